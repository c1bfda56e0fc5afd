"""Start-up of the light commands: what a fresh process spends before it answers, here and at a baseline commit.

Each command runs in its own fresh Python process, as a pipeline task or a user's shell runs it, and the wall
time of the whole process is measured (interpreter, imports, the work). The commands:

- ``check-inputs``: the pipeline's first task, `components.inputs.check_parameters` on the demo pipeline's
  config (pipelines/configs/demo.yaml: every stage section, evaluation and the gate);
- ``train --help``: `alignflow train grpo --help`;
- ``python``: an empty interpreter, the floor under both.

``--baseline REV`` checks out REV into a temporary git worktree and runs the same commands there, alternating
with this checkout's, so both sides see the same machine load. Each row also says which heavy modules the
command loaded (torch, transformers, datasets).

    flock /tmp/alignflow-bench.lock python benchmarks/startup.py --baseline HEAD~3 --repeats 7
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import common
import yaml

HEAVY = ("torch", "transformers", "datasets")
DEMO_CONFIG = common.REPO / "pipelines" / "configs" / "demo.yaml"


def commands() -> dict[str, str]:
    """Command name -> the Python source a fresh process runs. Each prints which of HEAVY it loaded."""
    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    sections = {stage: demo.get(stage) or {} for stage in ("sft", "reward", "dpo", "grpo", "ppo")}
    check = ("from components import inputs\n"
             f"inputs.check_parameters({demo['algorithm']!r}, {sections!r}, {demo.get('evaluate') or {}!r}, "
             "{'max_steps': 0, 'learning_rate': 0.0, 'num_generations': 0}, "
             f"{demo['model_name']!r}, {demo.get('gate_metric', 'reward')!r}, 'auto')\n")
    help_ = ("import contextlib, io\nfrom trainer.cli.main import main\n"
             "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
             "    main(['train', 'grpo', '--help'])\n")
    loaded = f"import sys\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules) or '-')\n"
    return {"check-inputs": check + loaded, "train --help": help_ + loaded, "python": loaded}


def run(tree: Path, source: str) -> tuple[float, str]:
    """(wall seconds, heavy modules loaded) of one fresh process running `source` in `tree`."""
    env = common.bench_env(PYTHONPATH=str(tree))
    # -P: the working folder (this checkout) does not go before PYTHONPATH's tree on sys.path.
    child = common.run_child([sys.executable, "-P", "-c", source], env=env, timeout=300)
    if child.returncode:
        raise SystemExit(f"{source!r} failed in {tree} (exit {child.returncode}):\n{child.output[-2000:]}")
    return child.wall_s, child.output.strip().splitlines()[-1]


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--baseline", metavar="REV", help="Also run the commands at this git revision (a temporary "
                        "worktree), alternating with this checkout.")
    parser.add_argument("--repeats", type=int, default=5, help="Runs of each command on each side (default 5).")
    parser.add_argument("--json", type=Path, help="Write the runs and medians here.")
    args = parser.parse_args()

    started, load_before = common.clock(), os.getloadavg()[0]
    trees = {"this checkout": common.REPO}
    tmp = None
    if args.baseline:
        tmp = Path(tempfile.mkdtemp(prefix="startup-baseline-"))
        subprocess.run(["git", "-C", str(common.REPO), "worktree", "add", "--detach", "-q", str(tmp), args.baseline],
                       check=True)
        trees[f"baseline {args.baseline}"] = tmp
    try:
        sources = commands()
        runs = []
        for repeat in range(args.repeats):
            for command, source in sources.items():
                for side, tree in trees.items():
                    wall, loaded = run(tree, source)
                    runs.append({"command": command, "side": side, "repeat": repeat, "wall_s": wall,
                                 "loaded": loaded})
                    print(f"  {command:<13} {side:<22} {wall:6.2f} s  loaded: {loaded}", file=sys.stderr)
    finally:
        if tmp is not None:
            subprocess.run(["git", "-C", str(common.REPO), "worktree", "remove", "--force", str(tmp)], check=False)
            shutil.rmtree(tmp, ignore_errors=True)

    medians = {(m["command"], m["side"]): m for m in common.median_rows(runs, ("command", "side"))}
    walls: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        walls.setdefault((r["command"], r["side"]), []).append(r["wall_s"])
    loaded = {(r["command"], r["side"]): r["loaded"] for r in runs}
    common.print_header("Start-up of the light commands", f"{args.repeats} fresh processes each",
                        started, load_before)
    rows = [[*key, m["n"], m["wall_s"], min(walls[key]), max(walls[key]), loaded[key]] for key, m in medians.items()]
    print(common.format_table(["command", "tree", "n", "median s", "min s", "max s", "loaded"], rows))
    if args.baseline:
        print()
        ours_side, base_side = trees
        for command in sources:
            share = common.ratio(medians.get((command, ours_side)), medians.get((command, base_side)), "wall_s")
            print(f"{command}: {common.fmt(share)} of the baseline's median")
    if args.json:
        common.write_json(args.json, "startup", args, runs, list(medians.values()))


if __name__ == "__main__":
    main()
