"""DPO config and input checks that fail before any model loads."""


import pytest

from tests.helpers import dpo_config
from trainer.errors import ConfigError, DataError
from trainer.stages.dpo import DPOConfig, run_dpo


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
