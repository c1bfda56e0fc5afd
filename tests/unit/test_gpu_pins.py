"""The GPU image's pin set (images/trainer/requirements.txt) resolves from the package index for the image's
platform, without installing anything; a conflicting pin fails. Needs the index: `-m "not network"` skips it.

The resolver is uv's (`uv pip compile`, in the dev extra), not pip's: pip resolves for another platform only
with `--only-binary=:all:` (no source distributions at all), and kfp's dependency kfp-server-api is published
as a source distribution only. uv resolves for a target platform and builds what it must; the second pass
below forbids building anything but the known pure-Python source distributions, so a native package whose
wheels do not fit the image (which `pip install` in the image would try to compile) still fails here.

Platform: the CUDA image's base, Ubuntu 24.04 (glibc 2.39, so manylinux_2_39 and older wheels install),
with its Python 3.12. manylinux_2_28 alone is too narrow: llguidance 1.7 (vllm 0.33's pin) ships
manylinux_2_31 x86_64 wheels only.
"""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT

PINS = ROOT / "images" / "trainer" / "requirements.txt"
PLATFORM = "x86_64-manylinux_2_39"  # Ubuntu 24.04's glibc (images/trainer/Dockerfile's base)
PYTHON = "3.12"
# Published as source distributions only, pure Python: building their metadata needs no compiler.
SDIST_ONLY = {"kfp-server-api"}

def uv_binary() -> str:
    try:
        import uv

        return uv.find_uv_bin()
    except ImportError:
        found = shutil.which("uv")
        if not found:
            pytest.skip("uv is not installed (it is in the dev extra: pip install -e '.[dev]')")
        return found


def compile_pins(requirements, *extra: str) -> subprocess.CompletedProcess:
    """`uv pip compile` of `requirements` for the image's platform and Python: the pinned closure on stdout."""
    command = [uv_binary(), "pip", "compile", "--no-config", "--native-tls", "--python-version", PYTHON,
               "--python-platform", PLATFORM, "--python", sys.executable, "--no-header", "--no-annotate",
               "--quiet", str(requirements), *extra]
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    if os.environ.get("PIP_INDEX_URL") and not (env.get("UV_DEFAULT_INDEX") or env.get("UV_INDEX_URL")):
        env["UV_DEFAULT_INDEX"] = os.environ["PIP_INDEX_URL"]  # a CI mirror given to pip serves uv too
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def pinned(lock: str) -> dict[str, str]:
    """{normalised name (PEP 503): version} of every `name==version` line."""
    return {re.sub(r"[-_.]+", "-", name).lower(): version
            for name, version in re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", lock, flags=re.M)}


def test_the_image_base_is_the_platform_resolved_for():
    assert "ubuntu24.04" in (ROOT / "images" / "trainer" / "Dockerfile").read_text()


@pytest.mark.network
def test_the_gpu_pin_set_resolves_for_the_image():
    started = time.perf_counter()
    first = compile_pins(PINS)
    assert first.returncode == 0, first.stderr
    closure = pinned(first.stdout)
    # Again, building nothing but the pure-Python source distributions: every other package has a wheel.
    no_build = [arg for name in sorted(set(closure) - SDIST_ONLY) for arg in ("--only-binary", name)]
    second = compile_pins(PINS, *no_build)
    assert second.returncode == 0, second.stderr
    assert pinned(second.stdout) == closure
    print(f"{len(closure)} packages resolved in {time.perf_counter() - started:.1f} s")
    top = pinned(PINS.read_text())
    assert {name: closure.get(name) for name in top} == top  # every pin is what the resolution holds
    assert "torch" in top and "vllm" in top


@pytest.mark.network
def test_a_conflicting_pin_fails(tmp_path):
    """vllm 0.33.0 requires torch 2.14.0: pinning torch 2.13.0 beside it cannot resolve."""
    broken = tmp_path / "requirements.txt"
    broken.write_text(re.sub(r"^torch==\S+", "torch==2.13.0", PINS.read_text(), flags=re.M))
    assert "torch==2.13.0" in broken.read_text()
    result = compile_pins(broken)
    assert result.returncode != 0
    assert "unsatisfiable" in result.stderr and "torch" in result.stderr, result.stderr
