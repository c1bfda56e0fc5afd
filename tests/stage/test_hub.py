"""Model cards of final checkpoints, and `push_to_hub` (against a local stand-in of the Hub's API)."""

import json
import shlex
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from tests.helpers import CHAT_DATA, tiny_sft
from trainer import checkpoint as ckpt
from trainer import cli, hub
from trainer.config import parse_config
from trainer.sft import SFTConfig


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("card") / "sft"
    tiny_sft(tiny_model, out, max_steps=3, hub_model_id="someone/tiny-sft", eval_split_ratio=0.1)
    return out


def test_final_checkpoint_has_a_card_from_its_manifest(trained, tiny_model):
    manifest = json.loads((trained / ckpt.MANIFEST).read_text())
    card = ModelCard.load(trained / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["tags"] == ["alignflow", "sft"]
    assert "base_model" not in data and "datasets" not in data  # a local folder and a local file: no hub ids
    text = card.text
    assert "# someone/tiny-sft" in text and f"`{tiny_model}`" in text
    for split in ("train", "eval"):
        assert manifest["datasets"][split]["fingerprint"] in text
    assert f"| `loss` | {manifest['metrics']['loss']:.6g} |" in text
    assert f"| `eval_loss` | {manifest['metrics']['eval_loss']:.6g} |" in text
    assert json.dumps(manifest["config"], indent=2, sort_keys=True) in text
    # The card is part of the checkpoint: listed (with its hash) in the completion marker.
    marker = json.loads((trained / ckpt.COMPLETE_MARKER).read_text())
    assert "README.md" in [f["path"] for f in marker["files"]]


def test_card_command_reproduces_the_config(trained):
    """The card's `alignflow train ...` line parses back into the very config the run used."""
    manifest = json.loads((trained / ckpt.MANIFEST).read_text())
    card = (trained / "README.md").read_text()
    line = next(li for li in card.splitlines() if li.startswith("alignflow train sft "))
    assert line == hub.train_command(manifest)
    config = parse_config(SFTConfig, shlex.split(line)[3:])
    saved = {k: v for k, v in manifest["config"].items() if k not in ("disable_progress_bar",)}
    assert {k: v for k, v in config.to_dict().items() if k in saved} == saved


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
