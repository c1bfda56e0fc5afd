"""Session fixtures for tiny checkpoints that several test modules read (`tests/conftest.py` imports them;
the one-label reward model, `reward_checkpoint`, lives with the reference runs in tests/references.py).

Each is built once per session from the `tiny_model` fixture. They are read-only: a test that writes into
one (a corrupted file, a planted pickle, a changed tokenizer) copies it into its own `tmp_path` first
(`shutil.copytree(sft_checkpoint, tmp_path / "sft")`).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def sft_checkpoint(tiny_model, tmp_path_factory) -> str:
    """SFT on the demo chat data for 10 steps (tests.helpers.tiny_sft), 10 % held out for `eval_loss`, with a
    `hub_model_id` for its model card: greedy replies that depend on the prompt, and a card with train and
    eval metrics. Returns the final model's folder."""
    from tests.helpers import tiny_sft

    return tiny_sft(tiny_model, tmp_path_factory.mktemp("sft-checkpoint") / "sft", hub_model_id="someone/tiny-sft",
                    eval_split_ratio=0.1)


@pytest.fixture(scope="session")
def sentiment_checkpoint(tiny_model, tmp_path_factory) -> str:
    """A two-label classifier (NEGATIVE, POSITIVE) on the tiny model, random head x5 (seed 0)."""
    from tests.helpers import classifier_checkpoint

    return classifier_checkpoint(tiny_model, tmp_path_factory.mktemp("sentiment") / "sentiment",
                                 ["NEGATIVE", "POSITIVE"], scale=5)
