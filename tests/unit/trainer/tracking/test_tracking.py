"""Tracker against an embedded sqlite MLflow store (failures injected into its client), and its helpers."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers import serve_in_thread
from trainer.config.options import TrainConfig
from trainer.tracking.provenance import redact_secrets, redact_uri
from trainer.tracking.tracker import (
    Tracker,
    dataset_inputs,
    flatten_params,
    is_connection_error,
    is_permanent,
    mlflow_key,
    unreachable_reason,
    use_uri_credentials,
)


def _config(uri: str | None, **overrides) -> TrainConfig:
    return TrainConfig(model="tiny", dataset="demo", mlflow_tracking_uri=uri, **overrides)


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    # One database per module: creating MLflow's tables takes a few seconds.
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'store' / 'mlflow.db'}"


@pytest.fixture(scope="module")
def client(sqlite_uri):
    from mlflow import MlflowClient

    return MlflowClient(sqlite_uri)


@pytest.fixture(autouse=True)
def _no_system_metrics(monkeypatch):
    """The monitor thread is tested once, on its own; elsewhere it would only add sqlite writers."""
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")


def _steps(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


class Outage:
    """Makes chosen methods of a tracker's MlflowClient fail like an unreachable server while `down`."""

    def __init__(self, tracker: Tracker, methods=("log_batch", "log_text", "log_inputs", "set_terminated")):
        self.down = False
        self.calls = 0
        for name in methods:
            real = getattr(tracker._client, name)
            setattr(tracker._client, name, self._wrap(real))

    def _wrap(self, real):
        def call(*args, **kwargs):
            self.calls += 1
            if self.down:
                raise ConnectionError("Connection refused")
            return real(*args, **kwargs)
        return call


# ----------------------------------------------------------------------------------------------
# Helpers


def test_flatten_params_makes_strings_and_redacts():
    assert flatten_params({"a": {"b": 1}, "c": [1, "x"], "d": None, "e": 2e-5}) == {
        "a.b": "1", "c": '[1, "x"]', "d": "None", "e": "2e-05"}
    assert len(flatten_params({"long": "x" * 10_000})["long"]) == 6000
    assert flatten_params({"mlflow_tracking_uri": "http://bob:hunter2@mlflow:5000"}) == {
        "mlflow_tracking_uri": "http://bob:***@mlflow:5000"}


@pytest.mark.parametrize(("text", "expected"), [
    ("http://bob:hunter2@mlflow:5000", "http://bob:***@mlflow:5000"),
    ("https://bob:p%40ss@host/api", "https://bob:***@host/api"),
    ("http://bob:p@ss@host:1/x", "http://bob:***@host:1/x"),  # an unencoded "@" in the password
    ("https://tok3n@host", "https://***@host"),
    ("at http://a:b@h1 and s3://k:s@bucket/x.", "at http://a:***@h1 and s3://k:***@bucket/x."),
    ("http://mlflow:5000", "http://mlflow:5000"),
    ("sqlite:///tmp/mlflow.db", "sqlite:///tmp/mlflow.db"),
    ("user@example.com wrote", "user@example.com wrote"),
])
def test_redact_uri(text, expected):
    assert redact_uri(text) == expected


def test_redact_secrets_nested():
    config = {"uri": "http://u:pw@h", "tags": ["x=http://u:pw@h"], "n": 3, "nested": {"t": ("http://u:pw@h",)}}
    assert "pw" not in json.dumps(redact_secrets(config))
    assert redact_secrets(config)["n"] == 3 and redact_secrets(config)["nested"]["t"] == ("http://u:***@h",)


def test_use_uri_credentials_moves_them_to_mlflows_variables(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    assert use_uri_credentials("sqlite:///x.db") == "sqlite:///x.db"
    assert use_uri_credentials("http://mlflow:5000") == "http://mlflow:5000"
    assert "MLFLOW_TRACKING_USERNAME" not in __import__("os").environ
    assert use_uri_credentials("https://bob:p%40ss@mlflow.example:443/prefix") == "https://mlflow.example:443/prefix"
    import os

    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("bob", "p@ss")


def test_health_check_accepts_credentials_in_the_uri(dead_mlflow_uri):
    seen = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    serve_in_thread(server)
    try:
        assert unreachable_reason(f"http://bob:hunter2@127.0.0.1:{server.server_port}") is None
        assert seen == [("/health", None)]  # the probe sends no credentials
    finally:
        server.shutdown()
    why = unreachable_reason(dead_mlflow_uri.replace("http://", "http://bob:hunter2@"))
    assert why is not None and "hunter2" not in why and "refused" in why.lower()


def test_is_permanent():
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED

    assert is_permanent(MlflowException.invalid_parameter_value("bad"))
    assert is_permanent(MlflowException("no", error_code=PERMISSION_DENIED))
    assert not is_permanent(MlflowException("API request to http://h failed with exception ..."))  # 500
    assert not is_permanent(ConnectionError("refused")) and not is_permanent(TimeoutError())
    try:  # MLflow's wrapping of a refused connection
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except Exception as inner:
            raise MlflowException(f"API request to http://h/api failed with exception {inner}")  # noqa: B904
    except MlflowException as wrapped:
        assert is_connection_error(wrapped) and not is_permanent(wrapped)
    assert not is_connection_error(MlflowException.invalid_parameter_value("bad"))
    assert is_permanent(FileNotFoundError("gone"))


@pytest.mark.parametrize(("key", "expected"), [
    ("rewards/chosen", "rewards/chosen"),
    ("clip_ratio/low_mean", "clip_ratio/low_mean"),
    ("rewards/my_pkg.rewards:accuracy/mean", "rewards/my_pkg.rewards:accuracy/mean"),
    ("reward (mean)", "reward _mean_"),
    ("/a//b/../c/", "a/b/c"),
])
def test_mlflow_key(key, expected):
    assert mlflow_key(key) == expected


def test_dataset_inputs():
    inputs = dataset_inputs({
        "train": {"path": "s3://b/data/gsm8k.jsonl", "fingerprint": "a1b2c3", "rows": 100, "tokens": 5000},
        "eval": {"path": "split", "fingerprint": "", "rows": 10},
        "prompts": {"path": "demo:math", "fingerprint": "f0", "rows": 5},
    })
    train, held_out, prompts = (i.dataset for i in inputs)
    assert (prompts.name, prompts.source_type) == ("demo:math", "builtin")
    assert (train.name, train.digest, train.source_type) == ("gsm8k.jsonl", "a1b2c3", "s3")
    assert json.loads(train.source) == {"uri": "s3://b/data/gsm8k.jsonl"}
    assert json.loads(train.profile) == {"rows": 100, "tokens": 5000}
    assert [t.value for i in inputs for t in i.tags] == ["train", "eval", "prompts"]
    assert len(held_out.digest) == 36  # no fingerprint: a digest of what is known


# ----------------------------------------------------------------------------------------------
# The run


def test_without_uri_only_history(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker(_config(None), stage="sft")
    tracker.log_metrics({"loss": 1.5, "entropy": None}, step=1)
    tracker.log_text("hello", "a.txt")
    tracker.log_datasets({"train": {"path": "x", "fingerprint": "f", "rows": 1}})
    tracker.finish()
    assert tracker.run_id is None and not tracker.active
    assert tracker.history == [{"step": 1, "loss": 1.5}]


def test_embedded_sqlite_run(sqlite_uri, client, tmp_path_factory):
    config = _config(sqlite_uri, mlflow_experiment="unit", mlflow_run_name="r1", mlflow_tags=["team=align"])
    with Tracker(config, stage="dpo") as tracker:
        for step in range(3):
            tracker.log_metrics({"loss": 1.0 / (step + 1), "rewards/chosen": step * 0.5}, step=step)
        tracker.log_dict({"stage": "dpo"}, "alignflow.json")
        tracker.log_table({"prompt": ["a", "b"], "completion": ["c", "d"]}, "samples.json")
        tracker.log_datasets({"train": {"path": "/data/train.jsonl", "fingerprint": "fp123", "rows": 3}})
    assert tracker.active

    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    assert run.data.params["learning_rate"] == "2e-05"
    assert run.data.params["lora_target_modules"] == '["all-linear"]'
    assert run.data.tags["alignflow.stage"] == "dpo" and run.data.tags["team"] == "align"
    assert _steps(client, tracker.run_id, "rewards/chosen") == [(0, 0.0), (1, 0.5), (2, 1.0)]
    assert {a.path for a in client.list_artifacts(tracker.run_id)} == {"alignflow.json", "samples.json"}
    # Artifacts sit next to the database, not under the working folder.
    assert run.info.artifact_uri.startswith(f"file://{sqlite_uri[len('sqlite:///'):].rsplit('/', 1)[0]}/mlartifacts")
    local = client.download_artifacts(tracker.run_id, "alignflow.json", str(tmp_path_factory.mktemp("dl")))
    assert json.load(open(local)) == {"stage": "dpo"}
    (dataset,) = run.inputs.dataset_inputs
    assert (dataset.dataset.name, dataset.dataset.digest) == ("train.jsonl", "fp123")
    assert [(t.key, t.value) for t in dataset.tags] == [("mlflow.data.context", "train")]
    assert len(tracker.history) == 3


def test_outage_queues_calls_and_sends_them_when_the_server_is_back(sqlite_uri, client, caplog):
    tracker = Tracker(_config(sqlite_uri, mlflow_experiment="unit"), stage="grpo")
    tracker.retry_min_s = tracker.retry_max_s = 0.0  # retry on every call (real runs pause 5-60 s)
    outage = Outage(tracker)
    with caplog.at_level(logging.WARNING, logger="trainer.tracking.tracker"):
        for step in range(10):
            outage.down = 3 <= step < 7
            tracker.log_metrics({"reward": float(step)}, step=step)
            if step == 4:
                tracker.log_text("written while down", "notes.txt")
                assert not tracker.active and tracker.pending == 2  # the batch of steps 3-4, then the text
            if step == 6:  # steps 5 and 6 joined one queued batch
                assert tracker.pending == 3
        assert tracker.active and tracker.pending == 0
        # Before the end: everything is on the server, in order, once.
        assert _steps(client, tracker.run_id, "reward") == [(s, float(s)) for s in range(10)]
        tracker.finish()
    messages = [r.getMessage() for r in caplog.records if r.name == "trainer.tracking.tracker"]
    assert len(messages) == 2, messages
    assert "unavailable" in messages[0] and "queued" in messages[0] and "metrics.jsonl" in messages[0]
    assert "is back" in messages[1]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert client.download_artifacts(tracker.run_id, "notes.txt").endswith("notes.txt")
    assert [r["reward"] for r in tracker.history] == [float(s) for s in range(10)]


def test_down_at_the_end_waits_then_backfills(sqlite_uri, client):
    tracker = Tracker(_config(sqlite_uri, mlflow_experiment="unit"), stage="sft")
    tracker.retry_min_s = tracker.retry_max_s = 0.05
    tracker.max_queued_points = 3  # a long outage: queued points are dropped, history keeps them
    outage = Outage(tracker)
    outage.down = True
    for step in range(8):
        tracker.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    assert tracker.pending <= 1 and tracker._queued_points <= 3 and tracker._dropped_points
    threading.Timer(0.3, lambda: setattr(outage, "down", False)).start()  # back while finish() waits
    tracker.finish_wait_s = 10
    tracker.finish()
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert _steps(client, tracker.run_id, "loss") == [(s, 1.0 / (s + 1)) for s in range(8)]


def test_still_down_at_the_end_gives_up_with_one_warning(sqlite_uri, client, caplog):
    tracker = Tracker(_config(sqlite_uri, mlflow_experiment="unit"), stage="sft")
    tracker.finish_wait_s = 0.2
    outage = Outage(tracker)
    outage.down = True
    tracker.log_metrics({"loss": 1.0}, step=1)
    with caplog.at_level(logging.WARNING, logger="trainer.tracking.tracker"):
        tracker.finish()
    assert "stays incomplete" in caplog.records[-1].getMessage()
    assert client.get_run(tracker.run_id).info.status == "RUNNING"  # the pipeline's finish task ends it


def test_refused_call_is_dropped_and_backfilled(sqlite_uri, client, caplog):
    from mlflow.exceptions import MlflowException

    tracker = Tracker(_config(sqlite_uri, mlflow_experiment="unit"), stage="dpo")
    real = tracker._client.log_batch
    refusals = []

    def refuse_once(*args, **kwargs):
        if not refusals:
            refusals.append(1)
            raise MlflowException.invalid_parameter_value("metric rejected")
        return real(*args, **kwargs)

    tracker._client.log_batch = refuse_once
    with caplog.at_level(logging.WARNING, logger="trainer.tracking.tracker"):
        for step in range(3):
            tracker.log_metrics({"kl": 0.1 * step}, step=step)
    assert tracker.active and "refused logging metrics" in caplog.text
    assert _steps(client, tracker.run_id, "kl") == [(1, 0.1), (2, 0.2)]
    tracker.finish()
    assert _steps(client, tracker.run_id, "kl") == [(0, 0.0), (1, 0.1), (2, 0.2)]


def test_log_params_and_datasets_survive_an_outage(sqlite_uri, client):
    tracker = Tracker(_config(sqlite_uri, mlflow_experiment="unit"), stage="sft")
    tracker.retry_min_s = tracker.retry_max_s = 0.0
    outage = Outage(tracker, methods=("log_batch", "get_run", "log_inputs"))
    outage.down = True
    tracker.log_params({"runtime/world_size": 2, "learning_rate": 1.0, "runtime/store": "http://u:pw@h/x"})
    datasets = {"train": {"path": "/data/a.jsonl", "fingerprint": "fa", "rows": 2}}
    tracker.log_datasets(datasets)
    assert tracker.pending == 2
    outage.down = False
    tracker.log_datasets(datasets)  # a resumed stage logs them again: still one input
    tracker.finish()
    run = client.get_run(tracker.run_id)
    assert run.data.params["runtime/world_size"] == "2" and run.data.params["runtime/store"] == "http://u:***@h/x"
    assert run.data.params["learning_rate"] == "2e-05"  # the config's value stays
    assert [d.dataset.digest for d in run.inputs.dataset_inputs] == ["fa"]


def test_resume_same_run(sqlite_uri, client):
    first = Tracker(_config(sqlite_uri, mlflow_experiment="unit"), stage="sft")
    first.log_metrics({"loss": 2.0}, step=1)
    first.finish("FAILED")
    # A restart changes a param (MLflow params are immutable): the old value stays, no failure.
    second = Tracker(_config(sqlite_uri, mlflow_experiment="unit", resume_from_checkpoint="auto"),
                     stage="sft", run_id=first.run_id)
    second.log_metrics({"loss": 1.0}, step=2)
    second.finish()
    assert second.active and second.run_id == first.run_id

    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["resume_from_checkpoint"] == "None"
    assert run.data.tags["alignflow.attempt.1"] == "FAILED" and run.data.tags["alignflow.attempts"] == "2"
    assert _steps(client, first.run_id, "loss") == [(1, 2.0), (2, 1.0)]


def test_resuming_a_dead_run_marks_the_attempt_killed_and_backfills(sqlite_uri, client, caplog):
    first = Tracker(_config(sqlite_uri, mlflow_experiment="unit"), stage="grpo")
    for step in (1, 2, 3):
        first.log_metrics({"reward": float(step)}, step=step)
    # The process dies here: no finish(), the run stays RUNNING. Its checkpoint's metrics.jsonl
    # holds steps 1-5 (4 and 5 never reached MLflow).
    with caplog.at_level(logging.WARNING, logger="trainer.tracking.tracker"):
        second = Tracker(_config(sqlite_uri, mlflow_experiment="unit"), stage="grpo", run_id=first.run_id)
    assert "still RUNNING" in caplog.text
    second.history[:] = [{"step": s, "reward": float(s)} for s in range(1, 6)]
    second.log_metrics({"reward": 6.0}, step=6)
    second.finish()
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["alignflow.attempt.1"] == "KILLED"
    assert _steps(client, first.run_id, "reward") == [(s, float(s)) for s in range(1, 7)]  # each once


def test_system_metrics(sqlite_uri, client, monkeypatch):
    import time

    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "true")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    tracker = Tracker(_config(sqlite_uri, mlflow_experiment="unit"), stage="sft")
    deadline = time.monotonic() + 20
    while "system/cpu_utilization_percentage" not in client.get_run(tracker.run_id).data.metrics:
        assert time.monotonic() < deadline, "no system metrics within 20 s"
        time.sleep(0.2)
    tracker.finish()
    metrics = client.get_run(tracker.run_id).data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(metrics)

    off = Tracker(_config(sqlite_uri, mlflow_experiment="unit"), stage="sft", system_metrics=False)
    assert off._monitor is None
    off.finish()


def test_container_image_reaches_the_manifest_and_the_run_tags(monkeypatch):
    """A task started in a container (ALIGNFLOW_IMAGE / ALIGNFLOW_IMAGE_DIGEST from the runner) records the
    image in alignflow.json; outside one the keys are absent."""
    from trainer.engine.checkpoint import build_manifest
    from trainer.tracking.provenance import container_image

    monkeypatch.delenv("ALIGNFLOW_IMAGE", raising=False)
    monkeypatch.delenv("ALIGNFLOW_IMAGE_DIGEST", raising=False)
    assert container_image() == {}
    assert "image_digest" not in build_manifest("sft", TrainConfig(model="base", dataset="demo"), "base", {}, {}, 1)
    monkeypatch.setenv("ALIGNFLOW_IMAGE", "reg.example/trainer:1-cpu")
    monkeypatch.setenv("ALIGNFLOW_IMAGE_DIGEST", "sha256:" + "ab" * 32)
    manifest = build_manifest("sft", TrainConfig(model="base", dataset="demo"), "base", {}, {}, 1)
    assert manifest["image"] == "reg.example/trainer:1-cpu" and manifest["image_digest"] == "sha256:" + "ab" * 32
