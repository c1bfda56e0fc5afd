"""GRPO quality on GSM8K: SmolLM2-135M-Instruct, exact-answer reward, vLLM rollouts, on CPU.

    nohup flock /tmp/alignflow-bench.lock python benchmarks/grpo_gsm8k.py > /tmp/grpo_gsm8k.log 2>&1 &

1. before  greedy answers of the starting model to 200 fixed GSM8K test questions (the first
           200 of test.jsonl), scored with the built-in `exact_answer` reward -> accuracy
2. train   `run_grpo` on GSM8K train prompts (the first `--train-prompts`, sampled by the
           trainer's seeded order) with `exact_answer` plus a small `answer_format` reward,
           in-process vLLM rollouts
3. after   the same evaluation of the trained model
4. write   benchmarks/results/grpo_gsm8k.json (settings, accuracies, per-question correctness,
           per-step rewards, runtimes) and benchmarks/results/grpo_gsm8k_reward.png

Prompts are one user message: the question and an instruction to end with "#### <number>"
(`grpo.gsm8k_rows`, as in the speed benchmark). Evaluation uses the vLLM engine (greedy,
`--eval-new-tokens` tokens, eos stops) because transformers `generate` would take most of the
time budget on this CPU; accuracy is `exact_answer` (the number after the last "####", else
the last number, against the reference answer), the same function the trainer's reward and
`alignflow eval`'s accuracy use. Each phase runs in its own process.

This is a smoke-scale check that training moves the reward the right way on a real model with
a real task on two CPU cores; SmolLM2-135M gets only a few percent of GSM8K right, so 50 steps
of 16 completions are too few to show much. A longer GPU run is the real quality check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import bench_env, run_child, write_result
from grpo import INSTRUCTION, SMOLLM2, gsm8k_rows

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data" / "gsm8k"
RESULTS = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------------------------
# Child side


def child_eval(spec: dict) -> dict:
    """Greedy answers to the test prompts with the vLLM engine; exact_answer accuracy."""
    import torch

    torch.set_num_threads(spec["threads"])
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
    import torch

    torch.set_num_threads(spec["threads"])
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
    history = [json.loads(line) for line in Path(spec["out_dir"], checkpoint.METRICS_FILE).read_text().splitlines()]
    keys = ("reward", "reward_std", "rewards/exact_answer/mean", "rewards/answer_format/mean",
            "completions/mean_length", "completions/clipped_ratio", "frac_reward_zero_std", "kl", "entropy",
            "loss", "grad_norm", "step_time", "timing/generate", "timing/update", "timing/sync")
    steps = [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in history if "reward" in r]
    return {"steps": steps, "train_s": time.perf_counter() - start}


def child_main(kind: str, spec: dict) -> None:
    write_result(child_eval(spec) if kind == "eval" else child_train(spec))


# ----------------------------------------------------------------------------------------------
# Parent side


def run(kind: str, spec: dict, timeout: float) -> dict:
    env = bench_env(spec["threads"], PYTHONPATH=str(REPO))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; unset, vLLM-CPU reserves a large share of RAM
    env.pop("MLFLOW_TRACKING_URI", None)
    child = run_child([sys.executable, __file__, "--child", kind, json.dumps(spec)], env=env, timeout=timeout)
    if not child.ok:
        sys.exit(f"{kind} failed (exit {child.returncode}):\n{child.output[-4000:]}")
    return {**child.result, "wall_s": child.wall_s, "peak_rss_mb": child.peak_rss_mb}


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SMOLLM2, help="Starting model (HF folder).")
    parser.add_argument("--steps", type=int, default=50, help="GRPO optimizer steps (one generation each).")
    parser.add_argument("--generations", type=int, default=4, help="Completions per prompt (G).")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=160, help="max_completion_length in training.")
    parser.add_argument("--learning-rate", type=float, default=5e-6, help="Constant learning rate (AdamW).")
    parser.add_argument("--temperature", type=float, default=1.0, help="Rollout sampling temperature.")
    parser.add_argument("--format-weight", type=float, default=0.2, help="Weight of answer_format (exact_answer: 1).")
    parser.add_argument("--train-prompts", type=int, default=2000, help="First N GSM8K train questions to draw from.")
    parser.add_argument("--eval-questions", type=int, default=200, help="First N GSM8K test questions.")
    parser.add_argument("--eval-new-tokens", type=int, default=256, help="Most tokens per evaluation answer.")
    parser.add_argument("--max-prompt-length", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--timeout", type=float, default=3600, help="Seconds before a phase is killed.")
    parser.add_argument("--results", type=Path, default=RESULTS, help="Where the JSON and PNG go.")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child[0], json.loads(args.child[1]))

    if not (args.model / "config.json").exists():
        sys.exit(f"No model at {args.model}; make SmolLM2 with scripts/get_smollm2.sh or pass --model.")
    work = Path(tempfile.mkdtemp(prefix="alignflow-grpo-gsm8k-"))
    started = time.perf_counter()
    common = dict(threads=args.threads, seed=args.seed, max_prompt_length=args.max_prompt_length)
    try:
        test, train = work / "test.jsonl", work / "train.jsonl"
        test.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows(DATA / "test.jsonl", args.eval_questions)))
        train.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows(DATA / "train.jsonl", args.train_prompts)))
        eval_spec = dict(common, data_path=str(test), new_tokens=args.eval_new_tokens)

        def log(message: str) -> None:
            print(f"[{time.perf_counter() - started:6.0f}s] {message}", flush=True)

        log(f"evaluating {args.model} on {args.eval_questions} test questions ...")
        before = run("eval", dict(eval_spec, model_path=str(args.model)), args.timeout)
        log(f"before: accuracy {before['accuracy']:.3f}, format {before['format_rate']:.3f}, "
            f"mean length {before['mean_length']:.0f} ({before['wall_s']:.0f}s)")
        train_spec = dict(common, model_path=str(args.model), data_path=str(train), out_dir=str(work / "out"),
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
    total = time.perf_counter() - started
    settings = (f"G={args.generations}, {args.prompts_per_step} prompts/step, {args.steps} steps, "
                f"max_completion_length={args.new_tokens}, lr={args.learning_rate:g} constant, "
                f"T={args.temperature:g}, beta=0, dapo, rewards exact_answer + {args.format_weight:g} x answer_format, "
                f"vLLM rollouts, fp32, {args.threads} CPU threads; eval greedy, {args.eval_new_tokens} tokens; "
                f"total {total / 60:.0f} min")
    both = list(zip(before["correct"], after["correct"]))
    summary = {
        "settings": vars(args) | {"model": str(args.model), "results": str(args.results), "instruction": INSTRUCTION},
        "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
        "newly_correct": sum(a == 0 and b == 1 for a, b in both), "newly_wrong": sum(a == 1 and b == 0 for a, b in both),
        "format_rate_before": before["format_rate"], "format_rate_after": after["format_rate"],
        "mean_length_before": before["mean_length"], "mean_length_after": after["mean_length"],
        "clipped_ratio_before": before["clipped_ratio"], "clipped_ratio_after": after["clipped_ratio"],
        "eval_wall_s": [before["wall_s"], after["wall_s"]], "train_wall_s": trained["wall_s"],
        "train_peak_rss_mb": trained["peak_rss_mb"], "total_s": total,
        "correct_before": before["correct"], "correct_after": after["correct"],
        "samples_before": before["samples"], "samples_after": after["samples"], "steps": trained["steps"],
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "grpo_gsm8k.json").write_text(json.dumps(summary, indent=1))
    plot(trained["steps"], before["accuracy"], after["accuracy"],
         f"GRPO on GSM8K, {args.model.name}, CPU; eval on the first {args.eval_questions} test questions",
         settings, args.results / "grpo_gsm8k_reward.png")
    print(f"\nGRPO on GSM8K ({settings})")
    print(f"accuracy on the first {args.eval_questions} test questions: {before['accuracy']:.1%} -> "
          f"{after['accuracy']:.1%} ({summary['newly_correct']} newly right, {summary['newly_wrong']} newly wrong); "
          f"'#### N' format {before['format_rate']:.1%} -> {after['format_rate']:.1%}")
    print(f"results: {args.results / 'grpo_gsm8k.json'}, {args.results / 'grpo_gsm8k_reward.png'}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
