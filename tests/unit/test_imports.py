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


# What each light command runs; none of them needs torch, datasets or a stage's module.
LIGHT_COMMANDS = {
    "check-inputs": (  # the pipeline's first task: every stage section, evaluation and the gate, checked
        "from components import inputs\n"
        "inputs.check_parameters('grpo', {'sft': {'packing': True}, 'reward': {'truncation_mode': 'drop'}, "
        "'dpo': {'loss_type': 'robust', 'label_smoothing': 0.1}, 'grpo': {'num_generations': 4, 'loss_type': 'bnpo', "
        "'advantage_estimator': 'rloo', 'reward_funcs': ['exact_answer', 'answer_format']}, 'ppo': {'ppo_epochs': 2}}, "
        "{'reward_funcs': ['exact_answer']}, {'max_steps': 3, 'learning_rate': 0.0, 'num_generations': 0}, 'm', "
        "'accuracy', 'auto')"),
    **{f"alignflow {' '.join(argv)} --help": (
        "import contextlib, io\nfrom trainer.cli.main import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as help:\n"
        f"    main({[*argv, '--help']!r})\n"
        f"assert {flag!r} in help.getvalue(), help.getvalue()")
       for argv, flag in [(["train", "grpo"], "--advantage_estimator"), (["eval"], "--baseline_model")]},
}


@pytest.mark.parametrize("command", LIGHT_COMMANDS)
def test_light_commands_start_without_torch(command):
    """Checking a pipeline's parameters (its first task, seconds before any training) and a stage's `--help`
    read the stage configs (trainer/config/), not the stages: no torch, datasets or stage module loads."""
    import subprocess
    import sys

    heavy = ["torch", "datasets", "trainer.stages.sft", "trainer.stages.rl.grpo", "trainer.stages.promote"]
    code = f"{LIGHT_COMMANDS[command]}\nimport sys\nprint([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[-2] == "[]", out
