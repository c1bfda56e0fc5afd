"""Proximal policy optimisation (PPO) with a value head, GAE and KL control: classic RLHF.

One PPO step:

    generate  one completion for each of `batch_size` prompts (rollout engine: hf | vllm | vllm-server)
    score     reward functions or a reward model -> [N]; minus `missing_eos_penalty` where truncated
    values    the policy's log-probs and its value head's V_t, and the reference's log-probs (no grad)
    reward    r_t = −β·(log π − log π_ref)_t, plus the score at the last completion token
    advantage GAE(γ, λ) on r_t against V_t; advantages whitened over the batch
    update    `ppo_epochs` passes over the batch in shuffled mini-batches of `mini_batch_size`, one
              optimizer step each: clipped policy loss + `vf_coef` × clipped value loss
    control   β follows the adaptive KL controller (`adap_kl_ctrl`) or stays fixed
    sync      push the new weights to the rollout engine

Formulas live in `trainer/algorithms/` (advantages.py, policy.py) (Schulman et al. 2017 for the clipped objective, Schulman et
al. 2016 for GAE, Ziegler et al. 2019 for the per-token KL reward and the adaptive controller);
rollouts, prompts, reward functions and weight sync are GRPO's (`trainer/stages/rl/grpo.py`). The value head
is a scalar linear map on the policy's last hidden state at the positions that predict completion
tokens (TRL's `AutoModelForCausalLMWithValueHead`): V_t is the value of the state before token t.
It is zero-initialised, so that the first advantages are the rewards-to-go. With `critic:
reward_model` a separate critic network gives V_t instead: a reward model (sequence classifier)
whose score head reads every token's hidden state (TRL PPOv2's `value_model`, OpenRLHF's critic),
trained by the same optimizer and saved as `critic/`. The reference is the starting policy: a
frozen copy, or with LoRA the model with its adapter disabled. Policy and reference log-probs are
those of softmax(logits / T) at the sampling `temperature` T (TRL's PPOTrainer divides both by
T + 1e-7; the critic's values are not tempered); greedy rollouts (T = 0) are scored under the plain
softmax (`trainer.algorithms.logprobs.logit_temperature`).

Departures from TRL's `PPOTrainer`: the score is the reward of the last completion token (TRL adds it
on the first pad after eos and fits a value there; docs/trl.md, "PPO: where the score goes"), and
`ppo/policy/approxkl` averages over completion tokens (TRL's over padding too); `max_steps` counts
optimizer steps (each PPO step takes `ppo_epochs × batch_size / mini_batch_size` of them); a
completion that ends without EOS keeps its tokens (the penalty lowers its score); with several ranks, advantages (and rewards) are whitened
over all ranks' tokens (TRL whitens each process's own), and the KL controller sees the mean KL of
all ranks. With `mini_batch_size == batch_size`, N ranks therefore compute what one process does on
the same global batch; smaller mini-batches are shuffled within each rank.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.algorithms.advantages import (
    AdaptiveKLController,
    FixedKLController,
    combine_rewards,
    gae_advantages,
    kl_penalty_rewards,
)
from trainer.algorithms.logprobs import (
    TargetLM,
    logit_temperature,
    selective_log_softmax,
    target_logits,
    to_padded,
)
from trainer.algorithms.masked import masked_moments, masked_whiten
from trainer.algorithms.policy import ppo_policy_loss, value_loss, value_stats
from trainer.config.rl_config import PPOConfig
from trainer.data.sources import describe_datasets
from trainer.engine import checkpoint as ckpt
from trainer.engine import distributed
from trainer.engine.completions import RolloutBatch, batched_logps, build_batch, sample_rows
from trainer.engine.loop import MetricWindow, keep_freed_memory
from trainer.engine.models import (
    apply_lora,
    count_parameters,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    model_and_tokenizer,
    resolve_model_path,
)
from trainer.engine.runner import StageRunner
from trainer.errors import ConfigError, ModelError
from trainer.rewards.scorer import RewardModelScorer, classifier_labels, label_index
from trainer.stages.rl.shared import (
    PromptSet,
    RewardSet,
    evaluate,
    load_rl_inputs,
    push_weights,
    start_engine,
)

log = logging.getLogger(__name__)

VALUE_HEAD = "value_head"  # saved as value_head.safetensors in every checkpoint
CRITIC = "critic"  # critic=reward_model: saved as a model folder critic/ in every checkpoint


# ----------------------------------------------------------------------------------------------
# The policy with its value head


class PolicyWithValue(torch.nn.Module):
    """The causal LM and its value function as one module (what `accelerate.prepare` wraps, so that DDP and
    DeepSpeed see both): the forward returns the logits at the target positions and V at the same
    positions, [n_targets]. `value` is a linear value head on the policy's hidden states, or a separate
    critic (a sequence-classification model, `critic=reward_model`) run over the same tokens."""

    def __init__(self, lm: torch.nn.Module, value: torch.nn.Module) -> None:
        super().__init__()
        self.lm, self.value = lm, value
        self.config = lm.config  # accelerate sizes DeepSpeed's "auto" buckets from it

    def forward(self, input_ids, target_mask, attention_mask, position_ids):
        if isinstance(self.value, torch.nn.Linear):
            out = target_logits(self.lm, input_ids, target_mask, attention_mask, position_ids, with_hidden=True)
            return out, self.value(out.hidden.to(self.value.weight.dtype)).squeeze(-1)
        out = target_logits(self.lm, input_ids, target_mask, attention_mask, position_ids)
        return out, critic_values(self.value, input_ids, attention_mask, position_ids, out.rows, out.cols - 1)


def critic_values(critic, input_ids, attention_mask, position_ids, rows, cols) -> torch.Tensor:
    """V of a critic network (a sequence classifier with one label) at the token positions (rows, cols), [n]:
    its score head applied to each of those positions' last hidden states (TRL PPOv2 and OpenRLHF read a
    reward model's head per token the same way), rather than only at the last token."""
    backbone = getattr(critic, critic.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state[rows, cols]  # [n, H]
    return critic.score(hidden.to(critic.score.weight.dtype)).squeeze(-1)


def make_value_head(model, dtype: torch.dtype) -> torch.nn.Linear:
    head = torch.nn.Linear(model.config.hidden_size, 1, dtype=dtype)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return head


def policy_forward(model, batch: RolloutBatch, rows, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs under softmax(logits / temperature) of the completion tokens and the values before each,
    both [n, C] (0 off the completion). The values are not tempered."""
    input_ids, attention = batch.input_ids[rows], batch.attention_mask[rows]
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)  # left padding
    out, values = model(input_ids=input_ids, target_mask=batch.completion_mask[rows], attention_mask=attention,
                        position_ids=position_ids)
    logps = to_padded(selective_log_softmax(out.logits, out.targets, temperature), out.rows, out.cols, input_ids.shape)
    values = to_padded(values.float(), out.rows, out.cols, input_ids.shape)
    P = batch.prompt_width
    return logps[:, P:], values[:, P:]


# ----------------------------------------------------------------------------------------------
# One PPO step: rollout, then update


@dataclass
class PPOTrajectory:
    """One PPO step's rollouts on this rank; per-token tensors cover the completion columns only."""

    batch: RolloutBatch  # [N, P+C] on the training device
    prompts: list  # [N]
    texts: list[str]  # [N]
    per_func: torch.Tensor  # [N, F] rewards of each function (NaN = unscored)
    scores: torch.Tensor  # [N] weighted score, minus the missing-EOS penalty
    mask: torch.Tensor  # [N, C] completion tokens
    logps: torch.Tensor  # [N, C] policy log-probs at rollout time
    values: torch.Tensor  # [N, C] V_t at rollout time
    advantages: torch.Tensor  # [N, C] GAE, whitened
    returns: torch.Tensor  # [N, C] GAE + V
    stats: dict[str, float]
    timings: dict[str, float]


@torch.no_grad()
def rollout(run: StageRunner, engine, data: PromptSet, rewards: RewardSet, tokenizer, sampling, cycle: int,
            ref_model, kl_coef: float) -> PPOTrajectory:
    """Generate and score this rank's prompts of PPO step `cycle`; values, KL reward and advantages."""
    config, timings, t = run.config, {}, time.perf_counter()
    picked = distributed.rank_prompts(len(data.token_ids), config.batch_size, run.rank, run.world, config.seed, cycle)
    completions = engine.generate([data.token_ids[i] for i in picked],
                                  dataclasses.replace(sampling, seed=config.seed + cycle, prompt_keys=picked))
    batch = build_batch([data.token_ids[i] for i in picked], completions, tokenizer.pad_token_id).to(run.device)
    run.report.add_cycle(cycle, picked, [len(group) for group in completions])
    timings["timing/generate"], t = time.perf_counter() - t, time.perf_counter()

    prompts, texts, per_func = rewards.score(data, picked, completions, tokenizer)  # per_func [N, F]
    scores = combine_rewards(per_func, rewards.weights).nan_to_num(0.0).to(run.device)  # [N]; unscorable -> 0
    if config.missing_eos_penalty is not None:
        scores = scores - config.missing_eos_penalty * batch.truncated.float()
    timings["timing/score"], t = time.perf_counter() - t, time.perf_counter()

    size, P, T = config.per_device_batch_size, batch.prompt_width, logit_temperature(config.temperature)
    with run.accelerator.autocast():
        parts = [policy_forward(run.model, batch, slice(i, i + size), T) for i in range(0, len(picked), size)]
        if ref_model is not None:
            ref = batched_logps(ref_model, batch, size, temperature=T)[:, P:]
        else:
            with run.module.disable_adapter():  # LoRA: the base model is the reference
                ref = batched_logps(run.module, batch, size, temperature=T)[:, P:]
    logps, values = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])  # [N, C]
    mask = batch.completion_mask[:, P:]
    timings["timing/reference"], t = time.perf_counter() - t, time.perf_counter()

    token_rewards, stats = kl_penalty_rewards(scores, logps, ref, mask, kl_coef)  # [N, C]
    if config.whiten_rewards:
        token_rewards = whiten(run, token_rewards, mask, shift_mean=False)
    advantages, returns = gae_advantages(token_rewards, values, mask, config.gamma, config.lam)
    advantages = whiten(run, advantages, mask)
    stats = {k: float(v) for k, v in {**stats, **value_stats(values, returns, mask)}.items()}
    stats["objective/kl_coef"] = kl_coef
    timings["timing/advantages"] = time.perf_counter() - t
    return PPOTrajectory(batch, prompts, texts, per_func, scores, mask, logps, values, advantages, returns, stats,
                         timings)


def whiten(run: StageRunner, x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """`masked_whiten` with the mean and variance of the whole PPO batch, all ranks' tokens."""
    total = run.sum_over_ranks(dict(zip(("n", "sum", "squares"), masked_moments(x, mask).tolist())))
    return masked_whiten(x, mask, shift_mean, moments=torch.tensor(list(total.values()), dtype=torch.float64))


def update(run: StageRunner, traj: PPOTrajectory, cycle: int) -> dict[str, float]:
    """`ppo_epochs` passes over the rollouts in shuffled mini-batches, one optimizer step each."""
    config, size = run.config, run.config.per_device_batch_size
    micro = config.mini_batch_size // size
    window = MetricWindow()
    order = torch.Generator().manual_seed(config.seed * 1_000_003 + cycle)  # same shuffles on resume
    n = len(traj.scores)
    for _ in range(config.ppo_epochs):
        # One mini-batch per epoch: no shuffle, so that micro-batches (and their token means) are the
        # same rows on one process as on N ranks of the same global batch.
        perm = (torch.randperm(n, generator=order) if n > config.mini_batch_size else torch.arange(n)).to(run.device)
        for start in range(0, len(perm), config.mini_batch_size):
            step_stats, step_loss = MetricWindow(), 0.0
            for i in range(micro):
                rows = perm[start + i * size:start + (i + 1) * size]
                with run.micro_batch(last=i == micro - 1):
                    logps, values = policy_forward(run.model, traj.batch, rows, logit_temperature(config.temperature))
                    mask = traj.mask[rows]
                    pg_loss, pg_stats = ppo_policy_loss(logps, traj.logps[rows], traj.advantages[rows], mask,
                                                        config.cliprange)
                    vf_loss, vf_stats = value_loss(values, traj.values[rows], traj.returns[rows], mask,
                                                   config.cliprange_value)
                    loss = (pg_loss + config.vf_coef * vf_loss) / micro
                    run.backward(loss)
                step_loss += float(loss.detach())
                step_stats.add({k: float(v) for k, v in {**pg_stats, **vf_stats}.items()})
            grad_norm = run.optimizer_step()
            run.state.global_step += 1
            window.add({**step_stats.pop(), "loss": step_loss, "grad_norm": grad_norm})
    return window.pop()


def rollout_metrics(traj: PPOTrajectory, rewards: RewardSet) -> dict[str, float]:
    """This rank's reward and completion statistics (averaged over ranks when logged); `reward` is
    GRPO's name for the mean weighted score before any missing-EOS penalty."""
    lengths = traj.batch.completion_lengths.float()
    return {
        **traj.stats,
        "reward": float(torch.nanmean(combine_rewards(traj.per_func, rewards.weights))),
        **{f"rewards/{n}/mean": float(torch.nanmean(traj.per_func[:, j])) for j, n in enumerate(rewards.names)},
        "completions/mean_length": float(lengths.mean()),
        "completions/clipped_ratio": float(traj.batch.truncated.float().mean()),
    }


def log_completions(run: StageRunner, traj: PPOTrajectory, names: list[str], step: int) -> None:
    # PPO's advantages are per token: the table shows each completion's mean over its tokens.
    mean_advantage = (traj.advantages * traj.mask).sum(-1) / traj.mask.sum(-1).clamp(min=1)  # [N]
    rows = sample_rows(step, traj.prompts, traj.texts, names, traj.per_func, traj.scores, mean_advantage,
                       reward_column="score", limit=run.config.num_completions_to_log)
    run.log_completions(rows, f"completions/step_{step:06d}.json")


# ----------------------------------------------------------------------------------------------
# The stage


def load_models(run: StageRunner, config: PPOConfig, model_path: str, tokenizer, rewards: RewardSet):
    """The policy (from the checkpoint when resuming), its value function (a value head or a critic
    network, restored exactly) and the reference (None with LoRA, whose reference is the
    adapter-disabled policy)."""
    resume = run.resume
    model = load_causal_lm(resume or model_path, config.dtype, config.trust_remote_code,
                           config.gradient_checkpointing, trainable_adapter=bool(resume and config.lora_r))
    if config.lora_r and not resume:
        model = apply_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules)
    if config.critic == "reward_model":
        value = load_critic(config, tokenizer, critic_source(config, rewards), resume)
    else:
        value = make_value_head(model, next(model.parameters()).dtype)
        if resume:
            ckpt.load_head(resume, VALUE_HEAD, value)
    ref_model = None
    if not config.lora_r:
        ref_model = load_causal_lm(model_path, config.dtype, config.trust_remote_code).eval().requires_grad_(False)
    model.train()
    trainable, total = count_parameters(model)
    log.info("Model %s: %.2fM parameters, %.2fM trainable, plus %s.", config.model, total / 1e6, trainable / 1e6,
             "a value head" if config.critic == "value_head" else
             f"a critic of {count_parameters(value)[1] / 1e6:.2f}M parameters")
    return model, value, ref_model


def critic_source(config: PPOConfig, rewards: RewardSet) -> str:
    """Where the critic starts: `critic_model`, else the one reward model among `reward_funcs`."""
    if config.critic_model:
        return config.critic_model
    models = [f.path for f in rewards.funcs if isinstance(f, RewardModelScorer)]
    if len(models) != 1:
        raise ConfigError(f"critic=reward_model starts the critic from a reward model, but `reward_funcs` has "
                          f"{len(models)} ({models}); set `critic_model` to the checkpoint to start from.")
    return models[0]


def load_critic(config: PPOConfig, tokenizer, source: str, resume: str | None) -> torch.nn.Module:
    """The critic network: the reward model at `source` (on resume, the checkpoint's `critic/` folder).

    Its score head becomes the per-token value head as it is (not a fresh head): V starts as the reward
    model's score of each prefix, the initialisation of TRL PPOv2 and OpenRLHF. A classifier with several
    labels keeps the row of `reward_label`. The critic reads the policy's token ids, so it must share the
    policy's tokenizer, and be a causal LM (an encoder's value of token t would see the tokens after t).
    """
    path = str(Path(resume, CRITIC)) if resume else resolve_model_path(source)
    if resume and not Path(path).is_dir():
        raise ModelError(f"{resume!r} has no {CRITIC}/ folder: it was not written with critic=reward_model; resume "
                         "with the critic it was trained with.")
    labels = [] if resume else classifier_labels(path, config.trust_remote_code)
    index = label_index(source, labels, config.reward_label)
    if not resume and load_tokenizer(path, config.trust_remote_code).get_vocab() != tokenizer.get_vocab():
        raise ModelError(f"Critic {source!r} has another tokenizer than the policy {config.model!r}; the critic "
                         "reads the policy's tokens: use a reward model trained from the policy's family, or "
                         "critic=value_head.")
    critic = load_reward_model(path, tokenizer.pad_token_id, config.dtype, config.trust_remote_code,
                               config.gradient_checkpointing, num_labels=max(1, len(labels)))
    score = getattr(critic, "score", None)
    if not isinstance(score, torch.nn.Linear) or not hasattr(critic, critic.base_model_prefix):
        raise ModelError(f"Critic {source!r} is a {type(critic).__name__}, not a causal-LM sequence classifier with "
                         "a `score` head; use a decoder reward model (e.g. from `alignflow train reward` on the "
                         "policy's base model) or critic=value_head.")
    if labels:  # keep the chosen label's row: a one-label critic
        head = torch.nn.Linear(score.in_features, 1, bias=score.bias is not None, dtype=score.weight.dtype)
        with torch.no_grad():
            head.weight.copy_(score.weight[index:index + 1])
            if score.bias is not None:
                head.bias.copy_(score.bias[index:index + 1])
        critic.score = head
        critic.config.num_labels = 1
    return critic.train()


def run_ppo(config: PPOConfig) -> str:
    """Train with PPO; returns `config.output_dir` (holding the final model and its value head or critic/)."""
    run = StageRunner("ppo", config)
    keep_freed_memory()

    model_path, tokenizer = model_and_tokenizer(config)
    data, eval_data, rewards = load_rl_inputs(run, tokenizer)
    per = config.updates_per_rollout
    cycles = (config.max_steps // per if config.max_steps > 0 else
              int(config.num_epochs * len(data.token_ids) / (config.batch_size * run.world)))
    steps = max(1, cycles) * per
    log.info("PPO: %d prompts, %d per step on each of %d ranks, %d optimizer steps (%d per PPO step), %s rollouts, "
             "rewards %s.", len(data.token_ids), config.batch_size, run.world, steps, per, config.rollout_engine,
             rewards.names)

    run.resume_checkpoint(model_path, data.rows)
    model, head, ref_model = load_models(run, config, model_path, tokenizer, rewards)
    with run.failing():
        run.prepare(model, tokenizer, steps, describe_datasets(config, data.rows, eval_data.rows if eval_data else None, {}),
                    wrap=lambda lm: PolicyWithValue(lm, head),
                    heads={VALUE_HEAD if config.critic == "value_head" else CRITIC: head})
        if ref_model is not None:
            ref_model = distributed.prepare_reference(run.accelerator, TargetLM(ref_model))
        kl_ctl = (AdaptiveKLController(config.init_kl_coef, config.target_kl, config.horizon) if config.adap_kl_ctrl
                  else FixedKLController(config.init_kl_coef))
        kl_ctl.value = run.state.extra.get("kl_coef", kl_ctl.value)
        engine, sampling = start_engine(run, model, tokenizer, run.resume or model_path, 1)
        evaluate_now = (lambda: evaluate(run, engine, eval_data, rewards, tokenizer, sampling)) if eval_data else None
        try:
            while run.state.global_step < steps:
                cycle, started = run.state.global_step // per, time.perf_counter()
                traj = rollout(run, engine, data, rewards, tokenizer, sampling, cycle, ref_model, kl_ctl.value)
                engine.sleep()  # vllm_enable_sleep_mode: vLLM's GPU memory to the update
                t = time.perf_counter()
                update_stats = update(run, traj, cycle)
                traj.timings["timing/update"], t = time.perf_counter() - t, time.perf_counter()
                kl = run.sum_over_ranks({"kl": traj.stats["objective/kl"]})["kl"] / run.world
                kl_ctl.update(kl, config.batch_size * run.world)
                run.state.extra["kl_coef"] = kl_ctl.value
                push_weights(run, engine)
                traj.timings["timing/sync"] = time.perf_counter() - t
                run.state.num_tokens += int(run.sum_over_ranks({"n": float(traj.batch.attention_mask.sum())})["n"])
                step = run.state.global_step
                metrics = {**update_stats, **rollout_metrics(traj, rewards), **traj.timings,
                           "step_time": time.perf_counter() - started}
                run.log_step(step, metrics, span=per, rank_means=True, evaluate=evaluate_now)
                if config.log_completions_steps and (cycle % config.log_completions_steps == 0 or step >= steps):
                    log_completions(run, traj, rewards.names, step)
                run.maybe_save(step, span=per)

            run.final_evaluation(evaluate_now)
            with run.gathered():
                run.report.write(torch.nn.ModuleList([model, head]))  # ranks compare policy and value function
            return run.finish()
        finally:
            engine.close()
