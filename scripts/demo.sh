#!/usr/bin/env bash
# Build a tiny model offline and run the whole post-training pipeline locally:
# SFT -> reward model -> GRPO -> evaluate -> promote (@champion in a local MLflow registry).
#   bash scripts/demo.sh [OUT_DIR]      (default: demo-output/)
# Sets up .venv first (scripts/setup.sh); with PYTHON=/path/to/python it uses that interpreter's
# packages as they are instead. The console gets a line per task; each task's full log goes to
# OUT_DIR/logs/<task>.log (VERBOSE=1 shows them live).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-demo-output}
if [[ -z "${PYTHON:-}" ]]; then
    bash scripts/setup.sh
    PYTHON=.venv/bin/python
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p "$OUT"
# A fresh MLflow store per demo folder (sqlite), unless the caller points at a server.
export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-sqlite:///$(cd "$OUT" && pwd)/mlflow.db}
"$PYTHON" -m pipelines.cli model init-tiny --out "$OUT/tiny-model" >"$OUT/init-tiny.log" 2>&1 \
    || { cat "$OUT/init-tiny.log" >&2; exit 1; }
"$PYTHON" -m pipelines.cli pipeline run --local --config pipelines/configs/demo.yaml --output "$OUT" \
    --base-model "$OUT/tiny-model" ${VERBOSE:+--verbose}
