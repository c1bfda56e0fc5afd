"""DPO against real services: TRL-named metrics in an MLflow server, checkpoints (with the
precomputed reference log-probs) in a SeaweedFS bucket, resumed from there exactly."""

import json
import time

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from trainer.engine import checkpoint as ckpt
from trainer.io import storage
from trainer.stages.dpo import DPOConfig, run_dpo


def config(model: str, out: str, **overrides) -> DPOConfig:
    values = dict(model=model, dataset="demo:preferences", output_dir=out, max_steps=6, per_device_batch_size=8,
                  learning_rate=3e-3, logging_steps=1, max_length=128, disable_progress_bar=True)
    values.update(overrides)
    return DPOConfig(**values)


def test_logs_trl_metric_names_to_real_mlflow_server(tiny_model, mlflow_server, tmp_path):
    run_dpo(config(tiny_model, str(tmp_path / "out"), mlflow_tracking_uri=mlflow_server,
                   mlflow_experiment="dpo-test", eval_split_ratio=0.1, eval_steps=3))
    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("dpo-test").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["alignflow.stage"] == "dpo"
    assert run.data.params["beta"] == "0.1" and run.data.params["loss_type"] == "sigmoid"
    for key in ("loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                "rewards/margins", "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected",
                "eval_loss", "eval_rewards/accuracies", "eval_logits/chosen"):
        assert key in run.data.metrics, key
    margins = client.get_metric_history(run.info.run_id, "rewards/margins")
    local = ckpt.read_history(str(tmp_path / "out"))
    assert [m.step for m in margins] == list(range(1, 7))
    assert [m.value for m in margins] == pytest.approx([r["rewards/margins"] for r in local if "loss" in r])
    assert ckpt.MANIFEST in {a.path for a in client.list_artifacts(run.info.run_id)}


def test_precomputed_reference_survives_resume_from_s3(tiny_model, s3_env, tmp_path):
    bucket = f"s3://{s3_env.bucket}"
    out = f"{bucket}/runs/dpo-{time.time_ns()}"
    common = dict(precompute_ref_log_probs=True, save_steps=3)
    run_dpo(config(tiny_model, out, **common))
    state = json.loads(storage.filesystem(out).cat(f"{out}/checkpoint-3/{ckpt.STATE_DIR}/state.json"))
    assert len(state["extra"]["ref_logps"]["train"]) == 600  # every demo pair: (chosen, rejected)

    # Resume from the bucket's checkpoint-3 into a local folder; compare with a straight local run.
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    run_dpo(config(tiny_model, str(resumed), resume_from_checkpoint=f"{out}/checkpoint-3", **common))
    run_dpo(config(tiny_model, str(straight), **common))
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)
