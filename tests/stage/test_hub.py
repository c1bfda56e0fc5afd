"""Model cards of final checkpoints (the session's SFT checkpoint). Cards from a manifest alone and the checks
before a push: tests/unit/trainer/engine/test_hub.py; a real push: tests/e2e/test_chat_hub.py."""

import json
import shlex
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from trainer.config.options import parse_config
from trainer.engine import checkpoint as ckpt
from trainer.engine import hub
from trainer.stages.sft import SFTConfig


@pytest.fixture
def trained(sft_checkpoint) -> Path:
    """The session's SFT checkpoint (tests/checkpoints.py), trained with `hub_model_id` and an eval split."""
    return Path(sft_checkpoint)


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
    assert line == hub.train_command(manifest, SFTConfig)
    config = parse_config(SFTConfig, shlex.split(line)[3:])
    saved = {k: v for k, v in manifest["config"].items() if k not in ("disable_progress_bar",)}
    assert {k: v for k, v in config.to_dict().items() if k in saved} == saved
