"""Which processes of the test suite coverage measures (installed into the venv by scripts/test.sh).

Coverage follows every Python sub-process (`patch = subprocess`), at roughly 1.3-2x its CPU time. Two kinds
of process run untraced:
- ranks other than 0: they run the same code as rank 0. Their environment (and their children's) loses
  the coverage settings.
- `accelerate launch` started by hand (`alignflow train` runs the launcher in its own process): it runs none
  of the project's code. It skips coverage itself but hands the settings on to the ranks it starts (rank 0 is
  measured).

In a measured process, the imports of other packages (torch, transformers, datasets, ...) run untraced: tracing
them measures nothing (coverage's `source` is the project's own packages) and cost ~1.6 CPU-s of a training
process's ~2.3 CPU-s of coverage (imports alone, 2 runs each: 6.5 user CPU-s traced against 4.85 untraced).
Their code that runs later, called from the project's, is traced as before.

`before()` runs from a0_alignflow_coverage.pth, ahead of coverage's own a1_coverage.pth, and `after()` from
a2_alignflow_coverage.pth, once coverage has (or has not) started in this process.
"""

import os
import sys

KEYS = ("COVERAGE_PROCESS_CONFIG", "COVERAGE_PROCESS_START")
OWN = ("trainer", "components", "pipelines", "tests")  # packages whose imports stay traced
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
    if sys.gettrace() is not None:  # coverage started in this process
        _untraced_imports()


def _untraced_imports() -> None:
    """Run the import statements of other packages with this thread's tracer off (`sys.settrace` saves and
    restores it as a debugger would); imports of the project's own packages, and everything else, stay traced."""
    import builtins

    real = builtins.__import__

    def __import__(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002 (builtins' own names)
        tracer = sys.gettrace()
        if tracer is None or (name in sys.modules and not fromlist):
            return real(name, globals, locals, fromlist, level)
        package = ((globals or {}).get("__package__") or "") if level else name
        if package.partition(".")[0] in OWN:
            return real(name, globals, locals, fromlist, level)
        sys.settrace(None)
        try:
            return real(name, globals, locals, fromlist, level)
        finally:
            sys.settrace(tracer)

    builtins.__import__ = __import__
