"""The training stages: name -> (module, config class, entry point).

The CLI, the KFP components and the multi-node launcher all look stages up here, so this
registry sits in the library, below every user of it.
"""

from __future__ import annotations

import importlib

# stage -> (module, config class, entry point)
STAGES = {
    "sft": ("trainer.sft", "SFTConfig", "run_sft"),
    "reward": ("trainer.reward", "RewardConfig", "run_reward"),
    "dpo": ("trainer.dpo", "DPOConfig", "run_dpo"),
    "grpo": ("trainer.grpo", "GRPOConfig", "run_grpo"),
    "ppo": ("trainer.ppo", "PPOConfig", "run_ppo"),
}


def stage_parts(stage: str):
    """The config class and the `run_<stage>(config)` function of a stage (imported on demand)."""
    module_name, config_name, run_name = STAGES[stage]
    module = importlib.import_module(module_name)
    return getattr(module, config_name), getattr(module, run_name)
