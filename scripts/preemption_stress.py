"""Preemption stress run (issue 29; not a CI test): SIGTERM every stage again and again at random steps,
with periodic saves off, and check that each stop saves within its budget and that `auto` resumes exactly.

For each case (every stage on one process; SFT and GRPO also on two ranks, the signal going to the
`alignflow train --num_processes 2` launcher, whose torchrun agent passes it on to the ranks) an
uninterrupted run is the reference. Then episodes: one output folder, run with `resume_from_checkpoint
auto` and SIGTERMed 0-100 ms after it logs a step 1-3 steps past its newest checkpoint, again and again,
until it is too close to the end; a last run finishes it, and its weights and logged metrics are compared
with the reference (`tests.helpers.same_run`). Each stop must exit 75 with one new complete checkpoint.
Reports per case: stops, save seconds (from the trainer's own line: signal to checkpoint marked) and
signal-to-exit seconds (median, max), and exact episodes. docs/reliability.md quotes a run.

    OMP_WAIT_POLICY=PASSIVE python scripts/preemption_stress.py --stops 10 --json stress.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers import DEMO_DATA, prompts_file, same_run, stop_after_step  # noqa: E402
from trainer.engine import checkpoint as ckpt  # noqa: E402
from trainer.engine.preemption import PREEMPTED_EXIT_CODE  # noqa: E402

# Rank 0's (or the only process's) line: "trainer.engine.runner: sft[ rank 0]: stopped by SIGTERM after step 7/24; saved
# <dir>/checkpoint-7 in 0.05 s, ..."
SAVED = re.compile(r"trainer\.runner: \w+(?: rank 0)?: stopped by .+? after step (\d+)/\d+; saved \S+ in ([\d.]+) s")


def stage_args(stage: str, prompts: str, ranks: int) -> list[str]:
    """A short run whose global batch is the same on one process and on `ranks` ranks."""
    per = lambda n: str(n // ranks)  # noqa: E731
    if stage == "sft":
        data = ["--dataset", str(DEMO_DATA / "sft.jsonl"), "--num_sample_completions", "0", "--max_length", "128",
                "--per_device_batch_size", per(4)]
    elif stage in ("reward", "dpo"):
        data = ["--dataset", str(DEMO_DATA / "preferences.jsonl"), "--max_length", "128", "--per_device_batch_size",
                per(4)]
    else:
        data = ["--dataset", prompts, "--reward_funcs", "tests.helpers:target_frequency", "--max_completion_length",
                "8", "--max_prompt_length", "32", "--log_completions_steps", "0"]
        data += (["--num_generations", "4", "--per_device_batch_size", per(8)] if stage == "grpo" else
                 ["--batch_size", per(8), "--mini_batch_size", per(4), "--per_device_batch_size", per(4),
                  "--ppo_epochs", "1"])
    return [*data, "--num_processes", str(ranks), "--max_steps", "24", "--logging_steps", "1", "--save_steps", "0",
            "--disable_progress_bar", "true", "--seed", "5", "--learning_rate", "3e-3",
            "--resume_from_checkpoint", "auto"]


def train(args: list[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "trainer.cli", "train", *args, "--output_dir", str(out)]


def newest(out: Path) -> int:
    return max((step for step, _ in ckpt.list_checkpoints(str(out))), default=0)


def finish(out: Path, reference: Path, exact: int, worst: float, args: list[str], env: dict,
           skip_run: bool = False) -> tuple[int, float]:
    """Run an episode's folder to the end and compare it with the reference: (exact episodes, worst difference)."""
    if not skip_run:
        subprocess.run(train(args, out), cwd=ROOT, env=env, check=True, capture_output=True)
    try:
        difference = same_run(out, reference)
    except AssertionError as err:
        print(f"{out.name}: metrics differ from the reference: {err}", flush=True)
        difference = float("inf")
    return exact + (difference <= 1e-6), max(worst, difference)


def run_case(stage: str, ranks: int, stops: int, work: Path, model: str, prompts: str, env: dict) -> dict:
    args = [stage, "--model", model, *stage_args(stage, prompts, ranks)]
    reference = work / f"{stage}-{ranks}-reference"
    subprocess.run(train(args, reference), cwd=ROOT, env=env, check=True, capture_output=True)
    rng = random.Random(f"stress-{stage}-{ranks}")
    save_s, exit_s, episodes, exact, worst, misses = [], [], 0, 0, 0.0, 0
    out = None
    while len(save_s) + misses < stops:
        if out is None:
            out, episodes = work / f"{stage}-{ranks}-episode-{episodes}", episodes + 1
        target = newest(out) + rng.randint(1, 3)
        if target < 24 - 4:
            stopped = stop_after_step(train(args, out), target, env, delay=rng.uniform(0.0, 0.05))
            if stopped.code != PREEMPTED_EXIT_CODE and ckpt.is_complete(str(out)):
                print(f"{stage} x{ranks}: the run ended before the signal; episode over", flush=True)
                exact, worst, out = *finish(out, reference, exact, worst, args, env, skip_run=True), None
                continue
            assert stopped.code == PREEMPTED_EXIT_CODE, stopped.stderr[-3000:]
            found = SAVED.search(stopped.stderr)
            if found:
                save_s.append(float(found.group(2)))
                assert int(found.group(1)) == newest(out), "the stop's checkpoint is not the newest"
            else:  # the budget was missed: said in one line, the previous checkpoint left as the newest
                misses += 1
                print(stopped.stderr[-2000:], file=sys.stderr)
            exit_s.append(stopped.exit_s)
            print(f"{stage} x{ranks}: stop {len(save_s) + misses}/{stops} at step {newest(out)}, "
                  f"save {save_s[-1] if found else 'MISSED'} s, exit {stopped.exit_s:.2f} s", flush=True)
            continue
        exact, worst, out = *finish(out, reference, exact, worst, args, env), None
    if out is not None:  # finish the last episode too
        exact, worst = finish(out, reference, exact, worst, args, env)
    return {"stage": stage, "ranks": ranks, "stops": len(save_s) + misses, "budget_misses": misses,
            "episodes": episodes, "exact_episodes": exact, "max_weight_difference": worst,
            "save_s": {"median": statistics.median(save_s), "max": max(save_s)},
            "signal_to_exit_s": {"median": statistics.median(exit_s), "max": max(exit_s)}, "save_s_all": save_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stops", type=int, default=10, help="SIGTERMs per case (default 10).")
    parser.add_argument("--cases", default="sft:1,reward:1,dpo:1,grpo:1,ppo:1,sft:2,grpo:2",
                        help="stage:ranks pairs (default: every stage on 1 process, SFT and GRPO on 2 ranks).")
    parser.add_argument("--json", help="Write the figures here.")
    opts = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("MLFLOW_TRACKING_URI", None)
    results = []
    with tempfile.TemporaryDirectory(prefix="alignflow-stress-") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "trainer.cli", "model", "init-tiny", "--out", str(work / "tiny")],
                       cwd=ROOT, env=env, check=True, capture_output=True)
        prompts = prompts_file(work / "prompts.jsonl", n=32)
        for case in opts.cases.split(","):
            stage, ranks = case.split(":")
            started = time.monotonic()
            result = run_case(stage, int(ranks), opts.stops, work, str(work / "tiny"), prompts, env)
            result["wall_s"] = round(time.monotonic() - started)
            print(json.dumps({k: v for k, v in result.items() if k != "save_s_all"}), flush=True)
            results.append(result)
    every = [s for r in results for s in r["save_s_all"]]
    summary = {"stops": sum(r["stops"] for r in results), "exact_episodes": sum(r["exact_episodes"] for r in results),
               "episodes": sum(r["episodes"] for r in results), "save_s_median": statistics.median(every),
               "save_s_max": max(every), "signal_to_exit_s_max": max(r["signal_to_exit_s"]["max"] for r in results)}
    print(json.dumps(summary))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"cases": results, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
