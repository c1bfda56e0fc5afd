"""Losses and advantage estimators as pure functions over tensors.

Nothing here sees a model, a tokenizer or a config: log-probabilities, rewards, masks and scalars
go in; ``(value, stats)`` comes out, where ``stats`` maps TRL's metric names to detached tensors so
that a trainer can log them unchanged. Stage files (`dpo.py`, `reward.py`, `grpo.py`, `ppo.py`)
call these; the formulas live only here.

Shape letters used in the comments:
    B  preference pairs (DPO, RM) or prompts (GRPO)        G  generations per prompt
    N  sequences in a micro-batch (N = B*G for GRPO)       T  completion tokens (padded)
    F  reward functions

Reference for every definition and metric name: TRL 1.16 (`DPOTrainer`, `CPOTrainer` for SimPO,
`RewardTrainer`, `GRPOTrainer`) and TRL's earlier `PPOTrainer` for GAE and the value loss.
Where this module departs from TRL, the docstring says so.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

Stats = dict[str, Tensor]

DPOLossType = Literal["sigmoid", "ipo", "hinge", "robust", "apo_zero", "simpo"]
GRPOLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]

# Added to the std before dividing, as TRL does: a group whose rewards are all equal gets
# advantage 0/(0 + 1e-4) = 0 instead of 0/0.
STD_EPS = 1e-4


# ---------------------------------------------------------------------------------------------
# Masking helpers
# ---------------------------------------------------------------------------------------------


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(x * mask) / max(sum(mask), 1), over all elements or along ``dim``.

    The clamp makes an empty mask give 0 rather than NaN (TRL clamps the same way in its GRPO
    losses; its logging helper does not).
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Variance of the masked entries with Bessel's correction (as `masked_whiten` and TRL's `masked_var`)."""
    mask = mask.to(x.dtype)
    count = mask.sum()
    return masked_mean((x - masked_mean(x, mask)) ** 2, mask) * count / (count - 1).clamp(min=1.0)


def masked_moments(x: Tensor, mask: Tensor) -> Tensor:
    """(n, Σx, Σx²) over the masked entries, float64 [3]: summed over ranks, they give `masked_whiten`
    the mean and variance of the whole batch."""
    mask = mask.to(torch.float64)
    x = x.to(torch.float64) * mask
    return torch.stack([mask.sum(), x.sum(), (x * x).sum()])


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, moments: Tensor | None = None) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries; var with Bessel's correction.

    TRL's `masked_whiten`, used on PPO advantages. With ``shift_mean=False`` the mean is added back
    (TRL's option for whitening rewards). Masked-out entries are set to 0. ``moments`` (from
    `masked_moments`, summed over ranks) take mean = Σx/n and var = (Σx² − n·mean²)/(n − 1) from
    the whole batch instead of this tensor.
    """
    mask = mask.to(x.dtype)
    if moments is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    else:
        n, total, squares = moments.to(device=x.device, dtype=torch.float64)
        mean64 = total / n.clamp(min=1.0)
        var64 = ((squares - n * mean64 * mean64) / (n - 1).clamp(min=1.0)).clamp(min=0.0)
        mean, var = mean64.to(x.dtype), var64.to(x.dtype)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def nanstd(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction; NaN where fewer than 2 values.

    Same definition as `trl.trainer.utils.nanstd` (torch has no nanstd).
    """
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keepdim).to(x.dtype)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keepdim)
    var = torch.where(count > 1, var * count / (count - 1).clamp(min=1.0), torch.nan)
    return var.sqrt()


# ---------------------------------------------------------------------------------------------
# DPO and its variants. Inputs are summed log-probs of each completion's tokens, shape [B].
# ---------------------------------------------------------------------------------------------


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
    if label_smoothing != 0.0 and loss_type not in ("robust", "simpo"):
        raise ValueError(
            f"label_smoothing={label_smoothing} is only used by loss_type 'robust' and 'simpo'; "
            f"set it to 0.0 for loss_type '{loss_type}'."
        )
    if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"loss_type 'robust' needs 0 <= label_smoothing < 0.5, got {label_smoothing}.")
    if loss_type in ("ipo", "simpo") and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError(
            f"loss_type '{loss_type}' normalises by completion length: pass chosen_lengths and rejected_lengths "
            "(token counts, [B]), or tensors of ones if the log-probs are already per-token means."
        )

    if loss_type == "simpo":
        chosen_avg = policy_chosen_logps / chosen_lengths.clamp(min=1)  # [B]
        rejected_avg = policy_rejected_logps / rejected_lengths.clamp(min=1)  # [B]
        losses = simpo(chosen_avg, rejected_avg, beta, simpo_gamma, label_smoothing)
        chosen_rewards, rejected_rewards = beta * chosen_avg.detach(), beta * rejected_avg.detach()
    else:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(f"loss_type '{loss_type}' needs ref_chosen_logps and ref_rejected_logps.")
        chosen_lr = policy_chosen_logps - ref_chosen_logps  # [B]
        rejected_lr = policy_rejected_logps - ref_rejected_logps  # [B]
        if loss_type == "sigmoid":
            losses = dpo_sigmoid(chosen_lr, rejected_lr, beta)
        elif loss_type == "ipo":
            losses = dpo_ipo(chosen_lr, rejected_lr, beta, chosen_lengths, rejected_lengths)
        elif loss_type == "hinge":
            losses = dpo_hinge(chosen_lr, rejected_lr, beta)
        elif loss_type == "robust":
            losses = dpo_robust(chosen_lr, rejected_lr, beta, label_smoothing)
        elif loss_type == "apo_zero":
            losses = dpo_apo_zero(chosen_lr, rejected_lr, beta)
        else:
            raise ValueError(f"Unknown DPO loss_type '{loss_type}'; expected one of {DPOLossType.__args__}.")
        chosen_rewards, rejected_rewards = beta * chosen_lr.detach(), beta * rejected_lr.detach()

    stats = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "losses": losses.detach(),  # [B]
    }
    return losses.mean(), stats


# ---------------------------------------------------------------------------------------------
# Reward model
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# GRPO: rewards -> advantages -> clipped token-level policy loss
# ---------------------------------------------------------------------------------------------


def combine_rewards(rewards_per_func: Tensor, weights: Tensor) -> Tensor:
    """Σ_f w_f·r_f over the reward functions that scored each completion.

    ``rewards_per_func`` [B*G, F] holds NaN where a function returned None; those entries are
    skipped (nansum, as TRL). A row where every function returned None is unscorable and stays NaN,
    so `group_advantages` leaves it out of the group statistics and gives it advantage 0 (TRL 1.16).
    Returns [B*G].
    """
    weighted = rewards_per_func * weights.to(rewards_per_func)  # [B*G, F]
    rewards = weighted.nansum(dim=1)  # [B*G]
    unscorable = torch.isnan(rewards_per_func).all(dim=1)  # [B*G]
    return torch.where(unscorable, torch.nan, rewards)


def group_advantages(
    rewards: Tensor, num_generations: int, scale_rewards: ScaleRewards
) -> tuple[Tensor, Stats]:
    """A_i = (r_i − mean_group(r)) / (std + 1e-4), per group of G consecutive completions.

    Outcome supervision of Shao et al. 2024, "DeepSeekMath" (GRPO, arXiv:2402.03300, Sec. 4.1.2).
    ``scale_rewards`` picks the std: ``group`` (the paper), ``batch`` (std over all B*G rewards,
    Liu et al. 2025, arXiv:2508.08221), or ``none`` (no division; Dr. GRPO, arXiv:2503.20783).
    NaN rewards (unscorable) are left out of means and stds and get advantage 0. Stds use Bessel's
    correction, as TRL. A group whose rewards are all equal gets advantage 0 in every mode.

    ``rewards`` [B*G] -> advantages [B*G]. Stats follow TRL 1.16's definitions exactly:
    ``reward`` = mean reward; ``reward_std`` = std of the whole batch's rewards (not the mean of
    per-group stds, which TRL logged before 1.0); ``frac_reward_zero_std`` = fraction of
    completions whose scaling std is ~0, i.e. the fraction of zero-variance groups for ``group``
    and ``none``, and 0 or 1 (is the whole batch constant?) for ``batch``.
    """
    if rewards.numel() % num_generations != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}.")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    grouped = rewards.view(-1, num_generations)  # [B, G]
    mean = torch.nanmean(grouped, dim=1, keepdim=True)  # [B, 1]
    if scale_rewards in ("group", "none"):
        # For "none" the std is only used to count zero-variance groups.
        if num_generations > 1:
            std = nanstd(grouped, dim=1, keepdim=True)  # [B, 1]
        else:
            std = torch.zeros_like(mean)
    elif scale_rewards == "batch":
        std = nanstd(rewards) if rewards.numel() > 1 else rewards.new_zeros(())
        std = std.expand_as(mean)  # [B, 1]
    else:
        raise ValueError(f"Unknown scale_rewards '{scale_rewards}'; expected one of {ScaleRewards.__args__}.")

    # A group (the batch, for "batch") whose scored rewards are all equal has std 0 and advantages 0
    # exactly: float32 rounding makes the std of eight 0.2s ~1.6e-8, not 0, which would give those
    # completions tiny advantages and hide them from `frac_reward_zero_std`.
    constant = _all_equal(grouped, dim=1)  # [B, 1]
    scale_constant = constant if scale_rewards != "batch" else _all_equal(rewards, dim=None).expand_as(mean)
    std = torch.where(scale_constant, torch.zeros_like(std), std)  # [B, 1]
    advantages = torch.where(constant, torch.zeros_like(grouped), grouped - mean)  # [B, G]
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    advantages = torch.nan_to_num(advantages, nan=0.0).view(-1)  # [B*G]

    is_std_zero = std == 0  # [B, 1]; NaN std (one scored sample) -> False
    stats = {
        "reward": torch.nanmean(rewards),
        "reward_std": nanstd(rewards),
        "frac_reward_zero_std": is_std_zero.float().mean(),
    }
    return advantages, stats


def _all_equal(x: Tensor, dim: int | None) -> Tensor:
    """Whether the non-NaN values along `dim` (all of `x` for None) are at least two and all equal. -> [B, 1] or []"""
    scored = ~torch.isnan(x)
    lo = torch.where(scored, x, torch.inf)
    hi = torch.where(scored, x, -torch.inf)
    if dim is None:
        return (scored.sum() >= 2) & (hi.max() == lo.min())
    return (scored.sum(dim, keepdim=True) >= 2) & (hi.amax(dim, keepdim=True) == lo.amin(dim, keepdim=True))


def rloo_advantages(rewards: Tensor, num_generations: int) -> tuple[Tensor, Stats]:
    """A_i = r_i − mean_{j≠i} r_j: REINFORCE with a leave-one-out baseline, per group of G completions.

    Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024,
    "Back to Basics" (RLOO, arXiv:2402.14740, Eq. 5); TRL's `RLOOTrainer` with its default
    ``normalize_advantages=False``. Equivalently A_i = G/(G − 1)·(r_i − mean_group(r)): the
    baseline of each sample does not depend on the sample, so the estimate is unbiased.
    NaN rewards (unscorable) are left out: with k scored samples in a group the baseline is the
    mean of the other k − 1, and a sample with no scored neighbour (or unscorable) gets 0.
    ``rewards`` [B*G] -> advantages [B*G]; stats as `group_advantages` (``frac_reward_zero_std``:
    fraction of groups whose rewards are all equal, whose advantages are all 0).
    """
    if rewards.numel() % num_generations != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}.")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    grouped = rewards.view(-1, num_generations)  # [B, G]
    scored = ~torch.isnan(grouped)  # [B, G]
    count = scored.sum(dim=1, keepdim=True).to(grouped.dtype)  # [B, 1]
    total = grouped.nansum(dim=1, keepdim=True)  # [B, 1]
    others = (count - 1).clamp(min=1.0)
    baseline = (total - grouped.nan_to_num()) / others  # [B, G] mean of the other scored samples
    advantages = torch.where(scored & (count > 1), grouped - baseline, 0.0).view(-1)  # [B*G]
    std = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(count)
    stats = {
        "reward": torch.nanmean(rewards),
        "reward_std": nanstd(rewards),
        "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean(),
    }
    return advantages, stats


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Per-token KL(πθ ‖ πref) estimate k3 = exp(ref − logp) − (ref − logp) − 1 ≥ 0.

    Schulman 2020, "Approximating KL Divergence"; used in GRPO (Shao et al. 2024, Eq. 4).
    Shapes [N, T] -> [N, T].
    """
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def rollout_is_weights(
    old_logps: Tensor,
    rollout_logps: Tensor,
    mask: Tensor,
    *,
    mode: ISMode,
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[Tensor, Stats]:
    """Importance weights π_train(y)/π_rollout(y) correcting the rollout engine/trainer mismatch.

    Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"), with TRL 1.16's four modes: per token (``token_*``, weights [N, T]) or
    per sequence with the log-ratio summed over the completion (``sequence_*``, weights [N, 1]);
    ``*_truncate`` clamps to [clip_min, clip_max], ``*_mask`` zeroes weights outside it.
    ``old_logps`` are the trainer's log-probs of the sampled tokens before the update, ``rollout_logps``
    the engine's; NaN rollout log-probs count as no mismatch (weight 1). Pass the result to
    `policy_loss(..., is_weights=...)`. Stats use TRL's ``sampling/...`` names.
    """
    if mode not in ISMode.__args__:
        raise ValueError(f"Unknown importance sampling mode '{mode}'; expected one of {ISMode.__args__}.")
    mask = mask.to(old_logps.dtype)
    diff = torch.nan_to_num((old_logps - rollout_logps) * mask, nan=0.0)  # [N, T]
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)  # [N, 1]
    ratio = torch.exp(diff)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        weights = ratio.clamp(min=lo, max=hi)
    else:
        weights = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)

    with torch.no_grad():
        valid = mask.bool() & ~torch.isnan(rollout_logps)
        delta = (old_logps - rollout_logps).abs()[valid]
        flat = weights.flatten() if mode.startswith("sequence") else weights[mask.bool()]
        zero = weights.new_zeros(())
        stats = {
            "sampling/sampling_logp_difference/mean": delta.mean() if delta.numel() else zero,
            "sampling/sampling_logp_difference/max": delta.max() if delta.numel() else zero,
            "sampling/importance_sampling_ratio/min": flat.min() if flat.numel() else zero,
            "sampling/importance_sampling_ratio/mean": flat.mean() if flat.numel() else zero,
            "sampling/importance_sampling_ratio/max": flat.max() if flat.numel() else zero,
        }
    return weights.detach(), stats


def aggregate_token_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    loss_type: GRPOLossType,
    max_completion_length: int | None = None,
    num_items_in_batch: Tensor | float | None = None,
) -> Tensor:
    """Reduce per-token losses [N, T] to a scalar; the four GRPO normalisations of TRL.

    grpo:    mean_i( Σ_t m_it·ℓ_it / Σ_t m_it )        (Shao et al. 2024, Eq. 3)
    bnpo:    Σ m·ℓ / Σ m over this micro-batch
    dr_grpo: Σ m·ℓ / (N · max_completion_length)    (Liu et al. 2025, Dr. GRPO, arXiv:2503.20783)
    dapo:    Σ m·ℓ / num_items_in_batch             (Yu et al. 2025, DAPO, arXiv:2503.14476)

    For ``dapo`` the caller passes the active-token count that this micro-batch's share of the
    loss is normalised by (TRL: tokens of the global generation batch / processes · grad-accum
    steps / steps per generation); without it, the local ``mask.sum()`` is used (= ``bnpo``).
    Dividing by the gradient-accumulation steps for the other types is the trainer's job.
    """
    mask = mask.to(per_token_loss.dtype)
    total = (per_token_loss * mask).sum()
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return total / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length.")
        return total / (per_token_loss.size(0) * max_completion_length)
    if loss_type == "dapo":
        normalizer = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
        return total / normalizer.to(total).clamp(min=1.0)
    raise ValueError(f"Unknown loss_type '{loss_type}'; expected one of {GRPOLossType.__args__}.")


def policy_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: GRPOLossType,
    epsilon: float,
    epsilon_high: float | None = None,
    ref_logps: Tensor | None = None,
    beta: float = 0.0,
    max_completion_length: int | None = None,
    num_items_in_batch: Tensor | float | None = None,
    is_weights: Tensor | None = None,
    use_bias_correction_kl: bool = False,
) -> tuple[Tensor, Stats]:
    """Clipped surrogate of PPO/GRPO per token, plus an optional k3 KL penalty, aggregated.

        r_t  = exp(logp_t − old_logp_t)
        ℓ_t  = −min(r_t·A, clip(r_t, 1 − ε_low, 1 + ε_high)·A) · w_t  +  β·KL_t

    PPO's clipped objective (Schulman et al. 2017, Eq. 7) at token level as in GRPO (Shao et al.
    2024, Eq. 3), with DAPO's decoupled ε_high ("clip-higher", Yu et al. 2025); ``epsilon_high=None``
    means ε_high = ε. KL_t = `k3_kl`, needs ``ref_logps``; with ``use_bias_correction_kl`` it is
    multiplied by r_t (DeepSeek-V3.2, arXiv:2512.02556; TRL 1.16's default is True, here the
    caller's config decides). w_t = ``is_weights`` from `rollout_is_weights` (not applied to KL).
    The result is reduced by `aggregate_token_loss` (``loss_type``).

    Shapes: logps, old_logps, ref_logps, mask [N, T]; advantages [N] (GRPO) or [N, T] (PPO, which
    uses ``bnpo``); is_weights [N, T] or [N, 1]. ``old_logps=None`` means on-policy
    (old = logps.detach(), r ≡ 1 with the gradient of r).

    Stats (TRL names, means over active tokens of this micro-batch): ``clip_ratio/low_mean``
    (r < 1 − ε_low and A < 0), ``clip_ratio/high_mean`` (r > 1 + ε_high and A > 0),
    ``clip_ratio/region_mean`` (either: the tokens whose gradient the clip removes),
    ``clip_ratio/low_min`` / ``clip_ratio/high_max`` (min/max over sequences of the per-sequence
    fractions), and ``kl`` (mean KL_t, when ``ref_logps`` is given).
    """
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    if beta != 0.0 and ref_logps is None:
        raise ValueError("beta != 0 adds a KL penalty and needs ref_logps.")
    if old_logps is None:
        old_logps = logps.detach()
    mask = mask.to(logps.dtype)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # [N, 1] or [N, T]

    ratio = torch.exp(logps - old_logps)  # [N, T]
    clipped_ratio = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)  # [N, T]
    per_token_loss = -torch.min(ratio * adv, clipped_ratio * adv)  # [N, T]
    if is_weights is not None:
        per_token_loss = per_token_loss * is_weights
    per_token_kl = None
    if ref_logps is not None:
        per_token_kl = k3_kl(logps, ref_logps)  # [N, T]
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio
        if beta != 0.0:
            per_token_loss = per_token_loss + beta * per_token_kl

    loss = aggregate_token_loss(per_token_loss, mask, loss_type, max_completion_length, num_items_in_batch)

    with torch.no_grad():
        is_low = ((ratio < 1 - eps_low) & (adv < 0)).to(mask.dtype)  # [N, T]
        is_high = ((ratio > 1 + eps_high) & (adv > 0)).to(mask.dtype)
        is_region = torch.maximum(is_low, is_high)
        has_tokens = mask.sum(-1) > 0  # [N]
        low_per_seq = masked_mean(is_low, mask, dim=-1)[has_tokens]
        high_per_seq = masked_mean(is_high, mask, dim=-1)[has_tokens]
        zero = mask.new_zeros(())
        stats = {
            "clip_ratio/low_mean": masked_mean(is_low, mask),
            "clip_ratio/low_min": low_per_seq.min() if low_per_seq.numel() else zero,
            "clip_ratio/high_mean": masked_mean(is_high, mask),
            "clip_ratio/high_max": high_per_seq.max() if high_per_seq.numel() else zero,
            "clip_ratio/region_mean": masked_mean(is_region, mask),
        }
        if per_token_kl is not None:
            stats["kl"] = masked_mean(per_token_kl, mask)
    return loss, stats


def ppo_policy_loss(
    logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, cliprange: float
) -> tuple[Tensor, Stats]:
    """PPO's clipped surrogate per token, averaged over the micro-batch's active tokens.

        ℓ = mean_masked( max(−A_t·r_t, −A_t·clip(r_t, 1 − ε, 1 + ε)) ),   r_t = exp(logp_t − old_logp_t)

    Schulman et al. 2017, Eq. 7; this is `policy_loss` with per-token advantages [N, T] and
    ``bnpo`` aggregation, which is TRL `PPOTrainer`'s ``masked_mean`` over the micro-batch.
    Stats (TRL's historic PPO names): ``ppo/loss/policy``, ``ppo/policy/clipfrac`` (tokens whose
    clipped term is the larger, i.e. whose gradient the clip removes), ``ppo/policy/approxkl``
    (½·mean (logp − old_logp)², the k2 estimator TRL logs).
    """
    loss, stats = policy_loss(logps, old_logps, advantages, mask, loss_type="bnpo", epsilon=cliprange)
    with torch.no_grad():
        approxkl = 0.5 * masked_mean((logps - old_logps) ** 2, mask)
    return loss, {"ppo/loss/policy": loss.detach(), "ppo/policy/clipfrac": stats["clip_ratio/region_mean"],
                  "ppo/policy/approxkl": approxkl}


# ---------------------------------------------------------------------------------------------
# PPO: per-token KL reward, GAE, the clipped value loss, KL control
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation, per token, and the value targets.

        δ_t = r_t + γ·V_{t+1} − V_t,   A_t = δ_t + γλ·A_{t+1},   R_t = A_t + V_t

    Eq. 16 of Schulman et al. 2016 (arXiv:1506.02438), as TRL's `PPOTrainer` and OpenRLHF compute
    it: rewards and values are zeroed where ``mask`` is 0 and V after the last token is 0, so a
    right-padded completion ends at its last active token. rewards, values, mask [N, T] ->
    advantages [N, T], returns [N, T], both 0 where masked and without gradient. TRL then whitens
    the advantages; call `masked_whiten` for that (kept separate so this stays the plain formula).
    """
    mask = mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    num_tokens = rewards.size(1)
    last = torch.zeros_like(values[:, 0])  # [N]
    reversed_advantages = []
    for t in reversed(range(num_tokens)):
        next_value = values[:, t + 1] if t < num_tokens - 1 else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        reversed_advantages.append(last)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)  # [N, T]
    returns = advantages + values
    return advantages * mask, returns * mask


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range_value: float
) -> tuple[Tensor, Stats]:
    """0.5 · mean_masked( max((V − R)², (clip(V, V_old − c, V_old + c) − R)²) ).

    PPO's clipped value loss (Ziegler et al. 2019, arXiv:1909.08593; as in TRL's `PPOTrainer` and
    OpenRLHF). ``values`` are the current predictions, ``old_values`` those at rollout time,
    ``returns`` from `gae_advantages`; all [N, T].
    Stats (TRL `PPOTrainer` names): ``ppo/loss/value`` (this loss, before any vf_coef),
    ``ppo/val/clipfrac`` (fraction where the clipped term is larger), ``ppo/val/vpred`` (mean V),
    ``ppo/val/error`` (mean (V − R)²).
    """
    values_clipped = torch.clamp(values, old_values - clip_range_value, old_values + clip_range_value)
    losses_unclipped = (values - returns) ** 2  # [N, T]
    losses_clipped = (values_clipped - returns) ** 2  # [N, T]
    loss = 0.5 * masked_mean(torch.max(losses_unclipped, losses_clipped), mask)
    with torch.no_grad():
        stats = {
            "ppo/loss/value": loss.detach(),
            "ppo/val/clipfrac": masked_mean((losses_clipped > losses_unclipped).to(values.dtype), mask),
            "ppo/val/vpred": masked_mean(values, mask),
            "ppo/val/error": masked_mean(losses_unclipped, mask),
        }
    return loss, stats


@torch.no_grad()
def value_stats(values: Tensor, returns: Tensor, mask: Tensor) -> Stats:
    """How well the rollout-time values V predict the GAE returns R, over the masked tokens [N, T].

    ``ppo/returns/mean``, ``ppo/returns/var``, and ``ppo/val/var_explained`` = 1 − Var(R − V)/Var(R)
    (1: V predicts R exactly; 0: no better than a constant; negative: worse); 0 when Var(R) = 0.
    """
    var = masked_var(returns, mask)
    explained = 1 - masked_var(returns - values, mask) / var if var > 0 else var.new_zeros(())
    return {"ppo/returns/mean": masked_mean(returns, mask), "ppo/returns/var": var, "ppo/val/var_explained": explained}


def kl_penalty_rewards(
    scores: Tensor, logps: Tensor, ref_logps: Tensor, mask: Tensor, kl_coef: float
) -> tuple[Tensor, Stats]:
    """Per-token reward of RLHF-PPO: −β·KL_t at every completion token, plus the score at the last.

        KL_t = log πθ(y_t) − log πref(y_t)                      (k1, the sampled log-ratio)
        r_t  = −β·KL_t + [t = last active token]·score

    Ziegler et al. 2019 (arXiv:1909.08593, Eq. 2) and Stiennon et al. 2020 (Eq. 1), in the per-token
    form of TRL's `PPOTrainer` (and OpenRLHF's `compute_reward`). ``scores`` [N] are the sequence
    rewards (any missing-EOS penalty already applied); ``logps``/``ref_logps``/``mask`` [N, T] are the
    rollout-time log-probs of the sampled tokens. A row without completion tokens gets no reward.
    Returns rewards [N, T] (0 where masked) and, TRL's names, ``objective/kl`` (mean over sequences of
    Σ_t KL_t), ``objective/non_score_reward`` (mean Σ_t −β·KL_t), ``objective/scores`` (mean score),
    ``objective/rlhf_reward`` (mean score + non-score reward).
    """
    mask = mask.to(logps.dtype)
    kl = (logps - ref_logps) * mask  # [N, T]
    non_score = -kl_coef * kl  # [N, T]
    positions = torch.arange(mask.size(1), device=mask.device).expand_as(mask)  # [N, T]
    last = (positions * mask).argmax(dim=1)  # [N] column of the last active token
    has_tokens = mask.sum(dim=1) > 0  # [N]
    rewards = non_score.clone()
    rows = torch.arange(mask.size(0), device=mask.device)
    rewards[rows, last] += torch.where(has_tokens, scores.to(rewards.dtype), 0.0)
    with torch.no_grad():
        stats = {
            "objective/kl": kl.sum(1).mean(),
            "objective/non_score_reward": non_score.sum(1).mean(),
            "objective/scores": scores.float().mean(),
            "objective/rlhf_reward": (scores.to(non_score.dtype) + non_score.sum(1)).mean(),
        }
    return rewards.detach(), stats


class FixedKLController:
    """β stays at its initial value (TRL's `FixedKLController`; PPOv2's `kl_coef`)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Proportional control of β towards a target KL (Ziegler et al. 2019, Sec. 2.2, arXiv:1909.08593).

        e = clip(KL / KL_target − 1, −0.2, 0.2),    β ← β·(1 + e·n / horizon)

    ``current_kl`` is the batch's mean per-sequence KL (``objective/kl``), ``n_steps`` the number of
    rollouts it came from, ``horizon`` the rollouts over which a 20 % error moves β by e^0.2. Same
    as TRL's `AdaptiveKLController`. β grows while the policy is further from the reference than the
    target and shrinks while it is closer.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon
