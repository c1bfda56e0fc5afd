"""DPO config and input checks that fail before any model loads."""

from pathlib import Path

import pytest

import trainer.dpo as dpo
from trainer.config import ConfigError
from trainer.data import DataError
from trainer.dpo import DPOConfig, run_dpo


def dpo_config(model: str, out: Path, **overrides) -> DPOConfig:
    values = dict(model=model, dataset="demo:preferences", output_dir=str(out), max_steps=6, per_device_batch_size=16,
                  learning_rate=3e-3, logging_steps=1, max_length=128,
                  disable_progress_bar=True)
    values.update(overrides)
    return DPOConfig(**values)


@pytest.fixture
def count_model_loads(monkeypatch):
    """Counts every model the stage loads (policy and reference)."""
    loads = []
    real = dpo.load_causal_lm

    def counting(path, *args, **kwargs):
        loads.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(dpo, "load_causal_lm", counting)
    return loads


def test_sft_data_fails_before_the_model_loads(tiny_model, tmp_path, count_model_loads):
    with pytest.raises(DataError) as err:
        run_dpo(dpo_config(tiny_model, tmp_path / "x", dataset="demo"))
    assert "`chosen`" in str(err.value) and "`rejected`" in str(err.value) and "SFT data" in str(err.value)
    assert not count_model_loads


@pytest.mark.parametrize("overrides,field", [
    ({"loss_type": "simpo", "ref_model": "x"}, "ref_model"),
    ({"loss_type": "simpo", "precompute_ref_log_probs": True}, "precompute_ref_log_probs"),
    ({"label_smoothing": 0.1}, "label_smoothing"),
    ({"loss_type": "robust", "label_smoothing": 0.5}, "label_smoothing"),
    ({"max_length": 128, "max_prompt_length": 128}, "max_prompt_length"),
    ({"beta": 0.0}, "beta"),
])
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        DPOConfig(model="m", dataset="demo:preferences", **overrides)
