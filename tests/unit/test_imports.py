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
            names.append(info.name)
    return sorted(names)


def _raise(name: str) -> None:
    raise ImportError(f"cannot import package {name}")


MODULES = _modules()


def test_walk_finds_the_stage_modules():
    assert {"trainer.config", "trainer.data", "trainer.sft", "trainer.cli"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_import(name):
    importlib.import_module(name)
