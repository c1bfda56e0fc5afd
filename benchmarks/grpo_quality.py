"""GRPO learning on a verifiable task: SmolLM2-135M-Instruct, 2-digit arithmetic, CPU, a paired test.

    nohup python benchmarks/grpo_quality.py > /tmp/grpo_quality.log 2>&1 &

The task: "What is 47 + 38? Answer with just the number." (a, b drawn from 10..99, + or -,
a >= b for -). Items come from `--seed`; the held-out set (`--eval-items`) and the training pool
(`--train-items`) are disjoint (no (a, op, b) in both).

1. before  greedy answers of the starting model to the held-out items (vLLM engine, eos stops,
           `--new-tokens` tokens), scored with the built-in `exact_answer` reward (the last
           number of the answer against the true result) -> per-item correctness
2. train   `run_grpo` on the training pool with `exact_answer` plus `--format-weight` x
           `regex:^\\s*-?\\d+\\s*$` (the answer is just the number), in-process vLLM rollouts,
           bf16 mixed precision (`--no-bf16` for float32), G = `--generations`
3. after   the same evaluation of the trained model
4. test    McNemar's exact test on the paired per-item results: the two-sided binomial tail
           (p = 1/2) of the discordant pairs (right after but not before, and the reverse)
5. write   `--json` (default benchmarks/results/grpo_quality.json: config, environment, summary
           with accuracies, discordant counts and p-value, per-item before/after results, per-step
           rewards and `frac_reward_zero_std`, runtimes, peak memory) and the reward curve beside
           it (grpo_quality_reward.png, with frac_reward_zero_std on its lower panel)

Each phase runs in its own process. The evaluation engine runs in the training dtype (bfloat16
with bf16, as the rollouts do), the same for before and after.

Learning per CPU-minute (`--budget SECONDS`): each of `--trainers` (alignflow, and TRL 1.16's
`GRPOTrainer` with `use_vllm=False`, since TRL's vLLM needs a GPU) trains the same model on the same
pool with the same rewards and weights, G, prompts per step, completion length, temperature, learning
rate, loss (dapo, beta 0, group scaling) and bf16, for `--budget` seconds of its step loop. At each
fraction in `--eval-at` of the budget it writes the model (the time spent writing is left out of the
clock), and every such model gets the same held-out evaluation as above. The start (model loading,
alignflow's vLLM engine) is recorded but not counted. Writes `results/grpo_quality_budget.json`
(curves of held-out accuracy against training seconds, per-step rewards, the budget at which
alignflow first reaches TRL's final accuracy as a fraction of TRL's budget) and
`results/grpo_quality_budget.png`.

    PYTHONPATH=/path/to/trl-1.16 python benchmarks/grpo_quality.py --budget 420 --json benchmarks/results/grpo_quality_budget.json
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import common

RESULTS = Path(__file__).resolve().parent / "results"
INSTRUCTION = "Answer with just the number."
JUST_A_NUMBER = r"^\s*-?\d+\s*$"
SERIES = [("reward", "total reward"), ("rewards/exact_answer/mean", "exact_answer"),
          ("rewards/regex/mean", "just the number (regex)")]


def arithmetic_items(count: int, seed: int) -> list[dict]:
    """`count` distinct items as GRPO rows: a one-message chat `prompt` and the `answer` column."""
    rng = random.Random(seed)
    seen: set[tuple[int, str, int]] = set()
    rows = []
    while len(rows) < count:
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
        if op == "-" and a < b:
            a, b = b, a
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        result = a + b if op == "+" else a - b
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} {op} {b}? {INSTRUCTION}"}],
                     "answer": str(result)})
    return rows


# ----------------------------------------------------------------------------------------------
# Child side


def child_eval(spec: dict) -> dict:
    """Greedy answers to the held-out prompts with the vLLM engine; exact_answer per item."""
    import time

    from trainer.engine.completions import prompt_token_ids
    from trainer.engine.models import load_tokenizer
    from trainer.rewards.rules import exact_answer, make_regex_reward
    from trainer.rollout import SamplingConfig, make_engine

    rows = [json.loads(line) for line in Path(spec["data_path"]).read_text().splitlines()]
    tokenizer = load_tokenizer(spec["model_path"])
    encoded = [prompt_token_ids(r["prompt"], tokenizer, spec["max_prompt_length"]) for r in rows]
    start = time.perf_counter()
    engine = make_engine("vllm", model=None, tokenizer=tokenizer, model_path=spec["model_path"],
                         max_model_len=spec["max_prompt_length"] + spec["new_tokens"], dtype=spec["dtype"],
                         seed=spec["seed"])
    ready = time.perf_counter()
    sampling = SamplingConfig(max_new_tokens=spec["new_tokens"], temperature=0.0,
                              stop_token_ids=[tokenizer.eos_token_id])
    with engine:
        completions = [group[0] for group in engine.generate(encoded, sampling)]
    generated = time.perf_counter()
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    shaped = [[{"role": "assistant", "content": t}] for t in texts]
    prompts = [r["prompt"] for r in rows]
    correct = exact_answer(prompts, shaped, answer=[r["answer"] for r in rows])
    bare = make_regex_reward(JUST_A_NUMBER)(prompts, shaped)
    return {"accuracy": sum(correct) / len(correct), "correct": [int(c) for c in correct],
            "format_rate": sum(bare) / len(bare), "completions": texts,
            "mean_length": sum(len(c.token_ids) for c in completions) / len(completions),
            "clipped_ratio": sum(c.finish_reason == "length" for c in completions) / len(completions),
            "engine_start_s": ready - start, "generate_s": generated - ready}


class Budget:
    """The clock of a budgeted run: seconds of the step loop, less the time spent writing the evaluation
    models. After each step, `after_step` writes a model at every mark passed (fractions of the budget) and
    says whether the budget is spent."""

    def __init__(self, seconds: float, fractions: list[float], root: Path):
        self.marks = [f * seconds for f in sorted(fractions)]
        self.root, self.points, self.writing, self.started = root, [], 0.0, None
        self.at_step: dict[int, float] = {}  # step -> seconds on this clock at its end

    def start(self) -> None:
        if self.started is None:
            self.started = common.clock()

    def after_step(self, step: int, write: Callable[[Path], None]) -> bool:
        elapsed = self.at_step[step] = common.clock() - self.started - self.writing
        if elapsed >= self.marks[len(self.points)]:
            began, path = common.clock(), self.root / f"at-{len(self.points)}"
            write(path)
            self.writing += common.clock() - began
            self.points.append({"step": step, "train_s": elapsed, "path": str(path)})
        return len(self.points) == len(self.marks)

    def result(self, start: float) -> dict:
        """The models written (`points`), the start before the clock ran (since `start`) and the writing time."""
        return {"points": self.points, "setup_s": self.started - start, "writing_s": self.writing}


class BudgetSpent(Exception):
    """Raised at the end of the step that spent the budget, with the run's metric history."""


STEP_KEYS = ("reward", "reward_std", "rewards/exact_answer/mean", "rewards/regex/mean", "completions/mean_length",
             "completions/clipped_ratio", "frac_reward_zero_std", "entropy", "loss", "grad_norm", "step_time",
             "timing/generate", "timing/update", "timing/sync")  # those a trainer logs go into the result


def step_rows(history: list[dict], clock: Budget | None) -> list[dict]:
    """The logged steps that have a reward, with their STEP_KEYS and, in a budgeted run, their seconds on its clock."""
    rows = [{"step": r["step"], **{k: r[k] for k in STEP_KEYS if k in r}} for r in history if "reward" in r]
    return [{**r, "train_s": clock.at_step.get(r["step"])} for r in rows] if clock else rows


def write_model(model, tokenizer, path: Path) -> None:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def child_train(spec: dict) -> dict:
    import time

    from trainer.engine import checkpoint
    from trainer.engine.runner import StageRunner
    from trainer.stages.rl import grpo

    budget = spec.get("budget")
    config = grpo.GRPOConfig(
        model=spec["model_path"], dataset=spec["data_path"], output_dir=spec["out_dir"], dtype="float32",
        bf16=spec["bf16"], rollout_engine="vllm", max_steps=10**6 if budget else spec["steps"],
        num_generations=spec["generations"], per_device_batch_size=spec["prompts_per_step"] * spec["generations"],
        gradient_accumulation_steps=1, max_prompt_length=spec["max_prompt_length"],
        max_completion_length=spec["new_tokens"], temperature=spec["temperature"], learning_rate=spec["learning_rate"],
        lr_scheduler="constant", beta=0.0, loss_type="dapo", scale_rewards="group",
        reward_funcs=["exact_answer", f"regex:{JUST_A_NUMBER}"], reward_weights=[1.0, spec["format_weight"]],
        seed=spec["seed"], logging_steps=1, log_completions_steps=0, save_steps=0, disable_progress_bar=True)
    start = time.perf_counter()
    clock = None
    if budget:  # patched in this child only: the loop's first rollout starts the clock, each step end checks it
        clock = Budget(budget, spec["eval_at"], Path(spec["out_dir"]) / "budget")
        rollout, maybe_save = grpo.rollout, StageRunner.maybe_save

        def timed_rollout(*args, **kwargs):
            clock.start()
            return rollout(*args, **kwargs)

        def budgeted_save(run, step, span=1):
            if clock.after_step(step, lambda path: write_model(run.module, run.tokenizer, path)):
                raise BudgetSpent(run.tracker.history)
            maybe_save(run, step, span)

        grpo.rollout, StageRunner.maybe_save = timed_rollout, budgeted_save
    try:
        grpo.run_grpo(config)
        history = checkpoint.read_history(spec["out_dir"])
    except BudgetSpent as spent:
        history = spent.args[0]
    out = {"steps": step_rows(history, clock), "train_s": time.perf_counter() - start}
    return {**out, **clock.result(start)} if clock else out


def child_train_trl(spec: dict) -> dict:
    """TRL's `GRPOTrainer` on the same inputs and settings, for `spec["budget"]` seconds of its step loop."""
    import time

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.rewards.rules import exact_answer, make_regex_reward

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    rows = datasets.load_dataset("json", data_files=spec["data_path"], split="train")
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    clock = Budget(spec["budget"], spec["eval_at"], Path(spec["out_dir"]) / "budget")
    logged: list[dict] = []
    completions = spec["prompts_per_step"] * spec["generations"]

    class Budgeted(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.start()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if clock.after_step(state.global_step, lambda path: write_model(model, tokenizer, path)):
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append({"step": state.global_step, **(logs or {})})

    args = GRPOConfig(
        output_dir=spec["out_dir"], max_steps=10**6, per_device_train_batch_size=completions,
        generation_batch_size=completions, gradient_accumulation_steps=1, num_generations=spec["generations"],
        max_completion_length=spec["new_tokens"], temperature=spec["temperature"], top_p=1.0, top_k=0, beta=0.0,
        loss_type="dapo", scale_rewards="group", num_iterations=1, learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant", warmup_steps=0, use_vllm=False, reward_weights=[1.0, spec["format_weight"]],
        bf16=spec["bf16"], fp16=False, use_cpu=True, gradient_checkpointing=False, seed=spec["seed"],
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[exact_answer, make_regex_reward(JUST_A_NUMBER)], args=args,
                          train_dataset=rows, processing_class=tokenizer, callbacks=[Budgeted()])
    trainer.train()
    return {"steps": step_rows(logged, clock), "train_s": time.perf_counter() - start, **clock.result(start)}


# ----------------------------------------------------------------------------------------------
# Parent side


def by_operation(items: list[dict]) -> dict:
    """Held-out items, right before and right after, per operation ("+", "-")."""
    out: dict[str, dict[str, int]] = {}
    for item in items:
        counts = out.setdefault(item["question"].split()[3], {"items": 0, "before": 0, "after": 0})
        counts["items"] += 1
        counts["before"] += item["before"]
        counts["after"] += item["after"]
    return out


def summarize(before: dict, after: dict, steps: list[dict], total: float, load: tuple[float, float]) -> dict:
    test = common.paired(before["correct"], after["correct"], "accuracy")
    return {"eval_items": len(before["correct"]), "accuracy_before": test["accuracy_before"],
            "accuracy_after": test["accuracy_after"], "newly_correct": test["accuracy_newly_1"],
            "newly_wrong": test["accuracy_newly_0"], "mcnemar_exact_p": test["accuracy_mcnemar_p"],
            "format_rate_before": before["format_rate"], "format_rate_after": after["format_rate"],
            "mean_length_before": before["mean_length"], "mean_length_after": after["mean_length"],
            **common.zero_std_summary(steps), "total_s": total, "load_average_before": load[0],
            "load_average_after": load[1]}


def task_settings(args) -> str:
    """The settings line's part that every run of this benchmark shares."""
    return (f"G={args.generations}, {args.prompts_per_step} prompts/step, max_completion_length={args.new_tokens}, "
            f"lr={args.learning_rate:g} constant, T={args.temperature:g}, beta=0, dapo, rewards exact_answer + "
            f"{args.format_weight:g} x just-the-number")


def compare_budgets(args, trainers: list[str], eval_at: list[float], train_spec: dict, before: dict,
                    evaluate: Callable[[Path, str], dict], held_out: list[dict], work: Path, started: float,
                    load_before: float) -> None:
    """Learning per CPU-minute: each trainer for `args.budget` seconds, each written model evaluated."""
    curves, steps, runs = {}, {}, [{"phase": "eval before", **{k: v for k, v in before.items() if k != "completions"}}]
    log = common.stamped_log(started)
    start = {"step": 0, "train_s": 0.0, "accuracy": before["accuracy"], "format_rate": before["format_rate"],
             "correct": before["correct"]}
    for trainer in trainers:
        spec = dict(train_spec, budget=args.budget, eval_at=eval_at, out_dir=str(work / trainer))
        log(f"{trainer}: training for {args.budget:.0f}s ...")
        trained = common.run_phase(__file__, "train" if trainer == "alignflow" else "train_trl", spec,
                                   args.timeout)
        log(f"{trainer}: {len(trained['steps'])} steps in {trained['points'][-1]['train_s']:.0f}s "
            f"(start {trained['setup_s']:.0f}s, writing models {trained['writing_s']:.0f}s, not counted)")
        points = [start]
        for point in trained.pop("points"):
            result = evaluate(Path(point["path"]), f"{trainer} at {point['train_s']:.0f}s (step {point['step']})")
            points.append({"step": point["step"], "train_s": point["train_s"], "accuracy": result["accuracy"],
                           "format_rate": result["format_rate"], "correct": result["correct"]})
            runs.append({"phase": f"eval {trainer} step {point['step']}",
                         **{k: v for k, v in result.items() if k not in ("completions", "correct")}})
        curves[trainer], steps[trainer] = points, trained["steps"]
        runs.append({"phase": f"train {trainer}", **trained})
    summary = budget_summary(curves, args.budget, steps)
    json_path = args.json
    plot_path = json_path.with_name(json_path.stem + ".png")
    settings = (f"{task_settings(args)}, budget {args.budget:.0f}s of training each (alignflow: vLLM rollouts; TRL: "
                f"use_vllm=False), {common.precision(args.bf16)}, {args.threads} CPU threads; eval greedy on "
                f"{len(held_out)} held-out items")
    plot_budget_curves(curves, steps, settings, plot_path)
    common.write_json(json_path, "grpo_quality_budget", args, runs, [], summary=summary,
                      curves={t: [{k: v for k, v in p.items() if k != "correct"} for p in c] for t, c in curves.items()},
                      items=[{"question": r["prompt"][0]["content"], "answer": r["answer"],
                              **{f"{t} step {p['step']}": p["correct"][i] for t, c in curves.items() for p in c}}
                             for i, r in enumerate(held_out)])
    common.print_header("GRPO learning per CPU-minute on 2-digit arithmetic", settings, started, load_before)
    rows = [[t, p["step"], round(p["train_s"]), p["accuracy"], p["format_rate"]] for t, c in curves.items() for p in c]
    print(common.format_table(["trainer", "step", "train s", "held-out accuracy", "just the number"], rows))
    for line in summary["lines"]:
        print(line)
    print(f"\nresults: {json_path}, {plot_path}")


def trailing_reward(steps: list[dict], k: int = 10) -> list[tuple[float, float]]:
    """(training seconds, mean reward of the last `k` steps) at each step from the k-th on."""
    return [(steps[i]["train_s"], sum(s["reward"] for s in steps[i + 1 - k:i + 1]) / k) for i in range(k - 1, len(steps))]


def budget_summary(curves: dict[str, list[dict]], budget: float, steps: dict[str, list[dict]]) -> dict:
    """Each trainer's final accuracy and steps; with both, the paired test of the final models, the training
    seconds at which alignflow's first evaluated model reaches TRL's final accuracy and at which alignflow's
    training reward (10-step mean) reaches TRL's last, each as a fraction of TRL's seconds."""
    summary: dict = {"budget_s": budget, "lines": []}
    for trainer, points in curves.items():
        last = points[-1]
        summary[trainer] = {"final_accuracy": last["accuracy"], "steps": last["step"], "train_s": last["train_s"],
                            "steps_per_minute": 60 * last["step"] / last["train_s"]}
        summary["lines"].append(f"{trainer}: {points[0]['accuracy']:.1%} -> {last['accuracy']:.1%} in "
                                f"{last['step']} steps, {last['train_s']:.0f}s")
    if {"alignflow", "trl"} <= curves.keys():
        ours, trl = curves["alignflow"], curves["trl"]
        test = common.paired(trl[-1]["correct"], ours[-1]["correct"], "accuracy")
        reached = next((p for p in ours[1:] if p["accuracy"] >= trl[-1]["accuracy"]), None)
        fraction = reached["train_s"] / trl[-1]["train_s"] if reached else None
        summary.update(final_paired=test, alignflow_reaches_trl_final_s=reached and reached["train_s"],
                       alignflow_budget_fraction=fraction)
        ours_reward, trl_reward = trailing_reward(steps["alignflow"]), trailing_reward(steps["trl"])
        if ours_reward and trl_reward:
            at = next((t for t, r in ours_reward if r >= trl_reward[-1][1]), None)
            share = at / trl[-1]["train_s"] if at is not None else None
            summary.update(trl_final_reward=trl_reward[-1][1], alignflow_reaches_trl_reward_s=at,
                           alignflow_reward_budget_fraction=share)
            summary["lines"].append(
                f"training reward (10-step mean): TRL ends at {trl_reward[-1][1]:.3f}; alignflow reaches it at "
                + (f"{at:.0f}s, {share:.2f} of TRL's budget" if at is not None else "no step within its budget"))
        summary["lines"].append(
            f"alignflow reaches TRL's final {trl[-1]['accuracy']:.1%} at "
            + (f"{reached['train_s']:.0f}s (step {reached['step']}), {fraction:.2f} of TRL's {trl[-1]['train_s']:.0f}s"
               if reached else "no evaluated point within its budget")
            + (" (TRL ended no better than the start, so this says little)"
               if trl[-1]["accuracy"] <= trl[0]["accuracy"] else "")
            + f"; final models paired: {test['accuracy_newly_1']} right only with alignflow, "
              f"{test['accuracy_newly_0']} only with TRL, McNemar exact p = {test['accuracy_mcnemar_p']:.3g}")
    return summary


def plot_budget_curves(curves: dict[str, list[dict]], steps: dict[str, list[dict]], settings: str, path: Path) -> None:
    """Held-out accuracy (top) and the training reward's 10-step mean (bottom) against training minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rewards = {t: trailing_reward(s) for t, s in steps.items() if s and all(r.get("train_s") is not None for r in s)}
    rewards = {t: r for t, r in rewards.items() if r}
    if rewards:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 2))
    else:  # runs recorded before the per-step seconds
        fig, top = plt.subplots(figsize=(8, 5))
        bottom = None
    for i, (trainer, points) in enumerate(curves.items()):
        top.plot([p["train_s"] / 60 for p in points], [p["accuracy"] for p in points], marker="o", color=f"C{i}",
                 label=f"{trainer}: {points[0]['accuracy']:.1%} -> {points[-1]['accuracy']:.1%} "
                       f"({points[-1]['step']} steps)")
        if bottom is not None and trainer in rewards:
            bottom.plot([t / 60 for t, _ in rewards[trainer]], [r for _, r in rewards[trainer]], color=f"C{i}",
                        label=trainer)
    top.set_ylabel("held-out accuracy (greedy)")
    top.set_title("GRPO on 2-digit arithmetic, SmolLM2-135M-Instruct, 2 CPU cores: learning per minute", fontsize=10)
    top.grid(alpha=0.3)
    top.legend(loc="best", fontsize=8)
    xlabel = "training wall time, minutes (model loading and engine start not counted)"
    if bottom is None:
        top.set_xlabel(xlabel)
    else:
        bottom.set_ylabel("training reward (10-step mean)")
        bottom.set_xlabel(xlabel)
        bottom.grid(alpha=0.3)
        bottom.legend(loc="lower right", fontsize=8)
    common.save_figure(fig, settings, path, 0.05)


def main(argv: list[str] | None = None) -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--model", type=Path, default=common.SMOLLM2, help="Starting model (HF folder).")
    parser.add_argument("--generations", type=int, default=8, help="Completions per prompt (G).")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="Prompts per step (x G completions).")
    parser.add_argument("--new-tokens", type=int, default=16, help="max_completion_length, training and eval.")
    parser.add_argument("--learning-rate", type=float, default=5e-6, help="Constant learning rate (AdamW).")
    parser.add_argument("--temperature", type=float, default=1.0, help="Rollout sampling temperature.")
    parser.add_argument("--format-weight", type=float, default=0.25,
                        help="Weight of the just-the-number reward (a binary fraction keeps the sums exact).")
    parser.add_argument("--train-items", type=int, default=2000, help="Training pool size.")
    parser.add_argument("--eval-items", type=int, default=300, help="Held-out items (the paired test).")
    parser.add_argument("--max-prompt-length", type=int, default=64, help="Longer prompts lose their start.")
    parser.add_argument("--steps", type=int, default=200, help="GRPO optimizer steps (one generation each).")
    parser.add_argument("--no-bf16", dest="bf16", action="store_false", help="Train and evaluate in float32.")
    parser.add_argument("--eval-only", action="store_true", help="Only the 'before' evaluation (a pilot).")
    parser.add_argument("--budget", type=float, default=0.0,
                        help="Seconds of training per trainer (learning per CPU-minute; replaces --steps). 0: off.")
    parser.add_argument("--trainers", default="alignflow,trl",
                        help="With --budget, comma-separated from: alignflow, trl (TRL 1.16 must be importable).")
    parser.add_argument("--eval-at", default="0.125,0.25,0.5,0.75,1",
                        help="With --budget, the fractions of the budget at which the model is written and evaluated.")
    common.add_run_flags(parser, "-", warmup=None, repeats=False, timeout=3600,
                         json_default=RESULTS / "grpo_quality.json")  # the reward curve goes beside it
    args = parser.parse_args(argv)
    if args.child:
        return common.phase_child(args.child, {"eval": child_eval, "train": child_train, "train_trl": child_train_trl})
    if not (args.model / "config.json").exists():
        sys.exit(f"No model at {args.model}; make SmolLM2 with scripts/get_smollm2.sh or pass --model.")
    if args.eval_items < 1 or args.train_items < args.prompts_per_step:
        sys.exit("--eval-items must be >= 1 and --train-items >= --prompts-per-step.")
    trainers = common.parse_list(args.trainers, ("alignflow", "trl"), "trainer")
    eval_at = [float(f) for f in args.eval_at.split(",")]
    if args.budget and not all(0 < f <= 1 for f in eval_at):
        sys.exit(f"--eval-at takes fractions of the budget in (0, 1]; got {args.eval_at}.")
    if args.budget:
        common.require_trl(trainers)
        if args.json == RESULTS / "grpo_quality.json":  # the default: the single-arm run's result stays
            args.json = RESULTS / "grpo_quality_budget.json"

    items = arithmetic_items(args.eval_items + args.train_items, args.seed)
    held_out, pool = items[:args.eval_items], items[args.eval_items:]
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="alignflow-grpo-quality-"))
    started = common.clock()
    log = common.stamped_log(started)
    shared = dict(threads=args.threads, seed=args.seed, max_prompt_length=args.max_prompt_length,
                  new_tokens=args.new_tokens)
    dtype = "bfloat16" if args.bf16 else "float32"

    def evaluate(model: Path, name: str) -> dict:
        spec = dict(shared, data_path=str(test), model_path=str(model), dtype=dtype)
        result = common.run_phase(__file__, "eval", spec, args.timeout)
        log(f"{name}: accuracy {result['accuracy']:.3f}, just-the-number {result['format_rate']:.3f}, "
            f"mean length {result['mean_length']:.1f}, clipped {result['clipped_ratio']:.3f} ({result['wall_s']:.0f}s)")
        return result

    try:
        test = common.write_jsonl(work / "test.jsonl", held_out)
        train = common.write_jsonl(work / "train.jsonl", pool)
        log(f"evaluating {args.model} on {len(held_out)} held-out items ...")
        before = evaluate(args.model, "before")
        if args.eval_only:
            for row, text, ok in list(zip(held_out, before["completions"], before["correct"]))[:10]:
                print(f"  {row['prompt'][0]['content']!r} -> {text!r} ({'right' if ok else 'wrong'})")
            return
        train_spec = dict(shared, model_path=str(args.model), data_path=str(train), out_dir=str(work / "out"),
                          steps=args.steps, generations=args.generations, prompts_per_step=args.prompts_per_step,
                          learning_rate=args.learning_rate, temperature=args.temperature,
                          format_weight=args.format_weight, bf16=args.bf16)
        if args.budget:
            return compare_budgets(args, trainers, eval_at, train_spec, before, evaluate, held_out, work, started,
                                   load_before)
        log(f"training {args.steps} steps ...")
        trained = common.run_phase(__file__, "train", train_spec, args.timeout)
        zero = [s.get("frac_reward_zero_std", float("nan")) for s in trained["steps"]]
        log(f"trained in {trained['wall_s']:.0f}s; frac_reward_zero_std mean {sum(zero) / len(zero):.3f}")
        after = evaluate(work / "out", "after")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = common.clock() - started
    summary = summarize(before, after, trained["steps"], total, (load_before, os.getloadavg()[0]))
    settings = (f"{task_settings(args)}, {args.steps} steps, vLLM rollouts, {common.precision(args.bf16)}, "
                f"{args.threads} CPU threads; eval greedy on {len(held_out)} held-out items")
    items_out = [{"question": r["prompt"][0]["content"], "answer": r["answer"], "before": b, "after": a,
                  "completion_before": tb, "completion_after": ta}
                 for r, b, a, tb, ta in zip(held_out, before.pop("correct"), after.pop("correct"),
                                            before.pop("completions"), after.pop("completions"))]
    runs = [{"phase": "eval before", **before}, {"phase": "train", **trained}, {"phase": "eval after", **after}]
    plot_path = args.json.with_name(args.json.stem + "_reward.png")
    summary["correct_by_operation"] = by_operation(items_out)
    common.write_json(args.json, "grpo_quality", args, runs, [], summary=summary, items=items_out)
    p = summary["mcnemar_exact_p"]
    common.plot_rewards(trained["steps"], SERIES, f"GRPO on 2-digit arithmetic, {args.model.name}, CPU\nheld-out accuracy (greedy) "
         f"{summary['accuracy_before']:.1%} -> {summary['accuracy_after']:.1%}, McNemar p = {p:.2g}",
         f"{settings}; total {total / 60:.0f} min", plot_path)
    common.print_header("GRPO on 2-digit arithmetic", settings, started, load_before)
    print(f"held-out accuracy: {summary['accuracy_before']:.1%} -> {summary['accuracy_after']:.1%} "
          f"({summary['newly_correct']} newly right, {summary['newly_wrong']} newly wrong; McNemar exact p = {p:.3g}); "
          f"just the number {summary['format_rate_before']:.1%} -> {summary['format_rate_after']:.1%}; "
          f"frac_reward_zero_std {summary['frac_reward_zero_std_first_10pct']:.2f} (first 10% of steps) -> "
          f"{summary['frac_reward_zero_std_last_10pct']:.2f} (last 10%)")
    print(f"\nresults: {args.json}, {plot_path}")


if __name__ == "__main__":
    main()
