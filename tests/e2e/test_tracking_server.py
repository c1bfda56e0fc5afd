"""Tracker against a real MLflow server (artifacts in SeaweedFS S3), one that is killed mid-run and
restarted, one behind HTTP basic auth, and a dead one."""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from pathlib import Path

import pytest

from trainer.config.options import TrainConfig
from trainer.tracking.tracker import Tracker


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


def test_server_killed_mid_run_and_restarted(restartable_mlflow, s3_server, caplog, monkeypatch):
    """The server dies after step 10 and is back for steps 21-40; a second stage starts while it is down.
    Both runs end FINISHED with every point, without stalling training, and with system metrics."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    server = restartable_mlflow
    config = _config(server.uri)
    tracker = Tracker(config, stage="grpo")
    tracker.retry_min_s, tracker.retry_max_s = 0.5, 2.0  # production pauses are 5-60 s
    tracker.log_datasets({"train": {"path": "s3://b/prompts.jsonl", "fingerprint": "0a1b2c3d", "rows": 40}})

    def train(steps):
        for step in steps:
            tracker.log_metrics({"reward": step / 10, "kl": step / 100}, step=step)
            time.sleep(0.1)

    with caplog.at_level(logging.WARNING, logger="trainer.tracking.tracker"):
        train(range(1, 11))
        time.sleep(1.5)  # a system-metrics sample or two before the crash
        server.kill()
        start = time.monotonic()
        train(range(11, 21))
        outage_steps = time.monotonic() - start
        late = Tracker(config, stage="dpo")  # starts while the server is down: the start is queued
        late.retry_min_s = late.retry_max_s = 0.5
        late.log_metrics({"loss": 0.7}, step=1)
        assert late.run_id is None and not tracker.active and tracker.pending >= 1

        server.start()
        train(range(21, 41))  # 20 steps over ~2 s of retry pauses: the queue drains mid-run
        assert tracker.pending == 0 and tracker.active, "queued calls were not sent after the server came back"
        late.log_metrics({"loss": 0.6}, step=2)
        tracker.finish()
        late.finish()

    # One failing call may wait out MLflow's capped HTTP retries (~3 s); the other steps are queued.
    assert outage_steps < 10, f"a dead server stalled training for {outage_steps:.1f} s over 10 steps"
    client = MlflowClient(server.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    reward = client.get_metric_history(tracker.run_id, "reward")
    assert sorted(m.step for m in reward) == list(range(1, 41)), "metric points missing or duplicated"
    assert len(client.get_metric_history(tracker.run_id, "kl")) == 40
    assert run.data.params["learning_rate"] == "2e-05"
    assert [d.dataset.digest for d in run.inputs.dataset_inputs] == ["0a1b2c3d"]
    assert any(k.startswith("system/") for k in run.data.metrics), sorted(run.data.metrics)

    late_run = client.get_run(late.run_id)
    assert late_run.info.status == "FINISHED" and late_run.data.tags["alignflow.stage"] == "dpo"
    assert [(m.step, m.value) for m in client.get_metric_history(late.run_id, "loss")] == [(1, 0.7), (2, 0.6)]
    messages = [r.getMessage() for r in caplog.records if r.name == "trainer.tracking.tracker"]
    assert any("unavailable" in m and "queued" in m for m in messages)
    assert any("is back" in m for m in messages)


def test_credentials_in_the_uri_work_and_stay_secret(basic_auth_mlflow, mlflow_server, tiny_model, tmp_path,
                                                     caplog, capfd, monkeypatch):
    """A tiny SFT run through `http://alice:PASSWORD@proxy`: the run is logged through basic auth, and the
    password is in no log line, printed output, param, logged artifact or alignflow.json."""
    from mlflow import MlflowClient

    from trainer.stages.sft import SFTConfig, run_sft

    proxy, password = basic_auth_mlflow, basic_auth_mlflow.password
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)  # restored after the test (the tracker sets the first two)
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")

    # Without credentials the proxy refuses: MLflow is switched off for that run, with a warning.
    with caplog.at_level(logging.WARNING, logger="trainer.tracking.tracker"):
        refused = Tracker(_config(proxy.uri), stage="sft")
    assert refused.run_id is None and "refused starting the run" in caplog.text and "401" in caplog.text
    before = len(proxy.seen)

    out = tmp_path / "sft"
    experiment = f"creds-{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.DEBUG):
        run_sft(SFTConfig(model=tiny_model, dataset="demo", output_dir=str(out), max_steps=2, per_device_batch_size=4,
                          logging_steps=1, max_length=64, num_sample_completions=0, disable_progress_bar=True,
                          mlflow_tracking_uri=proxy.uri_with_credentials, mlflow_experiment=experiment,
                          mlflow_log_checkpoint=True))
    requests = proxy.seen[before:]
    assert any("runs/create" in path for _, path, _ in requests)
    assert all(authorized or path == "/health" for _, path, authorized in requests)

    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [1, 2]
    assert run.data.params["mlflow_tracking_uri"] == proxy.uri_with_credentials.replace(password, "***")
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == ["demo"]  # the runner's log_datasets
    manifest = (out / "alignflow.json").read_text()
    assert proxy.uri_with_credentials.replace(password, "***") in manifest
    logged = client.download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts"))
    printed = capfd.readouterr()
    places = {"log records": caplog.text, "stdout": printed.out, "stderr": printed.err, "alignflow.json": manifest,
              "params": json.dumps(run.data.params), "tags": json.dumps(run.data.tags)}
    places.update({str(p): p.read_text(errors="replace") for p in Path(logged).rglob("*.json*") if p.is_file()})
    leaks = [where for where, text in places.items() if password in text]
    assert not leaks, f"the password leaked into {leaks}"


def test_dead_server_never_stalls_training(dead_mlflow_uri, caplog):
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="trainer.tracking.tracker"):
        tracker = Tracker(_config(dead_mlflow_uri), stage="sft")
        for step in range(20):
            tracker.log_metrics({"loss": 1.0, "rewards/chosen": 0.0}, step=step)
        tracker.log_table({"a": [1]}, "t.json")
        tracker.log_dict({"a": 1}, "alignflow.json")
        tracker.finish()
    elapsed = time.monotonic() - start

    assert elapsed < 5, f"a dead MLflow server stalled training for {elapsed:.1f} s"
    warnings = [r.getMessage() for r in caplog.records if r.name == "trainer.tracking.tracker"]
    assert len(warnings) == 1, warnings
    assert dead_mlflow_uri in warnings[0] and "metrics.jsonl" in warnings[0]
    assert tracker.run_id is None and not tracker.active
    assert [r["step"] for r in tracker.history] == list(range(20))
