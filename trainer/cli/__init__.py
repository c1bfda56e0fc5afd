"""The `alignflow` command line of the trainer (`python -m trainer.cli`): train, eval, promote, model, chat.

Before anything loads torch (OpenMP reads these once, when it loads): idle OpenMP threads spin ~10 µs, then
sleep (`trainer.engine.openmp` says why). Only how idle threads wait changes, never what is computed. A value
set by the caller wins.
"""

from trainer.engine.openmp import set_openmp_defaults

set_openmp_defaults()
