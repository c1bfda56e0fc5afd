"""`python -m tests.paced_cli train STAGE ...`: the trainer's command line with every optimizer step made to last at
least `STEP_SECONDS` longer (a sleep before it; the weights it computes are the same).

A test that signals a run after its step N must reach the run before the run ends. The tiny model's steps take a
few milliseconds, so an unpaced run can finish between its progress line and the signal (CI, stop 52: the reward
stage ran its steps 4-8 in the 27 ms that the SIGTERM test waited after the step-3 line)."""

import sys
import time

from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainer.cli.main import main

STEP_SECONDS = 0.1

register_optimizer_step_pre_hook(lambda *_: time.sleep(STEP_SECONDS))
sys.exit(main())
