"""Tracker against a real MLflow server (artifacts in SeaweedFS S3) and against a dead one."""

from __future__ import annotations

import json
import logging
import math
import time
import uuid

import pytest

from trainer.config import TrainConfig
from trainer.tracking import Tracker

pytestmark = pytest.mark.integration


def _config(uri: str, **overrides) -> TrainConfig:
    overrides.setdefault("mlflow_experiment", f"it-{uuid.uuid4().hex[:8]}")
    return TrainConfig(model="tiny", dataset="demo", mlflow_tracking_uri=uri, **overrides)


@pytest.fixture(scope="module")
def client(mlflow_server):
    from mlflow import MlflowClient

    return MlflowClient(mlflow_server)


def test_run_with_params_metrics_and_artifacts(mlflow_server, client, s3_server, tmp_path):
    config = _config(mlflow_server, mlflow_run_name="dpo-it", mlflow_tags=["pipeline=nightly"], learning_rate=5e-7)
    with Tracker(config, stage="dpo") as tracker:
        for step in range(1, 6):
            tracker.log_metrics({"loss": 1.0 / step, "rewards/chosen": 0.1 * step,
                                 "rewards/margins": 0.2 * step}, step=step)
        tracker.log_metrics({"kl": float("nan")}, step=6)  # a NaN must not switch MLflow off
        tracker.log_table({"prompt": ["2+2?", "hi"], "completion": ["4", "hello"], "reward": [1.0, 0.5]},
                          "samples/step_5.json")
        tracker.log_dict({"stage": "dpo", "metrics": {"loss": 0.2}}, "alignflow.json")
        tracker.log_text("notes", "notes.txt")
        assert tracker.active

    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "dpo-it"
    assert run.data.params["learning_rate"] == "5e-07"
    assert run.data.params["mlflow_experiment"] == config.mlflow_experiment
    assert run.data.tags["alignflow.stage"] == "dpo"
    assert run.data.tags["pipeline"] == "nightly"
    assert "alignflow.version" in run.data.tags
    chosen = client.get_metric_history(tracker.run_id, "rewards/chosen")
    assert [m.step for m in chosen] == [1, 2, 3, 4, 5]
    assert [m.value for m in chosen] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert run.data.metrics["loss"] == pytest.approx(0.2)
    assert math.isnan(client.get_metric_history(tracker.run_id, "kl")[0].value)
    top = {a.path for a in client.list_artifacts(tracker.run_id)}
    assert top == {"alignflow.json", "notes.txt", "samples"}
    assert [a.path for a in client.list_artifacts(tracker.run_id, "samples")] == ["samples/step_5.json"]
    with open(client.download_artifacts(tracker.run_id, "samples/step_5.json", str(tmp_path))) as fh:
        table = json.load(fh)  # pandas' "split" layout
    assert table["columns"] == ["prompt", "completion", "reward"]
    assert [row[1] for row in table["data"]] == ["4", "hello"]
    # The server proxies artifacts into the S3 bucket.
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(
        Bucket=s3_server.bucket, Prefix="mlflow/")["Contents"]]
    assert any(k.endswith(f"{tracker.run_id}/artifacts/alignflow.json") for k in keys)
    assert tracker.history[0] == {"step": 1, "loss": 1.0, "rewards/chosen": 0.1, "rewards/margins": 0.2}


def test_child_run_nests_under_parent(mlflow_server, client):
    experiment_id = client.create_experiment(f"pipeline-{uuid.uuid4().hex[:8]}")
    parent = client.create_run(experiment_id, run_name="pipeline").info.run_id
    # The stage names another experiment; the child still goes where its parent is.
    tracker = Tracker(_config(mlflow_server, mlflow_parent_run_id=parent), stage="sft")
    tracker.log_metrics({"loss": 0.5}, step=1)
    tracker.finish()
    child = client.get_run(tracker.run_id)
    assert child.data.tags["mlflow.parentRunId"] == parent
    assert child.info.experiment_id == experiment_id


def test_resume_continues_the_run(mlflow_server, client):
    config = _config(mlflow_server)
    first = Tracker(config, stage="grpo")
    for step in (1, 2):
        first.log_metrics({"reward": float(step)}, step=step)
    first.finish("FAILED")  # the pod died

    second = Tracker(config, stage="grpo", run_id=first.run_id)
    for step in (3, 4):
        second.log_metrics({"reward": float(step)}, step=step)
    second.finish()

    assert second.run_id == first.run_id and second.active
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "reward")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_dead_server_never_stalls_training(dead_mlflow_uri, caplog):
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="trainer.tracking"):
        tracker = Tracker(_config(dead_mlflow_uri), stage="sft")
        for step in range(20):
            tracker.log_metrics({"loss": 1.0, "rewards/chosen": 0.0}, step=step)
        tracker.log_table({"a": [1]}, "t.json")
        tracker.log_dict({"a": 1}, "alignflow.json")
        tracker.finish()
    elapsed = time.monotonic() - start

    assert elapsed < 5, f"a dead MLflow server stalled training for {elapsed:.1f} s"
    warnings = [r.getMessage() for r in caplog.records if r.name == "trainer.tracking"]
    assert len(warnings) == 1, warnings
    assert dead_mlflow_uri in warnings[0] and "metrics.jsonl" in warnings[0]
    assert tracker.run_id is None and not tracker.active
    assert [r["step"] for r in tracker.history] == list(range(20))
