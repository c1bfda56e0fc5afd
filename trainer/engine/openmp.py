"""How idle OpenMP threads wait between parallel regions: set before torch loads (libgomp, the OpenMP runtime
torch ships, reads its variables once, when torch loads it).

alignflow's default is a short spin, then sleep: `OMP_WAIT_POLICY=PASSIVE` with `GOMP_SPINCOUNT=1000`.
- Spinning without bound (OpenMP's own default) makes training several times slower whenever other processes
  share the cores: a GRPO step on a busy 2-core machine took 287 s instead of 13 s (benchmarks/README.md).
- Sleeping at once (PASSIVE alone) costs a wake-up in every parallel region: a training step runs thousands of
  small ops back to back, and each one waits for the other threads to wake. 1000 spins (~10 µs; libgomp's own
  count for a team with more threads than cores) bridge the gap between two ops and still let an idle thread
  sleep. SmolLM2 SFT in bf16 on 2 cores: a median 2.52 s a step against 2.76 s with PASSIVE alone; the demo's
  SFT stage 5.5 s against 7.5 s (benchmarks/NOTES.md, "fourteenth session").

Only how idle threads wait changes, never what is computed. A caller who sets either variable gets exactly what
they set.
"""

import os

OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}


def set_openmp_defaults() -> None:
    """Put `OPENMP_DEFAULTS` in the environment, unless the caller has set either variable (then nothing changes).
    Call it before torch is imported; processes started from this one inherit it."""
    if not any(name in os.environ for name in OPENMP_DEFAULTS):
        os.environ.update(OPENMP_DEFAULTS)
