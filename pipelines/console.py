"""The console of a local pipeline run (`alignflow pipeline run --local`): one line when a task
starts, one when it ends (duration, key metrics, the gate's verdict), a summary at the end; each
task's full log in OUTPUT/logs/<task>.log and kfp.local's own messages in OUTPUT/logs/pipeline.log.

kfp.local (SubprocessRunner) runs a task in a subprocess and `print`s its output line by line to
sys.stdout (kfp.local.subprocess_task_handler), so `TaskConsole` stands in for sys.stdout while
the DAG runs. It reports task starts, ends, outputs, cache hits, retries and skips with
`logging.info` on the root logger; a filter on the root logger takes those records (and only
those: by their source file under kfp/local) and keeps them from the console's handlers.
With `verbose`, every line still reaches the console as it comes.

Two kfp.local warnings are silenced (`quiet_kfp_warnings`), because they are always true here and say nothing:
- "settings [cpu_request, memory_limit, accelerator...] have no effect in the current local runner":
  the cluster resources that pipelines/kubernetes.py puts on every task;
- "custom or non-Python base image": SubprocessRunner(use_venv=False) runs every task with this
  checkout's interpreter, which is what the trainer image holds.
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from trainer.io.progress import format_duration

ANSI = re.compile(r"\x1b\[[0-9;]*m")
KFP_LOCAL = os.sep + os.path.join("kfp", "local") + os.sep
PIPELINE = re.compile(r"^Running pipeline: '([^']+)'")
START = re.compile(r"^Executing task '([^']+)'")
STREAMING = re.compile(r"^Streamed logs:")
END = re.compile(r"^Task '([^']+)' finished with status (SUCCESS|FAILURE)")
OUTPUTS = re.compile(r"^Task '([^']+)' (?:outputs:|has no outputs)")
CACHE_HIT = re.compile(r"^Task '?([\w.-]+)'? cache hit")
RETRY = re.compile(r"^Task '?([\w.-]+)'? failed \(attempt (\d+)/(\d+)\)\. Retrying in ([\d.]+)s")
# Shown after a task's duration, in this order, when its metrics artifact has them.
KEY_METRICS = ("reward", "accuracy", "loss", "rewards.margins", "win_rate", "kl")
MAX_KEY_METRICS = 3
FAILURE_TAIL = 15  # lines of a failed task's log shown on the console


@dataclass
class TaskRun:
    name: str
    log: Path
    started: float = field(default_factory=time.perf_counter)
    shown: bool = False  # its start line is on the console (importer tasks run no subprocess: never shown)
    status: str = ""
    pending: list[str] = field(default_factory=list)  # kfp.local's lines about it, until its subprocess starts


@dataclass
class Summary:
    """What the run's console summary needs: each task's outputs and the gate's verdict."""

    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed: str = ""
    failed_log: Path | None = None


def parse_outputs(message: str) -> dict[str, Any]:
    """kfp.local's `Task 'x' outputs:` record -> {name: value, or {"uri": ..., "metadata": {...}} for an artifact}."""
    out: dict[str, Any] = {}
    current = None
    for line in message.splitlines()[1:]:
        if m := re.match(r"^ {4}([\w-]+): (\w+)\( name='[^']*',\s*$", line):  # an artifact's first line
            current = out[m.group(1)] = {"type": m.group(2)}
        elif (m := re.match(r"^ {4}([\w-]+): (.*)$", line)) and not line.startswith(" " * 5):
            current = None
            try:
                out[m.group(1)] = ast.literal_eval(m.group(2))
            except (ValueError, SyntaxError):
                out[m.group(1)] = m.group(2)
        elif current is not None and (m := re.match(r"^\s+uri='(.*)',$", line)):
            current["uri"] = m.group(1)
        elif current is not None and (m := re.match(r"^\s+metadata=(\{.*\}) \)$", line)):
            try:
                current["metadata"] = ast.literal_eval(m.group(1))
            except (ValueError, SyntaxError):
                current["metadata"] = {}
    return out


def describe_outputs(task: str, outputs: dict[str, Any]) -> str:
    """The key numbers of a finished task: `loss=0.41`; `reward=0.62 accuracy=0.5, gate passed`."""
    artifact = outputs.get("metrics")
    metrics = artifact.get("metadata", {}) if isinstance(artifact, dict) else {}
    shown = [f"{k}={metrics[k]:.3g}" for k in KEY_METRICS if isinstance(metrics.get(k), int | float)]
    text = " ".join(shown[:MAX_KEY_METRICS])
    verdict = outputs.get("Output")
    if isinstance(verdict, bool):  # the evaluate task returns whether the candidate passes the gate
        text += (", " if text else "") + ("gate passed" if verdict else "gate failed")
    elif task.startswith("promote") and verdict is not None:  # promote returns the version it registered
        text += f"registered version {verdict}"
    return text


class TaskConsole(io.TextIOBase):
    """sys.stdout while kfp.local runs the DAG: routes each line to its task's log file, prints the task lines."""

    def __init__(self, log_dir: Path, console: TextIO, verbose: bool = False) -> None:
        self.log_dir, self.console, self.verbose = log_dir, console, verbose
        log_dir.mkdir(parents=True, exist_ok=True)
        self.pipeline_log = (log_dir / "pipeline.log").open("a", encoding="utf-8")
        self.tasks: dict[int, TaskRun] = {}  # by thread: kfp.local runs a ParallelFor's tasks in threads
        self.files: dict[Path, TextIO] = {}
        self.partial: dict[int, str] = {}
        self.summary = Summary()
        self.lock = threading.RLock()

    # --- what kfp.local prints (task output) ----------------------------------------------------

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        with self.lock:
            me = threading.get_ident()
            lines = (self.partial.pop(me, "") + text).split("\n")
            if lines[-1]:
                self.partial[me] = lines[-1]
            for line in lines[:-1]:
                self._task_line(line)
        return len(text)

    def flush(self) -> None:
        with self.lock:
            for fh in (*self.files.values(), self.pipeline_log):
                fh.flush()
            self.console.flush()

    def _task_line(self, line: str) -> None:
        if self.verbose:
            self.console.write(line + "\n")
        plain = ANSI.sub("", line)
        if not plain.strip() or set(plain.strip()) == {"-"}:  # kfp.local's blank lines and rules between tasks
            return
        task = self.tasks.get(threading.get_ident())
        target = self._file(task.log) if task else self.pipeline_log
        target.write(plain[4:] if plain.startswith("    ") else plain)  # kfp.local indents task output by 4
        target.write("\n")

    def _file(self, path: Path) -> TextIO:
        if path not in self.files:
            self.files[path] = path.open("a", encoding="utf-8")
        return self.files[path]

    # --- what kfp.local logs (task starts and ends) ----------------------------------------------

    def record(self, record: logging.LogRecord) -> None:
        """One of kfp.local's log records: into pipeline.log (and the task's log), and a console line when it
        starts or ends a task."""
        with self.lock:
            message = ANSI.sub("", record.getMessage())
            stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
            self.pipeline_log.write(f"{stamp} {record.levelname} {message}\n")
            if self.verbose:
                self.console.write(f"{stamp} {record.levelname} {message}\n")
            me = threading.get_ident()
            if m := START.match(message):
                self.tasks[me] = TaskRun(m.group(1), self.log_dir / f"{m.group(1)}.log")
            task = self.tasks.get(me)
            if task and not task.shown:
                task.pending.append(f"{stamp} {record.levelname} {message}\n")
            elif task:
                self._file(task.log).write(f"{stamp} {record.levelname} {message}\n")
            if m := PIPELINE.match(message):
                self._say(f"pipeline {m.group(1)}: each task's full log goes to {self.log_dir}/<task>.log")
            elif task and STREAMING.match(message):
                task.shown, task.started = True, time.perf_counter()
                self._file(task.log).writelines(task.pending)
                task.pending.clear()
                self._say(f"{task.name}: started")
            elif task and (m := END.match(message)):
                task.status = m.group(2)
                if task.status == "FAILURE":
                    self._failed(task)
                    del self.tasks[me]  # what follows (a retry, skipped tasks) is kfp.local's, not the task's
            elif task and (m := OUTPUTS.match(message)) and task.status == "SUCCESS":
                outputs = parse_outputs(message)
                self.summary.outputs[task.name] = outputs
                if task.shown:
                    numbers = describe_outputs(task.name, outputs)
                    self._say(f"{task.name}: done in {format_duration(time.perf_counter() - task.started)}"
                              + (f", {numbers}" if numbers else ""))
                del self.tasks[me]
            elif m := CACHE_HIT.match(message):
                self._say(f"{m.group(1)}: cached (outputs of an earlier run reused)")
            elif m := RETRY.match(message):
                self._say(f"{m.group(1)}: retrying in {float(m.group(4)):.0f}s (attempt {int(m.group(2)) + 1} of "
                          f"{m.group(3)}; resumes from its newest checkpoint)")

    def _failed(self, task: TaskRun) -> None:
        self.summary.failed, self.summary.failed_log = task.name, task.log
        self._file(task.log).writelines(task.pending)
        task.pending.clear()
        self._say(f"{task.name}: FAILED after {format_duration(time.perf_counter() - task.started)}; the end of "
                  f"{task.log}:")
        self._file(task.log).flush()
        if not self.verbose:
            lines = [ln for ln in task.log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
            for line in lines[-FAILURE_TAIL:]:
                self.console.write(f"    {line[:300]}\n")

    def _say(self, text: str) -> None:
        self.console.write(f"[{time.strftime('%H:%M:%S')}] {text}\n")
        self.console.flush()

    def close(self) -> None:
        with self.lock:
            for me in list(self.partial):
                tail = self.partial.pop(me)
                self._task_line(tail)
            super().close()  # flushes
            for fh in (*self.files.values(), self.pipeline_log):
                fh.close()


class _KfpRecords(logging.Filter):
    """On the root logger: kfp.local's own records go to the TaskConsole instead of the console's handlers."""

    def __init__(self, console: TaskConsole) -> None:
        super().__init__()
        self.target = console

    def filter(self, record: logging.LogRecord) -> bool:
        if KFP_LOCAL not in record.pathname:
            return True
        self.target.record(record)
        return False


@contextlib.contextmanager
def quiet_kfp_warnings() -> Iterator[None]:
    """Silence the two kfp.local warnings that are always true for this pipeline (see the module doc)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Task '.*': settings \[.*\] have no effect in the current local "
                                                  r"runner", category=UserWarning)
        warnings.filterwarnings("ignore", message=r"You may be attemping to run a task that uses custom or "
                                                  r"non-Python base image", category=RuntimeWarning)
        yield


@contextlib.contextmanager
def task_console(log_dir: Path, verbose: bool = False) -> Iterator[TaskConsole]:
    """Route kfp.local's output into per-task log files for the duration of a local run."""
    console = TaskConsole(log_dir, sys.stdout, verbose)
    records = _KfpRecords(console)
    root = logging.getLogger()
    root.addFilter(records)
    try:
        with quiet_kfp_warnings(), contextlib.redirect_stdout(console):
            yield console
    finally:
        root.removeFilter(records)
        console.close()
