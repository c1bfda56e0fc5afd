"""Hand-derived checks of the losses and advantage estimators in trainer/algorithms/.

Each test's docstring does the arithmetic; the assertions compare against those numbers
(rounded to ~6 significant digits, hence the tolerances). Notation: σ = sigmoid,
lσ(z) = −log σ(z) = log(1 + e^{−z}); note lσ(−z) = lσ(z) + z.
"""

import math

import pytest
import torch
from torch.testing import assert_close

from trainer.algorithms.advantages import (
    AdaptiveKLController,
    FixedKLController,
    combine_rewards,
    gae_advantages,
    group_advantages,
    kl_penalty_rewards,
    rloo_advantages,
)
from trainer.algorithms.choices import DPO_LOSS_TRAITS
from trainer.algorithms.masked import masked_mean, masked_moments, masked_whiten
from trainer.algorithms.policy import (
    aggregate_token_loss,
    k3_kl,
    policy_loss,
    ppo_policy_loss,
    rollout_is_weights,
    value_loss,
    value_stats,
)
from trainer.algorithms.preference import DPO_LOSSES, bradley_terry_loss, dpo_loss

TOL = {"atol": 1e-5, "rtol": 1e-5}


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def close(actual, expected, **kw):
    assert_close(torch.as_tensor(actual, dtype=torch.float32), torch.as_tensor(expected, dtype=torch.float32),
                 **(kw or TOL))


# ---------------------------------------------------------------------------------------------
# DPO family. Shared batch of two pairs:
#   pair 1: policy chosen −1.0 (ref −1.5) -> chosen log-ratio  +0.5
#           policy rejected −2.0 (ref −1.8) -> rejected log-ratio −0.2     Δ1 = 0.7
#   pair 2: policy chosen −3.0 (ref −2.0) -> −1.0
#           policy rejected −1.0 (ref −1.5) -> +0.5                         Δ2 = −1.5
# ---------------------------------------------------------------------------------------------


def pairs(requires_grad=False):
    pc = t(-1.0, -3.0).requires_grad_(requires_grad)
    pr = t(-2.0, -1.0).requires_grad_(requires_grad)
    return pc, pr, t(-1.5, -2.0), t(-1.8, -1.5)


def test_dpo_sigmoid_values_and_stats():
    """β = 0.1.
    pair 1: lσ(0.1·0.7) = lσ(0.07) = log(1 + e^−0.07) = log(1.932394) = 0.658760
    pair 2: lσ(0.1·(−1.5)) = lσ(−0.15) = log(1 + e^0.15) = log(2.161834) = 0.770957
    loss = (0.658760 + 0.770957)/2 = 0.714858
    rewards = β·log-ratio: chosen (0.05, −0.10) mean −0.025; rejected (−0.02, 0.05) mean 0.015
    accuracies: 0.05 > −0.02 yes, −0.10 > 0.05 no -> 0.5; margins (0.07 − 0.15)/2 = −0.04
    """
    loss, stats = dpo_loss(*pairs(), loss_type="sigmoid", beta=0.1)
    close(loss, 0.714858)
    close(stats["losses"], [0.658760, 0.770957])
    close(stats["rewards/chosen"], -0.025)
    close(stats["rewards/rejected"], 0.015)
    close(stats["rewards/accuracies"], 0.5)
    close(stats["rewards/margins"], -0.04)


def test_dpo_sigmoid_gradient():
    """∂/∂logπ(y_w) of lσ(βΔ) = −β·σ(−βΔ), divided by B = 2 for the mean:
    pair 1: −0.1·σ(−0.07)/2 = −0.1·0.482507/2 = −0.0241254
    pair 2: −0.1·σ(0.15)/2  = −0.1·0.537430/2 = −0.0268715
    The rejected gradient is the negative of these; the reference gets none; stats carry none.
    """
    pc, pr, rc, rr = pairs(requires_grad=True)
    loss, stats = dpo_loss(pc, pr, rc, rr, loss_type="sigmoid", beta=0.1)
    loss.backward()
    close(pc.grad, [-0.0241254, -0.0268715])
    close(pr.grad, [0.0241254, 0.0268715])
    assert not any(v.requires_grad for v in stats.values())


def test_dpo_ipo_normalises_by_length():
    """β = 0.5 so 1/(2β) = 1. Lengths: chosen (5, 4), rejected (2, 5).
    pair 1: Δ̄ = 0.5/5 − (−0.2)/2 = 0.1 + 0.1 = 0.2    -> (0.2 − 1)² = 0.64
    pair 2: Δ̄ = −1.0/4 − 0.5/5 = −0.25 − 0.1 = −0.35 -> (−0.35 − 1)² = 1.8225
    loss = (0.64 + 1.8225)/2 = 1.23125. Rewards stay β·(summed log-ratio), as TRL:
    chosen (0.25, −0.5) mean −0.125.
    """
    loss, stats = dpo_loss(*pairs(), loss_type="ipo", beta=0.5, chosen_lengths=t(5, 4), rejected_lengths=t(2, 5))
    close(stats["losses"], [0.64, 1.8225])
    close(loss, 1.23125)
    close(stats["rewards/chosen"], -0.125)


def test_dpo_ipo_requires_lengths():
    with pytest.raises(ValueError, match="chosen_lengths"):
        dpo_loss(*pairs(), loss_type="ipo", beta=0.5)


def test_dpo_hinge():
    """β = 2: pair 1: max(0, 1 − 2·0.7) = max(0, −0.4) = 0; pair 2: max(0, 1 + 2·1.5) = 4.
    loss = 2.0; the satisfied pair 1 gets no gradient, pair 2 gets −β/B = −1 on its chosen log-prob.
    """
    pc, pr, rc, rr = pairs(requires_grad=True)
    loss, stats = dpo_loss(pc, pr, rc, rr, loss_type="hinge", beta=2.0)
    close(stats["losses"], [0.0, 4.0])
    close(loss, 2.0)
    loss.backward()
    close(pc.grad, [0.0, -1.0])


def test_dpo_robust():
    """Pair 1 only, β = 0.1, ε = 0.1, z = 0.07.
    [(1 − ε)·lσ(z) − ε·lσ(−z)]/(1 − 2ε), and lσ(−z) = lσ(z) + z, so this is lσ(z) − ε·z/(1 − 2ε)
    = 0.658760 − 0.1·0.07/0.8 = 0.658760 − 0.00875 = 0.650010.
    With ε = 0 it is plain DPO: 0.658760.
    """
    pc, pr, rc, rr = (x[:1] for x in pairs())
    loss, _ = dpo_loss(pc, pr, rc, rr, loss_type="robust", beta=0.1, label_smoothing=0.1)
    close(loss, 0.650010)
    loss0, _ = dpo_loss(pc, pr, rc, rr, loss_type="robust", beta=0.1)
    close(loss0, 0.658760)
    with pytest.raises(ValueError, match="0.5"):
        dpo_loss(pc, pr, rc, rr, loss_type="robust", beta=0.1, label_smoothing=0.5)


def test_dpo_apo_zero():
    """Pair 1, β = 0.1: 1 − σ(0.1·0.5) + σ(0.1·(−0.2)) = 1 − σ(0.05) + σ(−0.02)
    = 1 − 0.512497 + 0.495000 = 0.982503.
    """
    pc, pr, rc, rr = (x[:1] for x in pairs())
    loss, _ = dpo_loss(pc, pr, rc, rr, loss_type="apo_zero", beta=0.1)
    close(loss, 0.982503)


def test_simpo_reference_free():
    """Chosen −1.0 over 2 tokens -> ā_w = −0.5; rejected −3.0 over 2 tokens -> ā_l = −1.5.
    β = 2, γ = 0.5: z = 2·(−0.5 + 1.5) − 0.5 = 1.5; lσ(1.5) = log(1 + e^−1.5) = log(1.223130) = 0.201413.
    With ε = 0.1: 0.9·lσ(z) + 0.1·lσ(−z) = lσ(z) + 0.1·z = 0.201413 + 0.15 = 0.351413.
    Rewards β·ā: chosen −1.0, rejected −3.0; accuracy 1; margin 2.0. No reference needed.
    """
    pc, pr, n = t(-1.0), t(-3.0), t(2.0)
    loss, stats = dpo_loss(pc, pr, None, None, loss_type="simpo", beta=2.0, simpo_gamma=0.5,
                           chosen_lengths=n, rejected_lengths=n)
    close(loss, 0.201413)
    close(stats["rewards/chosen"], -1.0)
    close(stats["rewards/rejected"], -3.0)
    close(stats["rewards/accuracies"], 1.0)
    close(stats["rewards/margins"], 2.0)
    loss_ls, _ = dpo_loss(pc, pr, None, None, loss_type="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.1,
                          chosen_lengths=n, rejected_lengths=n)
    close(loss_ls, 0.351413)


def test_dpo_rejects_unused_label_smoothing_and_missing_reference():
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*pairs(), loss_type="sigmoid", beta=0.1, label_smoothing=0.1)
    pc, pr, _, _ = pairs()
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        dpo_loss(pc, pr, None, None, loss_type="sigmoid", beta=0.1)
    with pytest.raises(ValueError, match="Unknown"):
        dpo_loss(*pairs(), loss_type="kto", beta=0.1)


@pytest.mark.parametrize("loss_type", list(DPO_LOSSES))
def test_every_registered_dpo_loss_pulls_towards_the_chosen_reply(loss_type):
    """Each loss in the registry, called by name with the options it reads, falls as the policy's chosen
    log-prob rises and as its rejected one falls (pairs() sits inside every loss's active region: |βΔ| < 1)."""
    pc, pr, rc, rr = pairs(requires_grad=True)
    kind = DPO_LOSS_TRAITS[loss_type]
    loss, stats = dpo_loss(pc, pr, None if kind.reference_free else rc, None if kind.reference_free else rr,
                           loss_type=loss_type, beta=0.1, label_smoothing=0.1 if kind.label_smoothing else 0.0,
                           chosen_lengths=t(2.0, 3.0), rejected_lengths=t(3.0, 2.0))
    loss.backward()
    assert (pc.grad < 0).all() and (pr.grad > 0).all(), (pc.grad, pr.grad)
    assert stats["losses"].shape == (2,) and torch.isfinite(loss)


def test_the_dpo_config_offers_exactly_the_registered_losses():
    import typing

    from trainer.stages.dpo import DPOConfig

    assert typing.get_args(typing.get_type_hints(DPOConfig)["loss_type"]) == tuple(DPO_LOSSES)


def test_the_torch_free_option_names_are_the_registries_keys():
    """The configs take their choices from `trainer.algorithms.choices` (no torch); each list names exactly the
    formulas of its registry, in order, so a new formula is offered by the config and a removed one is refused."""
    import typing

    from trainer.algorithms import choices
    from trainer.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from trainer.algorithms.policy import TOKEN_LOSS_AGGREGATIONS

    assert typing.get_args(choices.DPOLossType) == tuple(choices.DPO_LOSS_TRAITS) == tuple(DPO_LOSSES)
    assert typing.get_args(choices.AdvantageEstimator) == tuple(ADVANTAGE_ESTIMATORS)
    assert typing.get_args(choices.GRPOLossType) == tuple(TOKEN_LOSS_AGGREGATIONS)


# ---------------------------------------------------------------------------------------------
# Reward model
# ---------------------------------------------------------------------------------------------


def test_bradley_terry_plain_and_stats():
    """r_w = (2.0, 0.5), r_l = (1.0, 1.0): differences (1.0, −0.5).
    lσ(1) = 0.313262, lσ(−0.5) = 0.974077 -> loss = 0.643669.
    accuracy 1/2; margin (1 − 0.5)/2 = 0.25; rewards {2, 0.5, 1, 1}: min 0.5, mean 1.125, max 2.
    Gradient on r_w: −σ(−d)/B = (−σ(−1)/2, −σ(0.5)/2) = (−0.134471, −0.311230).
    """
    rc = t(2.0, 0.5).requires_grad_()
    loss, stats = bradley_terry_loss(rc, t(1.0, 1.0))
    close(loss, 0.643669)
    close(stats["accuracy"], 0.5)
    close(stats["margin"], 0.25)
    close(stats["min_reward"], 0.5)
    close(stats["mean_reward"], 1.125)
    close(stats["max_reward"], 2.0)
    loss.backward()
    close(rc.grad, [-0.134471, -0.311230])


def test_bradley_terry_margin_and_centring():
    """Margin m = (0.5, 0): logits (1 − 0.5, −0.5) = (0.5, −0.5):
    lσ(0.5) = 0.474077, lσ(−0.5) = 0.974077 -> 0.724077.
    Centring c = 0.01: mean((2 + 1)², (0.5 + 1)²) = (9 + 2.25)/2 = 5.625 -> + 0.05625 = 0.780327.
    The logged margin ignores m: still 0.25.
    """
    loss, stats = bradley_terry_loss(t(2.0, 0.5), t(1.0, 1.0), margin=t(0.5, 0.0))
    close(loss, 0.724077)
    loss, stats = bradley_terry_loss(t(2.0, 0.5), t(1.0, 1.0), margin=t(0.5, 0.0), center_rewards_coefficient=0.01)
    close(loss, 0.780327)
    close(stats["margin"], 0.25)


# ---------------------------------------------------------------------------------------------
# GRPO rewards and advantages
# ---------------------------------------------------------------------------------------------


def test_combine_rewards_ignores_none():
    """Weights (1, 0.5). Row (1, None) -> 1·1 = 1 (the None is skipped);
    row (0.5, 2) -> 0.5 + 1 = 1.5; row (None, None) -> unscorable, NaN.
    """
    per_func = torch.tensor([[1.0, math.nan], [0.5, 2.0], [math.nan, math.nan]])
    out = combine_rewards(per_func, t(1.0, 0.5))
    close(out[:2], [1.0, 1.5])
    assert math.isnan(out[2].item())


REWARDS = t(1.0, 2.0, 3.0, 5.0, 5.0, 5.0)  # two prompts, G = 3; the second group has zero variance


def test_group_advantages_group_scaling():
    """Group 1 (1, 2, 3): mean 2, std (Bessel) √((1 + 0 + 1)/2) = 1 -> A = (−1, 0, 1)/(1 + 1e−4)
    = (−0.999900, 0, 0.999900). Group 2 (5, 5, 5): std 0 -> A = 0/(0 + 1e−4) = 0.
    reward = 21/6 = 3.5; reward_std = batch std: deviations (−2.5, −1.5, −0.5, 1.5, 1.5, 1.5),
    squares sum 15.5, /5 = 3.1, √3.1 = 1.760682; frac_reward_zero_std = 1 of 2 groups = 0.5.
    """
    adv, stats = group_advantages(REWARDS, 3, "group")
    close(adv, [-0.999900, 0.0, 0.999900, 0.0, 0.0, 0.0])
    close(stats["reward"], 3.5)
    close(stats["reward_std"], 1.760682)
    close(stats["frac_reward_zero_std"], 0.5)


def test_group_advantages_batch_scaling():
    """Centred per group as above, (−1, 0, 1, 0, 0, 0), then divided by the batch std 1.760682:
    1/(1.760682 + 1e−4) = 0.567930. The batch std is not zero -> frac_reward_zero_std = 0 (TRL's
    definition for "batch"), though the constant group still gets advantage 0.
    """
    adv, stats = group_advantages(REWARDS, 3, "batch")
    close(adv, [-0.567930, 0.0, 0.567930, 0.0, 0.0, 0.0])
    close(stats["frac_reward_zero_std"], 0.0)


def test_group_advantages_no_scaling():
    """Dr. GRPO: only centred, (−1, 0, 1, 0, 0, 0); the zero-variance group is still counted: 0.5."""
    adv, stats = group_advantages(REWARDS, 3, "none")
    close(adv, [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    close(stats["frac_reward_zero_std"], 0.5)


def test_group_advantages_nan_rewards_are_left_out():
    """Group (1, NaN, 3): mean over scored = 2; std √((1 + 1)/(2 − 1)) = √2 = 1.414214;
    A = (−1, ·, 1)/(1.414214 + 1e−4) = (−0.707057, 0, 0.707057); the unscorable one gets 0.
    reward = nanmean(1, 3, 5, 5, 5) = 19/5 = 3.8.
    """
    rewards = t(1.0, math.nan, 3.0, 5.0, 5.0, 5.0)
    adv, stats = group_advantages(rewards, 3, "group")
    close(adv, [-0.707057, 0.0, 0.707057, 0.0, 0.0, 0.0])
    close(stats["reward"], 3.8)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_constant_groups_of_inexact_rewards_are_zero_variance(scale):
    """Eight rewards of 0.2 (a format reward weighted 0.2) have a float32 std of ~1.6e-8, not 0:
    the group still counts as zero-variance and its advantages are exactly 0."""
    rewards = torch.cat([torch.full((8,), 0.2), torch.tensor([0.0, 1.2, 0.2, 1.2, 0.0, 0.2, 1.2, 0.2])])
    adv, stats = group_advantages(rewards, 8, scale)
    assert torch.equal(adv[:8], torch.zeros(8)) and adv[8:].abs().min() > 0
    close(stats["frac_reward_zero_std"], 0.5 if scale != "batch" else 0.0)
    adv, stats = group_advantages(torch.full((8,), 0.2), 8, scale)  # the whole batch constant
    assert torch.equal(adv, torch.zeros(8)) and stats["frac_reward_zero_std"] == 1.0


def test_group_advantages_single_generation_and_bad_size():
    """G = 1: every 'group' is one sample with std 0 -> advantages 0 and frac_reward_zero_std = 1."""
    adv, stats = group_advantages(t(1.0, 2.0), 1, "group")
    close(adv, [0.0, 0.0])
    close(stats["frac_reward_zero_std"], 1.0)
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(t(1.0, 2.0, 3.0), 2, "group")
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(t(1.0, 2.0), 2, "prompt")


def test_group_advantages_matches_a_readable_loop():
    """The vectorised version equals a per-group Python loop with torch.std (Bessel) on random data."""
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(5 * 4, generator=gen)
    adv, _ = group_advantages(rewards, 4, "group")
    expected = torch.cat([(g - g.mean()) / (g.std() + 1e-4) for g in rewards.split(4)])
    close(adv, expected)


def test_rloo_advantages():
    """G = 3, four groups. A_i = r_i − mean of the other two scored rewards.
    (1, 2, 6): baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5 -> (−3, −1.5, 4.5)
               (= G/(G−1)·(r − 3) = 1.5·(−2, −1, 3)).
    (4, NaN, 2): the unscorable one is left out: 4 − 2 = 2, 2 − 4 = −2, and it gets 0.
    (5, 5, 5): all 0.   (NaN, 7, NaN): no scored neighbour -> all 0.
    reward = nanmean(1, 2, 6, 4, 2, 5, 5, 5, 7) = 37/9 = 4.111111;
    frac_reward_zero_std = 1/4 (only (5, 5, 5); a single scored reward has NaN std).
    """
    nan = math.nan
    rewards = t(1, 2, 6, 4, nan, 2, 5, 5, 5, nan, 7, nan)
    adv, stats = rloo_advantages(rewards, 3)
    close(adv, [-3.0, -1.5, 4.5, 2.0, 0.0, -2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    close(stats["reward"], 37 / 9)
    close(stats["frac_reward_zero_std"], 0.25)
    assert set(stats) == {"reward", "reward_std", "frac_reward_zero_std"}
    with pytest.raises(ValueError, match="num_generations"):
        rloo_advantages(t(1.0, 2.0, 3.0), 2)


def test_rloo_matches_a_readable_loop():
    """On random rewards, each advantage equals r_i minus the plain mean of the others in its group."""
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(5 * 4, generator=gen)
    adv, _ = rloo_advantages(rewards, 4)
    expected = [float(r - torch.cat([g[:i], g[i + 1:]]).mean()) for g in rewards.split(4) for i, r in enumerate(g)]
    close(adv, expected)


# ---------------------------------------------------------------------------------------------
# GRPO policy loss
# ---------------------------------------------------------------------------------------------


def test_k3_kl():
    """logπ = log 0.5, logπref = log 0.25: d = ref − logp = −log 2 -> e^d − d − 1 = 0.5 + 0.693147 − 1 = 0.193147.
    Swapped: d = log 2 -> 2 − 0.693147 − 1 = 0.306853. Equal -> 0.
    """
    logp = torch.log(t(0.5, 0.25, 0.3))
    ref = torch.log(t(0.25, 0.5, 0.3))
    close(k3_kl(logp, ref), [0.193147, 0.306853, 0.0])


def test_masked_mean():
    """x = (1, 2, 3, 4) with mask (1, 1, 0, 0): 3/2 = 1.5; per row of [[1, 2], [3, 4]]: (1.5, 0)
    (the empty row gives 0, not NaN)."""
    x = t(1, 2, 3, 4)
    close(masked_mean(x, t(1, 1, 0, 0)), 1.5)
    close(masked_mean(x.view(2, 2), t(1, 1, 0, 0).view(2, 2), dim=1), [1.5, 0.0])


# Two sequences of T = 3, ε = 0.2, ε_high = 0.28 (DAPO's clip-higher), old log-probs −1 everywhere.
#   seq 0, A = +1,   ratios (1.0, 1.5, 0.7), mask (1, 1, 1)
#   seq 1, A = −0.5, ratios (0.5, 1.5, 2.0), mask (1, 1, 0)
RATIOS = torch.tensor([[1.0, 1.5, 0.7], [0.5, 1.5, 2.0]])
OLD = torch.full((2, 3), -1.0)
ADV = t(1.0, -0.5)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def run_policy_loss(loss_type, **kw):
    logps = (OLD + torch.log(RATIOS)).requires_grad_()
    loss, stats = policy_loss(logps, OLD, ADV, MASK, loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, **kw)
    return logps, loss, stats


# Per-token losses ℓ = −min(r·A, clip(r, 0.8, 1.28)·A):
#   seq 0: r=1.0 -> −1;  r=1.5 -> −min(1.5, 1.28) = −1.28 (high-clipped);  r=0.7 -> −min(0.7, 0.8) = −0.7
#          (r < 0.8 but A > 0: the unclipped term is the smaller one, no clip)
#   seq 1: r=0.5 -> −min(−0.25, −0.4) = 0.4 (low-clipped);  r=1.5 -> −min(−0.75, −0.64) = 0.75
#          (r > 1.28 but A < 0: no clip);  third token masked
#   sums: seq 0 −2.98 over 3 tokens; seq 1 1.15 over 2 tokens; total −1.83 over 5 tokens


@pytest.mark.parametrize(
    ("loss_type", "kw", "expected"),
    [
        # mean of per-sequence means: (−2.98/3 + 1.15/2)/2 = (−0.993333 + 0.575)/2 = −0.209167
        ("grpo", {}, -0.209167),
        # local token mean: −1.83/5 = −0.366
        ("bnpo", {}, -0.366),
        # constant normaliser N·L = 2·4: −1.83/8 = −0.22875
        ("dr_grpo", {"max_completion_length": 4}, -0.22875),
        # global active tokens 10: −1.83/10 = −0.183
        ("dapo", {"num_items_in_batch": 10}, -0.183),
        # without a global count dapo falls back to the local one: −0.366
        ("dapo", {}, -0.366),
    ],
)
def test_policy_loss_aggregation(loss_type, kw, expected):
    _, loss, _ = run_policy_loss(loss_type, **kw)
    close(loss, expected)


def test_policy_loss_clip_stats():
    """Active tokens: 5. Low-clipped (r < 0.8, A < 0): seq 1 token 0 -> 1/5 = 0.2.
    High-clipped (r > 1.28, A > 0): seq 0 token 1 -> 0.2. Region: 2/5 = 0.4.
    Per sequence: low fractions (0, 1/2) -> low_min 0; high fractions (1/3, 0) -> high_max 1/3.
    No ref_logps -> no kl stat.
    """
    _, _, stats = run_policy_loss("bnpo")
    close(stats["clip_ratio/low_mean"], 0.2)
    close(stats["clip_ratio/high_mean"], 0.2)
    close(stats["clip_ratio/region_mean"], 0.4)
    close(stats["clip_ratio/low_min"], 0.0)
    close(stats["clip_ratio/high_max"], 1 / 3)
    assert "kl" not in stats


def test_policy_loss_clipping_blocks_gradient():
    """bnpo divides by 5. Unclipped ℓ = −r·A has ∂ℓ/∂logp = −r·A (∂r/∂logp = r):
    seq 0: token 0 −1·1/5 = −0.2; token 1 clipped -> 0; token 2 −0.7/5 = −0.14
    seq 1: token 0 clipped -> 0; token 1 −1.5·(−0.5)/5 = 0.15; token 2 masked -> 0
    """
    logps, loss, _ = run_policy_loss("bnpo")
    loss.backward()
    close(logps.grad, [[-0.2, 0.0, -0.14], [0.0, 0.15, 0.0]])


def test_policy_loss_importance_weights():
    """w = 0.5 on seq 0 token 0 halves its loss −1 -> −0.5: total −1.83 + 0.5 = −1.33; bnpo −1.33/5 = −0.266."""
    w = torch.ones(2, 3)
    w[0, 0] = 0.5
    _, loss, _ = run_policy_loss("bnpo", is_weights=w)
    close(loss, -0.266)


def test_policy_loss_kl_term_and_bias_correction():
    """On-policy (old = None -> r ≡ 1), A = 0, so only β·KL remains. One sequence,
    logπ = log(0.5, 0.25), logπref = log(0.25, 0.5): KL = (0.193147, 0.306853), mean 0.25 (stat ``kl``).
    grpo, β = 0.1: loss = 0.1·0.25 = 0.025.
    Gradient without correction: (β/T)·∂k3/∂logp = 0.05·(1 − e^{ref−logp}) = 0.05·(1 − 0.5, 1 − 2)
    = (0.025, −0.05).
    With ``use_bias_correction_kl`` the term is r·k3 and ∂r/∂logp = r = 1 adds 0.05·k3:
    (0.025 + 0.009657, −0.05 + 0.015343) = (0.034657, −0.034657); the value is unchanged.
    """
    ref = torch.log(t(0.25, 0.5)).view(1, 2)
    mask = torch.ones(1, 2)
    for correct, grad in [(False, [0.025, -0.05]), (True, [0.034657, -0.034657])]:
        logps = torch.log(t(0.5, 0.25)).view(1, 2).requires_grad_()
        loss, stats = policy_loss(logps, None, t(0.0), mask, loss_type="grpo", epsilon=0.2, ref_logps=ref,
                                  beta=0.1, use_bias_correction_kl=correct)
        close(loss, 0.025)
        close(stats["kl"], 0.25)
        loss.backward()
        close(logps.grad, [grad])


def test_policy_loss_argument_errors():
    logps = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss(logps, None, t(1.0), torch.ones(1, 2), loss_type="grpo", epsilon=0.2, beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logps, None, t(1.0), torch.ones(1, 2), loss_type="dr_grpo", epsilon=0.2)


def test_aggregate_token_loss_length_bias():
    """Unit losses, one sequence of 4 tokens and one of 1 (max length 4):
    grpo (1 + 1)/2 = 1; bnpo 5/5 = 1; dr_grpo 5/(2·4) = 0.625; dapo with 20 global tokens 5/20 = 0.25.
    """
    ones = torch.ones(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    close(aggregate_token_loss(ones, mask, "grpo"), 1.0)
    close(aggregate_token_loss(ones, mask, "bnpo"), 1.0)
    close(aggregate_token_loss(ones, mask, "dr_grpo", max_completion_length=4), 0.625)
    close(aggregate_token_loss(ones, mask, "dapo", num_items_in_batch=torch.tensor(20)), 0.25)


@pytest.mark.parametrize(
    ("mode", "clip_min", "clip_max", "expected_row0"),
    [
        # per-token ratios e^0.5 = 1.648721 -> truncated to 1.5, e^−1 = 0.367879 kept, masked token -> 1
        ("token_truncate", None, 1.5, [1.5, 0.367879, 1.0]),
        # 1.648721 > 1.5 -> masked to 0
        ("token_mask", None, 1.5, [0.0, 0.367879, 1.0]),
        # sequence ratio e^(0.5 − 1) = e^−0.5 = 0.606531, inside [0.5, 1.5]
        ("sequence_truncate", 0.5, 1.5, [0.606531]),
        # 0.606531 < 0.7 -> the whole sequence gets weight 0
        ("sequence_mask", 0.7, 1.5, [0.0]),
    ],
)
def test_rollout_is_weights(mode, clip_min, clip_max, expected_row0):
    """Row 0: trainer log-probs (−1, −2, −1), engine (−1.5, −1, −9), mask (1, 1, 0): log-ratios (0.5, −1, masked).
    Row 1: the engine could not score token 0 (NaN) and agrees elsewhere -> every weight 1.
    |old − rollout| over valid tokens: 0.5, 1, 0, 0 -> mean 0.375, max 1.
    """
    old = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.5, -1.0, -9.0], [math.nan, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    w, stats = rollout_is_weights(old, rollout, mask, mode=mode, clip_min=clip_min, clip_max=clip_max)
    close(w[0], expected_row0)
    close(w[1], torch.ones_like(w[1]))
    close(stats["sampling/sampling_logp_difference/mean"], 0.375)
    close(stats["sampling/sampling_logp_difference/max"], 1.0)


# ---------------------------------------------------------------------------------------------
# PPO
# ---------------------------------------------------------------------------------------------


def test_gae_advantages():
    """rewards (0, 1, 5), values (0.5, 0.8, 9), mask (1, 1, 0): the masked token is zeroed.
    γ = 0.9, λ = 0.8 (γλ = 0.72), V after the last active token = 0:
      t=1: δ = 1 + 0.9·0 − 0.8 = 0.2              A1 = 0.2
      t=0: δ = 0 + 0.9·0.8 − 0.5 = 0.22           A0 = 0.22 + 0.72·0.2 = 0.364
    returns = A + V = (0.864, 1.0, 0).
    With γ = λ = 1, A_t = (sum of later rewards) − V_t: (1 − 0.5, 1 − 0.8) = (0.5, 0.2).
    """
    rewards = torch.tensor([[0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.8, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.364, 0.2, 0.0]])
    close(ret, [[0.864, 1.0, 0.0]])
    assert not adv.requires_grad and not ret.requires_grad
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.2, 0.0]])
    close(ret, [[1.0, 1.0, 0.0]])


def test_masked_whiten():
    """x = (1, 2, 3, 100), mask (1, 1, 1, 0): mean 2, var (1 + 0 + 1)/(3 − 1) = 1 -> (−1, 0, 1, 0).
    shift_mean=False adds the mean back: (1, 2, 3, 0)."""
    x, mask = t(1, 2, 3, 100), t(1, 1, 1, 0)
    close(masked_whiten(x, mask), [-1.0, 0.0, 1.0, 0.0])
    close(masked_whiten(x, mask, shift_mean=False), [1.0, 2.0, 3.0, 0.0])

    # Moments of the whole batch, summed from two halves (two ranks): the same whitening.
    moments = masked_moments(x[:2], mask[:2]) + masked_moments(x[2:], mask[2:])
    close(moments, [3.0, 6.0, 14.0])
    close(masked_whiten(x, mask, moments=moments), [-1.0, 0.0, 1.0, 0.0])
    close(masked_whiten(x[2:], mask[2:], shift_mean=False, moments=moments), [3.0, 0.0])


def test_value_loss():
    """c = 0.2. Token 0: V = 1, V_old = 0.5 -> clipped to 0.7; R = 2:
    (1 − 2)² = 1 vs (0.7 − 2)² = 1.69 -> 1.69 (clipped term larger).
    Token 1: V = V_old = 2, R = 1: both (2 − 1)² = 1 -> 1. Token 2 masked.
    loss = 0.5·(1.69 + 1)/2 = 0.6725; clipfrac 1/2; vpred (1 + 2)/2 = 1.5; error (1 + 1)/2 = 1.
    Gradient: token 0 uses the clipped V, constant -> 0; token 1: 0.5·(1/2)·2(V − R) = 0.5.
    """
    values = torch.tensor([[1.0, 2.0, 7.0]], requires_grad=True)
    old = torch.tensor([[0.5, 2.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = value_loss(values, old, returns, mask, clip_range_value=0.2)
    close(loss, 0.6725)
    close(stats["ppo/loss/value"], 0.6725)
    close(stats["ppo/val/clipfrac"], 0.5)
    close(stats["ppo/val/vpred"], 1.5)
    close(stats["ppo/val/error"], 1.0)
    loss.backward()
    close(values.grad, [[0.0, 0.5, 0.0]])


def test_kl_penalty_rewards():
    """β = 0.1. Row 0: logp (−1, −2), ref (−1.5, −1) -> KL (0.5, −1); −β·KL = (−0.05, 0.1);
    the score 1 goes to the last active token (column 1): rewards (−0.05, 1.1, 0).
    Row 1: one token, KL 0: rewards (2, 0, 0).
    objective/kl = mean(0.5 − 1, 0) = −0.25; non_score_reward = mean(0.05, 0) = 0.025;
    scores = 1.5; rlhf_reward = mean(1 + 0.05, 2 + 0) = 1.525.
    A row without completion tokens gets nothing (its score has nowhere to go).
    """
    logps = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, 3.0], [-0.5, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rewards, stats = kl_penalty_rewards(t(1.0, 2.0), logps, ref, mask, kl_coef=0.1)
    close(rewards, [[-0.05, 1.1, 0.0], [2.0, 0.0, 0.0]])
    close(stats["objective/kl"], -0.25)
    close(stats["objective/non_score_reward"], 0.025)
    close(stats["objective/scores"], 1.5)
    close(stats["objective/rlhf_reward"], 1.525)
    empty, _ = kl_penalty_rewards(t(3.0), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), kl_coef=0.1)
    close(empty, [[0.0, 0.0]])


def test_ppo_policy_loss():
    """ε = 0.2, A = 1 on both active tokens; logp − old = (0, ln 1.5) -> r = (1, 1.5).
    Token 0: max(−1, −1) = −1.  Token 1: max(−1.5, −clip(1.5)·1 = −1.2) = −1.2 (clipped).
    loss = (−1 − 1.2)/2 = −1.1; clipfrac 1/2; approxkl = ½·(0 + ln²1.5)/2 = ½·0.164402/2 = 0.041101.
    Gradient: token 0: −r/2 = −0.5; token 1 clipped: 0; the masked token: 0.
    """
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    logps = (old + torch.tensor([[0.0, math.log(1.5), 5.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = ppo_policy_loss(logps, old, adv, mask, cliprange=0.2)
    close(loss, -1.1)
    close(stats["ppo/loss/policy"], -1.1)
    close(stats["ppo/policy/clipfrac"], 0.5)
    close(stats["ppo/policy/approxkl"], 0.041101)
    loss.backward()
    close(logps.grad, [[-0.5, 0.0, 0.0]])


def test_kl_controllers_hand_values():
    """Adaptive, β = 0.2, target 6, horizon 10000, 256 rollouts:
    KL 9: e = 9/6 − 1 = 0.5, clipped to 0.2 -> β = 0.2·(1 + 0.2·256/10000) = 0.2·1.00512 = 0.201024.
    KL 3: e = −0.5 -> −0.2 -> β = 0.201024·(1 − 0.00512) = 0.199994758.
    KL 6.6: e = 0.1 (inside the clip) -> β·(1 + 0.1·0.0256) = 0.199994758·1.00256 = 0.200506745.
    Fixed: stays 0.2.
    """
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl.update(9.0, 256)
    assert math.isclose(ctl.value, 0.201024, rel_tol=1e-9)
    ctl.update(3.0, 256)
    assert math.isclose(ctl.value, 0.199994758, rel_tol=1e-8)
    ctl.update(6.6, 256)
    assert math.isclose(ctl.value, 0.200506745, rel_tol=1e-8)
    fixed = FixedKLController(0.2)
    fixed.update(100.0, 256)
    assert fixed.value == 0.2


@pytest.mark.parametrize("start", [0.02, 0.5])
def test_adaptive_kl_controller_moves_kl_to_target(start):
    """A policy whose KL falls as β rises (KL = 0.6/β, so KL = target 6 at β* = 0.1): from β too small
    (KL 30) or too large (KL 1.2) the controller brings KL within 2 % of the target, and β to β*."""
    ctl = AdaptiveKLController(start, target=6.0, horizon=100)
    gaps = []
    for _ in range(400):
        kl = 0.6 / ctl.value
        gaps.append(abs(kl - 6.0))
        ctl.update(kl, n_steps=10)
    assert gaps[-1] < 0.02 * 6.0 < gaps[0]
    assert all(b <= a + 1e-9 for a, b in zip(gaps, gaps[1:])), "the gap to the target never grows"
    assert math.isclose(ctl.value, 0.1, rel_tol=0.02)


def test_value_stats():
    """V = (1, 2, 3), R = (2, 2, 5), a masked 4th token.
    R: mean 3, deviations (−1, −1, 2), Σ² = 6, var (Bessel) 6/2 = 3.
    R − V = (1, 0, 2): mean 1, deviations (0, −1, 1), Σ² = 2, var 1 -> var_explained 1 − 1/3 = 0.666667.
    Constant returns: Var(R) = 0 -> var_explained 0.
    """
    values, returns, mask = t(1, 2, 3, 50), t(2, 2, 5, -50), t(1, 1, 1, 0)
    stats = value_stats(values, returns, mask)
    close(stats["ppo/returns/mean"], 3.0)
    close(stats["ppo/returns/var"], 3.0)
    close(stats["ppo/val/var_explained"], 2 / 3)
    close(value_stats(values, t(1, 1, 1, 0), mask)["ppo/val/var_explained"], 0.0)
