"""Which processes of the test suite coverage measures (installed into the venv by scripts/test.sh).

Coverage follows every Python sub-process (`patch = subprocess`), at roughly 1.3-2x its CPU time. Two kinds
of process run untraced:
- ranks other than 0: they run the same code as rank 0. Their environment (and their children's) loses
  the coverage settings.
- `accelerate launch`, the launcher of a run's ranks: it runs none of the project's code. It skips coverage
  itself but hands the settings on to the ranks it starts (rank 0 is measured).

`before()` runs from a0_alignflow_coverage.pth, ahead of coverage's own a1_coverage.pth, and `after()` from
a2_alignflow_coverage.pth, once coverage has (or has not) started in this process.
"""

import os
import sys

KEYS = ("COVERAGE_PROCESS_CONFIG", "COVERAGE_PROCESS_START")
HELD = "ALIGNFLOW_COVERAGE_HELD"


def before() -> None:
    if os.environ.get("RANK", "0") != "0":
        for key in KEYS:
            os.environ.pop(key, None)
    elif "accelerate.commands.launch" in sys.orig_argv:
        held = {key: os.environ.pop(key) for key in KEYS if key in os.environ}
        if held:
            os.environ[HELD] = repr(held)


def after() -> None:
    held = os.environ.pop(HELD, None)
    if held:
        import ast

        os.environ.update(ast.literal_eval(held))
