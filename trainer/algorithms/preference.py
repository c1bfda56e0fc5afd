"""Preference losses: DPO and its variants (TRL `DPOTrainer`, `CPOTrainer` for SimPO) and the reward model's
Bradley-Terry loss. Inputs are summed log-probs of each completion's tokens, shape [B]."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.algorithms.choices import DPO_LOSS_TRAITS, DPOLossType, dpo_option_problem
from trainer.algorithms.masked import Stats


def dpo_sigmoid(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> Tensor:
    """-log σ(β·Δ), Δ = (log πθ(y_w) − log πref(y_w)) − (log πθ(y_l) − log πref(y_l)).

    Eq. 7 of Rafailov et al. 2023, "Direct Preference Optimization" (arXiv:2305.18290).
    Returns per-pair losses [B].
    """
    return -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))


def dpo_ipo(
    chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float, chosen_lengths: Tensor, rejected_lengths: Tensor
) -> Tensor:
    """(Δ̄ − 1/(2β))², Δ̄ = chosen_logratio/|y_w| − rejected_logratio/|y_l|.

    Eq. 17 of Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences" (IPO, arXiv:2310.12036); β is the paper's τ. Like TRL, the log-ratios are divided
    by the completion lengths (the paper's experiments used this per-token form). Returns [B].
    """
    delta = chosen_logratios / chosen_lengths.clamp(min=1) - rejected_logratios / rejected_lengths.clamp(min=1)
    return (delta - 1 / (2 * beta)) ** 2


def dpo_hinge(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> Tensor:
    """max(0, 1 − β·Δ): the SLiC calibration loss (Zhao et al. 2023, arXiv:2305.10425) on DPO's
    log-ratios, as in the RSO paper (Liu et al. 2023, arXiv:2309.06657). Returns [B]."""
    return torch.relu(1 - beta * (chosen_logratios - rejected_logratios))


def dpo_robust(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """[(1 − ε)·(−log σ(βΔ)) − ε·(−log σ(−βΔ))] / (1 − 2ε), ε = probability a label is flipped.

    Unbiased loss for noisy preferences from Chowdhury et al. 2024, "Provably Robust DPO"
    (arXiv:2403.00409). Needs 0 ≤ ε < 0.5. Returns [B].
    """
    z = beta * (chosen_logratios - rejected_logratios)
    eps = label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


def dpo_apo_zero(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> Tensor:
    """(1 − σ(β·chosen_logratio)) + σ(β·rejected_logratio): raise the chosen likelihood and lower the
    rejected one independently. Eq. 7 of D'Oosterlinck et al. 2024, "Anchored Preference
    Optimization" (APO-zero, arXiv:2408.06266). Returns [B]."""
    return 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)


def simpo(
    chosen_avg_logps: Tensor, rejected_avg_logps: Tensor, beta: float, gamma: float, label_smoothing: float = 0.0
) -> Tensor:
    """−(1 − ε)·log σ(β(ā_w − ā_l) − γ) − ε·log σ(−(β(ā_w − ā_l) − γ)), ā = mean token log-prob.

    Eq. 6 of Meng et al. 2024, "SimPO" (arXiv:2405.14734): reference-free, length-normalised, with
    target margin γ. ε > 0 gives the conservative form TRL's `CPOTrainer` applies. Returns [B].
    """
    z = beta * (chosen_avg_logps - rejected_avg_logps) - gamma
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


# loss_type -> its per-pair loss [B] on the chosen and rejected terms [B]: each completion's log-ratio
# log πθ − log πref or, for a reference-free loss, the policy's mean token log-prob (the implicit rewards are β
# times the terms, as TRL's `DPOTrainer` and `CPOTrainer`). `DPO_LOSS_TRAITS` (choices.py) says what each reads;
# the keys are `DPOConfig.loss_type`'s choices.
DPO_LOSSES: dict[str, Callable[..., Tensor]] = {
    "sigmoid": lambda c, r, beta, **_: dpo_sigmoid(c, r, beta),
    "ipo": lambda c, r, beta, chosen_lengths, rejected_lengths, **_: dpo_ipo(c, r, beta, chosen_lengths,
                                                                             rejected_lengths),
    "hinge": lambda c, r, beta, **_: dpo_hinge(c, r, beta),
    "robust": lambda c, r, beta, label_smoothing, **_: dpo_robust(c, r, beta, label_smoothing),
    "apo_zero": lambda c, r, beta, **_: dpo_apo_zero(c, r, beta),
    "simpo": lambda c, r, beta, label_smoothing, simpo_gamma, **_: simpo(c, r, beta, simpo_gamma, label_smoothing),
}


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    loss_type: DPOLossType,
    beta: float,
    label_smoothing: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    simpo_gamma: float = 0.5,
) -> tuple[Tensor, Stats]:
    """Mean preference loss over B pairs, and TRL's DPO reward metrics.

    All log-prob inputs are [B]: the sum of the completion's token log-probs. ``chosen_lengths`` and
    ``rejected_lengths`` [B] are completion token counts, required by ``ipo`` and ``simpo`` (pass
    ones if the log-probs are already per-token means). ``simpo`` is reference-free: the reference
    log-probs are ignored and may be None. ``label_smoothing`` is ε of ``robust`` (and of
    ``simpo``'s conservative form); other loss types reject ε ≠ 0 rather than ignore it.

    Implicit rewards (TRL): r = β·(log πθ − log πref) on summed log-probs for every reference-based
    type (including ``ipo``); r = β·ā for ``simpo`` (TRL `CPOTrainer`).
    Stats: ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins`` (means over the batch),
    ``rewards/accuracies`` (fraction with r_w > r_l), and ``losses`` [B], the per-pair losses.
    """
    problem = dpo_option_problem(loss_type, label_smoothing)
    if problem:
        raise ValueError(problem)
    kind = DPO_LOSS_TRAITS[loss_type]
    if kind.lengths and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError(
            f"loss_type '{loss_type}' normalises by completion length: pass chosen_lengths and rejected_lengths "
            "(token counts, [B]), or tensors of ones if the log-probs are already per-token means."
        )
    if kind.reference_free:  # the policy's mean token log-probs
        chosen = policy_chosen_logps / chosen_lengths.clamp(min=1)  # [B]
        rejected = policy_rejected_logps / rejected_lengths.clamp(min=1)  # [B]
    elif ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError(f"loss_type '{loss_type}' needs ref_chosen_logps and ref_rejected_logps.")
    else:  # the log-ratios
        chosen = policy_chosen_logps - ref_chosen_logps  # [B]
        rejected = policy_rejected_logps - ref_rejected_logps  # [B]
    losses = DPO_LOSSES[loss_type](chosen, rejected, beta=beta, label_smoothing=label_smoothing,
                                   simpo_gamma=simpo_gamma, chosen_lengths=chosen_lengths,
                                   rejected_lengths=rejected_lengths)
    chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()

    stats = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "losses": losses.detach(),  # [B]
    }
    return losses.mean(), stats


def bradley_terry_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    margin: Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> tuple[Tensor, Stats]:
    """mean(−log σ(r_w − r_l − m)) + c·mean((r_w + r_l)²).

    Bradley–Terry pairwise loss (InstructGPT, Ouyang et al. 2022, Eq. 1); the optional margin m [B]
    is Llama 2's (Touvron et al. 2023, Eq. 2); the centring term with coefficient c keeps rewards
    near zero (Eisenstein et al. 2023, arXiv:2312.09244). Same as TRL's `RewardTrainer`.
    Rewards are the scalar head outputs, [B] each.
    Stats (TRL names): ``accuracy`` (r_w > r_l), ``margin`` (mean r_w − r_l, without m),
    ``min_reward``/``mean_reward``/``max_reward`` over all 2B rewards.
    """
    diff = chosen_rewards - rejected_rewards  # [B]
    logits = diff if margin is None else diff - margin
    loss = -F.logsigmoid(logits).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * ((chosen_rewards + rejected_rewards) ** 2).mean()

    all_rewards = torch.cat([chosen_rewards, rejected_rewards]).detach()  # [2B]
    diff = diff.detach()
    stats = {
        "accuracy": (diff > 0).float().mean(),
        "margin": diff.mean(),
        "min_reward": all_rewards.min(),
        "mean_reward": all_rewards.mean(),
        "max_reward": all_rewards.max(),
    }
    return loss, stats
