"""DPO speed and memory: alignflow's `run_dpo` against TRL's `DPOTrainer`, side by side.

    flock /tmp/alignflow-bench.lock python benchmarks/dpo.py --models tiny,smollm2

For each model, both trainers train on the same Anthropic HH harmless-base pairs with the same
batch size, max_length, learning rate and linear schedule, beta=0.1, loss_type=sigmoid, a frozen
copy of the starting model as reference (loaded from the same folder), reference log-probs
computed on the fly (no precomputation), float32, 2 torch threads, no gradient checkpointing
(TRL turns it on by default; alignflow does not), dropout off (both defaults), no evaluation, no
MLflow/report_to, and logging only at the end. alignflow runs with its defaults, which pack each
batch's 2B sequences into rows of `max_length` (`padding_free`, exact: position ids restart per
sequence); `--trainers alignflow,trl,alignflow-padded` adds a row with padding_free=False, the
layout TRL 1.16 uses (2B rows padded to the longest; its padding-free mode is switched off).
Every run is its own process, so each peak RSS belongs to one trainer; runs alternate between
the trainers and the table shows medians over `--repeats`.

Data: HH pairs carry the prompt implicitly (both texts repeat the conversation). The parent
splits each pair once with alignflow's `preference_texts` and hands both trainers the same
explicit prompt/chosen/rejected strings, keeping the first `--num-pairs` pairs whose prompt fits
in half of `max_length` and whose prompt + reply fits in `max_length` (counted with the model's
tokenizer), so neither trainer truncates and both see the same tokens.

What is timed: the training steps only, as the time between the ends of consecutive optimizer
steps (batching, policy and reference forwards, backward, clipping, optimizer), leaving out the
first `--warmup-steps`. Imports, data preparation (reading and tokenizing), model loading
(policy and reference) and saving are separate phases; "wall s" is the whole process, everything
included. Pairs/s counts the pairs trained on in the timed steps; tokens/step (real, non-pad
tokens of all 2B sequences) is a sanity check that both did the same work.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import bench_env, format_table, median, run_child, self_peak_rss_mb, write_result

REPO = Path(__file__).resolve().parent.parent
HH = REPO.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
SMOLLM2 = Path(os.environ.get("ALIGNFLOW_CACHE", Path.home() / ".cache" / "alignflow")) / "smollm2-135m-instruct"
TRAINERS = ("alignflow", "trl", "alignflow-padded")  # -padded: alignflow with padding_free=False, TRL's layout


# ----------------------------------------------------------------------------------------------
# Child side: one training run, timed phase by phase


def _clock() -> float:
    return time.perf_counter()


def _timed_steps(spec: dict, train_start: float, step_ends: list[float], step_tokens: list[int]) -> dict:
    """Throughput over the steps after the warm-up ones."""
    warm = min(spec["warmup_steps"], len(step_ends) - 1)
    begin = step_ends[warm - 1] if warm else train_start
    seconds = step_ends[-1] - begin
    timed = len(step_ends) - warm
    return {"pairs_per_s": timed * spec["batch_size"] / seconds, "s_per_step": seconds / timed,
            "tokens_per_step": sum(step_tokens[warm:]) / timed, "train_s": step_ends[-1] - train_start,
            "steps": len(step_ends)}


def child_alignflow(spec: dict, started: float) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    # What run_dpo imports lazily, imported here so that the import phase holds all imports (as for TRL).
    import datasets  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler  # noqa: F401

    from trainer import checkpoint, dpo

    marks: dict[str, float] = {"imported": _clock()}
    step_ends: list[float] = []
    step_tokens: list[int] = [0]

    # Instrument the stage through the names it calls; nothing else changes.
    load_causal_lm, step_batches, collate, clip_and_step = (dpo.load_causal_lm, dpo.step_batches, dpo.collate,
                                                            dpo.clip_and_step)
    save_checkpoint = checkpoint.save_checkpoint

    def timed_load(*args, **kwargs):  # called for the policy, then the reference
        start = _clock()
        marks.setdefault("load_start", start)
        model = load_causal_lm(*args, **kwargs)
        marks["load_s"] = marks.get("load_s", 0.0) + _clock() - start
        marks["rss_after_load"] = self_peak_rss_mb()
        return model

    def timed_step_batches(*args, **kwargs):
        marks.setdefault("train_start", _clock())
        return step_batches(*args, **kwargs)

    def counting_collate(*args, **kwargs):
        batch = collate(*args, **kwargs)
        step_tokens[-1] += batch.num_tokens
        return batch

    def timed_clip_and_step(*args, **kwargs):
        out = clip_and_step(*args, **kwargs)
        step_ends.append(_clock())
        step_tokens.append(0)
        return out

    def timed_save(*args, **kwargs):
        marks["save_start"] = _clock()
        save_checkpoint(*args, **kwargs)
        marks["save_end"] = _clock()

    dpo.load_causal_lm, dpo.step_batches, dpo.collate, dpo.clip_and_step = (
        timed_load, timed_step_batches, counting_collate, timed_clip_and_step)
    checkpoint.save_checkpoint = timed_save

    config = dpo.DPOConfig(
        model=spec["model_path"], dataset=spec["data_path"], output_dir=spec["out_dir"], dtype="float32",
        max_steps=spec["steps"], per_device_batch_size=spec["batch_size"], learning_rate=spec["learning_rate"],
        lr_scheduler="linear", warmup_ratio=0.0, max_length=spec["max_length"], beta=spec["beta"],
        loss_type="sigmoid", precompute_ref_log_probs=False, padding_free=spec["trainer"] != "alignflow-padded",
        seed=spec["seed"], disable_progress_bar=True,
        logging_steps=10**9, save_steps=0)
    dpo.run_dpo(config)
    done = _clock()
    history = [json.loads(line) for line in Path(spec["out_dir"], checkpoint.METRICS_FILE).read_text().splitlines()]
    last = next((r for r in reversed(history) if "loss" in r), {})
    return {**_timed_steps(spec, marks["train_start"], step_ends, step_tokens[:-1]),
            "import_s": marks["imported"] - started,
            "data_s": marks["load_start"] - marks["imported"],  # tokenizer, rows, implicit prompts, tokenizing
            "load_s": marks["load_s"],
            "save_s": marks["save_end"] - marks["save_start"],
            "total_s": done - started, "rss_after_load_mb": marks["rss_after_load"],
            "loss": last.get("loss"), "accuracy": last.get("rewards/accuracies")}


def child_trl(spec: dict, started: float) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    import datasets
    import trl.trainer.dpo_trainer as trl_dpo
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    imported = _clock()
    step_ends: list[float] = []
    step_tokens: dict[int, int] = {}
    marks: dict[str, float] = {"ref_load_s": 0.0}
    last_metrics: dict[str, float] = {}

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks["train_start"] = _clock()

        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(_clock())

        def on_log(self, args, state, control, logs=None, **kwargs):
            last_metrics.update(logs or {})

    class CountingDPOTrainer(DPOTrainer):
        """Counts the real tokens of each micro-batch the model trains on; the loss is TRL's own."""

        def compute_loss(self, model, inputs, *args, **kwargs):
            if model.training:
                n = int(inputs["attention_mask"].sum())
                step_tokens[self.state.global_step] = step_tokens.get(self.state.global_step, 0) + n
            return super().compute_loss(model, inputs, *args, **kwargs)

    # TRL loads the reference itself (a copy of the policy's checkpoint): time that as loading, not data.
    create_model = trl_dpo.create_model_from_path

    def timed_create(*args, **kwargs):
        start = _clock()
        model = create_model(*args, **kwargs)
        marks["ref_load_s"] += _clock() - start
        marks["rss_after_load"] = self_peak_rss_mb()
        return model

    trl_dpo.create_model_from_path = timed_create

    data_start = _clock()
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    rows = datasets.load_dataset("json", data_files=spec["data_path"], split="train")
    data_s = _clock() - data_start
    load_start = _clock()
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    load_s = _clock() - load_start
    args = DPOConfig(
        output_dir=spec["out_dir"], max_steps=spec["steps"], per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=1, learning_rate=spec["learning_rate"], lr_scheduler_type="linear",
        warmup_steps=0, max_length=spec["max_length"], truncation_mode="keep_start", beta=spec["beta"],
        loss_type=["sigmoid"], precompute_ref_log_probs=False, bf16=False, fp16=False, use_cpu=True,
        gradient_checkpointing=False, seed=spec["seed"], logging_steps=10**9, save_strategy="no",
        eval_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    init_start = _clock()
    trainer = CountingDPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                                 callbacks=[StepTimer()])
    load_s += marks["ref_load_s"]
    data_s += _clock() - init_start - marks["ref_load_s"]  # the constructor tokenizes
    trainer.train()
    save_start = _clock()
    trainer.save_model(spec["out_dir"])
    done = _clock()
    tokens = [step_tokens.get(step, 0) for step in range(len(step_ends))]
    return {**_timed_steps(spec, marks["train_start"], step_ends, tokens),
            "import_s": imported - started, "data_s": data_s, "load_s": load_s, "save_s": done - save_start,
            "total_s": done - started, "rss_after_load_mb": marks.get("rss_after_load"),
            "loss": last_metrics.get("train_loss"), "accuracy": last_metrics.get("rewards/accuracies")}


def child_main(spec: dict) -> None:
    started = _clock()
    result = (child_trl if spec["trainer"] == "trl" else child_alignflow)(spec, started)
    result["peak_rss_self_mb"] = self_peak_rss_mb()
    write_result(result)


# ----------------------------------------------------------------------------------------------
# Parent side: data, models, the runs and the table


def prepare_data(out: Path, model_dir: Path, num_pairs: int, max_length: int) -> tuple[Path, dict]:
    """The first `num_pairs` HH pairs that fit `max_length` untruncated, as explicit prompt/chosen/rejected."""
    from transformers import AutoTokenizer

    from trainer.preferences import preference_texts

    if not HH.exists():
        sys.exit(f"The HH pairs are missing at {HH}.")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    path = out / f"hh-{model_dir.name}.jsonl"
    kept, seen, tokens = 0, 0, 0
    with gzip.open(HH, "rt") as src, open(path, "w") as dst:
        for index, line in enumerate(src):
            seen += 1
            pair = preference_texts(json.loads(line), index)
            if pair.chosen == pair.rejected or not pair.prompt:
                continue
            n_prompt = len(tokenizer(pair.prompt)["input_ids"])
            # +1: both trainers append eos to the replies.
            n_replies = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in (pair.chosen, pair.rejected)]
            if n_prompt > max_length // 2 or n_prompt + max(n_replies) > max_length:
                continue
            dst.write(json.dumps({"prompt": pair.prompt, "chosen": pair.chosen, "rejected": pair.rejected}) + "\n")
            tokens += 2 * n_prompt + sum(n_replies)
            kept += 1
            if kept == num_pairs:
                break
    if kept < num_pairs:
        print(f"  only {kept} of {seen} HH pairs fit max_length={max_length} with {model_dir.name}'s tokenizer",
              file=sys.stderr)
    return path, {"pairs": kept, "scanned": seen, "tokens_per_pair": tokens / max(kept, 1)}


def model_path(name: str, work: Path, smollm2_dir: Path) -> Path:
    if name == "tiny":
        out = work / "tiny"
        subprocess.run([sys.executable, "-c", f"from trainer.tiny import init_tiny; init_tiny({str(out)!r})"],
                       check=True, cwd=REPO, env=bench_env())
        return out
    if name == "smollm2":
        if not (smollm2_dir / "config.json").exists() or not (smollm2_dir / "model.safetensors").exists():
            sys.exit(f"SmolLM2 is missing at {smollm2_dir}; import it with scripts/get_smollm2.sh "
                     "or pass --smollm2-dir.")
        return smollm2_dir
    sys.exit(f"Unknown model {name!r}; use tiny and/or smollm2.")


def run_one(spec: dict, work: Path, threads: int, timeout: float) -> dict | None:
    """One training run in its own process, with its own output folder and datasets cache."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    spec = {**spec, "out_dir": str(run_dir / "out")}
    env = bench_env(threads, HF_DATASETS_CACHE=str(run_dir / "datasets-cache"), PYTHONPATH=str(REPO))
    env.pop("MLFLOW_TRACKING_URI", None)
    child = run_child([sys.executable, __file__, "--child", json.dumps(spec)], env=env, timeout=timeout)
    shutil.rmtree(run_dir, ignore_errors=True)
    if not child.ok:
        print(f"  FAILED (exit {child.returncode}):\n{child.output[-3000:]}", file=sys.stderr)
        return None
    return {**child.result, "peak_rss_mb": child.peak_rss_mb, "wall_s": child.wall_s}


COLUMNS = [("pairs_per_s", "pairs/s"), ("s_per_step", "s/step"), ("peak_rss_mb", "peak RSS MB"),
           ("import_s", "import s"), ("data_s", "data s"), ("load_s", "load s"), ("train_s", "train s"),
           ("save_s", "save s"), ("wall_s", "wall s"), ("tokens_per_step", "tok/step"), ("loss", "loss")]


def summarise(results: dict[tuple[str, str], list[dict]], models: list[str], trainers: list[str]) -> str:
    headers = ["model", "trainer", *(title for _, title in COLUMNS)]
    rows = []
    for model in models:
        med = {}
        for trainer in trainers:
            runs = results.get((model, trainer), [])
            med[trainer] = {key: median([r.get(key) for r in runs]) for key, _ in COLUMNS}
            rows.append([model, f"{trainer} (n={len(runs)})", *(med[trainer][key] for key, _ in COLUMNS)])
        for ours in (t for t in trainers if t != "trl" and "trl" in trainers):
            ratio = [a / b if a is not None and b else None
                     for a, b in ((med[ours][k], med["trl"][k]) for k, _ in COLUMNS)]
            ratio[-2:] = [None, None]  # tokens per step and loss are sanity checks, not ratios
            rows.append([model, f"{ours}/TRL", *ratio])
    return format_table(headers, rows)


def default_steps(model: str) -> int:
    return 20 if model == "tiny" else 4


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2", help="Comma-separated: tiny, smollm2.")
    parser.add_argument("--trainers", default="alignflow,trl",
                        help="Comma-separated: alignflow (its defaults, padding-free batches), trl, and "
                             "alignflow-padded (padding_free=False: 2B rows padded to the longest, as TRL).")
    parser.add_argument("--steps", type=int, default=None,
                        help="Optimizer steps per run (default: 20 for tiny, 4 for smollm2).")
    parser.add_argument("--warmup-steps", type=int, default=1, help="Leading steps left out of pairs/s and s/step.")
    parser.add_argument("--batch-size", type=int, default=4, help="Pairs per step (2x rows per forward).")
    parser.add_argument("--max-length", type=int, default=256, help="max_length (prompt + reply).")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta.")
    parser.add_argument("--learning-rate", type=float, default=5e-6, help="Peak learning rate (linear decay, no warmup).")
    parser.add_argument("--repeats", type=int, default=2, help="Runs per (model, trainer); medians shown.")
    parser.add_argument("--num-pairs", type=int, default=256, help="HH pairs used (the first N that fit).")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each run.")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--smollm2-dir", type=Path, default=SMOLLM2)
    parser.add_argument("--timeout", type=float, default=900, help="Seconds before a run is killed.")
    parser.add_argument("--json", type=Path, default=None, help="Also write every run's numbers here.")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))

    sys.path.insert(0, str(REPO))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
    if unknown := set(trainers) - set(TRAINERS):
        sys.exit(f"Unknown trainers {sorted(unknown)}; use {', '.join(TRAINERS)}.")
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-dpo-"))
    results: dict[tuple[str, str], list[dict]] = {}
    raw, data_info = [], {}
    started = time.perf_counter()
    try:
        for model in models:
            path = model_path(model, work, args.smollm2_dir)
            data, data_info[model] = prepare_data(work, path, args.num_pairs, args.max_length)
            steps = args.steps or default_steps(model)
            for repeat in range(args.repeats):
                # Alternate who goes first so slow drift on a shared machine hits both alike.
                for trainer in trainers if repeat % 2 == 0 else trainers[::-1]:
                    spec = dict(trainer=trainer, model_path=str(path), data_path=str(data), steps=steps,
                                batch_size=args.batch_size, learning_rate=args.learning_rate, beta=args.beta,
                                max_length=args.max_length, threads=args.threads, warmup_steps=args.warmup_steps,
                                seed=args.seed)
                    print(f"[{time.perf_counter() - started:6.0f}s] {model} {trainer} #{repeat + 1} ...",
                          file=sys.stderr, flush=True)
                    result = run_one(spec, work, args.threads, args.timeout)
                    if result is None:
                        continue
                    print(f"  {result['pairs_per_s']:.2f} pairs/s, {result['s_per_step']:.3f} s/step, "
                          f"{result['peak_rss_mb']:.0f} MB, {result['tokens_per_step']:.0f} tok/step, "
                          f"loss {result['loss']}", file=sys.stderr)
                    results.setdefault((model, trainer), []).append(result)
                    raw.append({"model": model, "trainer": trainer, "repeat": repeat, "steps": steps, **result})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    settings = (f"batch {args.batch_size} pairs, max_length {args.max_length}, beta {args.beta}, sigmoid, "
                f"lr {args.learning_rate} linear, float32, {args.threads} threads, frozen-copy reference, "
                "HH harmless-base pairs " + ", ".join(
                    f"{m}: {d['pairs']} pairs ~{d['tokens_per_pair']:.0f} tok/pair" for m, d in data_info.items())
                + ", steps " + ", ".join(f"{m}={args.steps or default_steps(m)}" for m in models)
                + f" (first {args.warmup_steps} untimed), medians of {args.repeats}")
    print(f"\nDPO, {settings}; total {time.perf_counter() - started:.0f}s\n")
    print(summarise(results, models, trainers))
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"smollm2_dir": str(args.smollm2_dir),
                                                                    "json": str(args.json)},
                                         "data": data_info, "runs": raw}, indent=1))


if __name__ == "__main__":
    main()
