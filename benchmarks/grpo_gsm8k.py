r"""GRPO on GSM8K: SmolLM2-135M-Instruct, exact answers plus a partial-credit format reward and a
length budget, vLLM rollouts, on CPU, with a paired test.

    nohup flock /tmp/alignflow-bench.lock python benchmarks/grpo_gsm8k.py > /tmp/grpo_gsm8k.log 2>&1 &

1. before  greedy answers of the starting model to fixed GSM8K test questions (the first
           `--eval-questions` of `--eval-data`, default ../shared/data/gsm8k/test.jsonl, 300) ->
           per-question accuracy (`exact_answer`: the number after the last "####", else the last
           number, against the reference), `#### N` format at the end (`answer_format`), length
2. train   `run_grpo` on GSM8K train prompts (the first `--train-prompts` of `--data`, default
           ../shared/data/gsm8k/train.jsonl) with in-process vLLM rollouts and the rewards
             exact_answer                                              x 1
             regex: "#### N" ends the completion after >= `--working-chars`
               characters of working (the format; 0: answer_format)    x `--format-weight`
             regex:####\s*-?[\d,]*\d  ("#### N" anywhere, optional)  x `--marker-weight`
             soft_overlong_punishment:<new tokens>:<cache>             x `--overlong-weight`
               (DAPO's length budget: 0 up to new tokens − `--overlong-cache`, then down to −1)
           Runs recorded (results/): v1 `--working-chars 0 --overlong-weight 0 --format-weight 0.2
           --new-tokens 160 --micro-batch 16 --generations 4 --no-bf16 --learning-rate 5e-6 --steps 50
           --eval-questions 200` (exact answer + 0.2 x format only); v2 `--working-chars 0
           --marker-weight 0.25 --overlong-weight 0.5` (the policy learned to answer a bare "#### N"
           with no working: format 100%, accuracy down); v3 the defaults (the format only counts
           after working)
3. after   the same evaluation of the trained model
4. test    McNemar's exact test on the paired per-question results, for accuracy and for format
5. write   `--json` (default benchmarks/results/grpo_gsm8k.json: config, environment, summary,
           per-question before/after answers, per-step rewards and `frac_reward_zero_std`,
           runtimes, peak memory) and the reward curve beside it (grpo_gsm8k_reward.png)

Prompts are one user message: the question and an instruction to end with "#### <number>"
(`common.gsm8k_rows`, as in the speed benchmark). Evaluation uses the vLLM engine (greedy,
`--eval-new-tokens` tokens, eos stops) in the training dtype. Each phase runs in its own process.
SmolLM2-135M gets almost no GSM8K question right, so the format and the length are what a CPU-sized
run can move; accuracy is reported with its paired test either way.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import common

RESULTS = Path(__file__).resolve().parent / "results"
MARKER = r"####\s*-?[\d,]*\d"


def reward_specs(args) -> tuple[list[str], list[float], list[tuple[str, str]]]:
    """The training rewards, their weights (a zero weight leaves a reward out) and the plot's series.
    With `--working-chars N`, the format reward is a regex: "#### N" ends the completion *after* at
    least N characters of working, so that skipping the reasoning earns nothing."""
    if args.working_chars:
        format_spec, format_label = (f"regex:[\\s\\S]{{{args.working_chars},}}{MARKER}\\s*$",
                                     f"'#### N' at the end after {args.working_chars}+ characters")
    else:
        format_spec, format_label = "answer_format", "'#### N' at the end"
    specs = [("exact_answer", 1.0, "exact_answer"), (f"regex:{MARKER}", args.marker_weight, "'#### N' anywhere"),
             (format_spec, args.format_weight, format_label),
             (f"soft_overlong_punishment:{args.new_tokens}:{args.overlong_cache}", args.overlong_weight,
              "soft_overlong_punishment")]
    from trainer.rewards.functions import load_reward_function, reward_names

    kept = [spec for spec in specs if spec[1]]
    names = reward_names([load_reward_function(name) for name, _, _ in kept])  # the trainer's metric names
    series = [("reward", "total reward"), *((f"rewards/{n}/mean", label) for n, (_, _, label) in zip(names, kept))]
    return [name for name, _, _ in kept], [weight for _, weight, _ in kept], series


# ----------------------------------------------------------------------------------------------
# Child side


def child_eval(spec: dict) -> dict:
    """Greedy answers to the test prompts with the vLLM engine; per question: right, formatted, length."""
    from trainer.engine.completions import prompt_token_ids
    from trainer.engine.models import load_tokenizer
    from trainer.rewards.rules import answer_format, exact_answer
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
    shaped = [[{"role": "assistant", "content": t}] for t in texts]  # chat prompts -> chat completions (TRL)
    prompts = [r["prompt"] for r in rows]
    correct = [int(c) for c in exact_answer(prompts, shaped, answer=[r["answer"] for r in rows])]
    formatted = [int(f) for f in answer_format(prompts, shaped)]
    lengths = [len(c.token_ids) for c in completions]
    return {"accuracy": sum(correct) / len(correct), "correct": correct, "format_rate": sum(formatted) / len(rows),
            "formatted": formatted, "completions": texts, "lengths": lengths,
            "mean_length": sum(lengths) / len(lengths),
            "clipped_ratio": sum(c.finish_reason == "length" for c in completions) / len(completions),
            "engine_start_s": ready - start, "generate_s": generated - ready}


def child_train(spec: dict) -> dict:
    from trainer.engine import checkpoint
    from trainer.stages.rl import grpo

    config = grpo.GRPOConfig(
        model=spec["model_path"], dataset=spec["data_path"], output_dir=spec["out_dir"], dtype="float32",
        bf16=spec["bf16"], rollout_engine="vllm", max_steps=spec["steps"], num_generations=spec["generations"],
        per_device_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["prompts_per_step"] * spec["generations"] // spec["micro_batch"],
        max_prompt_length=spec["max_prompt_length"], max_completion_length=spec["new_tokens"],
        temperature=spec["temperature"], learning_rate=spec["learning_rate"], lr_scheduler="constant",
        beta=0.0, loss_type="dapo", scale_rewards="group", reward_funcs=spec["reward_funcs"],
        reward_weights=spec["reward_weights"], seed=spec["seed"], logging_steps=1,
        log_completions_steps=0, save_steps=0, disable_progress_bar=True)
    start = time.perf_counter()
    grpo.run_grpo(config)
    history = checkpoint.read_history(spec["out_dir"])
    per_reward = sorted({k for r in history for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    keys = ["reward", "reward_std", *per_reward, "completions/mean_length", "completions/clipped_ratio",
            "frac_reward_zero_std", "kl", "entropy", "loss", "grad_norm", "step_time", "timing/generate",
            "timing/update", "timing/sync"]
    steps = [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in history if "reward" in r]
    return {"steps": steps, "train_s": time.perf_counter() - start}


# ----------------------------------------------------------------------------------------------
# Parent side


def phase_table(before: dict, trained: dict, after: dict, completions_per_step: int) -> str:
    """Wall time, the measured parts, throughput and peak memory of each phase (its own process)."""
    steps = trained["steps"]
    step_s = sum(s["step_time"] for s in steps)
    train_tokens = sum(s["completions/mean_length"] for s in steps) * completions_per_step

    def eval_row(name: str, r: dict) -> list:
        return [name, r["wall_s"], r["engine_start_s"], r["generate_s"], None, sum(r["lengths"]) / r["generate_s"],
                r["peak_rss_mb"]]

    train = ["train", trained["wall_s"], None, sum(s.get("timing/generate", 0.0) for s in steps),
             step_s / len(steps), train_tokens / step_s, trained["peak_rss_mb"]]
    return common.format_table(["phase", "wall s", "engine start s", "generate s", "s/step", "gen tok/s", "peak RSS MB"],
                               [eval_row("eval before", before), train, eval_row("eval after", after)])


def summarize(before: dict, after: dict, steps: list[dict], total: float, load: tuple[float, float]) -> dict:
    return {"eval_questions": len(before["correct"]),
            **common.paired(before["correct"], after["correct"], "accuracy"),
            **common.paired(before["formatted"], after["formatted"], "format_rate"),
            "mean_length_before": before["mean_length"], "mean_length_after": after["mean_length"],
            "clipped_ratio_before": before["clipped_ratio"], "clipped_ratio_after": after["clipped_ratio"],
            "train_clipped_ratio_first_10": _mean([s.get("completions/clipped_ratio") for s in steps[:10]]),
            "train_clipped_ratio_last_10": _mean([s.get("completions/clipped_ratio") for s in steps[-10:]]),
            **common.zero_std_summary(steps), "total_s": total, "load_average_before": load[0],
            "load_average_after": load[1]}


def plot_title(model: str, summary: dict) -> str:
    return (f"GRPO on GSM8K, {model}, CPU; {summary['eval_questions']} test questions (greedy):\n"
            f"accuracy {summary['accuracy_before']:.1%} -> {summary['accuracy_after']:.1%} "
            f"(p = {summary['accuracy_mcnemar_p']:.2g}), '#### N' at the end {summary['format_rate_before']:.1%} -> "
            f"{summary['format_rate_after']:.1%} (p = {summary['format_rate_mcnemar_p']:.2g})")


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def main(argv: list[str] | None = None) -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--model", type=Path, default=common.SMOLLM2, help="Starting model (HF folder).")
    parser.add_argument("--generations", type=int, default=8, help="Completions per prompt (G).")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="Prompts per step (x G completions).")
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="Completions per forward/backward (one optimizer step per generation either way).")
    parser.add_argument("--new-tokens", type=int, default=256, help="max_completion_length in training.")
    parser.add_argument("--learning-rate", type=float, default=1e-5, help="Constant learning rate (AdamW).")
    parser.add_argument("--temperature", type=float, default=1.0, help="Rollout sampling temperature.")
    parser.add_argument("--marker-weight", type=float, default=0.0,
                        help="Weight of the '#### N' anywhere reward (partial format credit; 0 leaves it out).")
    parser.add_argument("--format-weight", type=float, default=0.25,
                        help="Weight of the format reward ('#### N' at the very end; 0 leaves it out).")
    parser.add_argument("--working-chars", type=int, default=150,
                        help="The format reward counts only after this many characters of working (0: the "
                             "built-in answer_format, which a bare '#### N' satisfies).")
    parser.add_argument("--overlong-weight", type=float, default=0.25,
                        help="Weight of soft_overlong_punishment (0 leaves it out).")
    parser.add_argument("--overlong-cache", type=int, default=64,
                        help="Its soft band: the punishment starts this many tokens before --new-tokens.")
    parser.add_argument("--train-prompts", type=int, default=2000, help="First N GSM8K train questions to draw from.")
    parser.add_argument("--eval-questions", type=int, default=300, help="First N GSM8K test questions.")
    parser.add_argument("--eval-new-tokens", type=int, default=256, help="Most tokens per evaluation answer.")
    parser.add_argument("--max-prompt-length", type=int, default=512, help="Longer prompts lose their start.")
    parser.add_argument("--eval-data", type=Path, default=None,
                        help="GSM8K test questions (default: ../shared/data/gsm8k/test.jsonl beside the repository).")
    parser.add_argument("--steps", type=int, default=40, help="GRPO optimizer steps (one generation each).")
    parser.add_argument("--no-bf16", dest="bf16", action="store_false", help="Train and evaluate in float32.")
    common.add_run_flags(parser, "gsm8k/train.jsonl", warmup=None, repeats=False, timeout=3600,
                         json_default=RESULTS / "grpo_gsm8k.json")  # the reward curve goes beside it
    args = parser.parse_args(argv)
    if args.child:
        return common.phase_child(args.child, {"eval": child_eval, "train": child_train})
    if not (args.model / "config.json").exists():
        sys.exit(f"No model at {args.model}; make SmolLM2 with scripts/get_smollm2.sh or pass --model.")
    if (args.prompts_per_step * args.generations) % args.micro_batch:
        sys.exit("--micro-batch must divide --prompts-per-step x --generations.")
    if args.overlong_weight and not 0 < args.overlong_cache <= args.new_tokens:
        sys.exit("--overlong-cache must be in 1..--new-tokens.")
    train_source = common.data_path(args.data, "gsm8k/train.jsonl")
    test_source = common.data_path(args.eval_data, "gsm8k/test.jsonl", "--eval-data")
    reward_funcs, reward_weights, series = reward_specs(args)
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="alignflow-grpo-gsm8k-"))
    started = common.clock()
    log = common.stamped_log(started)
    shared = dict(threads=args.threads, seed=args.seed, max_prompt_length=args.max_prompt_length,
                  dtype="bfloat16" if args.bf16 else "float32")

    def evaluate(model: Path, name: str) -> dict:
        spec = dict(shared, data_path=str(test), model_path=str(model), new_tokens=args.eval_new_tokens)
        result = common.run_phase(__file__, "eval", spec, args.timeout)
        log(f"{name}: accuracy {result['accuracy']:.3f}, format {result['format_rate']:.3f}, mean length "
            f"{result['mean_length']:.0f}, clipped {result['clipped_ratio']:.3f} ({result['wall_s']:.0f}s)")
        return result

    try:
        rows = common.gsm8k_rows(test_source, args.eval_questions)
        test = common.write_jsonl(work / "test.jsonl", rows)
        train = common.write_jsonl(work / "train.jsonl", common.gsm8k_rows(train_source, args.train_prompts))
        log(f"evaluating {args.model} on {args.eval_questions} test questions ...")
        before = evaluate(args.model, "before")
        train_spec = dict(shared, model_path=str(args.model), data_path=str(train), out_dir=str(work / "out"),
                          steps=args.steps, generations=args.generations, prompts_per_step=args.prompts_per_step,
                          micro_batch=args.micro_batch, new_tokens=args.new_tokens, learning_rate=args.learning_rate, bf16=args.bf16,
                          temperature=args.temperature, reward_funcs=reward_funcs, reward_weights=reward_weights)
        log(f"training {args.steps} steps with {list(zip(reward_funcs, reward_weights))} ...")
        trained = common.run_phase(__file__, "train", train_spec, args.timeout)
        rewards = [s["reward"] for s in trained["steps"]]
        log(f"trained in {trained['wall_s']:.0f}s; reward first 5 steps {sum(rewards[:5]) / 5:.3f}, "
            f"last 5 {sum(rewards[-5:]) / 5:.3f}")
        after = evaluate(work / "out", "after")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = common.clock() - started
    weighted = " + ".join(f"{w:g} x {n}" for n, w in zip(reward_funcs, reward_weights))
    settings = (f"G={args.generations}, {args.prompts_per_step} prompts/step (micro-batches of {args.micro_batch}), "
                f"{args.steps} steps, "
                f"max_completion_length={args.new_tokens}, lr={args.learning_rate:g} constant, "
                f"T={args.temperature:g}, beta=0, dapo, rewards {weighted}, vLLM rollouts, "
                f"{common.precision(args.bf16)}, {args.threads} CPU threads; eval greedy, {args.eval_new_tokens} tokens")
    summary = summarize(before, after, trained["steps"], total, (load_before, os.getloadavg()[0]))
    items = [{"question": r["prompt"][0]["content"], "answer": r["answer"], **{
        f"{key}_{when}": result[key][i] for when, result in (("before", before), ("after", after))
        for key in ("correct", "formatted", "lengths", "completions")}} for i, r in enumerate(rows)]
    table = phase_table(before, trained, after, args.prompts_per_step * args.generations)
    for result in (before, after):
        for key in ("correct", "formatted", "lengths", "completions"):
            result.pop(key)
    runs = [{"phase": "eval before", **before}, {"phase": "train", **trained}, {"phase": "eval after", **after}]
    plot_path = args.json.with_name(args.json.stem + "_reward.png")
    common.write_json(args.json, "grpo_gsm8k", args, runs, [], summary=summary, items=items,
                      instruction=common.GSM8K_INSTRUCTION)
    a, f = summary["accuracy_mcnemar_p"], summary["format_rate_mcnemar_p"]
    common.plot_rewards(trained["steps"], series, plot_title(args.model.name, summary),
                        f"{settings}; total {total / 60:.0f} min", plot_path, k=5)
    common.print_header("GRPO on GSM8K", settings, started, load_before)
    print(f"accuracy on the first {args.eval_questions} test questions: {summary['accuracy_before']:.1%} -> "
          f"{summary['accuracy_after']:.1%} ({summary['accuracy_newly_1']} newly right, "
          f"{summary['accuracy_newly_0']} newly wrong, McNemar exact p = {a:.3g}); '#### N' at the end "
          f"{summary['format_rate_before']:.1%} -> {summary['format_rate_after']:.1%} (p = {f:.3g}); mean length "
          f"{summary['mean_length_before']:.0f} -> {summary['mean_length_after']:.0f} tokens; frac_reward_zero_std "
          f"{summary['frac_reward_zero_std_mean']:.2f} over the run\n")
    print(table)
    print(f"\nresults: {args.json}, {plot_path}")


if __name__ == "__main__":
    main()
