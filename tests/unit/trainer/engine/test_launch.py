"""`alignflow train --num_processes N`: how the in-process launcher's outcomes become exit codes.

Accelerate's launcher is faked here (it would start real ranks); the real ranks, their SIGTERM path (exit 75) and
their weights are tests/e2e/test_ranks.py's.
"""

import os
import signal
from types import SimpleNamespace

import accelerate.commands.launch as accelerate_launch
import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from trainer.engine import launch
from trainer.engine.preemption import PREEMPTED_EXIT_CODE

CONFIG = SimpleNamespace(num_processes=2, deepspeed="zero2", mixed_precision="no")


def run_with(monkeypatch, outcome) -> tuple[int, object]:
    """launch() with accelerate's `launch_command` replaced by `outcome(args)`; returns its code and the args."""
    seen = []

    def fake(args):
        seen.append(args)
        signal.signal(signal.SIGTERM, lambda *_: None)  # as torchrun's agent does, and leaves it
        os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun does for the ranks, in the launcher's environment
        outcome(args)

    monkeypatch.setattr(accelerate_launch, "launch_command", fake)
    return launch.launch("sft", ["--model", "m"], CONFIG), seen[0]


def failure(rank: int, exitcode: int) -> ProcessFailure:
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="/nonexistent")


def test_the_command_accelerate_launch_would_get_is_parsed_by_its_own_parser(monkeypatch, capsys):
    code, args = run_with(monkeypatch, lambda args: None)
    assert code == 0
    assert args.num_processes == 2 and args.use_deepspeed and args.module
    assert args.deepspeed_config_file.endswith("deepspeed_zero2.json")
    assert args.training_script == "trainer.cli" and args.training_script_args == ["train", "sft", "--model", "m"]
    assert "starting 2 rank(s): accelerate launch --num_processes 2" in capsys.readouterr().out


def test_a_stop_signal_is_75_and_the_handlers_and_environment_are_restored(monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = signal.getsignal(signal.SIGTERM)

    def stopped(args):
        raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)

    code, _ = run_with(monkeypatch, stopped)
    assert code == PREEMPTED_EXIT_CODE
    assert "stopped by SIGTERM" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
    assert "OMP_NUM_THREADS" not in os.environ


@pytest.mark.parametrize(("exitcode", "expected", "said"), [(2, 2, "exit code 2"), (-9, 1, "SIGKILL")])
def test_a_failed_rank_passes_its_exit_code_on(monkeypatch, capsys, exitcode, expected, said):
    def failed(args):
        raise ChildFailedError("trainer.cli", {1: failure(1, exitcode), 0: failure(0, -15)})

    code, _ = run_with(monkeypatch, failed)
    assert code == expected
    err = capsys.readouterr().err
    assert f"rank 1 failed ({said})" in err
