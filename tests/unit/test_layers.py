"""Layers point down only: pipelines -> components -> trainer (-> trainer/rollout, the only vLLM importer).

Every import statement counts, including those inside functions: a lazy import up the layers is
still a dependency up the layers (it only fails later, in a container without the upper package).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# package -> the top-level packages its modules must never import
FORBIDDEN = {"trainer": {"components", "pipelines", "kfp"}, "components": {"pipelines"}}
VLLM_HOME = "trainer/rollout/"


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in a file, at any depth of the tree."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            found.append((node.lineno, node.args[0].value.split(".")[0]))
    return found


def _is_dynamic_import(node: ast.Call) -> bool:
    """`importlib.import_module("x")` / `__import__("x")` with a literal name."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return (name in ("import_module", "__import__") and bool(node.args) and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str))


def python_files(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (REPO / package).rglob("*.py"))


def violations(files: list[Path]) -> list[str]:
    bad = []
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        forbidden = FORBIDDEN.get(rel.split("/")[0], set())
        for line, package in imported_packages(path):
            if package in forbidden:
                bad.append(f"{rel}:{line} imports {package}")
            if package == "vllm" and not rel.startswith(VLLM_HOME):
                bad.append(f"{rel}:{line} imports vllm (only {VLLM_HOME} may)")
    return bad


def test_layers_point_down_and_only_the_rollout_package_imports_vllm():
    files = python_files("trainer", "components", "pipelines")
    assert len(files) > 30, "the walk found too few modules to be checking anything"
    assert violations(files) == []


@pytest.mark.parametrize(("rel", "source", "expected"), [
    ("trainer/x.py", "def f():\n    from pipelines import run\n", "trainer/x.py:2 imports pipelines"),
    ("trainer/x.py", "import components.runtime\n", "trainer/x.py:1 imports components"),
    ("trainer/x.py", "import importlib\nimportlib.import_module('kfp.dsl')\n", "trainer/x.py:2 imports kfp"),
    ("components/x.py", "class A:\n    def f(self):\n        import pipelines.kubernetes\n",
     "components/x.py:3 imports pipelines"),
    ("pipelines/x.py", "def f():\n    import vllm\n", "pipelines/x.py:2 imports vllm (only trainer/rollout/ may)"),
    ("trainer/grpo_x.py", "from vllm import LLM\n", "trainer/grpo_x.py:1 imports vllm (only trainer/rollout/ may)"),
])
def test_the_check_catches_an_import_up_the_layers(tmp_path, monkeypatch, rel, source, expected):
    """The check itself can fail: each planted import, nested or dynamic, is reported."""
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    path = tmp_path / rel
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert violations([path]) == [expected]


def test_allowed_imports_pass(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    path = tmp_path / "trainer/rollout/engine.py"
    path.parent.mkdir(parents=True)
    path.write_text("from vllm import LLM\nfrom . import base\nimport trainer.config.options\n")
    assert violations([path]) == []


@pytest.mark.parametrize(("module", "absent"), [
    ("trainer.cli.main", ("pipelines", "components", "kfp")),
    ("pipelines.cli", ("kfp", "components")),  # the console script reaches KFP only for `pipeline` commands
])
def test_importing_the_entry_point_loads_no_upper_layer(module, absent):
    code = (f"import sys, {module}; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {absent!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


MAX_FUNCTION_LINES = 120


def test_no_trainer_function_is_longer_than_a_screenful_or_two():
    """Stage loops read as their algorithm: phases are functions, none over 120 lines (issue 13)."""
    long = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long
