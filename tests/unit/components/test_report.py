"""The KFP task reports (components/report.py) and the completions tables (trainer/engine/completions.py)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import torch

from components import report, runtime
from trainer.engine.completions import chat_text, completions_table, flat_sample, sample_rows

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def grpo_history(steps: int = 5) -> list[dict]:
    return [{"step": s, "loss": 1.0 / s, "reward": 0.1 * s, "kl": 0.01 * s, "entropy": 2.0 - 0.1 * s,
             "completions/mean_length": 10.0 + s, "rewards/fmt/mean": 0.2 * s, "learning_rate": 1e-5}
            for s in range(1, steps + 1)]


def test_chat_prompts_become_role_lines():
    assert chat_text(CHAT) == "system: Be brief.\nuser: What is 2+2?"
    assert chat_text("plain text") == "plain text"


def test_completions_table_has_a_column_per_reward_function_and_the_advantage():
    per_func = torch.tensor([[1.0, 0.5], [float("nan"), 0.0], [0.0, 0.0]])  # [N=3, F=2]; NaN: not scored
    rows = sample_rows(7, [CHAT, CHAT, "text prompt"], ["4", "5", "x"], ["accuracy", "fmt"], per_func,
                       torch.tensor([1.5, 0.0, 0.0]), torch.tensor([0.9, -0.3, -0.6]), limit=2)
    table = completions_table(rows)
    assert list(table) == ["step", "prompt", "completion", "rewards/accuracy", "rewards/fmt", "reward", "advantage"]
    assert table["prompt"] == ["system: Be brief.\nuser: What is 2+2?"] * 2  # text, not a repr of a list
    assert table["rewards/accuracy"] == [1.0, None]  # an unscored completion is empty, not NaN
    assert table["advantage"] == [0.8999999761581421, -0.30000001192092896]
    json.dumps(table, allow_nan=False)  # what MLflow stores


def test_evaluation_samples_flatten_their_rewards():
    record = {"prompt": CHAT, "completion": "4", "rewards": {"accuracy": 1.0}, "reward": 1.0, "win": 1.0}
    assert flat_sample(record) == {"prompt": CHAT, "completion": "4", "reward": 1.0, "win": 1.0, "rewards/accuracy": 1.0}
    assert completions_table([record])["rewards/accuracy"] == [1.0]


def test_report_leads_with_headline_metrics_and_draws_the_curves():
    metrics = {"zeta": 3.0, "loss": 0.25, "kl": 0.05, "reward": 0.75, "learning_rate": 1e-5, "win_rate": 0.6}
    page = report.render(report.Report("grpo", "Group relative policy optimisation", metrics, grpo_history()))
    labels = [label for _, label, _ in report.headline_metrics(metrics)]
    assert labels == ["reward", "KL", "loss", "win rate"]
    cards = page.index("class='cards'")
    assert cards < page.index("<h2>Training curves")
    titles = re.findall(r"<svg[^>]*><title>([^<]+)</title>", page)
    assert titles == ["Reward", "Loss", "KL", "Completion length (tokens)", "Entropy"]
    assert "rewards/fmt/mean" in page  # the per-function reward is a line of the reward chart
    assert "All final metrics (6)" in page


def test_samples_render_as_chat_with_one_column_per_reward():
    rows = sample_rows(3, [CHAT], ["<b>4</b>"], ["accuracy", "fmt"], torch.tensor([[1.0, 0.0]]),
                       torch.tensor([1.0]), torch.tensor([0.5]))
    page = report.render(report.Report("grpo", samples=rows))
    header = re.search(r"<tr>(<th>.*?)</tr>", page).group(1)
    assert re.findall(r"<th>([^<]+)</th>", header) == ["step", "prompt", "completion", "rewards/accuracy",
                                                       "rewards/fmt", "reward", "advantage"]
    assert "<span class='role'>user</span>What is 2+2?" in page
    assert "{&#x27;role&#x27;" not in page and "{'role'" not in page  # no Python repr of the messages
    assert "&lt;b&gt;4&lt;/b&gt;" in page  # model output is escaped, never markup


def test_gate_verdict_and_mlflow_link():
    passed = report.render(report.Report("evaluate", gate=report.Gate(True, "reward 0.8 > 0.7"), mlflow_run_id="abc",
                                         mlflow_url="http://mlflow:5000/#/experiments/1/runs/abc"))
    assert "Gate passed: <span>reward 0.8 &gt; 0.7</span>" in passed
    assert "href='http://mlflow:5000/#/experiments/1/runs/abc'" in passed
    failed = report.render(report.Report("evaluate", gate=report.Gate(False, "no champion"), mlflow_run_id="abc"))
    assert "banner fail'>Gate not passed" in failed and "<code>abc</code>" in failed


def test_report_is_self_contained():
    page = report.render(report.Report("grpo", "x", {"reward": 1.0}, grpo_history(),
                                       sample_rows(1, [CHAT], ["4"], ["a"], torch.ones(1, 1), torch.ones(1)),
                                       mlflow_run_id="r", mlflow_url="http://mlflow/#/experiments/0/runs/r"))
    assert "<script" not in page
    # The only URLs: the SVG namespace and the MLflow link (nothing to fetch on an offline cluster).
    assert set(re.findall(r"https?://[^'\" ]+", page)) == {"http://www.w3.org/2000/svg", "http://mlflow/#/experiments/0/runs/r"}


def test_chart_of_a_constant_series_has_a_range():
    svg = report.svg_chart("flat", {"kl": [(1, 0.0), (2, 0.0)]})
    assert "nan" not in svg.lower() and "inf" not in svg.lower()


def test_mlflow_url_leaves_credentials_out(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://user:secret@mlflow.ns:5000/")
    client = SimpleNamespace(get_run=lambda run_id: SimpleNamespace(info=SimpleNamespace(experiment_id="4")))
    monkeypatch.setattr(runtime, "_client", lambda: client)
    assert runtime.mlflow_run_url("r1") == "http://mlflow.ns:5000/#/experiments/4/runs/r1"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    assert runtime.mlflow_run_url("r1") == ""  # no UI to link to


def test_evaluate_report_shows_samples_with_reward_columns(tmp_path):
    # As trainer.stages.evaluate writes it: the weighted reward before the per-function ones.
    (tmp_path / "samples.jsonl").write_text(json.dumps({"prompt": CHAT, "completion": "4", "reward": 1.0,
                                                       "rewards": {"accuracy": 1.0}}) + "\n")
    page = report.render(runtime.evaluate_report({"reward": 1.0}, str(tmp_path), False, "no champion yet", ""))
    assert "Gate not passed" in page
    assert re.findall(r"<th>([^<]+)</th>", page)[:4] == ["prompt", "completion", "rewards/accuracy", "reward"]
