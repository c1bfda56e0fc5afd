"""Preemption: SIGTERM or SIGINT stops a training run at the next step boundary with a checkpoint.

Kubernetes ends a pod (a preempted or spot node, a cancelled KFP task, a drained node) with SIGTERM,
then SIGKILL after the grace period (30 s by default). While a stage trains (`StageRunner.failing`),
`StopSignal` turns the first SIGTERM or SIGINT into a flag; the runner reads it at the next step
boundary (`StageRunner.maybe_save`, where every rank agrees on it through one all-reduce), writes the
same resumable step checkpoint a periodic save writes, and raises `Preempted`, which ends the process
with `PREEMPTED_EXIT_CODE`. A retry with `resume_from_checkpoint auto` continues from that checkpoint.

The signal also starts a watchdog: when the run has not stopped within `stop_budget_seconds` of the
signal (a long step, a slow upload, a ZeRO-3 gather of a large model), it prints one line and ends the
process with the same code before Kubernetes' SIGKILL can. A checkpoint it interrupts never gets its
completion marker (the marker is written under `commit`, which the watchdog waits for), so `auto` resumes
from the previous complete checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

# EX_TEMPFAIL of sysexits.h ("temporary failure; the user is invited to retry"): the run was stopped by a
# signal and a retry resumes it. Any other non-zero code is a failure of the run itself.
PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
    """The run stopped on a signal at a step boundary, its checkpoint saved; ends the process with exit code 75."""

    def __init__(self, message: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


class StopSignal:
    """While entered: the first SIGTERM / SIGINT sets `name` and starts the watchdog; later ones are ignored.

    Signal handlers can only be installed in the main thread; elsewhere (a stage run as a library call in
    a thread) the process keeps its own handling, and `name` stays None."""

    def __init__(self, budget_s: float, who: str) -> None:
        self.budget_s, self.who = budget_s, who
        self.name: str | None = None  # the signal received, e.g. "SIGTERM"
        self.received_at: float | None = None  # time.monotonic() when it came
        self.saved: str | None = None  # what a completed save during the stop wrote (for the watchdog's line)
        self._lock = threading.Lock()
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

    @property
    def requested(self) -> bool:
        return self.name is not None

    def elapsed(self) -> float:
        """Seconds since the signal (0 before one came)."""
        return time.monotonic() - self.received_at if self.received_at is not None else 0.0

    def agreed(self, name: str) -> None:
        """Another rank received the stop signal: this one stops too, and its watchdog runs from now."""
        if self.name is None:
            self._start(name)

    def _handle(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self.name is not None:
            log.warning("%s: %s received while already stopping on %s; still stopping.", self.who, name, self.name)
            return
        log.warning("%s: %s received: stopping at the end of this step with a checkpoint (within %.0f s).",
                    self.who, name, self.budget_s)
        self._start(name)

    def _start(self, name: str) -> None:
        self.name, self.received_at = name, time.monotonic()
        self._timer = threading.Timer(self.budget_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    @contextlib.contextmanager
    def commit(self) -> Iterator[None]:
        """Held while a checkpoint's completion marker is written: the watchdog cannot end the process
        halfway through it, so a checkpoint is either complete before the deadline or never marked."""
        with self._lock:
            yield

    def _expire(self) -> None:
        with self._lock:  # never in the middle of writing a completion marker
            if self.saved:
                line = (f"{self.who}: {self.saved}, but the run did not end within stop_budget_seconds="
                        f"{self.budget_s:g} of {self.name}; exiting with code {PREEMPTED_EXIT_CODE} now.")
            else:
                line = (f"{self.who}: no checkpoint could be written within stop_budget_seconds={self.budget_s:g} of "
                        f"{self.name} (the step or the save took longer); the previous complete checkpoint is left "
                        f"intact and `resume_from_checkpoint auto` continues from it. Raise `stop_budget_seconds` "
                        f"(and the pod's terminationGracePeriodSeconds) or save more often with `save_minutes`. "
                        f"Exit code {PREEMPTED_EXIT_CODE}.")
            print(line, file=sys.stderr, flush=True)
            os._exit(PREEMPTED_EXIT_CODE)
