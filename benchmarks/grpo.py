"""GRPO step time by phase: alignflow (vLLM rollouts, hf rollouts) against TRL's `GRPOTrainer`.

    flock /tmp/alignflow-bench.lock python benchmarks/grpo.py --models tiny,smollm2 --json grpo.json

For each model, group size G and completion length, three trainers run the same GRPO step:
alignflow with `rollout_engine=vllm` (in-process vLLM), alignflow with `rollout_engine=hf`
(transformers `generate` on the training model) and TRL's `GRPOTrainer` with `use_vllm=False`
(transformers `generate`; TRL's vLLM path needs a GPU). All three get the same model folder, the
same chat-format GSM8K prompts, `--prompts-per-step` prompts x G completions per step (TRL:
per_device_train_batch_size = generation_batch_size = that many completions, one optimizer step
per generation; alignflow: per_device_batch_size the same, gradient_accumulation_steps=1),
temperature 1, top_p 1, no top_k, beta=0 (no reference model), loss_type=dapo, scale_rewards=
group, num_iterations=1, learning rate 1e-6 constant, the very same reward function
(`trainer.rewards.rules.exact_answer`, which has TRL's signature), float32, 2 torch threads, no
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

Prompts: the first `--prompts-per-step` GSM8K train questions (`--data`, default
../shared/data/gsm8k/train.jsonl), as one user message asking for
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

Floor table: two probe children (same threads and environment as the runs; one before, one
after; the faster counts) time torch.matmul of 2048 x 2048 bf16 and fp32 matrices and a 512 MiB
tensor copy (bytes read + written). Each phase of each median run is set against them, with the
work counted from N = the model's nn.Linear parameters (LM head included) and tokens = each
prompt once per group + the generated tokens: update 6 N tokens FLOPs; reference 2 N tokens per
forward-only pass (beta > 0; num_iterations > 1); generate 2 N tokens FLOPs and, as decode,
N x weight bytes x new-token steps (bf16 vLLM: 2 bytes, else 4; KV-cache reads left out), also
against what the probes' GEMMs reach on one token step of the model (every nn.Linear weight, its
own tensor, times a [G x prompts, in] activation; bf16 and fp32), the ceiling of these kernels; sync
N x (4 + weight bytes); the step all FLOPs. The JSON adds `peaks`, `probes`, `parameters`, `floor`.
`--set FIELD=VALUE` overrides GRPOConfig fields of the alignflow runs and `--child-env NAME=VALUE`
(NAME= unsets) the training children's environment, for A/B runs of settings.

`alignflow-cli` is what a user types: `python -m trainer.cli train grpo` (the `alignflow train grpo`
command) in its own process, given only the model, data, output folder, `--bf16`, the rollout engine
(vllm), G, the completion length, the batch, beta 0, the learning rate, the reward and the seed; every
other field at its CLI default (loss, scaling, schedule, logging, completion logging, progress bar),
the thread and vLLM KV-cache variables unset, no patching (use `--natural-lengths` with it: the CLI
stops at eos). Its steps are its own `step_time` (generate to sync) from `metrics.jsonl`.

    python benchmarks/grpo.py --models smollm2 --bf16 --generations 8 --new-tokens 64 --natural-lengths \
        --trainers alignflow-cli,trl --json benchmarks/results/grpo_cli.json
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import common

TRAINERS = ("alignflow-vllm", "alignflow-hf", "alignflow-cli", "trl")
PHASES = ("generate", "score", "reference", "update", "sync", "other")


# ----------------------------------------------------------------------------------------------
# Child side: one training run


def _summary(spec: dict, step_ends: list[float], train_start: float, phases: list[dict[str, float]],
             gen_tokens: list[float], all_tokens: list[float]) -> dict:
    """Median step time and phases over the steps after the warm-up ones."""
    starts = [train_start, *step_ends[:-1]]
    steps = [end - start for start, end in zip(starts, step_ends)]
    keep = range(min(spec["warmup_steps"], len(steps) - 1), len(steps))
    for i in keep:
        phases[i]["other"] = steps[i] - sum(phases[i].get(p, 0.0) for p in PHASES if p != "other")
    s_step = common.median([steps[i] for i in keep])
    out = {"s_per_step": s_step, "step_times": steps, "steps": len(steps),
           "gen_tokens_per_step": common.median([gen_tokens[i] for i in keep]),
           "tokens_per_step": common.median([all_tokens[i] for i in keep])}
    out.update({f"{p}_s": common.median([phases[i].get(p, 0.0) for i in keep]) for p in PHASES})
    out["gen_tok_per_s"] = out["gen_tokens_per_step"] / s_step
    out["tok_per_s"] = out["tokens_per_step"] / s_step
    return out


def child_alignflow(spec: dict, started: float) -> dict:
    from trainer.engine import checkpoint, runner
    from trainer.stages.rl import grpo, shared

    imported = common.clock()
    marks: dict[str, float] = {}
    step_ends: list[float] = []

    # Instrument the stage through the names it calls; nothing else changes.
    sampling_config, progress_cls = shared.SamplingConfig, runner.Progress

    def sampling(*args, **kwargs):
        if spec["full_length"]:
            kwargs["stop_token_ids"] = []  # run every completion to max_completion_length
        return sampling_config(*args, **kwargs)

    class TimedProgress(progress_cls):
        def __init__(self, *args, **kwargs):  # right before the first step
            super().__init__(*args, **kwargs)
            marks["train_start"] = common.clock()

        def update(self, *args, **kwargs):  # once per optimizer step, after sync and logging
            super().update(*args, **kwargs)
            step_ends.append(common.clock())

    shared.SamplingConfig, runner.Progress = sampling, TimedProgress
    group = spec["generations"]
    config = grpo.GRPOConfig(
        model=spec["model_path"], dataset=spec["data_path"], output_dir=spec["out_dir"], dtype="float32",
        bf16=spec["bf16"], max_steps=spec["steps"], per_device_batch_size=spec["prompts_per_step"] * group,
        gradient_accumulation_steps=1, learning_rate=spec["learning_rate"], lr_scheduler="constant",
        num_generations=group, max_prompt_length=spec["max_prompt_length"],
        max_completion_length=spec["new_tokens"], temperature=1.0, beta=0.0, loss_type="dapo",
        scale_rewards="group", reward_funcs=["exact_answer"], rollout_engine=spec["trainer"].split("-", 1)[1],
        seed=spec["seed"], logging_steps=1, log_completions_steps=0, save_steps=0, disable_progress_bar=True)
    config = dataclasses.replace(config, **spec.get("overrides", {}))
    grpo.run_grpo(config)
    done = common.clock()
    history = [r for r in checkpoint.read_history(spec["out_dir"]) if "step_time" in r]
    phases = [{p: r.get(f"timing/{p}", 0.0) for p in PHASES if p != "other"} for r in history]
    completions = spec["prompts_per_step"] * group
    gen_tokens = [r["completions/mean_length"] * completions for r in history]
    totals = [r["num_tokens"] for r in history]
    all_tokens = [b - a for a, b in zip([0.0, *totals[:-1]], totals)]
    loop = [r["step_time"] for r in history[min(spec["warmup_steps"], len(history) - 1):]]
    return {**_summary(spec, step_ends, marks["train_start"], phases, gen_tokens, all_tokens),
            "loop_s": common.median(loop),  # the stage's own step_time (generate to sync), as the CLI logs it
            "import_s": imported - started, "setup_s": marks["train_start"] - imported,
            "total_s": done - started, "reward": history[-1].get("reward")}


def child_cli(spec: dict, started: float) -> dict:
    """`alignflow train grpo` as a user runs it, timed from its own metrics.jsonl."""
    import subprocess

    from trainer.engine import checkpoint

    group = spec["generations"]
    flags = dict(model=spec["model_path"], dataset=spec["data_path"], output_dir=spec["out_dir"],
                 bf16="true" if spec["bf16"] else "false", rollout_engine="vllm", num_generations=group,
                 max_completion_length=spec["new_tokens"], per_device_batch_size=spec["prompts_per_step"] * group,
                 beta=0, learning_rate=spec["learning_rate"], reward_funcs="exact_answer", seed=spec["seed"],
                 max_steps=spec["steps"])
    flags.update({k: json.dumps(v) if isinstance(v, bool) else v for k, v in spec.get("overrides", {}).items()})
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "OMP_WAIT_POLICY")}
    command = [sys.executable, "-m", "trainer.cli", "train", "grpo", *(f"--{k}={v}" for k, v in flags.items())]
    subprocess.run(command, check=True, env=env, cwd=common.REPO)
    done = common.clock()
    history = [r for r in checkpoint.read_history(spec["out_dir"]) if "step_time" in r]
    steps = [r["step_time"] for r in history]
    ends = list(itertools.accumulate(steps))
    phases = [{p: r.get(f"timing/{p}", 0.0) for p in PHASES if p != "other"} for r in history]
    gen_tokens = [r["completions/mean_length"] * spec["prompts_per_step"] * group for r in history]
    totals = [r["num_tokens"] for r in history]
    all_tokens = [b - a for a, b in zip([0.0, *totals[:-1]], totals)]
    return {**_summary(spec, ends, 0.0, phases, gen_tokens, all_tokens), "total_s": done - started,
            "reward": history[-1].get("reward")}


def child_trl(spec: dict, started: float) -> dict:
    import datasets  # noqa: F401  (imported here: the import phase holds all imports)
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: F401
    from trl import GRPOConfig, GRPOTrainer

    from trainer.rewards.rules import exact_answer

    imported = common.clock()
    marks: dict[str, float] = {}
    step_ends: list[float] = []
    phases: list[dict[str, float]] = [{}]
    gen_tokens: list[float] = [0.0]
    all_tokens: list[float] = [0.0]

    def add(phase: str, seconds: float) -> None:
        phases[-1][phase] = phases[-1].get(phase, 0.0) + seconds

    def next_step() -> None:
        phases[-1]["update"] = step_ends[-1] - marks.pop("prepared")  # loss, backward, clip, optimizer
        phases.append({})
        gen_tokens.append(0.0)
        all_tokens.append(0.0)

    class TimedGRPOTrainer(GRPOTrainer):
        """TRL's own step, with its phases timed and its tokens counted."""

        def _generate_and_score_completions(self, inputs):
            marks["in_prepare"] = 1.0
            start = common.clock()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                marks.pop("in_prepare")
                marks["prepared"] = common.clock()
                add("prepare", marks["prepared"] - start)

        def _generate(self, prompts):
            start = common.clock()
            try:
                return super()._generate(prompts)
            finally:
                add("generate", common.clock() - start)

        def _calculate_rewards(self, *args, **kwargs):
            start = common.clock()
            try:
                return super()._calculate_rewards(*args, **kwargs)
            finally:
                add("score", common.clock() - start)

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if "in_prepare" not in marks:  # the loss's own forward pass
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            start = common.clock()
            try:
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            finally:
                add("reference", common.clock() - start)

        def compute_loss(self, model, inputs, *args, **kwargs):
            gen_tokens[-1] += float(inputs["completion_mask"].sum())
            all_tokens[-1] += float(inputs["completion_mask"].sum() + inputs["prompt_mask"].sum())
            return super().compute_loss(model, inputs, *args, **kwargs)

    tokenizer, rows, model, _ = common.trl_inputs(spec)
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
                               processing_class=tokenizer,
                               callbacks=[common.trl_step_timer(marks, step_ends, after_step=next_step)])
    trainer.train()
    done = common.clock()
    for p in phases:  # TRL's bookkeeping inside _generate_and_score_completions counts as "other"
        p.pop("prepare", None)
    return {**_summary(spec, step_ends, marks["train_start"], phases[:len(step_ends)], gen_tokens, all_tokens),
            "import_s": imported - started, "setup_s": marks["train_start"] - imported,
            "total_s": done - started, "reward": None}


def child_probe(spec: dict, started: float) -> dict:
    """The machine's peaks, measured in a child with the training children's threads and environment,
    and what its GEMMs reach on each model's decode token step at each batch (`common.decode_gemm_rate`)."""
    return {**common.machine_peaks(),
            "decode_gemm": {model: common.decode_gemm_rate(path, spec["rows"]) for model, path in spec["models"].items()}}


# ----------------------------------------------------------------------------------------------
# Parent side: data, models, the runs and the tables


def parse_env(items: list[str]) -> dict[str, str]:
    """`--child-env NAME=VALUE` items (an empty VALUE unsets NAME in the training children)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            sys.exit(f"--child-env {item!r}: expected NAME=VALUE (NAME= to unset it), e.g. OMP_WAIT_POLICY=.")
        out[key] = value
    return out


def floor_rows(run: dict, counts: dict, prompt_tokens: int, spec: dict, peaks: dict) -> list[list]:
    """Achieved FLOP/s and bytes/s of each phase of one (median) run against the measured peaks.

    Useful work, the same for every trainer: N = matmul parameters (`common.matmul_parameters`),
    tokens = each prompt once per group + every generated token. update 6 N tokens FLOPs; reference
    (forward-only log-prob passes: one for beta > 0, one for num_iterations > 1) 2 N tokens per pass;
    generate 2 N tokens FLOPs and, decoding, N x weight bytes per token step (all weights read
    once a step; KV-cache reads left out), against the copy bandwidth and, as "decode vs GEMMs",
    against the bytes/s this machine's GEMMs themselves reach on a token step of the model at this
    many concurrent sequences (`peaks["decode_gemm"]`); sync N_all x (4 + weight bytes) bytes (read
    fp32, write the engine's copy). Attention's own FLOPs (~5% at these lengths) are left out."""
    n = counts["matmul_params"]
    tokens = prompt_tokens + run["gen_tokens_per_step"]
    matmul = common.matmul_peak_of(peaks, spec["bf16"])
    copy = peaks["copy"]["peak"]
    engine_bytes = 2 if spec["bf16"] and run["trainer"] in ("alignflow-vllm", "alignflow-cli") else 4
    gemm = peaks["decode_gemm"][run["model"]]["bfloat16" if engine_bytes == 2 else "float32"][str(spec["completions"])]
    steps = spec["new_tokens"] if spec["full_length"] else run["gen_tokens_per_step"] / spec["completions"]
    overrides = spec.get("overrides", {})
    passes = int(overrides.get("beta", 0.0) > 0) + int(overrides.get("num_iterations", 1) > 1)
    if run["trainer"] == "trl":
        passes = int(run["reference_s"] > 0)
    sync = counts["params"] * (4 + engine_bytes) if run["trainer"] in ("alignflow-vllm", "alignflow-cli") else None
    return [common.floor_row("update", run["update_s"], 6.0 * n * tokens, "FLOP", matmul),
            common.floor_row("reference", run["reference_s"], 2.0 * n * tokens * passes or None, "FLOP", matmul),
            common.floor_row("generate", run["generate_s"], 2.0 * n * tokens, "FLOP", matmul),
            common.floor_row("decode", run["generate_s"], n * engine_bytes * steps, "B", copy),
            common.floor_row("decode vs GEMMs", run["generate_s"], n * engine_bytes * steps, "B", gemm["peak"]),
            common.floor_row("sync", run["sync_s"] or None, sync, "B", copy),
            common.floor_row("step", run["s_per_step"], 6.0 * n * tokens + 2.0 * n * tokens * (1 + passes), "FLOP",
                             matmul)]


def floor_report(medians: list[dict], data_info: dict, counts: dict, spec: dict, peaks: dict) -> tuple[str, list]:
    """The floor table of every median run, and its rows as dicts for the JSON."""
    def rows_of(run: dict) -> list[list]:
        case = {**spec, "new_tokens": run["new_tokens"], "completions": spec["prompts_per_step"] * run["generations"]}
        return floor_rows(run, counts[run["model"]], sum(data_info[run["model"]]["prompt_tokens"]), case, peaks)

    return common.floor_report(medians, [("model", "model"), ("generations", "G"), ("new_tokens", "new tok"),
                                         ("trainer", "trainer")], rows_of)


def prepare_data(source: Path, work: Path, model_dir: Path, prompts: int) -> tuple[Path, dict]:
    """One step's worth of GSM8K prompts as jsonl, and their length in this model's tokens."""
    from transformers import AutoTokenizer

    rows = common.gsm8k_rows(source, prompts)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lengths = [len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]) for r in rows]
    path = common.write_jsonl(work / f"gsm8k-grpo-{model_dir.name}.jsonl", rows)
    return path, {"prompts": len(rows), "prompt_tokens": lengths}


def summarise(medians: list[dict], cases: list[tuple], trainers: list[str]) -> tuple[str, str]:
    """The per-run table (phases, throughput, memory) and the ratio table against TRL."""
    results = {(m["model"], m["generations"], m["new_tokens"], m["trainer"]): m for m in medians}
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
        trl, vllm, hf, cli = (results.get((*case, t)) for t in ("trl", "alignflow-vllm", "alignflow-hf", "alignflow-cli"))
        top = max(PHASES, key=lambda p: vllm[f"{p}_s"]) if vllm else None
        step_ratio = common.ratio(vllm, trl, "s_per_step")
        ratio_rows.append([*case, step_ratio, common.ratio(hf, trl, "s_per_step"), common.ratio(cli, trl, "s_per_step"),
                           common.ratio(vllm, trl, "generate_s"),
                           common.ratio(vllm, trl, "update_s"),
                           f"{top} {vllm[f'{top}_s'] / vllm['s_per_step']:.0%}" if top else None,
                           None if step_ratio is None else "yes" if step_ratio <= 1 / 3 else "no"])
    ratio_table = common.format_table(["model", "G", "new tok", "vllm/TRL step", "hf/TRL step", "cli/TRL step",
                                       "vllm/TRL generate",
                                       "vllm/TRL update", "vllm's largest phase", "<= 1/3?"], ratio_rows)
    return common.format_table(headers, rows), ratio_table


def main(argv: list[str] | None = None) -> None:
    parser = common.make_parser(__doc__)
    common.add_run_flags(parser, "gsm8k/train.jsonl", trainers=TRAINERS, warmup=2, repeats=False,
                         steps="Optimizer steps per run (one generation each; default 7).")
    parser.set_defaults(steps=7)
    parser.add_argument("--generations", default="4,8", help="Comma-separated group sizes G.")
    parser.add_argument("--new-tokens", default="32,128", help="Comma-separated completion lengths.")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="Prompts per step (x G completions).")
    parser.add_argument("--natural-lengths", action="store_true",
                        help="Let completions stop at eos instead of forcing --new-tokens tokens.")
    parser.add_argument("--learning-rate", type=float, default=1e-6, help="Constant learning rate.")
    parser.add_argument("--max-prompt-length", type=int, default=512, help="alignflow's left truncation (none here).")
    parser.add_argument("--bf16", action="store_true",
                        help="Mixed precision in every trainer: alignflow and TRL `bf16=True` (autocast, fp32 weights); "
                             "alignflow's vLLM then generates in bfloat16.")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="Override a GRPOConfig field in the alignflow runs (VALUE as JSON), for A/B runs; repeatable.")
    parser.add_argument("--child-env", action="append", default=[], metavar="NAME=VALUE",
                        help="Set (NAME= unsets) an environment variable in the training children; repeatable.")
    args = parser.parse_args(argv)
    if args.child:
        return common.child_main(json.loads(args.child), {"trl": child_trl, "probe": child_probe,
                                                          "alignflow-cli": child_cli, "": child_alignflow})

    models = common.parse_list(args.models, ("tiny", "smollm2"), "model")
    groups = [int(g) for g in common.parse_list(args.generations)]
    lengths = [int(n) for n in common.parse_list(args.new_tokens)]
    trainers = common.parse_list(args.trainers, TRAINERS, "trainer")
    common.require_trl(trainers)
    source = common.data_path(args.data, "gsm8k/train.jsonl")
    overrides, env_overrides = common.parse_overrides(args.set, "trainer.stages.rl.grpo:GRPOConfig"), parse_env(args.child_env)
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-grpo-"))
    runs, data_info, cases, counts = [], {}, [], {}
    started = common.clock()
    try:
        paths = {model: common.model_path(model, work, args.smollm2_dir) for model in models}
        rows = sorted({args.prompts_per_step * g for g in groups})
        probe = dict(vllm=True, models={m: str(p) for m, p in paths.items()}, rows=rows)
        probes = [common.probe_peaks(__file__, work, args.threads, args.timeout, **probe)]
        for model, path in paths.items():
            data, data_info[model] = prepare_data(source, work, path, args.prompts_per_step)
            counts[model] = common.matmul_parameters(path)
            if max(data_info[model]["prompt_tokens"]) > args.max_prompt_length:
                sys.exit(f"A prompt has {max(data_info[model]['prompt_tokens'])} tokens > --max-prompt-length.")
            plan = []
            for group in groups:
                for new_tokens in lengths:
                    cases.append((model, group, new_tokens))
                    plan += [(f"{model} G={group} {new_tokens} tok {trainer}",
                              {"model": model, "generations": group, "new_tokens": new_tokens, "trainer": trainer},
                              dict(trainer=trainer, model_path=str(path), data_path=str(data), steps=args.steps,
                                   warmup_steps=args.warmup_steps, prompts_per_step=args.prompts_per_step,
                                   generations=group, new_tokens=new_tokens, full_length=not args.natural_lengths,
                                   learning_rate=args.learning_rate, max_prompt_length=args.max_prompt_length,
                                   threads=args.threads, seed=args.seed, bf16=args.bf16, overrides=overrides))
                             for trainer in trainers]
            runs += common.run_trainers(__file__, plan, work, args.threads, args.timeout, vllm=True,
                                        env_overrides=env_overrides, show=lambda r: (
                f"{r['s_per_step']:.2f} s/step (steps {[round(s, 2) for s in r['step_times']]}), "
                + ", ".join(f"{p} {r[f'{p}_s']:.2f}" for p in PHASES)
                + f"; {r['gen_tok_per_s']:.0f} gen tok/s, {r['wall_s']:.0f} s wall"))
        probes.append(common.probe_peaks(__file__, work, args.threads, args.timeout, **probe))  # the best of both counts
    finally:
        shutil.rmtree(work, ignore_errors=True)
    peaks = common.best_peaks(*probes)
    medians = common.median_rows(runs, ["model", "generations", "new_tokens", "trainer"])
    precision = "bf16 mixed precision (fp32 weights)" if args.bf16 else "float32"
    lengths_note = "natural lengths (eos stops)" if args.natural_lengths else "every completion forced to full length"
    settings = (f"{args.prompts_per_step} prompts x G completions per step, {lengths_note}, temperature 1, beta 0, "
                f"dapo, {precision}, {args.threads} threads, {args.steps} steps (first {args.warmup_steps} untimed, "
                "median of the rest); prompt tokens " + ", ".join(
                    f"{m}: {d['prompt_tokens']}" for m, d in data_info.items()))
    if overrides or env_overrides:
        settings += f"; alignflow overrides {overrides}, child environment {env_overrides}"
    table, ratios = summarise(medians, cases, trainers)
    floor, floor_records = floor_report(medians, data_info, counts, dict(
        bf16=args.bf16, full_length=not args.natural_lengths, prompts_per_step=args.prompts_per_step,
        overrides=overrides), peaks)
    common.print_header("GRPO", settings, started, load_before)
    print(table)
    print()
    print(ratios)
    print("\n" + common.peaks_line(peaks, counts) + "\n")
    for model, by_dtype in peaks["decode_gemm"].items():
        print(f"Decode GEMMs of one {model} token step (every nn.Linear weight once): " + "; ".join(
            f"{dtype} at {n} sequences {r['seconds'] * 1e3:.1f} ms = {r['peak'] / 1e9:.1f} GB/s "
            f"({100 * r['peak'] / peaks['copy']['peak']:.0f}% of copy)"
            for dtype, by_rows in by_dtype.items() for n, r in by_rows.items()))
    print()
    print(floor)
    if args.json:
        common.write_json(args.json, "grpo", args, runs, medians, data=data_info, peaks=peaks, probes=probes,
                          parameters=counts, floor=floor_records)


if __name__ == "__main__":
    main()
