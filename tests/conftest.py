"""Shared pytest setup. Server fixtures live in tests/servers.py (imported here)."""

import os
from pathlib import Path

# 2-thread training slows 10-30x on a shared machine with OpenMP's default busy-wait; no hub.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Tokenized data (and fetched files) are cached per test session, not in the user's ~/.cache/alignflow.
if "ALIGNFLOW_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["ALIGNFLOW_CACHE"] = tempfile.mkdtemp(prefix="alignflow-test-cache-")
    atexit.register(shutil.rmtree, os.environ["ALIGNFLOW_CACHE"], True)

from tests.servers import (  # noqa: E402
    basic_auth_mlflow,
    dead_mlflow_uri,
    mlflow_server,
    restartable_mlflow,
    restartable_s3,
    s3_env,
    s3_server,
)

__all__ = ["basic_auth_mlflow", "dead_mlflow_uri", "mlflow_server", "restartable_mlflow", "restartable_s3",
           "s3_env", "s3_server"]


import pytest  # noqa: E402

from tests.checkpoints import sentiment_checkpoint, sft_checkpoint, tiny_model  # noqa: E402, F401 (session fixtures)
from tests.references import reference_run, reward_checkpoint, toy_prompts  # noqa: E402, F401 (session fixtures)

HERE = Path(__file__).parent


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading a model's weights fails the test: a refusal must come before it (bad input, a changed run)."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was refused")

    for cls in (transformers.AutoModelForCausalLM, transformers.AutoModelForSequenceClassification):
        monkeypatch.setattr(cls, "from_pretrained", refuse)


@pytest.fixture
def count_model_loads(monkeypatch):
    """Counts every model the DPO stage loads (policy and reference)."""
    import trainer.stages.dpo as dpo

    loads = []
    real = dpo.load_causal_lm

    def counting(path, *args, **kwargs):
        loads.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(dpo, "load_causal_lm", counting)
    return loads


# scripts/test.sh: one line per test, as it ends; written by the controller only under xdist (`-n 2`),
# which hears every worker's reports.
_DURATIONS = None if os.environ.get("PYTEST_XDIST_WORKER") else os.environ.get("ALIGNFLOW_TEST_DURATIONS")
_timings: dict[str, tuple[float, str]] = {}


def pytest_runtest_logreport(report):
    """Add up a test's setup, call and teardown; its outcome is the first phase that did not pass."""
    seconds, outcome = _timings.get(report.nodeid, (0.0, "passed"))
    _timings[report.nodeid] = (seconds + report.duration, outcome if outcome != "passed" else report.outcome)


def pytest_runtest_logfinish(nodeid, location):
    """Append `seconds<TAB>outcome<TAB>test id` to $ALIGNFLOW_TEST_DURATIONS as each test ends."""
    seconds, outcome = _timings.pop(nodeid, (0.0, "passed"))
    if _DURATIONS:
        with open(_DURATIONS, "a") as fh:
            fh.write(f"{seconds:.2f}\t{outcome}\t{nodeid}\n")


TIERS = ("unit", "stage", "e2e", "gpu")  # the folders under tests/, each its own marker


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which turns the xdist_group markers into `@group` ids
def pytest_collection_modifyitems(config, items):
    """Each test gets its tier's marker from its folder (`-m unit` is the edit-test loop); tests of the
    `gpu` tier are skipped, with the reason, where torch sees no CUDA device."""
    import torch

    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        tier = Path(item.path).relative_to(HERE).parts[0]
        assert tier in TIERS, f"{item.nodeid}: a test belongs in one of tests/{{{','.join(TIERS)}}}/"
        item.add_marker(tier)
        if tier == "gpu" and not torch.cuda.is_available():
            item.add_marker(skip)
        if _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def _shares_a_module_fixture(item) -> bool:
    """Whether `item` uses a module- (or class-) scoped fixture: under `pytest -n 2 --dist loadgroup`
    (scripts/test.sh) all tests of such a module run on one worker, which builds the fixture (a vLLM engine,
    a server, a trained model) once, as a serial run does; every other test goes to whichever worker is free."""
    fixtures = getattr(item, "_fixtureinfo", None)
    return fixtures is not None and any(
        definition.scope in ("module", "class", "package")
        for definitions in fixtures.name2fixturedefs.values() for definition in definitions)
