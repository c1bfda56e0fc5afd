"""The training stages by name: each stage's config class and its `run_<stage>(config)` function.

The CLI, the KFP components and the multi-node launcher all look stages up here, so this
registry sits in the library, below every user of it. A stage's module (and torch, transformers,
datasets with it) is imported only when that stage is asked for: a process that runs one stage,
or only `trainer.stages.promote`, does not pay for the others.
"""

from __future__ import annotations

import importlib

# stage -> (module, config class, run function)
STAGES = {
    "sft": ("trainer.stages.sft", "SFTConfig", "run_sft"),
    "reward": ("trainer.stages.reward_model", "RewardConfig", "run_reward"),
    "dpo": ("trainer.stages.dpo", "DPOConfig", "run_dpo"),
    "grpo": ("trainer.stages.rl.grpo", "GRPOConfig", "run_grpo"),
    "ppo": ("trainer.stages.rl.ppo", "PPOConfig", "run_ppo"),
}


def stage_parts(stage: str):
    """The config class and the `run_<stage>(config)` function of a stage."""
    module, config_cls, run = STAGES[stage]
    loaded = importlib.import_module(module)
    return getattr(loaded, config_cls), getattr(loaded, run)
