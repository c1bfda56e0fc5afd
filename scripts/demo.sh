#!/usr/bin/env bash
# Set up .venv, build a tiny model offline and fine-tune it on the built-in demo data.
#   bash scripts/demo.sh [OUT_DIR]      (default: demo-output/)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-demo-output}
bash scripts/setup.sh
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
.venv/bin/alignflow model init-tiny --out "$OUT/tiny-model"
.venv/bin/alignflow train sft --config trainer/configs/sft_demo.yaml \
    --model "$OUT/tiny-model" --output_dir "$OUT/sft"
echo
echo "Done. The fine-tuned model, its manifest (alignflow.json) and metrics (metrics.jsonl): $OUT/sft"
echo "With MLFLOW_TRACKING_URI set (e.g. sqlite:///$OUT/mlflow.db) the run is logged to MLflow;"
echo "browse it with: .venv/bin/mlflow ui --backend-store-uri sqlite:///$OUT/mlflow.db"
