"""Reward-model stage inputs that fail before the model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import write_jsonl
from trainer.errors import DataError
from trainer.stages import reward_model as reward
from trainer.stages.reward_model import RewardConfig, run_reward


def rm_config(model: str, dataset: str, out: Path, **overrides) -> RewardConfig:
    values = dict(model=model, dataset=dataset, output_dir=str(out), max_steps=60, per_device_batch_size=16,
                  learning_rate=3e-3, logging_steps=10, max_length=64, disable_progress_bar=True)
    values.update(overrides)
    return RewardConfig(**values)


def test_margin_values_must_be_numbers(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", [{"chosen": "a b", "rejected": "a c", "margin": None}])
    with pytest.raises(DataError, match="row 0: `margin`"):
        run_reward(rm_config(tiny_model, data, tmp_path / "out"))


def test_sft_data_fails_before_the_model_loads_naming_the_columns(tiny_model, tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(reward, "load_reward_model", no_model)
    with pytest.raises(DataError) as err:
        run_reward(rm_config(tiny_model, "demo", tmp_path / "out"))
    assert "`chosen`" in str(err.value) and "`rejected`" in str(err.value)
    assert "SFT" in str(err.value)
