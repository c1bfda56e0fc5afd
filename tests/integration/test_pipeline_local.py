"""The whole post-training DAG with kfp.local: outputs mirrored to a real SeaweedFS bucket, every
stage in a real MLflow server, the winner registered as @champion; a failing gate leaves the
champion alone; rollback restores the previous champion."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from mlflow import MlflowClient

from trainer import storage

pytestmark = pytest.mark.integration

FAST = {
    "sft": {"max_steps": 40, "per_device_batch_size": 16, "learning_rate": 3e-3, "max_length": 128},
    "reward": {"max_steps": 10, "per_device_batch_size": 16, "learning_rate": 1e-3, "max_length": 128},
    "grpo": {"reward_funcs": ["exact_answer", "answer_format"], "reward_weights": [1.0, 0.2], "num_generations": 4,
             "max_completion_length": 16, "max_prompt_length": 64, "learning_rate": 1e-4, "max_steps": 3},
    "dpo": {"max_steps": 3, "per_device_batch_size": 8, "max_length": 128},
    "evaluate": {"reward_funcs": ["exact_answer", "answer_format"], "max_completion_length": 16,
                 "max_prompt_length": 64, "max_samples": 12},
    "datasets": {"sft": "demo:math_sft", "preferences": "demo:preferences", "prompts": "demo:math",
                 "eval": "demo:math_eval"},
    "model_name": "pipeline-test",
}


def run_pipeline(tmp_path, name: str, env: dict, **overrides) -> subprocess.CompletedProcess:
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({**FAST, **overrides}))
    cmd = [sys.executable, "-m", "pipelines.cli", "pipeline", "run", "--local", "--config", str(config),
           "--output", str(tmp_path / name), "--pipeline-root", env["PIPELINE_ROOT"]]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def test_pipeline_on_s3_and_mlflow_with_gate_and_rollback(tiny_model, s3_env, mlflow_server, tmp_path):
    s3_server = s3_env
    root = f"s3://{s3_server.bucket}/pipelines/{os.getpid()}"
    env = {**os.environ, **s3_server.env(), "MLFLOW_TRACKING_URI": mlflow_server, "PIPELINE_ROOT": root,
           "OMP_WAIT_POLICY": "PASSIVE"}

    first = run_pipeline(tmp_path, "first", env, base_model=tiny_model)
    assert first.returncode == 0, first.stderr[-3000:]

    client = MlflowClient(mlflow_server)
    model = client.get_registered_model("pipeline-test")
    assert model.aliases == {"champion": "1"}
    # Every stage logged a child run with metrics under the pipeline's parent run.
    exp = client.get_experiment_by_name("alignflow")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("alignflow.stage") == "pipeline"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = {r.data.tags["alignflow.stage"]: r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert set(children) >= {"sft", "reward", "grpo", "eval"}, sorted(children)
    assert children["sft"].data.metrics["loss"] > 0 and "reward" in children["grpo"].data.metrics
    # Task outputs are in the bucket.
    objects = storage.filesystem(root).find(root)
    for suffix in ("sft/model/model.safetensors", "grpo/model/alignflow.json", "evaluate/results/metrics.json",
                   "reward-model/model/alignflow.complete"):
        assert any(o.endswith(suffix) for o in objects), f"{suffix} not in the bucket"
    # The registered version carries the checkpoint files and the lineage tags.
    version = client.get_model_version("pipeline-test", "1")
    assert version.tags["alignflow.promotion.promoted"] == "true" and "alignflow.pipeline_run" in version.tags
    files = [a.path for a in client.list_artifacts(version.run_id, "checkpoint")]
    assert any(f.endswith("model.safetensors") for f in files)

    # An impossible gate: the candidate is evaluated but nothing is registered and the champion stays.
    second = run_pipeline(tmp_path, "second", env, base_model=tiny_model, min_improvement=1e6)
    assert second.returncode == 0, second.stderr[-3000:]
    assert client.get_registered_model("pipeline-test").aliases == {"champion": "1"}
    assert len(client.search_model_versions("name='pipeline-test'")) == 1

    # A DPO run that always passes takes over; rollback gives the crown back.
    third = run_pipeline(tmp_path, "third", env, base_model=tiny_model, algorithm="dpo", min_improvement=-1e6)
    assert third.returncode == 0, third.stderr[-3000:]
    assert client.get_registered_model("pipeline-test").aliases == {"champion": "2", "previous-champion": "1"}
    rollback = subprocess.run([sys.executable, "-m", "trainer.cli", "promote", "--rollback", "pipeline-test"],
                              env=env, capture_output=True, text=True, timeout=120)
    assert rollback.returncode == 0, rollback.stderr[-2000:]
    assert json.loads(rollback.stdout)["champion_after"] == "1"
    assert client.get_registered_model("pipeline-test").aliases == {"champion": "1", "previous-champion": "2"}
