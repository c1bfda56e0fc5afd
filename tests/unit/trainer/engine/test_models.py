"""Loading tokenizers and models (trainer/engine/models.py)."""

import json
import warnings

from trainer.engine.models import load_tokenizer


def test_tokenizer_without_pad_token_falls_back_to_eos(tiny_model, tmp_path):
    folder = tmp_path / "nopad"
    tok = load_tokenizer(tiny_model)
    tok.pad_token = None
    tok.save_pretrained(folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("pad_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_tokenizer(str(folder))
    assert loaded.pad_token == loaded.eos_token
    assert any("no pad token" in str(w.message) for w in caught)


def test_compile_blocks_compiles_each_decoder_layer_in_place(tiny_model):
    from trainer.engine.models import compile_blocks, load_causal_lm

    model = load_causal_lm(tiny_model)
    names = list(model.state_dict())
    assert compile_blocks(model) == len(model.model.layers) > 1
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert model.model.embed_tokens._compiled_call_impl is None and model.lm_head._compiled_call_impl is None
    assert list(model.state_dict()) == names  # checkpoints keep their names


def test_torch_compile_is_refused_under_zero3_before_any_model_loads(monkeypatch, tmp_path):
    import pytest

    from trainer.engine import runner
    from trainer.errors import ConfigError
    from trainer.stages.sft import SFTConfig

    describe = runner.distributed.describe
    monkeypatch.setattr(runner.distributed, "describe", lambda acc: {**describe(acc), "zero_stage": 3})
    config = SFTConfig(model="m", dataset="demo", output_dir=str(tmp_path / "out"), torch_compile=True)
    with pytest.raises(ConfigError, match="`torch_compile` does not run under DeepSpeed ZeRO-3.*ZeRO-2"):
        runner.StageRunner("sft", config)
