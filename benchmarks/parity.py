"""Numerical parity with TRL 1.16: each objective's loss, gradient and metrics on one identical batch.

For every case, one tiny random Llama (`alignflow model init-tiny`, or `--model`) in float32 is copied
twice. One copy goes through alignflow's own batch and loss code (the functions its stages call:
`tokenize_sft` + `sft.collate` + `sft.token_loss`; `dpo.load_split` + `dpo.collate` + `dpo.pair_loss`
with a frozen `dpo.Reference`; `tokenize_reward_pairs` + `reward_model.collate` + `bradley_terry_loss`;
`token_logps` + `policy_loss`),
the other through TRL's trainer (its own dataset preparation and collator, then
`trainer.compute_loss(model, inputs)`). Each side runs ONE forward and backward; nothing is trained.

Compared, per case:
- token ids: both sides must see the same sequences and the same loss targets (checked; a mismatch
  is reported as the difference, not hidden);
- per-token log-probabilities of the loss targets (max abs diff; the reward model: its scores);
- the loss and the total L2 gradient norm over all parameters (relative diff);
- every metric both trainers log for that step under the same name (relative diff).

A row matches when both sides saw the same ids and targets and every relative diff (and the log-prob
diff) is within `--tolerance` (default 1e-5); otherwise its status says what differs, and a note names
the tokens when the loss targets do.

Cases: SFT completion-only (padded and packed) and assistant-only, the latter with TRL's
`{% generation %}` markers placed two ways (see MARKED_TEMPLATES); DPO sigmoid, ipo, hinge, robust (label smoothing
0.1) and apo_zero with a frozen reference, sigmoid with alignflow's padding-free layout, and with a
precomputed reference (the DPO policy is the model plus seeded noise, so that log-ratios are not all
zero); the reward model's Bradley-Terry loss with and without `center_rewards_coefficient` and with a
`margin` column; GRPO's policy loss (dapo) on fixed completions with given old and reference log-probs,
without and with a KL term (`use_bias_correction_kl` off, and at TRL's default, on, on both sides).
Data: the first `--rows` rows of trainer/demo_data (sft.jsonl, chat.jsonl, preferences.jsonl). TRL is
imported only when the script runs; without it the script exits naming `pip install trl==1.16.0`.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common

DEMO = common.REPO / "trainer" / "demo_data"
RESULT = common.REPO / "benchmarks" / "results" / "parity.json"
CASES = ("sft-completion", "sft-assistant", "sft-assistant-span", "sft-completion-packed",
         "sft-completion-padding-free", "dpo-sigmoid", "dpo-ipo", "dpo-hinge", "dpo-robust", "dpo-apo_zero", "dpo-sigmoid-padding-free",
         "dpo-sigmoid-chat", "dpo-sigmoid-precomputed",
         "reward", "reward-center", "reward-margin", "reward-padding-free", "grpo", "grpo-shared-prompts", "grpo-kl",
         "grpo-kl-trl-default")
TRL_PIN = "pip install trl==1.16.0"

# TRL's assistant-only loss needs `{% generation %}` markers, which init-tiny's ChatML template lacks. Both render the
# same text as that template. "trl": the markers where TRL's own ChatML training template (qwen2_5_training.jinja)
# puts them, from the newline after `<|im_start|>assistant` to the turn's closing newline. "span": on alignflow's
# assistant span, which starts after the generation prompt `<|im_start|>assistant\n`.
_TURN = "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
_GENERATION_PROMPT = "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
MARKED_TEMPLATES = {
    "trl": ("{%- for message in messages %}{%- if message['role'] == 'assistant' %}{{ '<|im_start|>assistant' }}"
            "{%- generation %}{{ '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endgeneration %}"
            "{%- else %}" + _TURN + "{%- endif %}{%- endfor %}" + _GENERATION_PROMPT),
    "span": ("{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
             "{{ '<|im_start|>assistant\\n' }}{%- generation %}{{ message['content'] + '<|im_end|>\\n' }}"
             "{%- endgeneration %}{%- else %}" + _TURN + "{%- endif %}{%- endfor %}" + _GENERATION_PROMPT),
}


# ----------------------------------------------------------------------------------------------
# Shared measurements


def rel_diff(ours: float, theirs: float) -> float:
    """|ours − theirs| / max(|theirs|, 1e-12)."""
    return abs(ours - theirs) / max(abs(theirs), 1e-12)


def grad_norm(model) -> float:
    """Total L2 norm of every parameter's gradient (parameters without one count as zero)."""
    import torch

    norms = [p.grad.detach().double().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


@contextlib.contextmanager
def captured_outputs(model):
    """Record the outputs of every forward of `model` (TRL's per-token log-probs live in them)."""
    outputs: list[Any] = []
    handle = model.register_forward_hook(lambda _module, _args, out: outputs.append(out))
    try:
        yield outputs
    finally:
        handle.remove()


def trl_step(trainer) -> tuple[Any, dict[str, Any], Any]:
    """TRL's side of a case: its prepared train_dataset as one batch through its own collator, then
    `compute_loss` and backward on its model in train mode; returns the loss, the inputs and the last forward's
    output (where TRL keeps its per-token log-probs)."""
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    trainer.model.train()
    with captured_outputs(trainer.model) as outputs:
        loss = trainer.compute_loss(trainer.model, dict(inputs))
    loss.backward()
    return loss, inputs, outputs[-1]


def shared_metrics(ours: dict[str, float], theirs: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """The metrics logged under the same name by both sides; TRL's `_metrics` hold one value per step."""
    out = {}
    for name in sorted(set(ours) & set(theirs)):
        if name == "num_tokens" or not theirs[name]:
            continue
        value = float(theirs[name][-1])
        out[name] = {"alignflow": float(ours[name]), "trl": value, "rel_diff": rel_diff(float(ours[name]), value)}
    return out


def same_batch(ours, theirs, attention, our_targets, trl_targets) -> tuple[bool, int]:
    """(same token ids where `attention` [B, T] is set, number of positions where the loss targets [B, T] differ)."""
    if ours.shape != theirs.shape or our_targets.shape != trl_targets.shape:
        return False, -1
    return bool((ours == theirs)[attention.bool()].all()), int((our_targets.bool() != trl_targets.bool()).sum())


def target_difference(tokenizer, ids, ours, theirs) -> str:
    """Which tokens only one side trains on, in a line: `only TRL: '\\n' x4`. All tensors [B, T]."""
    parts = []
    for side, mask in (("only alignflow", ours.bool() & ~theirs.bool()), ("only TRL", theirs.bool() & ~ours.bool())):
        if mask.any():
            tokens: dict[str, int] = {}
            for token in ids[mask].tolist():
                text = repr(tokenizer.decode([token]))
                tokens[text] = tokens.get(text, 0) + 1
            parts.append(f"{side}: " + ", ".join(f"{t} x{n}" for t, n in tokens.items()))
    return "loss targets differ (" + "; ".join(parts) + ")"


def row(stage: str, case: str, same: tuple[bool, int], logprob_diff: float | None, loss: tuple[float, float],
        norms: tuple[float, float], metrics: dict[str, dict[str, float]], shapes: tuple[Any, Any],
        note: str = "") -> dict[str, Any]:
    return {"stage": stage, "case": case, "ids_equal": same[0], "targets_differing": same[1],
            "batch_shape": {"alignflow": list(shapes[0]), "trl": list(shapes[1])},
            "logprob_max_abs_diff": logprob_diff,
            "loss": {"alignflow": loss[0], "trl": loss[1]}, "loss_rel_diff": rel_diff(*loss),
            "grad_norm": {"alignflow": norms[0], "trl": norms[1]}, "grad_norm_rel_diff": rel_diff(*norms),
            "metrics": metrics, "note": note}


def trl_args(config_class, work: Path, **settings):
    """A TRL config for one float32 CPU step that logs nowhere and saves nothing."""
    return config_class(output_dir=str(work / "trl"), report_to="none", use_cpu=True, bf16=False, fp16=False,
                        per_device_train_batch_size=8, gradient_checkpointing=False, save_strategy="no",
                        disable_tqdm=True, dataloader_num_workers=0, seed=0, **settings)


def perturbed(model, scale: float = 0.02, seed: int = 1):
    """A copy of `model` with seeded Gaussian noise on every weight: a policy that differs from its reference, so
    DPO's log-ratios, rewards and accuracies are not all zero (at the reference, every loss type is trivial)."""
    import torch

    out = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * scale)
    return out


def read_rows(name: str, count: int) -> list[dict]:
    with open(DEMO / name) as f:
        return [json.loads(line) for line, _ in zip(f, range(count))]


# ----------------------------------------------------------------------------------------------
# SFT: completion-only loss on prompt/completion rows, assistant-only loss on `messages` rows


def by_example(input_ids, position_ids, rows, cols, logps) -> dict[tuple[int, ...], list[tuple[list[int], Any]]]:
    """Packed rows [B, T] split into their examples (position ids restart at 0): example token ids -> a list, one
    entry per copy, of (target offsets in the example, their log-probs). Targets are (`rows`, `cols`) [N]."""
    out: dict[tuple[int, ...], list[tuple[list[int], Any]]] = {}
    for r in range(input_ids.shape[0]):
        starts = (position_ids[r] == 0).nonzero().flatten().tolist() + [input_ids.shape[1]]
        for start, end in zip(starts, starts[1:]):
            mine = (rows == r) & (cols >= start) & (cols < end)
            if mine.any():  # padding segments have no targets
                key = tuple(input_ids[r, start:end].tolist())
                out.setdefault(key, []).append(((cols[mine] - start).tolist(), logps[mine]))
    return out


def compare_packed(ours: dict, theirs: dict) -> tuple[tuple[bool, int], float | None]:
    """((same examples, targets differing), log-prob max abs diff) of two `by_example` results, example by example."""
    if sorted((k, len(v)) for k, v in ours.items()) != sorted((k, len(v)) for k, v in theirs.items()):
        return (False, -1), None
    differing, worst = 0, 0.0
    for key, copies in ours.items():
        for (our_cols, our_logps), (trl_cols, trl_logps) in zip(copies, theirs[key]):
            if our_cols != trl_cols:
                differing += len(set(our_cols) ^ set(trl_cols))
            else:
                worst = max(worst, float((our_logps - trl_logps).abs().max()))
    return (True, differing), (None if differing else worst)


def sft_case(model, tokenizer, work: Path, *, markers: str | None, max_length: int, count: int,
             packing: bool = False, padding_free: bool = False) -> dict[str, Any]:
    """Completion-only loss (`markers` None) or assistant-only loss with TRL's template marked per `markers`;
    `packing`: both sides pack (best-fit decreasing, position ids restarting per example), and the examples are
    matched by their token ids, since the two packers may order them differently. `padding_free`: the batch's
    examples packed (alignflow: into rows of at most `max_length`; TRL: into one row), matched the same way."""
    import datasets
    import torch
    from trl import SFTConfig, SFTTrainer

    from trainer.algorithms.logprobs import selective_log_softmax, target_logits
    from trainer.data.formatting import pack_best_fit, tokenize_sft
    from trainer.stages.sft import SFTConfig as OurSFTConfig
    from trainer.stages.sft import collate, micro_batch, token_loss

    assistant = markers is not None
    rows = datasets.Dataset.from_list(read_rows("chat.jsonl" if assistant else "sft.jsonl", count))

    # alignflow: tokenize, collate, summed NLL over targets / number of targets (one micro-batch = the step).
    ours = copy.deepcopy(model).train()
    data = tokenize_sft(rows, tokenizer=tokenizer, name="parity", max_length=max_length, truncation_mode="keep_start",
                        completion_only_loss=True, assistant_only_loss=True)
    units = pack_best_fit(data.lengths.tolist(), max_length) if packing else [[i] for i in range(len(data))]
    if padding_free:  # as the stage builds a micro-batch
        batch = micro_batch(data, units, tokenizer.pad_token_id,
                            OurSFTConfig(model=str(work), dataset="parity", padding_free=True, max_length=max_length))
    else:
        batch = collate(data, units, tokenizer.pad_token_id, packed=packing)
    nll, stats = token_loss(ours, batch)
    targets = stats["targets"]
    (nll / targets).backward()
    with torch.no_grad():
        out = target_logits(ours, batch.input_ids, batch.target_mask, batch.attention_mask, batch.position_ids)
        our_logps = selective_log_softmax(out.logits, out.targets)  # [N], row-major over (row, col)
    our_metrics = {"entropy": stats["entropy_sum"] / targets, "mean_token_accuracy": stats["correct"] / targets}

    # TRL: its dataset preparation and collator, then compute_loss (no num_items_in_batch: a mean over targets).
    theirs = copy.deepcopy(model)
    # TRL refuses `max_length` with padding-free batches that it does not pack; the rows here fit in `max_length`.
    args = trl_args(SFTConfig, work, max_length=None if padding_free else max_length, packing=packing,
                    padding_free=padding_free,
                    completion_only_loss=True, assistant_only_loss=assistant, dataset_num_proc=None)
    trl_tokenizer = copy.deepcopy(tokenizer)
    if assistant:
        trl_tokenizer.chat_template = MARKED_TEMPLATES[markers]
    trainer = SFTTrainer(model=theirs, args=args, train_dataset=rows, processing_class=trl_tokenizer)
    loss, inputs, trl_out = trl_step(trainer)
    trl_logps = trl_out.log_probs[trl_out.label_mask.bool()].detach()

    case = (f"assistant-only (messages), {markers} markers" if assistant
            else "completion-only (prompt/completion)") + (", packed" if packing else "") + (
        ", padding-free" if padding_free else "")
    if packing or padding_free:  # TRL's log_probs[:, t] is the log-prob of token t + 1
        trl_rows, trl_cols = trl_out.label_mask.nonzero(as_tuple=True)
        same, logprob_diff = compare_packed(
            by_example(batch.input_ids, batch.position_ids, out.rows, out.cols, our_logps),
            by_example(inputs["input_ids"], inputs["position_ids"], trl_rows, trl_cols + 1, trl_logps))
        return row("sft", case, same, logprob_diff, (float(nll.detach() / targets), float(loss.detach())),
                   (grad_norm(ours), grad_norm(theirs)), shared_metrics(our_metrics, trainer._metrics["train"]),
                   (batch.input_ids.shape, inputs["input_ids"].shape))
    # Same sequences (unpadded) and the same targets (a target at column t is predicted from t − 1).
    same = same_batch(batch.input_ids, inputs["input_ids"], batch.attention_mask, batch.target_mask[:, 1:],
                      (inputs["labels"] != -100)[:, 1:])
    logprob_diff = float((our_logps - trl_logps).abs().max()) if our_logps.shape == trl_logps.shape else None
    return row("sft", case, same, logprob_diff, (float(nll.detach() / targets), float(loss.detach())),
               (grad_norm(ours), grad_norm(theirs)), shared_metrics(our_metrics, trainer._metrics["train"]),
               (batch.input_ids.shape, inputs["input_ids"].shape),
               note=target_difference(tokenizer, batch.input_ids[:, 1:], batch.target_mask[:, 1:],
                                      (inputs["labels"] != -100)[:, 1:]) if same[0] and same[1] else "")


# ----------------------------------------------------------------------------------------------
# DPO with a frozen reference model (a copy of the starting model on both sides)


def dpo_case(model, tokenizer, model_dir: Path, work: Path, *, loss_type: str, beta: float, max_length: int,
             count: int, padding_free: bool = False, precompute: bool = False,
             label_smoothing: float = 0.0, chat: bool = False) -> dict[str, Any]:
    """One DPO step; alignflow padded as TRL (or packed with `padding_free`), the reference scored during the step
    (or before it with `precompute`: alignflow's cache of (chosen, rejected) sums, TRL's dataset columns). `chat`:
    the same pairs as conversations (a user turn, then each answer as an assistant turn), through the chat template."""
    import datasets
    import torch
    from trl import DPOConfig, DPOTrainer

    from trainer.algorithms.logprobs import selective_log_softmax, target_logits
    from trainer.stages.dpo import DPOConfig as OurDPOConfig
    from trainer.stages.dpo import Reference, collate, freeze, load_split, metric_means, pair_loss

    rows = read_rows("preferences.jsonl", count)
    if chat:
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
                 **{k: [{"role": "assistant", "content": r[k].strip()}] for k in ("chosen", "rejected")}} for r in rows]
    rows = datasets.Dataset.from_list(rows)

    # alignflow: TRL's layout (2B right-padded rows) or its default padding-free one (packed rows).
    config = OurDPOConfig(model=str(model_dir), dataset="parity", loss_type=loss_type, beta=beta,
                          label_smoothing=label_smoothing, max_length=max_length, padding_free=padding_free,
                          truncation_mode="keep_start")
    data = load_split(rows, "parity", tokenizer, config)
    pairs = list(range(len(data)))
    padded = collate(data, pairs, tokenizer.pad_token_id, pack_to=0)  # compared with TRL's batch
    batch = collate(data, pairs, tokenizer.pad_token_id, pack_to=max_length if padding_free else 0)
    policy = perturbed(model)
    ours = copy.deepcopy(policy).train()
    reference = Reference(model=freeze(copy.deepcopy(model)))
    if precompute:  # what Reference.precompute stores, from one padded batch: [pairs, 2]
        reference.cache["train"] = reference.compute(padded).view(2, -1).T
    ref_logps = reference.logps(batch, "train")
    loss_ours, sums = pair_loss(ours, batch, ref_logps, config)
    loss_ours.backward()
    with torch.no_grad():
        out = target_logits(ours, batch.input_ids, batch.completion_mask, batch.attention_mask, batch.position_ids)
        owner = batch.sequence[out.rows, out.cols]  # [N] which of the 2B sequences
        # Packed rows hold the sequences in another order: sort the targets back to sequence order (stable).
        our_logps = selective_log_softmax(out.logits, out.targets)[torch.argsort(owner, stable=True)]  # [N]

    # TRL: the same policy, and a copy of the starting weights as its ref_model (both references identical).
    theirs = copy.deepcopy(policy)
    args = trl_args(DPOConfig, work, max_length=max_length, truncation_mode="keep_start", beta=beta,
                    loss_type=[loss_type], label_smoothing=label_smoothing, precompute_ref_log_probs=precompute,
                    eval_strategy="no",
                    dataset_num_proc=None)
    trainer = DPOTrainer(model=theirs, ref_model=copy.deepcopy(model), args=args, train_dataset=rows,
                         processing_class=tokenizer)
    loss_trl, inputs, trl_out = trl_step(trainer)
    shift_mask = inputs["completion_mask"][:, 1:].bool()
    trl_logps = trl_out.log_probs[:, -shift_mask.size(1):][shift_mask].detach()

    # alignflow never makes a sequence's first token a target; TRL's column 0 cannot be one either (shifted).
    same = same_batch(padded.input_ids, inputs["input_ids"], padded.attention_mask, padded.completion_mask[:, 1:],
                      shift_mask)
    logprob_diff = float((our_logps - trl_logps).abs().max()) if our_logps.shape == trl_logps.shape else None
    case = (f"{loss_type}{f' (label_smoothing {label_smoothing})' if label_smoothing else ''}, "
            f"{'precomputed' if precompute else 'frozen'} reference" + (", alignflow padding-free" if padding_free else "")
            + (", chat pairs" if chat else ""))
    return row("dpo", case, same, logprob_diff,
               (float(loss_ours.detach()), float(loss_trl.detach())), (grad_norm(ours), grad_norm(theirs)),
               shared_metrics(metric_means(sums), trainer._metrics["train"]),
               (batch.input_ids.shape, inputs["input_ids"].shape))


# ----------------------------------------------------------------------------------------------
# Reward model: Bradley-Terry (optionally with reward centring)


def reward_case(model_dir: Path, tokenizer, work: Path, *, center: float | None, max_length: int,
                count: int, margin: bool = False, padding_free: bool = False) -> dict[str, Any]:
    """One Bradley-Terry step; with `margin`, the rows carry a `margin` column (0.5, 1.0, ...) that both subtract
    from the score difference; with `padding_free`, alignflow scores its texts packed into rows of at most
    `max_length` (TRL pads)."""
    import datasets
    import torch
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from trainer.algorithms.preference import bradley_terry_loss
    from trainer.data.preferences import tokenize_reward_pairs
    from trainer.stages.reward_model import collate, pair_rewards

    rows = datasets.Dataset.from_list([{**r, "margin": 0.5 * (i + 1)} if margin else r
                                       for i, r in enumerate(read_rows("preferences.jsonl", count))])
    torch.manual_seed(0)  # the score head is new: initialise it once, then copy it to both sides
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id

    ours = copy.deepcopy(model).train()
    data = tokenize_reward_pairs(rows, tokenizer, "parity", max_length, "keep_end")  # as the stage's `prepare`
    padded = collate(data, list(range(len(data))), tokenizer.pad_token_id)  # compared with TRL's batch
    batch = collate(data, list(range(len(data))), tokenizer.pad_token_id, pack_to=max_length if padding_free else 0)
    chosen, rejected = pair_rewards(ours, batch)
    loss_ours, stats = bradley_terry_loss(chosen, rejected, batch.margin, center)
    loss_ours.backward()
    our_scores = torch.cat([chosen, rejected]).detach()

    theirs = copy.deepcopy(model)
    args = trl_args(RewardConfig, work, max_length=max_length, center_rewards_coefficient=center,
                    eval_strategy="no", dataset_num_proc=None)
    trainer = RewardTrainer(model=theirs, args=args, train_dataset=rows, processing_class=tokenizer)
    loss_trl, inputs, trl_out = trl_step(trainer)
    trl_scores = trl_out.logits.squeeze(-1).detach()

    # The reward is read at each row's last token: the attention masks are the targets here.
    same = same_batch(padded.input_ids, inputs["input_ids"], padded.attention_mask, padded.attention_mask,
                      inputs["attention_mask"])
    score_diff = float((our_scores - trl_scores).abs().max()) if our_scores.shape == trl_scores.shape else None
    case = ("Bradley-Terry" + (f", center_rewards_coefficient {center}" if center is not None else "")
            + (", margin column" if margin else "") + (", alignflow padding-free" if padding_free else ""))
    return row("reward", case, same, score_diff, (float(loss_ours.detach()), float(loss_trl.detach())),
               (grad_norm(ours), grad_norm(theirs)),
               shared_metrics({k: float(v) for k, v in stats.items()}, trainer._metrics["train"]),
               (batch.input_ids.shape, inputs["input_ids"].shape), note="scores (not log-probs) in the log-prob column")


# ----------------------------------------------------------------------------------------------
# GRPO: the policy loss on given completions (no generation)


def grpo_case(model, tokenizer, work: Path, *, beta: float, bias_correction: bool | None, max_length: int,
              count: int, shared: bool = False) -> dict[str, Any]:
    """One GRPO update (TRL's default loss_type dapo, epsilon 0.2) on fixed completions: each preference pair is a
    group of G = 2 completions of its prompt (chosen, rejected, each + eos), with fixed advantages (+1, −1 scaled
    per group). The policy is the model plus noise and the old (rollout-time) policy and the reference are the model,
    so the ratios are not 1 and some clip. Both sides get the same old and reference log-probs (alignflow's
    `token_logps` on the model). `bias_correction`: TRL's `use_bias_correction_kl` (None = its default); `shared`:
    alignflow runs each group's prompt once (`share_prompts`, as its GRPO stage does), TRL once per completion."""
    import datasets
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from trainer.algorithms.policy import policy_loss
    from trainer.engine.completions import RolloutBatch, token_logps

    pairs = read_rows("preferences.jsonl", count)
    eos = tokenizer.eos_token_id
    prompts = [tokenizer(p["prompt"])["input_ids"] for p in pairs]
    completions = [tokenizer(p[k], add_special_tokens=False)["input_ids"][:max_length] + [eos]
                   for p in pairs for k in ("chosen", "rejected")]
    rows = [prompts[i // 2] for i in range(len(completions))]
    width_p, width_c = max(map(len, rows)), max(map(len, completions))
    n = len(completions)
    prompt_ids = torch.full((n, width_p), tokenizer.pad_token_id)
    prompt_mask = torch.zeros((n, width_p), dtype=torch.long)
    completion_ids = torch.full((n, width_c), tokenizer.pad_token_id)
    completion_mask = torch.zeros((n, width_c), dtype=torch.long)
    for i, (p, c) in enumerate(zip(rows, completions)):  # prompts left-padded, completions right-padded
        prompt_ids[i, width_p - len(p):], prompt_mask[i, width_p - len(p):] = torch.tensor(p), 1
        completion_ids[i, :len(c)], completion_mask[i, :len(c)] = torch.tensor(c), 1
    advantages = torch.tensor([1.0, -1.0] * (n // 2)) * torch.linspace(0.5, 1.5, n)  # [N]
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    full_mask = torch.cat([torch.zeros_like(prompt_mask), completion_mask], 1)
    batch = RolloutBatch(input_ids, attention, full_mask, torch.zeros(input_ids.shape), completion_mask.sum(1),
                         torch.zeros(n, dtype=torch.bool), width_p)

    with torch.no_grad():
        old, _ = token_logps(model.eval(), batch, slice(None))  # [N, P+C]; also the reference
    model.train()
    tokens = float(completion_mask.sum())

    corrected = GRPOConfig.use_bias_correction_kl if bias_correction is None else bias_correction
    # alignflow: as `grpo.update` for one micro-batch holding the whole cycle.
    policy = perturbed(model)
    ours = copy.deepcopy(policy).train()
    logps, ent = token_logps(ours, batch, slice(None), with_entropy=True, group_size=2 if shared else 0)
    loss_ours, stats = policy_loss(logps, old, advantages, full_mask, loss_type="dapo", epsilon=0.2,
                                   ref_logps=old if beta else None, beta=beta, max_completion_length=width_c,
                                   num_items_in_batch=tokens, use_bias_correction_kl=corrected)
    loss_ours.backward()
    our_metrics = {"entropy": ent, **{k: float(v) for k, v in stats.items() if v.ndim == 0}}

    # TRL: the inputs its generation step would hand to compute_loss.
    theirs = copy.deepcopy(policy)
    extra = {} if bias_correction is None else {"use_bias_correction_kl": bias_correction}
    args = trl_args(GRPOConfig, work, loss_type="dapo", beta=beta, epsilon=0.2, num_generations=2,
                    max_completion_length=width_c, temperature=1.0, **extra)
    prompts_ds = datasets.Dataset.from_list([{"prompt": p["prompt"]} for p in pairs])
    trainer = GRPOTrainer(model=theirs, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=prompts_ds, processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1  # set by `training_step` during training
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages,
              "old_per_token_logps": old[:, width_p:], "num_items_in_batch": torch.tensor(tokens)}
    if beta:
        inputs["ref_per_token_logps"] = old[:, width_p:]
    theirs.train()
    loss_trl = trainer.compute_loss(trainer.model, inputs)
    loss_trl.backward()
    with torch.no_grad():
        trl_logps = trainer._get_per_token_logps_and_entropies(theirs, input_ids, attention, width_c)[0]

    mask = completion_mask.bool()
    logprob_diff = float((logps[:, width_p:][mask] - trl_logps[mask]).abs().max())
    case = ("dapo" + (f", beta {beta}, use_bias_correction_kl={corrected}"
                      + (" (TRL's default)" if bias_correction is None else "") if beta else ", beta 0")
            + (", alignflow shared prompts" if shared else ""))
    return row("grpo", case, (True, 0), logprob_diff, (float(loss_ours.detach()), float(loss_trl.detach())),
               (grad_norm(ours), grad_norm(theirs)), shared_metrics(our_metrics, trainer._metrics["train"]),
               (input_ids.shape, input_ids.shape))


# ----------------------------------------------------------------------------------------------
# The table


def status(result: dict[str, Any], tolerance: float) -> str:
    if "error" in result:
        return "error"
    if not result["ids_equal"]:
        return "ids differ"
    if result["targets_differing"]:
        return "targets differ"
    diffs = [result["loss_rel_diff"], result["grad_norm_rel_diff"]]
    # A logged metric passes within `tolerance` relative or absolute (as math.isclose with both): a mean margin near
    # zero differs relatively by float rounding alone.
    metrics_ok = all(m["rel_diff"] <= tolerance or abs(m["alignflow"] - m["trl"]) <= tolerance
                     for m in result["metrics"].values())
    logprob = result["logprob_max_abs_diff"]
    ok = logprob is not None and logprob <= tolerance and all(d <= tolerance for d in diffs) and metrics_ok
    return "match" if ok else "DIFFERS"


def worst_metric(result: dict[str, Any]) -> str:
    metrics = result.get("metrics") or {}
    if not metrics:
        return "-"
    name = max(metrics, key=lambda k: metrics[k]["rel_diff"])
    return f"{name} {metrics[name]['rel_diff']:.1e}"


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--cases", default=",".join(CASES), help=f"Comma-separated, from: {', '.join(CASES)}.")
    parser.add_argument("--model", type=Path, default=None,
                        help="A causal LM folder with its tokenizer (default: a fresh `init-tiny` model).")
    parser.add_argument("--rows", type=int, default=4, help="Rows (examples or pairs) in the batch.")
    parser.add_argument("--max-length", type=int, default=256, help="max_length on both sides.")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO's beta on both sides.")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="Largest relative (and log-prob) diff that passes.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads.")
    parser.add_argument("--out", type=Path, default=RESULT,
                        help="Result JSON (default benchmarks/results/parity.json).")
    args = parser.parse_args()
    cases = common.parse_list(args.cases, CASES, "case")
    if importlib.util.find_spec("trl") is None:
        sys.exit(f"TRL is not installed: {TRL_PIN} (the `bench` extra pins it).")

    started, load_before = common.clock(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="alignflow-parity-") as tmp:
        work = Path(tmp)
        os.environ["ALIGNFLOW_CACHE"] = str(work / "cache")  # tokenized data stays in the temp dir
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        common.torch_threads(args.threads)
        model_dir = args.model or common.model_path("tiny", work, common.SMOLLM2)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        settings = dict(max_length=args.max_length, count=args.rows)
        runners: dict[str, Callable[[], dict[str, Any]]] = {
            "sft-completion": lambda: sft_case(model, tokenizer, work, markers=None, **settings),
            "sft-assistant": lambda: sft_case(model, tokenizer, work, markers="trl", **settings),
            "sft-assistant-span": lambda: sft_case(model, tokenizer, work, markers="span", **settings),
            "sft-completion-packed": lambda: sft_case(model, tokenizer, work, markers=None, packing=True, **settings),
            "sft-completion-padding-free": lambda: sft_case(model, tokenizer, work, markers=None, padding_free=True,
                                                            **settings),
            **{f"dpo-{t}": (lambda t=t: dpo_case(model, tokenizer, model_dir, work, loss_type=t, beta=args.beta,
                                                   **settings)) for t in ("sigmoid", "ipo", "hinge", "apo_zero")},
            "dpo-robust": lambda: dpo_case(model, tokenizer, model_dir, work, loss_type="robust", beta=args.beta,
                                           label_smoothing=0.1, **settings),
            "dpo-sigmoid-padding-free": lambda: dpo_case(model, tokenizer, model_dir, work, loss_type="sigmoid",
                                                         beta=args.beta, padding_free=True, **settings),
            "dpo-sigmoid-chat": lambda: dpo_case(model, tokenizer, model_dir, work, loss_type="sigmoid",
                                                 beta=args.beta, chat=True, **settings),
            "dpo-sigmoid-precomputed": lambda: dpo_case(model, tokenizer, model_dir, work, loss_type="sigmoid",
                                                        beta=args.beta, precompute=True, **settings),
            "reward": lambda: reward_case(model_dir, tokenizer, work, center=None, **settings),
            "reward-center": lambda: reward_case(model_dir, tokenizer, work, center=0.01, **settings),
            "reward-margin": lambda: reward_case(model_dir, tokenizer, work, center=None, margin=True, **settings),
            "reward-padding-free": lambda: reward_case(model_dir, tokenizer, work, center=None, padding_free=True,
                                                       **settings),
            "grpo": lambda: grpo_case(model, tokenizer, work, beta=0.0, bias_correction=None, **settings),
            "grpo-shared-prompts": lambda: grpo_case(model, tokenizer, work, beta=0.0, bias_correction=None,
                                                     shared=True, **settings),
            "grpo-kl": lambda: grpo_case(model, tokenizer, work, beta=0.04, bias_correction=False, **settings),
            "grpo-kl-trl-default": lambda: grpo_case(model, tokenizer, work, beta=0.04, bias_correction=None,
                                                     **settings),
        }
        results = []
        for name in cases:
            torch.manual_seed(0)
            try:
                result = runners[name]()
            except Exception as error:  # one broken case must not hide the others
                result = {"stage": name.split("-")[0], "case": name, "error": f"{type(error).__name__}: {error}"}
            result["status"] = status(result, args.tolerance)
            results.append(result)
            print(f"{name}: {result['status']}", file=sys.stderr)

    table = [[r["stage"], r["case"], r.get("logprob_max_abs_diff"), r.get("loss_rel_diff"),
              r.get("grad_norm_rel_diff"), worst_metric(r), r["status"]] for r in results]
    common.print_header("Parity with TRL 1.16", f"float32, {args.rows} rows, one forward and backward per side",
                        started, load_before)
    print(common.format_table(["stage", "case", "logprob max abs diff", "loss rel diff", "grad-norm rel diff",
                               "worst shared metric (rel diff)", "status"], table))
    for r in results:
        if r.get("error") or r.get("note"):
            print(f"- {r['stage']} {r['case']}: {r.get('error') or r['note']}")
    common.write_json(args.out, "parity", args, results, [], tolerance=args.tolerance)


if __name__ == "__main__":
    main()
