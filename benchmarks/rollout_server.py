"""GRPO with one `alignflow rollout-server` shared by 2 trainer ranks, against in-process vLLM colocated
with 1 rank: step time, time per phase, peak memory, and bytes and seconds per weight push.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/rollout_server.py --json benchmarks/results/rollout_server.json

Both cases run `alignflow train grpo` from the command line, as a user runs it, at the same global
batch (`--prompts-per-step` GSM8K questions x `--generations` completions per step), seed, length
and learning rate, float32, no saving until the end, no MLflow:

- `colocated-1`: one process, `--rollout_engine vllm` (vLLM inside the training process).
- `server-2`: `alignflow rollout-server` started first, as a user starts it (its own process, its
  start-up timed apart), then 2 ranks (`--num_processes 2`, DDP over gloo) with `--use_vllm true
  --vllm_mode server --vllm_server_host 127.0.0.1 --vllm_server_port P`; each rank asks the server for
  its own prompts' completions, and rank 0 pushes the new weights after every update.

Per step, from the run's metrics.jsonl: `step_time` and `timing/{generate,score,reference,update,sync}`
(sync: the whole weight push as the trainer sees it: gather, serialise, send, load); the first
`--warmup-steps` steps are left out; tables show medians over steps, then over `--repeats` runs.
The server's log gives each push's size and its load time on the server side. Peak memory is the
largest sum of RSS over the case's processes (trainer ranks and server), sampled every 0.2 s.

What the numbers mean here: on a CPU machine the server and the ranks share the same cores, so
this measures what the server protocol costs (HTTP generation requests, weight pushes), not the
GPU picture, where the server has GPUs of its own and generation overlaps nothing else.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    REPO,
    add_run_flags,
    child_env,
    clock,
    data_path,
    format_table,
    gsm8k_rows,
    make_parser,
    median,
    median_rows,
    model_path,
    parse_list,
    print_header,
    write_json,
    write_jsonl,
)

PHASES = ("generate", "score", "reference", "update", "sync")
CASES = ("colocated-1", "server-2")
PUSH_LINE = re.compile(r"Weights updated to version \d+: \d+ tensors, ([\d.]+) MB in (\d+) chunks, loaded in ([\d.]+) s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeakRSS(threading.Thread):
    """The largest total RSS (MB) of a set of process trees, sampled every 0.2 s until stopped."""

    def __init__(self, *roots: int):
        super().__init__(daemon=True)
        self.roots, self.peak_mb, self._done = list(roots), 0.0, threading.Event()

    def run(self) -> None:
        import psutil

        while not self._done.wait(0.2):
            total = 0
            for root in self.roots:
                try:
                    process = psutil.Process(root)
                    for p in [process, *process.children(recursive=True)]:
                        total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_mb = max(self.peak_mb, total / 2**20)

    def stop(self) -> float:
        self._done.set()
        self.join()
        return self.peak_mb


class Server:
    """`alignflow rollout-server` in its own process group, its output in `log`."""

    def __init__(self, model: Path, max_model_len: int, log: Path, env: dict, timeout: float):
        self.port, self.log = free_port(), log
        start = clock()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainer.cli", "rollout-server", "--model", str(model), "--host", "127.0.0.1",
                 "--port", str(self.port), "--max_model_len", str(max_model_len), "--dtype", "float32"],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"the rollout server exited ({self.proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ready", timeout=2):
                    break
            except OSError:
                if clock() - start > timeout:
                    self.stop()
                    sys.exit(f"the rollout server was not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        self.start_s = clock() - start

    def pushes(self) -> list[tuple[float, int, float]]:
        """(MB, chunks, load seconds) of every weight update the server logged."""
        return [(float(mb), int(n), float(s)) for mb, n, s in PUSH_LINE.findall(self.log.read_text(errors="replace"))]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def train(case: str, model: Path, data: Path, out: Path, args, server: Server | None, env: dict) -> dict:
    """One `alignflow train grpo` run of `case`; per-step medians from its metrics.jsonl."""
    ranks = 2 if server else 1
    completions = args.prompts_per_step * args.generations
    argv = [sys.executable, "-m", "trainer.cli", "train", "grpo", "--model", str(model), "--dataset", str(data),
            "--output_dir", str(out), "--reward_funcs", "exact_answer", "--num_generations", str(args.generations),
            "--per_device_batch_size", str(completions // ranks), "--max_prompt_length", str(args.max_prompt_length),
            "--max_completion_length", str(args.new_tokens), "--learning_rate", "1e-6", "--max_steps", str(args.steps),
            "--seed", str(args.seed), "--logging_steps", "1", "--log_completions_steps", "0",
            "--disable_progress_bar", "true", "--save_steps", "0"]
    if server:
        argv += ["--num_processes", "2", "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host",
                 "127.0.0.1", "--vllm_server_port", str(server.port)]
    else:
        argv += ["--rollout_engine", "vllm"]
    log = out.parent / f"{out.name}.log"
    start = clock()
    with open(log, "wb") as output:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)
        sampler = PeakRSS(proc.pid, *([server.proc.pid] if server else []))
        sampler.start()
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        peak = sampler.stop()
    if proc.returncode != 0:
        sys.exit(f"{case} failed ({proc.returncode}):\n{log.read_text(errors='replace')[-4000:]}")
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step_time" in r]
    kept = [r for r in steps if r["step"] > args.warmup_steps] or steps
    row = {"case": case, "wall_s": clock() - start, "peak_rss_mb": peak,
           "step_s": median([r["step_time"] for r in kept]),
           **{f"{p}_s": median([r.get(f"timing/{p}") for r in kept]) for p in PHASES},
           "completions_per_s": completions / median([r["step_time"] for r in kept])}
    if server:
        pushes = server.pushes()
        row |= {"server_start_s": server.start_s, "pushes": len(pushes),
                "push_mb": median([mb for mb, _, _ in pushes]), "push_chunks": median([n for _, n, _ in pushes]),
                "server_load_s": median([s for _, _, s in pushes])}
    return row


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__)
    add_run_flags(parser, "gsm8k/train.jsonl", trainers=CASES, default_trainers=",".join(CASES),
                  steps="GRPO steps per run (default 6).", warmup=1, timeout=1800)
    parser.add_argument("--generations", type=int, default=8, help="Completions per prompt (G).")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="Prompts per step, over all ranks.")
    parser.add_argument("--new-tokens", type=int, default=64, help="max_completion_length.")
    parser.add_argument("--max-prompt-length", type=int, default=256, help="max_prompt_length.")
    parser.set_defaults(models="smollm2")
    args = parser.parse_args(argv)
    args.steps = args.steps or 6
    if args.prompts_per_step * args.generations % 2:
        sys.exit("--prompts-per-step x --generations must be even (2 ranks share them).")
    started, load_before = clock(), os.getloadavg()[0]
    cases = parse_list(args.trainers, CASES, "case")
    source = data_path(args.data, "gsm8k/train.jsonl")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-rollout-server-") as tmp:
        work = Path(tmp)
        data = write_jsonl(work / "prompts.jsonl", gsm8k_rows(source, args.prompts_per_step * args.steps * 4))
        env = child_env(args.threads, vllm=True)
        for name in parse_list(args.models, ("tiny", "smollm2"), "model"):
            model = model_path(name, work, args.smollm2_dir)
            for repeat in range(args.repeats):
                for case in cases:
                    out = work / f"{name}-{case}-{repeat}"
                    server = None
                    if case == "server-2":
                        server = Server(model, args.max_prompt_length + args.new_tokens, work / f"{out.name}-server.log",
                                        env, args.timeout)
                    try:
                        row = train(case, model, data, out, args, server, env)
                    finally:
                        if server:
                            server.stop()
                    runs.append({"model": name, "repeat": repeat, **row})
                    print(f"{name} {case} #{repeat}: step {row['step_s']:.2f} s", file=sys.stderr, flush=True)
    medians = median_rows(runs, ("model", "case"))
    print_header("GRPO rollouts: one rollout server for 2 ranks vs in-process vLLM with 1",
                 f"{args.prompts_per_step} prompts x G {args.generations} per step, {args.new_tokens} new tokens, "
                 f"{args.steps} steps ({args.warmup_steps} warm-up), {args.threads} threads per process, "
                 f"{args.repeats} repeat(s)", started, load_before)
    headers = ["model", "case", "step s", *(f"{p} s" for p in PHASES), "completions/s", "peak RSS MB"]
    print(format_table(headers, [[m["model"], m["case"], m["step_s"], *(m[f"{p}_s"] for p in PHASES),
                                  m["completions_per_s"], m["peak_rss_mb"]] for m in medians]))
    pushes = [m for m in medians if m.get("pushes")]
    if pushes:
        print("\nWeight pushes (server-2): size and chunks from the server's log, the trainer's whole push "
              "(timing/sync) and the server's share (loading the staged tensors)\n")
        print(format_table(["model", "server start s", "pushes/run", "MB/push", "chunks/push", "push s (trainer)",
                            "load s (server)", "MB/s"],
                           [[m["model"], m["server_start_s"], m["pushes"], m["push_mb"], m["push_chunks"], m["sync_s"],
                             m["server_load_s"], m["push_mb"] / m["sync_s"] if m["sync_s"] else None]
                            for m in pushes]))
    for model in dict.fromkeys(m["model"] for m in medians):
        by_case = {m["case"]: m for m in medians if m["model"] == model}
        if set(CASES) <= set(by_case):
            print(f"\n{model}: server-2 / colocated-1 step time = "
                  f"{by_case['server-2']['step_s'] / by_case['colocated-1']['step_s']:.2f}")
    if args.json:
        write_json(args.json, "rollout_server", args, runs, medians)


if __name__ == "__main__":
    main()
