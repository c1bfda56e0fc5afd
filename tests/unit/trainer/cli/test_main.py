"""`alignflow train`'s own list of stage names (kept so that `--help` loads no torch) is the stage registry's."""

from trainer.cli.main import STAGE_NAMES
from trainer.stages import STAGES


def test_the_train_command_offers_exactly_the_registered_stages():
    assert sorted(STAGE_NAMES) == sorted(STAGES)
