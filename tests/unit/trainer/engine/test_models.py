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
