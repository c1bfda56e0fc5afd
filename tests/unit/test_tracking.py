"""Tracker against an embedded sqlite MLflow store, and its helpers."""

from __future__ import annotations

import json
import logging

import pytest

from trainer.config import TrainConfig
from trainer.tracking import Tracker, flatten_params, mlflow_key


def _config(uri: str | None, **overrides) -> TrainConfig:
    return TrainConfig(model="tiny", dataset="demo", mlflow_tracking_uri=uri, **overrides)


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    # One database per module: creating MLflow's tables takes a few seconds.
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'store' / 'mlflow.db'}"


def test_flatten_params_makes_strings():
    assert flatten_params({"a": {"b": 1}, "c": [1, "x"], "d": None, "e": 2e-5}) == {
        "a.b": "1", "c": '[1, "x"]', "d": "None", "e": "2e-05"}
    assert len(flatten_params({"long": "x" * 10_000})["long"]) == 6000


@pytest.mark.parametrize(("key", "expected"), [
    ("rewards/chosen", "rewards/chosen"),
    ("clip_ratio/low_mean", "clip_ratio/low_mean"),
    ("rewards/my_pkg.rewards:accuracy/mean", "rewards/my_pkg.rewards:accuracy/mean"),
    ("reward (mean)", "reward _mean_"),
    ("/a//b/../c/", "a/b/c"),
])
def test_mlflow_key(key, expected):
    assert mlflow_key(key) == expected


def test_without_uri_only_history(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker(_config(None), stage="sft")
    tracker.log_metrics({"loss": 1.5, "entropy": None}, step=1)
    tracker.log_text("hello", "a.txt")
    tracker.finish()
    assert tracker.run_id is None and not tracker.active
    assert tracker.history == [{"step": 1, "loss": 1.5}]


def test_embedded_sqlite_run(sqlite_uri, tmp_path_factory):
    config = _config(sqlite_uri, mlflow_experiment="unit", mlflow_run_name="r1", mlflow_tags=["team=align"])
    with Tracker(config, stage="dpo") as tracker:
        for step in range(3):
            tracker.log_metrics({"loss": 1.0 / (step + 1), "rewards/chosen": step * 0.5}, step=step)
        tracker.log_dict({"stage": "dpo"}, "alignflow.json")
        tracker.log_table({"prompt": ["a", "b"], "completion": ["c", "d"]}, "samples.json")
    assert tracker.active

    from mlflow import MlflowClient

    client = MlflowClient(sqlite_uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    assert run.data.params["learning_rate"] == "2e-05"
    assert run.data.params["lora_target_modules"] == '["all-linear"]'
    assert run.data.tags["alignflow.stage"] == "dpo" and run.data.tags["team"] == "align"
    history = client.get_metric_history(tracker.run_id, "rewards/chosen")
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (1, 0.5), (2, 1.0)]
    assert {a.path for a in client.list_artifacts(tracker.run_id)} == {"alignflow.json", "samples.json"}
    # Artifacts sit next to the database, not under the working folder.
    assert run.info.artifact_uri.startswith(f"file://{sqlite_uri[len('sqlite:///'):].rsplit('/', 1)[0]}/mlartifacts")
    local = client.download_artifacts(tracker.run_id, "alignflow.json", str(tmp_path_factory.mktemp("dl")))
    assert json.load(open(local)) == {"stage": "dpo"}
    assert len(tracker.history) == 3


def test_failure_mid_run_warns_once_and_keeps_history(sqlite_uri, caplog):
    tracker = Tracker(_config(sqlite_uri, mlflow_experiment="unit"), stage="grpo")
    assert tracker.active
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise ConnectionError("server went away")

    tracker._client.log_batch = broken
    with caplog.at_level(logging.WARNING, logger="trainer.tracking"):
        for step in range(5):
            tracker.log_metrics({"reward": float(step)}, step=step)
        tracker.log_text("x", "x.txt")
        tracker.finish("FAILED")
    warnings = [r for r in caplog.records if r.name == "trainer.tracking"]
    assert len(warnings) == 1 and "metrics.jsonl" in warnings[0].getMessage()
    assert sqlite_uri in warnings[0].getMessage()
    assert len(calls) == 1 and not tracker.active and tracker.run_id is not None
    assert [r["reward"] for r in tracker.history] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_resume_same_run(sqlite_uri):
    first = Tracker(_config(sqlite_uri, mlflow_experiment="unit"), stage="sft")
    first.log_metrics({"loss": 2.0}, step=1)
    first.finish("FAILED")
    # A restart changes a param (MLflow params are immutable): the old value stays, no failure.
    second = Tracker(_config(sqlite_uri, mlflow_experiment="unit", resume_from_checkpoint="auto"),
                     stage="sft", run_id=first.run_id)
    second.log_metrics({"loss": 1.0}, step=2)
    second.finish()
    assert second.active and second.run_id == first.run_id

    from mlflow import MlflowClient

    client = MlflowClient(sqlite_uri)
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["resume_from_checkpoint"] == "None"
    assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "loss")] == [(1, 2.0), (2, 1.0)]
