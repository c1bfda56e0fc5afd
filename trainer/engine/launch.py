"""`alignflow train STAGE --num_processes N [--deepspeed zero2|zero3|FILE]`: start the ranks.

The stage's own command line runs again once per rank, started by accelerate's launcher (torchrun's agent
underneath) inside this process: the command `accelerate launch` would be given, parsed by accelerate's own
parser, so the ranks get the environment `accelerate launch` gives them without a launcher process of its own
(one Python start-up, torch's import included, fewer: ~4 s a run on a 2-core CPU). Inside a rank (`LOCAL_RANK` is
set) nothing is launched again. `accelerate launch ... -m trainer.cli train STAGE ...` (or `torchrun`) started by
hand reaches the same code.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # trainer/configs


def deepspeed_config_file(value: str) -> str:
    """A `deepspeed` option (preset name or JSON path) as a JSON file path."""
    preset = CONFIGS / f"deepspeed_{value}.json"
    return str(preset) if preset.is_file() else value


def needs_launch(config) -> bool:
    """Whether this process must start the ranks (it is not one of them yet)."""
    return (config.num_processes > 1 or bool(config.deepspeed)) and "LOCAL_RANK" not in os.environ


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(stage: str, argv: list[str], config) -> list[str]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(config.num_processes),
               "--num_machines", "1", "--main_process_port", str(free_port()), "--dynamo_backend", "no",
               "--mixed_precision", config.mixed_precision]
    if config.deepspeed:
        command += ["--use_deepspeed", "--deepspeed_config_file", deepspeed_config_file(config.deepspeed)]
    else:
        command += ["--multi_gpu"]  # torchrun; on CPU the ranks then run over gloo (trainer/engine/distributed.py)
    return command + ["-m", "trainer.cli", "train", stage, *argv]


def launch(stage: str, argv: list[str], config) -> int:
    """Run the stage on `config.num_processes` local ranks; returns 0, the first failed rank's exit code, or 75.

    The ranks run in sessions of their own (torchrun's), so a Ctrl-C in a terminal reaches them only through this
    process. A SIGTERM, SIGINT, SIGHUP or SIGQUIT here goes to the agent, which passes it to every rank and waits
    up to 30 s for them; the ranks stop at the same step with a checkpoint (`trainer.engine.preemption`) and
    this returns 75."""
    from accelerate.commands.launch import launch_command as accelerate_launch
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from trainer.engine.preemption import PREEMPTED_EXIT_CODE

    command = launch_command(stage, argv, config)
    print(f"alignflow train {stage}: starting {config.num_processes} rank(s): accelerate launch "
          f"{' '.join(command[3:])}", flush=True)
    args = launch_command_parser().parse_args(command[3:])
    # The agent sets its own handlers (they raise SignalException) and leaves them, and torchrun sets OMP_NUM_THREADS
    # for the ranks in this process's environment: put both back after it (a KFP task goes on after its ranks).
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    environment = dict(os.environ)
    try:
        accelerate_launch(args)
        return 0
    except SignalException as stopped:
        print(f"alignflow train {stage}: the ranks were stopped by {signal.Signals(stopped.sigval).name}; exit code "
              f"{PREEMPTED_EXIT_CODE}: run it again with `resume_from_checkpoint auto` to continue.",
              file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        how = failure.signal_name() if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        print(f"alignflow train {stage}: rank {rank} failed ({how}); its error is in the output above.",
              file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 1
    finally:
        os.environ.clear()
        os.environ.update(environment)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in previous.items():
                signal.signal(sig, handler)
