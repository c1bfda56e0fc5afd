"""GRPO step time by phase: alignflow (vLLM rollouts, hf rollouts) against TRL's `GRPOTrainer`.

    flock /tmp/alignflow-bench.lock python benchmarks/grpo.py --models tiny,smollm2

For each model, group size G and completion length, three trainers run the same GRPO step:
alignflow with `rollout_engine=vllm` (in-process vLLM), alignflow with `rollout_engine=hf`
(transformers `generate` on the training model) and TRL's `GRPOTrainer` with `use_vllm=False`
(transformers `generate`; TRL's vLLM path needs a GPU). All three get the same model folder, the
same chat-format GSM8K prompts, `--prompts-per-step` prompts x G completions per step (TRL:
per_device_train_batch_size = generation_batch_size = that many completions, one optimizer step
per generation; alignflow: per_device_batch_size the same, gradient_accumulation_steps=1),
temperature 1, top_p 1, no top_k, beta=0 (no reference model), loss_type=dapo, scale_rewards=
group, num_iterations=1, learning rate 1e-6 constant, the very same reward function
(`trainer.rewards.exact_answer`, which has TRL's signature), float32, 2 torch threads, no
gradient checkpointing (TRL turns it on by default), no evaluation, no report_to/MLflow, no
completion logging. Each run is its own process. `--bf16` gives every trainer bf16 mixed
precision instead (`bf16=True` in both configs: float32 weights and optimizer, bfloat16 autocast
compute; alignflow's vLLM then samples in bfloat16, TRL generates under the same autocast).

Fair lengths: every completion runs to exactly `--new-tokens` tokens in all three trainers, so
each step generates and trains on the same number of tokens. alignflow gets an empty stop list
(its engines then ignore eos; patched in the child, nothing else changes), TRL gets
`generation_kwargs={"min_new_tokens": N}` (transformers masks eos until N tokens, and N is also
max_completion_length). Without this the trainers would sample different lengths (a random
model, or different RNG streams) and step times would compare different amounts of work;
tokens/s columns are given as well, so `--natural-lengths` runs compare too.

Prompts: the first `--prompts-per-step` GSM8K train questions, as one user message asking for
a final "#### <number>" line. The dataset holds exactly one step's prompts, so every step of
every trainer sees the same prompt tokens (in a different order); no prompt is truncated.

What is timed: steps, as the time between the ends of consecutive optimizer steps (after
weight sync and logging), leaving out the first `--warmup-steps`; the median over the rest.
Phases: alignflow's own `timing/*` metrics (generate, score, reference, update, sync); for
TRL, `_generate` (tokenize + generate + decode) -> generate, `_calculate_rewards` -> score,
log-prob passes inside `_generate_and_score_completions` -> reference (none with beta=0 and
num_iterations=1), the rest of the step (loss, backward, clip, optimizer) -> update. "other"
is what the phases leave of the step (batching, advantages, bookkeeping, logging).
Generated tok/s counts completion tokens per step / step time; total tok/s adds the prompts'.
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
GSM8K_TRAIN = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
SMOLLM2 = Path(os.environ.get("ALIGNFLOW_CACHE", Path.home() / ".cache" / "alignflow")) / "smollm2-135m-instruct"
TRAINERS = ("alignflow-vllm", "alignflow-hf", "trl")
PHASES = ("generate", "score", "reference", "update", "sync", "other")
INSTRUCTION = 'Solve the problem step by step. End with the final answer on its own line as "#### <number>".'


def gsm8k_rows(path: Path, count: int, start: int = 0) -> list[dict]:
    """GSM8K rows [start, start + count) as GRPO data: a one-message chat `prompt` and the `answer` column."""
    rows = []
    with open(path) as f:
        for index, line in enumerate(f):
            if index < start:
                continue
            if len(rows) == count:
                break
            item = json.loads(line)
            rows.append({"prompt": [{"role": "user", "content": f"{item['question']}\n{INSTRUCTION}"}],
                         "answer": item["answer"]})
    return rows


# ----------------------------------------------------------------------------------------------
# Child side: one training run


def _clock() -> float:
    return time.perf_counter()


def _summary(spec: dict, step_ends: list[float], train_start: float, phases: list[dict[str, float]],
             gen_tokens: list[float], all_tokens: list[float]) -> dict:
    """Median step time and phases over the steps after the warm-up ones."""
    starts = [train_start, *step_ends[:-1]]
    steps = [end - start for start, end in zip(starts, step_ends)]
    keep = range(min(spec["warmup_steps"], len(steps) - 1), len(steps))
    for i in keep:
        phases[i]["other"] = steps[i] - sum(phases[i].get(p, 0.0) for p in PHASES if p != "other")
    s_step = median([steps[i] for i in keep])
    out = {"s_per_step": s_step, "step_times": steps, "steps": len(steps),
           "gen_tokens_per_step": median([gen_tokens[i] for i in keep]),
           "tokens_per_step": median([all_tokens[i] for i in keep])}
    out.update({f"{p}_s": median([phases[i].get(p, 0.0) for i in keep]) for p in PHASES})
    out["gen_tok_per_s"] = out["gen_tokens_per_step"] / s_step
    out["tok_per_s"] = out["tokens_per_step"] / s_step
    return out


def child_alignflow(spec: dict, started: float) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    from trainer import checkpoint, grpo

    imported = _clock()
    marks: dict[str, float] = {}
    step_ends: list[float] = []

    # Instrument the stage through the names it calls; nothing else changes.
    sampling_config, progress_cls = grpo.SamplingConfig, grpo.Progress

    def sampling(*args, **kwargs):
        if spec["full_length"]:
            kwargs["stop_token_ids"] = []  # run every completion to max_completion_length
        return sampling_config(*args, **kwargs)

    class TimedProgress(progress_cls):
        def __init__(self, *args, **kwargs):  # right before the first step
            super().__init__(*args, **kwargs)
            marks["train_start"] = _clock()

        def update(self, *args, **kwargs):  # once per optimizer step, after sync and logging
            super().update(*args, **kwargs)
            step_ends.append(_clock())

    grpo.SamplingConfig, grpo.Progress = sampling, TimedProgress
    group = spec["generations"]
    config = grpo.GRPOConfig(
        model=spec["model_path"], dataset=spec["data_path"], output_dir=spec["out_dir"], dtype="float32",
        bf16=spec["bf16"], max_steps=spec["steps"], per_device_batch_size=spec["prompts_per_step"] * group,
        gradient_accumulation_steps=1, learning_rate=spec["learning_rate"], lr_scheduler="constant",
        num_generations=group, max_prompt_length=spec["max_prompt_length"],
        max_completion_length=spec["new_tokens"], temperature=1.0, beta=0.0, loss_type="dapo",
        scale_rewards="group", reward_funcs=["exact_answer"], rollout_engine=spec["trainer"].split("-", 1)[1],
        seed=spec["seed"], logging_steps=1, log_completions_steps=0, save_steps=0, disable_progress_bar=True)
    grpo.run_grpo(config)
    done = _clock()
    history = [r for r in (json.loads(line) for line in
                           Path(spec["out_dir"], checkpoint.METRICS_FILE).read_text().splitlines())
               if "step_time" in r]
    phases = [{p: r.get(f"timing/{p}", 0.0) for p in PHASES if p != "other"} for r in history]
    completions = spec["prompts_per_step"] * group
    gen_tokens = [r["completions/mean_length"] * completions for r in history]
    totals = [r["num_tokens"] for r in history]
    all_tokens = [b - a for a, b in zip([0.0, *totals[:-1]], totals)]
    return {**_summary(spec, step_ends, marks["train_start"], phases, gen_tokens, all_tokens),
            "import_s": imported - started, "setup_s": marks["train_start"] - imported,
            "total_s": done - started, "reward": history[-1].get("reward")}


def child_trl(spec: dict, started: float) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.rewards import exact_answer

    imported = _clock()
    marks: dict[str, float] = {}
    step_ends: list[float] = []
    phases: list[dict[str, float]] = [{}]
    gen_tokens: list[float] = [0.0]
    all_tokens: list[float] = [0.0]

    def add(phase: str, seconds: float) -> None:
        phases[-1][phase] = phases[-1].get(phase, 0.0) + seconds

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks["train_start"] = _clock()

        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(_clock())
            phases[-1]["update"] = step_ends[-1] - marks.pop("prepared")  # loss, backward, clip, optimizer
            phases.append({})
            gen_tokens.append(0.0)
            all_tokens.append(0.0)

    class TimedGRPOTrainer(GRPOTrainer):
        """TRL's own step, with its phases timed and its tokens counted."""

        def _generate_and_score_completions(self, inputs):
            marks["in_prepare"] = 1.0
            start = _clock()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                marks.pop("in_prepare")
                marks["prepared"] = _clock()
                add("prepare", marks["prepared"] - start)

        def _generate(self, prompts):
            start = _clock()
            try:
                return super()._generate(prompts)
            finally:
                add("generate", _clock() - start)

        def _calculate_rewards(self, *args, **kwargs):
            start = _clock()
            try:
                return super()._calculate_rewards(*args, **kwargs)
            finally:
                add("score", _clock() - start)

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if "in_prepare" not in marks:  # the loss's own forward pass
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            start = _clock()
            try:
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            finally:
                add("reference", _clock() - start)

        def compute_loss(self, model, inputs, *args, **kwargs):
            gen_tokens[-1] += float(inputs["completion_mask"].sum())
            all_tokens[-1] += float(inputs["completion_mask"].sum() + inputs["prompt_mask"].sum())
            return super().compute_loss(model, inputs, *args, **kwargs)

    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    rows = datasets.load_dataset("json", data_files=spec["data_path"], split="train")
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    completions = spec["prompts_per_step"] * spec["generations"]
    args = GRPOConfig(
        output_dir=spec["out_dir"], max_steps=spec["steps"], per_device_train_batch_size=completions,
        generation_batch_size=completions, gradient_accumulation_steps=1, num_generations=spec["generations"],
        max_completion_length=spec["new_tokens"], temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        loss_type="dapo", scale_rewards="group", num_iterations=1, learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant", warmup_steps=0, use_vllm=False,
        generation_kwargs={"min_new_tokens": spec["new_tokens"]} if spec["full_length"] else None,
        bf16=spec["bf16"], fp16=False, use_cpu=True, gradient_checkpointing=False, seed=spec["seed"],
        logging_steps=10**9, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=[exact_answer], args=args, train_dataset=rows,
                               processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    done = _clock()
    for p in phases:  # TRL's bookkeeping inside _generate_and_score_completions counts as "other"
        p.pop("prepare", None)
    return {**_summary(spec, step_ends, marks["train_start"], phases[:len(step_ends)], gen_tokens, all_tokens),
            "import_s": imported - started, "setup_s": marks["train_start"] - imported,
            "total_s": done - started, "reward": None}


def child_main(spec: dict) -> None:
    started = _clock()
    result = (child_trl if spec["trainer"] == "trl" else child_alignflow)(spec, started)
    result["peak_rss_self_mb"] = self_peak_rss_mb()
    write_result(result)


# ----------------------------------------------------------------------------------------------
# Parent side: data, models, the runs and the tables


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


def prepare_data(work: Path, model_dir: Path, prompts: int) -> tuple[Path, dict]:
    """One step's worth of GSM8K prompts as jsonl, and their length in this model's tokens."""
    from transformers import AutoTokenizer

    if not GSM8K_TRAIN.exists():
        sys.exit(f"GSM8K is missing at {GSM8K_TRAIN}.")
    rows = gsm8k_rows(GSM8K_TRAIN, prompts)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lengths = [len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]) for r in rows]
    path = work / f"gsm8k-grpo-{model_dir.name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, {"prompts": len(rows), "prompt_tokens": lengths}


def run_one(spec: dict, work: Path, threads: int, timeout: float) -> dict | None:
    """One training run in its own process, with its own output folder and datasets cache."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    spec = {**spec, "out_dir": str(run_dir / "out")}
    env = bench_env(threads, HF_DATASETS_CACHE=str(run_dir / "datasets-cache"), PYTHONPATH=str(REPO))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; unset, vLLM-CPU reserves a large share of RAM
    env.pop("MLFLOW_TRACKING_URI", None)
    child = run_child([sys.executable, __file__, "--child", json.dumps(spec)], env=env, timeout=timeout)
    shutil.rmtree(run_dir, ignore_errors=True)
    if not child.ok:
        print(f"  FAILED (exit {child.returncode}):\n{child.output[-3000:]}", file=sys.stderr)
        return None
    return {**child.result, "peak_rss_mb": child.peak_rss_mb, "wall_s": child.wall_s}


def summarise(results: dict[tuple, dict], cases: list[tuple], trainers: list[str]) -> tuple[str, str]:
    """The per-run table (phases, throughput) and the ratio table against TRL."""
    headers = ["model", "G", "new tok", "trainer", "s/step", *(f"{p} s" for p in PHASES),
               "gen tok/s", "total tok/s", "gen tok/step", "peak RSS MB"]
    rows, ratio_rows = [], []
    for case in cases:
        for trainer in trainers:
            r = results.get((*case, trainer))
            if r is None:
                rows.append([*case, trainer, *([None] * (len(headers) - 4))])
                continue
            rows.append([*case, trainer, r["s_per_step"], *(r[f"{p}_s"] for p in PHASES), r["gen_tok_per_s"],
                         r["tok_per_s"], r["gen_tokens_per_step"], r["peak_rss_mb"]])
        trl, vllm, hf = (results.get((*case, t)) for t in ("trl", "alignflow-vllm", "alignflow-hf"))

        def ratio(ours: dict | None, key: str, trl: dict | None = trl) -> float | None:
            return ours[key] / trl[key] if ours and trl and trl[key] else None

        top = max(PHASES, key=lambda p: vllm[f"{p}_s"]) if vllm else None
        step_ratio = ratio(vllm, "s_per_step")
        ratio_rows.append([*case, step_ratio, ratio(hf, "s_per_step"), ratio(vllm, "generate_s"),
                           ratio(vllm, "update_s"), f"{top} {vllm[f'{top}_s'] / vllm['s_per_step']:.0%}" if top else None,
                           None if step_ratio is None else "yes" if step_ratio <= 1 / 3 else "no"])
    ratio_table = format_table(["model", "G", "new tok", "vllm/TRL step", "hf/TRL step", "vllm/TRL generate",
                                "vllm/TRL update", "vllm's largest phase", "<= 1/3?"], ratio_rows)
    return format_table(headers, rows), ratio_table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2", help="Comma-separated: tiny, smollm2.")
    parser.add_argument("--generations", default="4,8", help="Comma-separated group sizes G.")
    parser.add_argument("--new-tokens", default="32,128", help="Comma-separated completion lengths.")
    parser.add_argument("--trainers", default=",".join(TRAINERS), help=f"Comma-separated: {', '.join(TRAINERS)}.")
    parser.add_argument("--steps", type=int, default=7, help="Optimizer steps per run (one generation each).")
    parser.add_argument("--warmup-steps", type=int, default=2,
                        help="Leading steps left out of the medians (vLLM runs settle over ~2 steps).")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="Prompts per step (x G completions).")
    parser.add_argument("--natural-lengths", action="store_true",
                        help="Let completions stop at eos instead of forcing --new-tokens tokens.")
    parser.add_argument("--learning-rate", type=float, default=1e-6)
    parser.add_argument("--max-prompt-length", type=int, default=512, help="alignflow's left truncation (none here).")
    parser.add_argument("--bf16", action="store_true",
                        help="Mixed precision in every trainer: alignflow and TRL `bf16=True` (autocast, fp32 weights); "
                             "alignflow's vLLM then generates in bfloat16.")
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
    groups = [int(g) for g in args.generations.split(",")]
    lengths = [int(n) for n in args.new_tokens.split(",")]
    trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
    if unknown := set(trainers) - set(TRAINERS):
        sys.exit(f"Unknown trainers {sorted(unknown)}; use {', '.join(TRAINERS)}.")
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-grpo-"))
    results: dict[tuple, dict] = {}
    raw, data_info, cases = [], {}, []
    started = time.perf_counter()
    try:
        for model in models:
            path = model_path(model, work, args.smollm2_dir)
            data, data_info[model] = prepare_data(work, path, args.prompts_per_step)
            if max(data_info[model]["prompt_tokens"]) > args.max_prompt_length:
                sys.exit(f"A prompt has {max(data_info[model]['prompt_tokens'])} tokens > --max-prompt-length.")
            for group in groups:
                for new_tokens in lengths:
                    case = (model, group, new_tokens)
                    cases.append(case)
                    for trainer in trainers:
                        spec = dict(trainer=trainer, model_path=str(path), data_path=str(data), steps=args.steps,
                                    warmup_steps=args.warmup_steps, prompts_per_step=args.prompts_per_step,
                                    generations=group, new_tokens=new_tokens, full_length=not args.natural_lengths,
                                    learning_rate=args.learning_rate, max_prompt_length=args.max_prompt_length,
                                    threads=args.threads, seed=args.seed, bf16=args.bf16)
                        print(f"[{time.perf_counter() - started:6.0f}s] {model} G={group} {new_tokens} tok "
                              f"{trainer} ...", file=sys.stderr, flush=True)
                        result = run_one(spec, work, args.threads, args.timeout)
                        if result is None:
                            continue
                        print(f"  {result['s_per_step']:.2f} s/step (steps {[round(s, 2) for s in result['step_times']]}), "
                              + ", ".join(f"{p} {result[f'{p}_s']:.2f}" for p in PHASES)
                              + f"; {result['gen_tok_per_s']:.0f} gen tok/s, {result['wall_s']:.0f} s wall",
                              file=sys.stderr, flush=True)
                        results[(*case, trainer)] = result
                        raw.append({"model": model, "generations": group, "new_tokens": new_tokens,
                                    "trainer": trainer, **result})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    precision = "bf16 mixed precision (fp32 weights)" if args.bf16 else "float32"
    lengths_note = "natural lengths (eos stops)" if args.natural_lengths else "every completion forced to full length"
    settings = (f"{args.prompts_per_step} prompts x G completions per step, {lengths_note}, temperature 1, beta 0, "
                f"dapo, {precision}, {args.threads} threads, {args.steps} steps (first {args.warmup_steps} untimed, "
                "median of the rest); prompt tokens " + ", ".join(
                    f"{m}: {d['prompt_tokens']}" for m, d in data_info.items()))
    table, ratios = summarise(results, cases, trainers)
    print(f"\nGRPO, {settings}; total {time.perf_counter() - started:.0f}s\n")
    print(table)
    print()
    print(ratios)
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"smollm2_dir": str(args.smollm2_dir),
                                                                    "json": str(args.json)},
                                         "data": data_info, "runs": raw}, indent=1, default=str))


if __name__ == "__main__":
    main()
