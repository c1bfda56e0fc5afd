"""Progress on the console: a tqdm bar on a terminal, periodic plain log lines elsewhere (KFP pod
logs, CI, a piped run), each with an ETA. Used by the training loop (one line per logging step),
evaluation's generation and object-store transfers (a line every `PERIOD_S` seconds or
`PERCENT_STEP` % of the work).

A step line puts the numbers a reader scans for first (loss or reward, KL, learning rate), then
the rest in the stage's own order, cut at `STEP_LINE_WIDTH` characters; every metric still goes
to MLflow and the model's metrics.jsonl.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

log = logging.getLogger(__name__)

STEP_LINE_WIDTH = 160
PERIOD_S = 30.0  # a plain progress line at least this often...
PERCENT_STEP = 25  # ...or every time this much more of the work is done
# The numbers read first, in this order (KL under the names GRPO, PPO and evaluation log it).
KEY_METRICS = ("loss", "reward", "kl", "objective/kl", "learning_rate")
SHORT_NAMES = {"learning_rate": "lr", "objective/kl": "kl"}
# Next, when the stage logs them; then the rest in the stage's order.
SECONDARY_METRICS = ("eval_loss", "eval_reward", "accuracy", "rewards/margins", "rewards/accuracies", "reward_std",
                     "grad_norm", "entropy", "completions/mean_length", "epoch")
# Not shown on the step line (timing/*, rank spreads, token counts: MLflow has them).
HIDDEN_PREFIXES = ("timing/", "num_tokens", "step_time")


def format_duration(seconds: float) -> str:
    """A compact duration: 42s, 3m05s, 2h14m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def eta_seconds(done: float, total: float, elapsed: float) -> float | None:
    """Seconds left at the rate so far; None before any work is done."""
    if done <= 0 or elapsed <= 0:
        return None
    return max(0.0, (total - done) * elapsed / done)


def _number(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def format_step_line(step: int, total: int, metrics: dict[str, float], elapsed: float, eta: float | None,
                     width: int = STEP_LINE_WIDTH) -> str:
    """`step 12/200 loss=0.412 kl=0.013 lr=1e-05 | grad_norm=1.2 ... | 1m02s, ETA 14m30s`, at most `width` chars.

    Key metrics (`KEY_METRICS`) come first, then `SECONDARY_METRICS`, then the others in their given
    order; metrics that do not fit are dropped and counted (`+5 more`). The step count and the ETA
    are always kept."""
    head = f"step {step}/{total}"
    tail = f"| {format_duration(elapsed)}, ETA {format_duration(eta) if eta is not None else '?'}"
    keys = [k for k in KEY_METRICS if k in metrics]
    rest = [k for k in SECONDARY_METRICS if k in metrics]
    rest += [k for k in metrics if k not in keys and k not in rest and not k.startswith(HIDDEN_PREFIXES)]
    items = [f"{SHORT_NAMES.get(k, k)}={_number(metrics[k])}" for k in keys]
    others = [f"{k}={_number(metrics[k])}" for k in rest]
    items += ["|", *others] if items and others else others
    shown, used = [], len(head) + 1 + len(tail)
    for i, item in enumerate(items):
        left = sum(1 for it in items[i + 1:] if it != "|")  # room for "+N more" if the next ones do not fit
        if used + 1 + len(item) + (len(f" +{left} more") if left else 0) > width:
            shown.append(f"+{sum(1 for it in items[i:] if it != '|')} more")
            break
        shown.append(item)
        used += 1 + len(item)
    if shown and shown[-1] == "|":
        shown.pop()
    return " ".join([head, *shown, tail])[:width]


def is_terminal() -> bool:
    return sys.stderr.isatty()


class Reporter:
    """Progress of one piece of work (`total` units): a tqdm bar on a terminal, otherwise a log line
    `<desc>: 12/40 <unit> (30%), 1m02s, ETA 2m25s` every `PERIOD_S` seconds or `PERCENT_STEP` %, and at the end."""

    def __init__(self, total: float, desc: str, unit: str = "it", disable: bool = False,
                 bytes_: bool = False, logger: logging.Logger | None = None) -> None:
        self.total, self.desc, self.unit, self.bytes = total, desc, unit, bytes_
        self.done = 0.0
        self.log = logger or log
        self.start = time.perf_counter()
        self._last_time, self._last_percent = self.start, 0.0
        self.bar = None
        self.disabled = disable
        if not disable and is_terminal():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="B" if bytes_ else unit, unit_scale=bytes_,
                            unit_divisor=1024, dynamic_ncols=True, leave=False)

    def _amount(self, value: float) -> str:
        return f"{value / 2**20:.1f}" if self.bytes else f"{value:.0f}"

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        eta = eta_seconds(self.done, self.total, elapsed)
        percent = 100 * self.done / self.total if self.total else 100.0
        unit = "MiB" if self.bytes else self.unit
        return (f"{self.desc}: {self._amount(self.done)}/{self._amount(self.total)} {unit} ({percent:.0f}%), "
                f"{format_duration(elapsed)}, ETA {format_duration(eta) if eta is not None else '?'}")

    def update(self, amount: float = 1) -> None:
        self.done += amount
        if self.bar is not None:
            self.bar.update(amount)
            return
        if self.disabled or not self.total:
            return
        now, percent = time.perf_counter(), 100 * self.done / self.total
        if self.done < self.total and (now - self._last_time >= PERIOD_S
                                       or percent - self._last_percent >= PERCENT_STEP):
            self._last_time, self._last_percent = now, percent
            self.log.info("%s", self.line())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif not self.disabled and self.total and self.done >= self.total:
            self.log.info("%s", self.line())

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


class Progress:
    """A training run's progress: a tqdm bar on a terminal (key metrics in its postfix, tqdm's own
    ETA), and a `format_step_line` log line at every logging step everywhere else (KFP logs, CI)."""

    def __init__(self, total: int, initial: int, desc: str, disable: bool = False) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True,
                        disable=disable or not is_terminal())
        self.start = time.perf_counter()
        self.initial, self.total = initial, total

    def update(self, step: int, metrics: dict[str, float] | None = None) -> None:
        self.bar.update(step - self.bar.n)
        if metrics:
            shown = {SHORT_NAMES.get(k, k): f"{metrics[k]:.3g}" for k in KEY_METRICS if k in metrics}
            self.bar.set_postfix(shown, refresh=False)
            if self.bar.disable:
                elapsed = time.perf_counter() - self.start
                eta = eta_seconds(step - self.initial, self.total - self.initial, elapsed)
                log.info("%s", format_step_line(step, self.total, metrics, elapsed, eta))

    def close(self) -> None:
        self.bar.close()
