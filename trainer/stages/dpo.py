"""Direct preference optimisation (DPO) and its variants.

Each step scores both replies of B preference pairs under the policy and under a reference
model, and lowers a loss of the log-ratios log πθ(y|x) − log πref(y|x) of the chosen and the
rejected reply (Rafailov et al. 2023, arXiv:2305.18290; the loss types are pure functions in
`trainer.algorithms.preference.dpo_loss`). Log-probs are summed over completion tokens only; prompts are
context. The loss of one optimizer step is the mean over all its pairs (all accumulated
micro-batches), so gradient accumulation gives the same update as one large batch.

The reference is, in order of precedence: nothing for the reference-free `simpo`; an explicit
checkpoint (`ref_model`); with LoRA, the policy itself with its adapters disabled (the base
model, no second copy in memory); otherwise a frozen copy of the starting policy. With
`precompute_ref_log_probs` the reference scores every pair once before training and is then
freed; the scores are kept in memory by pair index and saved in each step checkpoint's
training state, so a resumed run uses the very same numbers.

Departures from TRL 1.16's DPOTrainer, all for speed or exactness: chosen and rejected rows go
through one concatenated forward (as TRL) but the LM head runs only at completion positions
(`trainer.algorithms.logprobs.target_logits`; TRL's fused head scores every position on CPU); the
reference forward runs under `torch.inference_mode`; `padding_free` packs the 2B sequences
into rows of `max_length` with restarting position ids (TRL 1.16 has switched its
padding-free mode off); prompt and reply are tokenized separately (TRL tokenizes them joined
and splits where the token sequences diverge), so the completion boundary is exact; the
prompt is left-truncated to `max_prompt_length` before `max_length` applies to the reply
(TRL 1.16 cuts the joined sequence from the end).

Read top to bottom: data, batches, reference, loss, the stage. The options are `DPOConfig` in
`trainer/config/dpo_config.py`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.algorithms.logprobs import TargetLM, log_probs_and_stats, sequence_sums, target_logits
from trainer.algorithms.preference import dpo_loss
from trainer.config.dpo_config import DPOConfig
from trainer.data.formatting import lay_out_rows
from trainer.data.preferences import TokenizedPairs, tokenize_dpo_pairs
from trainer.data.sources import describe_datasets, load_train_eval
from trainer.engine import distributed
from trainer.engine.loop import total_steps
from trainer.engine.models import (
    apply_lora,
    count_parameters,
    disable_dropout,
    eval_mode,
    load_causal_lm,
    model_and_tokenizer,
    resolve_model_path,
)
from trainer.engine.runner import StageRunner, layouts_agree, score_both_layouts, to_device
from trainer.errors import ConfigError

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Data


def load_split(rows, name: str, tokenizer, config: DPOConfig) -> TokenizedPairs:
    """Pairs of a dataset (errors name the missing columns; identical pairs dropped), tokenized into the
    tokenized-data cache."""
    return tokenize_dpo_pairs(rows, tokenizer, name, config.max_length, config.prompt_limit, config.truncation_mode,
                              config.dataset_num_proc)


# ----------------------------------------------------------------------------------------------
# Batches


@dataclass
class DPOBatch:
    """B pairs as 2B sequences: 0..B-1 are prompt + chosen, B..2B-1 prompt + rejected.

    Padded (the default), sequence s is row s, right-padded to the longest row. Padding-free,
    the sequences are packed into fewer rows of at most `max_length` tokens with position ids
    restarting per sequence and no attention mask; transformers then builds a block-diagonal
    causal mask, so no sequence attends to another.
    """

    input_ids: torch.Tensor  # [R, T]
    attention_mask: torch.Tensor | None  # [R, T] padded rows; None when packed
    position_ids: torch.Tensor | None  # [R, T] restarting per sequence when packed; None when padded
    completion_mask: torch.Tensor  # [R, T] 1 on completion tokens (the log-prob targets)
    sequence: torch.Tensor  # [R, T] which of the 2B sequences each position belongs to (-1 = padding)
    pairs: torch.Tensor  # [B] index of each pair in its TokenizedPairs

    @property
    def num_pairs(self) -> int:
        return self.pairs.numel()

    @property
    def num_tokens(self) -> int:
        return int((self.sequence >= 0).sum())


def collate(data: TokenizedPairs, indices: list[int], pad_id: int, pack_to: int = 0) -> DPOBatch:
    """Pad to the longest sequence of this batch (not to `max_length`), or with `pack_to` > 0 pack
    the sequences into rows of at most `pack_to` tokens (best fit, longest first).

    A sequence's first token is never a target (in a packed row it would be predicted from the
    previous sequence), whether packed or not, so both layouts score the same tokens.
    """
    tokens = [data.pair(i) for i in indices]
    sequences = [(p.prompt, p.chosen) for p in tokens] + [(p.prompt, p.rejected) for p in tokens]
    seqs = [prompt + reply for prompt, reply in sequences]
    masks = [[0] * max(len(prompt), 1) + [1] * (len(reply) - (not prompt)) for prompt, reply in sequences]
    layout = lay_out_rows(seqs, pad_id, pack_to)
    completion = layout.spread(masks)
    pairs = torch.tensor(indices, dtype=torch.long)
    if pack_to:
        return DPOBatch(layout.input_ids, None, layout.position_ids, completion, layout.sequence, pairs)
    return DPOBatch(layout.input_ids, (layout.sequence >= 0).long(), None, completion, layout.sequence, pairs)


@dataclass
class SequenceLogps:
    """Per-sequence sums over completion tokens of one forward pass over a DPOBatch."""

    logps: torch.Tensor  # [2B] summed token log-probs
    lengths: torch.Tensor  # [2B] completion tokens scored
    logit_sums: torch.Tensor | None  # [2B] sum over tokens of the vocabulary-mean logit (detached; TRL logits/*)


def sequence_logps(model, batch: DPOBatch, with_logits: bool = True) -> SequenceLogps:
    """One forward over all 2B sequences; the LM head runs only where a completion token is predicted."""
    out = target_logits(model, batch.input_ids, batch.completion_mask, batch.attention_mask, batch.position_ids)
    token_logps, row = log_probs_and_stats(out.logits, out.targets, ("mean",) if with_logits else ())  # [N]
    owner = batch.sequence[out.rows, out.cols]  # [N]
    num = 2 * batch.num_pairs
    lengths = sequence_sums(torch.ones_like(token_logps.detach()), owner, num)
    logit_sums = sequence_sums(row["mean"], owner, num) if with_logits else None
    return SequenceLogps(sequence_sums(token_logps, owner, num), lengths, logit_sums)


# ----------------------------------------------------------------------------------------------
# The reference


@dataclass
class Reference:
    """Where reference log-probs come from: a cache filled before training, or a frozen model.

    `model` is a frozen model, or the policy itself (as prepared: forwards go through the DDP /
    DeepSpeed wrapper) with the adapters of `adapters` (the PEFT model) disabled, i.e. its base
    model. `cache` maps a split ("train", "eval") to [num_pairs, 2] (chosen, rejected) sums.
    Reference-free loss types use an empty Reference and never call it.
    """

    model: Any = None
    adapters: Any = None
    cache: dict[str, torch.Tensor] = field(default_factory=dict)
    sharded: bool = False  # parameters sharded by DeepSpeed ZeRO-3

    def compute(self, batch: DPOBatch) -> torch.Tensor:
        """Reference log-probs of a batch's 2B sequences, [2B], without autograd."""
        adapters_off = self.adapters.disable_adapter() if self.adapters is not None else contextlib.nullcontext()
        # inference_mode is faster, but ZeRO-3 would gather parameters into inference tensors.
        with eval_mode(self.model), (torch.no_grad() if self.sharded else torch.inference_mode()), adapters_off:
            logps = sequence_logps(self.model, batch, with_logits=False).logps
        return logps.clone()  # a normal tensor: inference tensors cannot join the policy's graph

    def logps(self, batch: DPOBatch, split: str) -> torch.Tensor:
        if split in self.cache:
            pair = self.cache[split][batch.pairs.cpu()].to(batch.input_ids.device)  # [B, 2]
            return torch.cat([pair[:, 0], pair[:, 1]])
        return self.compute(batch)

    def precompute(self, run: StageRunner, data: TokenizedPairs, split: str, batch_size: int, pad_id: int,
                   pack_to: int) -> None:
        """Score every pair once: each rank its contiguous share, gathered in data order."""
        from accelerate.utils import gather_object

        scores: list[list[float]] = []
        for part in run.rank_slice(len(data), batch_size):
            batch = to_device(collate(data, list(part or range(1)), pad_id, pack_to), run.device)
            with run.accelerator.autocast():
                pair = self.compute(batch).view(2, -1).T  # [B, 2]; an empty share still runs a forward (ZeRO-3)
            scores += pair.tolist() if len(part) else []
        if run.world > 1:
            scores = sum(gather_object([scores]), [])
        self.cache[split] = torch.tensor(scores, dtype=torch.float32)


def freeze(model):
    model.eval()
    model.requires_grad_(False)
    return model


def packing_is_exact(model, data: TokenizedPairs, pad_id: int, pack_to: int, device="cpu") -> bool:
    """Whether `model` scores packed sequences as it scores padded ones, i.e. its attention builds
    the block-diagonal mask from restarting position ids (transformers' models do; some
    remote-code models do not, and would let packed sequences attend to each other); see `layouts_agree`."""
    padded, packed = score_both_layouts(model, lambda m, batch: sequence_logps(m, batch, with_logits=False), collate,
                                        data, pad_id, pack_to, device)
    return layouts_agree(model, padded.logps, packed.logps, int(padded.lengths.sum()),
                         "Training on padded batches.")


def reference_model(config: DPOConfig, model_path: str, policy, fresh_start: bool) -> tuple[Any, bool]:
    """(model, adapters_off) to score the reference with; see the module docstring for the order."""
    load = dict(dtype=config.dtype, trust_remote_code=config.trust_remote_code)
    if config.ref_model:
        ref = freeze(load_causal_lm(resolve_model_path(config.ref_model), **load))
    elif config.lora_r:
        return policy, True
    elif config.precompute_ref_log_probs and fresh_start:
        return policy, False  # before its first step the policy is the starting model; no copy needed
    else:
        ref = freeze(load_causal_lm(model_path, **load))
    if config.disable_dropout:
        disable_dropout(ref)
    return ref, False


# ----------------------------------------------------------------------------------------------
# Loss and metrics


def pair_loss(model, batch: DPOBatch, ref_logps: torch.Tensor | None,
              config: DPOConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean loss over the batch's pairs and summed statistics (divide by pairs or tokens to log)."""
    policy = sequence_logps(model, batch)
    b = batch.num_pairs
    ref_chosen, ref_rejected = (ref_logps[:b], ref_logps[b:]) if ref_logps is not None else (None, None)
    loss, stats = dpo_loss(policy.logps[:b], policy.logps[b:], ref_chosen, ref_rejected,
                           loss_type=config.loss_type, beta=config.beta, label_smoothing=config.label_smoothing,
                           chosen_lengths=policy.lengths[:b], rejected_lengths=policy.lengths[b:],
                           simpo_gamma=config.simpo_gamma)
    logps = policy.logps.detach()
    sums = {key: float(stats[key]) * b for key in
            ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")}
    sums.update({
        "loss": float(loss.detach()) * b,
        "logps/chosen": float(logps[:b].sum()), "logps/rejected": float(logps[b:].sum()),
        "logits/chosen": float(policy.logit_sums[:b].sum()), "logits/rejected": float(policy.logit_sums[b:].sum()),
        "tokens/chosen": float(policy.lengths[:b].sum()), "tokens/rejected": float(policy.lengths[b:].sum()),
        "pairs": float(b),
    })
    return loss, sums


def metric_means(sums: dict[str, float]) -> dict[str, float]:
    """Per-pair means, except logits/* which are per completion token (TRL's definition)."""
    out = {k: v / sums["pairs"] for k, v in sums.items() if not k.startswith(("logits/", "tokens/", "pairs"))}
    for side in ("chosen", "rejected"):
        out[f"logits/{side}"] = sums[f"logits/{side}"] / max(sums[f"tokens/{side}"], 1.0)
    return out


def add_sums(total: dict[str, float], sums: dict[str, float]) -> None:
    for key, value in sums.items():
        total[key] = total.get(key, 0.0) + value


@torch.no_grad()
def evaluate(run: StageRunner, data: TokenizedPairs, reference: Reference, pad_id: int, pack_to: int) -> dict[str, float]:
    """The metrics over the whole eval set; each rank scores its share, the sums cross ranks."""
    config = run.config
    run.module.eval()
    total: dict[str, float] = {}
    for part in run.rank_slice(len(data), run.config.eval_batch_size):
        batch = to_device(collate(data, list(part or range(1)), pad_id, pack_to), run.device)
        with run.accelerator.autocast():
            ref = None if config.reference_free else reference.logps(batch, "eval")
            sums = pair_loss(run.model, batch, ref, config)[1]  # an empty share still runs a forward (ZeRO-3)
        add_sums(total, {k: v * bool(len(part)) for k, v in sums.items()})
    run.module.train()
    return {f"eval_{k}": v for k, v in metric_means(run.sum_over_ranks(total)).items()}


# ----------------------------------------------------------------------------------------------
# The stage


def train_step(run: StageRunner, data: TokenizedPairs, reference: Reference, pad_id: int,
               pack_to: int) -> dict[str, float]:
    """One optimizer step over this rank's share of the step's pairs; returns the step's metrics."""
    config = run.config
    step = run.state.global_step + 1
    micro = [(collate(data, part.indices, pad_id, pack_to), part.weight) for part in run.rank_batches(len(data), step)]
    step_pairs = run.sum_over_ranks({"n": sum(w * b.num_pairs for b, w in micro)})["n"]
    sums: dict[str, float] = {}
    for i, (batch, weight) in enumerate(micro):
        batch = to_device(batch, run.device)
        with run.micro_batch(last=i == len(micro) - 1):
            ref = None if config.reference_free else reference.logps(batch, "train")
            loss, batch_sums = pair_loss(run.model, batch, ref, config)
            # The loss is a mean over the step's pairs on all ranks (x world size: gradients are averaged).
            run.backward(loss * (weight * batch.num_pairs / step_pairs * run.world))
        add_sums(sums, {**{k: v * weight for k, v in batch_sums.items()}, "tokens": weight * batch.num_tokens})
    grad_norm = run.optimizer_step()
    sums = run.sum_over_ranks(sums)
    run.state.global_step = step
    run.state.num_tokens += int(sums.pop("tokens"))
    return {**metric_means(sums), "grad_norm": grad_norm}


def prepare_reference(run: StageRunner, model_path: str, train_data: TokenizedPairs, splits: dict,
                      pad_id: int, pack_to: int) -> Reference:
    """The reference: restored scores, precomputed scores (sharded over ranks), or a model scoring every batch."""
    config = run.config
    reference = Reference(sharded=run.runtime["zero_stage"] == 3)
    if config.precompute_ref_log_probs:
        saved = run.state.extra.get("ref_logps", {})  # from the checkpoint; recomputed if the data changed since
        reference.cache = {k: torch.tensor(v) for k, v in saved.items() if k in splits and len(v) == len(splits[k])}
    if config.reference_free or set(reference.cache) == set(splits):
        return reference
    model, adapters_off = reference_model(config, model_path, run.module, not run.resume)
    if model is run.module:  # the policy itself (LoRA adapters off, or before its first step)
        reference.model, reference.adapters = run.model, run.module if adapters_off else None
    else:
        # (Under ZeRO-3 it loaded sharded, and cannot run before DeepSpeed wraps it; there it is
        # trusted to be of the policy's kind, whose packing was checked.)
        if pack_to and run.runtime["zero_stage"] != 3 and not packing_is_exact(model, train_data, pad_id, pack_to):
            raise ConfigError(f"The reference model {config.ref_model!r} mixes packed sequences (its attention does "
                              "not follow restarting position ids); set `padding_free false`.")
        reference.model = distributed.prepare_reference(run.accelerator, TargetLM(model))
    if config.precompute_ref_log_probs:
        started = time.perf_counter()
        batch_size = config.precompute_ref_batch_size or 2 * config.per_device_batch_size
        for split, data in splits.items():
            if split not in reference.cache:
                reference.precompute(run, data, split, batch_size, pad_id, pack_to)
        reference.model = None  # training needs only the scores
        run.state.extra["ref_logps"] = {k: v.tolist() for k, v in reference.cache.items()}
        log.info("Reference log-probs of %s ready in %.1fs.", " and ".join(splits), time.perf_counter() - started)
    return reference


def run_dpo(config: DPOConfig) -> str:
    """Train, checkpoint and save; returns `config.output_dir` (holding the final model).

    Under `accelerate launch` (or `alignflow train dpo --num_processes N`) every process runs it as one rank.
    """
    run = StageRunner("dpo", config)

    # 1. Data, validated before any model is loaded.
    model_path, tokenizer = model_and_tokenizer(config)
    rows, eval_rows = load_train_eval(config)
    # One process per node tokenizes into the shared cache; the others then map the files it wrote.
    with run.accelerator.local_main_process_first():
        train_data = load_split(rows, config.dataset, tokenizer, config)
        eval_data = load_split(eval_rows, config.eval_dataset or "eval split", tokenizer, config) if eval_rows else None
    splits = {"train": train_data, **({"eval": eval_data} if eval_data else {})}
    steps = total_steps(config, len(train_data), run.world)
    data_runtime = time.perf_counter() - run.started
    log.info("DPO: %d pairs, %d optimizer steps, loss_type=%s.", len(train_data), steps, config.loss_type)

    # 2. Policy, optimizer, schedule; restored from a checkpoint when resuming.
    resume = run.resume_checkpoint(model_path, rows)
    model = load_causal_lm(resume or model_path, config.dtype, config.trust_remote_code,
                           config.gradient_checkpointing, trainable_adapter=bool(resume and config.lora_r))
    if config.lora_r and not resume:
        model = apply_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules)
    if config.disable_dropout:
        disable_dropout(model)
    model.train()
    trainable, total = count_parameters(model)
    log.info("Model %s: %.2fM parameters, %.2fM trainable.", config.model, total / 1e6, trainable / 1e6)
    with run.failing():
        run.prepare(model, tokenizer, steps, describe_datasets(config, rows, eval_rows, {"pairs": len(train_data)},
                                                    {"pairs": len(eval_data)} if eval_data is not None else None),
                    wrap=TargetLM)
        pad_id = tokenizer.pad_token_id
        pack_to = config.max_length if config.padding_free else 0
        if pack_to and not packing_is_exact(run.model_without_autocast(), train_data, pad_id, pack_to, run.device):
            pack_to, config.padding_free = 0, False  # so the manifest says what ran
        reference = prepare_reference(run, model_path, train_data, splits, pad_id, pack_to)

        # 3. The loop.
        evaluate_now = (lambda: evaluate(run, eval_data, reference, pad_id, pack_to)) if eval_data else None
        loop_started = time.perf_counter()
        while run.state.global_step < steps:
            run.end_step(train_step(run, train_data, reference, pad_id, pack_to), len(train_data), evaluate_now)
        loop_runtime = time.perf_counter() - loop_started

        # 4. Final evaluation and the model.
        run.final_evaluation(evaluate_now)
        run.last_metrics.update(data_runtime=data_runtime, loop_runtime=loop_runtime)
        return run.finish()
