"""Model cards from a manifest, and the checks `push_to_hub` makes before any training."""

import pytest
from huggingface_hub import ModelCard

from tests.helpers import CHAT_DATA
from trainer.cli import main as cli
from trainer.engine import hub
from trainer.stages.sft import SFTConfig


def test_front_matter_names_hub_ids_only(tmp_path):
    manifest = {"stage": "dpo", "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "step": 7,
                "datasets": {"train": {"path": "trl-lib/ultrafeedback_binarized", "fingerprint": "sha256-x", "rows": 9},
                             "eval": {"path": str(tmp_path / "eval.jsonl"), "fingerprint": "sha256-y", "rows": 2}},
                "config": {"lora_r": 8, "output_dir": "s3://b/runs/dpo"}, "metrics": {}}
    data = ModelCard(hub.model_card(manifest)).data.to_dict()
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert data["datasets"] == ["trl-lib/ultrafeedback_binarized"]
    assert data["tags"] == ["alignflow", "dpo", "peft", "lora"]
    assert "AutoPeftModelForCausalLM" in hub.model_card(manifest)
    for local in ("demo", "split", "s3://b/data", "./data.jsonl", "/abs/base", "models:/policy@champion", str(tmp_path)):
        assert not hub.is_hub_id(local), local


def test_push_without_a_token_stops_before_training(tiny_model, tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    out = tmp_path / "out"
    code = cli.main(["train", "sft", "--model", tiny_model, "--dataset", str(CHAT_DATA), "--output_dir", str(out),
                     "--max_steps", "2", "--push_to_hub", "true"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("alignflow train sft: error: `push_to_hub`") and "HF_TOKEN" in err and "\n" not in err
    assert not (out / "model.safetensors").exists()


def test_bad_hub_model_id_is_a_config_error():
    with pytest.raises(ValueError, match="hub_model_id"):
        SFTConfig(model="m", dataset="demo", hub_model_id="a/b/c")
