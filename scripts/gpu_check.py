"""The GPU check of issue 17: `pytest -m gpu` plus a short throughput run of every stage, one JSON summary.

    bash scripts/gpu_check.sh [--out gpu_check.json] [--dry-run] [--stages sft,dpo] [--steps 20]

On a CUDA machine it runs tests/gpu (every stage on the GPU in bf16; 2-GPU DDP and ZeRO-3 when
there are two GPUs) and then each stage for a few steps on a small model built offline
(`init-tiny`, widened), in bf16, on one GPU and, with two or more, on two under DeepSpeed ZeRO-3,
and records steps/s and tokens/s from the stages' own metrics. `--dry-run` runs the same
sequence on the CPU with the tiny model and float32 (no GPU needed): it proves the script, not
a GPU. The summary says which device really ran; nothing in it is a GPU number unless
`"cuda": true`. Budget: under 8 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "trainer" / "demo_data"
STAGES = ("sft", "reward", "dpo", "grpo")


def stage_args(stage: str, work: Path) -> list[str]:
    if stage == "sft":
        return ["--dataset", str(DEMO / "sft.jsonl"), "--num_sample_completions", "0"]
    if stage in ("reward", "dpo"):
        return ["--dataset", str(DEMO / "preferences.jsonl")]
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Write about item {i}.", "target": "a"}) + "\n"
                               for i in range(64)))
    return ["--dataset", str(prompts), "--reward_funcs", "length:16", "--num_generations", "8",
            "--max_completion_length", "32", "--max_prompt_length", "64", "--log_completions_steps", "0"]


def train_command(stage: str, model: Path, out: Path, steps: int, cuda: bool, work: Path,
                  extra: list[str]) -> list[str]:
    """`alignflow train STAGE` for a throughput run of `steps` steps (`extra`: the layout's flags)."""
    batch = 8 if stage == "grpo" else 4
    return [sys.executable, "-m", "trainer.cli", "train", stage, "--model", str(model), "--output_dir", str(out),
            "--max_steps", str(steps), "--logging_steps", "1", "--disable_progress_bar", "true",
            "--per_device_batch_size", str(batch), "--bf16", "true" if cuda else "false", *stage_args(stage, work),
            *extra]


def run(command: list[str], timeout: float) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return done.returncode, time.perf_counter() - start, (done.stdout + done.stderr)[-4000:]
    except subprocess.TimeoutExpired as err:
        return 124, time.perf_counter() - start, f"timed out after {timeout}s: {err}"


def throughput(out: Path, seconds: float) -> dict:
    """Step rate and tokens from the run's own metrics.jsonl and manifest."""
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in records if "num_tokens" in r]
    manifest = json.loads((out / "alignflow.json").read_text())
    runtime = manifest["metrics"].get("train_runtime", seconds)
    return {"steps": train[-1]["step"], "tokens": train[-1]["num_tokens"], "train_runtime_s": runtime,
            "steps_per_s": train[-1]["step"] / runtime, "tokens_per_s": train[-1]["num_tokens"] / runtime,
            **{k: manifest.get(k) for k in ("device", "world_size", "mixed_precision", "zero_stage")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json", help="Summary JSON file (default gpu_check.json).")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, float32: check the script itself.")
    parser.add_argument("--steps", type=int, default=20, help="Steps per throughput run (default 20).")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"Comma-separated stages to run (default all: {','.join(STAGES)}).")
    args = parser.parse_args()
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if not stages or set(stages) - set(STAGES):
        parser.error(f"--stages takes some of {','.join(STAGES)}, got {args.stages!r}")
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    gpus = torch.cuda.device_count() if cuda else 0
    if not cuda and not args.dry_run:
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); use --dry-run to test the script "
              "on the CPU.", file=sys.stderr)
        return 2
    summary: dict = {"cuda": cuda, "gpus": gpus, "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
                     "torch": torch.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "tests": None, "stages": []}
    with tempfile.TemporaryDirectory(prefix="alignflow-gpu-check-") as tmp:
        work = Path(tmp)
        model = work / "model"
        width = ["--hidden-size", "512", "--num-layers", "8", "--num-heads", "8"] if cuda else []
        code, _, log = run([sys.executable, "-m", "trainer.cli", "model", "init-tiny", "--out", str(model), *width], 300)
        assert code == 0, log
        if cuda:
            code, secs, log = run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu"], 300)
            summary["tests"] = {"exit_code": code, "seconds": secs, "tail": log[-1500:]}
        layouts = [("1 GPU" if cuda else "1 CPU rank", [])]
        if gpus >= 2 or args.dry_run:
            layouts.append(("2 ranks, ZeRO-3", ["--num_processes", "2", "--deepspeed", "zero3"]))
        for stage in stages:
            # A dry run checks the two-rank path once (on SFT); the multi-rank tests cover every stage.
            for name, extra in layouts[:1] if args.dry_run and stage != "sft" else layouts:
                out = work / f"{stage}-{len(summary['stages'])}"
                command = train_command(stage, model, out, args.steps, cuda, work, extra)
                code, secs, log = run(command, 240)
                row = {"stage": stage, "layout": name, "exit_code": code, "wall_s": secs}
                row.update(throughput(out, secs) if code == 0 else {"tail": log[-1500:]})
                summary["stages"].append(row)
                print(f"{stage:7s} {name:16s} exit {code}  "
                      + (f"{row['steps_per_s']:.2f} steps/s, {row['tokens_per_s']:.0f} tok/s on {row['device']}"
                         if code == 0 else "FAILED"), flush=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    failed = [r for r in summary["stages"] if r["exit_code"]] or (summary["tests"] or {}).get("exit_code")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
