#!/usr/bin/env bash
# GPU readiness (issue 17): pytest -m gpu + a short throughput run of every stage -> one JSON summary.
#   bash scripts/gpu_check.sh [--out gpu_check.json] [--steps 20]     on a CUDA machine (< 8 minutes)
#   bash scripts/gpu_check.sh --dry-run                               the same sequence on the CPU
set -euo pipefail
cd "$(dirname "$0")/.."
# PYTHON when set, else the project's .venv, else python3 from PATH.
PY=${PYTHON:-}
[[ -n "$PY" ]] || { [[ -x .venv/bin/python ]] && PY=.venv/bin/python; } || PY=python3
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$PY" scripts/gpu_check.py "$@"
