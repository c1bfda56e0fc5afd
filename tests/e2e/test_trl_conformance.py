"""TRL conformance: the example configs of TRL's own documentation run under `alignflow train`.

tests/data/trl_configs/<stage>.yaml are TRL's examples (each names its source) with only the model and data
paths made local; every stage trains two steps on the tiny model from them, through the `alignflow` console
script's entry point, with the TRL names noted and nothing rejected."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import DEMO_DATA, ROOT

CONFIGS = ROOT / "tests" / "data" / "trl_configs"
# Only what a CPU test needs on top of the file: a short run (and short GRPO completions).
OVERRIDES = {"sft": [], "dpo": [], "reward": [], "grpo": ["--max_completion_length", "16"]}


def test_every_stage_has_a_trl_config():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == ["dpo", "grpo", "reward", "sft"]
    for path in CONFIGS.glob("*.yaml"):
        assert "Source: github.com/huggingface/trl" in path.read_text(), f"{path.name} does not name its source"


@pytest.mark.parametrize("stage", ["sft", "dpo", "reward", "grpo"])
def test_trl_example_config_trains(stage, tiny_model, tmp_path):
    shutil.copytree(tiny_model, tmp_path / "tiny-model")
    (tmp_path / "data").mkdir()
    lines = (DEMO_DATA / "preferences.jsonl").read_text().splitlines()
    (tmp_path / "data" / "preferences.jsonl").write_text("\n".join(lines[:6]) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", "train", stage, "--config", str(CONFIGS / f"{stage}.yaml"),
                           "--output_dir", "out", "--max_steps", "2", *OVERRIDES[stage]],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{stage} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert "note: model_name_or_path is TRL's name for model" in done.stderr
    manifest = json.loads((tmp_path / "out" / "alignflow.json").read_text())
    config = manifest["config"]
    assert config["model"] == "./tiny-model" and config["max_steps"] == 2
    if stage == "sft":  # the example's optimisation keys took effect under their alignflow names
        assert (config["lr_scheduler"], config["learning_rate"], config["report_to"]) == ("cosine", 1e-4, ["none"])
    if stage == "dpo":  # the two `datasets:` entries were mixed: 6 demo pairs more than the demo data alone
        demo_rows = len(lines)
        assert manifest["datasets"]["train"]["rows"] == demo_rows + 6
