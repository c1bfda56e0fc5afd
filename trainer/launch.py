"""`alignflow train STAGE --num_processes N [--deepspeed zero2|zero3|FILE]`: start the ranks.

The stage's own command line runs again under `accelerate launch` (torchrun underneath), once
per rank; inside a rank (`LOCAL_RANK` is set) nothing is launched again. `accelerate launch ...
-m trainer.cli train STAGE ...` (or `torchrun`) started by hand reaches the same code.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

CONFIGS = Path(__file__).parent / "configs"


def deepspeed_config_file(value: str) -> str:
    """A `deepspeed` option (preset name or JSON path) as a JSON file path."""
    preset = CONFIGS / f"deepspeed_{value}.json"
    return str(preset) if preset.is_file() else value


def needs_launch(config) -> bool:
    """Whether this process must start the ranks (it is not one of them yet)."""
    return (config.num_processes > 1 or bool(config.deepspeed)) and "LOCAL_RANK" not in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(stage: str, argv: list[str], config) -> list[str]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(config.num_processes),
               "--num_machines", "1", "--main_process_port", str(_free_port()), "--dynamo_backend", "no",
               "--mixed_precision", config.mixed_precision]
    if config.deepspeed:
        command += ["--use_deepspeed", "--deepspeed_config_file", deepspeed_config_file(config.deepspeed)]
    else:
        command += ["--multi_gpu"]  # torchrun; on CPU the ranks then run over gloo (trainer/distributed.py)
    return command + ["-m", "trainer.cli", "train", stage, *argv]


def launch(stage: str, argv: list[str], config) -> int:
    """Run the stage on `config.num_processes` local ranks; returns the launcher's exit code."""
    command = launch_command(stage, argv, config)
    print(f"alignflow train {stage}: starting {config.num_processes} rank(s): {' '.join(command[2:])}", flush=True)
    return subprocess.run(command).returncode
