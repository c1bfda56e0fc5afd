"""parity.py's PPO cases: one PPO step on fixed rollouts against TRL 1.12's PPOTrainer (`trl.experimental.ppo`; TRL
1.13 removed it), run by parity.py in a child process with that TRL (`--trl-ppo-path`). See parity.py's docstring for
what is compared and benchmarks/NOTES.md for the results."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from parity_grpo import Layout, group_completions
from parity_measure import grad_norm, perturbed, read_rows, rel_diff, row, shared_metrics, trl_args

TRL_PPO_PIN = "pip install --no-deps --target DIR trl==1.12.0"


# alignflow's PPO metric -> TRL PPOTrainer's name for the same quantity (one mini-batch: TRL's `_avg` is its value).
PPO_METRIC_NAMES = {"ppo/loss/policy": "loss/policy_avg", "ppo/loss/value": "loss/value_avg",
                    "ppo/policy/clipfrac": "policy/clipfrac_avg", "ppo/policy/approxkl": "policy/approxkl_avg",
                    "ppo/val/clipfrac": "val/clipfrac_avg"}
PPO_SETTINGS = dict(kl_coef=0.05, gamma=1.0, lam=0.95, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)


def seeded_classifier(model_dir: Path, seed: int):
    """`AutoModelForSequenceClassification` (one label) from `model_dir` with a score head drawn from `seed`."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    out = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        out.score.weight.normal_(0.0, 0.5)
    return out


def ppo_case(model, tokenizer, model_dir: Path, work: Path, *, temperature: float, max_length: int,
             count: int) -> dict[str, Any]:
    """One PPO step (one epoch, one mini-batch, one micro-batch) on fixed rollouts, each side computing its own
    rollout log-probs, reference log-probs, values, scores, KL rewards, GAE advantages (whitened) and returns.

    Models, the same on both sides: the reference is the model; the policy that generated the rollouts is the model
    plus noise; the reward model and the critic (a separate value network, TRL's `value_model`, alignflow's
    `critic: reward_model`) are sequence classifiers from the model's folder with seeded heads. The update runs as at a
    later mini-batch: between the rollout and the update, policy and critic move (more seeded noise on both sides), so
    that ratios and values clip. Rollouts: the first `count` preference prompts, each with its chosen answer + eos.
    alignflow: what `ppo.rollout` and `ppo.update` call (`policy_forward` of a `PolicyWithValue`, `batched_logps`,
    `RewardModelScorer.rewards`, `kl_penalty_rewards`, `gae_advantages`, `masked_whiten`, `ppo_policy_loss`,
    `value_loss`). TRL: `PPOTrainer.train()` for one step with only its generation (`batch_generation`) replaced by
    one that returns these completions and, as generate's scores, the rollout policy's logits / (T + 1e-7) from
    TRL's own `forward`; its optimizer records the gradient norm and changes nothing; its tensors (advantages,
    returns, ...) are read from `train()`'s frame when it logs."""
    import sys as _sys

    import datasets
    import torch
    import trl
    from transformers import AutoModelForSequenceClassification

    try:
        import trl.experimental.ppo.ppo_trainer as trl_ppo
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    except ImportError as error:
        raise RuntimeError(f"TRL {trl.__version__} has no PPOTrainer (1.13 removed it): pass --trl-ppo-path DIR after "
                           f"`{TRL_PPO_PIN}`") from error

    from trainer.algorithms.advantages import gae_advantages, kl_penalty_rewards
    from trainer.algorithms.logprobs import logit_temperature
    from trainer.algorithms.masked import masked_moments, masked_whiten
    from trainer.algorithms.policy import ppo_policy_loss, value_loss, value_stats
    from trainer.engine.completions import batched_logps
    from trainer.rewards.scorer import RewardModelScorer
    from trainer.stages.rl.ppo import PolicyWithValue, policy_forward

    cfg = PPO_SETTINGS
    # The first `count` distinct prompts (TRL's batch order is matched to alignflow's by prompt), each with its chosen
    # answer + eos.
    pairs = list({r["prompt"]: r for r in reversed(read_rows("preferences.jsonl", 10 * count))}.values())[::-1]
    prompts, completions = group_completions(tokenizer, pairs[:count], max_length, group=2)
    prompts, completions = prompts[::2], completions[::2]
    layout = Layout.build(prompts, completions, tokenizer.pad_token_id)
    n, P, C = len(completions), layout.width_p, layout.width_c
    reward_dir = work / "ppo-reward"
    seeded_classifier(model_dir, seed=0).save_pretrained(reward_dir)
    tokenizer.save_pretrained(reward_dir)
    critic = seeded_classifier(model_dir, seed=3)
    rollout_policy = perturbed(model)
    policy, moved_critic = perturbed(rollout_policy, scale=0.01, seed=2), perturbed(critic, scale=0.01, seed=4)

    # alignflow: `ppo.rollout`, then `ppo.update` for one mini-batch of one micro-batch.
    T = logit_temperature(temperature)
    batch, mask = layout.batch, layout.completion_mask  # mask [N, C]
    scorer = RewardModelScorer(str(reward_dir))
    with torch.no_grad():
        scores = scorer.rewards(batch.input_ids, batch.attention_mask)  # [N]
        old_logps, old_values = policy_forward(PolicyWithValue(copy.deepcopy(rollout_policy), copy.deepcopy(critic)),
                                               batch, slice(None), T)  # [N, C]
        ref = batched_logps(copy.deepcopy(model).eval(), batch, n, temperature=T)[:, P:]
    token_rewards, stats = kl_penalty_rewards(scores, old_logps, ref, mask, cfg["kl_coef"])
    raw_advantages, returns = gae_advantages(token_rewards, old_values, mask, cfg["gamma"], cfg["lam"])
    advantages = masked_whiten(raw_advantages, mask, moments=masked_moments(raw_advantages, mask))
    stats.update(value_stats(old_values, returns, mask))
    ours = PolicyWithValue(copy.deepcopy(policy), copy.deepcopy(moved_critic)).train()
    logps, values = policy_forward(ours, batch, slice(None), T)
    pg_loss, pg_stats = ppo_policy_loss(logps, old_logps, advantages, mask, cfg["cliprange"])
    vf_loss, vf_stats = value_loss(values, old_values, returns, mask, cfg["cliprange_value"])
    loss_ours = pg_loss + cfg["vf_coef"] * vf_loss
    loss_ours.backward()
    our_metrics = {PPO_METRIC_NAMES.get(k, k): float(v) for k, v in {**stats, **pg_stats, **vf_stats}.items()}

    # TRL: train() for one PPO step on the same rollouts.
    by_prompt = {tuple(p): c for p, c in zip(prompts, completions)}
    seen: dict[str, Any] = {}

    def fixed_generation(lm, queries, _chunk, pad, _config):  # replaces trl_ppo.batch_generation
        responses = torch.full((len(queries), C), pad)
        for i, q in enumerate(queries.tolist()):
            c = by_prompt[tuple(t for t in q if t != pad)]
            responses[i, :len(c)] = torch.tensor(c)
        query_responses = torch.cat([queries, responses], 1)
        logits = trl_forward(lm, query_responses, pad).logits[:, queries.shape[1] - 1:-1] / (temperature + 1e-7)
        seen["queries"] = queries
        return query_responses, logits

    trl_forward = trl_ppo.forward

    def moving_forward(module, query_responses, pad):  # the update's forward: policy and critic have moved
        if isinstance(module, trl_ppo.PolicyAndValueWrapper):
            if "moved" not in seen:
                module.policy.load_state_dict(policy.state_dict())
                module.value_model.load_state_dict(moved_critic.state_dict())
                seen["moved"] = True
        return trl_forward(module, query_responses, pad)

    class RecordingOptimizer(torch.optim.Optimizer):  # keeps the gradient norm; leaves the weights as they are
        def __init__(self, params):
            super().__init__(params, {"lr": 0.0})

        def step(self, closure=None):
            grads = [p.grad.detach().double().norm() for g in self.param_groups for p in g["params"]
                     if p.grad is not None]
            seen["grad_norm"] = float(torch.stack(grads).norm())

    trl_tokenizer = copy.deepcopy(tokenizer)
    trl_tokenizer.padding_side = "left"
    theirs_policy, theirs_critic = copy.deepcopy(rollout_policy), copy.deepcopy(critic)
    args = trl_args(PPOConfig, work, per_device_train_batch_size=n, num_mini_batches=1, num_ppo_epochs=1,
                    gradient_accumulation_steps=1, total_episodes=n, response_length=C, stop_token="eos",
                    temperature=temperature, kl_estimator="k1", whiten_rewards=False, missing_eos_penalty=None,
                    num_sample_generations=0, local_rollout_forward_batch_size=n, lr_scheduler_type="constant",
                    kl_coef=cfg["kl_coef"], gamma=cfg["gamma"], lam=cfg["lam"], cliprange=cfg["cliprange"],
                    cliprange_value=cfg["cliprange_value"], vf_coef=cfg["vf_coef"])
    optimizer = RecordingOptimizer(list(theirs_policy.parameters()) + list(theirs_critic.parameters()))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1, dtype=torch.float32)
    trainer = PPOTrainer(args=args, processing_class=trl_tokenizer, model=theirs_policy,
                         ref_model=copy.deepcopy(model), reward_model=reward_model,
                         train_dataset=datasets.Dataset.from_list([{"input_ids": p} for p in prompts[:n]]),
                         value_model=theirs_critic, optimizers=(optimizer, scheduler))
    backward = trainer.accelerator.backward

    def recording_backward(loss, **kwargs):
        seen["loss"] = float(loss.detach())
        return backward(loss, **kwargs)

    def recording_log(logs, *_args, **_kwargs):  # called by train() with its tensors still alive
        seen["frame"] = dict(_sys._getframe(1).f_locals)
        seen["metrics"] = dict(logs)

    trainer.accelerator.backward, trainer.log = recording_backward, recording_log
    patched = {"batch_generation": fixed_generation, "forward": moving_forward}
    saved = {k: getattr(trl_ppo, k) for k in patched}
    try:
        for k, v in patched.items():
            setattr(trl_ppo, k, v)
        trainer.train()
    finally:
        for k, v in saved.items():
            setattr(trl_ppo, k, v)

    # TRL's rows come in its dataloader's order: put them in alignflow's.
    frame = seen["frame"]
    order = [prompts.index([t for t in q if t != tokenizer.pad_token_id]) for q in seen["queries"].tolist()]
    back = torch.tensor(order).argsort()
    same_ids = bool(torch.equal(frame["query_responses"][back], batch.input_ids))
    differing = int(((~frame["padding_mask"][back]) != mask.bool()).sum())
    real = mask.bool()

    # TRL's update forward again (its mini-batch ran the same rows, shuffled, on the same weights: the recording
    # optimizer changed none), for its per-token log-probs and for the objective recomputed from its tensors.
    out, vpred = trl_forward(trainer.model, frame["query_responses"], tokenizer.pad_token_id)
    new_logps = torch.log_softmax(out.logits[:, P - 1:-1] / (temperature + 1e-7), -1)
    new_logps = new_logps.gather(-1, frame["responses"][..., None]).squeeze(-1)  # [N, C]
    vpred = vpred[:, P - 1:-1].squeeze(-1)  # [N, C]
    recomputed = {at_eos: trl_ppo_objective(frame, new_logps, vpred, cfg, trl_ppo, at_eos) for at_eos in (False, True)}
    recomputed[True]["loss"].backward()  # TRL's zero_grad left no gradients
    with_our_definition = {"grad_norm": grad_norm(trainer.model)}

    logprob_diffs = {name: float((a[real] - b[back][real]).abs().max()) for name, a, b in (
        ("rollout", old_logps, frame["logprobs"]), ("reference", ref, frame["ref_logprobs"]),
        ("policy", logps.detach(), new_logps.detach()))}
    trl_metrics = {k: [v] for k, v in seen["metrics"].items()}
    result = row("ppo", f"k1 KL penalty, GAE, clipped value loss, T {temperature:g}, scored by each side",
                 (same_ids, differing), max(logprob_diffs.values()), (float(loss_ours.detach()), seen["loss"]),
                 (grad_norm(ours), seen["grad_norm"]), shared_metrics(our_metrics, trl_metrics),
                 (batch.input_ids.shape, frame["query_responses"].shape))
    result["trl_version"] = trl.__version__
    result["logprob_max_abs_diff_by_kind"] = logprob_diffs
    compared = {"scores": (scores, frame["scores"][back], None), "values": (old_values, frame["values"][back], real),
                "advantages": (advantages, frame["advantages"][back], real),
                "returns": (returns, frame["returns"][back], real)}
    for name, (a, b, where) in compared.items():
        result[f"{name}_max_abs_diff"] = float(((a - b).abs() if where is None else (a - b).abs()[where]).max())

    # TRL's objective recomputed from its own tensors, once as TRL defines it (which must give train()'s loss) and
    # once with alignflow's definition (score on the eos token, values and value loss up to it, approxkl over
    # completion tokens), compared with alignflow's.
    mine = recomputed[True]
    with_our_definition.update({
        "trl_definition_loss_rel_diff_from_train": rel_diff(float(recomputed[False]["loss"]), seen["loss"]),
        "loss": float(mine["loss"]), "loss_rel_diff": rel_diff(float(loss_ours.detach()), float(mine["loss"])),
        "loss_abs_diff": abs(float(loss_ours.detach()) - float(mine["loss"])),
        "grad_norm_rel_diff": rel_diff(grad_norm(ours), with_our_definition["grad_norm"]),
        "advantages_max_abs_diff": float((advantages - mine["advantages"][back]).abs()[real].max()),
        "returns_max_abs_diff": float((returns - mine["returns"][back]).abs()[real].max()),
        "metrics": shared_metrics(our_metrics, {k: [float(v)] for k, v in mine["metrics"].items()})})
    result["trl_with_alignflow_definition"] = with_our_definition
    name, worst = max(with_our_definition["metrics"].items(), key=lambda kv: kv[1]["rel_diff"])
    result["note"] = (
        "TRL adds the score one position after eos and fits values there, and averages approxkl over padding too; "
        "TRL's tensors recomputed with alignflow's definition: loss "
        f"{with_our_definition['loss_rel_diff']:.1e}, grad norm {with_our_definition['grad_norm_rel_diff']:.1e}, "
        f"advantages {with_our_definition['advantages_max_abs_diff']:.1e}, returns "
        f"{with_our_definition['returns_max_abs_diff']:.1e} (abs), worst metric {name} {worst['rel_diff']:.1e} "
        f"(abs {abs(worst['alignflow'] - worst['trl']):.1e}); TRL's own definition recomputed gives train()'s loss "
        f"to {with_our_definition['trl_definition_loss_rel_diff_from_train']:.1e}")
    return result


def trl_ppo_objective(frame: dict[str, Any], new_logps, vpred, cfg: dict[str, float], trl_ppo,
                      at_eos: bool) -> dict[str, Any]:
    """TRL PPOTrainer's rewards, GAE, whitening and loss, recomputed from the tensors of its `train()` (`frame`) and
    its update forward (`new_logps`, `vpred` [N, C], with gradients), with TRL's own `masked_mean`/`masked_whiten`.
    `at_eos` False: TRL 1.12's definition: the score one position after the eos token (the first pad; TRL issues
    #1893, #3750), values and the value loss one position past the eos, approxkl averaged over every position.
    True: alignflow's: the score on the eos token (the last action), values and value loss up to it, approxkl over
    completion tokens. Returns the total loss, TRL-named metrics, and the advantages and returns [N, C]."""
    import torch

    pad = frame["padding_mask"]  # [N, C] True after the eos token
    lengths = frame["sequence_lengths"]  # [N] column of the eos token
    width = pad.shape[1]
    if at_eos:
        value_pad, end = pad, lengths
    else:
        value_pad = frame["padding_mask_p1"]
        end = torch.where(lengths + 1 < width, lengths + 1, lengths)
    values = frame["values"].masked_fill(value_pad, 0)
    rewards = -cfg["kl_coef"] * frame["kl"]
    rewards[torch.arange(len(end)), end] += frame["scores"]
    advantages, last = torch.zeros_like(rewards), 0.0
    for t in reversed(range(width)):  # GAE (Schulman et al. 2016, Eq. 16), V after the last column 0
        following = values[:, t + 1] if t + 1 < width else 0.0
        last = rewards[:, t] + cfg["gamma"] * following - values[:, t] + cfg["gamma"] * cfg["lam"] * last
        advantages[:, t] = last
    returns = advantages + values
    advantages = trl_ppo.masked_whiten(advantages, ~pad).masked_fill(pad, 0)

    new_logps = new_logps.masked_fill(pad, 1.0)  # TRL's INVALID_LOGPROB, as `logprobs` holds it
    vpred = vpred.masked_fill(value_pad, 0)
    clipped = torch.clamp(vpred, values - cfg["cliprange_value"], values + cfg["cliprange_value"])
    vf_plain, vf_clipped = (vpred - returns) ** 2, (clipped - returns) ** 2
    vf_loss = 0.5 * trl_ppo.masked_mean(torch.max(vf_plain, vf_clipped), ~value_pad)
    log_ratio = new_logps - frame["logprobs"]
    ratio = torch.exp(log_ratio)
    pg_plain = -advantages * ratio
    pg_clipped = -advantages * torch.clamp(ratio, 1 - cfg["cliprange"], 1 + cfg["cliprange"])
    pg_loss = trl_ppo.masked_mean(torch.max(pg_plain, pg_clipped), ~pad)
    with torch.no_grad():
        approxkl = 0.5 * (trl_ppo.masked_mean(log_ratio ** 2, ~pad) if at_eos else (log_ratio ** 2).mean())
        metrics = {"loss/policy_avg": pg_loss, "loss/value_avg": vf_loss, "policy/approxkl_avg": approxkl,
                   "policy/clipfrac_avg": trl_ppo.masked_mean((pg_clipped > pg_plain).float(), ~pad),
                   "val/clipfrac_avg": trl_ppo.masked_mean((vf_clipped > vf_plain).float(), ~value_pad)}
    return {"loss": pg_loss + cfg["vf_coef"] * vf_loss, "metrics": metrics, "advantages": advantages.detach(),
            "returns": returns.detach()}
