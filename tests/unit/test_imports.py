"""Import every module of the shipped packages, so a broken import or missing dependency fails here."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

PACKAGES = ["trainer", "components", "pipelines"]


def _modules() -> list[str]:
    names = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        names.append(package_name)
        # onerror re-raises: a subpackage whose __init__ fails to import must fail the collection, not vanish.
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package_name}.", onerror=_raise):
            if not info.name.endswith(".__main__"):  # (running it is `python -m`, tested with the commands)
                names.append(info.name)
    return sorted(names)


def _raise(name: str) -> None:
    raise ImportError(f"cannot import package {name}")


MODULES = _modules()


def test_walk_finds_the_stage_modules():
    assert {"trainer.config.options", "trainer.data.sources", "trainer.stages.sft", "trainer.cli"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_import(name):
    importlib.import_module(name)


@pytest.mark.parametrize("module", ["trainer.cli.main", "pipelines.cli"])
@pytest.mark.parametrize("given", [None, "ACTIVE"])
def test_cli_sets_openmp_waits_before_torch_loads(module, given):
    """The command line makes idle OpenMP threads spin briefly, then sleep (a caller's value wins, and then the
    spin count is left alone), and does so before torch is imported: OpenMP reads the variables only once,
    when torch loads it."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if given:
        env["OMP_WAIT_POLICY"] = given
    code = (f"import os, sys, {module}; print(os.environ['OMP_WAIT_POLICY'], os.environ.get('GOMP_SPINCOUNT'), "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ([given, "None", "False"] if given else ["PASSIVE", "1000", "False"])
