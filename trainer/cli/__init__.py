"""The `alignflow` command line of the trainer (`python -m trainer.cli`): train, eval, promote, model, chat.

Before anything loads torch (OpenMP reads this once, when it loads): idle OpenMP threads sleep
instead of spinning. Spinning makes training several times slower whenever other processes
share the cores (a GRPO step on a busy 2-core machine: 287 s instead of 50 s; benchmarks/README.md).
Only how idle threads wait changes, never what is computed. A value set by the caller wins.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
