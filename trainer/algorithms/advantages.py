"""Rewards to advantages: GRPO's group normalisation, RLOO's leave-one-out baseline (a name -> function
registry, `ADVANTAGE_ESTIMATORS`, whose keys are `advantage_estimator`'s choices), and PPO's GAE over
per-token KL-penalised rewards.

Shape letters used in the comments:
    B  preference pairs (DPO, RM) or prompts (GRPO)        G  generations per prompt
    N  sequences in a micro-batch (N = B*G for GRPO)       T  completion tokens (padded)
    F  reward functions
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from trainer.algorithms.choices import ScaleRewards
from trainer.algorithms.masked import STD_EPS, Stats, nanstd


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


def _rloo(rewards: Tensor, num_generations: int, scale_rewards: ScaleRewards) -> tuple[Tensor, Stats]:
    return rloo_advantages(rewards, num_generations)  # RLOO's advantages are not scaled (TRL's default)


# advantage_estimator -> fn(rewards [B*G], G, scale_rewards) -> (advantages [B*G], stats); its keys are the
# choices of GRPO's `advantage_estimator` (`choices.AdvantageEstimator`).
ADVANTAGE_ESTIMATORS: dict[str, Callable[[Tensor, int, ScaleRewards], tuple[Tensor, Stats]]] = {
    "grpo": group_advantages, "rloo": _rloo,
}


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


def kl_penalty_rewards(
    scores: Tensor, logps: Tensor, ref_logps: Tensor, mask: Tensor, kl_coef: float
) -> tuple[Tensor, Stats]:
    """Per-token reward of RLHF-PPO: −β·KL_t at every completion token, plus the score at the last.

        KL_t = log πθ(y_t) − log πref(y_t)                      (k1, the sampled log-ratio)
        r_t  = −β·KL_t + [t = last active token]·score

    Ziegler et al. 2019 (arXiv:1909.08593, Eq. 2) and Stiennon et al. 2020 (Eq. 1), in the per-token
    form of TRL's `PPOTrainer` and OpenRLHF's `compute_reward`, with the score on the last completion
    token as OpenRLHF; TRL 1.12 adds it one position later, on the first pad after eos (docs/trl.md,
    "PPO: where the score goes"; benchmarks/parity.py measures both). ``scores`` [N] are the sequence
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
