"""Progress lines: the step line's order, ETA and width cap; periodic plain lines off a terminal."""

import logging
import re

from trainer.io import progress
from trainer.io.progress import Progress, Reporter, eta_seconds, format_duration, format_step_line

# What a GRPO step logs (trainer/stages/rl/grpo.py cycle_metrics + update stats + timings + the runner's extras).
GRPO_METRICS = {
    "grad_norm": 0.8123, "clip_ratio/region_mean": 0.0, "entropy": 3.2188, "reward_std": 0.43, "reward": 0.5625,
    "frac_reward_zero_std": 0.25, **{f"rewards/{f}/{s}": 0.5 for f in ("exact_answer", "answer_format", "judge")
                                     for s in ("mean", "std")},
    "completions/mean_length": 23.5, "completions/min_length": 7.0, "completions/max_length": 24.0,
    "completions/clipped_ratio": 0.75, "timing/generate": 3.2, "timing/score": 0.01, "timing/update": 4.4,
    "timing/sync": 0.3, "step_time": 8.1, "loss": 0.0123, "kl": 0.0042, "learning_rate": 9.5e-5,
    "num_tokens": 12345.0,
}


def test_step_line_puts_loss_reward_kl_lr_first_and_ends_with_the_eta():
    line = format_step_line(12, 200, GRPO_METRICS, elapsed=62.0, eta=870.0)
    assert line.startswith("step 12/200 loss=0.0123 reward=0.562 kl=0.0042 lr=9.5e-05 | reward_std=0.43 grad_norm=0.812 "
                           "entropy=3.22 "), line
    assert line.endswith("| 1m02s, ETA 14m30s"), line
    assert "timing/" not in line and "num_tokens" not in line  # MLflow has those; the line does not


def test_step_line_is_capped_and_counts_what_it_left_out():
    line = format_step_line(12, 200, GRPO_METRICS, elapsed=62.0, eta=870.0)
    assert len(line) <= progress.STEP_LINE_WIDTH, len(line)
    shown = len(re.findall(r"\S+=", line))
    hidden = int(re.search(r"\+(\d+) more", line).group(1))
    visible_keys = [k for k in GRPO_METRICS if not k.startswith(progress.HIDDEN_PREFIXES)]
    assert shown + hidden == len(visible_keys)
    narrow = format_step_line(3, 10, GRPO_METRICS, 5.0, 10.0, width=70)
    assert len(narrow) <= 70 and narrow.startswith("step 3/10 loss=") and narrow.endswith("ETA 10s"), narrow


def test_a_short_step_line_is_whole_and_the_eta_is_unknown_before_any_step():
    assert format_step_line(1, 3, {"loss": 1.5, "epoch": 0.25}, 0.4, None) == "step 1/3 loss=1.5 | epoch=0.25 | 0s, ETA ?"


def test_eta_and_durations():
    assert eta_seconds(0, 10, 5.0) is None
    assert eta_seconds(2, 10, 4.0) == 16.0
    assert [format_duration(s) for s in (0.4, 59, 61, 3599, 7260)] == ["0s", "59s", "1m01s", "59m59s", "2h01m"]


def test_training_progress_logs_a_step_line_with_eta_off_a_terminal(caplog):
    bar = Progress(total=4, initial=2, desc="sft")  # resumed at step 2: the ETA counts only this run's steps
    with caplog.at_level(logging.INFO, logger="trainer.io.progress"):
        bar.update(3, {"loss": 0.5, "learning_rate": 1e-4})
    bar.close()
    (line,) = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(r"step 3/4 loss=0\.5 lr=0\.0001 \| \d+s, ETA \d+s", line), line


def test_reporter_logs_every_quarter_and_at_the_end_off_a_terminal(caplog, monkeypatch):
    monkeypatch.setattr(progress, "PERIOD_S", 3600.0)
    with caplog.at_level(logging.INFO, logger="trainer.io.progress"), Reporter(8, "generating", unit="prompts") as r:
        for _ in range(8):
            r.update()
    lines = [rec.getMessage() for rec in caplog.records]
    assert [re.match(r"generating: (\d+)/8 prompts \((\d+)%\), \d+s, ETA ", ln).groups() for ln in lines] == [
        ("2", "25"), ("4", "50"), ("6", "75"), ("8", "100")], lines


def test_reporter_logs_after_the_period_even_below_a_quarter(caplog):
    with caplog.at_level(logging.INFO, logger="trainer.io.progress"):
        r = Reporter(100 * 2**20, "upload s3://b/m", bytes_=True)
        r.update(2**20 // 2)  # 0.5% just now: nothing yet
        r.start -= 40.0  # as if it had started 40 s ago...
        r._last_time = r.start
        r.update(2**20 // 2)  # ...so 1% gets a line: more than PERIOD_S passed
    lines = [rec.getMessage() for rec in caplog.records]
    assert len(lines) == 1 and re.fullmatch(r"upload s3://b/m: 1\.0/100\.0 MiB \(1%\), 40s, ETA 1h06m", lines[0]), lines
