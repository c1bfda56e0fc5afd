"""`python -m trainer.cli ...`: the trainer's command line (trainer/cli/main.py)."""

import sys

from trainer.cli.main import main

sys.exit(main())
