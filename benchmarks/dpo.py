"""DPO speed and memory: alignflow's `run_dpo` against TRL's `DPOTrainer`, side by side.

    flock /tmp/alignflow-bench.lock python benchmarks/dpo.py --models tiny,smollm2 --json dpo.json

For each model, both trainers train on the same Anthropic HH harmless-base pairs with the same
batch size, max_length, learning rate and linear schedule, beta=0.1, loss_type=sigmoid, a frozen
copy of the starting model as reference (loaded from the same folder), reference log-probs
computed on the fly (no precomputation), float32 (or, with `--bf16`, bf16 mixed precision in
both: `bf16=True`, float32 weights and AdamW state, bfloat16 autocast), 2 torch threads, no
gradient checkpointing (TRL turns it on by default; alignflow does not), dropout off (both
defaults), no evaluation, no MLflow/report_to, and logging only at the end. alignflow runs with its defaults, which pack each
batch's 2B sequences into rows of `max_length` (`padding_free`, exact: position ids restart per
sequence); `--trainers alignflow,trl,alignflow-padded` adds a row with padding_free=False, the
layout TRL 1.16 uses (2B rows padded to the longest; its padding-free mode is switched off).
Every run is its own process, so each peak RSS belongs to one trainer; runs alternate between
the trainers and the table shows medians over `--repeats`.

Data (`--data`, default ../shared/data/hh-rlhf/harmless-base-test.jsonl.gz): HH pairs carry the prompt implicitly (both texts repeat the conversation). The parent
splits each pair once with alignflow's `preference_texts` and hands both trainers the same
explicit prompt/chosen/rejected strings, keeping the first `--num-pairs` pairs whose prompt fits
in half of `max_length` and whose prompt + reply fits in `max_length` (counted with the model's
tokenizer), so neither trainer truncates and both see the same tokens.

What is timed: the training steps only, as the time between the ends of consecutive optimizer
steps (batching, policy and reference forwards, backward, clipping, optimizer), leaving out the
first `--warmup-steps` ("s/step" is their mean, "median step s" the median single step,
"CPU s/step" the process's CPU seconds per step, all threads: on a shared machine it counts the
work done rather than the time other processes held the cores).
Imports, data preparation (reading and tokenizing), model loading (policy and reference) and
saving are separate phases; "wall s" is the whole process, everything included. Pairs/s
counts the pairs trained on in the timed steps; tokens/step (real, non-pad tokens of all 2B
sequences) is a sanity check that both did the same work.

Floor table (issue 28): two probe children (the training runs' threads and environment, one
before and one after the runs; the faster counts, as in grpo.py) time torch.matmul of 2048 x 2048
bf16 and fp32 matrices and a 512 MiB copy. Each median run's step is set against the matmul peak
(bf16 with `--bf16`, fp32 otherwise). Useful FLOPs per step = policy forward + backward
6 x (N_body x tokens + N_head x targets) + the reference's forward 2 x (N_body x tokens + N_head x
targets) (every step here: no precomputed reference log-probs), with N_body = the nn.Linear weights
of the transformer blocks and N_head = the LM head's (from the model's config;
`common.matmul_parameters`), tokens = the real tokens of all 2B sequences, targets = their
completion tokens (alignflow runs the head only there; TRL at every position, work this count
leaves out; TRL rows take the targets of alignflow's run). Left out: attention's own FLOPs (QK^T
and AV), padding (alignflow-padded and TRL compute it; it is not useful work), norms, activations,
the softmax/loss and the optimizer. "step" divides by the mean s/step, "median step" by the median
single step. The JSON adds `peaks`, `probes`, `parameters` and `floor`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import common

TRAINERS = ("alignflow", "trl", "alignflow-padded")  # -padded: alignflow with padding_free=False, TRL's layout
HH = "hh-rlhf/harmless-base-test.jsonl.gz"


# ----------------------------------------------------------------------------------------------
# Child side: one training run, timed phase by phase


def child_alignflow(spec: dict, started: float) -> dict:
    # What run_dpo imports lazily, imported here so that the import phase holds all imports (as for TRL).
    import datasets  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler  # noqa: F401

    from trainer.engine import checkpoint
    from trainer.stages import dpo

    imported = common.clock()
    probe = common.StageProbe(dpo, "load_causal_lm", lambda arguments, batch: {
        "pairs": batch.num_pairs, "tokens": batch.num_tokens, "targets": int(batch.completion_mask.sum())})
    config = dpo.DPOConfig(
        model=spec["model_path"], dataset=spec["data_path"], output_dir=spec["out_dir"], dtype="float32",
        bf16=spec["bf16"], max_steps=spec["steps"], per_device_batch_size=spec["batch_size"],
        learning_rate=spec["learning_rate"],
        lr_scheduler="linear", warmup_ratio=0.0, max_length=spec["max_length"], beta=spec["beta"],
        loss_type="sigmoid", precompute_ref_log_probs=False, padding_free=spec["trainer"] != "alignflow-padded",
        seed=spec["seed"], disable_progress_bar=True,
        logging_steps=10**9, save_steps=0)
    dpo.run_dpo(config)
    done = common.clock()
    last = next((r for r in reversed(checkpoint.read_history(spec["out_dir"])) if "loss" in r), {})
    return {**probe.result(imported, spec["warmup_steps"]),  # data: tokenizer, rows, implicit prompts, tokenizing
            "import_s": imported - started, "total_s": done - started,
            "loss": last.get("loss"), "accuracy": last.get("rewards/accuracies")}


def child_trl(spec: dict, started: float) -> dict:
    import datasets  # noqa: F401  (imported here: the import phase holds all imports)
    import trl.trainer.dpo_trainer as trl_dpo
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: F401
    from trl import DPOConfig, DPOTrainer

    imported = common.clock()
    step_ends: list[float] = []
    cpu_ends: list[float] = []
    step_tokens: dict[int, int] = {}
    marks: dict[str, float] = {"ref_load_s": 0.0}
    last_metrics: dict[str, float] = {}

    # TRL loads the reference itself (a copy of the policy's checkpoint): time that as loading, not data.
    create_model = trl_dpo.create_model_from_path

    def timed_create(*args, **kwargs):
        start = common.clock()
        model = create_model(*args, **kwargs)
        marks["ref_load_s"] += common.clock() - start
        marks["rss_after_load"] = common.self_peak_rss_mb()
        return model

    trl_dpo.create_model_from_path = timed_create
    tokenizer, rows, model, phases = common.trl_inputs(spec)
    args = DPOConfig(
        output_dir=spec["out_dir"], max_steps=spec["steps"], per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=1, learning_rate=spec["learning_rate"], lr_scheduler_type="linear",
        warmup_steps=0, max_length=spec["max_length"], truncation_mode="keep_start", beta=spec["beta"],
        loss_type=["sigmoid"], precompute_ref_log_probs=False, bf16=spec["bf16"], fp16=False, use_cpu=True,
        gradient_checkpointing=False, seed=spec["seed"], logging_steps=10**9, save_strategy="no",
        eval_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    init_start = common.clock()
    trainer = common.token_counting(DPOTrainer, step_tokens)(model=model, args=args, train_dataset=rows,
                                                             processing_class=tokenizer,
                                                             callbacks=[common.trl_step_timer(marks, step_ends, last_metrics, cpu_ends=cpu_ends)])
    phases["load_s"] += marks["ref_load_s"]
    phases["data_s"] += common.clock() - init_start - marks["ref_load_s"]  # the constructor tokenizes
    phases["rss_after_load_mb"] = marks.get("rss_after_load")
    trainer.train()
    save_start = common.clock()
    trainer.save_model(spec["out_dir"])
    done = common.clock()
    tokens = [step_tokens.get(step, 0) for step in range(len(step_ends))]
    pairs = [spec["batch_size"]] * len(step_ends)
    return {**common.steady_steps(marks["train_start"], step_ends, spec["warmup_steps"],
                                cpu=(marks["train_start_cpu"], cpu_ends), pairs=pairs, tokens=tokens),
            **phases, "import_s": imported - started, "save_s": done - save_start, "total_s": done - started,
            "loss": last_metrics.get("train_loss"), "accuracy": last_metrics.get("rewards/accuracies")}


# ----------------------------------------------------------------------------------------------
# Parent side: data, models, the runs and the table


def prepare_data(source: Path, out: Path, model_dir: Path, num_pairs: int, max_length: int) -> tuple[Path, dict]:
    """The first `num_pairs` HH pairs that fit `max_length` untruncated, as explicit prompt/chosen/rejected."""
    from transformers import AutoTokenizer

    from trainer.data.preferences import preference_texts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    path = out / f"hh-{model_dir.name}.jsonl"
    kept, seen, tokens = 0, 0, 0
    with common.open_text(source) as src, open(path, "w") as dst:
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


COLUMNS = [("pairs_per_s", "pairs/s"), ("tokens_per_s", "tok/s"), ("s_per_step", "s/step"),
           ("step_median_s", "median step s"), ("cpu_s_per_step", "CPU s/step"),
           ("peak_rss_mb", "peak RSS MB"), ("import_s", "import s"), ("data_s", "data s"), ("load_s", "load s"),
           ("train_s", "train s"), ("save_s", "save s"), ("wall_s", "wall s"), ("tokens_per_step", "tok/step"),
           ("loss", "loss")]
SANITY = ("tokens_per_step", "loss")  # checks that both did the same work, not ratios


def summarise(medians: list[dict]) -> str:
    """Medians per (model, trainer), then each alignflow row / TRL where TRL ran."""
    headers = ["model", "trainer", *(title for _, title in COLUMNS)]
    rows = []
    by_key = {(m["model"], m["trainer"]): m for m in medians}
    models = list(dict.fromkeys(m["model"] for m in medians))
    for model in models:
        mine = [m for m in medians if m["model"] == model]
        rows += [[model, f"{m['trainer']} (n={m['n']})", *(m.get(key) for key, _ in COLUMNS)] for m in mine]
        if trl := by_key.get((model, "trl")):
            rows += [[model, f"{m['trainer']}/TRL", *(None if key in SANITY else common.ratio(m, trl, key)
                                                      for key, _ in COLUMNS)]
                     for m in mine if m["trainer"] != "trl"]
    return common.format_table(headers, rows)


def floor_report(medians: list[dict], counts: dict, peaks: dict, bf16: bool) -> tuple[str, list]:
    """Each median run's step (policy forward + backward and the reference's forward) against the
    matmul peak; see the module docstring for the count."""
    targets = {m["model"]: m["targets_per_step"] for m in medians if m.get("targets_per_step")}
    peak = common.matmul_peak_of(peaks, bf16)

    def rows_of(run: dict) -> list[list]:
        head = run.get("targets_per_step") or targets.get(run["model"])
        work = None
        if head:
            n, tokens = counts[run["model"]], run["tokens_per_step"]
            work = common.linear_flops(n, tokens, head) + common.linear_flops(n, tokens, head, per_param=2.0)
        return [common.floor_row("step", run["s_per_step"], work, "FLOP", peak),
                common.floor_row("median step", run["step_median_s"], work, "FLOP", peak)]

    return common.floor_report(medians, [("model", "model"), ("trainer", "trainer")], rows_of)


def default_steps(model: str) -> int:
    return 20 if model == "tiny" else 4


def main(argv: list[str] | None = None) -> None:
    parser = common.make_parser(__doc__)
    common.add_run_flags(parser, HH, trainers=TRAINERS, default_trainers="alignflow,trl",
                         steps="Optimizer steps per run (default: 20 for tiny, 4 for smollm2).")
    parser.add_argument("--batch-size", type=int, default=4, help="Pairs per step (2x rows per forward).")
    parser.add_argument("--max-length", type=int, default=256, help="max_length (prompt + reply).")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta.")
    parser.add_argument("--learning-rate", type=float, default=5e-6, help="Peak learning rate (linear decay, no warmup).")
    parser.add_argument("--num-pairs", type=int, default=256, help="HH pairs used (the first N that fit).")
    parser.add_argument("--bf16", action="store_true",
                        help="Mixed precision in both trainers: `bf16=True` (bfloat16 autocast, float32 weights).")
    args = parser.parse_args(argv)
    if args.child:
        return common.child_main(json.loads(args.child), {"trl": child_trl, "probe": common.child_probe,
                                                          "": child_alignflow})

    models = common.parse_list(args.models, ("tiny", "smollm2"), "model")
    trainers = common.parse_list(args.trainers, TRAINERS, "trainer")
    common.require_trl(trainers)
    source = common.data_path(args.data, HH)
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-dpo-"))
    runs, data_info, counts = [], {}, {}
    started = common.clock()
    try:
        probes = [common.probe_peaks(__file__, work, args.threads, args.timeout)]
        for model in models:
            path = common.model_path(model, work, args.smollm2_dir)
            counts[model] = common.matmul_parameters(path)
            data, data_info[model] = prepare_data(source, work, path, args.num_pairs, args.max_length)
            steps = args.steps or default_steps(model)
            plan = [(f"{model} {trainer} #{repeat + 1}",
                     {"model": model, "trainer": trainer, "repeat": repeat, "steps": steps},
                     dict(trainer=trainer, model_path=str(path), data_path=str(data), steps=steps,
                          batch_size=args.batch_size, learning_rate=args.learning_rate, beta=args.beta,
                          max_length=args.max_length, threads=args.threads, warmup_steps=args.warmup_steps,
                          seed=args.seed, bf16=args.bf16))
                    for repeat, trainer in common.alternating(trainers, args.repeats)]
            runs += common.run_trainers(__file__, plan, work, args.threads, args.timeout, show=lambda r: (
                f"{r['pairs_per_s']:.2f} pairs/s, {r['s_per_step']:.3f} s/step, {r['peak_rss_mb']:.0f} MB, "
                f"{r['tokens_per_step']:.0f} tok/step, loss {r['loss']}"))
        probes.append(common.probe_peaks(__file__, work, args.threads, args.timeout))  # the best of both counts
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = common.median_rows(runs, ["model", "trainer"])
    settings = (f"batch {args.batch_size} pairs, max_length {args.max_length}, beta {args.beta}, sigmoid, "
                f"lr {args.learning_rate} linear, {common.precision(args.bf16)}, {args.threads} threads, frozen-copy reference, "
                "HH harmless-base pairs " + ", ".join(
                    f"{m}: {d['pairs']} pairs ~{d['tokens_per_pair']:.0f} tok/pair" for m, d in data_info.items())
                + ", steps " + ", ".join(f"{m}={args.steps or default_steps(m)}" for m in models)
                + f" (first {args.warmup_steps} untimed), medians of {args.repeats}")
    common.print_header("DPO", settings, started, load_before)
    print(summarise(medians))
    peaks = common.best_peaks(*probes)
    floor, floor_records = floor_report(medians, counts, peaks, args.bf16)
    print("\n" + common.peaks_line(peaks, counts) + "\n")
    print(floor)
    if args.json:
        common.write_json(args.json, "dpo", args, runs, medians, data=data_info, peaks=peaks, probes=probes,
                          parameters=counts, floor=floor_records)


if __name__ == "__main__":
    main()
