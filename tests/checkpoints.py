"""Session fixtures for tiny checkpoints that several test modules read (`tests/conftest.py` imports them;
the one-label reward model, `reward_checkpoint`, lives with the reference runs in tests/references.py).

Each is built once per test run from the `tiny_model` fixture (`build_once`: under `pytest -n N`, by the
first worker that asks). They are read-only: a test that writes into
one (a corrupted file, a planted pickle, a changed tokenizer) copies it into its own `tmp_path` first
(`shutil.copytree(sft_checkpoint, tmp_path / "sft")`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def shared_folder(tmp_path_factory, name: str) -> Path:
    """`name` in a session folder that every xdist worker of this run sees (the one basetemp of a serial run);
    not created here."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-<user>/pytest-<n>/ holds each worker's basetemp (popen-gw0, ...)
    return root / name


def build_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """`build(folder)` once per test run, in a shared folder: under `pytest -n N` the first worker to ask
    builds while the others wait on a lock, then all read the same folder. A build that raised leaves no
    `.done` marker, so the next request starts it again in a clean folder."""
    folder = shared_folder(tmp_path_factory, name)
    done = folder.with_name(f"{name}.done")
    with FileLock(folder.with_name(f"{name}.lock")):  # (filelock: a dependency of torch and the hub client)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama model + BPE tokenizer with a chat template (built offline, ~5 s)."""
    from trainer.cli.init_tiny import init_tiny

    return str(build_once(tmp_path_factory, "tiny-model", init_tiny))


@pytest.fixture(scope="session")
def sft_checkpoint(tiny_model, tmp_path_factory) -> str:
    """SFT on the demo chat data for 10 steps (tests.helpers.tiny_sft), 10 % held out for `eval_loss`, with a
    `hub_model_id` for its model card: greedy replies that depend on the prompt, and a card with train and
    eval metrics. Returns the final model's folder."""
    from tests.helpers import tiny_sft

    def build(folder: Path) -> None:
        tiny_sft(tiny_model, folder / "sft", hub_model_id="someone/tiny-sft", eval_split_ratio=0.1)

    return str(build_once(tmp_path_factory, "sft-checkpoint", build) / "sft")


@pytest.fixture(scope="session")
def sentiment_checkpoint(tiny_model, tmp_path_factory) -> str:
    """A two-label classifier (NEGATIVE, POSITIVE) on the tiny model, random head x5 (seed 0)."""
    from tests.helpers import classifier_checkpoint

    return str(build_once(tmp_path_factory, "sentiment", lambda folder: classifier_checkpoint(
        tiny_model, folder, ["NEGATIVE", "POSITIVE"], scale=5)))
