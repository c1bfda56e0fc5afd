"""The training stages by name: each stage's config class and its `run_<stage>(config)` function.

The CLI, the KFP components and the multi-node launcher all look stages up here, so this
registry sits in the library, below every user of it. Importing it imports every stage (and
torch): the command line reads it only once it runs a command.
"""

from __future__ import annotations

from trainer.stages.dpo import DPOConfig, run_dpo
from trainer.stages.reward_model import RewardConfig, run_reward
from trainer.stages.rl.grpo import GRPOConfig, run_grpo
from trainer.stages.rl.ppo import PPOConfig, run_ppo
from trainer.stages.sft import SFTConfig, run_sft

STAGES = {
    "sft": (SFTConfig, run_sft),
    "reward": (RewardConfig, run_reward),
    "dpo": (DPOConfig, run_dpo),
    "grpo": (GRPOConfig, run_grpo),
    "ppo": (PPOConfig, run_ppo),
}


def stage_parts(stage: str):
    """The config class and the `run_<stage>(config)` function of a stage."""
    return STAGES[stage]
