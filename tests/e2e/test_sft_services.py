"""SFT against real services: checkpoints in a SeaweedFS bucket, metrics in an MLflow server."""

import json
import time
import warnings

import pytest
from mlflow.tracking import MlflowClient

from tests.helpers import write_jsonl
from trainer.engine import checkpoint as ckpt
from trainer.io import storage
from trainer.stages.sft import SFTConfig, run_sft


def config(model: str, out: str, **overrides) -> SFTConfig:
    values = dict(model=model, dataset="demo", output_dir=out, max_steps=6, per_device_batch_size=8,
                  learning_rate=3e-3, logging_steps=1, max_length=128, num_sample_completions=0,
                  disable_progress_bar=True)
    values.update(overrides)
    return SFTConfig(**values)


def test_checkpoints_and_data_on_s3_and_resume_from_there(tiny_model, s3_env, tmp_path):
    bucket = f"s3://{s3_env.bucket}"
    # Training data read from the bucket.
    data = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"Say {w}.", "completion": f" {w}"}
                                                  for w in ["red", "green", "blue", "cyan", "pink", "gold"] * 10])
    s3 = storage.filesystem(bucket)
    s3.put_file(str(data), f"{bucket}/data/train.jsonl")

    out = f"{bucket}/runs/sft-{time.time_ns()}"
    run_sft(config(tiny_model, out, dataset=f"{bucket}/data/train.jsonl", save_steps=3))
    objects = {p.split("/", 3)[-1] for p in s3.find(out)}
    for name in ("model.safetensors", "config.json", "tokenizer.json", ckpt.MANIFEST, ckpt.METRICS_FILE,
                 ckpt.COMPLETE_MARKER, "checkpoint-3/training_state/optimizer.pt",
                 f"checkpoint-3/{ckpt.COMPLETE_MARKER}"):
        assert any(o.endswith(name) for o in objects), f"{name} missing from {sorted(objects)}"
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [3]

    # Resume from the bucket: a longer plan continues from checkpoint-3 and keeps its history.
    run_sft(config(tiny_model, out, dataset=f"{bucket}/data/train.jsonl", save_steps=3, max_steps=9,
                   resume_from_checkpoint="auto"))
    steps = [r["step"] for r in ckpt.read_history(out)]
    assert steps == list(range(1, 10)), steps
    assert json.loads(s3.cat(f"{out}/{ckpt.MANIFEST}"))["step"] == 9

    # The S3 model is a valid starting point for the next stage.
    run_sft(config(out, str(tmp_path / "from-s3"), max_steps=2))
    assert ckpt.is_complete(str(tmp_path / "from-s3"))


def test_logs_to_real_mlflow_server(tiny_model, mlflow_server, tmp_path):
    cfg = config(tiny_model, str(tmp_path / "out"), mlflow_tracking_uri=mlflow_server,
                 mlflow_experiment="sft-test", mlflow_tags=["team=research"], num_sample_completions=2,
                 mlflow_log_checkpoint=True)
    run_sft(cfg)
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("sft-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["learning_rate"] == "0.003"
    assert run.data.tags["team"] == "research"
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in losses] == list(range(1, 7))
    local = [json.loads(line) for line in (tmp_path / "out" / ckpt.METRICS_FILE).read_text().splitlines()]
    assert [m.value for m in losses] == pytest.approx([r["loss"] for r in local])
    for key in ("grad_norm", "learning_rate", "entropy", "num_tokens", "mean_token_accuracy"):
        assert key in run.data.metrics, key
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert ckpt.MANIFEST in artifacts and "checkpoint" in artifacts and "samples" in artifacts


def test_dead_mlflow_server_does_not_stop_training(tiny_model, dead_mlflow_uri, tmp_path):
    out = tmp_path / "out"
    started = time.monotonic()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        run_sft(config(tiny_model, str(out), mlflow_tracking_uri=dead_mlflow_uri))
    assert time.monotonic() - started < 60
    assert ckpt.is_complete(str(out))
    assert [r["step"] for r in ckpt.read_history(str(out))] == list(range(1, 7))
