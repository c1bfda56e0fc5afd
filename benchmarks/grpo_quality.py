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
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
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


def child_train(spec: dict) -> dict:
    import time

    from trainer.engine import checkpoint
    from trainer.stages.rl import grpo

    config = grpo.GRPOConfig(
        model=spec["model_path"], dataset=spec["data_path"], output_dir=spec["out_dir"], dtype="float32",
        bf16=spec["bf16"], rollout_engine="vllm", max_steps=spec["steps"], num_generations=spec["generations"],
        per_device_batch_size=spec["prompts_per_step"] * spec["generations"], gradient_accumulation_steps=1,
        max_prompt_length=spec["max_prompt_length"], max_completion_length=spec["new_tokens"],
        temperature=spec["temperature"], learning_rate=spec["learning_rate"], lr_scheduler="constant",
        beta=0.0, loss_type="dapo", scale_rewards="group", reward_funcs=["exact_answer", f"regex:{JUST_A_NUMBER}"],
        reward_weights=[1.0, spec["format_weight"]], seed=spec["seed"], logging_steps=1,
        log_completions_steps=0, save_steps=0, disable_progress_bar=True)
    start = time.perf_counter()
    grpo.run_grpo(config)
    history = checkpoint.read_history(spec["out_dir"])
    keys = ("reward", "reward_std", "rewards/exact_answer/mean", "rewards/regex/mean", "completions/mean_length",
            "completions/clipped_ratio", "frac_reward_zero_std", "entropy", "loss", "grad_norm", "step_time",
            "timing/generate", "timing/update", "timing/sync")
    steps = [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in history if "reward" in r]
    return {"steps": steps, "train_s": time.perf_counter() - start}


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
    common.add_run_flags(parser, "-", warmup=None, repeats=False, timeout=3600,
                         json_default=RESULTS / "grpo_quality.json")  # the reward curve goes beside it
    args = parser.parse_args(argv)
    if args.child:
        return common.phase_child(args.child, {"eval": child_eval, "train": child_train})
    if not (args.model / "config.json").exists():
        sys.exit(f"No model at {args.model}; make SmolLM2 with scripts/get_smollm2.sh or pass --model.")
    if args.eval_items < 1 or args.train_items < args.prompts_per_step:
        sys.exit("--eval-items must be >= 1 and --train-items >= --prompts-per-step.")

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
        log(f"training {args.steps} steps ...")
        trained = common.run_phase(__file__, "train", train_spec, args.timeout)
        zero = [s.get("frac_reward_zero_std", float("nan")) for s in trained["steps"]]
        log(f"trained in {trained['wall_s']:.0f}s; frac_reward_zero_std mean {sum(zero) / len(zero):.3f}")
        after = evaluate(work / "out", "after")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = common.clock() - started
    summary = summarize(before, after, trained["steps"], total, (load_before, os.getloadavg()[0]))
    settings = (f"G={args.generations}, {args.prompts_per_step} prompts/step, {args.steps} steps, "
                f"max_completion_length={args.new_tokens}, lr={args.learning_rate:g} constant, "
                f"T={args.temperature:g}, beta=0, dapo, rewards exact_answer + {args.format_weight:g} x just-the-number, "
                f"vLLM rollouts, {'bf16 mixed precision' if args.bf16 else 'float32'}, {args.threads} CPU threads; "
                f"eval greedy on {len(held_out)} held-out items")
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
