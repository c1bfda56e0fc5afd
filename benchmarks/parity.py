"""Numerical parity with TRL 1.16 (PPO: 1.12): each objective's loss, gradient and metrics on one identical batch.

For every case, one tiny random Llama (`alignflow model init-tiny`, or `--model`) in float32 is copied
twice. One copy goes through alignflow's own batch and loss code (the functions its stages call:
`tokenize_sft` + `sft.collate` + `sft.token_loss`; `dpo.load_split` + `dpo.collate` + `dpo.pair_loss`
with a frozen `dpo.Reference`; `tokenize_reward_pairs` + `reward_model.collate` + `bradley_terry_loss`;
`token_logps` + `policy_loss`; for scored GRPO/RLOO also `combine_rewards` + `ADVANTAGE_ESTIMATORS` +
`batched_logps`; PPO's `policy_forward` + `kl_penalty_rewards` + `gae_advantages` + `masked_whiten` +
`ppo_policy_loss` + `value_loss`), the other through TRL's trainer (its own dataset preparation and collator, then
`trainer.compute_loss(model, inputs)`; GRPO/RLOO: its `_generate_and_score_completions`; PPO: its `train()`).
Each side runs ONE forward and backward; nothing is trained.

Compared, per case:
- token ids: both sides must see the same sequences and the same loss targets (checked; a mismatch
  is reported as the difference, not hidden);
- per-token log-probabilities of the loss targets (max abs diff; the reward model: its scores; scored GRPO, RLOO
  and PPO: the worst of the policy's, the old (rollout) policy's and the reference's);
- the loss and the total L2 gradient norm over all parameters (relative diff);
- scored GRPO and RLOO: the advantages each side computed from the same rewards (max abs diff); PPO: the scores,
  values, GAE advantages (whitened) and returns (max abs diff, in the JSON);
- every metric both trainers log for that step under the same name (relative diff; PPO: alignflow's `ppo/...`
  names mapped to TRL's, `PPO_METRIC_NAMES`).

A row matches when both sides saw the same ids and targets and every relative diff (and the log-prob and
advantage diffs) is within `--tolerance` (default 1e-5); otherwise its status says what differs, and a note names
the tokens when the loss targets do. "definition differs": the objectives differ by design and the row shows that
this is the whole difference, by recomputing one side's objective with the other's definition (PPO: TRL's tensors
with alignflow's definition; RLOO: alignflow's tensors in TRL's objective) within the tolerance.

Cases: SFT completion-only (padded and packed) and assistant-only, the latter with TRL's
`{% generation %}` markers placed two ways (see MARKED_TEMPLATES); DPO sigmoid, ipo, hinge, robust (label smoothing
0.1) and apo_zero with a frozen reference, sigmoid with alignflow's padding-free layout, and with a
precomputed reference (the DPO policy is the model plus seeded noise, so that log-ratios are not all
zero); the reward model's Bradley-Terry loss with and without `center_rewards_coefficient` and with a
`margin` column; GRPO's policy loss (dapo) on fixed completions with given old and reference log-probs,
without and with a KL term (`use_bias_correction_kl` off, and at TRL's default, on, on both sides); GRPO scored by
each side (`grpo_scored_case`: fixed completions and rewards, TRL's generation step replaced): loss types grpo,
bnpo, dr_grpo and dapo at the second iteration (num_iterations 2, TRL computes the old log-probs), temperature 0.7
with beta 0.04, `scale_rewards` batch and none, and temperature 0.7 + beta + num_iterations 2; RLOO against TRL
1.16's RLOOTrainer (`rloo_case`); PPO against TRL 1.12's PPOTrainer at temperature 1 and 0.7 (`ppo_case`: one
`train()` step on fixed rollouts). Data: the first `--rows` rows of trainer/demo_data (sft.jsonl, chat.jsonl,
preferences.jsonl). TRL is imported only when the script runs; without it the script exits naming
`pip install trl==1.16.0`. TRL 1.13 removed PPOTrainer: `--trl-ppo-path DIR` (with
`pip install --no-deps --target DIR trl==1.12.0`) runs the ppo cases in a child process with that TRL and merges
them into the same table and JSON.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common

DEMO = common.REPO / "trainer" / "demo_data"
RESULT = common.REPO / "benchmarks" / "results" / "parity.json"
CASES = ("sft-completion", "sft-assistant", "sft-assistant-span", "sft-completion-packed",
         "sft-completion-padding-free", "dpo-sigmoid", "dpo-ipo", "dpo-hinge", "dpo-robust", "dpo-apo_zero", "dpo-sigmoid-padding-free",
         "dpo-sigmoid-chat", "dpo-sigmoid-precomputed",
         "reward", "reward-center", "reward-margin", "reward-padding-free", "grpo", "grpo-shared-prompts", "grpo-kl",
         "grpo-kl-trl-default", "grpo-loss-grpo", "grpo-loss-bnpo", "grpo-loss-dr_grpo", "grpo-loss-dapo",
         "grpo-temperature-kl", "grpo-scale-batch", "grpo-scale-none", "grpo-iterations-kl", "rloo", "ppo", "ppo-temperature")
TRL_PPO_PIN = "pip install --no-deps --target DIR trl==1.12.0"
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
    settings = {"per_device_train_batch_size": 8, **settings}
    return config_class(output_dir=str(work / "trl"), report_to="none", use_cpu=True, bf16=False, fp16=False,
                        gradient_checkpointing=False, save_strategy="no", disable_tqdm=True,
                        dataloader_num_workers=0, seed=0, **settings)


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


def group_completions(tokenizer, pairs: list[dict], max_length: int, group: int) -> tuple[list, list]:
    """Each preference pair as a group of `group` completions of its prompt, each + eos: chosen and rejected, then
    (group 4) their first halves. Returns the prompt token ids and the completion token ids, one per completion."""
    eos = tokenizer.eos_token_id
    prompts, completions = [], []
    for pair in pairs:
        prompt = tokenizer(pair["prompt"])["input_ids"]
        answers = [tokenizer(pair[k], add_special_tokens=False)["input_ids"][:max_length] for k in ("chosen", "rejected")]
        answers += [a[:max(1, len(a) // 2)] for a in answers][:group - 2]
        prompts += [prompt] * group
        completions += [a + [eos] for a in answers]
    return prompts, completions


@dataclass
class Layout:
    """Rollouts as both sides batch them: prompts left-padded [N, P], completions right-padded [N, C]; `batch` is
    alignflow's `RolloutBatch` of the same rows [N, P+C]."""

    prompt_ids: Any
    prompt_mask: Any
    completion_ids: Any
    completion_mask: Any
    batch: Any

    @classmethod
    def build(cls, prompts: list[list[int]], completions: list[list[int]], pad: int) -> Layout:
        import torch

        from trainer.engine.completions import RolloutBatch

        width_p, width_c, n = max(map(len, prompts)), max(map(len, completions)), len(completions)
        prompt_ids, completion_ids = torch.full((n, width_p), pad), torch.full((n, width_c), pad)
        prompt_mask = torch.zeros((n, width_p), dtype=torch.long)
        completion_mask = torch.zeros((n, width_c), dtype=torch.long)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            prompt_ids[i, width_p - len(p):], prompt_mask[i, width_p - len(p):] = torch.tensor(p), 1
            completion_ids[i, :len(c)], completion_mask[i, :len(c)] = torch.tensor(c), 1
        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        batch = RolloutBatch(input_ids, torch.cat([prompt_mask, completion_mask], 1),
                             torch.cat([torch.zeros_like(prompt_mask), completion_mask], 1),
                             torch.zeros(input_ids.shape), completion_mask.sum(1), torch.zeros(n, dtype=torch.bool),
                             width_p)
        return cls(prompt_ids, prompt_mask, completion_ids, completion_mask, batch)

    @property
    def width_p(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def width_c(self) -> int:
        return self.completion_ids.shape[1]

    @property
    def input_ids(self):
        return self.batch.input_ids

    @property
    def attention(self):
        return self.batch.attention_mask

    @property
    def full_mask(self):
        return self.batch.completion_mask


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
    from trainer.engine.completions import token_logps

    pairs = read_rows("preferences.jsonl", count)
    rows, completions = group_completions(tokenizer, pairs, max_length, group=2)
    layout = Layout.build(rows, completions, tokenizer.pad_token_id)
    prompt_ids, prompt_mask, completion_ids, completion_mask = (
        layout.prompt_ids, layout.prompt_mask, layout.completion_ids, layout.completion_mask)
    width_p, width_c, n = layout.width_p, layout.width_c, len(completions)
    advantages = torch.tensor([1.0, -1.0] * (n // 2)) * torch.linspace(0.5, 1.5, n)  # [N]
    input_ids, attention, full_mask, batch = layout.input_ids, layout.attention, layout.full_mask, layout.batch

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


# Fixed rewards of the scored GRPO cases: 4 groups of G = 4; the third group is constant (std 0, advantages 0).
GROUP_REWARDS = (1.0, 0.0, 0.25, 2.0, -0.5, 1.5, 0.75, 0.0, 0.5, 0.5, 0.5, 0.5, 3.0, -1.0, 0.0, 1.25)


def grpo_scored_case(model, tokenizer, work: Path, *, loss_type: str, temperature: float = 1.0, beta: float = 0.0,
                     scale_rewards: str = "group", num_iterations: int = 1, max_length: int,
                     count: int) -> dict[str, Any]:
    """One GRPO update where each side computes its own advantages, old and reference log-probs.

    The rollouts are fixed: each preference pair is a group of G = 4 completions of its prompt (chosen, rejected and
    their first halves, each + eos), with fixed rewards (`GROUP_REWARDS`, one group constant). The generating policy
    is the model plus noise (the reference is the model, so KL terms are not 0). alignflow: what its GRPO stage's
    `rollout` and `update` call, in order: `combine_rewards` -> `ADVANTAGE_ESTIMATORS["grpo"]` (`scale_rewards`) ->
    `batched_logps` at `logit_temperature(temperature)` for the old policy (num_iterations > 1) and the reference
    (beta > 0) -> `token_logps` + `policy_loss`. TRL: `GRPOTrainer._generate_and_score_completions` with only its
    generation step (`_generate`) replaced by one that returns these completions, and a reward function that returns
    these rewards: TRL pads, scores, normalises and computes its old and reference log-probs itself; then
    `compute_loss` on its output. With `num_iterations` 2 the update runs at the second iteration: the policy has
    moved since the rollout (the generating policy plus more noise on both sides), so the ratios are not 1."""
    import datasets
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from trainer.algorithms.advantages import ADVANTAGE_ESTIMATORS, combine_rewards
    from trainer.algorithms.logprobs import logit_temperature
    from trainer.algorithms.policy import policy_loss
    from trainer.engine.completions import batched_logps, token_logps
    from trainer.stages.rl.grpo import GRPOConfig as OurGRPOConfig

    G = 4
    pairs = read_rows("preferences.jsonl", count)
    prompts, completions = group_completions(tokenizer, pairs, max_length, group=G)
    layout = Layout.build(prompts, completions, tokenizer.pad_token_id)
    n, width_c, P = len(completions), layout.width_c, layout.width_p
    rewards = torch.tensor([GROUP_REWARDS[i % len(GROUP_REWARDS)] for i in range(n)])  # [N]
    generating = perturbed(model)  # the policy that sampled the completions
    updated = perturbed(generating, scale=0.01, seed=2) if num_iterations > 1 else generating
    # TRL's default (use_bias_correction_kl true) is also alignflow's; both sides run with it.
    corrected = OurGRPOConfig.use_bias_correction_kl

    # alignflow: as `grpo.rollout` and `grpo.update` for one micro-batch holding the whole cycle.
    T = logit_temperature(temperature)
    combined = combine_rewards(rewards[:, None], torch.ones(1))  # [N]
    our_adv, reward_stats = ADVANTAGE_ESTIMATORS["grpo"](combined, G, scale_rewards)
    old = batched_logps(copy.deepcopy(generating).eval(), layout.batch, n, 0, T) if num_iterations > 1 else None
    ref = batched_logps(copy.deepcopy(model).eval(), layout.batch, n, 0, T) if beta else None
    ours = copy.deepcopy(updated).train()
    logps, ent = token_logps(ours, layout.batch, slice(None), with_entropy=True, temperature=T)
    loss_ours, stats = policy_loss(logps, old, our_adv, layout.full_mask, loss_type=loss_type, epsilon=0.2,
                                   ref_logps=ref, beta=beta, max_completion_length=width_c,
                                   num_items_in_batch=float(layout.completion_mask.sum()),
                                   use_bias_correction_kl=corrected)
    loss_ours.backward()
    our_metrics = {"entropy": ent, **{k: float(v) for k, v in {**stats, **reward_stats}.items() if v.ndim == 0},
                   "rewards/fixed_reward/mean": float(torch.nanmean(rewards)),
                   "rewards/fixed_reward/std": float(rewards.std())}

    # TRL: its scoring path on these completions and rewards.
    def fixed_reward(completions, **_):
        assert len(completions) == n
        return rewards.tolist()

    theirs = copy.deepcopy(generating)
    args = trl_args(GRPOConfig, work, loss_type=loss_type, beta=beta, epsilon=0.2, num_generations=G,
                    max_completion_length=width_c, temperature=temperature, scale_rewards=scale_rewards,
                    num_iterations=num_iterations, use_bias_correction_kl=corrected)
    texts = [p["prompt"] for p in pairs]
    trainer = GRPOTrainer(model=theirs, reward_funcs=fixed_reward, args=args,
                          train_dataset=datasets.Dataset.from_list([{"prompt": t} for t in texts]),
                          processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1  # set by `training_step` during training

    def generate(prompt_texts):  # TRL's `_generate` without the sampling: these prompts' fixed completions
        assert prompt_texts == [t for t in texts for _ in range(G)]
        decoded = tokenizer.batch_decode(completions, skip_special_tokens=True)
        return prompts, completions, None, decoded, None, {}, None, []

    trainer._generate = generate
    theirs.train()
    inputs = trainer._generate_and_score_completions([{"prompt": t} for t in texts for _ in range(G)])
    if num_iterations > 1:  # the second iteration: the policy has moved since the rollout
        theirs.load_state_dict(updated.state_dict())
    loss_trl = trainer.compute_loss(trainer.model, inputs)
    loss_trl.backward()
    with torch.no_grad():
        trl_logps = trainer._get_per_token_logps_and_entropies(theirs, layout.input_ids, layout.attention, width_c)[0]

    same_ids = bool(torch.equal(inputs["prompt_ids"], layout.prompt_ids)
                    and torch.equal(inputs["completion_ids"], layout.completion_ids))
    differing = int((inputs["completion_mask"].bool() != layout.completion_mask.bool()).sum())
    mask = layout.completion_mask.bool()
    logprob_diff = float((logps[:, P:][mask] - trl_logps[mask]).abs().max())
    for name, our_side, trl_side in (("old", old, inputs.get("old_per_token_logps")),
                                     ("ref", ref, inputs.get("ref_per_token_logps"))):
        if (our_side is None) != (trl_side is None):
            raise RuntimeError(f"only one side computed {name} log-probs")
        if our_side is not None:  # the log-prob column holds the worst of the three
            logprob_diff = max(logprob_diff, float((our_side[:, P:][mask] - trl_side[mask]).abs().max()))
    case = (f"{loss_type}, T {temperature:g}, beta {beta:g}, scale_rewards {scale_rewards}, "
            f"num_iterations {num_iterations}, scored by each side")
    result = row("grpo", case, (same_ids, differing), logprob_diff,
                 (float(loss_ours.detach()), float(loss_trl.detach())), (grad_norm(ours), grad_norm(theirs)),
                 shared_metrics(our_metrics, trainer._metrics["train"]), (layout.input_ids.shape,) * 2)
    result["advantages_max_abs_diff"] = float((our_adv - inputs["advantages"]).abs().max())
    result["advantages"] = {"alignflow": our_adv.tolist(), "trl": inputs["advantages"].tolist()}
    return result


def rloo_case(model, tokenizer, work: Path, *, max_length: int, count: int) -> dict[str, Any]:
    """alignflow's RLOO (its GRPO stage with `advantage_estimator: rloo`, loss_type dapo) against TRL 1.16's
    RLOOTrainer on the rollouts and rewards of `grpo_scored_case`, at the second iteration (num_iterations 2), beta 0.

    The advantages (leave-one-out baseline, not normalised: both defaults) are computed by each side from the same
    rewards and must agree. The objectives differ by design (docs/ppo.md): TRL's RLOOTrainer clips a sequence-level
    ratio exp(Σ_t log π − Σ_t log π_old) and averages over sequences; alignflow's RLOO is the GRPO loss with
    leave-one-out advantages (token-level ratios, `loss_type`). So the row also recomputes TRL's objective from
    alignflow's log-probs and advantages (`alignflow_with_trl_definition`)."""
    import datasets
    import torch
    from trl import RLOOConfig, RLOOTrainer

    from trainer.algorithms.advantages import ADVANTAGE_ESTIMATORS, combine_rewards
    from trainer.algorithms.policy import policy_loss
    from trainer.engine.completions import batched_logps, token_logps

    G = 4
    pairs = read_rows("preferences.jsonl", count)
    prompts, completions = group_completions(tokenizer, pairs, max_length, group=G)
    layout = Layout.build(prompts, completions, tokenizer.pad_token_id)
    n, P = len(completions), layout.width_p
    rewards = torch.tensor([GROUP_REWARDS[i % len(GROUP_REWARDS)] for i in range(n)])  # [N]
    generating = perturbed(model)
    updated = perturbed(generating, scale=0.01, seed=2)
    mask = layout.full_mask

    combined = combine_rewards(rewards[:, None], torch.ones(1))
    our_adv, reward_stats = ADVANTAGE_ESTIMATORS["rloo"](combined, G, "group")
    old = batched_logps(copy.deepcopy(generating).eval(), layout.batch, n, 0, 1.0)
    ours = copy.deepcopy(updated).train()
    logps, ent = token_logps(ours, layout.batch, slice(None), with_entropy=True)
    loss_ours, stats = policy_loss(logps, old, our_adv, mask, loss_type="dapo", epsilon=0.2,
                                   num_items_in_batch=float(layout.completion_mask.sum()))
    loss_ours.backward()
    our_metrics = {"entropy": ent, **{k: float(v) for k, v in {**stats, **reward_stats}.items() if v.ndim == 0},
                   "rewards/fixed_reward/mean": float(torch.nanmean(rewards)),
                   "rewards/fixed_reward/std": float(rewards.std())}
    # TRL's RLOO objective on alignflow's log-probs and advantages.
    redone = copy.deepcopy(updated).train()
    seq_logps = token_logps(redone, layout.batch, slice(None))[0].mul(mask).sum(1)  # [N]
    ratio = torch.exp(seq_logps - old.mul(mask).sum(1))
    loss_redone = -torch.min(ratio * our_adv, ratio.clamp(0.8, 1.2) * our_adv).mean()
    loss_redone.backward()
    with torch.no_grad():
        low, high = (ratio < 0.8) & (our_adv < 0), (ratio > 1.2) & (our_adv > 0)
        redone_metrics = {"clip_ratio/low_mean": low.float().mean(), "clip_ratio/high_mean": high.float().mean(),
                          "clip_ratio/region_mean": (low | high).float().mean()}

    def fixed_reward(completions, **_):
        return rewards.tolist()

    theirs = copy.deepcopy(generating)
    args = trl_args(RLOOConfig, work, beta=0.0, epsilon=0.2, num_generations=G, num_iterations=2,
                    max_completion_length=layout.width_c, temperature=1.0)
    texts = [p["prompt"] for p in pairs]
    trainer = RLOOTrainer(model=theirs, reward_funcs=fixed_reward, args=args,
                          train_dataset=datasets.Dataset.from_list([{"prompt": t} for t in texts]),
                          processing_class=tokenizer)
    trainer._generate = lambda prompt_texts: (prompts, completions,
                                              tokenizer.batch_decode(completions, skip_special_tokens=True))
    theirs.train()
    inputs = trainer._generate_and_score_completions([{"prompt": t} for t in texts for _ in range(G)])
    trl_old = inputs["old_logps"]
    theirs.load_state_dict(updated.state_dict())  # the second iteration
    loss_trl = trainer.compute_loss(trainer.model, inputs)
    loss_trl.backward()
    with torch.no_grad():
        trl_logps = trainer._get_per_token_logps_and_entropies(theirs, layout.input_ids, layout.attention,
                                                               layout.width_c)[0]

    real = layout.completion_mask.bool()
    logprob_diff = max(float((logps[:, P:][real] - trl_logps[real]).abs().max()),
                       float((old.mul(mask).sum(1) - trl_old).abs().max()))
    same_ids = bool(torch.equal(inputs["prompt_ids"], layout.prompt_ids)
                    and torch.equal(inputs["completion_ids"], layout.completion_ids))
    trl_metrics = trainer._metrics["train"]
    result = row("rloo", "dapo loss (alignflow) vs sequence-level ratio (TRL), num_iterations 2, scored by each side",
                 (same_ids, int((inputs["completion_mask"].bool() != real).sum())), logprob_diff,
                 (float(loss_ours.detach()), float(loss_trl.detach())), (grad_norm(ours), grad_norm(theirs)),
                 shared_metrics(our_metrics, trl_metrics), (layout.input_ids.shape,) * 2)
    result["advantages_max_abs_diff"] = float((our_adv - inputs["advantages"]).abs().max())
    result["advantages"] = {"alignflow": our_adv.tolist(), "trl": inputs["advantages"].tolist()}
    redone_result = {"loss_rel_diff": rel_diff(float(loss_redone.detach()), float(loss_trl.detach())),
                     "loss_abs_diff": abs(float(loss_redone.detach()) - float(loss_trl.detach())),
                     "grad_norm_rel_diff": rel_diff(grad_norm(redone), grad_norm(theirs)),
                     "metrics": shared_metrics({**{k: float(v) for k, v in redone_metrics.items()},
                                                **{k: v for k, v in our_metrics.items() if not k.startswith("clip")}},
                                               trl_metrics)}
    result["alignflow_with_trl_definition"] = redone_result
    result["note"] = ("TRL's RLOOTrainer clips one ratio per sequence and averages over sequences; alignflow's "
                      f"log-probs and advantages in TRL's objective: loss {redone_result['loss_rel_diff']:.1e} "
                      f"(abs {redone_result['loss_abs_diff']:.1e}), grad norm "
                      f"{redone_result['grad_norm_rel_diff']:.1e}, worst metric {worst_metric(redone_result)}")
    return result


# ----------------------------------------------------------------------------------------------
# PPO: one PPO step on fixed rollouts against TRL 1.12's PPOTrainer (trl.experimental.ppo; 1.13 removed it)

# alignflow's PPO metric -> TRL PPOTrainer's name for the same quantity (one mini-batch: TRL's `_avg` is its value).
PPO_METRIC_NAMES = {"ppo/loss/policy": "loss/policy_avg", "ppo/loss/value": "loss/value_avg",
                    "ppo/policy/clipfrac": "policy/clipfrac_avg", "ppo/policy/approxkl": "policy/approxkl_avg",
                    "ppo/val/clipfrac": "val/clipfrac_avg"}
PPO_SETTINGS = dict(kl_coef=0.05, gamma=1.0, lam=0.95, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)


def seeded_classifier(model_dir: Path, seed: int):
    """`AutoModelForSequenceClassification` (one label) from `model_dir` with a score head drawn from `seed`."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    out = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        out.score.weight.normal_(0.0, 0.5)
    return out


def ppo_case(model, tokenizer, model_dir: Path, work: Path, *, temperature: float, max_length: int,
             count: int) -> dict[str, Any]:
    """One PPO step (one epoch, one mini-batch, one micro-batch) on fixed rollouts, each side computing its own
    rollout log-probs, reference log-probs, values, scores, KL rewards, GAE advantages (whitened) and returns.

    Models, the same on both sides: the reference is the model; the policy that generated the rollouts is the model
    plus noise; the reward model and the critic (a separate value network, TRL's `value_model`, alignflow's
    `critic: reward_model`) are sequence classifiers from the model's folder with seeded heads. The update runs as at a
    later mini-batch: between the rollout and the update, policy and critic move (more seeded noise on both sides), so
    that ratios and values clip. Rollouts: the first `count` preference prompts, each with its chosen answer + eos.
    alignflow: what `ppo.rollout` and `ppo.update` call (`policy_forward` of a `PolicyWithValue`, `batched_logps`,
    `RewardModelScorer.rewards`, `kl_penalty_rewards`, `gae_advantages`, `masked_whiten`, `ppo_policy_loss`,
    `value_loss`). TRL: `PPOTrainer.train()` for one step with only its generation (`batch_generation`) replaced by
    one that returns these completions and, as generate's scores, the rollout policy's logits / (T + 1e-7) from
    TRL's own `forward`; its optimizer records the gradient norm and changes nothing; its tensors (advantages,
    returns, ...) are read from `train()`'s frame when it logs."""
    import sys as _sys

    import datasets
    import torch
    import trl

    try:
        import trl.experimental.ppo.ppo_trainer as trl_ppo
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    except ImportError as error:
        raise RuntimeError(f"TRL {trl.__version__} has no PPOTrainer (1.13 removed it): pass --trl-ppo-path DIR after "
                           f"`{TRL_PPO_PIN}`") from error

    from trainer.algorithms.advantages import gae_advantages, kl_penalty_rewards
    from trainer.algorithms.logprobs import logit_temperature
    from trainer.algorithms.masked import masked_moments, masked_whiten
    from trainer.algorithms.policy import ppo_policy_loss, value_loss, value_stats
    from trainer.engine.completions import batched_logps
    from trainer.rewards.scorer import RewardModelScorer
    from trainer.stages.rl.ppo import PolicyWithValue, policy_forward

    cfg = PPO_SETTINGS
    # The first `count` distinct prompts (TRL's batch order is matched to alignflow's by prompt), each with its chosen
    # answer + eos.
    pairs = list({r["prompt"]: r for r in reversed(read_rows("preferences.jsonl", 10 * count))}.values())[::-1]
    prompts, completions = group_completions(tokenizer, pairs[:count], max_length, group=2)
    prompts, completions = prompts[::2], completions[::2]
    layout = Layout.build(prompts, completions, tokenizer.pad_token_id)
    n, P, C = len(completions), layout.width_p, layout.width_c
    reward_dir = work / "ppo-reward"
    seeded_classifier(model_dir, seed=0).save_pretrained(reward_dir)
    tokenizer.save_pretrained(reward_dir)
    critic = seeded_classifier(model_dir, seed=3)
    rollout_policy = perturbed(model)
    policy, moved_critic = perturbed(rollout_policy, scale=0.01, seed=2), perturbed(critic, scale=0.01, seed=4)

    # alignflow: `ppo.rollout`, then `ppo.update` for one mini-batch of one micro-batch.
    T = logit_temperature(temperature)
    batch, mask = layout.batch, layout.completion_mask  # mask [N, C]
    scorer = RewardModelScorer(str(reward_dir))
    with torch.no_grad():
        scores = scorer.rewards(batch.input_ids, batch.attention_mask)  # [N]
        old_logps, old_values = policy_forward(PolicyWithValue(copy.deepcopy(rollout_policy), copy.deepcopy(critic)),
                                               batch, slice(None), T)  # [N, C]
        ref = batched_logps(copy.deepcopy(model).eval(), batch, n, temperature=T)[:, P:]
    token_rewards, stats = kl_penalty_rewards(scores, old_logps, ref, mask, cfg["kl_coef"])
    raw_advantages, returns = gae_advantages(token_rewards, old_values, mask, cfg["gamma"], cfg["lam"])
    advantages = masked_whiten(raw_advantages, mask, moments=masked_moments(raw_advantages, mask))
    stats.update(value_stats(old_values, returns, mask))
    ours = PolicyWithValue(copy.deepcopy(policy), copy.deepcopy(moved_critic)).train()
    logps, values = policy_forward(ours, batch, slice(None), T)
    pg_loss, pg_stats = ppo_policy_loss(logps, old_logps, advantages, mask, cfg["cliprange"])
    vf_loss, vf_stats = value_loss(values, old_values, returns, mask, cfg["cliprange_value"])
    loss_ours = pg_loss + cfg["vf_coef"] * vf_loss
    loss_ours.backward()
    our_metrics = {PPO_METRIC_NAMES.get(k, k): float(v) for k, v in {**stats, **pg_stats, **vf_stats}.items()}

    # TRL: train() for one PPO step on the same rollouts.
    by_prompt = {tuple(p): c for p, c in zip(prompts, completions)}
    seen: dict[str, Any] = {}

    def fixed_generation(lm, queries, _chunk, pad, _config):  # replaces trl_ppo.batch_generation
        responses = torch.full((len(queries), C), pad)
        for i, q in enumerate(queries.tolist()):
            c = by_prompt[tuple(t for t in q if t != pad)]
            responses[i, :len(c)] = torch.tensor(c)
        query_responses = torch.cat([queries, responses], 1)
        logits = trl_forward(lm, query_responses, pad).logits[:, queries.shape[1] - 1:-1] / (temperature + 1e-7)
        seen["queries"] = queries
        return query_responses, logits

    trl_forward = trl_ppo.forward

    def moving_forward(module, query_responses, pad):  # the update's forward: policy and critic have moved
        if isinstance(module, trl_ppo.PolicyAndValueWrapper):
            if "moved" not in seen:
                module.policy.load_state_dict(policy.state_dict())
                module.value_model.load_state_dict(moved_critic.state_dict())
                seen["moved"] = True
        return trl_forward(module, query_responses, pad)

    class RecordingOptimizer(torch.optim.Optimizer):  # keeps the gradient norm; leaves the weights as they are
        def __init__(self, params):
            super().__init__(params, {"lr": 0.0})

        def step(self, closure=None):
            grads = [p.grad.detach().double().norm() for g in self.param_groups for p in g["params"]
                     if p.grad is not None]
            seen["grad_norm"] = float(torch.stack(grads).norm())

    trl_tokenizer = copy.deepcopy(tokenizer)
    trl_tokenizer.padding_side = "left"
    theirs_policy, theirs_critic = copy.deepcopy(rollout_policy), copy.deepcopy(critic)
    args = trl_args(PPOConfig, work, per_device_train_batch_size=n, num_mini_batches=1, num_ppo_epochs=1,
                    gradient_accumulation_steps=1, total_episodes=n, response_length=C, stop_token="eos",
                    temperature=temperature, kl_estimator="k1", whiten_rewards=False, missing_eos_penalty=None,
                    num_sample_generations=0, local_rollout_forward_batch_size=n, lr_scheduler_type="constant",
                    kl_coef=cfg["kl_coef"], gamma=cfg["gamma"], lam=cfg["lam"], cliprange=cfg["cliprange"],
                    cliprange_value=cfg["cliprange_value"], vf_coef=cfg["vf_coef"])
    optimizer = RecordingOptimizer(list(theirs_policy.parameters()) + list(theirs_critic.parameters()))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    from transformers import AutoModelForSequenceClassification
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1, dtype=torch.float32)
    trainer = PPOTrainer(args=args, processing_class=trl_tokenizer, model=theirs_policy,
                         ref_model=copy.deepcopy(model), reward_model=reward_model,
                         train_dataset=datasets.Dataset.from_list([{"input_ids": p} for p in prompts[:n]]),
                         value_model=theirs_critic, optimizers=(optimizer, scheduler))
    backward = trainer.accelerator.backward

    def recording_backward(loss, **kwargs):
        seen["loss"] = float(loss.detach())
        return backward(loss, **kwargs)

    def recording_log(logs, *_args, **_kwargs):  # called by train() with its tensors still alive
        seen["frame"] = dict(_sys._getframe(1).f_locals)
        seen["metrics"] = dict(logs)

    trainer.accelerator.backward, trainer.log = recording_backward, recording_log
    patched = {"batch_generation": fixed_generation, "forward": moving_forward}
    saved = {k: getattr(trl_ppo, k) for k in patched}
    try:
        for k, v in patched.items():
            setattr(trl_ppo, k, v)
        trainer.train()
    finally:
        for k, v in saved.items():
            setattr(trl_ppo, k, v)

    # TRL's rows come in its dataloader's order: put them in alignflow's.
    frame = seen["frame"]
    order = [prompts.index([t for t in q if t != tokenizer.pad_token_id]) for q in seen["queries"].tolist()]
    back = torch.tensor(order).argsort()
    same_ids = bool(torch.equal(frame["query_responses"][back], batch.input_ids))
    differing = int(((~frame["padding_mask"][back]) != mask.bool()).sum())
    real = mask.bool()

    # TRL's update forward again (its mini-batch ran the same rows, shuffled, on the same weights: the recording
    # optimizer changed none), for its per-token log-probs and for the objective recomputed from its tensors.
    out, vpred = trl_forward(trainer.model, frame["query_responses"], tokenizer.pad_token_id)
    new_logps = torch.log_softmax(out.logits[:, P - 1:-1] / (temperature + 1e-7), -1)
    new_logps = new_logps.gather(-1, frame["responses"][..., None]).squeeze(-1)  # [N, C]
    vpred = vpred[:, P - 1:-1].squeeze(-1)  # [N, C]
    recomputed = {at_eos: trl_ppo_objective(frame, new_logps, vpred, cfg, trl_ppo, at_eos) for at_eos in (False, True)}
    recomputed[True]["loss"].backward()  # TRL's zero_grad left no gradients
    with_our_definition = {"grad_norm": grad_norm(trainer.model)}

    logprob_diffs = {name: float((a[real] - b[back][real]).abs().max()) for name, a, b in (
        ("rollout", old_logps, frame["logprobs"]), ("reference", ref, frame["ref_logprobs"]),
        ("policy", logps.detach(), new_logps.detach()))}
    trl_metrics = {k: [v] for k, v in seen["metrics"].items()}
    result = row("ppo", f"k1 KL penalty, GAE, clipped value loss, T {temperature:g}, scored by each side",
                 (same_ids, differing), max(logprob_diffs.values()), (float(loss_ours.detach()), seen["loss"]),
                 (grad_norm(ours), seen["grad_norm"]), shared_metrics(our_metrics, trl_metrics),
                 (batch.input_ids.shape, frame["query_responses"].shape))
    result["trl_version"] = trl.__version__
    result["logprob_max_abs_diff_by_kind"] = logprob_diffs
    compared = {"scores": (scores, frame["scores"][back], None), "values": (old_values, frame["values"][back], real),
                "advantages": (advantages, frame["advantages"][back], real),
                "returns": (returns, frame["returns"][back], real)}
    for name, (a, b, where) in compared.items():
        result[f"{name}_max_abs_diff"] = float(((a - b).abs() if where is None else (a - b).abs()[where]).max())

    # TRL's objective recomputed from its own tensors, once as TRL defines it (which must give train()'s loss) and
    # once with alignflow's definition (score on the eos token, values and value loss up to it, approxkl over
    # completion tokens), compared with alignflow's.
    mine = recomputed[True]
    with_our_definition.update({
        "trl_definition_loss_rel_diff_from_train": rel_diff(float(recomputed[False]["loss"]), seen["loss"]),
        "loss": float(mine["loss"]), "loss_rel_diff": rel_diff(float(loss_ours.detach()), float(mine["loss"])),
        "loss_abs_diff": abs(float(loss_ours.detach()) - float(mine["loss"])),
        "grad_norm_rel_diff": rel_diff(grad_norm(ours), with_our_definition["grad_norm"]),
        "advantages_max_abs_diff": float((advantages - mine["advantages"][back]).abs()[real].max()),
        "returns_max_abs_diff": float((returns - mine["returns"][back]).abs()[real].max()),
        "metrics": shared_metrics(our_metrics, {k: [float(v)] for k, v in mine["metrics"].items()})})
    result["trl_with_alignflow_definition"] = with_our_definition
    name, worst = max(with_our_definition["metrics"].items(), key=lambda kv: kv[1]["rel_diff"])
    result["note"] = (
        "TRL adds the score one position after eos and fits values there, and averages approxkl over padding too; "
        "TRL's tensors recomputed with alignflow's definition: loss "
        f"{with_our_definition['loss_rel_diff']:.1e}, grad norm {with_our_definition['grad_norm_rel_diff']:.1e}, "
        f"advantages {with_our_definition['advantages_max_abs_diff']:.1e}, returns "
        f"{with_our_definition['returns_max_abs_diff']:.1e} (abs), worst metric {name} {worst['rel_diff']:.1e} "
        f"(abs {abs(worst['alignflow'] - worst['trl']):.1e}); TRL's own definition recomputed gives train()'s loss "
        f"to {with_our_definition['trl_definition_loss_rel_diff_from_train']:.1e}")
    return result


def trl_ppo_objective(frame: dict[str, Any], new_logps, vpred, cfg: dict[str, float], trl_ppo,
                      at_eos: bool) -> dict[str, Any]:
    """TRL PPOTrainer's rewards, GAE, whitening and loss, recomputed from the tensors of its `train()` (`frame`) and
    its update forward (`new_logps`, `vpred` [N, C], with gradients), with TRL's own `masked_mean`/`masked_whiten`.
    `at_eos` False: TRL 1.12's definition: the score one position after the eos token (the first pad; TRL issues
    #1893, #3750), values and the value loss one position past the eos, approxkl averaged over every position.
    True: alignflow's: the score on the eos token (the last action), values and value loss up to it, approxkl over
    completion tokens. Returns the total loss, TRL-named metrics, and the advantages and returns [N, C]."""
    import torch

    pad = frame["padding_mask"]  # [N, C] True after the eos token
    lengths = frame["sequence_lengths"]  # [N] column of the eos token
    width = pad.shape[1]
    if at_eos:
        value_pad, end = pad, lengths
    else:
        value_pad = frame["padding_mask_p1"]
        end = torch.where(lengths + 1 < width, lengths + 1, lengths)
    values = frame["values"].masked_fill(value_pad, 0)
    rewards = -cfg["kl_coef"] * frame["kl"]
    rewards[torch.arange(len(end)), end] += frame["scores"]
    advantages, last = torch.zeros_like(rewards), 0.0
    for t in reversed(range(width)):  # GAE (Schulman et al. 2016, Eq. 16), V after the last column 0
        following = values[:, t + 1] if t + 1 < width else 0.0
        last = rewards[:, t] + cfg["gamma"] * following - values[:, t] + cfg["gamma"] * cfg["lam"] * last
        advantages[:, t] = last
    returns = advantages + values
    advantages = trl_ppo.masked_whiten(advantages, ~pad).masked_fill(pad, 0)

    new_logps = new_logps.masked_fill(pad, 1.0)  # TRL's INVALID_LOGPROB, as `logprobs` holds it
    vpred = vpred.masked_fill(value_pad, 0)
    clipped = torch.clamp(vpred, values - cfg["cliprange_value"], values + cfg["cliprange_value"])
    vf_plain, vf_clipped = (vpred - returns) ** 2, (clipped - returns) ** 2
    vf_loss = 0.5 * trl_ppo.masked_mean(torch.max(vf_plain, vf_clipped), ~value_pad)
    log_ratio = new_logps - frame["logprobs"]
    ratio = torch.exp(log_ratio)
    pg_plain = -advantages * ratio
    pg_clipped = -advantages * torch.clamp(ratio, 1 - cfg["cliprange"], 1 + cfg["cliprange"])
    pg_loss = trl_ppo.masked_mean(torch.max(pg_plain, pg_clipped), ~pad)
    with torch.no_grad():
        approxkl = 0.5 * (trl_ppo.masked_mean(log_ratio ** 2, ~pad) if at_eos else (log_ratio ** 2).mean())
        metrics = {"loss/policy_avg": pg_loss, "loss/value_avg": vf_loss, "policy/approxkl_avg": approxkl,
                   "policy/clipfrac_avg": trl_ppo.masked_mean((pg_clipped > pg_plain).float(), ~pad),
                   "val/clipfrac_avg": trl_ppo.masked_mean((vf_clipped > vf_plain).float(), ~value_pad)}
    return {"loss": pg_loss + cfg["vf_coef"] * vf_loss, "metrics": metrics, "advantages": advantages.detach(),
            "returns": returns.detach()}


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
    # GRPO's advantages; PPO's scores, values, advantages and returns.
    diffs += [v for k, v in result.items() if k.endswith("_max_abs_diff") and k != "logprob_max_abs_diff"]
    ok = logprob is not None and logprob <= tolerance and all(d <= tolerance for d in diffs) and metrics_ok
    if ok:
        return "match"
    # PPO: TRL's own tensors recomputed with alignflow's definition (see `trl_ppo_objective`).
    # PPO: TRL's tensors recomputed with alignflow's definition; RLOO: alignflow's in TRL's objective. Recomputed
    # losses pass within `tolerance` relative or absolute, as metrics: a loss that sums exp(summed log-ratios) of
    # ±advantages cancels, and float32 rounding of the summed log-probs alone moves it by ~1e-6.
    redone = result.get("trl_with_alignflow_definition") or result.get("alignflow_with_trl_definition")
    if redone and logprob is not None and logprob <= tolerance and all(
            v <= tolerance for k, v in redone.items() if k.endswith("_max_abs_diff") or k == "grad_norm_rel_diff") and (
            redone["loss_rel_diff"] <= tolerance or redone["loss_abs_diff"] <= tolerance) and all(
            m["rel_diff"] <= tolerance or abs(m["alignflow"] - m["trl"]) <= tolerance
            for m in redone["metrics"].values()):
        return "definition differs"
    return "DIFFERS"


def worst_metric(result: dict[str, Any]) -> str:
    metrics = result.get("metrics") or {}
    if not metrics:
        return "-"
    name = max(metrics, key=lambda k: metrics[k]["rel_diff"])
    return f"{name} {metrics[name]['rel_diff']:.1e}"


def ppo_in_child(args, names: list[str], model_dir: Path, work: Path) -> dict[str, dict[str, Any]]:
    """Run the ppo cases in a child process whose only TRL is the one at `--trl-ppo-path`; case -> its row."""
    import subprocess

    out = work / "ppo-child.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--cases", ",".join(names), "--model", str(model_dir),
               "--rows", str(args.rows), "--max-length", str(args.max_length), "--tolerance", str(args.tolerance),
               "--threads", str(args.threads), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(args.trl_ppo_path)}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode or not out.exists():
        error = f"child process failed ({done.returncode}): {done.stderr[-2000:]}"
        return {name: {"stage": "ppo", "case": name, "error": error} for name in names}
    return dict(zip(names, json.loads(out.read_text())["runs"]))


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
    parser.add_argument("--trl-ppo-path", type=Path, default=None,
                        help="A folder holding TRL 1.12.0, the last with PPOTrainer (`" + TRL_PPO_PIN + "`): the ppo "
                             "cases then run in a child process with it as PYTHONPATH, merged into this run's table. "
                             "Default: in this process, whose TRL must then be 1.12.")
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
            **{f"grpo-loss-{t}": (lambda t=t: grpo_scored_case(model, tokenizer, work, loss_type=t, num_iterations=2,
                                                               **settings)) for t in ("grpo", "bnpo", "dr_grpo", "dapo")},
            "grpo-temperature-kl": lambda: grpo_scored_case(model, tokenizer, work, loss_type="dapo", temperature=0.7,
                                                            beta=0.04, **settings),
            **{f"grpo-scale-{m}": (lambda m=m: grpo_scored_case(model, tokenizer, work, loss_type="dapo",
                                                                scale_rewards=m, **settings)) for m in ("batch", "none")},
            "grpo-iterations-kl": lambda: grpo_scored_case(model, tokenizer, work, loss_type="dapo", temperature=0.7,
                                                           beta=0.04, num_iterations=2, **settings),
            "rloo": lambda: rloo_case(model, tokenizer, work, **settings),
            "ppo": lambda: ppo_case(model, tokenizer, model_dir, work, temperature=1.0, **settings),
            "ppo-temperature": lambda: ppo_case(model, tokenizer, model_dir, work, temperature=0.7, **settings),
        }
        child = {}
        if args.trl_ppo_path and any(name.startswith("ppo") for name in cases):
            child = ppo_in_child(args, [name for name in cases if name.startswith("ppo")], model_dir, work)
        results = []
        for name in cases:
            torch.manual_seed(0)
            try:
                result = child[name] if name in child else runners[name]()
            except Exception as error:  # one broken case must not hide the others
                result = {"stage": name.split("-")[0], "case": name, "error": f"{type(error).__name__}: {error}"}
            result["status"] = status(result, args.tolerance)
            results.append(result)
            print(f"{name}: {result['status']}", file=sys.stderr)

    table = [[r["stage"], r["case"], r.get("logprob_max_abs_diff"), r.get("loss_rel_diff"),
              r.get("grad_norm_rel_diff"), r.get("advantages_max_abs_diff"), worst_metric(r), r["status"]]
             for r in results]
    common.print_header("Parity with TRL 1.16 (PPO: 1.12)", f"float32, {args.rows} rows, one forward and backward per side",
                        started, load_before)
    print(common.format_table(["stage", "case", "logprob max abs diff", "loss rel diff", "grad-norm rel diff",
                               "advantages max abs diff", "worst shared metric (rel diff)", "status"], table))
    for r in results:
        if r.get("error") or r.get("note"):
            print(f"- {r['stage']} {r['case']}: {r.get('error') or r['note']}")
    common.write_json(args.out, "parity", args, results, [], tolerance=args.tolerance)


if __name__ == "__main__":
    main()
