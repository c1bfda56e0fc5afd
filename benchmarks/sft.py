"""SFT speed and memory: alignflow's `run_sft` against TRL's `SFTTrainer`, side by side.

    flock /tmp/alignflow-bench.lock python benchmarks/sft.py --models tiny,smollm2 --json sft.json

For each model and packing setting, both trainers train on the same GSM8K prompt/completion
subset with the same batch size, max_length, gradient accumulation, learning rate and linear
schedule, completion-only loss, float32, 2 torch threads, no gradient checkpointing (TRL turns
it on by default; alignflow does not), and both save the final model. `--bf16` gives both
trainers bf16 mixed precision instead (`bf16=True` in both configs: float32 weights, gradients
and AdamW state, forward and backward under bfloat16 autocast; TRL's own default on hardware
with bf16). Every run is its own process, so each peak RSS belongs to one trainer; runs
alternate between the trainers and the table shows medians over `--repeats`. `alignflow` runs
with its default `padding_free` (unpacked runs: on the CPU each micro-batch is one row), `alignflow-padded` pads
each example to the micro-batch's longest, as TRL does.

What is timed: the training steps only, as the time between the ends of consecutive optimizer
steps (batch building, forward, backward, clipping, optimizer and scheduler), leaving out the
first `--warmup-steps` ("s/step" is their mean, "median step s" the median single step,
"CPU s/step" the process's CPU seconds per step, all threads: on a shared machine it counts the
work done rather than the time other processes held the cores).
Imports, data preparation (tokenizing, packing), model loading and saving are separate phases.
Tokens are counted the same way for both: the real (non-pad) input tokens of every micro-batch
the model trains on.

Floor table (issue 28): two probe children (the training runs' threads and environment, one
before and one after the runs; the faster counts, as in grpo.py) time torch.matmul of 2048 x 2048
bf16 and fp32 matrices and a 512 MiB copy. Each median run's step is set against the matmul peak
(bf16 with `--bf16`, fp32 otherwise): useful FLOPs = 6 x (N_body x tokens + N_head x targets),
N_body = the nn.Linear weights of the transformer blocks and N_head = the LM head's (from the
model's config; `common.matmul_parameters`), tokens = the real tokens of the step, targets = its
loss-target tokens (alignflow runs the head only there; TRL runs it at every position, which this
count leaves out as work the step does not need; TRL rows take the targets of alignflow's run of
the same case). Left out: attention's own FLOPs (QK^T and AV; a few % at 256 tokens), norms,
activations, the softmax/loss and the optimizer. "step" divides by the mean s/step, "median step"
by the median single step. The JSON adds `peaks`, `probes`, `parameters` and `floor`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import common

TRAINERS = ("alignflow", "alignflow-padded", "trl")  # alignflow-padded: padding_free false
DEFAULT_STEPS = {"tiny": 30, "smollm2": 4}  # about 10 minutes for everything on 2 idle cores


# ----------------------------------------------------------------------------------------------
# Child side: one training run, timed phase by phase


def real_tokens(arguments: dict, batch) -> dict[str, int]:
    """The real input tokens of the examples `collate` puts in a batch (packed padding left out)."""
    data = arguments["data"]
    return {"tokens": sum(len(data.input_ids[i]) for members in arguments["rows"] for i in members),
            "targets": int(batch.target_mask.sum())}


def child_alignflow(spec: dict, started: float) -> dict:
    # What run_sft imports lazily, imported here so that the import phase holds all imports (as for TRL).
    import datasets  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler  # noqa: F401

    from trainer.engine import checkpoint
    from trainer.stages import sft

    imported = common.clock()
    probe = common.StageProbe(sft, "load_causal_lm", real_tokens)
    config = sft.SFTConfig(
        model=spec["model_path"], dataset=spec["data_path"], output_dir=spec["out_dir"], dtype="float32",
        bf16=spec["bf16"], max_steps=spec["steps"], per_device_batch_size=spec["batch_size"],
        gradient_accumulation_steps=spec["grad_accum"], learning_rate=spec["learning_rate"],
        lr_scheduler="linear", warmup_ratio=0.0, max_length=spec["max_length"], packing=spec["packing"],
        completion_only_loss=True, seed=spec["seed"], num_sample_completions=0, disable_progress_bar=True,
        logging_steps=10**9, save_steps=0,
        **{**spec.get("overrides", {}), **({"padding_free": False} if spec["trainer"] == "alignflow-padded" else {})})
    sft.run_sft(config)
    done = common.clock()
    loss = next((r["loss"] for r in reversed(checkpoint.read_history(spec["out_dir"])) if "loss" in r), None)
    return {**probe.result(imported, spec["warmup_steps"]), "import_s": imported - started,
            "total_s": done - started, "loss": loss}


def child_trl(spec: dict, started: float) -> dict:
    import datasets  # noqa: F401  (imported here: the import phase holds all imports)
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: F401
    from trl import SFTConfig, SFTTrainer

    imported = common.clock()
    step_ends: list[float] = []
    cpu_ends: list[float] = []
    step_tokens: dict[int, int] = {}
    marks: dict[str, float] = {}
    tokenizer, rows, model, phases = common.trl_inputs(spec)
    args = SFTConfig(
        output_dir=spec["out_dir"], max_steps=spec["steps"], per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=spec["grad_accum"], learning_rate=spec["learning_rate"],
        lr_scheduler_type="linear", warmup_steps=0, max_length=spec["max_length"], packing=spec["packing"],
        packing_strategy="bfd", completion_only_loss=True, bf16=spec["bf16"], fp16=False, use_cpu=True,
        gradient_checkpointing=False, seed=spec["seed"], logging_steps=10**9, save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    init_start = common.clock()
    trainer = common.token_counting(SFTTrainer, step_tokens)(model=model, args=args, train_dataset=rows,
                                                             processing_class=tokenizer,
                                                             callbacks=[common.trl_step_timer(marks, step_ends, cpu_ends=cpu_ends)])
    phases["data_s"] += common.clock() - init_start  # the constructor tokenizes and packs
    output = trainer.train()
    save_start = common.clock()
    trainer.save_model(spec["out_dir"])
    done = common.clock()
    tokens = [step_tokens.get(step, 0) for step in range(len(step_ends))]
    return {**common.steady_steps(marks["train_start"], step_ends, spec["warmup_steps"],
                                cpu=(marks["train_start_cpu"], cpu_ends), tokens=tokens), **phases,
            "import_s": imported - started, "save_s": done - save_start, "total_s": done - started,
            "loss": output.training_loss}


# ----------------------------------------------------------------------------------------------
# Parent side: data, models, the runs and the table


def prepare_data(source: Path, out: Path, num_examples: int) -> Path:
    """The first `num_examples` GSM8K training rows as prompt/completion jsonl."""
    path = out / "gsm8k-sft.jsonl"
    with open(source) as src, open(path, "w") as dst:
        for i, line in enumerate(src):
            if i == num_examples:
                break
            row = json.loads(line)
            dst.write(json.dumps({"prompt": f"Question: {row['question']}\nAnswer:",
                                  "completion": f" {row['answer']}"}) + "\n")
    return path


COLUMNS = [("tokens_per_s", "tok/s"), ("s_per_step", "s/step"), ("step_median_s", "median step s"),
           ("cpu_s_per_step", "CPU s/step"), ("peak_rss_mb", "peak RSS MB"),
           ("import_s", "import s"), ("data_s", "data s"), ("load_s", "load s"), ("train_s", "train s"),
           ("save_s", "save s"), ("tokens_per_step", "tok/step"), ("loss", "loss")]
SANITY = ("tokens_per_step", "loss")  # checks that both did the same work, not ratios


def summarise(medians: list[dict]) -> str:
    """Medians per (model, packing, trainer), and alignflow / TRL where both ran."""
    headers = ["model", "packing", "trainer", *(title for _, title in COLUMNS)]
    rows = []
    by_key = {(m["model"], m["packing"], m["trainer"]): m for m in medians}
    for (model, packing, trainer), med in by_key.items():
        layout = "bfd" if packing else "no"
        rows.append([model, layout, f"{trainer} (n={med['n']})", *(med.get(key) for key, _ in COLUMNS)])
        for name in ("alignflow", "alignflow-padded"):
            if trainer == "trl" and (ours := by_key.get((model, packing, name))):
                rows.append([model, layout, f"{name}/TRL",
                             *(None if key in SANITY else common.ratio(ours, med, key) for key, _ in COLUMNS)])
    return common.format_table(headers, rows)


def floor_report(medians: list[dict], counts: dict, peaks: dict, bf16: bool) -> tuple[str, list]:
    """Each median run's step against the matmul peak (see the module docstring for the count)."""
    targets = {(m["model"], m["packing"]): m["targets_per_step"] for m in medians if m.get("targets_per_step")}
    peak = common.matmul_peak_of(peaks, bf16)

    def rows_of(run: dict) -> list[list]:
        head = run.get("targets_per_step") or targets.get((run["model"], run["packing"]))
        work = common.linear_flops(counts[run["model"]], run["tokens_per_step"], head) if head else None
        return [common.floor_row("step", run["s_per_step"], work, "FLOP", peak),
                common.floor_row("median step", run["step_median_s"], work, "FLOP", peak)]

    named = [{**m, "layout": "bfd" if m["packing"] else "no"} for m in medians]
    return common.floor_report(named, [("model", "model"), ("layout", "packing"), ("trainer", "trainer")], rows_of)


def main(argv: list[str] | None = None) -> None:
    parser = common.make_parser(__doc__)
    common.add_run_flags(parser, "gsm8k/train.jsonl", trainers=TRAINERS,
                         steps="Optimizer steps per run (default: 30 for tiny, 4 for smollm2).")
    parser.add_argument("--batch-size", type=int, default=4, help="Rows per micro-batch (packed rows when packing).")
    parser.add_argument("--max-length", type=int, default=256, help="max_length (and the packed row length).")
    parser.add_argument("--grad-accum", type=int, default=1, help="Gradient accumulation steps.")
    parser.add_argument("--learning-rate", type=float, default=2e-5, help="Peak learning rate (linear decay, no warmup).")
    parser.add_argument("--packing", default="no,bfd", help="Comma-separated: no, bfd.")
    parser.add_argument("--num-examples", type=int, default=1000, help="GSM8K training rows used (the first N).")
    parser.add_argument("--bf16", action="store_true",
                        help="Mixed precision in both trainers: `bf16=True` (bfloat16 autocast, float32 weights).")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="Override an SFTConfig field of the alignflow runs (e.g. torch_compile=true).")
    args = parser.parse_args(argv)
    if args.child:
        return common.child_main(json.loads(args.child), {"alignflow": child_alignflow, "alignflow-padded": child_alignflow,
                                                          "trl": child_trl,
                                                          "probe": common.child_probe})

    models = common.parse_list(args.models, list(DEFAULT_STEPS), "model")
    trainers = common.parse_list(args.trainers, TRAINERS, "trainer")
    packings = [p == "bfd" for p in common.parse_list(args.packing, ("no", "bfd"), "packing")]
    common.require_trl(trainers)
    overrides = common.parse_overrides(args.set, "trainer.stages.sft:SFTConfig")
    source = common.data_path(args.data, "gsm8k/train.jsonl")
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-sft-"))
    started = common.clock()
    runs, counts = [], {}
    try:
        probes = [common.probe_peaks(__file__, work, args.threads, args.timeout)]
        data = prepare_data(source, work, args.num_examples)
        for model in models:
            path = common.model_path(model, work, args.smollm2_dir)
            counts[model] = common.matmul_parameters(path)
            steps = args.steps or DEFAULT_STEPS[model]
            plan = []
            for packing in packings:
                for repeat, trainer in common.alternating(trainers, args.repeats):
                    spec = dict(trainer=trainer, model_path=str(path), data_path=str(data), steps=steps,
                                batch_size=args.batch_size, grad_accum=args.grad_accum,
                                learning_rate=args.learning_rate, max_length=args.max_length, packing=packing,
                                threads=args.threads, warmup_steps=args.warmup_steps, seed=args.seed,
                                bf16=args.bf16, overrides=overrides)
                    label = f"{model} packing={'bfd' if packing else 'no'} {trainer} #{repeat + 1}"
                    plan.append((label, {"model": model, "packing": packing, "trainer": trainer, "repeat": repeat,
                                         "steps": steps}, spec))
            runs += common.run_trainers(__file__, plan, work, args.threads, args.timeout, show=lambda r: (
                f"{r['tokens_per_s']:.0f} tok/s, {r['s_per_step']:.3f} s/step, peak {r['peak_rss_mb']:.0f} MB "
                f"({r['rss_after_load_mb']:.0f} MB after load), loss {r['loss']:.4g}"))
        probes.append(common.probe_peaks(__file__, work, args.threads, args.timeout))  # the best of both counts
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = common.median_rows(runs, ["model", "packing", "trainer"])
    settings = (f"batch {args.batch_size} x accumulation {args.grad_accum}, max_length {args.max_length}, "
                f"lr {args.learning_rate} linear, {common.precision(args.bf16)}, {args.threads} threads, "
                f"{args.num_examples} GSM8K rows, steps " + ", ".join(
                    f"{m}={args.steps or DEFAULT_STEPS[m]}" for m in models)
                + f" (first {args.warmup_steps} untimed), medians of {args.repeats}" + "".join(f", {item}" for item in args.set))
    common.print_header("SFT", settings, started, load_before)
    print(summarise(medians))
    peaks = common.best_peaks(*probes)
    floor, floor_records = floor_report(medians, counts, peaks, args.bf16)
    print("\n" + common.peaks_line(peaks, counts) + "\n")
    print(floor)
    if args.json:
        common.write_json(args.json, "sft", args, runs, medians, peaks=peaks, probes=probes, parameters=counts,
                          floor=floor_records)


if __name__ == "__main__":
    main()
