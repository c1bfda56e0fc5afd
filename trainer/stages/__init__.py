"""The training stages by name: each stage's config class and its `run_<stage>(config)` function.

The CLI, the KFP components and the multi-node launcher all look stages up here, so this
registry sits in the library, below every user of it. `STAGES` names each stage's module and
its two parts; `stage_parts` imports that one module only (an SFT run does not load the RL stages,
vLLM's client or the rollout engines: every training process, every rank, pays for what it imports).
"""

from __future__ import annotations

import importlib

# stage -> (module under trainer.stages, config class, run function)
STAGES = {
    "sft": ("sft", "SFTConfig", "run_sft"),
    "reward": ("reward_model", "RewardConfig", "run_reward"),
    "dpo": ("dpo", "DPOConfig", "run_dpo"),
    "grpo": ("rl.grpo", "GRPOConfig", "run_grpo"),
    "ppo": ("rl.ppo", "PPOConfig", "run_ppo"),
}


def stage_parts(stage: str):
    """The config class and the `run_<stage>(config)` function of a stage (importing its module)."""
    module, config_cls, run = STAGES[stage]
    loaded = importlib.import_module(f"{__name__}.{module}")
    return getattr(loaded, config_cls), getattr(loaded, run)
