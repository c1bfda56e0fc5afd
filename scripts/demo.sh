#!/usr/bin/env bash
# Set up .venv, build a tiny model offline and run the whole post-training pipeline locally:
# SFT -> reward model -> GRPO -> evaluate -> promote (@champion in a local MLflow registry).
#   bash scripts/demo.sh [OUT_DIR]      (default: demo-output/)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-demo-output}
bash scripts/setup.sh
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
# A fresh MLflow store per demo folder (sqlite), unless the caller points at a server.
export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-sqlite:///$(pwd)/$OUT/mlflow.db}
mkdir -p "$OUT"
.venv/bin/alignflow model init-tiny --out "$OUT/tiny-model"
.venv/bin/alignflow pipeline run --local --config pipelines/configs/demo.yaml --output "$OUT" \
    --base-model "$OUT/tiny-model"
echo
echo "Registered model 'alignflow-demo':"
.venv/bin/python - <<'PY'
import os
from mlflow import MlflowClient
model = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_registered_model("alignflow-demo")
print("  aliases:", {k: str(v) for k, v in model.aliases.items()})
PY
echo "Task outputs (checkpoints, reports, metrics): $OUT/pipeline-root"
echo "Browse the runs and the registry: .venv/bin/mlflow ui --backend-store-uri $MLFLOW_TRACKING_URI"
