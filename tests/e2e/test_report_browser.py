"""The KFP task report in a real browser: headless Chromium loads it without console errors.

Chromium logs every console message (script errors, and the Content-Security-Policy violations
that any attempt to fetch something from the page produces) to stderr as `CONSOLE` lines. Skipped
without Debian's `chromium` (`apt-get install -y chromium`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from components import report
from trainer.engine.completions import sample_rows

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
              pytest.mark.skipif(CHROMIUM is None,
                                 reason="headless Chromium is not installed (apt-get install -y chromium)")]

CONSOLE = re.compile(r":CONSOLE[:(]\d*\)?\] (.*)")


def load(page: Path, screenshot: Path) -> list[str]:
    """Load `page` in headless Chromium, write a screenshot; returns the console messages it logged."""
    done = subprocess.run([CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
                           "--enable-logging=stderr", "--v=0", "--window-size=1280,1600",
                           f"--user-data-dir={page.parent / 'chromium-profile'}", f"--screenshot={screenshot}",
                           "--virtual-time-budget=5000", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return [m.group(1) for line in done.stderr.splitlines() if (m := CONSOLE.search(line))]


def demo_report() -> report.Report:
    chat = [{"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples?"}]
    history = [{"step": s, "loss": 0.5 / s, "reward": 0.1 * s, "kl": 0.002 * s, "entropy": 3 - 0.1 * s,
                "completions/mean_length": 20.0 + s, "rewards/exact_answer/mean": 0.08 * s} for s in range(1, 21)]
    rows = sample_rows(20, [chat, chat], ["7 <b>apples</b>", "#### 7"], ["exact_answer", "answer_format"],
                       torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([1.0, 1.2]), torch.tensor([-0.7, 0.7]))
    return report.Report("grpo", "Group relative policy optimisation", history[-1], history, rows,
                         gate=report.Gate(True, "reward 2.0 beats the champion's 1.5 by 0.5 (>= 0)"),
                         mlflow_run_id="0123abcd", mlflow_url="http://mlflow.example:5000/#/experiments/1/runs/0123abcd")


def test_report_loads_without_console_errors(tmp_path):
    from PIL import Image

    page = tmp_path / "report.html"
    report.write(str(page), report.render(demo_report()))
    assert load(page, tmp_path / "report.png") == []
    image = Image.open(tmp_path / "report.png").convert("L")
    low, high = image.getextrema()
    assert high - low > 100, "the screenshot is blank"  # text and curves were drawn


def test_browser_check_catches_a_fetch_and_a_script(tmp_path):
    """The control: the same page with an external image and a script logs errors (the CSP blocks both),
    so the check above can fail."""
    page = tmp_path / "report.html"
    html = report.render(demo_report()).replace(
        "</body>", "<img src='http://example.invalid/x.png'><script>console.log('ran')</script></body>")
    page.write_text(html)
    messages = load(page, tmp_path / "report.png")
    assert any("example.invalid" in m for m in messages), messages
    assert any("script" in m.lower() for m in messages), messages
    assert not any("ran" == m.strip('"') for m in messages)  # the script did not run
