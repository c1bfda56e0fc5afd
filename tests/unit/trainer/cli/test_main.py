"""`alignflow train`'s own list of stage names (kept so that `--help` loads no torch) is the stage registry's,
and the registry loads only the stage it is asked for."""

import subprocess
import sys

from trainer.cli.main import STAGE_NAMES
from trainer.stages import STAGES, stage_parts


def test_the_train_command_offers_exactly_the_registered_stages():
    assert sorted(STAGE_NAMES) == sorted(STAGES)


def test_every_registered_stage_resolves_to_its_config_and_run_function():
    for stage in STAGES:
        config_cls, run = stage_parts(stage)
        assert config_cls.stage == stage and run.__name__ == STAGES[stage][3]


def test_a_process_that_runs_one_stage_imports_no_other_stage():
    """Each process of a run (the CLI, every rank, a pipeline task) pays for the imports of its own stage only;
    `trainer.stages.promote` (the promote task, rollback) loads no training stage."""
    modules = {stage: module for stage, (module, *_) in STAGES.items()}
    code = ("import sys\nfrom trainer.stages import promote, stage_parts\n"
            f"before = sorted(m for m in {sorted(modules.values())!r} if m in sys.modules)\n"
            "stage_parts('sft')\n"
            f"after = sorted(m for m in {sorted(modules.values())!r} if m in sys.modules)\n"
            "print(before, after)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[0] == f"[] [{modules['sft']!r}]"
