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
from parity_grpo import grpo_case, grpo_scored_case, rloo_case
from parity_measure import (
    grad_norm,
    perturbed,
    read_rows,
    row,
    same_batch,
    shared_metrics,
    target_difference,
    trl_args,
    trl_step,
    worst_metric,
)
from parity_ppo import TRL_PPO_PIN, ppo_case

RESULT = common.REPO / "benchmarks" / "results" / "parity.json"
CASES = ("sft-completion", "sft-assistant", "sft-assistant-span", "sft-completion-packed",
         "sft-completion-padding-free", "dpo-sigmoid", "dpo-ipo", "dpo-hinge", "dpo-robust", "dpo-apo_zero", "dpo-sigmoid-padding-free",
         "dpo-sigmoid-chat", "dpo-sigmoid-precomputed",
         "reward", "reward-center", "reward-margin", "reward-padding-free", "grpo", "grpo-shared-prompts", "grpo-kl",
         "grpo-kl-trl-default", "grpo-loss-grpo", "grpo-loss-bnpo", "grpo-loss-dr_grpo", "grpo-loss-dapo",
         "grpo-temperature-kl", "grpo-scale-batch", "grpo-scale-none", "grpo-iterations-kl", "rloo", "ppo", "ppo-temperature")
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
