"""`alignflow train STAGE --num_processes N [--deepspeed zero2|zero3|FILE]`: start the ranks.

The stage's own command line runs again under `accelerate launch` (torchrun underneath), once
per rank; inside a rank (`LOCAL_RANK` is set) nothing is launched again. `accelerate launch ...
-m trainer.cli train STAGE ...` (or `torchrun`) started by hand reaches the same code.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
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
    """Run the stage on `config.num_processes` local ranks; returns the launcher's exit code.

    A SIGTERM or SIGINT to this process goes on, once, to `accelerate launch` (torchrun's agent), which
    passes it to every rank; the ranks stop at the same step with a checkpoint (`trainer.engine.preemption`) and
    this returns 75. The launcher runs in a session of its own, so that a Ctrl-C in a terminal reaches it
    only through this process (twice would make the agent cut its wait for the ranks short)."""
    from trainer.engine.preemption import PREEMPTED_EXIT_CODE, STOP_SIGNALS

    command = launch_command(stage, argv, config)
    print(f"alignflow train {stage}: starting {config.num_processes} rank(s): {' '.join(command[2:])}", flush=True)
    child = subprocess.Popen(command, start_new_session=True)
    received: list[str] = []

    def forward(signum: int, _frame: object) -> None:
        if not received:
            received.append(signal.Signals(signum).name)
            child.send_signal(signum)

    main = threading.current_thread() is threading.main_thread()  # (handlers can only be set there)
    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS} if main else {}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received and code:
        # The agent reports its own exit (a SignalException), not the ranks' code 75.
        print(f"alignflow train {stage}: the ranks were stopped by {received[0]} (launcher exit code {code}); exit "
              f"code {PREEMPTED_EXIT_CODE}: run it again with `resume_from_checkpoint auto` to continue.",
              file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    return code
