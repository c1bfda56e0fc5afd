"""`--dist loadgroup` keeps the tests that share a module-scoped fixture on one worker (tests/conftest.py marks
them with `xdist_group` in a `tryfirst` collection hook). Both halves can break silently: pytest 9.2 moved node
ids out of `_nodeid`, where pytest-xdist 3.8 writes the `@group` suffix, and a collection hook that runs after
xdist's adds its markers too late. Either way every worker then builds its own vLLM engine, server or model."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

CONFTEST = '''
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.name.startswith("test_shared"):
            item.add_marker(pytest.mark.xdist_group("shared"))
'''
TESTS = "".join(f"def test_shared_{i}():\n    pass\n\n\ndef test_free_{i}():\n    pass\n\n\n" for i in range(4))


def test_the_suites_collection_hook_runs_before_xdists():
    from tests import conftest

    assert conftest.pytest_collection_modifyitems.pytest_impl.get("tryfirst") is True


def test_a_group_marked_at_collection_runs_on_one_worker(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_groups.py").write_text(TESTS)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                           "-v", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]
    workers = re.findall(r"\[(gw\d)\] .*PASSED .*::test_shared_\d(@shared)?", done.stdout)
    assert len(workers) == 4, done.stdout[-3000:]
    assert {group for _, group in workers} == {"@shared"}, "the xdist_group markers were not applied"
    assert len({worker for worker, _ in workers}) == 1, workers
