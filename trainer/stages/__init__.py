"""The training stages by name: each stage's config class and its `run_<stage>(config)` function.

The CLI, the KFP components and the multi-node launcher all look stages up here, so this
registry sits in the library, below every user of it. A stage's module (and torch, transformers,
datasets with it) is imported only when that stage is asked for: a process that runs one stage,
or only `trainer.stages.promote`, does not pay for the others. A stage's config class lives in
`trainer/config/`, without torch, so `stage_config` checks a config (`alignflow pipeline validate`,
the pipeline's check-inputs task) without loading any stage.
"""

from __future__ import annotations

import importlib

# stage -> (stage module, config module, config class, run function)
STAGES = {
    "sft": ("trainer.stages.sft", "trainer.config.sft_config", "SFTConfig", "run_sft"),
    "reward": ("trainer.stages.reward_model", "trainer.config.reward_config", "RewardConfig", "run_reward"),
    "dpo": ("trainer.stages.dpo", "trainer.config.dpo_config", "DPOConfig", "run_dpo"),
    "grpo": ("trainer.stages.rl.grpo", "trainer.config.rl_config", "GRPOConfig", "run_grpo"),
    "ppo": ("trainer.stages.rl.ppo", "trainer.config.rl_config", "PPOConfig", "run_ppo"),
}


def stage_config(stage: str):
    """The config class of a stage, without importing the stage (or torch)."""
    _, module, config_cls, _ = STAGES[stage]
    return getattr(importlib.import_module(module), config_cls)


def stage_run(stage: str):
    """The `run_<stage>(config)` function of a stage (this imports the stage's module)."""
    module, _, _, run = STAGES[stage]
    return getattr(importlib.import_module(module), run)


def stage_parts(stage: str):
    """The config class and the `run_<stage>(config)` function of a stage."""
    return stage_config(stage), stage_run(stage)
