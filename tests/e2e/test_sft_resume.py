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


def sft_command(model: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer.cli", "train", "sft", "--model", model, "--dataset", "demo",
            "--output_dir", str(out), "--max_steps", "10", "--per_device_batch_size", "32", "--max_length", "256",
            "--learning_rate", "3e-3", "--logging_steps", "3", "--num_sample_completions", "0",
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
    # The logged metrics are the straight run's too, the window of steps 4-6 that straddles the kill included.
    resumed, reference = ckpt.read_history(str(killed)), ckpt.read_history(str(straight))
    assert [r["step"] for r in resumed] == [r["step"] for r in reference] == [3, 6, 9, 10]
    for got, want in zip(resumed, reference, strict=True):
        shared = {k for k in want if not k.endswith(("_runtime", "per_second", "_seconds")) and k.startswith(
            ("loss", "learning_rate", "num_tokens", "epoch", "grad_norm", "mean_token_accuracy", "entropy"))}
        assert shared >= {"loss", "learning_rate", "num_tokens", "grad_norm"}, sorted(want)
        for key in shared:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (got["step"], key)
