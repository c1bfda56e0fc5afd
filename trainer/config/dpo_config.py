"""The DPO stage's options (`trainer/stages/dpo.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.algorithms.choices import DPO_LOSS_TRAITS, DPOLossType, dpo_option_problem
from trainer.config.options import TrainConfig, option
from trainer.errors import ConfigError


@dataclass
class DPOConfig(TrainConfig):
    """Direct preference optimisation on `prompt`/`chosen`/`rejected` pairs (text or chat)."""

    learning_rate: float = option(1e-6, "Peak learning rate (AdamW). TRL's DPO default; small models and LoRA "
                                        "usually want more.")
    beta: float = option(0.1, "Strength of the tie to the reference: higher keeps the policy closer "
                              "(β of https://arxiv.org/abs/2305.18290; τ of IPO; β of SimPO).")
    loss_type: DPOLossType = option(
        "sigmoid", "Preference loss: sigmoid (DPO), ipo (https://arxiv.org/abs/2310.12036), hinge (SLiC, "
                   "https://arxiv.org/abs/2305.10425), robust (https://arxiv.org/abs/2403.00409), apo_zero "
                   "(https://arxiv.org/abs/2408.06266), or simpo (reference-free, https://arxiv.org/abs/2405.14734).")
    label_smoothing: float = option(0.0, "For `robust` (and `simpo`): assumed probability that a preference label is "
                                         "flipped, in [0, 0.5). Must be 0 for the other loss types.")
    simpo_gamma: float = option(0.5, "SimPO's target reward margin γ (only with loss_type=simpo).")
    max_prompt_length: int = option(0, "Longest prompt, in tokens; longer prompts lose their start (left truncation). "
                                       "Below `max_length`; the reply gets the rest. 0 = half of `max_length`.")
    ref_model: str | None = option(None, "Reference model checkpoint (folder, s3:// prefix or hub id). Default: a frozen "
                                         "copy of `model`, or with LoRA the base model with adapters disabled.")
    precompute_ref_log_probs: bool = option(False, "Score every pair under the reference once before training and free "
                                                   "the reference model (saves memory and a forward per step).")
    precompute_ref_batch_size: int = option(0, "Pairs per forward when precomputing reference log-probs "
                                               "(0 = 2 x `per_device_batch_size`).")
    padding_free: bool = option(True, "Pack each batch's sequences into rows of at most `max_length` tokens instead of "
                                      "padding every sequence to the longest; position ids restart per sequence, so none "
                                      "attends to another. Same result, less compute. Checked on the first batch: a model "
                                      "whose attention mixes packed sequences falls back to padding, with a warning.")
    disable_dropout: bool = option(True, "Turn off dropout in the policy and reference, as TRL does, so that policy and "
                                         "reference agree exactly at the start.")

    stage = "dpo"

    def validate(self) -> None:
        super().validate()
        if self.beta <= 0:
            raise ConfigError(f"`beta` must be > 0, got {self.beta}.")
        if problem := dpo_option_problem(self.loss_type, self.label_smoothing):
            raise ConfigError(problem)
        if self.max_length < 2:
            raise ConfigError(f"`max_length` must be >= 2 (a prompt token and a reply token), got {self.max_length}.")
        if not 0 <= self.max_prompt_length < self.max_length:
            raise ConfigError(f"`max_prompt_length` must be below `max_length` ({self.max_length}) so that replies "
                              f"keep at least one token (0 = half of it); got {self.max_prompt_length}.")
        if self.precompute_ref_batch_size < 0:
            raise ConfigError(f"`precompute_ref_batch_size` must be >= 0, got {self.precompute_ref_batch_size}.")
        if self.reference_free and (self.ref_model or self.precompute_ref_log_probs):
            raise ConfigError(f"loss_type {self.loss_type} is reference-free: unset `ref_model` and "
                              "`precompute_ref_log_probs`.")

    @property
    def reference_free(self) -> bool:
        return DPO_LOSS_TRAITS[self.loss_type].reference_free

    @property
    def prompt_limit(self) -> int:
        return self.max_prompt_length or max(1, self.max_length // 2)
