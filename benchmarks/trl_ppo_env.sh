#!/usr/bin/env bash
# The reference venv for benchmarks/ppo.py: TRL 1.12.0, the last release that ships `PPOTrainer`
# (as trl.experimental.ppo; 0.28.0 is the last with trl/trainer/ppo_trainer.py, a shim over it;
# 1.13 removed it), beside the same torch and transformers as alignflow, so both run the same model code.
#
#     bash benchmarks/trl_ppo_env.sh [VENV]        # default /work/venvs/trl-ppo
#
# torch first, pinned, so that pip takes the CPU build on this disk and not a CUDA one.
set -euo pipefail
VENV=${1:-/work/venvs/trl-ppo}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q trl==1.12.0 transformers==5.19.0 accelerate==1.15.0 datasets==5.2.0 torch==2.13.0
"$VENV/bin/python" -c "from trl.experimental.ppo import PPOTrainer; import trl, transformers, torch; \
print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
