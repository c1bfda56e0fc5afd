"""The shell scripts pick the project's .venv interpreter when it exists (a fresh clone after
scripts/setup.sh has torch only there), python3 otherwise, and an explicit PYTHON always."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def fake_python(path: Path, name: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "{name} $*"\nexit 3\n')  # fail at once: the script stops there
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("script", ["get_smollm2.sh", "get_minilm.sh", "gpu_check.sh"])
def test_scripts_use_the_venv_then_python3_and_honour_PYTHON(script, tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / script, repo / "scripts" / script)
    bin_dir = tmp_path / "bin"
    fake_python(bin_dir / "python3", "path-python3")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", ALIGNFLOW_CACHE=str(tmp_path / "cache"))

    def first_call(**extra) -> str:
        result = subprocess.run(["bash", str(repo / "scripts" / script), str(tmp_path / "out")],
                                env={**env, **extra}, capture_output=True, text=True, timeout=30)
        assert result.returncode != 0
        return (result.stdout + result.stderr).strip().splitlines()[-1]

    assert first_call().startswith("path-python3 ")
    fake_python(repo / ".venv" / "bin" / "python", "venv-python")
    assert first_call().startswith("venv-python ")
    explicit = fake_python(tmp_path / "chosen", "chosen-python")
    assert first_call(PYTHON=str(explicit)).startswith("chosen-python ")


def test_gpu_check_runs_a_valid_config_of_every_stage(tmp_path):
    """What scripts/gpu_check.py asks of each stage, on either device and layout, is a config the stage accepts
    (its dry run trains SFT only: tests/e2e/test_ranks.py)."""
    import importlib.util

    from trainer.config.options import parse_config
    from trainer.stages import stage_parts

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    for stage in gpu_check.STAGES:
        for cuda in (False, True):
            for extra in ([], ["--num_processes", "2", "--deepspeed", "zero3"]):
                command = gpu_check.train_command(stage, tmp_path / "model", tmp_path / stage, 3, cuda, tmp_path, extra)
                assert command[3:5] == ["train", stage]
                config = parse_config(stage_parts(stage)[0], command[5:])
                assert (config.max_steps, config.bf16, config.num_processes) == (3, cuda, 2 if extra else 1)


def test_coverage_scope_traces_the_projects_imports_and_not_other_packages(tmp_path):
    """scripts/coverage_scope.py: under a tracer, importing another package runs untraced; importing the
    project's own module, and the importing frame's next lines, stay traced."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\n"
        f"sys.path[:0] = [{str(REPO / 'scripts')!r}, {str(REPO)!r}]\n"
        "import coverage_scope\n"
        "seen = set()\n"
        "def trace(frame, event, arg):\n"
        "    seen.add((frame.f_code.co_filename, event, frame.f_lineno))\n"
        "    return trace\n"
        "def body():\n"
        "    import xml.dom.minidom  # not imported at start-up\n"
        "    after = 1\n"
        "    import trainer.errors\n"
        "    return after\n"
        "coverage_scope._untraced_imports()\n"
        "sys.settrace(trace)\n"
        "body()\n"
        "sys.settrace(None)\n"
        "files = {f for f, _, _ in seen}\n"
        "print(any('minidom' in f for f in files), any(f.endswith('trainer/errors.py') for f in files),\n"
        "      (__file__, 'line', 10) in seen)  # `after = 1`, the line after the untraced import\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True"]
