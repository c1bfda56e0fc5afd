"""The lean install trains: `alignflow train sft` with no extra importable (the hiding is tested in
tests/unit/test_install.py)."""

from __future__ import annotations

from tests.helpers import CLI, lean


def test_sft_trains_without_any_extra(tiny_model, tmp_path):
    """`alignflow train sft` on the demo data with no extra importable: trains, saves, and notes once
    that MLflow tracking is off."""
    out = tmp_path / "sft"
    done = lean(CLI, "train", "sft", "--model", tiny_model, "--dataset", "demo", "--output_dir", str(out),
                "--max_steps", "2", "--per_device_batch_size", "2", "--max_length", "64")
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert (out / "model.safetensors").is_file() and (out / "alignflow.complete").exists()
    assert done.stderr.count("MLflow tracking is off") == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
