"""GRPO quality on GSM8K: SmolLM2-135M-Instruct, exact-answer reward, vLLM rollouts, on CPU.

    nohup flock /tmp/alignflow-bench.lock python benchmarks/grpo_gsm8k.py > /tmp/grpo_gsm8k.log 2>&1 &

1. before  greedy answers of the starting model to 200 fixed GSM8K test questions (the first
           200 of `--eval-data`, default ../shared/data/gsm8k/test.jsonl), scored with the
           built-in `exact_answer` reward -> accuracy
2. train   `run_grpo` on GSM8K train prompts (the first `--train-prompts` of `--data`, default
           ../shared/data/gsm8k/train.jsonl, sampled by the trainer's seeded order) with
           `exact_answer` plus a small `answer_format` reward, in-process vLLM rollouts
3. after   the same evaluation of the trained model
4. write   `--json` (default benchmarks/results/grpo_gsm8k.json: config, environment, one row per
           phase with accuracies, per-question correctness, per-step rewards, runtimes, peak
           memory) and the reward curve beside it (grpo_gsm8k_reward.png)

Prompts are one user message: the question and an instruction to end with "#### <number>"
(`common.gsm8k_rows`, as in the speed benchmark). Evaluation uses the vLLM engine (greedy,
`--eval-new-tokens` tokens, eos stops) because transformers `generate` would take most of the
time budget on this CPU; accuracy is `exact_answer` (the number after the last "####", else
the last number, against the reference answer), the same function the trainer's reward and
`alignflow eval`'s accuracy use. Each phase runs in its own process.

This is a smoke-scale check that training moves the reward the right way on a real model with
a real task on two CPU cores; SmolLM2-135M gets only a few percent of GSM8K right, so 50 steps
of 16 completions are too few to show much. A longer GPU run is the real quality check.
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


# ----------------------------------------------------------------------------------------------
# Child side


def child_eval(spec: dict) -> dict:
    """Greedy answers to the test prompts with the vLLM engine; exact_answer accuracy."""
    from trainer.completions import prompt_token_ids
    from trainer.models import load_tokenizer
    from trainer.rewards import answer_format, exact_answer
    from trainer.rollout import SamplingConfig, make_engine

    rows = [json.loads(line) for line in Path(spec["data_path"]).read_text().splitlines()]
    tokenizer = load_tokenizer(spec["model_path"])
    encoded = [prompt_token_ids(r["prompt"], tokenizer, spec["max_prompt_length"]) for r in rows]
    start = time.perf_counter()
    engine = make_engine("vllm", model=None, tokenizer=tokenizer, model_path=spec["model_path"],
                         max_model_len=spec["max_prompt_length"] + spec["new_tokens"], seed=spec["seed"])
    ready = time.perf_counter()
    sampling = SamplingConfig(max_new_tokens=spec["new_tokens"], temperature=0.0,
                              stop_token_ids=[tokenizer.eos_token_id])
    with engine:
        completions = [group[0] for group in engine.generate(encoded, sampling)]
    generated = time.perf_counter()
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    shaped = [[{"role": "assistant", "content": t}] for t in texts]  # chat prompts -> chat completions (TRL)
    prompts = [r["prompt"] for r in rows]
    correct = exact_answer(prompts, shaped, answer=[r["answer"] for r in rows])
    formatted = answer_format(prompts, shaped)
    return {"accuracy": sum(correct) / len(correct), "correct": [int(c) for c in correct],
            "format_rate": sum(formatted) / len(formatted),
            "mean_length": sum(len(c.token_ids) for c in completions) / len(completions),
            "clipped_ratio": sum(c.finish_reason == "length" for c in completions) / len(completions),
            "engine_start_s": ready - start, "generate_s": generated - ready,
            "samples": [{"question": r["prompt"][0]["content"], "completion": t, "answer": r["answer"]}
                        for r, t in list(zip(rows, texts))[:3]]}


def child_train(spec: dict) -> dict:
    from trainer import checkpoint, grpo

    config = grpo.GRPOConfig(
        model=spec["model_path"], dataset=spec["data_path"], output_dir=spec["out_dir"], dtype="float32",
        rollout_engine="vllm", max_steps=spec["steps"], num_generations=spec["generations"],
        per_device_batch_size=spec["prompts_per_step"] * spec["generations"], gradient_accumulation_steps=1,
        max_prompt_length=spec["max_prompt_length"], max_completion_length=spec["new_tokens"],
        temperature=spec["temperature"], learning_rate=spec["learning_rate"], lr_scheduler="constant",
        beta=0.0, loss_type="dapo", scale_rewards="group", reward_funcs=["exact_answer", "answer_format"],
        reward_weights=[1.0, spec["format_weight"]], seed=spec["seed"], logging_steps=1,
        log_completions_steps=0, save_steps=0, disable_progress_bar=True)
    start = time.perf_counter()
    grpo.run_grpo(config)
    history = checkpoint.read_history(spec["out_dir"])
    keys = ("reward", "reward_std", "rewards/exact_answer/mean", "rewards/answer_format/mean",
            "completions/mean_length", "completions/clipped_ratio", "frac_reward_zero_std", "kl", "entropy",
            "loss", "grad_norm", "step_time", "timing/generate", "timing/update", "timing/sync")
    steps = [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in history if "reward" in r]
    return {"steps": steps, "train_s": time.perf_counter() - start}


def child_main(kind: str, spec: dict) -> None:
    common.torch_threads(spec["threads"])
    common.write_result(child_eval(spec) if kind == "eval" else child_train(spec))


# ----------------------------------------------------------------------------------------------
# Parent side


def run(kind: str, spec: dict, timeout: float) -> dict:
    env = common.child_env(spec["threads"], vllm=True)
    result = common.measure(__file__, [json.dumps([kind, spec])], env, timeout)
    if result is None:
        sys.exit(f"The {kind} phase failed; its output is above.")
    return result


def phase_table(before: dict, trained: dict, after: dict, completions_per_step: int) -> str:
    """Wall time, the measured parts, throughput and peak memory of each phase (its own process)."""
    steps = trained["steps"]
    step_s = sum(s["step_time"] for s in steps)
    train_tokens = sum(s["completions/mean_length"] for s in steps) * completions_per_step

    def eval_row(name: str, r: dict) -> list:
        tokens = r["mean_length"] * len(r["correct"])
        return [name, r["wall_s"], r["engine_start_s"], r["generate_s"], None, tokens / r["generate_s"],
                r["peak_rss_mb"]]

    train = ["train", trained["wall_s"], None, sum(s.get("timing/generate", 0.0) for s in steps),
             step_s / len(steps), train_tokens / step_s, trained["peak_rss_mb"]]
    return common.format_table(["phase", "wall s", "engine start s", "generate s", "s/step", "gen tok/s", "peak RSS MB"],
                               [eval_row("eval before", before), train, eval_row("eval after", after)])


def plot(steps: list[dict], before: float, after: float, title: str, settings: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["step"] for s in steps]

    def smooth(values: list[float], k: int = 5) -> list[float]:
        return [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]

    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = [("reward", "total reward", "C0"), ("rewards/exact_answer/mean", "exact_answer", "C1"),
              ("rewards/answer_format/mean", "answer_format", "C2")]
    for key, label, color in series:
        y = [s.get(key, float("nan")) for s in steps]
        ax.plot(x, y, color=color, alpha=0.3, linewidth=1)
        ax.plot(x, smooth(y), color=color, linewidth=2, label=f"{label} (5-step mean)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward per completion")
    ax.set_title(f"{title}\ntest accuracy (greedy): {before:.1%} before -> {after:.1%} after", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.text(0.01, 0.01, settings, fontsize=6.5, color="0.35", wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--model", type=Path, default=common.SMOLLM2, help="Starting model (HF folder).")
    parser.add_argument("--generations", type=int, default=4, help="Completions per prompt (G).")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="Prompts per step (x G completions).")
    parser.add_argument("--new-tokens", type=int, default=160, help="max_completion_length in training.")
    parser.add_argument("--learning-rate", type=float, default=5e-6, help="Constant learning rate (AdamW).")
    parser.add_argument("--temperature", type=float, default=1.0, help="Rollout sampling temperature.")
    parser.add_argument("--format-weight", type=float, default=0.2, help="Weight of answer_format (exact_answer: 1).")
    parser.add_argument("--train-prompts", type=int, default=2000, help="First N GSM8K train questions to draw from.")
    parser.add_argument("--eval-questions", type=int, default=200, help="First N GSM8K test questions.")
    parser.add_argument("--eval-new-tokens", type=int, default=256, help="Most tokens per evaluation answer.")
    parser.add_argument("--max-prompt-length", type=int, default=512, help="Longer prompts lose their start.")
    parser.add_argument("--eval-data", type=Path, default=None,
                        help="GSM8K test questions (default: ../shared/data/gsm8k/test.jsonl beside the repository).")
    parser.add_argument("--steps", type=int, default=50, help="GRPO optimizer steps (one generation each).")
    common.add_run_flags(parser, "gsm8k/train.jsonl", warmup=None, repeats=False, timeout=3600,
                         json_default=RESULTS / "grpo_gsm8k.json")  # the reward curve goes beside it
    args = parser.parse_args(argv)
    if args.child:
        kind, spec = json.loads(args.child)
        return child_main(kind, spec)

    if not (args.model / "config.json").exists():
        sys.exit(f"No model at {args.model}; make SmolLM2 with scripts/get_smollm2.sh or pass --model.")
    train_source = common.data_path(args.data, "gsm8k/train.jsonl")
    test_source = common.data_path(args.eval_data, "gsm8k/test.jsonl", "--eval-data")
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="alignflow-grpo-gsm8k-"))
    started = common.clock()
    shared = dict(threads=args.threads, seed=args.seed, max_prompt_length=args.max_prompt_length)
    try:
        test = common.write_jsonl(work / "test.jsonl", common.gsm8k_rows(test_source, args.eval_questions))
        train = common.write_jsonl(work / "train.jsonl", common.gsm8k_rows(train_source, args.train_prompts))
        eval_spec = dict(shared, data_path=str(test), new_tokens=args.eval_new_tokens)

        def log(message: str) -> None:
            print(f"[{common.clock() - started:6.0f}s] {message}", flush=True)

        log(f"evaluating {args.model} on {args.eval_questions} test questions ...")
        before = run("eval", dict(eval_spec, model_path=str(args.model)), args.timeout)
        log(f"before: accuracy {before['accuracy']:.3f}, format {before['format_rate']:.3f}, "
            f"mean length {before['mean_length']:.0f} ({before['wall_s']:.0f}s)")
        train_spec = dict(shared, model_path=str(args.model), data_path=str(train), out_dir=str(work / "out"),
                          steps=args.steps, generations=args.generations, prompts_per_step=args.prompts_per_step,
                          new_tokens=args.new_tokens, learning_rate=args.learning_rate,
                          temperature=args.temperature, format_weight=args.format_weight)
        log(f"training {args.steps} steps ...")
        trained = run("train", train_spec, args.timeout)
        rewards = [s["reward"] for s in trained["steps"]]
        log(f"trained in {trained['wall_s']:.0f}s; reward first 5 steps {sum(rewards[:5]) / 5:.3f}, "
            f"last 5 {sum(rewards[-5:]) / 5:.3f}")
        after = run("eval", dict(eval_spec, model_path=str(work / "out")), args.timeout)
        log(f"after: accuracy {after['accuracy']:.3f}, format {after['format_rate']:.3f}, "
            f"mean length {after['mean_length']:.0f} ({after['wall_s']:.0f}s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = common.clock() - started
    settings = (f"G={args.generations}, {args.prompts_per_step} prompts/step, {args.steps} steps, "
                f"max_completion_length={args.new_tokens}, lr={args.learning_rate:g} constant, "
                f"T={args.temperature:g}, beta=0, dapo, rewards exact_answer + {args.format_weight:g} x answer_format, "
                f"vLLM rollouts, fp32, {args.threads} CPU threads; eval greedy, {args.eval_new_tokens} tokens")
    both = list(zip(before["correct"], after["correct"]))
    summary = {
        "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
        "newly_correct": sum(a == 0 and b == 1 for a, b in both), "newly_wrong": sum(a == 1 and b == 0 for a, b in both),
        "format_rate_before": before["format_rate"], "format_rate_after": after["format_rate"],
        "mean_length_before": before["mean_length"], "mean_length_after": after["mean_length"],
        "clipped_ratio_before": before["clipped_ratio"], "clipped_ratio_after": after["clipped_ratio"],
        "total_s": total,
    }
    runs = [{"phase": "eval before", **before}, {"phase": "train", **trained}, {"phase": "eval after", **after}]
    plot_path = args.json.with_name(args.json.stem + "_reward.png")
    common.write_json(args.json, "grpo_gsm8k", args, runs, common.median_rows(runs, ["phase"]), summary=summary,
                      instruction=common.GSM8K_INSTRUCTION)
    plot(trained["steps"], before["accuracy"], after["accuracy"],
         f"GRPO on GSM8K, {args.model.name}, CPU; eval on the first {args.eval_questions} test questions",
         f"{settings}; total {total / 60:.0f} min", plot_path)
    common.print_header("GRPO on GSM8K", settings, started, load_before)
    print(f"accuracy on the first {args.eval_questions} test questions: {before['accuracy']:.1%} -> "
          f"{after['accuracy']:.1%} ({summary['newly_correct']} newly right, {summary['newly_wrong']} newly wrong); "
          f"'#### N' format {before['format_rate']:.1%} -> {after['format_rate']:.1%}\n")
    print(phase_table(before, trained, after, args.prompts_per_step * args.generations))
    print(f"\nresults: {args.json}, {plot_path}")


if __name__ == "__main__":
    main()
