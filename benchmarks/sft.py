"""SFT speed and memory: alignflow's `run_sft` against TRL's `SFTTrainer`, side by side.

    flock /tmp/alignflow-bench.lock python benchmarks/sft.py --models tiny,smollm2

For each model and packing setting, both trainers train on the same GSM8K prompt/completion
subset with the same batch size, max_length, gradient accumulation, learning rate and linear
schedule, completion-only loss, float32, 2 torch threads, no gradient checkpointing (TRL turns
it on by default; alignflow does not), and both save the final model. Every run is its own
process, so each peak RSS belongs to one trainer; runs alternate between the trainers and the
table shows medians over `--repeats`.

What is timed: the training steps only, as the time between the ends of consecutive optimizer
steps (batch building, forward, backward, clipping, optimizer and scheduler), leaving out the
first `--warmup-steps`. Imports, data preparation (tokenizing, packing), model loading and
saving are separate phases. Tokens are counted the same way for both: the real (non-pad) input
tokens of every micro-batch the model trains on.
"""

from __future__ import annotations

import argparse
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
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
SMOLLM2 = Path(os.environ.get("ALIGNFLOW_CACHE", Path.home() / ".cache" / "alignflow")) / "smollm2-135m-instruct"
TRAINERS = ("alignflow", "trl")
DEFAULT_STEPS = {"tiny": 30, "smollm2": 4}  # about 10 minutes for everything on 2 idle cores


# ----------------------------------------------------------------------------------------------
# Child side: one training run, timed phase by phase


def _clock() -> float:
    return time.perf_counter()


def _timed_steps(spec: dict, train_start: float, step_ends: list[float], step_tokens: list[int]) -> dict:
    """Throughput over the steps after the warm-up ones."""
    warm = min(spec["warmup_steps"], len(step_ends) - 1)
    begin = step_ends[warm - 1] if warm else train_start
    seconds = step_ends[-1] - begin
    tokens = sum(step_tokens[warm:])
    return {"tokens_per_s": tokens / seconds, "s_per_step": seconds / (len(step_ends) - warm),
            "tokens_per_step": tokens / (len(step_ends) - warm), "train_s": step_ends[-1] - train_start,
            "steps": len(step_ends)}


def child_alignflow(spec: dict, started: float) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    # What run_sft imports lazily, imported here so that the import phase holds all imports (as for TRL).
    import datasets  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler  # noqa: F401

    from trainer import checkpoint, sft

    marks: dict[str, float] = {"imported": _clock()}
    step_ends: list[float] = []
    step_tokens: list[int] = [0]

    # Instrument the stage through the names it calls; nothing else changes.
    load_causal_lm, step_batches, collate, clip_and_step = (sft.load_causal_lm, sft.step_batches, sft.collate,
                                                            sft.clip_and_step)
    save_checkpoint = checkpoint.save_checkpoint

    def timed_load(*args, **kwargs):
        marks["load_start"] = _clock()
        model = load_causal_lm(*args, **kwargs)
        marks["load_end"], marks["rss_after_load"] = _clock(), self_peak_rss_mb()
        return model

    def timed_step_batches(*args, **kwargs):
        marks.setdefault("train_start", _clock())
        return step_batches(*args, **kwargs)

    def counting_collate(data, rows, pad_id, packed):
        step_tokens[-1] += sum(len(data.input_ids[i]) for members in rows for i in members)
        return collate(data, rows, pad_id, packed)

    def timed_clip_and_step(*args, **kwargs):
        out = clip_and_step(*args, **kwargs)
        step_ends.append(_clock())
        step_tokens.append(0)
        return out

    def timed_save(*args, **kwargs):
        marks["save_start"] = _clock()
        save_checkpoint(*args, **kwargs)
        marks["save_end"] = _clock()

    sft.load_causal_lm, sft.step_batches, sft.collate, sft.clip_and_step = (
        timed_load, timed_step_batches, counting_collate, timed_clip_and_step)
    checkpoint.save_checkpoint = timed_save

    config = sft.SFTConfig(
        model=spec["model_path"], dataset=spec["data_path"], output_dir=spec["out_dir"], dtype="float32",
        max_steps=spec["steps"], per_device_batch_size=spec["batch_size"],
        gradient_accumulation_steps=spec["grad_accum"], learning_rate=spec["learning_rate"],
        lr_scheduler="linear", warmup_ratio=0.0, max_length=spec["max_length"], packing=spec["packing"],
        completion_only_loss=True, seed=spec["seed"], num_sample_completions=0, disable_progress_bar=True,
        logging_steps=10**9, save_steps=0)
    sft.run_sft(config)
    done = _clock()
    history = [json.loads(line) for line in Path(spec["out_dir"], checkpoint.METRICS_FILE).read_text().splitlines()]
    loss = next((r["loss"] for r in reversed(history) if "loss" in r), None)
    return {**_timed_steps(spec, marks["train_start"], step_ends, step_tokens[:-1]),
            "import_s": marks["imported"] - started,
            "data_s": marks["load_start"] - marks["imported"],  # tokenizer, rows, tokenize, pack
            "load_s": marks["load_end"] - marks["load_start"],
            "save_s": marks["save_end"] - marks["save_start"],
            "total_s": done - started, "rss_after_load_mb": marks["rss_after_load"], "loss": loss}


def child_trl(spec: dict, started: float) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    imported = _clock()
    step_ends: list[float] = []
    step_tokens: dict[int, int] = {}
    marks: dict[str, float] = {}

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks["train_start"] = _clock()

        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(_clock())

    class CountingSFTTrainer(SFTTrainer):
        """Counts the real tokens of each micro-batch the model trains on; the loss is TRL's own."""

        def compute_loss(self, model, inputs, *args, **kwargs):
            if model.training:
                # Padded batches carry an attention mask; padding-free (packed) ones are one row with no padding.
                mask = inputs.get("attention_mask")
                n = int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
                step_tokens[self.state.global_step] = step_tokens.get(self.state.global_step, 0) + n
            return super().compute_loss(model, inputs, *args, **kwargs)

    data_start = _clock()
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    rows = datasets.load_dataset("json", data_files=spec["data_path"], split="train")
    data_s = _clock() - data_start
    load_start = _clock()
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    load_s, rss_after_load = _clock() - load_start, self_peak_rss_mb()
    args = SFTConfig(
        output_dir=spec["out_dir"], max_steps=spec["steps"], per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=spec["grad_accum"], learning_rate=spec["learning_rate"],
        lr_scheduler_type="linear", warmup_steps=0, max_length=spec["max_length"], packing=spec["packing"],
        packing_strategy="bfd", completion_only_loss=True, bf16=False, fp16=False, use_cpu=True,
        gradient_checkpointing=False, seed=spec["seed"], logging_steps=10**9, save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    init_start = _clock()
    trainer = CountingSFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                                 callbacks=[StepTimer()])
    data_s += _clock() - init_start  # the constructor tokenizes and packs
    output = trainer.train()
    save_start = _clock()
    trainer.save_model(spec["out_dir"])
    done = _clock()
    tokens = [step_tokens.get(step, 0) for step in range(len(step_ends))]
    return {**_timed_steps(spec, marks["train_start"], step_ends, tokens),
            "import_s": imported - started, "data_s": data_s, "load_s": load_s, "save_s": done - save_start,
            "total_s": done - started, "rss_after_load_mb": rss_after_load, "loss": output.training_loss}


def child_main(spec: dict) -> None:
    started = _clock()
    result = (child_alignflow if spec["trainer"] == "alignflow" else child_trl)(spec, started)
    result["peak_rss_self_mb"] = self_peak_rss_mb()
    write_result(result)


# ----------------------------------------------------------------------------------------------
# Parent side: data, models, the runs and the table


def prepare_data(out: Path, num_examples: int) -> Path:
    """The first `num_examples` GSM8K training rows as prompt/completion jsonl."""
    if not GSM8K.exists():
        sys.exit(f"GSM8K is missing at {GSM8K}.")
    path = out / "gsm8k-sft.jsonl"
    with open(GSM8K) as src, open(path, "w") as dst:
        for i, line in enumerate(src):
            if i == num_examples:
                break
            row = json.loads(line)
            dst.write(json.dumps({"prompt": f"Question: {row['question']}\nAnswer:",
                                  "completion": f" {row['answer']}"}) + "\n")
    return path


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
    raise ValueError(name)


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


COLUMNS = [("tokens_per_s", "tok/s"), ("s_per_step", "s/step"), ("peak_rss_mb", "peak RSS MB"),
           ("import_s", "import s"), ("data_s", "data s"), ("load_s", "load s"), ("train_s", "train s"),
           ("save_s", "save s"), ("tokens_per_step", "tok/step"), ("loss", "loss")]


def summarise(results: dict[tuple[str, bool, str], list[dict]], models: list[str], packings: list[bool]) -> str:
    headers = ["model", "packing", "trainer", *(title for _, title in COLUMNS)]
    rows = []
    for model in models:
        for packing in packings:
            med = {}
            for trainer in TRAINERS:
                runs = results.get((model, packing, trainer), [])
                med[trainer] = {key: median([r.get(key) for r in runs]) for key, _ in COLUMNS}
                rows.append([model, "bfd" if packing else "no", f"{trainer} (n={len(runs)})",
                             *(med[trainer][key] for key, _ in COLUMNS)])
            ratio = [a / b if a is not None and b else None
                     for a, b in ((med["alignflow"][k], med["trl"][k]) for k, _ in COLUMNS)]
            ratio[-2:] = [None, None]  # tokens per step and loss are sanity checks, not ratios
            rows.append([model, "bfd" if packing else "no", "alignflow/TRL", *ratio])
    return format_table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2", help="Comma-separated: tiny, smollm2.")
    parser.add_argument("--steps", type=int, default=None,
                        help="Optimizer steps per run (default: 30 for tiny, 4 for smollm2).")
    parser.add_argument("--warmup-steps", type=int, default=1, help="Leading steps left out of tokens/s and s/step.")
    parser.add_argument("--batch-size", type=int, default=4, help="Rows per micro-batch (packed rows when packing).")
    parser.add_argument("--max-length", type=int, default=256, help="max_length (and the packed row length).")
    parser.add_argument("--grad-accum", type=int, default=1, help="Gradient accumulation steps.")
    parser.add_argument("--learning-rate", type=float, default=2e-5, help="Peak learning rate (linear decay, no warmup).")
    parser.add_argument("--repeats", type=int, default=2, help="Runs per (model, packing, trainer); medians shown.")
    parser.add_argument("--packing", default="no,bfd", help="Comma-separated: no, bfd.")
    parser.add_argument("--num-examples", type=int, default=1000, help="GSM8K training rows used (the first N).")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each run.")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--smollm2-dir", type=Path, default=SMOLLM2)
    parser.add_argument("--timeout", type=float, default=900, help="Seconds before a run is killed.")
    parser.add_argument("--json", type=Path, default=None, help="Also write every run's numbers here.")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    packings = [p.strip() == "bfd" for p in args.packing.split(",") if p.strip()]
    if set(models) - set(DEFAULT_STEPS):
        sys.exit(f"Unknown model(s) {sorted(set(models) - set(DEFAULT_STEPS))}; use {', '.join(DEFAULT_STEPS)}.")
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-sft-"))
    results: dict[tuple[str, bool, str], list[dict]] = {}
    raw = []
    started = time.perf_counter()
    try:
        data = prepare_data(work, args.num_examples)
        for model in models:
            path = model_path(model, work, args.smollm2_dir)
            steps = args.steps or DEFAULT_STEPS[model]
            for packing in packings:
                for repeat in range(args.repeats):
                    # Alternate who goes first so slow drift on a shared machine hits both alike.
                    for trainer in TRAINERS if repeat % 2 == 0 else TRAINERS[::-1]:
                        spec = dict(trainer=trainer, model_path=str(path), data_path=str(data), steps=steps,
                                    batch_size=args.batch_size, grad_accum=args.grad_accum,
                                    learning_rate=args.learning_rate, max_length=args.max_length, packing=packing,
                                    threads=args.threads, warmup_steps=args.warmup_steps, seed=args.seed)
                        label = f"{model} packing={'bfd' if packing else 'no'} {trainer} #{repeat + 1}"
                        print(f"[{time.perf_counter() - started:6.0f}s] {label} ...", file=sys.stderr, flush=True)
                        result = run_one(spec, work, args.threads, args.timeout)
                        if result is None:
                            continue
                        print(f"  {result['tokens_per_s']:.0f} tok/s, {result['s_per_step']:.3f} s/step, "
                              f"peak {result['peak_rss_mb']:.0f} MB ({result['rss_after_load_mb']:.0f} MB after "
                              f"load), loss {result['loss']:.4g}", file=sys.stderr)
                        results.setdefault((model, packing, trainer), []).append(result)
                        raw.append({"model": model, "packing": packing, "trainer": trainer, "repeat": repeat,
                                    "steps": steps, **result})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    settings = (f"batch {args.batch_size} x accumulation {args.grad_accum}, max_length {args.max_length}, "
                f"lr {args.learning_rate} linear, float32, {args.threads} threads, "
                f"{args.num_examples} GSM8K rows, steps " + ", ".join(
                    f"{m}={args.steps or DEFAULT_STEPS[m]}" for m in models)
                + f" (first {args.warmup_steps} untimed), medians of {args.repeats}")
    # Other work on a shared machine slows every run; the load average says how much there was.
    print(f"\nSFT, {settings}; total {time.perf_counter() - started:.0f}s, "
          f"1-min load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after\n")
    print(summarise(results, models, packings))
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"smollm2_dir": str(args.smollm2_dir),
                                                                    "json": str(args.json)},
                                         "runs": raw}, indent=1))


if __name__ == "__main__":
    main()
