"""Helpers every benchmark shares: a measured child process, medians and a results table.

Each measured run is its own process so that its peak memory is its own: `run_child` waits
for the child with `os.wait4`, whose resource usage (peak RSS included) covers that child
alone. The child reports its numbers as JSON with `write_result`. Benchmarks import this as
`from common import ...` when run as `python benchmarks/<name>.py`.

Run benchmarks one at a time on a shared machine (`flock /tmp/alignflow-bench.lock python ...`):
two at once slow each other down and the numbers mean nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULT_ENV = "BENCH_RESULT"  # where a child writes its JSON result


def bench_env(threads: int = 2, **extra: str) -> dict[str, str]:
    """The environment for a measured child: fixed thread count, passive OpenMP waits, no hub."""
    env = dict(os.environ)
    env.update(
        OMP_WAIT_POLICY="PASSIVE",  # busy-waiting threads make 2-thread runs 10-30x slower on a shared box
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.update(extra)
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


def median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


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
