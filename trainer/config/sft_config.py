"""The SFT stage's options (`trainer/stages/sft.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.options import TrainConfig, option
from trainer.errors import ConfigError


@dataclass
class SFTConfig(TrainConfig):
    """Supervised fine-tuning on text, prompt/completion or chat data."""

    learning_rate: float = option(2e-5, "Peak learning rate (AdamW).")
    completion_only_loss: bool = option(True, "For prompt/completion data: train on completion tokens only.")
    assistant_only_loss: bool = option(True, "For chat `messages`: train on assistant turns only.")
    packing: bool = option(False, "Pack several short examples into each row of `max_length` tokens "
                              "(no attention across examples).")
    padding_free: bool = option(True, "Pack each micro-batch's examples into one row (on the CPU; elsewhere rows "
                                      "of at most `max_length` tokens), position ids restarting per example, "
                                      "instead of padding each example to the longest (TRL's name, off by default "
                                      "there; no attention across examples). The same loss with less compute when "
                                      "lengths vary; off by itself, with a warning, for a model whose attention "
                                      "mixes packed examples. `packing` packs across the dataset.")
    num_sample_completions: int = option(4, "Greedy sample completions of held-out prompts logged at the end "
                                        "(0 = none).")
    sample_max_new_tokens: int = option(48, "Length of those sample completions.")

    stage = "sft"

    def validate(self) -> None:
        super().validate()
        if self.packing and self.per_device_batch_size > 1 and self.max_length < 16:
            raise ConfigError("`packing` needs `max_length` >= 16 to fit examples into rows.")
