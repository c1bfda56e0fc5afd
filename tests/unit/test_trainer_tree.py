"""The trainer's folders are its architecture: sub-packages in layers, each importing only those below it.

Every import statement counts, including those inside functions (as in tests/unit/test_layers.py): a
lazy import is still a dependency, and a cycle through one is still a cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Bottom to top: a sub-package (or top-level module) of trainer/ may import only those before it.
LAYERS = ["errors", "extras", "io", "tracking", "algorithms", "config", "data", "engine", "rewards", "rollout",
          "stages", "cli"]
# What trainer/algorithms/ may import: the maths is torch and the standard library only.
ALGORITHMS_MAY_IMPORT = {"torch", "__future__"} | set(sys.stdlib_module_names)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {imported trainer module: line} for every module under root/trainer."""
    paths = {module_name(p, root): p for p in sorted((root / "trainer").rglob("*.py"))}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                # `from trainer.engine import checkpoint` imports the module trainer.engine.checkpoint
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            for target in targets:
                found = resolve(target) if target.split(".")[0] == "trainer" else None
                if found and found != name:
                    edges.setdefault(found, node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import cycles (strongly connected components of more than one module), each sorted."""
    index, low, stack, found = {}, {}, [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "trainer"


def upward_imports(graph: dict[str, dict[str, int]], root: Path) -> list[str]:
    """`file:line module -> module` for each import of a sub-package at or above the importer's own layer."""
    bad = []
    for name, edges in graph.items():
        here = layer_of(name)
        for target, line in edges.items():
            there = layer_of(target)
            if here == there or here == "trainer" or there == "trainer":
                continue
            if here not in LAYERS or there not in LAYERS or LAYERS.index(there) > LAYERS.index(here):
                bad.append(f"{name} -> {target} (line {line}): {here}/ may not import {there}/")
    return sorted(bad)


def foreign_imports(root: Path, package: str, allowed: set[str]) -> list[str]:
    bad = []
    for path in sorted((root / "trainer" / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [])
            for name in names:
                top = name.split(".")[0]
                if top not in allowed and not name.startswith(f"trainer.{package}"):
                    bad.append(f"{path.relative_to(root)}:{node.lineno} imports {name}")
    return bad


def test_no_import_cycles_in_the_trainer():
    assert cycles(import_graph(REPO)) == []


def test_every_sub_package_imports_only_the_layers_below_it():
    """The order in LAYERS is the architecture (docs/development.md): it also rules out cycles between sub-packages."""
    top = {p.stem if p.suffix else p.name for p in (REPO / "trainer").iterdir()
           if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert top == set(LAYERS), f"add a new sub-package to LAYERS (or remove a gone one): {sorted(top ^ set(LAYERS))}"
    assert upward_imports(import_graph(REPO), REPO) == []


def test_algorithms_import_only_torch():
    assert foreign_imports(REPO, "algorithms", ALGORITHMS_MAY_IMPORT) == []


def test_the_engine_imports_no_stage():
    """engine/ runs any stage; it never knows one (the stages import the engine, not the reverse)."""
    graph = import_graph(REPO)
    assert [f"{m} -> {t}" for m, edges in graph.items() if layer_of(m) == "engine"
            for t in edges if layer_of(t) in ("stages", "rewards", "rollout", "cli")] == []


def test_the_unit_tests_mirror_the_package_tree():
    """The unit tests of `trainer/X/y.py` live in tests/unit/trainer/X/: every folder there is a package of trainer/."""
    tests = REPO / "tests" / "unit" / "trainer"
    folders = [p.relative_to(tests) for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__"]
    assert folders and [str(f) for f in folders if not (REPO / "trainer" / f / "__init__.py").exists()] == []
    assert [p.name for p in tests.glob("test_*.py")] == [], "put a unit test in the folder of the module it tests"


@pytest.fixture
def tree(tmp_path):
    def write(files: dict[str, str]) -> Path:
        for rel, text in files.items():
            path = tmp_path / "trainer" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return tmp_path
    return write


def test_the_checks_catch_a_cycle_an_upward_import_and_a_foreign_import(tree):
    """Each check can fail: a planted lazy cycle, an engine import of a stage, a numpy import in algorithms/."""
    root = tree({
        "__init__.py": "", "engine/__init__.py": "", "stages/__init__.py": "", "algorithms/__init__.py": "",
        "engine/runner.py": "def f():\n    from trainer.stages import sft\n",
        "stages/sft.py": "from trainer.engine import runner\n",
        "algorithms/losses.py": "import torch\nimport numpy\nfrom trainer.algorithms import logprobs\n",
        "algorithms/logprobs.py": "import math\n",
    })
    graph = import_graph(root)
    assert cycles(graph) == [["trainer.engine.runner", "trainer.stages.sft"]]
    assert upward_imports(graph, root) == [
        "trainer.engine.runner -> trainer.stages.sft (line 2): engine/ may not import stages/"]
    assert foreign_imports(root, "algorithms", ALGORITHMS_MAY_IMPORT) == ["trainer/algorithms/losses.py:2 imports numpy"]
