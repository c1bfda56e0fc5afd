"""Policy and value losses: the clipped token-level policy loss of GRPO and PPO with its aggregations
(a name -> function registry, `TOKEN_LOSS_AGGREGATIONS`, whose keys are `loss_type`'s choices), the k3
KL estimator, truncated importance sampling against the rollout engine, and PPO's clipped value loss.

Shape letters used in the comments:
    B  preference pairs (DPO, RM) or prompts (GRPO)        G  generations per prompt
    N  sequences in a micro-batch (N = B*G for GRPO)       T  completion tokens (padded)
    F  reward functions
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from trainer.algorithms.choices import GRPOLossType, ISMode
from trainer.algorithms.masked import Stats, masked_mean, masked_var


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


def _per_sequence(loss: Tensor, mask: Tensor, max_completion_length: int | None, num_items: Tensor | float | None):
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def _batch_tokens(loss: Tensor, mask: Tensor, max_completion_length: int | None, num_items: Tensor | float | None):
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


def _fixed_length(loss: Tensor, mask: Tensor, max_completion_length: int | None, num_items: Tensor | float | None):
    if max_completion_length is None:
        raise ValueError("loss_type 'dr_grpo' needs max_completion_length.")
    return (loss * mask).sum() / (loss.size(0) * max_completion_length)


def _cycle_tokens(loss: Tensor, mask: Tensor, max_completion_length: int | None, num_items: Tensor | float | None):
    total = (loss * mask).sum()
    normalizer = mask.sum() if num_items is None else torch.as_tensor(num_items)
    return total / normalizer.to(total).clamp(min=1.0)


# loss_type -> how per-token losses [N, T] become one scalar (`aggregate_token_loss`); its keys are the choices
# of GRPO's `loss_type` (`choices.GRPOLossType`).
TOKEN_LOSS_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "grpo": _per_sequence, "bnpo": _batch_tokens, "dr_grpo": _fixed_length, "dapo": _cycle_tokens,
}


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
    if loss_type not in TOKEN_LOSS_AGGREGATIONS:
        raise ValueError(f"Unknown loss_type '{loss_type}'; expected one of {tuple(TOKEN_LOSS_AGGREGATIONS)}.")
    aggregate = TOKEN_LOSS_AGGREGATIONS[loss_type]
    return aggregate(per_token_loss, mask.to(per_token_loss.dtype), max_completion_length, num_items_in_batch)


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
