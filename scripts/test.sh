#!/usr/bin/env bash
# Set up .venv and run the whole test suite (unit + integration; GPU tests skip without a GPU).
#   bash scripts/test.sh [pytest args]     e.g.  bash scripts/test.sh -m "not integration"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -ra "$@"
