"""Data at scale: SFT preparation time, peak memory and the tokenized-data cache as the row count grows.

    flock /tmp/alignflow-bench.lock python benchmarks/data_scale.py --rows 50000,200000 --json data_scale.json

For each row count, synthetic prompt/completion rows (a few dozen words each, fixed seed) are written once as
JSON lines; then `alignflow train sft` on the tiny model (`model init-tiny`) runs 3 optimizer steps, twice,
each run its own process (`common.run_child`, so the peak RSS is that run's own):

- **first**: an empty `ALIGNFLOW_CACHE` and `HF_DATASETS_CACHE` (nothing tokenized, the JSON not yet in Arrow);
- **second**: the same caches, a new output folder (a second run, or a retried pipeline task).

Columns: wall seconds of the whole process; seconds from the process's start to the end of its first optimizer
step ("first step s": imports, loading, fingerprinting, tokenizing, packing, model loading and one step); peak
RSS (`ru_maxrss` of the child, MB); the size of the tokenized-data cache and of datasets' own cache (MB);
whether the second run logged "tokenized data from cache"; how many processes tokenized (`BuildWatcher`: the
cache's temporary build folders seen during the run). `--baseline-repo DIR` also runs the first run with another checkout's `trainer` (e.g. the
in-memory path before issue 27) on the same rows, marked `baseline`. `--ranks 2` adds a first run of
`alignflow train sft --num_processes 2` on an empty cache (its peak RSS is the largest process's: `wait4`'s
`ru_maxrss` covers the launcher's descendants; its first step is not stamped). `--trainers alignflow,trl` adds TRL
1.16's `SFTTrainer` on the same rows, model, batch, `max_length` and steps (TRL importable, e.g. `PYTHONPATH` of a
`pip install --target` folder; its first step is stamped by a callback).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import common

WORDS = ("the a of to and in is it that for on with as was at by an be this from or have not are but had "
         "they which one you were her all she there would their we him been has when who will more no if out "
         "so said what up its about into than them can only other new some could time these two may then do "
         "first any my now such like our over man me even most made after also did many before must through "
         "years where much your way well down should because each just those people how too little state good "
         "very make world still own see men work long get here between both life being under never day same "
         "another know while last might us great old year off come since against go came right used take three").split()

# The child: `trainer.stages.sft.train_step` wrapped to stamp the end of the first optimizer step.
CHILD = """
import json, os, sys, time
import trainer.stages.sft as sft
from trainer.cli.main import main
first = []
step = sft.train_step
def timed(*args, **kwargs):
    out = step(*args, **kwargs)
    first.append(time.time())
    return out
sft.train_step = timed
code = main(sys.argv[1:])
if code:
    sys.exit(code)
t0 = float(os.environ["BENCH_T0"])
with open(os.environ["BENCH_RESULT"], "w") as fh:
    json.dump({"first_step_s": first[0] - t0 if first else None, "trainer_file": sft.__file__}, fh)
"""


# TRL's SFTTrainer on the same rows: time to the end of its first optimizer step, from the process's start.
TRL_CHILD = """
import json, os, sys, time
import datasets, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer
model_path, data, out, batch = sys.argv[1:5]
first = []
class First(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        first.append(time.time())
rows = datasets.load_dataset("json", data_files=data, split="train")
tokenizer = AutoTokenizer.from_pretrained(model_path)
model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
config = SFTConfig(output_dir=out, max_steps=3, per_device_train_batch_size=int(batch), max_length=128,
                   completion_only_loss=True, use_cpu=True, logging_steps=1, save_strategy="no", report_to="none",
                   disable_tqdm=True, dataloader_num_workers=0)
SFTTrainer(model=model, args=config, train_dataset=rows, processing_class=tokenizer, callbacks=[First()]).train()
with open(os.environ["BENCH_RESULT"], "w") as fh:
    json.dump({"first_step_s": first[0] - float(os.environ["BENCH_T0"]), "trainer_file": sys.modules["trl"].__file__}, fh)
"""


class BuildWatcher(threading.Thread):
    """The tokenized-data cache entries built during a run: each build writes into a temporary folder of its own
    (`.<kind>-<key>.tmp-<id>`, trainer/data/token_cache.py) before renaming it, so distinct temporary folders
    count the processes that tokenized (a process that maps an existing entry makes none). Polled every 0.1 s."""

    def __init__(self, root: Path):
        super().__init__(daemon=True)
        self.root, self.seen, self._done = root, set(), threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.1):
            if self.root.exists():
                self.seen.update(p.name for p in self.root.glob(".*.tmp-*"))

    def stop(self) -> int:
        self._done.set()
        self.join()
        return len(self.seen)


def synthetic_rows(path: Path, rows: int, seed: int = 0) -> None:
    """`rows` prompt/completion rows of 30-50 and 10-20 random common words."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(rows):
            prompt = " ".join(rng.choices(WORDS, k=rng.randint(30, 50)))
            completion = " ".join(rng.choices(WORDS, k=rng.randint(10, 20)))
            fh.write(json.dumps({"prompt": f"Question {i}: {prompt}?", "completion": " " + completion}) + "\n")


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20 if path.exists() else 0.0


def train(trainer: str, repo: Path, model: Path, data: Path, out: Path, caches: Path, args) -> dict:
    env = common.child_env(args.threads, ALIGNFLOW_CACHE=str(caches / "alignflow"),
                           HF_DATASETS_CACHE=str(caches / "datasets"), BENCH_T0=repr(time.time()))
    env["PYTHONPATH"] = os.pathsep.join([str(repo), *filter(None, [os.environ.get("PYTHONPATH")])])
    options = ["--model", str(model), "--dataset", str(data), "--output_dir", str(out), "--max_steps", "3",
               "--per_device_batch_size", str(args.batch_size), "--max_length", "128", "--logging_steps", "1",
               "--num_sample_completions", "0", "--disable_progress_bar", "true"]
    if trainer == "trl":
        argv = [sys.executable, "-P", "-c", TRL_CHILD, str(model), str(data), str(out), str(args.batch_size)]
    elif trainer == "alignflow-2ranks":  # the ranks run `trainer.cli` themselves: no first-step stamp
        argv = [sys.executable, "-P", "-m", "trainer.cli", "train", "sft", *options, "--num_processes", "2"]
    else:  # -P: `trainer` from PYTHONPATH (repo), not the current folder
        argv = [sys.executable, "-P", "-c", CHILD, "train", "sft", *options]
    watcher = BuildWatcher(caches / "alignflow" / "tokenized")
    watcher.start()
    child = common.run_child(argv, env=env, timeout=args.timeout)
    builds = watcher.stop()
    ok = child.ok or (trainer == "alignflow-2ranks" and child.returncode == 0)
    if not ok:
        print(f"  FAILED (exit {child.returncode}):\n{child.output[-3000:]}", file=sys.stderr)
    return {"wall_s": child.wall_s, "first_step_s": (child.result or {}).get("first_step_s"),
            "peak_rss_mb": child.peak_rss_mb, "ok": ok, "trainer_file": (child.result or {}).get("trainer_file"),
            "tokenized_cache_mb": folder_mb(caches / "alignflow" / "tokenized"),
            "datasets_cache_mb": folder_mb(caches / "datasets"),
            "from_cache": "tokenized data from cache" in child.output,
            "tokenizing_processes": builds if trainer != "trl" else None}


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--rows", default="50000,200000", help="Comma-separated row counts.")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=1,
                        help="2: also a first run with 2 processes (alignflow train --num_processes 2).")
    parser.add_argument("--trainers", default="alignflow", help="alignflow, or alignflow,trl.")
    parser.add_argument("--baseline-repo", type=Path, default=None,
                        help="Another checkout whose `trainer` also runs the first run (e.g. before issue 27).")
    parser.add_argument("--work", type=Path, default=None, help="Working folder (default: a temporary one).")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    trainers = common.parse_list(args.trainers, ("alignflow", "trl"), "trainer")
    common.require_trl(trainers)
    started, load_before = common.clock(), __import__("os").getloadavg()[0]
    work = args.work or Path(tempfile.mkdtemp(prefix="data-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny"
    if not model.exists():
        common.run_child([sys.executable, "-m", "trainer.cli", "model", "init-tiny", "--out", str(model)],
                         env=common.child_env(args.threads))
    runs = []
    for rows in [int(n) for n in args.rows.split(",")]:
        data = work / f"rows-{rows}.jsonl"
        if not data.exists():
            synthetic_rows(data, rows)
        plans = [("alignflow", common.REPO, "first"), ("alignflow", common.REPO, "second")]
        if args.baseline_repo:
            plans.insert(0, ("baseline", args.baseline_repo, "first"))
        if args.ranks == 2:
            plans.append(("alignflow-2ranks", common.REPO, "first"))
        if "trl" in trainers:
            plans.append(("trl", common.REPO, "first"))
        for trainer, repo, which in plans:
            caches = work / f"caches-{trainer}-{rows}"
            if which == "first":
                shutil.rmtree(caches, ignore_errors=True)
            print(f"{rows} rows, {trainer}, {which} run ...", file=sys.stderr, flush=True)
            result = train(trainer, repo, model, data, work / f"out-{trainer}-{rows}-{which}", caches, args)
            runs.append({"rows": rows, "trainer": trainer, "run": which, **result})
            print(f"  {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    common.print_header("SFT data preparation at scale", f"tiny model, 3 steps, batch {args.batch_size}, "
                        f"max_length 128, {args.threads} threads", started, load_before)
    headers = ["rows", "trainer", "run", "wall s", "first step s", "peak RSS MB", "tokenized cache MB",
               "datasets cache MB", "from cache", "tokenizing processes"]
    print(common.format_table(headers, [[r["rows"], r["trainer"], r["run"], r["wall_s"], r["first_step_s"],
                                         r["peak_rss_mb"], r["tokenized_cache_mb"], r["datasets_cache_mb"],
                                         "yes" if r["from_cache"] else "no", r["tokenizing_processes"]]
                                        for r in runs]))
    if args.json:
        common.write_json(args.json, "data_scale", args, runs, [])


if __name__ == "__main__":
    main()
