"""Direct preference optimisation (DPO) and its variants.

Each step scores both replies of B preference pairs under the policy and under a reference
model, and lowers a loss of the log-ratios log πθ(y|x) − log πref(y|x) of the chosen and the
rejected reply (Rafailov et al. 2023, arXiv:2305.18290; the loss types are pure functions in
`trainer.losses.dpo_loss`). Log-probs are summed over completion tokens only; prompts are
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
(`trainer.logprobs.target_logits`; TRL's fused head scores every position on CPU); the
reference forward runs under `torch.inference_mode`; `padding_free` packs the 2B sequences
into rows of `max_length` with restarting position ids (TRL 1.16 has switched its
padding-free mode off); prompt and reply are tokenized separately (TRL tokenizes them joined
and splits where the token sequences diverge), so the completion boundary is exact; the
prompt is left-truncated to `max_prompt_length` before `max_length` applies to the reply
(TRL 1.16 cuts the joined sequence from the end).

Read top to bottom: config, data, batches, reference, loss, the stage.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from trainer import checkpoint as ckpt
from trainer.config import ConfigError, TrainConfig, option
from trainer.data import (
    describe_datasets,
    is_conversational,
    load_rows,
    pack_best_fit,
    split_eval,
)
from trainer.logprobs import selective_log_softmax, sequence_sums, target_logits
from trainer.loop import (
    MetricWindow,
    Progress,
    build_optimizer,
    build_scheduler,
    clip_and_step,
    set_seed,
    step_batches,
    total_steps,
)
from trainer.losses import dpo_loss
from trainer.models import (
    apply_lora,
    count_parameters,
    disable_dropout,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)
from trainer.preferences import TokenizedPairs, load_pairs, tokenize_dpo_pairs
from trainer.storage import fetch_to_local, is_remote

log = logging.getLogger(__name__)

REFERENCE_FREE = ("simpo",)


@dataclass
class DPOConfig(TrainConfig):
    """Direct preference optimisation on `prompt`/`chosen`/`rejected` pairs (text or chat)."""

    learning_rate: float = option(1e-6, "Peak learning rate (AdamW). TRL's DPO default; small models and LoRA "
                                        "usually want more.")
    beta: float = option(0.1, "Strength of the tie to the reference: higher keeps the policy closer "
                              "(β of https://arxiv.org/abs/2305.18290; τ of IPO; β of SimPO).")
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "apo_zero", "simpo"] = option(
        "sigmoid", "Preference loss: sigmoid (DPO), ipo (https://arxiv.org/abs/2310.12036), hinge (SLiC, "
                   "https://arxiv.org/abs/2305.10425), robust (https://arxiv.org/abs/2403.00409), apo_zero "
                   "(https://arxiv.org/abs/2408.06266), or simpo (reference-free, https://arxiv.org/abs/2405.14734).")
    label_smoothing: float = option(0.0, "For `robust` (and `simpo`): assumed probability that a preference label is "
                                         "flipped, in [0, 0.5). Must be 0 for the other loss types.")
    simpo_gamma: float = option(0.5, "SimPO's target reward margin γ (only with loss_type=simpo).")
    max_prompt_length: int = option(0, "Longest prompt, in tokens; longer prompts lose their start (left truncation). "
                                       "Below `max_length`; the reply gets the rest. 0 = half of `max_length`.")
    ref_model: str | None = option(None, "Reference model checkpoint (folder, s3:// prefix or hub id). Default: a frozen "
                                         "copy of `model`, or with LoRA the base model with adapters disabled.")
    precompute_ref_log_probs: bool = option(False, "Score every pair under the reference once before training and free "
                                                   "the reference model (saves memory and a forward per step).")
    precompute_ref_batch_size: int = option(0, "Pairs per forward when precomputing reference log-probs "
                                               "(0 = 2 x `per_device_batch_size`).")
    padding_free: bool = option(True, "Pack each batch's sequences into rows of at most `max_length` tokens instead of "
                                      "padding every sequence to the longest; position ids restart per sequence, so none "
                                      "attends to another. Same result, less compute. Checked on the first batch: a model "
                                      "whose attention mixes packed sequences falls back to padding, with a warning.")
    disable_dropout: bool = option(True, "Turn off dropout in the policy and reference, as TRL does, so that policy and "
                                         "reference agree exactly at the start.")

    stage = "dpo"

    def validate(self) -> None:
        super().validate()
        if self.beta <= 0:
            raise ConfigError(f"`beta` must be > 0, got {self.beta}.")
        if self.label_smoothing and self.loss_type not in ("robust", "simpo"):
            raise ConfigError(f"`label_smoothing` is only used by loss_type robust and simpo; set it to 0 for "
                              f"loss_type {self.loss_type} (got {self.label_smoothing}).")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"`label_smoothing` must be in [0, 0.5), got {self.label_smoothing}.")
        if self.max_length < 2:
            raise ConfigError(f"`max_length` must be >= 2 (a prompt token and a reply token), got {self.max_length}.")
        if not 0 <= self.max_prompt_length < self.max_length:
            raise ConfigError(f"`max_prompt_length` must be below `max_length` ({self.max_length}) so that replies "
                              f"keep at least one token (0 = half of it); got {self.max_prompt_length}.")
        if self.precompute_ref_batch_size < 0:
            raise ConfigError(f"`precompute_ref_batch_size` must be >= 0, got {self.precompute_ref_batch_size}.")
        if self.loss_type in REFERENCE_FREE and (self.ref_model or self.precompute_ref_log_probs):
            raise ConfigError(f"loss_type {self.loss_type} is reference-free: unset `ref_model` and "
                              "`precompute_ref_log_probs`.")

    @property
    def prompt_limit(self) -> int:
        return self.max_prompt_length or max(1, self.max_length // 2)


# ----------------------------------------------------------------------------------------------
# Data


def load_split(rows, name: str, tokenizer, config: DPOConfig) -> TokenizedPairs:
    """Pairs of a dataset (errors name the missing columns; identical pairs dropped), tokenized."""
    pairs, _ = load_pairs(rows, name, "dpo", tokenizer)
    chat = is_conversational(rows[0]["chosen"])  # a column is all text or all chat
    return tokenize_dpo_pairs(pairs, tokenizer, name, chat, config.max_length, config.prompt_limit,
                              config.truncation_mode, len(rows))


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
    seqs, masks = [], []
    for completions in (data.chosen_ids, data.rejected_ids):
        for i in indices:
            seqs.append(data.prompt_ids[i] + completions[i])
            masks.append([0] * max(len(data.prompt_ids[i]), 1) + [1] * (len(completions[i]) - (not data.prompt_ids[i])))
    rows = pack_best_fit([len(s) for s in seqs], pack_to) if pack_to else [[s] for s in range(len(seqs))]
    width = max(sum(len(seqs[s]) for s in members) for members in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    completion = torch.zeros(shape, dtype=torch.long)
    sequence = torch.full(shape, -1, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for s in members:
            end = start + len(seqs[s])
            input_ids[r, start:end] = torch.tensor(seqs[s])
            completion[r, start:end] = torch.tensor(masks[s])
            sequence[r, start:end] = s
            position_ids[r, start:end] = torch.arange(end - start)
            start = end
        # Padding continues as its own "sequence" so it never joins a real one's attention block.
        position_ids[r, start:] = torch.arange(width - start)
    pairs = torch.tensor(indices, dtype=torch.long)
    if pack_to:
        return DPOBatch(input_ids, None, position_ids, completion, sequence, pairs)
    return DPOBatch(input_ids, (sequence >= 0).long(), None, completion, sequence, pairs)


@dataclass
class SequenceLogps:
    """Per-sequence sums over completion tokens of one forward pass over a DPOBatch."""

    logps: torch.Tensor  # [2B] summed token log-probs
    lengths: torch.Tensor  # [2B] completion tokens scored
    logit_sums: torch.Tensor | None  # [2B] sum over tokens of the vocabulary-mean logit (detached; TRL logits/*)


def sequence_logps(model, batch: DPOBatch, with_logits: bool = True) -> SequenceLogps:
    """One forward over all 2B sequences; the LM head runs only where a completion token is predicted."""
    out = target_logits(model, batch.input_ids, batch.completion_mask, batch.attention_mask, batch.position_ids)
    token_logps = selective_log_softmax(out.logits, out.targets)  # [N]
    owner = batch.sequence[out.rows, out.cols]  # [N]
    num = 2 * batch.num_pairs
    lengths = sequence_sums(torch.ones_like(token_logps.detach()), owner, num)
    logit_sums = None
    if with_logits:
        with torch.no_grad():
            logit_sums = sequence_sums(out.logits.float().mean(-1), owner, num)
    return SequenceLogps(sequence_sums(token_logps, owner, num), lengths, logit_sums)


# ----------------------------------------------------------------------------------------------
# The reference


@dataclass
class Reference:
    """Where reference log-probs come from: a cache filled before training, or a frozen model.

    `model` is a frozen model, or the PEFT policy itself when `adapter_disabled` (its base
    model). `cache` maps a split ("train", "eval") to [num_pairs, 2] (chosen, rejected) sums.
    Reference-free loss types use an empty Reference and never call it.
    """

    model: Any = None
    adapter_disabled: bool = False
    cache: dict[str, torch.Tensor] = field(default_factory=dict)

    def compute(self, batch: DPOBatch) -> torch.Tensor:
        """Reference log-probs of a batch's 2B sequences, [2B], without autograd."""
        was_training = self.model.training
        self.model.eval()
        adapters_off = self.model.disable_adapter() if self.adapter_disabled else contextlib.nullcontext()
        with torch.inference_mode(), adapters_off:
            logps = sequence_logps(self.model, batch, with_logits=False).logps
        self.model.train(was_training)
        return logps.clone()  # a normal tensor: inference tensors cannot join the policy's graph

    def logps(self, batch: DPOBatch, split: str) -> torch.Tensor:
        if split in self.cache:
            pair = self.cache[split][batch.pairs]  # [B, 2]
            return torch.cat([pair[:, 0], pair[:, 1]])
        return self.compute(batch)

    def precompute(self, data: TokenizedPairs, split: str, batch_size: int, pad_id: int, pack_to: int) -> None:
        scores = []
        for start in range(0, len(data), batch_size):
            batch = collate(data, list(range(start, min(start + batch_size, len(data)))), pad_id, pack_to)
            scores.append(self.compute(batch).view(2, -1).T)  # [B, 2]
        self.cache[split] = torch.cat(scores)


def freeze(model):
    model.eval()
    model.requires_grad_(False)
    return model


def packing_is_exact(model, indices: list[int], data: TokenizedPairs, pad_id: int, pack_to: int) -> bool:
    """Whether `model` scores packed sequences as it scores padded ones, i.e. its attention builds
    the block-diagonal mask from restarting position ids (transformers' models do; some
    remote-code models do not, and would let packed sequences attend to each other)."""
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        padded = sequence_logps(model, collate(data, indices, pad_id), with_logits=False)
        packed = sequence_logps(model, collate(data, indices, pad_id, pack_to), with_logits=False)
    model.train(was_training)
    per_token = float(((padded.logps - packed.logps).abs() / padded.lengths.clamp(min=1)).max())
    tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 3e-2
    if per_token > tolerance:
        log.warning("padding_free is off: %s scores packed sequences differently from padded ones (%.3g nats per "
                    "token), so its attention does not separate them. Training on padded batches.",
                    type(model).__name__, per_token)
    return per_token <= tolerance


def reference_model(config: DPOConfig, model_path: str, policy, fresh_start: bool) -> tuple[Any, bool]:
    """(model, adapter_disabled) to score the reference with; see the module docstring for the order."""
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
def evaluate(model, data: TokenizedPairs, reference: Reference, config: DPOConfig, pad_id: int,
             pack_to: int) -> dict[str, float]:
    model.eval()
    total: dict[str, float] = {}
    for start in range(0, len(data), config.per_device_batch_size):
        batch = collate(data, list(range(start, min(start + config.per_device_batch_size, len(data)))), pad_id,
                        pack_to)
        ref = None if config.loss_type in REFERENCE_FREE else reference.logps(batch, "eval")
        add_sums(total, pair_loss(model, batch, ref, config)[1])
    model.train()
    return {f"eval_{k}": v for k, v in metric_means(total).items()}


# ----------------------------------------------------------------------------------------------
# The stage


def run_dpo(config: DPOConfig) -> str:
    """Train, checkpoint and save; returns `config.output_dir` (holding the final model)."""
    set_seed(config.seed)
    started = time.perf_counter()

    # 1. Data, validated before any model is loaded.
    model_path = resolve_model_path(config.model)
    tokenizer = load_tokenizer(model_path, config.trust_remote_code)
    rows = load_rows(config.dataset, config.dataset_split)
    if config.eval_dataset:
        eval_rows = load_rows(config.eval_dataset, config.dataset_split)
    elif config.eval_split_ratio:
        rows, eval_rows = split_eval(rows, config.eval_split_ratio, config.seed)
    else:
        eval_rows = None
    train_data = load_split(rows, config.dataset, tokenizer, config)
    eval_data = load_split(eval_rows, config.eval_dataset or "eval split", tokenizer, config) if eval_rows else None
    steps = total_steps(config, len(train_data))
    data_runtime = time.perf_counter() - started
    log.info("DPO: %d pairs, %d optimizer steps, loss_type=%s.", len(train_data), steps, config.loss_type)

    # 2. Policy, optimizer, schedule; restored from a checkpoint when resuming.
    resume = ckpt.resolve_resume(config.resume_from_checkpoint, config.output_dir)
    if resume and is_remote(resume):
        resume = fetch_to_local(resume)
    model = load_causal_lm(resume or model_path, config.dtype, config.trust_remote_code,
                           config.gradient_checkpointing, trainable_adapter=bool(resume and config.lora_r))
    if config.lora_r and not resume:
        model = apply_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules)
    if config.disable_dropout:
        disable_dropout(model)
    model.train()
    trainable, total = count_parameters(model)
    log.info("Model %s: %.2fM parameters, %.2fM trainable.", config.model, total / 1e6, trainable / 1e6)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, steps)
    run = ckpt.StageRun("dpo", config, model, tokenizer, optimizer, scheduler, resume,
                        describe_datasets(config, rows, eval_rows, {"pairs": len(train_data)},
                                          {"pairs": len(eval_data)} if eval_data is not None else None))
    state = run.state

    # 3. The reference: restored scores, precomputed scores, or a model scoring every batch.
    splits = {"train": train_data, **({"eval": eval_data} if eval_data else {})}
    reference = Reference()
    if config.precompute_ref_log_probs:
        saved = state.extra.get("ref_logps", {})  # from the checkpoint; recomputed if the data changed since
        reference.cache = {k: torch.tensor(v) for k, v in saved.items() if k in splits and len(v) == len(splits[k])}
    if config.loss_type not in REFERENCE_FREE and set(reference.cache) != set(splits):
        reference.model, reference.adapter_disabled = reference_model(config, model_path, model, not resume)
    pack_to = config.max_length if config.padding_free else 0
    if pack_to:
        # The shortest few pairs pack several sequences per row, and cost little to score twice.
        probe = sorted(range(len(train_data)), key=train_data.pair_length)[:4]
        architectures = {type(m.get_base_model() if hasattr(m, "get_base_model") else m): m
                         for m in (model, reference.model) if m is not None}
        if not all(packing_is_exact(m, probe, train_data, tokenizer.pad_token_id, pack_to)
                   for m in architectures.values()):
            pack_to = 0
    if config.precompute_ref_log_probs:
        ref_started = time.perf_counter()
        batch_size = config.precompute_ref_batch_size or 2 * config.per_device_batch_size
        for split, data in splits.items():
            if split not in reference.cache:
                reference.precompute(data, split, batch_size, tokenizer.pad_token_id, pack_to)
        reference.model = None  # training needs only the scores
        state.extra["ref_logps"] = {k: v.tolist() for k, v in reference.cache.items()}
        log.info("Reference log-probs of %s ready in %.1fs.", " and ".join(splits), time.perf_counter() - ref_started)
    tracker = run.tracker

    # 4. The loop.
    pad_id = tokenizer.pad_token_id
    pairs_per_step = config.per_device_batch_size * config.gradient_accumulation_steps
    window = MetricWindow()
    progress = Progress(steps, state.global_step, "dpo", config.disable_progress_bar)
    loop_started = time.perf_counter()
    try:
        while state.global_step < steps:
            step = state.global_step + 1
            micro = [collate(train_data, idx, pad_id, pack_to)
                     for idx in step_batches(len(train_data), config.per_device_batch_size,
                                             config.gradient_accumulation_steps, config.seed, step)]
            step_pairs = sum(b.num_pairs for b in micro)
            sums: dict[str, float] = {}
            for batch in micro:
                ref = None if config.loss_type in REFERENCE_FREE else reference.logps(batch, "train")
                loss, batch_sums = pair_loss(model, batch, ref, config)
                (loss * (batch.num_pairs / step_pairs)).backward()
                add_sums(sums, batch_sums)
                state.num_tokens += batch.num_tokens
            grad_norm = clip_and_step(model, optimizer, scheduler, config.max_grad_norm)
            state.global_step = step
            window.add({**metric_means(sums), "grad_norm": grad_norm})
            logged = None
            if step % config.logging_steps == 0 or step == steps:
                logged = {**window.pop(), "learning_rate": scheduler.get_last_lr()[0],
                          "num_tokens": float(state.num_tokens), "epoch": step * pairs_per_step / len(train_data)}
                if eval_data and config.eval_steps and step % config.eval_steps == 0 and step != steps:
                    logged.update(evaluate(model, eval_data, reference, config, pad_id, pack_to))
                tracker.log_metrics(logged, step)
                run.last_metrics = logged
            progress.update(step, logged)
            if config.save_steps and step % config.save_steps == 0 and step != steps:
                run.save("step")
        progress.close()
        loop_runtime = time.perf_counter() - loop_started

        # 5. Final evaluation and the model.
        if eval_data:
            final_eval = evaluate(model, eval_data, reference, config, pad_id, pack_to)
            tracker.log_metrics(final_eval, state.global_step)
            run.last_metrics = {**run.last_metrics, **final_eval}
        run.last_metrics.update(train_runtime=time.perf_counter() - started, data_runtime=data_runtime,
                                loop_runtime=loop_runtime)
        run.save("final")
        tracker.log_dict(run.manifest(), ckpt.MANIFEST)
        if config.mlflow_log_checkpoint and not is_remote(config.output_dir):
            tracker.log_artifacts(config.output_dir, "checkpoint")
        tracker.finish()
    except BaseException:
        progress.close()
        tracker.finish("FAILED")
        raise
    log.info("DPO done in %.1fs; model saved to %s", time.perf_counter() - started, config.output_dir)
    return str(Path(config.output_dir)) if not is_remote(config.output_dir) else config.output_dir
