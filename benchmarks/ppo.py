"""PPO step time by phase and peak memory: alignflow PPO against TRL's `PPOTrainer` and alignflow GRPO.

    bash benchmarks/trl_ppo_env.sh        # once: TRL 1.12.0 in its own venv, /work/venvs/trl-ppo
    flock /tmp/alignflow-bench.lock python benchmarks/ppo.py --json ppo.json   # both models, ~18 min on a busy box

For each model, in one run, these trainers do the same amount of RL work per step, each in its
own process (peak RSS is that process's own):

- `alignflow-ppo-hf` / `alignflow-ppo-vllm`: `trainer.stages.rl.ppo.run_ppo` with transformers `generate`
  or in-process vLLM rollouts; the value head shares the policy's backbone.
- `trl-ppo`: TRL 1.12.0's `PPOTrainer` (`trl.experimental.ppo`; 1.12.0 is the last release that
  ships it, TRL 1.13 removed it, and 0.28.0 is the last with `trl/trainer/ppo_trainer.py`), run by
  the Python of its own venv (`--trl-python`, made by `benchmarks/trl_ppo_env.sh`) beside the same
  torch 2.13 and transformers 5.19 as alignflow. Its critic is a separate backbone
  (`AutoModelForSequenceClassification`, as in TRL's own PPO example, loaded from the reward model).
- `alignflow-grpo-hf` / `alignflow-grpo-vllm`: `trainer.stages.rl.grpo.run_grpo` on the same number of
  rollouts per step (`--batch-size` completions = batch_size / G prompts x G), micro-batches of
  `--mini-batch-size`, one optimizer step per generation (num_iterations 1, GRPO's usual setting),
  beta = the PPO KL coefficient (so it runs a reference forward too), loss_type dapo.

Same settings in every PPO run: `--batch-size` rollouts (prompts, one completion each) per PPO
step, `--ppo-epochs` passes over them in mini-batches of `--mini-batch-size` (one forward/backward
and one optimizer step each: TRL per_device_train_batch_size = batch, num_mini_batches = batch /
mini, gradient_accumulation_steps 1; alignflow per_device_batch_size = mini_batch_size = mini),
fixed KL coefficient 0.05 (k1 per-token penalty), gamma 1, lam 0.95, cliprange 0.2, cliprange_value
0.2, vf_coef 0.1, no reward whitening, no missing-EOS penalty, temperature 1, top_k off, top_p 1,
learning rate 3e-6 constant, float32 (`--bf16`: bf16 mixed precision in every trainer), 2 torch threads, no
gradient checkpointing, no saving during training, no MLflow. The reward is the same sequence-classification model in every trainer: the
benchmarked model's backbone with a seeded random score head (`AutoModelForSequenceClassification`,
num_labels=1), made once per run; scores are random-ish, which does not matter for timing.
TRL's rollout forwards and generation run in chunks of `local_rollout_forward_batch_size` (its
default, 64, so the whole batch at once); alignflow's rollout forwards run in micro-batches of
`--mini-batch-size` and its generation takes the whole batch at once.

Fair lengths: every completion runs to exactly `--new-tokens` tokens: alignflow gets an empty stop
list (patched in the child, as in grpo.py), TRL `stop_token=None` (no EOS stop, no truncation).
Prompts: the first `--batch-size` GSM8K train questions as one chat message each; the dataset holds
exactly one PPO step's prompts, so every step of every trainer sees the same prompt tokens.

What is timed: steps, from the end of one PPO step (rollout + all its optimizer steps + weight sync
+ logging) to the end of the next, leaving out the first `--warmup-steps`; medians of the rest.
Phases: `generate` (rollout); `score` (the reward model); `reference` (the no-grad forwards of the
rollout: reference log-probs, plus for PPO the policy's log-probs and the critic's values; TRL takes
its rollout log-probs from generate's scores, so it runs reference + critic forwards); `update` (the
PPO epochs: forwards, backwards, optimizer steps; TRL's also holds its end-of-step metric
reductions); `sync` (weights to the rollout engine); `other` (what the phases leave of the step:
batching, KL rewards, GAE, whitening, logging). alignflow reports its own `timing/*` metrics; TRL's
phases are timed around its module-level `batch_generation`, `forward` and `get_reward` calls;
its two `gc.collect()` calls per step are timed too (`gc_s` in the JSON; they stay in "other").
CPU s/step is the process's CPU time per step (all threads): steadier than wall time when other
work shares the machine. Peak RSS is the child's whole life (models, optimizer, vLLM's KV cache).
The result JSON adds `trl_env`, the package versions of the TRL venv (`environment.versions` is
this Python's).

Floor table (issue 28): two probe children (one before and one after the runs, with the threads and
environment of the alignflow children; the faster counts, as in grpo.py) time torch.matmul of
2048 x 2048 bf16 and fp32 matrices and a 512 MiB copy. FLOPs are held against the fp32 matmul peak, or
the bf16 one with `--bf16`. Per phase of each median run, with N_body = the nn.Linear weights of
the transformer blocks, N_head = the LM head's (`common.matmul_parameters`), tokens = the prompts
(each once; GRPO: each prompt once per group, as grpo.py counts) + the generated tokens, targets =
the generated tokens (the head runs only there): generate 2 x (N_body x tokens + N_head x targets)
FLOPs and, as decode, all weights read once per token step (N x 4 bytes x new tokens; KV-cache
reads left out) against the copy peak; score the reward model's forward, 2 x its linears x tokens;
reference 2 x (N_body x tokens + N_head x targets) per forward-only pass: PPO two (the policy's
log-probs and values in one pass, the reference's log-probs), GRPO one (beta > 0), TRL the
reference's plus its critic's (the reward model's linears); update 6 x (N_body x tokens + N_head x
targets) per PPO epoch (TRL adds its critic's 6 x linears x tokens); sync (vLLM) N x (4 + 4) bytes;
the step all FLOPs. Left out: attention's own FLOPs, the value head (one row), left padding (the
micro-batches compute it; not useful work), norms, sampling, GAE and the optimizer.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import common

TRAINERS = ("alignflow-ppo-hf", "alignflow-ppo-vllm", "alignflow-grpo-hf", "alignflow-grpo-vllm", "trl-ppo")
DEFAULT_TRAINERS = "alignflow-ppo-hf,alignflow-ppo-vllm,alignflow-grpo-hf,trl-ppo"
PHASES = ("generate", "score", "reference", "update", "sync", "other")
TRL_PYTHON = Path("/work/venvs/trl-ppo/bin/python")
KL_COEF = 0.05


# ----------------------------------------------------------------------------------------------
# Child side: one training run


def _summary(spec: dict, step_ends: list[float], train_start: float, phases: list[dict[str, float]],
             gen_tokens: list[float], cpu: tuple[float, list[float]]) -> dict:
    """Median step time (wall and CPU) and phases over the steps after the warm-up ones; `cpu` = (the
    process's CPU clock at the start of training, and at each step end)."""
    starts = [train_start, *step_ends[:-1]]
    steps = [end - start for start, end in zip(starts, step_ends)]
    cpu_steps = [end - start for start, end in zip([cpu[0], *cpu[1][:-1]], cpu[1])]
    keep = range(min(spec["warmup_steps"], len(steps) - 1), len(steps))
    for i in keep:
        phases[i]["other"] = steps[i] - sum(phases[i].get(p, 0.0) for p in PHASES if p != "other")
    out = {"s_per_step": common.median([steps[i] for i in keep]), "step_times": steps, "steps": len(steps),
           "cpu_s_per_step": common.median([cpu_steps[i] for i in keep]),
           "gen_tokens_per_step": common.median([gen_tokens[i] for i in keep])}
    out.update({f"{p}_s": common.median([phases[i].get(p, 0.0) for i in keep]) for p in PHASES})
    out["gen_tok_per_s"] = out["gen_tokens_per_step"] / out["s_per_step"]
    return out


def _alignflow_config(spec: dict, stage):
    """The PPO or GRPO config of one alignflow run (see the module docstring for the settings)."""
    engine = spec["trainer"].rsplit("-", 1)[1]
    common_fields = dict(
        model=spec["model_path"], dataset=spec["data_path"], output_dir=spec["out_dir"], dtype="float32",
        learning_rate=spec["learning_rate"], lr_scheduler="constant", reward_funcs=[spec["reward_path"]],
        max_completion_length=spec["new_tokens"], max_prompt_length=spec["max_prompt_length"], temperature=1.0,
        top_p=1.0, top_k=-1, rollout_engine=engine, seed=spec["seed"], logging_steps=1, log_completions_steps=0,
        save_steps=0, disable_progress_bar=True, bf16=spec["bf16"])
    if spec["trainer"].startswith("alignflow-ppo"):
        per = spec["ppo_epochs"] * spec["batch_size"] // spec["mini_batch_size"]
        return stage.PPOConfig(
            **common_fields, max_steps=spec["steps"] * per, batch_size=spec["batch_size"],
            mini_batch_size=spec["mini_batch_size"], per_device_batch_size=spec["mini_batch_size"],
            ppo_epochs=spec["ppo_epochs"], init_kl_coef=KL_COEF, adap_kl_ctrl=False, gamma=1.0, lam=0.95,
            cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, whiten_rewards=False, missing_eos_penalty=None)
    return stage.GRPOConfig(
        **common_fields, max_steps=spec["steps"], per_device_batch_size=spec["mini_batch_size"],
        gradient_accumulation_steps=spec["batch_size"] // spec["mini_batch_size"],
        num_generations=spec["generations"], num_iterations=1, beta=KL_COEF, loss_type="dapo",
        scale_rewards="group")


def child_alignflow(spec: dict, started: float) -> dict:
    from trainer.engine import checkpoint, runner
    from trainer.stages.rl import grpo, ppo, shared

    imported = common.clock()
    marks: dict[str, float] = {}
    step_ends: list[float] = []
    cpu_ends: list[float] = []

    # Instrument the stage through the names it calls; nothing else changes.
    sampling_config, progress_cls = shared.SamplingConfig, runner.Progress

    def sampling(*args, **kwargs):
        kwargs["stop_token_ids"] = []  # run every completion to max_completion_length
        return sampling_config(*args, **kwargs)

    class TimedProgress(progress_cls):
        def __init__(self, *args, **kwargs):  # right before the first step
            super().__init__(*args, **kwargs)
            marks["train_start_cpu"], marks["train_start"] = common.cpu_clock(), common.clock()

        def update(self, *args, **kwargs):  # once per PPO step (GRPO: per generation), after sync and logging
            super().update(*args, **kwargs)
            step_ends.append(common.clock())
            cpu_ends.append(common.cpu_clock())

    shared.SamplingConfig, runner.Progress = sampling, TimedProgress
    is_ppo = spec["trainer"].startswith("alignflow-ppo")
    config = _alignflow_config(spec, ppo if is_ppo else grpo)
    (ppo.run_ppo if is_ppo else grpo.run_grpo)(config)
    done = common.clock()
    history = [r for r in checkpoint.read_history(spec["out_dir"]) if "step_time" in r]
    phases = [{p: r.get(f"timing/{p}", 0.0) for p in PHASES if p != "other"} for r in history]
    gen_tokens = [r["completions/mean_length"] * spec["batch_size"] for r in history]
    return {**_summary(spec, step_ends, marks["train_start"], phases, gen_tokens,
                       (marks["train_start_cpu"], cpu_ends)),
            "import_s": imported - started, "setup_s": marks["train_start"] - imported,
            "total_s": done - started, "score_mean": history[-1].get("reward")}


def _trl_inputs(spec: dict):
    """Tokenizer (left padding), tokenized prompts, and the four models of TRL's PPO."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"], padding_side="left")
    with open(spec["data_path"]) as f:
        rows = [json.loads(line) for line in f]
    ids = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"] for r in rows]
    dataset = datasets.Dataset.from_dict({"input_ids": ids})

    def lm():
        return AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)

    def classifier():
        return AutoModelForSequenceClassification.from_pretrained(spec["reward_path"], num_labels=1,
                                                                  dtype=torch.float32)

    return tokenizer, dataset, lm(), lm(), classifier(), classifier()


def child_trl(spec: dict, started: float) -> dict:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import gc

    import torch
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as module

    imported = common.clock()
    marks: dict[str, float] = {}
    step_ends: list[float] = []
    cpu_ends: list[float] = []
    phases: list[dict[str, float]] = [{}]
    gen_tokens: list[float] = [0.0]

    def add(phase: str, seconds: float) -> None:
        phases[-1][phase] = phases[-1].get(phase, 0.0) + seconds

    def timed(fn, phase_of):
        """`fn` with its time added to the phase `phase_of(*args)` names (None: not a rollout phase)."""
        def wrapper(*args, **kwargs):
            phase = phase_of(*args)
            if phase is None:
                marks.setdefault("update_start", common.clock())
                return fn(*args, **kwargs)
            start = common.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                add(phase, common.clock() - start)
        return wrapper

    def after_step() -> None:
        phases[-1]["update"] = step_ends[-1] - marks.pop("update_start")
        phases.append({})
        gen_tokens.append(0.0)

    generate = module.batch_generation

    def counted_generation(model, queries, *args, **kwargs):
        out = generate(model, queries, *args, **kwargs)
        gen_tokens[-1] += float(out[0][:, queries.shape[1]:].numel())
        return out

    class TimedGC:  # TRL calls gc.collect() twice per step; its time stays in "other" and is reported apart
        def collect(self, *args):
            start = common.clock()
            try:
                return gc.collect(*args)
            finally:
                phases[-1]["gc"] = phases[-1].get("gc", 0.0) + common.clock() - start

    tokenizer, dataset, policy, ref, value, reward = _trl_inputs(spec)
    module.gc = TimedGC()
    module.batch_generation = timed(counted_generation, lambda *a: "generate")
    module.forward = timed(module.forward, lambda model, *a: None if torch.is_grad_enabled() else "reference")
    module.get_reward = timed(module.get_reward, lambda model, *a: "score" if model is reward else "reference")
    batch = spec["batch_size"]
    args = PPOConfig(
        output_dir=spec["out_dir"], per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_mini_batches=batch // spec["mini_batch_size"], num_ppo_epochs=spec["ppo_epochs"],
        total_episodes=spec["steps"] * batch, response_length=spec["new_tokens"], stop_token=None,
        missing_eos_penalty=None, temperature=1.0, kl_coef=KL_COEF, kl_estimator="k1", vf_coef=0.1,
        cliprange=0.2, cliprange_value=0.2, gamma=1.0, lam=0.95, whiten_rewards=False,
        learning_rate=spec["learning_rate"], lr_scheduler_type="constant", warmup_steps=0, bf16=spec["bf16"],
        fp16=False,
        use_cpu=True, gradient_checkpointing=False, seed=spec["seed"], num_sample_generations=0,
        logging_steps=10**9, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0)
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=dataset, eval_dataset=dataset,
                         callbacks=[common.trl_step_timer(marks, step_ends, after_step=after_step,
                                                                    cpu_ends=cpu_ends)])
    trainer.train()
    done = common.clock()
    keep = phases[min(spec["warmup_steps"], len(step_ends) - 1):len(step_ends)]
    return {**_summary(spec, step_ends, marks["train_start"], phases[:len(step_ends)], gen_tokens,
                       (marks["train_start_cpu"], cpu_ends)),
            "gc_s": common.median([p.get("gc", 0.0) for p in keep]),
            "import_s": imported - started, "setup_s": marks["train_start"] - imported,
            "total_s": done - started, "score_mean": None}


# ----------------------------------------------------------------------------------------------
# Parent side: data, models, the runs and the tables


def make_reward_model(model_dir: Path, out: Path, seed: int) -> Path:
    """The benchmark's reward model: `model_dir`'s backbone with a seeded random scalar head, and its tokenizer."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def prepare_data(source: Path, work: Path, model_dir: Path, prompts: int) -> tuple[Path, dict]:
    """One PPO step's worth of GSM8K chat prompts as jsonl, and their length in this model's tokens."""
    from transformers import AutoTokenizer

    rows = common.gsm8k_rows(source, prompts)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lengths = [len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]) for r in rows]
    path = common.write_jsonl(work / f"gsm8k-ppo-{model_dir.name}-{prompts}.jsonl", rows)
    return path, {"prompts": len(rows), "prompt_tokens": lengths}


def run_one(spec: dict, work: Path, threads: int, timeout: float, trl_python: Path) -> dict | None:
    """One training run in its own process (TRL's with the Python of its venv); None when it failed."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    spec = {**spec, "out_dir": str(run_dir / "out")}
    python = str(trl_python) if spec["trainer"] == "trl-ppo" else sys.executable
    env = common.child_env(threads, "vllm" in spec["trainer"], alignflow=spec["trainer"].startswith("alignflow"),
                           HF_DATASETS_CACHE=str(run_dir / "datasets-cache"))
    try:
        child = common.run_child([python, __file__, "--child", json.dumps(spec)], env=env, timeout=timeout)
        if not child.ok:
            print(f"  FAILED (exit {child.returncode}):\n{child.output[-3000:]}", file=sys.stderr)
            return {"failed": f"exit {child.returncode}: " + child.output.strip().splitlines()[-1][-300:]
                    if child.output.strip() else f"exit {child.returncode}"}
        return {**child.result, "peak_rss_mb": child.peak_rss_mb, "wall_s": child.wall_s}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def summarise(medians: list[dict], models: list[str], trainers: list[str]) -> tuple[str, str]:
    """The per-run table (phases, throughput, memory) and the ratio table."""
    results = {(m["model"], m["trainer"]): m for m in medians}
    headers = ["model", "trainer", "s/step", "CPU s/step", *(f"{p} s" for p in PHASES), "gen tok/s", "peak RSS MB",
               "n"]
    rows, ratio_rows = [], []
    for model in models:
        for trainer in trainers:
            r = results.get((model, trainer))
            rows.append([model, trainer, *([None] * (len(headers) - 2))] if r is None else
                        [model, trainer, r["s_per_step"], r["cpu_s_per_step"], *(r[f"{p}_s"] for p in PHASES),
                         r["gen_tok_per_s"],
                         r["peak_rss_mb"], r["n"]])
        for engine in ("hf", "vllm"):
            ours = results.get((model, f"alignflow-ppo-{engine}"))
            if ours is None:
                continue
            trl, grpo = results.get((model, "trl-ppo")), results.get((model, f"alignflow-grpo-{engine}"))
            ratio_rows.append([model, f"alignflow-ppo-{engine}",
                               *(common.ratio(ours, trl, k) for k in ("s_per_step", "cpu_s_per_step", "generate_s",
                                                                      "reference_s", "update_s", "peak_rss_mb")),
                               *(common.ratio(ours, grpo, k) for k in ("s_per_step", "cpu_s_per_step", "peak_rss_mb"))])
    ratio_table = common.format_table(
        ["model", "ours", "/TRL PPO step", "/TRL CPU s", "/TRL generate", "/TRL ref+critic", "/TRL update",
         "/TRL peak RSS", "/GRPO step", "/GRPO CPU s", "/GRPO peak RSS"], ratio_rows)
    return common.format_table(headers, rows), ratio_table


def floor_rows(run: dict, policy: dict, reward: dict, prompt_tokens: list[int], args, peaks: dict) -> list[list]:
    """Achieved FLOP/s and bytes/s of each phase of one median run against the measured peaks
    (the count is in the module docstring)."""
    grpo, trl = "grpo" in run["trainer"], run["trainer"] == "trl-ppo"
    gen = run["gen_tokens_per_step"]
    tokens = sum(prompt_tokens[:args.batch_size // args.generations] if grpo else prompt_tokens) + gen
    matmul, copy = common.matmul_peak_of(peaks, args.bf16), peaks["copy"]["peak"]

    def lm(per_param: float) -> float:
        return common.linear_flops(policy, tokens, gen, per_param)

    critic = common.linear_flops(reward, tokens, None, 2.0) if trl else 0.0
    epochs, passes = (1, 1) if grpo else (args.ppo_epochs, 1 if trl else 2)
    flops = {"generate": lm(2.0), "score": common.linear_flops(reward, tokens, None, 2.0),
             "reference": passes * lm(2.0) + critic, "update": epochs * (lm(6.0) + 3 * critic)}
    rows = [common.floor_row(phase, run[f"{phase}_s"], work, "FLOP", matmul) for phase, work in flops.items()]
    rows.append(common.floor_row("decode", run["generate_s"], policy["matmul_params"] * 4.0 * args.new_tokens, "B",
                                 copy))
    if "vllm" in run["trainer"]:
        rows.append(common.floor_row("sync", run["sync_s"] or None, policy["params"] * 8.0, "B", copy))
    rows.append(common.floor_row("step", run["s_per_step"], sum(flops.values()), "FLOP", matmul))
    return rows


def add_flags(parser) -> None:
    common.add_run_flags(parser, "gsm8k/train.jsonl", trainers=TRAINERS, default_trainers=DEFAULT_TRAINERS,
                         warmup=1, steps="PPO steps per run (rollout + all its epochs; default 3).", timeout=1200)
    parser.set_defaults(steps=3, repeats=1)
    parser.add_argument("--batch-size", type=int, default=4, help="Rollouts per PPO (and GRPO) step.")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 mixed precision in every trainer (`bf16=True`: fp32 weights, bf16 autocast; alignflow's "
                             "vLLM then samples in bfloat16); the floor table then uses the bf16 matmul peak.")
    parser.add_argument("--mini-batch-size", type=int, default=4,
                        help="Rollouts per forward/backward and optimizer step.")
    parser.add_argument("--ppo-epochs", type=int, default=1, help="PPO passes over each step's rollouts.")
    parser.add_argument("--generations", type=int, default=4, help="GRPO's G (batch-size / G prompts per step).")
    parser.add_argument("--new-tokens", type=int, default=32, help="Tokens generated per completion (all of them).")
    parser.add_argument("--learning-rate", type=float, default=3e-6, help="Constant learning rate.")
    parser.add_argument("--max-prompt-length", type=int, default=512, help="alignflow's prompt limit (none cut here).")
    parser.add_argument("--trl-python", type=Path, default=TRL_PYTHON,
                        help="Python of the venv with TRL 1.12.0 (benchmarks/trl_ppo_env.sh makes it).")


def check_args(args) -> list[str]:
    """The trainers to run; exits with a one-line message on settings that cannot work."""
    trainers = common.parse_list(args.trainers, TRAINERS, "trainer")
    if args.batch_size % args.mini_batch_size:
        sys.exit(f"--batch-size ({args.batch_size}) must be a multiple of --mini-batch-size ({args.mini_batch_size}).")
    if any(t.startswith("alignflow-grpo") for t in trainers) and args.batch_size % args.generations:
        sys.exit(f"--batch-size ({args.batch_size}) must be a multiple of --generations ({args.generations}) for GRPO.")
    if "trl-ppo" in trainers and not args.trl_python.exists():
        sys.exit(f"--trl-python {args.trl_python}: no such file; make the venv with `bash benchmarks/trl_ppo_env.sh` "
                 "or leave trl-ppo out of --trainers.")
    return trainers


def main(argv: list[str] | None = None) -> None:
    parser = common.make_parser(__doc__)
    add_flags(parser)
    args = parser.parse_args(argv)
    if args.child:
        return common.child_main(json.loads(args.child), {"trl-ppo": child_trl, "probe": common.child_probe,
                                                          "": child_alignflow})

    models = common.parse_list(args.models, ("tiny", "smollm2"), "model")
    trainers = check_args(args)
    source = common.data_path(args.data, "gsm8k/train.jsonl")
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-ppo-"))
    runs, data_info, counts, reward_counts = [], {}, {}, {}
    started = common.clock()
    vllm = any("vllm" in t for t in trainers)
    try:
        probes = [common.probe_peaks(__file__, work, args.threads, args.timeout, vllm=vllm)]
        for model in models:
            path = common.model_path(model, work, args.smollm2_dir)
            reward = make_reward_model(path, work / f"{model}-reward", args.seed)
            counts[model] = common.matmul_parameters(path)
            reward_counts[model] = common.matmul_parameters(reward, "AutoModelForSequenceClassification")
            ppo_data, data_info[model] = prepare_data(source, work, path, args.batch_size)
            grpo_data, _ = prepare_data(source, work, path, args.batch_size // args.generations)
            for repeat, trainer in common.alternating(trainers, args.repeats):
                print(f"[{common.clock() - started:6.0f}s] {model} {trainer} (repeat {repeat}) ...",
                      file=sys.stderr, flush=True)
                spec = dict(trainer=trainer, model_path=str(path), reward_path=str(reward),
                            data_path=str(grpo_data if "grpo" in trainer else ppo_data), steps=args.steps,
                            warmup_steps=args.warmup_steps, batch_size=args.batch_size,
                            mini_batch_size=args.mini_batch_size, ppo_epochs=args.ppo_epochs,
                            generations=args.generations, new_tokens=args.new_tokens,
                            learning_rate=args.learning_rate, max_prompt_length=args.max_prompt_length,
                            threads=args.threads, seed=args.seed, bf16=args.bf16)
                result = run_one(spec, work, args.threads, args.timeout, args.trl_python)
                row = {"model": model, "trainer": trainer, "repeat": repeat}
                if "failed" in result:
                    runs.append({**row, **result})
                    continue
                print(f"  {result['s_per_step']:.2f} s/step (steps {[round(s, 2) for s in result['step_times']]}), "
                      + ", ".join(f"{p} {result[f'{p}_s']:.2f}" for p in PHASES)
                      + f"; peak RSS {result['peak_rss_mb']:.0f} MB, {result['wall_s']:.0f} s wall",
                      file=sys.stderr, flush=True)
                runs.append({**row, **result})
        probes.append(common.probe_peaks(__file__, work, args.threads, args.timeout, vllm=vllm))  # the best counts
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = common.median_rows([r for r in runs if "failed" not in r], ["model", "trainer"])
    settings = (f"{args.batch_size} rollouts per step, {args.ppo_epochs} PPO epochs in mini-batches of "
                f"{args.mini_batch_size}, {args.new_tokens} new tokens each (forced), GRPO G={args.generations}, "
                f"kl_coef {KL_COEF}, {common.precision(args.bf16)}, {args.threads} threads, {args.steps} steps "
                f"(first {args.warmup_steps} untimed, median of the rest); prompt tokens "
                + ", ".join(f"{m}: {d['prompt_tokens']}" for m, d in data_info.items()))
    table, ratios = summarise(medians, models, trainers)
    common.print_header("PPO", settings, started, load_before)
    print(table)
    print()
    print(ratios)
    for failed in (r for r in runs if "failed" in r):
        print(f"\n{failed['model']} {failed['trainer']} FAILED: {failed['failed']}")
    peaks = common.best_peaks(*probes)
    floor, floor_records = common.floor_report(medians, [("model", "model"), ("trainer", "trainer")], lambda run: floor_rows(
        run, counts[run["model"]], reward_counts[run["model"]], data_info[run["model"]]["prompt_tokens"], args, peaks))
    print("\n" + common.peaks_line(peaks, counts) + "\n")
    print(floor)
    if args.json:
        common.write_json(args.json, "ppo", args, runs, medians, data=data_info, trl_env=trl_versions(args),
                          peaks=peaks, probes=probes, parameters={"policy": counts, "reward": reward_counts},
                          floor=floor_records)


def trl_versions(args) -> dict | None:
    """The package versions of the TRL venv, for the result JSON."""
    import subprocess

    if not args.trl_python.exists():
        return None
    code = ("import json, importlib.metadata as m; print(json.dumps({n: m.version(n) for n in "
            "('trl', 'transformers', 'torch', 'accelerate', 'datasets')}))")
    out = subprocess.run([str(args.trl_python), "-c", code], capture_output=True, text=True, check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr.strip()[-300:]}


if __name__ == "__main__":
    main()
