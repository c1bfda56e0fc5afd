"""A run killed with SIGKILL resumes from its last complete checkpoint and ends bit-for-bit
where an uninterrupted run ends."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import kill_after_checkpoint
from trainer import checkpoint as ckpt

pytestmark = pytest.mark.integration


def sft_command(model: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer.cli", "train", "sft", "--model", model, "--dataset", "demo",
            "--output_dir", str(out), "--max_steps", "10", "--per_device_batch_size", "32", "--max_length", "256",
            "--learning_rate", "3e-3", "--logging_steps", "1", "--num_sample_completions", "0",
            "--save_total_limit", "0", *extra]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("MLFLOW_TRACKING_URI", None)
    e["PYTHONUNBUFFERED"] = "1"
    return e


def test_sigkill_then_auto_resume_matches_straight_run(tiny_model, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run(sft_command(tiny_model, straight), check=True, env=env(), capture_output=True)

    # Save every step; kill the process as soon as step 5 is complete, while it trains on.
    kill_after_checkpoint(sft_command(tiny_model, killed, "--save_steps", "1"), killed / "checkpoint-5", 120, env())
    done = [s for s, _ in ckpt.list_checkpoints(str(killed))]
    assert 5 in done and max(done) < 10, f"killed too late: complete checkpoints {done}"
    assert not ckpt.is_complete(str(killed)), "the final model must not look complete after a kill"

    subprocess.run(sft_command(tiny_model, killed, "--save_steps", "1", "--resume_from_checkpoint", "auto"),
                   check=True, env=env(), capture_output=True)
    assert ckpt.is_complete(str(killed))
    a = load_file(straight / "model.safetensors")
    b = load_file(killed / "model.safetensors")
    start = load_file(Path(tiny_model) / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert not torch.equal(a[name], start[name])
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)
    steps = [r["step"] for r in ckpt.read_history(str(killed))]
    assert steps == list(range(1, 11)), steps
