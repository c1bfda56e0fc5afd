"""Supervised fine-tuning (SFT).

Next-token cross-entropy on the tokens a user wants learned: completions of prompt/completion
data, assistant turns of chat data, everything of plain text (each configurable). The loss of
one optimizer step is the sum over its target tokens divided by the number of target tokens in
the whole step (all accumulated micro-batches), as TRL does with `num_items_in_batch`, so
gradient accumulation gives the same update as one large batch.

Departures from TRL's SFTTrainer, all for speed: the LM head runs only at target positions
(`trainer.logprobs.target_logits`), and packing uses best-fit-decreasing bins with position ids
restarting per example, so no example attends to another (transformers builds the
block-diagonal mask from the position ids).

Read top to bottom: config, data, model, loop, save.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer import checkpoint as ckpt
from trainer.config import ConfigError, TrainConfig, option
from trainer.data import TokenizedSFT, describe_datasets, load_rows, pack_best_fit, split_eval, tokenize_sft
from trainer.logprobs import entropy, selective_log_softmax, target_logits
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
from trainer.models import apply_lora, count_parameters, load_causal_lm, load_tokenizer, resolve_model_path
from trainer.storage import fetch_to_local, is_remote

log = logging.getLogger(__name__)


@dataclass
class SFTConfig(TrainConfig):
    """Supervised fine-tuning on text, prompt/completion or chat data."""

    learning_rate: float = option(2e-5, "Peak learning rate (AdamW).")
    completion_only_loss: bool = option(True, "For prompt/completion data: train on completion tokens only.")
    assistant_only_loss: bool = option(True, "For chat `messages`: train on assistant turns only.")
    packing: bool = option(False, "Pack several short examples into each row of `max_length` tokens "
                                  "(no attention across examples).")
    num_sample_completions: int = option(4, "Greedy sample completions of held-out prompts logged at the end "
                                            "(0 = none).")
    sample_max_new_tokens: int = option(48, "Length of those sample completions.")

    stage = "sft"

    def validate(self) -> None:
        super().validate()
        if self.packing and self.per_device_batch_size > 1 and self.max_length < 16:
            raise ConfigError("`packing` needs `max_length` >= 16 to fit examples into rows.")


# ----------------------------------------------------------------------------------------------
# Batches


@dataclass
class SFTBatch:
    input_ids: torch.Tensor  # [B, T]
    target_mask: torch.Tensor  # [B, T] 1 where the token is a loss target
    attention_mask: torch.Tensor | None  # [B, T] padded rows; None for packed rows
    position_ids: torch.Tensor | None  # [B, T] restarting per packed example; None when not packed

    @property
    def num_tokens(self) -> int:
        if self.attention_mask is not None:
            return int(self.attention_mask.sum())
        return int((self.position_ids >= 0).sum())


def collate(data: TokenizedSFT, rows: list[list[int]], pad_id: int, packed: bool) -> SFTBatch:
    """Right-pad examples (or packed groups of examples) into one batch.

    `rows` lists, for each batch row, the indices of the examples it holds (one unless packed).
    The first token of each example is never a target: in a packed row it would be predicted
    from the previous example.
    """
    seqs, masks, positions = [], [], []
    for members in rows:
        ids, mask, pos = [], [], []
        for i in members:
            ids += data.input_ids[i]
            mask += [0] + data.loss_mask[i][1:]
            pos += list(range(len(data.input_ids[i])))
        seqs.append(ids)
        masks.append(mask)
        positions.append(pos)
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    target_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    position_ids = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, (ids, mask, pos) in enumerate(zip(seqs, masks, positions)):
        n = len(ids)
        input_ids[r, :n] = torch.tensor(ids)
        target_mask[r, :n] = torch.tensor(mask)
        attention[r, :n] = 1
        # Padding continues as its own "example" so it never joins a real one's attention block.
        position_ids[r, :n] = torch.tensor(pos)
        position_ids[r, n:] = torch.arange(width - n)
    if packed:
        return SFTBatch(input_ids, target_mask, None, position_ids)
    return SFTBatch(input_ids, target_mask, attention, None)


def token_loss(model, batch: SFTBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Summed negative log-likelihood of the batch's targets, and detached statistics."""
    out = target_logits(model, batch.input_ids, batch.target_mask, batch.attention_mask, batch.position_ids)
    logps = selective_log_softmax(out.logits, out.targets)  # [N]
    with torch.no_grad():
        stats = {
            "entropy_sum": float(entropy(out.logits).sum()),
            "correct": float((out.logits.argmax(-1) == out.targets).sum()),
            "targets": float(out.targets.numel()),
        }
    return -logps.sum(), stats


@torch.no_grad()
def evaluate(model, data: TokenizedSFT, batch_size: int, pad_id: int) -> dict[str, float]:
    model.eval()
    total = correct = loss = 0.0
    for start in range(0, len(data), batch_size):
        batch = collate(data, [[i] for i in range(start, min(start + batch_size, len(data)))], pad_id, False)
        nll, stats = token_loss(model, batch)
        loss += float(nll)
        correct += stats["correct"]
        total += stats["targets"]
    model.train()
    return {"eval_loss": loss / max(total, 1), "eval_mean_token_accuracy": correct / max(total, 1)}


@torch.no_grad()
def sample_completions(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    model.eval()
    outs = []
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt")
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        outs.append(tokenizer.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    model.train()
    return outs


def _prompt_texts(rows, tokenizer, n: int) -> list[str]:
    from trainer.data import render_chat

    prompts = []
    for row in rows.select(range(min(n, len(rows)))):
        if "messages" in row:
            first_reply = next((i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"), None)
            if first_reply:
                prompts.append(render_chat(tokenizer, row["messages"][:first_reply], add_generation_prompt=True))
        elif "prompt" in row:
            p = row["prompt"]
            prompts.append(render_chat(tokenizer, p, add_generation_prompt=True) if isinstance(p, list) else p)
    return prompts


# ----------------------------------------------------------------------------------------------
# The stage


def run_sft(config: SFTConfig) -> str:
    """Train, checkpoint and save; returns `config.output_dir` (holding the final model)."""
    set_seed(config.seed)
    started = time.perf_counter()

    # 1. Data, validated before the model is loaded.
    model_path = resolve_model_path(config.model)
    tokenizer = load_tokenizer(model_path, config.trust_remote_code)
    rows = load_rows(config.dataset, config.dataset_split)
    if config.eval_dataset:
        eval_rows = load_rows(config.eval_dataset, config.dataset_split)
    elif config.eval_split_ratio:
        rows, eval_rows = split_eval(rows, config.eval_split_ratio, config.seed)
    else:
        eval_rows = None
    tokenize = dict(tokenizer=tokenizer, max_length=config.max_length, truncation_mode=config.truncation_mode,
                    completion_only_loss=config.completion_only_loss, assistant_only_loss=config.assistant_only_loss)
    train_data = tokenize_sft(rows, name=config.dataset, **tokenize)
    eval_data = tokenize_sft(eval_rows, name=config.eval_dataset or "eval split", **tokenize) if eval_rows else None
    # Each schedulable unit is a list of examples: one each, or one packed row each.
    units = (pack_best_fit([len(x) for x in train_data.input_ids], config.max_length) if config.packing
             else [[i] for i in range(len(train_data))])
    steps = total_steps(config, len(units))
    log.info("SFT: %d examples in %d %s; %d optimizer steps.", len(train_data), len(units),
             "packed rows" if config.packing else "rows", steps)

    # 2. Model, optimizer, schedule; restored from a checkpoint when resuming.
    resume = ckpt.resolve_resume(config.resume_from_checkpoint, config.output_dir)
    if resume and is_remote(resume):
        resume = fetch_to_local(resume)
    model = load_causal_lm(resume or model_path, config.dtype, config.trust_remote_code,
                           config.gradient_checkpointing, trainable_adapter=bool(resume and config.lora_r))
    if config.lora_r and not resume:
        model = apply_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules)
    model.train()
    trainable, total = count_parameters(model)
    log.info("Model %s: %.2fM parameters, %.2fM trainable.", config.model, total / 1e6, trainable / 1e6)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, steps)
    run = ckpt.StageRun("sft", config, model, tokenizer, optimizer, scheduler, resume,
                        describe_datasets(config, rows, eval_rows, {"examples": len(train_data)}))
    state, tracker = run.state, run.tracker
    # 3. The loop.
    pad_id = tokenizer.pad_token_id
    units_per_step = config.per_device_batch_size * config.gradient_accumulation_steps
    window = MetricWindow()
    progress = Progress(steps, state.global_step, "sft", config.disable_progress_bar)
    try:
        while state.global_step < steps:
            step = state.global_step + 1
            micro = [collate(train_data, [units[u] for u in idx], pad_id, config.packing)
                     for idx in step_batches(len(units), config.per_device_batch_size,
                                             config.gradient_accumulation_steps, config.seed, step)]
            step_targets = sum(int(b.target_mask.sum()) for b in micro)  # collate zeroes position 0
            loss_sum = entropy_sum = correct = 0.0
            for batch in micro:
                nll, stats = token_loss(model, batch)
                (nll / step_targets).backward()
                loss_sum += float(nll.detach())
                entropy_sum += stats["entropy_sum"]
                correct += stats["correct"]
                state.num_tokens += batch.num_tokens
            grad_norm = clip_and_step(model, optimizer, scheduler, config.max_grad_norm)
            state.global_step = step
            window.add({"loss": loss_sum / step_targets, "grad_norm": grad_norm,
                        "entropy": entropy_sum / step_targets, "mean_token_accuracy": correct / step_targets})
            logged = None
            if step % config.logging_steps == 0 or step == steps:
                logged = {**window.pop(), "learning_rate": scheduler.get_last_lr()[0],
                          "num_tokens": float(state.num_tokens), "epoch": step * units_per_step / len(units)}
                if eval_data and config.eval_steps and step % config.eval_steps == 0 and step != steps:
                    logged.update(evaluate(model, eval_data, config.per_device_batch_size, pad_id))
                tracker.log_metrics(logged, step)
                run.last_metrics = logged
            progress.update(step, logged)
            if config.save_steps and step % config.save_steps == 0 and step != steps:
                run.save("step")
        progress.close()

        # 4. Final evaluation, samples and the model.
        if eval_data:
            final_eval = evaluate(model, eval_data, config.per_device_batch_size, pad_id)
            tracker.log_metrics(final_eval, state.global_step)
            run.last_metrics = {**run.last_metrics, **final_eval}
        if config.num_sample_completions:
            prompts = _prompt_texts(eval_rows if eval_rows is not None else rows, tokenizer,
                                    config.num_sample_completions)
            if prompts:
                completions = sample_completions(model, tokenizer, prompts, config.sample_max_new_tokens)
                tracker.log_table({"prompt": prompts, "completion": completions}, "samples/completions.json")
        run.last_metrics["train_runtime"] = time.perf_counter() - started
        run.save("final")
        tracker.log_dict(run.manifest(), ckpt.MANIFEST)
        if config.mlflow_log_checkpoint and not is_remote(config.output_dir):
            tracker.log_artifacts(config.output_dir, "checkpoint")
        tracker.finish()
    except BaseException:
        progress.close()
        tracker.finish("FAILED")
        raise
    log.info("SFT done in %.1fs; model saved to %s", time.perf_counter() - started, config.output_dir)
    return str(Path(config.output_dir)) if not is_remote(config.output_dir) else config.output_dir
