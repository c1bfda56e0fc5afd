"""The algorithms' option names, without torch: the values the stage configs accept.

Each name list is the key set of a registry of formulas in this package (`preference.DPO_LOSSES`,
`advantages.ADVANTAGE_ESTIMATORS`, `policy.TOKEN_LOSS_AGGREGATIONS`); a unit test holds each pair equal.
They live apart from the formulas so that checking a config (`alignflow pipeline validate`, the pipeline's
check-inputs task) does not load torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# GRPO's `advantage_estimator`, `scale_rewards`, `loss_type` (how per-token losses aggregate) and
# `importance_sampling_mode`.
AdvantageEstimator = Literal["grpo", "rloo"]
ScaleRewards = Literal["group", "batch", "none"]
GRPOLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@dataclass(frozen=True)
class DPOLossTraits:
    """What one DPO `loss_type` reads besides the policy's log-probs."""

    reference_free: bool = False  # scores the policy's mean token log-probs, with no reference model
    label_smoothing: bool = False  # reads ε
    lengths: bool = False  # needs the completions' token counts


# DPO's `loss_type` -> what it reads; the keys are `DPOConfig.loss_type`'s choices.
DPO_LOSS_TRAITS: dict[str, DPOLossTraits] = {
    "sigmoid": DPOLossTraits(),
    "ipo": DPOLossTraits(lengths=True),
    "hinge": DPOLossTraits(),
    "robust": DPOLossTraits(label_smoothing=True),
    "apo_zero": DPOLossTraits(),
    "simpo": DPOLossTraits(reference_free=True, label_smoothing=True, lengths=True),
}
DPOLossType = Literal[tuple(DPO_LOSS_TRAITS)]


def dpo_option_problem(loss_type: str, label_smoothing: float) -> str | None:
    """What is wrong with a DPO loss's options, in a sentence, or None. The DPO config checks its options with it
    before any work, and `dpo_loss` its arguments."""
    if loss_type not in DPO_LOSS_TRAITS:
        return f"Unknown DPO loss_type '{loss_type}'; expected one of {', '.join(DPO_LOSS_TRAITS)}."
    if label_smoothing and not DPO_LOSS_TRAITS[loss_type].label_smoothing:
        users = " and ".join(name for name, traits in DPO_LOSS_TRAITS.items() if traits.label_smoothing)
        return (f"`label_smoothing` is only used by loss_type {users}; set it to 0 for loss_type {loss_type} "
                f"(got {label_smoothing}).")
    if not 0.0 <= label_smoothing < 0.5:
        return f"`label_smoothing` must be in [0, 0.5), got {label_smoothing}."
    return None
