"""Every stage on CUDA: the model trains on the GPU in bf16, and with two GPUs two ranks (DDP and
DeepSpeed ZeRO-3) end with the weights one GPU gives at the same global batch (float32)."""

import json

import pytest
import torch

from tests.helpers import DEMO_DATA, max_difference, prompts_file, train_cli, weights
from trainer.engine import checkpoint as ckpt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"),
]

STAGES = ["sft", "reward", "dpo", "grpo"]
COMMON = ("--max_steps", "6", "--logging_steps", "1", "--disable_progress_bar", "true", "--seed", "3",
          "--learning_rate", "1e-3")


def stage_args(stage, tmp_path):
    if stage == "sft":
        return "--dataset", str(DEMO_DATA / "sft.jsonl"), "--num_sample_completions", "1"
    if stage in ("reward", "dpo"):
        return ("--dataset", str(DEMO_DATA / "preferences.jsonl"))
    return ("--dataset", prompts_file(tmp_path / "prompts.jsonl", n=16), "--reward_funcs",
            "tests.helpers:target_frequency", "--num_generations", "4", "--max_completion_length", "8",
            "--max_prompt_length", "32", "--learning_rate", "1e-2", "--log_completions_steps", "0")


@pytest.mark.parametrize("stage", STAGES)
def test_stage_trains_on_the_gpu_in_bf16(stage, tiny_model, tmp_path):
    out = tmp_path / "out"
    train_cli(stage, "--model", tiny_model, "--output_dir", str(out), *COMMON, *stage_args(stage, tmp_path),
              "--per_device_batch_size", "8" if stage == "grpo" else "4", "--bf16", "true")
    manifest = json.loads((out / ckpt.MANIFEST).read_text())
    assert manifest["device"].startswith("cuda"), manifest["device"]
    assert manifest["mixed_precision"] == "bf16"
    assert max_difference(weights(out), weights(tiny_model)) > 0 if stage != "reward" else ckpt.is_complete(str(out))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("mode", [(), ("--deepspeed", "zero3")], ids=["ddp", "zero3"])
@pytest.mark.parametrize("stage", STAGES)
def test_two_gpus_match_one(stage, mode, tiny_model, tmp_path):
    batch = 8 if stage == "grpo" else 4
    one, two = tmp_path / "one", tmp_path / "two"
    train_cli(stage, "--model", tiny_model, "--output_dir", str(one), *COMMON, *stage_args(stage, tmp_path),
              "--per_device_batch_size", str(batch))
    train_cli(stage, "--model", tiny_model, "--output_dir", str(two), *COMMON, *stage_args(stage, tmp_path),
              "--per_device_batch_size", str(batch // 2), "--num_processes", "2", *mode)
    assert json.loads((two / ckpt.MANIFEST).read_text())["world_size"] == 2
    assert max_difference(weights(two), weights(one)) < 1e-4
