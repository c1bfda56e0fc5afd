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

With `padding_free` (on by default, off in TRL), each micro-batch's 2B sequences are packed without
padding, position ids restarting per sequence: on the CPU into one row whose sequence bounds reach the
attention (`trainer.engine.attention.per_sequence_attention`, which runs each apart), elsewhere into rows
of at most `max_length` tokens (best fit) with no attention mask, whose block-diagonal causal mask
transformers builds from the position ids. The backbone runs over the packed row(s), and the head only
at each sequence's reward token (`sequence_rewards`): the last one for causal LMs, the pooled first one
for BERT-style encoders (one row only: without the bounds their attention would mix the texts). An encoder's
top layer then runs its feed-forward block and attention output at the first tokens alone, their queries
attending over their whole texts (`encode_first_tokens`). Same rewards as padded rows up to float rounding,
less compute when lengths vary. A check before training scores a few pairs both ways, and a model whose
packed rewards differ trains padded, with a warning.

Read top to bottom: batches, the stage (pairs are tokenized by `trainer.data.preferences`). The options
are `RewardConfig` in `trainer/config/reward_config.py`.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.algorithms.preference import bradley_terry_loss
from trainer.config.reward_config import RewardConfig
from trainer.data.formatting import ROW_MULTIPLE, lay_out_rows
from trainer.data.preferences import TokenizedPairs, tokenize_reward_pairs
from trainer.data.sources import describe_datasets, load_train_eval
from trainer.engine.attention import attention_at, packed_row_kwargs
from trainer.engine.loop import total_steps
from trainer.engine.models import (
    apply_lora,
    count_parameters,
    disable_dropout,
    load_reward_model,
    model_and_tokenizer,
)
from trainer.engine.runner import StageRunner, score_both_layouts, to_device
from trainer.errors import ConfigError, ModelError

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Batches


@dataclass
class PairBatch:
    """B pairs as 2B sequences: 0..B-1 the chosen texts, B..2B-1 the rejected ones.

    Padded, sequence s is row s, right-padded to the longest. Padding-free, the sequences are packed
    into one row with their `bounds`, or into fewer rows of at most `max_length` tokens, with position
    ids restarting per sequence and no attention mask (transformers then builds a block-diagonal causal
    mask); `last` and `first` say where each sequence's reward is read (causal LMs, encoders).
    """

    input_ids: torch.Tensor  # [R, T]
    attention_mask: torch.Tensor | None  # [R, T] padded rows; None when packed
    position_ids: torch.Tensor | None  # [R, T] restarting per sequence when packed; None when padded
    last: torch.Tensor | None  # [2B, 2] (row, column) of each sequence's last non-pad token when packed; else None
    first: torch.Tensor | None  # [2B, 2] (row, column) of each sequence's first token when packed; else None
    margin: torch.Tensor | None  # [B]
    num_pairs: int
    num_tokens: int  # real tokens, padding excluded
    bounds: torch.Tensor | None = None  # [2B + 1] cumulative lengths when one row holds all the sequences


def collate(data: TokenizedPairs, indices: list[int], pad_id: int, pack_to: int = 0,
            one_row: bool = False) -> PairBatch:
    """Pad to the longest sequence of this batch, or with `pack_to` > 0 pack the sequences into one row
    (`one_row`, with their `bounds`) or into rows of at most `pack_to` tokens (best fit, longest first).

    A packed sequence's reward is read where a padded row's is: transformers takes the last token
    that is not `pad_id` (so where pad == eos, the token before a final eos, as in TRL), or an
    encoder's first token.
    """
    tokens = [data.pair(i) for i in indices]
    seqs = [p.prompt + p.chosen for p in tokens] + [p.prompt + p.rejected for p in tokens]
    num_tokens = sum(len(s) for s in seqs)
    one_row = bool(pack_to and one_row)
    layout = lay_out_rows(seqs, pad_id, num_tokens if one_row else pack_to, ROW_MULTIPLE if one_row else 1)
    margin = torch.tensor([data.margins[i] for i in indices]) if data.margins is not None else None
    if pack_to:
        last = torch.stack([layout.row, layout.start + torch.tensor([_last_non_pad(s, pad_id) for s in seqs])], 1)
        # The padding at the row's end is a sequence of its own.
        bounds = torch.tensor(sorted({*layout.start.tolist(), num_tokens, layout.input_ids.shape[1]})) \
            if one_row else None
        return PairBatch(layout.input_ids, None, layout.position_ids, last, torch.stack([layout.row, layout.start], 1),
                         margin, len(indices), num_tokens, bounds)
    return PairBatch(layout.input_ids, (layout.sequence >= 0).long(), None, None, None, margin, len(indices),
                     num_tokens)


@dataclass(frozen=True)
class Layout:
    """`collate`'s padding and packing arguments, fixed for a run: `pack_to` 0 pads each micro-batch."""

    pad_id: int
    pack_to: int = 0
    one_row: bool = False

    def collate(self, data: TokenizedPairs, indices: list[int]) -> PairBatch:
        return collate(data, indices, self.pad_id, self.pack_to, self.one_row)


def _last_non_pad(ids: list[int], pad_id: int) -> int:
    """Index of the last token that is not `pad_id` (0 if none), as transformers' sequence classifiers find it."""
    return next((j for j in reversed(range(len(ids))) if ids[j] != pad_id), 0)


def packed_parts(model) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor], bool]:
    """What `padding_free` runs apart, through a PEFT wrapper: (backbone, head, reads_first). The head maps the
    hidden states of the reward tokens [S, H] to rewards [S, 1]: a causal LM's `score` (at the last token), or a
    BERT-style encoder's pooler (when it has one), dropout and `classifier` (at the first token)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(lm, getattr(lm, "base_model_prefix", ""), None)
    if isinstance(backbone, torch.nn.Module) and backbone is not lm \
            and not getattr(lm.config, "is_encoder_decoder", False):
        if isinstance(score := getattr(lm, "score", None), torch.nn.Module):
            return backbone, score, False
        classifier, pooler = getattr(lm, "classifier", None), getattr(backbone, "pooler", None)
        if isinstance(classifier, torch.nn.Module) and not lm.config.is_decoder:
            if pooler is None:  # RoBERTa-style: the classifier reads position 0 of [S, T, H] itself
                return backbone, lambda h: classifier(h[:, None]), True
            dropout = getattr(lm, "dropout", torch.nn.Identity())
            return backbone, lambda h: classifier(dropout(pooler(h[:, None]))), True
    raise ModelError(f"`padding_free` reads each packed text's reward through the backbone and a `score` head "
                     f"(causal LMs) or a `classifier` (encoders); {type(lm).__name__} has neither.")


def sequence_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None = None, last: torch.Tensor | None = None,
                     first: torch.Tensor | None = None, bounds: torch.Tensor | None = None) -> torch.Tensor:
    """One scalar reward per sequence (float32). Padded rows [2B, T] -> [2B]: the model's own forward, which
    reads each row at its last non-pad token (causal LMs) or its first (encoders). Packed rows [R, T] -> [2B]:
    the backbone over the rows (with the sequences' `bounds` when one row holds them all), then the head at
    `last` or `first` [2B, 2] (per position: the same numbers as the model's own forward)."""
    if isinstance(model, PackedRewards) or isinstance(getattr(model, "module", None), PackedRewards):
        # Prepared by accelerate (DDP, DeepSpeed): through the wrapper's forward, where its hooks live.
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, last=last,
                     first=first, bounds=bounds)
    if position_ids is None:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1).float()
    backbone, head, reads_first = packed_parts(model)
    if reads_first and bounds is not None and top_layer_runs_apart(backbone):
        return head(encode_first_tokens(backbone, input_ids, position_ids, bounds, first[:, 1])).squeeze(-1).float()
    # No cache: transformers finds packed sequences in the position ids only without one.
    kwargs = packed_row_kwargs(bounds) if bounds is not None else {}
    if not reads_first:
        kwargs["use_cache"] = False
    hidden = backbone(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state  # [R, T, H]
    at = first if reads_first else last
    return head(hidden[at[:, 0], at[:, 1]]).squeeze(-1).float()  # [2B]


def top_layer_runs_apart(backbone) -> bool:
    """Whether `backbone` is a BERT-style encoder (BERT, RoBERTa, MiniLM, ...: `embeddings`, then `encoder.layer`,
    each with `attention.self`'s query, key and value, `attention.output` and `feed_forward_chunk`) whose top layer
    `encode_first_tokens` can run at the first tokens alone."""
    layers = getattr(getattr(backbone, "encoder", None), "layer", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers) or not hasattr(backbone, "embeddings"):
        return False
    top = layers[-1]
    attention = getattr(top, "attention", None)
    projections = [getattr(getattr(attention, "self", None), name, None) for name in ("query", "key", "value")]
    return (all(isinstance(p, torch.nn.Module) for p in projections) and hasattr(attention.self, "attention_head_size")
            and hasattr(attention, "output") and hasattr(top, "feed_forward_chunk")
            and not getattr(top, "is_decoder", True) and not hasattr(top, "crossattention")
            and getattr(backbone.config, "position_embedding_type", "absolute") == "absolute")


def encode_first_tokens(backbone, input_ids: torch.Tensor, position_ids: torch.Tensor, bounds: torch.Tensor,
                        at: torch.Tensor) -> torch.Tensor:
    """An encoder's last hidden states at row positions `at` [S] of one packed row (`bounds`), [S, H]: the layers
    below the top over the whole row, as the backbone's own forward runs them, and the top layer only where the
    reward is read. There its queries, attention output and feed-forward block run for the S first tokens instead
    of all N, while its keys and values still cover every token (each first token attends to its whole text). The
    same numbers as the whole row's top layer at those positions, up to float rounding; for MiniLM's six layers,
    about a seventh of the step's GEMMs saved."""
    *lower, top = backbone.encoder.layer
    hidden = backbone.embeddings(input_ids=input_ids, position_ids=position_ids)  # [1, N, H]
    kwargs = packed_row_kwargs(bounds)
    for layer in lower:
        hidden = layer(hidden, None, position_ids=position_ids, **kwargs)
    attention = top.attention.self
    x = hidden[:, at]  # [1, S, H]

    def heads(states: torch.Tensor) -> torch.Tensor:  # [1, n, H] -> [1, heads, n, D]
        return states.unflatten(-1, (-1, attention.attention_head_size)).transpose(1, 2)

    context = attention_at(heads(attention.query(x)), heads(attention.key(hidden)), heads(attention.value(hidden)),
                           at, bounds, attention.dropout.p if attention.training else 0.0,
                           getattr(attention, "scaling", attention.attention_head_size ** -0.5))
    return top.feed_forward_chunk(top.attention.output(context.flatten(2), x))[0]


class PackedRewards(torch.nn.Module):
    """A reward model whose forward is `sequence_rewards`: the module handed to `accelerate.prepare` with
    `padding_free`. Packed rows run the backbone and the head apart, which would bypass DDP's gradient
    all-reduce and DeepSpeed ZeRO-3's parameter gathering (both rooted at the prepared module's forward);
    wrapped, they keep both. `rm` is the model itself (saved as usual through `StageRunner.module`)."""

    def __init__(self, rm: torch.nn.Module) -> None:
        super().__init__()
        self.rm = rm
        self.config = rm.config  # accelerate sizes DeepSpeed's "auto" buckets from it

    @property
    def dtype(self) -> torch.dtype:
        return self.rm.dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, last: torch.Tensor | None = None,
                first: torch.Tensor | None = None, bounds: torch.Tensor | None = None) -> torch.Tensor:
        return sequence_rewards(self.rm, input_ids, attention_mask, position_ids, last, first, bounds)


def pair_rewards(model, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of the chosen and the rejected texts, [B] each, from one forward over the batch's rows."""
    rewards = sequence_rewards(model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.last,
                               batch.first, batch.bounds)
    chosen, rejected = rewards.chunk(2)
    return chosen, rejected


def packing_is_exact(model, data: TokenizedPairs, layout: Layout, device="cpu") -> bool:
    """Whether `model` scores packed texts (laid out as `layout` packs them) as it scores them padded,
    i.e. its attention keeps packed texts apart (through their bounds in one row, or the restarting position ids;
    some remote-code models follow neither). Logs a warning when not: the run then trains padded."""
    padded, packed = score_both_layouts(model, lambda m, batch: torch.cat(pair_rewards(m, batch)),
                                        functools.partial(collate, one_row=layout.one_row), data,
                                        layout.pad_id, layout.pack_to, device)
    error = float((padded - packed).abs().max() / padded.abs().max().clamp(min=1e-6))
    tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
    if error > tolerance:
        inner = getattr(model, "module", model)
        log.warning("padding_free is off: %s scores packed texts differently from padded ones (relative error "
                    "%.3g), so its attention does not keep them apart. Training on padded batches.",
                    type(getattr(inner, "rm", inner)).__name__, error)
    return error <= tolerance


@torch.no_grad()
def evaluate(run: StageRunner, data: TokenizedPairs, layout: Layout) -> dict[str, float]:
    """Loss and statistics over the whole eval set (not a mean of batch means); each rank scores its share."""
    from accelerate.utils import gather_object

    run.module.eval()
    chosen, rejected = [], []
    for part in run.rank_slice(len(data), run.config.eval_batch_size):
        batch = to_device(layout.collate(data, list(part or range(1))), run.device)
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


def train_step(run: StageRunner, data: TokenizedPairs, layout: Layout) -> dict[str, float]:
    """One optimizer step over this rank's share of the step's pairs, laid out by `layout`; returns the step's
    metrics."""
    step = run.state.global_step + 1
    micro = [(layout.collate(data, part.indices), part.weight)
             for part in run.rank_batches(len(data), step)]
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
        sums["tokens"] += weight * batch.num_tokens
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
        return tokenize_reward_pairs(ds, tokenizer, name, config.max_length, config.truncation_mode,
                                     config.dataset_num_proc)

    # One process per node tokenizes into the shared cache; the others then map the files it wrote.
    with run.accelerator.local_main_process_first():
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
    longest = max(data.longest() for data in (train_data, eval_data) if data)
    if positions and longest > positions:
        raise ConfigError(f"`max_length` is {config.max_length} and texts of {longest} tokens remain, but "
                          f"{config.model} has {positions} positions: pass --max_length {positions} or less.")
    if config.padding_free:
        try:
            packed_parts(model)
        except ModelError as error:
            log.warning("padding_free is off: %s Training on padded batches.", error)
            config.padding_free = False  # so the manifest says what ran
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
                                                    {"pairs": len(eval_data)} if eval_data is not None else None),
                    wrap=PackedRewards if config.padding_free else None)
        layout = Layout(tokenizer.pad_token_id, config.max_length if config.padding_free else 0,
                        one_row=run.one_row)
        if layout.pack_to and not packing_is_exact(run.model_without_autocast(), train_data, layout, run.device):
            layout, config.padding_free = Layout(layout.pad_id), False  # so the manifest says what ran

        # 3. The loop.
        evaluate_now = (lambda: evaluate(run, eval_data, layout)) if eval_data else None
        while run.state.global_step < steps:
            run.end_step(train_step(run, train_data, layout), len(train_data), evaluate_now)

        # 4. Final evaluation and the model.
        run.final_evaluation(evaluate_now)
        return run.finish()
