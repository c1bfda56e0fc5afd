"""Reward model (RM): a scalar head trained with the Bradley–Terry loss on preference pairs.

The model is any causal LM or encoder loaded with `AutoModelForSequenceClassification`
(num_labels=1): a linear head on the last hidden states gives one reward per sequence, read at
the last non-pad token for causal LMs (hence `config.pad_token_id`) and at the pooled [CLS]
token for BERT-style encoders. Each step scores the chosen and the rejected text of B pairs in
one forward of 2B rows and lowers mean(−log σ(r_chosen − r_rejected − margin)), plus optionally
the centring term c·mean((r_chosen + r_rejected)²) (`trainer.algorithms.preference.bradley_terry_loss`, where
the formula and its references live). The loss of one optimizer step is the mean over all its
pairs (all accumulated micro-batches), so gradient accumulation gives the same update as one
large batch.

The text scored is prompt + reply, as in TRL's RewardTrainer, closed with the eos token when
the model reads its reward at the last token (`trainer.data.preferences.reward_texts`).
`trainer.rewards.scorer.RewardModelScorer` builds its inputs with the same function, so a checkpoint
scores GRPO completions exactly as it was trained.

Departures from TRL's RewardTrainer: pairs longer than `max_length` are truncated from the left
by default (keeping both replies and the latest turns of the prompt; the saved tokenizer keeps
that `truncation_side`), where TRL drops them (`truncation_mode=drop` does that here); chat and
text data alike get the eos rule above (TRL adds eos to text data only, and fails on tokenizers
without one, like BERT's).

Read top to bottom: config, batches, the stage (pairs are tokenized by `trainer.data.preferences`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

import torch

from trainer.algorithms.preference import bradley_terry_loss
from trainer.config.options import TrainConfig, option
from trainer.data.preferences import (
    TokenizedPairs,
    load_pairs,
    pad_right,
    read_margins,
    tokenize_reward_pairs,
)
from trainer.data.sources import describe_datasets, load_train_eval
from trainer.engine.loop import total_steps
from trainer.engine.models import (
    apply_lora,
    count_parameters,
    disable_dropout,
    load_reward_model,
    model_and_tokenizer,
)
from trainer.engine.runner import StageRunner, to_device
from trainer.errors import ConfigError, ModelError

log = logging.getLogger(__name__)


@dataclass
class RewardConfig(TrainConfig):
    """Reward-model training on preference pairs (Bradley–Terry)."""

    learning_rate: float = option(1e-4, "Peak learning rate (AdamW); TRL's RewardConfig default.")
    truncation_mode: Literal["keep_start", "keep_end", "drop"] = option(
        "keep_end", "Texts (prompt + reply) longer than `max_length`: `keep_end` cuts their start, so both replies "
                    "and the latest prompt turns stay; `keep_start` cuts their end (and may cut away the replies' "
                    "difference: such pairs are dropped); `drop` drops the pair, as TRL does. Counts are logged.")
    center_rewards_coefficient: float | None = option(
        None, "Weight c of the reward-centring term c·mean((r_chosen + r_rejected)²), which keeps rewards near 0 "
              "(Eisenstein et al. 2023, arXiv:2312.09244; TRL suggests 0.01). Unset = off.")
    disable_dropout: bool = option(True, "Set every dropout probability to 0, as TRL does for reward models (BERT-style "
                                         "encoders ship with 0.1, so chosen and rejected would see different masks).")

    stage = "reward"

    def validate(self) -> None:
        super().validate()
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            raise ConfigError(f"`center_rewards_coefficient` must be >= 0 (or unset), got "
                              f"{self.center_rewards_coefficient}.")


# ----------------------------------------------------------------------------------------------
# Batches


@dataclass
class PairBatch:
    """B pairs as one batch of 2B sequences: the chosen texts first, then the rejected ones."""

    input_ids: torch.Tensor  # [2B, T] right-padded
    attention_mask: torch.Tensor  # [2B, T]
    margin: torch.Tensor | None  # [B]

    @property
    def num_pairs(self) -> int:
        return self.input_ids.shape[0] // 2


def collate(data: TokenizedPairs, indices: list[int], pad_id: int) -> PairBatch:
    seqs = ([data.prompt_ids[i] + data.chosen_ids[i] for i in indices]
            + [data.prompt_ids[i] + data.rejected_ids[i] for i in indices])
    input_ids, attention = pad_right(seqs, pad_id)
    margin = torch.tensor([data.margins[i] for i in indices]) if data.margins is not None else None
    return PairBatch(input_ids, attention, margin)


def sequence_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One scalar reward per row. [N, T] -> [N] (float32)"""
    return model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1).float()


def pair_rewards(model, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of the chosen and the rejected texts, [B] each, from one forward of 2B rows."""
    chosen, rejected = sequence_rewards(model, batch.input_ids, batch.attention_mask).chunk(2)
    return chosen, rejected


@torch.no_grad()
def evaluate(run: StageRunner, data: TokenizedPairs, pad_id: int) -> dict[str, float]:
    """Loss and statistics over the whole eval set (not a mean of batch means); each rank scores its share."""
    from accelerate.utils import gather_object

    run.module.eval()
    chosen, rejected = [], []
    for part in run.rank_slice(len(data), run.config.eval_batch_size):
        batch = to_device(collate(data, list(part or range(1)), pad_id), run.device)
        with run.accelerator.autocast():
            c, r = pair_rewards(run.model, batch)  # an empty share still runs one forward (ZeRO-3)
        if len(part):
            chosen += c.tolist()
            rejected += r.tolist()
    run.module.train()
    if run.world > 1:  # shares are contiguous, so rank order is data order
        chosen, rejected = (sum(gather_object([x]), []) for x in (chosen, rejected))
    margin = torch.tensor(data.margins) if data.margins is not None else None
    loss, stats = bradley_terry_loss(torch.tensor(chosen), torch.tensor(rejected), margin,
                                     run.config.center_rewards_coefficient)
    return {"eval_loss": float(loss), **{f"eval_{k}": float(v) for k, v in stats.items()}}


def _score_head(model) -> str:
    """Name of the freshly initialised head that LoRA must train in full (`modules_to_save`)."""
    for name in ("score", "classifier"):  # causal LMs / encoders in transformers
        if isinstance(getattr(model, name, None), torch.nn.Module):
            return name
    raise ModelError(f"{type(model).__name__} has neither a `score` nor a `classifier` head; LoRA cannot "
                     "tell which module to train in full. Set `lora_r 0`.")


# ----------------------------------------------------------------------------------------------
# The stage


def train_step(run: StageRunner, data: TokenizedPairs, pad_id: int) -> dict[str, float]:
    """One optimizer step over this rank's share of the step's pairs; returns the step's metrics."""
    step = run.state.global_step + 1
    micro = [(collate(data, part.indices, pad_id), part.weight) for part in run.rank_batches(len(data), step)]
    step_pairs = run.sum_over_ranks({"n": sum(w * b.num_pairs for b, w in micro)})["n"]
    sums = dict.fromkeys(("loss", "accuracy", "margin", "mean_reward", "tokens"), 0.0)
    low, high = math.inf, -math.inf
    for i, (batch, weight) in enumerate(micro):
        with run.micro_batch(last=i == len(micro) - 1):
            chosen, rejected = pair_rewards(run.model, to_device(batch, run.device))
            loss, stats = bradley_terry_loss(chosen, rejected, batch.margin, run.config.center_rewards_coefficient)
            # Both terms of the loss are means over the micro-batch's pairs: weight by its share of
            # the step's pairs on all ranks (x world size: the ranks' gradients are averaged).
            share = weight * batch.num_pairs / step_pairs
            run.backward(loss * share * run.world)
        for key, value in (("loss", loss.detach()), *((k, stats[k]) for k in ("accuracy", "margin", "mean_reward"))):
            sums[key] += float(value) * share
        sums["tokens"] += weight * int(batch.attention_mask.sum())
        if weight:
            low, high = min(low, float(stats["min_reward"])), max(high, float(stats["max_reward"]))
    grad_norm = run.optimizer_step()
    sums = run.sum_over_ranks(sums)
    run.state.global_step = step
    run.state.num_tokens += int(sums.pop("tokens"))
    return {**sums, "min_reward": run.extreme_over_ranks(low, largest=False),
            "max_reward": run.extreme_over_ranks(high, largest=True), "grad_norm": grad_norm}


def run_reward(config: RewardConfig) -> str:
    """Train, checkpoint and save a reward model; returns `config.output_dir` (holding it).

    Under `accelerate launch` (or `alignflow train reward --num_processes N`) every process runs it as one rank.
    """
    run = StageRunner("reward", config)

    # 1. Data, validated before the model is loaded.
    model_path, tokenizer = model_and_tokenizer(config)
    # The saved tokenizer keeps the side, so scorers truncate as training did (save_pretrained
    # writes only attributes listed in init_kwargs).
    tokenizer.truncation_side = tokenizer.init_kwargs["truncation_side"] = (
        "left" if config.truncation_mode == "keep_end" else "right")
    rows, eval_rows = load_train_eval(config)

    def prepare(ds, name: str) -> TokenizedPairs:
        pairs, kept = load_pairs(ds, name, "reward", tokenizer)
        return tokenize_reward_pairs(pairs, read_margins(ds, kept, name), tokenizer, name, config.max_length,
                                     config.truncation_mode)

    train_data = prepare(rows, config.dataset)
    eval_data = prepare(eval_rows, config.eval_dataset or "eval split") if eval_rows is not None else None
    steps = total_steps(config, len(train_data), run.world)
    log.info("Reward model: %d pairs%s; %d optimizer steps.", len(train_data),
             f" ({len(eval_data)} held out)" if eval_data else "", steps)

    # 2. Model, optimizer, schedule; restored from a checkpoint when resuming.
    resume = run.resume_checkpoint(model_path, rows)
    model = load_reward_model(resume or model_path, tokenizer.pad_token_id, config.dtype, config.trust_remote_code,
                              config.gradient_checkpointing, trainable_adapter=bool(resume and config.lora_r))
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    longest = max(len(x) for data in (train_data, eval_data) if data for x in data.chosen_ids + data.rejected_ids)
    if positions and longest > positions:
        raise ConfigError(f"`max_length` is {config.max_length} and texts of {longest} tokens remain, but "
                          f"{config.model} has {positions} positions: pass --max_length {positions} or less.")
    if config.disable_dropout:
        disable_dropout(model)
    if config.lora_r and not resume:
        model = apply_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules,
                           task_type="SEQ_CLS", modules_to_save=[_score_head(model)])
    model.train()
    trainable, total = count_parameters(model)
    log.info("Model %s: %.2fM parameters, %.2fM trainable.", config.model, total / 1e6, trainable / 1e6)
    with run.failing():
        run.prepare(model, tokenizer, steps, describe_datasets(config, rows, eval_rows, {"pairs": len(train_data)},
                                                    {"pairs": len(eval_data)} if eval_data is not None else None))

        # 3. The loop.
        pad_id = tokenizer.pad_token_id
        evaluate_now = (lambda: evaluate(run, eval_data, pad_id)) if eval_data else None
        while run.state.global_step < steps:
            run.end_step(train_step(run, train_data, pad_id), len(train_data), evaluate_now)

        # 4. Final evaluation and the model.
        run.final_evaluation(evaluate_now)
        return run.finish()
