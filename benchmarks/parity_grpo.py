"""parity.py's GRPO and RLOO cases: the policy loss on given completions against TRL 1.16's GRPOTrainer, the same
scored by each side (rewards -> advantages -> old and reference log-probs -> loss), and RLOO against its RLOOTrainer.
See parity.py's docstring for what is compared and benchmarks/NOTES.md for the results."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity_measure import (
    grad_norm,
    perturbed,
    read_rows,
    rel_diff,
    row,
    shared_metrics,
    trl_args,
    worst_metric,
)


def group_completions(tokenizer, pairs: list[dict], max_length: int, group: int) -> tuple[list, list]:
    """Each preference pair as a group of `group` completions of its prompt, each + eos: chosen and rejected, then
    (group 4) their first halves. Returns the prompt token ids and the completion token ids, one per completion."""
    eos = tokenizer.eos_token_id
    prompts, completions = [], []
    for pair in pairs:
        prompt = tokenizer(pair["prompt"])["input_ids"]
        answers = [tokenizer(pair[k], add_special_tokens=False)["input_ids"][:max_length] for k in ("chosen", "rejected")]
        answers += [a[:max(1, len(a) // 2)] for a in answers][:group - 2]
        prompts += [prompt] * group
        completions += [a + [eos] for a in answers]
    return prompts, completions


@dataclass
class Layout:
    """Rollouts as both sides batch them: prompts left-padded [N, P], completions right-padded [N, C]; `batch` is
    alignflow's `RolloutBatch` of the same rows [N, P+C]."""

    prompt_ids: Any
    prompt_mask: Any
    completion_ids: Any
    completion_mask: Any
    batch: Any

    @classmethod
    def build(cls, prompts: list[list[int]], completions: list[list[int]], pad: int) -> Layout:
        import torch

        from trainer.engine.completions import RolloutBatch

        width_p, width_c, n = max(map(len, prompts)), max(map(len, completions)), len(completions)
        prompt_ids, completion_ids = torch.full((n, width_p), pad), torch.full((n, width_c), pad)
        prompt_mask = torch.zeros((n, width_p), dtype=torch.long)
        completion_mask = torch.zeros((n, width_c), dtype=torch.long)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            prompt_ids[i, width_p - len(p):], prompt_mask[i, width_p - len(p):] = torch.tensor(p), 1
            completion_ids[i, :len(c)], completion_mask[i, :len(c)] = torch.tensor(c), 1
        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        batch = RolloutBatch(input_ids, torch.cat([prompt_mask, completion_mask], 1),
                             torch.cat([torch.zeros_like(prompt_mask), completion_mask], 1),
                             torch.zeros(input_ids.shape), completion_mask.sum(1), torch.zeros(n, dtype=torch.bool),
                             width_p)
        return cls(prompt_ids, prompt_mask, completion_ids, completion_mask, batch)

    @property
    def width_p(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def width_c(self) -> int:
        return self.completion_ids.shape[1]

    @property
    def input_ids(self):
        return self.batch.input_ids

    @property
    def attention(self):
        return self.batch.attention_mask

    @property
    def full_mask(self):
        return self.batch.completion_mask


def grpo_case(model, tokenizer, work: Path, *, beta: float, bias_correction: bool | None, max_length: int,
              count: int, shared: bool = False) -> dict[str, Any]:
    """One GRPO update (TRL's default loss_type dapo, epsilon 0.2) on fixed completions: each preference pair is a
    group of G = 2 completions of its prompt (chosen, rejected, each + eos), with fixed advantages (+1, −1 scaled
    per group). The policy is the model plus noise and the old (rollout-time) policy and the reference are the model,
    so the ratios are not 1 and some clip. Both sides get the same old and reference log-probs (alignflow's
    `token_logps` on the model). `bias_correction`: TRL's `use_bias_correction_kl` (None = its default); `shared`:
    alignflow runs each group's prompt once (`share_prompts`, as its GRPO stage does), TRL once per completion."""
    import datasets
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from trainer.algorithms.policy import policy_loss
    from trainer.engine.completions import token_logps

    pairs = read_rows("preferences.jsonl", count)
    rows, completions = group_completions(tokenizer, pairs, max_length, group=2)
    layout = Layout.build(rows, completions, tokenizer.pad_token_id)
    prompt_ids, prompt_mask, completion_ids, completion_mask = (
        layout.prompt_ids, layout.prompt_mask, layout.completion_ids, layout.completion_mask)
    width_p, width_c, n = layout.width_p, layout.width_c, len(completions)
    advantages = torch.tensor([1.0, -1.0] * (n // 2)) * torch.linspace(0.5, 1.5, n)  # [N]
    input_ids, attention, full_mask, batch = layout.input_ids, layout.attention, layout.full_mask, layout.batch

    with torch.no_grad():
        old, _ = token_logps(model.eval(), batch, slice(None))  # [N, P+C]; also the reference
    model.train()
    tokens = float(completion_mask.sum())

    corrected = GRPOConfig.use_bias_correction_kl if bias_correction is None else bias_correction
    # alignflow: as `grpo.update` for one micro-batch holding the whole cycle.
    policy = perturbed(model)
    ours = copy.deepcopy(policy).train()
    logps, ent = token_logps(ours, batch, slice(None), with_entropy=True, group_size=2 if shared else 0)
    loss_ours, stats = policy_loss(logps, old, advantages, full_mask, loss_type="dapo", epsilon=0.2,
                                   ref_logps=old if beta else None, beta=beta, max_completion_length=width_c,
                                   num_items_in_batch=tokens, use_bias_correction_kl=corrected)
    loss_ours.backward()
    our_metrics = {"entropy": ent, **{k: float(v) for k, v in stats.items() if v.ndim == 0}}

    # TRL: the inputs its generation step would hand to compute_loss.
    theirs = copy.deepcopy(policy)
    extra = {} if bias_correction is None else {"use_bias_correction_kl": bias_correction}
    args = trl_args(GRPOConfig, work, loss_type="dapo", beta=beta, epsilon=0.2, num_generations=2,
                    max_completion_length=width_c, temperature=1.0, **extra)
    prompts_ds = datasets.Dataset.from_list([{"prompt": p["prompt"]} for p in pairs])
    trainer = GRPOTrainer(model=theirs, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=prompts_ds, processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1  # set by `training_step` during training
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages,
              "old_per_token_logps": old[:, width_p:], "num_items_in_batch": torch.tensor(tokens)}
    if beta:
        inputs["ref_per_token_logps"] = old[:, width_p:]
    theirs.train()
    loss_trl = trainer.compute_loss(trainer.model, inputs)
    loss_trl.backward()
    with torch.no_grad():
        trl_logps = trainer._get_per_token_logps_and_entropies(theirs, input_ids, attention, width_c)[0]

    mask = completion_mask.bool()
    logprob_diff = float((logps[:, width_p:][mask] - trl_logps[mask]).abs().max())
    case = ("dapo" + (f", beta {beta}, use_bias_correction_kl={corrected}"
                      + (" (TRL's default)" if bias_correction is None else "") if beta else ", beta 0")
            + (", alignflow shared prompts" if shared else ""))
    return row("grpo", case, (True, 0), logprob_diff, (float(loss_ours.detach()), float(loss_trl.detach())),
               (grad_norm(ours), grad_norm(theirs)), shared_metrics(our_metrics, trainer._metrics["train"]),
               (input_ids.shape, input_ids.shape))


# Fixed rewards of the scored GRPO cases: 4 groups of G = 4; the third group is constant (std 0, advantages 0).
GROUP_REWARDS = (1.0, 0.0, 0.25, 2.0, -0.5, 1.5, 0.75, 0.0, 0.5, 0.5, 0.5, 0.5, 3.0, -1.0, 0.0, 1.25)


def grpo_scored_case(model, tokenizer, work: Path, *, loss_type: str, temperature: float = 1.0, beta: float = 0.0,
                     scale_rewards: str = "group", num_iterations: int = 1, max_length: int,
                     count: int) -> dict[str, Any]:
    """One GRPO update where each side computes its own advantages, old and reference log-probs.

    The rollouts are fixed: each preference pair is a group of G = 4 completions of its prompt (chosen, rejected and
    their first halves, each + eos), with fixed rewards (`GROUP_REWARDS`, one group constant). The generating policy
    is the model plus noise (the reference is the model, so KL terms are not 0). alignflow: what its GRPO stage's
    `rollout` and `update` call, in order: `combine_rewards` -> `ADVANTAGE_ESTIMATORS["grpo"]` (`scale_rewards`) ->
    `batched_logps` at `logit_temperature(temperature)` for the old policy (num_iterations > 1) and the reference
    (beta > 0) -> `token_logps` + `policy_loss`. TRL: `GRPOTrainer._generate_and_score_completions` with only its
    generation step (`_generate`) replaced by one that returns these completions, and a reward function that returns
    these rewards: TRL pads, scores, normalises and computes its old and reference log-probs itself; then
    `compute_loss` on its output. With `num_iterations` 2 the update runs at the second iteration: the policy has
    moved since the rollout (the generating policy plus more noise on both sides), so the ratios are not 1."""
    import datasets
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from trainer.algorithms.advantages import ADVANTAGE_ESTIMATORS, combine_rewards
    from trainer.algorithms.logprobs import logit_temperature
    from trainer.algorithms.policy import policy_loss
    from trainer.engine.completions import batched_logps, token_logps
    from trainer.stages.rl.grpo import GRPOConfig as OurGRPOConfig

    G = 4
    pairs = read_rows("preferences.jsonl", count)
    prompts, completions = group_completions(tokenizer, pairs, max_length, group=G)
    layout = Layout.build(prompts, completions, tokenizer.pad_token_id)
    n, width_c, P = len(completions), layout.width_c, layout.width_p
    rewards = torch.tensor([GROUP_REWARDS[i % len(GROUP_REWARDS)] for i in range(n)])  # [N]
    generating = perturbed(model)  # the policy that sampled the completions
    updated = perturbed(generating, scale=0.01, seed=2) if num_iterations > 1 else generating
    # TRL's default (use_bias_correction_kl true) is also alignflow's; both sides run with it.
    corrected = OurGRPOConfig.use_bias_correction_kl

    # alignflow: as `grpo.rollout` and `grpo.update` for one micro-batch holding the whole cycle.
    T = logit_temperature(temperature)
    combined = combine_rewards(rewards[:, None], torch.ones(1))  # [N]
    our_adv, reward_stats = ADVANTAGE_ESTIMATORS["grpo"](combined, G, scale_rewards)
    old = batched_logps(copy.deepcopy(generating).eval(), layout.batch, n, 0, T) if num_iterations > 1 else None
    ref = batched_logps(copy.deepcopy(model).eval(), layout.batch, n, 0, T) if beta else None
    ours = copy.deepcopy(updated).train()
    logps, ent = token_logps(ours, layout.batch, slice(None), with_entropy=True, temperature=T)
    loss_ours, stats = policy_loss(logps, old, our_adv, layout.full_mask, loss_type=loss_type, epsilon=0.2,
                                   ref_logps=ref, beta=beta, max_completion_length=width_c,
                                   num_items_in_batch=float(layout.completion_mask.sum()),
                                   use_bias_correction_kl=corrected)
    loss_ours.backward()
    our_metrics = {"entropy": ent, **{k: float(v) for k, v in {**stats, **reward_stats}.items() if v.ndim == 0},
                   "rewards/fixed_reward/mean": float(torch.nanmean(rewards)),
                   "rewards/fixed_reward/std": float(rewards.std())}

    # TRL: its scoring path on these completions and rewards.
    def fixed_reward(completions, **_):
        assert len(completions) == n
        return rewards.tolist()

    theirs = copy.deepcopy(generating)
    args = trl_args(GRPOConfig, work, loss_type=loss_type, beta=beta, epsilon=0.2, num_generations=G,
                    max_completion_length=width_c, temperature=temperature, scale_rewards=scale_rewards,
                    num_iterations=num_iterations, use_bias_correction_kl=corrected)
    texts = [p["prompt"] for p in pairs]
    trainer = GRPOTrainer(model=theirs, reward_funcs=fixed_reward, args=args,
                          train_dataset=datasets.Dataset.from_list([{"prompt": t} for t in texts]),
                          processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1  # set by `training_step` during training

    def generate(prompt_texts):  # TRL's `_generate` without the sampling: these prompts' fixed completions
        assert prompt_texts == [t for t in texts for _ in range(G)]
        decoded = tokenizer.batch_decode(completions, skip_special_tokens=True)
        return prompts, completions, None, decoded, None, {}, None, []

    trainer._generate = generate
    theirs.train()
    inputs = trainer._generate_and_score_completions([{"prompt": t} for t in texts for _ in range(G)])
    if num_iterations > 1:  # the second iteration: the policy has moved since the rollout
        theirs.load_state_dict(updated.state_dict())
    loss_trl = trainer.compute_loss(trainer.model, inputs)
    loss_trl.backward()
    with torch.no_grad():
        trl_logps = trainer._get_per_token_logps_and_entropies(theirs, layout.input_ids, layout.attention, width_c)[0]

    same_ids = bool(torch.equal(inputs["prompt_ids"], layout.prompt_ids)
                    and torch.equal(inputs["completion_ids"], layout.completion_ids))
    differing = int((inputs["completion_mask"].bool() != layout.completion_mask.bool()).sum())
    mask = layout.completion_mask.bool()
    logprob_diff = float((logps[:, P:][mask] - trl_logps[mask]).abs().max())
    for name, our_side, trl_side in (("old", old, inputs.get("old_per_token_logps")),
                                     ("ref", ref, inputs.get("ref_per_token_logps"))):
        if (our_side is None) != (trl_side is None):
            raise RuntimeError(f"only one side computed {name} log-probs")
        if our_side is not None:  # the log-prob column holds the worst of the three
            logprob_diff = max(logprob_diff, float((our_side[:, P:][mask] - trl_side[mask]).abs().max()))
    case = (f"{loss_type}, T {temperature:g}, beta {beta:g}, scale_rewards {scale_rewards}, "
            f"num_iterations {num_iterations}, scored by each side")
    result = row("grpo", case, (same_ids, differing), logprob_diff,
                 (float(loss_ours.detach()), float(loss_trl.detach())), (grad_norm(ours), grad_norm(theirs)),
                 shared_metrics(our_metrics, trainer._metrics["train"]), (layout.input_ids.shape,) * 2)
    result["advantages_max_abs_diff"] = float((our_adv - inputs["advantages"]).abs().max())
    result["advantages"] = {"alignflow": our_adv.tolist(), "trl": inputs["advantages"].tolist()}
    return result


def rloo_case(model, tokenizer, work: Path, *, max_length: int, count: int) -> dict[str, Any]:
    """alignflow's RLOO (its GRPO stage with `advantage_estimator: rloo`, loss_type dapo) against TRL 1.16's
    RLOOTrainer on the rollouts and rewards of `grpo_scored_case`, at the second iteration (num_iterations 2), beta 0.

    The advantages (leave-one-out baseline, not normalised: both defaults) are computed by each side from the same
    rewards and must agree. The objectives differ by design (docs/ppo.md): TRL's RLOOTrainer clips a sequence-level
    ratio exp(Σ_t log π − Σ_t log π_old) and averages over sequences; alignflow's RLOO is the GRPO loss with
    leave-one-out advantages (token-level ratios, `loss_type`). So the row also recomputes TRL's objective from
    alignflow's log-probs and advantages (`alignflow_with_trl_definition`)."""
    import datasets
    import torch
    from trl import RLOOConfig, RLOOTrainer

    from trainer.algorithms.advantages import ADVANTAGE_ESTIMATORS, combine_rewards
    from trainer.algorithms.policy import policy_loss
    from trainer.engine.completions import batched_logps, token_logps

    G = 4
    pairs = read_rows("preferences.jsonl", count)
    prompts, completions = group_completions(tokenizer, pairs, max_length, group=G)
    layout = Layout.build(prompts, completions, tokenizer.pad_token_id)
    n, P = len(completions), layout.width_p
    rewards = torch.tensor([GROUP_REWARDS[i % len(GROUP_REWARDS)] for i in range(n)])  # [N]
    generating = perturbed(model)
    updated = perturbed(generating, scale=0.01, seed=2)
    mask = layout.full_mask

    combined = combine_rewards(rewards[:, None], torch.ones(1))
    our_adv, reward_stats = ADVANTAGE_ESTIMATORS["rloo"](combined, G, "group")
    old = batched_logps(copy.deepcopy(generating).eval(), layout.batch, n, 0, 1.0)
    ours = copy.deepcopy(updated).train()
    logps, ent = token_logps(ours, layout.batch, slice(None), with_entropy=True)
    loss_ours, stats = policy_loss(logps, old, our_adv, mask, loss_type="dapo", epsilon=0.2,
                                   num_items_in_batch=float(layout.completion_mask.sum()))
    loss_ours.backward()
    our_metrics = {"entropy": ent, **{k: float(v) for k, v in {**stats, **reward_stats}.items() if v.ndim == 0},
                   "rewards/fixed_reward/mean": float(torch.nanmean(rewards)),
                   "rewards/fixed_reward/std": float(rewards.std())}
    # TRL's RLOO objective on alignflow's log-probs and advantages.
    redone = copy.deepcopy(updated).train()
    seq_logps = token_logps(redone, layout.batch, slice(None))[0].mul(mask).sum(1)  # [N]
    ratio = torch.exp(seq_logps - old.mul(mask).sum(1))
    loss_redone = -torch.min(ratio * our_adv, ratio.clamp(0.8, 1.2) * our_adv).mean()
    loss_redone.backward()
    with torch.no_grad():
        low, high = (ratio < 0.8) & (our_adv < 0), (ratio > 1.2) & (our_adv > 0)
        redone_metrics = {"clip_ratio/low_mean": low.float().mean(), "clip_ratio/high_mean": high.float().mean(),
                          "clip_ratio/region_mean": (low | high).float().mean()}

    def fixed_reward(completions, **_):
        return rewards.tolist()

    theirs = copy.deepcopy(generating)
    args = trl_args(RLOOConfig, work, beta=0.0, epsilon=0.2, num_generations=G, num_iterations=2,
                    max_completion_length=layout.width_c, temperature=1.0)
    texts = [p["prompt"] for p in pairs]
    trainer = RLOOTrainer(model=theirs, reward_funcs=fixed_reward, args=args,
                          train_dataset=datasets.Dataset.from_list([{"prompt": t} for t in texts]),
                          processing_class=tokenizer)
    trainer._generate = lambda prompt_texts: (prompts, completions,
                                              tokenizer.batch_decode(completions, skip_special_tokens=True))
    theirs.train()
    inputs = trainer._generate_and_score_completions([{"prompt": t} for t in texts for _ in range(G)])
    trl_old = inputs["old_logps"]
    theirs.load_state_dict(updated.state_dict())  # the second iteration
    loss_trl = trainer.compute_loss(trainer.model, inputs)
    loss_trl.backward()
    with torch.no_grad():
        trl_logps = trainer._get_per_token_logps_and_entropies(theirs, layout.input_ids, layout.attention,
                                                               layout.width_c)[0]

    real = layout.completion_mask.bool()
    logprob_diff = max(float((logps[:, P:][real] - trl_logps[real]).abs().max()),
                       float((old.mul(mask).sum(1) - trl_old).abs().max()))
    same_ids = bool(torch.equal(inputs["prompt_ids"], layout.prompt_ids)
                    and torch.equal(inputs["completion_ids"], layout.completion_ids))
    trl_metrics = trainer._metrics["train"]
    result = row("rloo", "dapo loss (alignflow) vs sequence-level ratio (TRL), num_iterations 2, scored by each side",
                 (same_ids, int((inputs["completion_mask"].bool() != real).sum())), logprob_diff,
                 (float(loss_ours.detach()), float(loss_trl.detach())), (grad_norm(ours), grad_norm(theirs)),
                 shared_metrics(our_metrics, trl_metrics), (layout.input_ids.shape,) * 2)
    result["advantages_max_abs_diff"] = float((our_adv - inputs["advantages"]).abs().max())
    result["advantages"] = {"alignflow": our_adv.tolist(), "trl": inputs["advantages"].tolist()}
    redone_result = {"loss_rel_diff": rel_diff(float(loss_redone.detach()), float(loss_trl.detach())),
                     "loss_abs_diff": abs(float(loss_redone.detach()) - float(loss_trl.detach())),
                     "grad_norm_rel_diff": rel_diff(grad_norm(redone), grad_norm(theirs)),
                     "metrics": shared_metrics({**{k: float(v) for k, v in redone_metrics.items()},
                                                **{k: v for k, v in our_metrics.items() if not k.startswith("clip")}},
                                               trl_metrics)}
    result["alignflow_with_trl_definition"] = redone_result
    result["note"] = ("TRL's RLOOTrainer clips one ratio per sequence and averages over sequences; alignflow's "
                      f"log-probs and advantages in TRL's objective: loss {redone_result['loss_rel_diff']:.1e} "
                      f"(abs {redone_result['loss_abs_diff']:.1e}), grad norm "
                      f"{redone_result['grad_norm_rel_diff']:.1e}, worst metric {worst_metric(redone_result)}")
    return result
