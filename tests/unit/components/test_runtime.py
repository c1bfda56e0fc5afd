"""The pipeline's MLflow parent run (start / find / finish tasks) and the promote run nested under it,
against an embedded sqlite store."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from components import runtime
from trainer.config.options import TrainConfig
from trainer.engine import checkpoint as ckpt
from trainer.tracking.tracker import Tracker


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('runs') / 'mlflow.db'}"


@pytest.fixture
def client(uri, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("ALIGNFLOW_MLFLOW_EXPERIMENT", f"pipelines-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    monkeypatch.delenv("MLFLOW_PARENT_RUN_ID", raising=False)
    return MlflowClient(uri, registry_uri=uri)


def _in_run(monkeypatch) -> str:
    """Be inside a new pipeline run: its id in the environment, as KFP's pod label gives every task."""
    run_id = f"run-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("ALIGNFLOW_PIPELINE_RUN_ID", run_id)
    return run_id


def _stage_tracker(uri: str, parent: str, stage: str) -> Tracker:
    return Tracker(TrainConfig(model="tiny", dataset="demo", mlflow_tracking_uri=uri, mlflow_parent_run_id=parent),
                   stage)


def test_start_is_idempotent_and_findable_by_the_run_id(client, monkeypatch):
    run = _in_run(monkeypatch)
    first = runtime.start_pipeline_run("post-training", "nightly", {"base_model": "tiny"})
    assert first and runtime.start_pipeline_run("post-training", "nightly", {"base_model": "tiny"}) == first
    assert runtime.find_pipeline_run() == first and runtime.parent_run_id() == first
    assert client.get_run(first).info.status == "RUNNING"
    assert client.get_run(first).data.tags["alignflow.pipeline_run_id"] == run
    # Another run with the same display name (KFP does not make names unique) gets its own parent.
    _in_run(monkeypatch)
    assert runtime.find_pipeline_run() == ""
    second = runtime.start_pipeline_run("post-training", "nightly", {})
    assert second and second != first
    monkeypatch.delenv("ALIGNFLOW_PIPELINE_RUN_ID")
    assert runtime.find_pipeline_run() == "" and runtime.parent_run_id() == ""  # outside a pipeline run


def test_a_stage_opens_the_parent_when_start_run_could_not(client, monkeypatch):
    _in_run(monkeypatch)
    parent = runtime.parent_run_id()  # what train_stage calls
    assert parent and runtime.parent_run_id() == parent
    assert client.get_run(parent).data.tags["alignflow.stage"] == "pipeline"


def test_finish_kills_children_left_running(uri, client, caplog, monkeypatch):
    run = _in_run(monkeypatch)
    parent = runtime.start_pipeline_run("post-training", run, {})
    done = _stage_tracker(uri, parent, "sft")
    done.log_metrics({"loss": 1.0}, step=1)
    done.finish()
    dead = _stage_tracker(uri, parent, "dpo")  # its process "died": never finished
    dead.log_metrics({"loss": 1.0}, step=1)

    runtime.finish_pipeline_run(run)
    assert client.get_run(done.run_id).info.status == "FINISHED"
    killed = client.get_run(dead.run_id)
    assert killed.info.status == "KILLED" and "finish-run" in killed.data.tags["alignflow.ended_by"]
    assert client.get_run(parent).info.status == "FAILED"  # a stage's last run died
    assert dead.run_id in caplog.text


def test_finish_follows_the_pipeline_state_and_retried_stages(uri, client, monkeypatch):
    run = _in_run(monkeypatch)
    parent = runtime.start_pipeline_run("post-training", run, {})
    failed = _stage_tracker(uri, parent, "sft")
    failed.finish("FAILED")
    retried = _stage_tracker(uri, parent, "sft")  # the retry started a new run, which finished
    retried.finish()
    runtime.finish_pipeline_run(run)
    assert client.get_run(parent).info.status == "FINISHED"

    cancelled = _in_run(monkeypatch)
    other = runtime.start_pipeline_run("post-training", cancelled, {})
    runtime.finish_pipeline_run(cancelled, pipeline_state="CANCELED")
    assert client.get_run(other).info.status == "KILLED"


def test_promote_run_sits_under_the_pipeline_run(client, tmp_path, monkeypatch):
    run = _in_run(monkeypatch)
    parent = runtime.start_pipeline_run("post-training", run, {})
    model = tmp_path / "policy"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "model.safetensors").write_bytes(b"weights")
    (model / ckpt.COMPLETE_MARKER).write_text("{}")
    results = tmp_path / "results"
    results.mkdir()
    (results / "metrics.json").write_text(json.dumps({"reward": 0.4}))
    name = f"policy-{uuid.uuid4().hex[:6]}"

    version = runtime.promote_stage(model_in=str(model), results=str(results), model_name=name, gate_metric="reward",
                                     min_improvement=0.0, pipeline_run=run,
                                     report_out=SimpleNamespace(path=str(tmp_path / "report.html")))
    promote_run = client.get_run(client.get_model_version(name, version).run_id)
    assert promote_run.data.tags["mlflow.parentRunId"] == parent
    assert promote_run.data.tags["alignflow.stage"] == "promote"
    assert "version 1" in Path(tmp_path / "report.html").read_text()


def test_the_pipeline_run_tasks_start_without_torch():
    """start-run and finish-run open and close an MLflow run: their task process does not import torch (~1.5 s)."""
    import subprocess
    import sys

    code = "import sys; from components.runtime import start_pipeline_run, finish_pipeline_run; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_ranks_stopped_by_a_signal_end_the_task_with_the_preemption_code(tmp_path, monkeypatch):
    """A task that starts its ranks in the pod passes the launcher's 75 on (its retry resumes); another code fails."""
    from trainer.engine import launch
    from trainer.engine.preemption import PREEMPTED_EXIT_CODE, Preempted

    config = TrainConfig(model="m", dataset="d", output_dir=str(tmp_path / "out"), num_processes=2)
    monkeypatch.setattr(launch, "launch", lambda stage, argv, config: PREEMPTED_EXIT_CODE)
    with pytest.raises(Preempted) as stopped:
        runtime.run_ranks("sft", config)
    assert stopped.value.code == PREEMPTED_EXIT_CODE
    monkeypatch.setattr(launch, "launch", lambda stage, argv, config: 1)
    with pytest.raises(RuntimeError, match="exit code 1"):
        runtime.run_ranks("sft", config)
