"""Uninterrupted reference runs, trained once per session and shared by every test that compares with one.

A resume test compares a killed-and-resumed run with an uninterrupted run; a rank test compares N ranks
with one process. Such a run depends on nothing but its arguments, so `reference_run(stage, *args)` trains
it (`tests.helpers.train_cli`) the first time a test asks for that (stage, args) and hands the same output
folder to every later test that asks for it. Tests that can share a reference use the same arguments (and
the same inputs: `toy_prompts(n)`, `reward_checkpoint`), so that they do.

A reference folder is read-only: a test that wants to train on from it copies it or resumes elsewhere. Its
files are made read-only (which binds all users but root), and every later request for it, and the end of
the session, check that no file in it was added, removed or rewritten.

Registered in tests/conftest.py; tests import the argument builders from here, never from each other.
"""

from __future__ import annotations

import hashlib
import json
import stat
import time
from pathlib import Path

import pytest

from tests.checkpoints import build_once
from tests.helpers import classifier_checkpoint, prompts_file, train_cli


def _fingerprint(folder: Path) -> dict[str, list[int]]:
    return {str(p.relative_to(folder)): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _make_read_only(folder: Path) -> None:
    for path in [*folder.rglob("*"), folder]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


class ReferenceRuns:
    """`reference_run(stage, *args) -> Path`: the output folder of `alignflow train STAGE ARGS --output_dir
    <a session folder>`, trained on the first request for (stage, args); `seconds[folder]`: its wall time.
    Under `pytest -n N` the workers share it (`tests.checkpoints.build_once`)."""

    def __init__(self, tmp_path_factory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.made: dict[tuple[str, ...], Path] = {}
        self.seconds: dict[Path, float] = {}
        self._fingerprints: dict[Path, dict[str, list[int]]] = {}

    def __call__(self, stage: str, *args: str) -> Path:
        key = (stage, *args)
        if key not in self.made:
            name = f"reference-{stage}-{hashlib.sha256(repr(key).encode()).hexdigest()[:12]}"
            out = build_once(self.tmp_path_factory, name, lambda out: self._train(out, stage, *args))
            recorded = json.loads(out.with_suffix(".json").read_text())
            self.seconds[out], self._fingerprints[out] = recorded["seconds"], recorded["files"]
            self.made[key] = out
        self.check(self.made[key])
        return self.made[key]

    @staticmethod
    def _train(out: Path, stage: str, *args: str) -> None:
        started = time.monotonic()
        # One process runs a stage as its in-process tests (tests/stage) run it, which coverage measures: untraced,
        # at ~45% less CPU. A multi-rank run is the subject of the rank tests, and is measured.
        train_cli(stage, *args, "--output_dir", str(out), traced="--num_processes" in args)
        seconds = time.monotonic() - started
        _make_read_only(out)
        out.with_suffix(".json").write_text(json.dumps({"seconds": seconds, "files": _fingerprint(out)}))

    def check(self, out: Path) -> None:
        assert _fingerprint(out) == self._fingerprints[out], f"a test wrote into the reference run {out}"


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    runs = ReferenceRuns(tmp_path_factory)
    yield runs
    for out in runs.made.values():
        runs.check(out)


@pytest.fixture(scope="session")
def toy_prompts(tmp_path_factory):
    """`toy_prompts(n) -> str`: a prompts file of the GRPO/PPO toy task (tests.helpers.prompts_file), one per n."""
    def build(folder: Path, n: int) -> None:
        folder.mkdir()
        prompts_file(folder / "prompts.jsonl", n=n)

    return lambda n: str(build_once(tmp_path_factory, f"toy-prompts-{n}", lambda f: build(f, n)) / "prompts.jsonl")


@pytest.fixture(scope="session")
def reward_checkpoint(tiny_model, tmp_path_factory) -> str:
    """The tiny model as a one-label reward model, its random head scaled by 5: PPO's critic network starts here."""
    return str(build_once(tmp_path_factory, "reward-model", lambda folder: classifier_checkpoint(tiny_model, folder, scale=5)))


def ppo_args(model: str, critic: str, prompts: str, critic_model: str, per_rank: int) -> tuple[str, ...]:
    """Two PPO steps (2 optimizer steps each) on `per_rank` rollouts per rank in one mini-batch, in
    micro-batches of 4 (gradient accumulation), so that N ranks compute what one process computes on
    the same global batch: the same micro-batches, averaged the same way. `critic_model` is the critic
    network's start with critic=reward_model. The learning rate is 1e-3: ZeRO-3's float32 noise, which
    Adam amplifies in the weights whose gradient is near zero, grows with it (up to 1.6e-4 here at 1e-2,
    4.9e-5 at 3e-3; ZeRO-2 1.5e-5 and DDP 3.9e-6 at 1e-2). Shared by tests/e2e/test_ranks.py (ZeRO) and
    tests/e2e/test_ppo_ranks.py (DDP), which compare with the same one-process runs."""
    extra = ("--critic", critic, "--critic_model", critic_model) if critic == "reward_model" else ()
    return ("--model", model, "--dataset", prompts, "--reward_funcs",
            "tests.helpers:target_frequency", "--batch_size", str(per_rank), "--mini_batch_size", str(per_rank),
            "--per_device_batch_size", "4", "--ppo_epochs", "2", "--max_completion_length", "8",
            "--max_prompt_length", "32", "--max_steps", "4", "--save_steps", "0", "--logging_steps", "1",
            "--learning_rate", "1e-3", "--init_kl_coef", "0.05", "--seed", "3", "--disable_progress_bar", "true",
            *extra)
