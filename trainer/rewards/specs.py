"""Checking reward-function specs before anything runs, without running the user's code.

A reward spec (`reward_funcs` of GRPO, PPO and `alignflow eval`) is a built-in name, `regex:<pattern>`,
`length:<N>`, an import path `pkg.module:function`, or a reward-model checkpoint (a folder, an s3://
prefix or a hub id). `trainer.rewards.functions.load_reward_function` imports an import path, which *executes
that module's code in the trainer process*. `check_reward_spec` finds out whether the spec will load
without executing it: the module is located with `importlib.util.find_spec` (which imports its parent
packages, not the module itself) and its source is parsed with `ast` for a top-level definition of the
name (a `def`, a class, an assignment or an import of it).

`ALIGNFLOW_ALLOWED_REWARD_MODULES` (comma-separated module names) restricts import paths to those
modules and their submodules, e.g. `trainer.rewards.functions,my_company.rewards`; unset, any module is
allowed. It is read from the environment of the process that checks (the pipeline's first task, the
`alignflow` command), never from a config a pipeline user can edit (docs/reliability.md).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from pathlib import Path

from trainer.errors import ConfigError
from trainer.rewards.rules import BUILTIN_REWARDS, PARAMETRISED_REWARDS

ALLOWLIST_ENV = "ALIGNFLOW_ALLOWED_REWARD_MODULES"


def allowed_modules() -> list[str] | None:
    """The module names of `ALIGNFLOW_ALLOWED_REWARD_MODULES`, or None when unset (no restriction)."""
    value = os.environ.get(ALLOWLIST_ENV, "").strip()
    return [m.strip() for m in value.split(",") if m.strip()] if value else None


def check_reward_specs(specs: list[str], field: str = "reward_funcs") -> None:
    for spec in specs:
        check_reward_spec(spec, field)


def check_reward_spec(spec: str, field: str = "reward_funcs") -> None:
    """Raise a one-line ConfigError naming `field` and the spec when it cannot load (or is not allowed)."""
    if spec in BUILTIN_REWARDS:
        return
    name, sep, arg = spec.partition(":")
    if sep and name in PARAMETRISED_REWARDS:
        _check_parametrised(spec, name, arg, field)
        return
    if sep and name.endswith(".py"):
        raise ConfigError(f"`{field}` entry {spec!r}: reward functions are loaded by import path, not from a file. "
                          f"Put the folder of {Path(name).name} on PYTHONPATH (the trainer image's) and give "
                          f"`{Path(name).stem}:{arg}`.")
    if sep and not spec.startswith("s3:") and "/" not in name:
        _check_import_path(spec, name, arg, field)
        return
    local = spec.startswith((".", "/", "~")) or ("/" not in spec and "://" not in spec)  # not a hub id org/name
    if local and not Path(spec).expanduser().exists():
        raise ConfigError(f"`{field}` entry {spec!r}: neither a built-in reward nor a reward-model folder. Give a checkpoint folder (the "
                          f"output of `alignflow train reward`), a built-in ({', '.join(BUILTIN_REWARDS)}, "
                          "regex:<pattern>, length:<N>, soft_overlong_punishment:<max>:<cache>) or an import path "
                          "`pkg.module:function`.")
    # A folder, s3:// prefix or hub id: a reward model, which its loader checks before the policy loads.


def _check_parametrised(spec: str, name: str, arg: str, field: str) -> None:
    if name == "regex":
        try:
            re.compile(arg)
        except re.error as err:
            raise ConfigError(f"`{field}` entry {spec!r}: the pattern is not a valid regular expression "
                              f"({err}).") from None
    elif name == "soft_overlong_punishment":
        try:
            PARAMETRISED_REWARDS[name](arg)
        except ConfigError as err:
            raise ConfigError(f"`{field}` entry {spec!r}: {err}") from None
    elif not arg.isdigit() or int(arg) < 1:
        raise ConfigError(f"`{field}` entry {spec!r}: length:<N> takes a whole number of characters N >= 1, "
                          "e.g. length:200.")


def _check_import_path(spec: str, module: str, attr: str, field: str) -> None:
    if not module or not attr or not attr.isidentifier():
        raise ConfigError(f"`{field}` entry {spec!r} is not an import path: write `pkg.module:function`.")
    allowed = allowed_modules()
    if allowed is not None and not any(module == m or module.startswith(m + ".") for m in allowed):
        raise ConfigError(f"`{field}` entry {spec!r}: module {module!r} is not in {ALLOWLIST_ENV} "
                          f"({', '.join(allowed)}). Use a reward function from those modules, or ask whoever "
                          "deploys alignflow to allow the module.")
    try:
        found = importlib.util.find_spec(module)  # imports the parent packages, not the module
    except (ImportError, ValueError) as err:
        found, why = None, f"{type(err).__name__}: {err}"
    else:
        why = "no such module"
    if found is None:
        raise ConfigError(f"`{field}` entry {spec!r}: cannot find module {module!r} ({why}). Check the spelling, "
                          "and that the package is installed (in the trainer image, for a pipeline).")
    defined = _top_level_names(found.origin)
    if defined is not None and attr not in defined:
        raise ConfigError(f"`{field}` entry {spec!r}: module {module!r} ({found.origin}) defines no `{attr}` at "
                          "top level. Check the function's name.")


def _top_level_names(origin: str | None) -> set[str] | None:
    """Names a Python source file binds at top level, or None when that cannot be known without running
    it (no source file, a module `__getattr__`, a star import, a syntax error the import will report)."""
    if not origin or not origin.endswith(".py") or not Path(origin).is_file():
        return None
    try:
        tree = ast.parse(Path(origin).read_text(encoding="utf-8", errors="replace"))
    except SyntaxError:
        return None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if any(a.name == "*" for a in node.names):
                return None
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If | ast.Try | ast.With):  # definitions under `if`/`try`: count them, unchecked
            names.update(n.name for n in ast.walk(node) if isinstance(n, ast.FunctionDef | ast.ClassDef))
            names.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    return None if "__getattr__" in names else names
