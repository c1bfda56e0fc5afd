"""Supervised fine-tuning (SFT).

Next-token cross-entropy on the tokens a user wants learned: completions of prompt/completion
data, assistant turns of chat data, everything of plain text (each configurable). The loss of
one optimizer step is the sum over its target tokens divided by the number of target tokens in
the whole step (all accumulated micro-batches), as TRL does with `num_items_in_batch`, so
gradient accumulation gives the same update as one large batch.

Departures from TRL's SFTTrainer, all for speed: the LM head runs only at target positions
(`trainer.algorithms.logprobs.target_logits`), and packing uses best-fit-decreasing bins with position ids
restarting per example, so no example attends to another (transformers builds the
block-diagonal mask from the position ids). `padding_free` (on by default, off in TRL) packs each micro-batch
on the CPU into one row whose examples' attention runs apart (`trainer.engine.attention.per_sequence_attention`):
the linears skip the padding (SmolLM2, bf16, 4 GSM8K examples a step: -7 to -9% a step). It is checked first
(`padding_free_is_exact`), and turned off for a model whose attention would mix the examples.

Read top to bottom: data, model, loop, save. The options are `SFTConfig` in `trainer/config/sft_config.py`.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from trainer.algorithms.logprobs import TargetLM, log_probs_and_stats, target_logits
from trainer.config.sft_config import SFTConfig
from trainer.data.formatting import TokenizedSFT, pack_best_fit, tokenize_sft
from trainer.data.sources import describe_datasets, load_train_eval
from trainer.engine.attention import packed_row_kwargs
from trainer.engine.loop import total_steps
from trainer.engine.models import apply_lora, count_parameters, load_causal_lm, model_and_tokenizer
from trainer.engine.runner import StageRunner, layout_check, layouts_agree, to_device

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Batches


@dataclass
class SFTBatch:
    input_ids: torch.Tensor  # [B, T]
    target_mask: torch.Tensor  # [B, T] 1 where the token is a loss target
    attention_mask: torch.Tensor | None  # [B, T] padded rows; None for packed rows
    position_ids: torch.Tensor | None  # [B, T] restarting per packed example; None when not packed
    num_tokens: int  # real tokens, padding excluded
    bounds: torch.Tensor | None = None  # [S + 1] cumulative example lengths when one row holds S examples, no padding

    @property
    def model_kwargs(self) -> dict | None:
        """Passed to the model's forward: the attention runs each example of a single packed row apart."""
        return packed_row_kwargs(self.bounds) if self.bounds is not None else None


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
            example = data.row(i)
            ids += example["input_ids"]
            mask += [0] + example["loss_mask"][1:]
            pos += list(range(len(example["input_ids"])))
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
    num_tokens = sum(len(ids) for ids in seqs)
    if packed:
        return SFTBatch(input_ids, target_mask, None, position_ids, num_tokens)
    return SFTBatch(input_ids, target_mask, attention, None, num_tokens)


def micro_batch(data: TokenizedSFT, rows: list[list[int]], pad_id: int, config: SFTConfig,
                one_row: bool = False) -> SFTBatch:
    """A micro-batch of `rows` (see `collate`): packed rows as they are; with `padding_free`, its examples packed
    into one row (`one_row`, with their `bounds`) or into rows of at most `max_length` tokens (best fit); padded
    otherwise."""
    if config.padding_free and not config.packing:
        examples = [i for members in rows for i in members]
        if one_row:
            batch = collate(data, [examples], pad_id, packed=True)
            batch.bounds = torch.tensor([0, *itertools.accumulate(int(data.lengths[i]) for i in examples)])
            return batch
        fit = pack_best_fit([int(data.lengths[i]) for i in examples], config.max_length)
        return collate(data, [[examples[j] for j in sorted(row)] for row in fit], pad_id, packed=True)
    return collate(data, rows, pad_id, config.packing)


def target_log_probs(model, batch: SFTBatch, stats: tuple[str, ...] = ()):
    """Log-probs of the batch's targets [N], their requested statistics ({[N]}) and the targets [N]."""
    out = target_logits(model, batch.input_ids, batch.target_mask, batch.attention_mask, batch.position_ids,
                        model_kwargs=batch.model_kwargs)
    return *log_probs_and_stats(out.logits, out.targets, stats), out.targets


def token_loss(model, batch: SFTBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Summed negative log-likelihood of the batch's targets, and detached statistics."""
    logps, row, targets = target_log_probs(model, batch, ("entropy", "argmax"))
    stats = {
        "entropy_sum": float(row["entropy"].sum()),
        "correct": float((row["argmax"] == targets).sum()),
        "targets": float(targets.numel()),
    }
    return -logps.sum(), stats


def padding_free_is_exact(model, data: TokenizedSFT, pad_id: int, config: SFTConfig, one_row: bool,
                          device) -> bool:
    """Whether `model` scores a padding-free micro-batch of the shortest examples as it scores them padded: its
    attention keeps packed examples apart (through their bounds in one row, or the restarting position ids;
    some remote-code models follow neither). See `layouts_agree`."""
    shortest = sorted(range(len(data)), key=lambda i: int(data.lengths[i]))[:4]
    rows = [[i] for i in shortest]
    scores = []
    with layout_check(model):
        for batch in (collate(data, rows, pad_id, packed=False), micro_batch(data, rows, pad_id, config, one_row)):
            scores.append(target_log_probs(model, to_device(batch, device))[0])
    return layouts_agree(model, *scores, len(scores[0]), "Training on padded batches.")


@torch.no_grad()
def evaluate(run: StageRunner, data: TokenizedSFT, pad_id: int) -> dict[str, float]:
    """Loss and token accuracy on held-out data; each rank scores its share, the sums cross ranks."""
    run.module.eval()
    sums = {"loss": 0.0, "correct": 0.0, "targets": 0.0}
    for part in run.rank_slice(len(data), run.config.eval_batch_size):
        weight = 1.0 if len(part) else 0.0  # an empty share still runs one forward (ZeRO-3 gathers collectively)
        batch = to_device(collate(data, [[i] for i in (part or range(1))], pad_id, False), run.device)
        with run.accelerator.autocast():
            nll, stats = token_loss(run.model, batch)
        for key, value in (("loss", float(nll)), ("correct", stats["correct"]), ("targets", stats["targets"])):
            sums[key] += weight * value
    run.module.train()
    sums = run.sum_over_ranks(sums)
    return {"eval_loss": sums["loss"] / max(sums["targets"], 1), "eval_mean_token_accuracy":
            sums["correct"] / max(sums["targets"], 1)}


@torch.no_grad()
def sample_completions(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    model.eval()
    outs = []
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt").to(model.device)
        with torch.compiler.set_stance("force_eager"):  # (as the hf rollout engine: decoding would recompile)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        outs.append(tokenizer.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    model.train()
    return outs


def _prompt_texts(rows, tokenizer, n: int) -> list[str]:
    from trainer.data.chat_templates import render_chat

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


def train_step(run: StageRunner, units: list[list[int]], data: TokenizedSFT, pad_id: int) -> dict[str, float]:
    """One optimizer step over this rank's share of the step's micro-batches; returns the step's metrics."""
    step = run.state.global_step + 1
    micro = [(micro_batch(data, [units[u] for u in part.indices], pad_id, run.config, run.one_row), part.weight)
             for part in run.rank_batches(len(units), step)]
    # The loss is summed over the step's target tokens on all ranks, divided by their number
    # (x world size: DDP and DeepSpeed average the ranks' gradients). collate zeroes position 0.
    step_targets = run.sum_over_ranks({"n": sum(w * int(b.target_mask.sum()) for b, w in micro)})["n"]
    sums = {"loss": 0.0, "entropy": 0.0, "correct": 0.0, "tokens": 0.0}
    for i, (batch, weight) in enumerate(micro):
        with run.micro_batch(last=i == len(micro) - 1):
            nll, stats = token_loss(run.model, to_device(batch, run.device))
            run.backward(nll * (weight * run.world / step_targets))
        for key, value in (("loss", float(nll.detach())), ("entropy", stats["entropy_sum"]),
                           ("correct", stats["correct"]), ("tokens", batch.num_tokens)):
            sums[key] += weight * value
    grad_norm = run.optimizer_step()
    sums = run.sum_over_ranks(sums)
    run.state.global_step = step
    run.state.num_tokens += int(sums["tokens"])
    return {"loss": sums["loss"] / step_targets, "grad_norm": grad_norm, "entropy": sums["entropy"] / step_targets,
            "mean_token_accuracy": sums["correct"] / step_targets}


def run_sft(config: SFTConfig) -> str:
    """Train, checkpoint and save; returns `config.output_dir` (holding the final model).

    Under `accelerate launch` (or `alignflow train sft --num_processes N`) every process runs it as one rank.
    """
    run = StageRunner("sft", config)

    # 1. Data, validated before the model is loaded.
    model_path, tokenizer = model_and_tokenizer(config)
    rows, eval_rows = load_train_eval(config)
    tokenize = dict(tokenizer=tokenizer, max_length=config.max_length, truncation_mode=config.truncation_mode,
                    completion_only_loss=config.completion_only_loss, assistant_only_loss=config.assistant_only_loss,
                    num_proc=config.dataset_num_proc)
    # One process per node tokenizes into the shared cache; the others then map the files it wrote.
    with run.accelerator.local_main_process_first():
        train_data = tokenize_sft(rows, name=config.dataset, **tokenize)
        eval_data = (tokenize_sft(eval_rows, name=config.eval_dataset or "eval split", **tokenize) if eval_rows
                     else None)
    # Each schedulable unit is a list of examples: one each, or one packed row each.
    units = (pack_best_fit(train_data.lengths.tolist(), config.max_length) if config.packing
             else [[i] for i in range(len(train_data))])
    steps = total_steps(config, len(units), run.world)
    log.info("SFT: %d examples in %d %s; %d optimizer steps.", len(train_data), len(units),
             "packed rows" if config.packing else "rows", steps)

    # 2. Model, optimizer, schedule; restored from a checkpoint when resuming.
    resume = run.resume_checkpoint(model_path, rows)
    model = load_causal_lm(resume or model_path, config.dtype, config.trust_remote_code,
                           config.gradient_checkpointing, trainable_adapter=bool(resume and config.lora_r))
    if config.lora_r and not resume:
        model = apply_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules)
    model.train()
    trainable, total = count_parameters(model)
    log.info("Model %s: %.2fM parameters, %.2fM trainable.", config.model, total / 1e6, trainable / 1e6)
    with run.failing():
        run.prepare(model, tokenizer, steps, describe_datasets(config, rows, eval_rows, {"examples": len(train_data)}),
                    wrap=TargetLM)

        # 3. The loop.
        pad_id = tokenizer.pad_token_id
        if config.padding_free and not config.packing and not padding_free_is_exact(
                run.model_without_autocast(), train_data, pad_id, config, run.one_row, run.device):
            config.padding_free = False  # so the manifest says what ran
        evaluate_now = (lambda: evaluate(run, eval_data, pad_id)) if eval_data else None
        while run.state.global_step < steps:
            run.end_step(train_step(run, units, train_data, pad_id), len(units), evaluate_now)

        # 4. Final evaluation, samples and the model.
        run.final_evaluation(evaluate_now)
        if config.num_sample_completions:
            prompts = _prompt_texts(eval_rows if eval_rows is not None else rows, tokenizer,
                                    config.num_sample_completions)
            if prompts:
                with run.gathered():
                    completions = sample_completions(model, tokenizer, prompts, config.sample_max_new_tokens)
                run.log_completions([{"step": run.state.global_step, "prompt": p, "completion": c}
                                     for p, c in zip(prompts, completions)], "samples/completions.json")
        return run.finish()
