"""The reward-model stage's options (`trainer/stages/reward_model.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.config.options import TrainConfig, option
from trainer.errors import ConfigError


@dataclass
class RewardConfig(TrainConfig):
    """Reward-model training on preference pairs (Bradley–Terry)."""

    learning_rate: float = option(1e-4, "Peak learning rate (AdamW); TRL's RewardConfig default.")
    truncation_mode: Literal["keep_start", "keep_end", "drop"] = option(
        "keep_end", "Texts (prompt + reply) longer than `max_length`: `keep_end` cuts their start, so both replies "
                    "and the latest prompt turns stay; `keep_start` cuts their end (and may cut away the replies' "
                    "difference: such pairs are dropped); `drop` drops the pair, as TRL does. Counts are logged.")
    center_rewards_coefficient: float | None = option(
        None, "Weight c of the reward-centring term c·mean((r_chosen + r_rejected)²), which keeps rewards near 0 "
              "(Eisenstein et al. 2023, arXiv:2312.09244; TRL suggests 0.01). Unset = off.")
    disable_dropout: bool = option(True, "Set every dropout probability to 0, as TRL does for reward models (BERT-style "
                                         "encoders ship with 0.1, so chosen and rejected would see different masks).")
    padding_free: bool = option(True, "Pack each micro-batch's chosen and rejected texts into one row (on the CPU; "
                                      "elsewhere rows of at most `max_length` tokens, causal LMs only), position ids "
                                      "restarting per text, instead of padding each to the longest (TRL's name, off "
                                      "by default there; no attention across texts). The same rewards with less "
                                      "compute when lengths vary; off by itself, with a warning, for a model that "
                                      "scores packed texts differently.")

    stage = "reward"

    def validate(self) -> None:
        super().validate()
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            raise ConfigError(f"`center_rewards_coefficient` must be >= 0 (or unset), got "
                              f"{self.center_rewards_coefficient}.")
