"""`torch_compile` beyond SFT (whose compiled layers train eager's weights: tests/stage/test_sft.py): GRPO (bf16,
shared-prompt attention, hf rollouts eager), PPO (with its value head) and a reward model on BERT's encoder layers
train with their repeated blocks compiled. DPO and a causal reward model compile the same decoder layers as SFT
(`StageRunner.prepare`), and are not run compiled here (each costs 30-50 s of compiling)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import grpo_config, ppo_config, weights
from tests.stage.test_reward_model import agreement_data, rm_config, tiny_bert  # noqa: F401 (fixtures)


@pytest.fixture(autouse=True)
def compiled_graphs():
    """Each test's stage ran compiled graphs (dynamo's counters), not eager code, each traced in one attempt (no
    second `compile_attempt_1` after a restart: `compile_blocks` takes Python floats as constants). (Reset first:
    a layer's code compiled by an earlier test in this process would be reused without a new capture.)"""
    from torch._dynamo.utils import compilation_time_metrics, counters

    torch._dynamo.reset()
    counters.clear()
    compilation_time_metrics.clear()
    yield
    assert counters["stats"]["unique_graphs"] >= 1
    assert "compile_attempt_0" in compilation_time_metrics and "compile_attempt_1" not in compilation_time_metrics


def trained(out: Path, start_folder: str) -> bool:
    start = load_file(Path(start_folder) / "model.safetensors")
    after = weights(out)
    return any(not torch.equal(after[k], start[k]) for k in start if k in after)


def test_reward_model_on_an_encoder(tiny_bert, agreement_data, tmp_path):  # noqa: F811 (fixtures)
    from trainer.stages.reward_model import run_reward

    run_reward(rm_config(tiny_bert, agreement_data["train"], tmp_path / "rm", max_steps=2, torch_compile=True))
    assert trained(tmp_path / "rm", tiny_bert)


def test_grpo(tiny_model, tmp_path):
    from trainer.stages.rl.grpo import run_grpo

    run_grpo(grpo_config(tiny_model, tmp_path, max_steps=2, torch_compile=True, bf16=True))
    assert trained(tmp_path / "out", tiny_model)


def test_ppo(tiny_model, tmp_path):
    from trainer.stages.rl.ppo import run_ppo

    run_ppo(ppo_config(tiny_model, tmp_path, max_steps=2, torch_compile=True))
    assert trained(tmp_path / "out", tiny_model)
