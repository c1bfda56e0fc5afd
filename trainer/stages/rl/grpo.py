"""Group relative policy optimisation (GRPO), as TRL's GRPOTrainer defines it.

One generation cycle:

    generate  G completions for each of B prompts (rollout engine: hf | vllm | vllm-server)
    score     every reward function -> [B*G, F]; weighted sum -> [B*G]
    advantage normalise within each group of G (`scale_rewards`); zero-variance groups give 0;
              or RLOO's leave-one-out baseline (`advantage_estimator: rloo`)
    reference trainer log-probs before the update (num_iterations > 1), reference model (beta > 0)
    update    `num_iterations` optimizer steps over the cycle's completions, each accumulating
              micro-batches of `per_device_batch_size` completions; clipped per-token ratio,
              optional k3 KL, aggregation by `loss_type`
    sync      push the new weights to the rollout engine

Formulas live in `trainer/algorithms/` (advantages.py, policy.py) (Shao et al. 2024 for GRPO, Yu et al. 2025 for DAPO's
token-level loss and epsilon_high, Liu et al. 2025 for Dr. GRPO). Departures from TRL: the
LM head runs only at completion positions; each group's prompt goes through the model once
per micro-batch, not once per completion (`share_prompt`, `trainer.engine.attention.share_prompts`);
and the rollout engine's log-probs feed a truncated importance-sampling correction for the
engine/trainer mismatch (Yao et al. 2025) by default.

As in TRL, `per_device_batch_size` counts completions, and a cycle generates
`per_device_batch_size * gradient_accumulation_steps` completions (that many / G prompts).

Several processes (`accelerate launch`, docs/scaling.md): each rank draws its own, disjoint slice
of the cycle's prompts, so the G completions of a prompt are generated and scored on one rank
and every group stays whole. Rewards are gathered so that advantages and their statistics are
those of the whole cycle; gradients are averaged across ranks by DDP or DeepSpeed, and dapo's
token count is that of the whole cycle. Rank 0 logs and saves. With one process the stage
computes exactly what it did before it could run on several (trainer/engine/distributed.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from trainer.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    combine_rewards,
)
from trainer.algorithms.logprobs import TargetLM, logit_temperature
from trainer.algorithms.masked import nanstd
from trainer.algorithms.policy import policy_loss, rollout_is_weights
from trainer.config.rl_config import GRPOConfig
from trainer.data.sources import describe_datasets
from trainer.engine import distributed
from trainer.engine.attention import use_alignflow_attention
from trainer.engine.completions import (
    RolloutBatch,
    batched_logps,
    build_batch,
    sample_rows,
    token_logps,
)
from trainer.engine.loop import MetricWindow, keep_freed_memory
from trainer.engine.models import apply_lora, count_parameters, load_causal_lm, model_and_tokenizer
from trainer.engine.runner import StageRunner
from trainer.rollout import SamplingConfig
from trainer.stages.rl.shared import (
    PromptSet,
    RewardSet,
    evaluate,
    load_rl_inputs,
    push_weights,
    start_engine,
)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Prompts, rewards and one cycle's trajectory


@dataclass
class Trajectory:
    """One generation cycle on this rank: completions, rewards, advantages, and the log-probs the update needs."""

    batch: RolloutBatch  # [N, P+C] with N = prompts x G, on the training device
    prompts: list  # [N] the prompt of each completion (text or chat)
    texts: list[str]  # [N] decoded completions
    per_func: torch.Tensor  # [N, F]
    rewards: torch.Tensor  # [N] weighted sum
    advantages: torch.Tensor  # [N] normalised within groups over the whole cycle (all ranks)
    reward_stats: dict[str, torch.Tensor]  # reward, reward_std, frac_reward_zero_std of the whole cycle
    loss_mask: torch.Tensor  # [N, P+C]
    old_logps: torch.Tensor | None  # [N, P+C] before the update (num_iterations > 1)
    ref_logps: torch.Tensor | None  # [N, P+C] under the reference (beta > 0)
    timings: dict[str, float]


def rollout(run: StageRunner, engine, data: PromptSet, rewards: RewardSet, tokenizer, sampling: SamplingConfig,
            cycle: int, ref_model) -> Trajectory:
    """Generate G completions for this rank's prompts of `cycle`, score them, compute advantages over
    the whole cycle (groups whole on their rank, rewards gathered), and the old and reference log-probs."""
    config, G = run.config, run.config.num_generations
    timings, t = {}, time.perf_counter()
    picked = distributed.rank_prompts(len(data.token_ids), config.prompts_per_cycle, run.rank, run.world,
                                      config.seed, cycle)
    # Seeded by cycle and keyed by dataset index: a prompt's completions do not depend on its rank.
    call = dataclasses.replace(sampling, seed=config.seed + cycle, prompt_keys=picked)
    completions = engine.generate([data.token_ids[i] for i in picked], call)
    batch = build_batch([data.token_ids[i] for i in picked], completions, tokenizer.pad_token_id).to(run.device)
    run.report.add_cycle(cycle, picked, [len(group) for group in completions])
    timings["timing/generate"], t = time.perf_counter() - t, time.perf_counter()

    prompts, texts, per_func = rewards.score(data, picked, completions, tokenizer)  # per_func [N, F]
    combined = combine_rewards(per_func, rewards.weights)  # [N]
    everyone = run.accelerator.gather(combined.to(run.device)).cpu()  # [world*N], rank order
    advantages, stats = ADVANTAGE_ESTIMATORS[config.advantage_estimator](everyone, G, config.scale_rewards)
    mine = advantages[run.rank * len(combined):(run.rank + 1) * len(combined)].to(run.device)  # [N]
    timings["timing/score"], t = time.perf_counter() - t, time.perf_counter()

    loss_mask = batch.completion_mask.clone()
    if config.mask_truncated_completions:
        loss_mask[batch.truncated] = 0
    size, shared, T = config.per_device_batch_size, _shared_group(config), logit_temperature(config.temperature)
    with run.accelerator.autocast():  # old and reference log-probs at the sampling temperature, as in TRL
        old = batched_logps(run.model, batch, size, shared, T) if config.num_iterations > 1 else None
        ref = None
        if config.beta > 0 and ref_model is not None:
            ref = batched_logps(ref_model, batch, size, shared, T)
        elif config.beta > 0:
            with run.module.disable_adapter():  # LoRA: the base model is the reference
                ref = batched_logps(run.model, batch, size, shared, T)
    timings["timing/reference"] = time.perf_counter() - t
    return Trajectory(batch, prompts, texts, per_func, combined, mine, stats, loss_mask, old, ref, timings)


def _shared_group(config: GRPOConfig) -> int:
    """G when micro-batches hold whole groups whose prompt can run once (`share_prompt`), else 0."""
    G = config.num_generations
    return G if config.share_prompt and config.per_device_batch_size % G == 0 else 0


def engine_correction(config: GRPOConfig) -> dict | None:
    """`rollout_is_weights`' options for the rollout engine's sampling mismatch, or None when the loss is not
    corrected (the hf engine samples with the trainer's own weights, or the correction is off)."""
    if not config.importance_sampling_correction or config.rollout_engine == "hf":
        return None
    return {"mode": config.importance_sampling_mode, "clip_min": config.importance_sampling_min,
            "clip_max": config.importance_sampling_cap}


def update(run: StageRunner, traj: Trajectory) -> dict[str, float]:
    """`num_iterations` optimizer steps over the trajectory's completions; returns this rank's means."""
    config, batch, size = run.config, traj.batch, run.config.per_device_batch_size
    # dapo divides by the active tokens of the whole cycle on all ranks; by world / world of them
    # here, because DDP / DeepSpeed average the ranks' gradients (TRL does the same).
    cycle_tokens = run.sum_over_ranks({"n": float(traj.loss_mask.sum())})["n"] / run.world
    starts = range(0, len(batch.input_ids), size)
    correction = engine_correction(config)
    window = MetricWindow()
    for _ in range(config.num_iterations):
        step_stats, step_loss = MetricWindow(), 0.0
        for i, start in enumerate(starts):
            rows = slice(start, start + size)
            with run.micro_batch(last=i == len(starts) - 1):
                logps, ent = token_logps(run.model, batch, rows, with_entropy=True, group_size=_shared_group(config),
                                         temperature=logit_temperature(config.temperature))
                mask, old = traj.loss_mask[rows], traj.old_logps[rows] if traj.old_logps is not None else None
                is_weights, is_stats = None, {}
                if correction is not None:
                    is_weights, is_stats = rollout_is_weights(old if old is not None else logps.detach(),
                                                              batch.rollout_logps[rows], mask, **correction)
                loss, stats = policy_loss(
                    logps, old, traj.advantages[rows], mask, loss_type=config.loss_type, epsilon=config.epsilon,
                    epsilon_high=config.epsilon_high, ref_logps=traj.ref_logps[rows] if traj.ref_logps is not None
                    else None, beta=config.beta, max_completion_length=config.max_completion_length,
                    num_items_in_batch=cycle_tokens, is_weights=is_weights,
                    use_bias_correction_kl=config.use_bias_correction_kl)
                # dapo already divides by the whole cycle's tokens; the others average micro-batches.
                contribution = loss if config.loss_type == "dapo" else loss / len(starts)
                run.backward(contribution)
            step_loss += float(contribution.detach())
            step_stats.add({**({"entropy": ent} if ent is not None else {}),
                            **{k: float(v) for k, v in {**stats, **is_stats}.items() if v.ndim == 0}})
        grad_norm = run.optimizer_step()
        run.state.global_step += 1
        window.add({**step_stats.pop(), "loss": step_loss, "grad_norm": grad_norm})
    return window.pop()


def cycle_metrics(run: StageRunner, traj: Trajectory, names: list[str]) -> dict[str, float]:
    """The cycle's reward and completion statistics over all ranks (TRL's names)."""
    gather = run.accelerator.gather
    per_func = gather(traj.per_func.to(run.device)).cpu()  # [world*N, F]
    lengths = gather(traj.batch.completion_lengths).float().cpu()  # [world*N]
    truncated = gather(traj.batch.truncated.float()).cpu()  # [world*N]
    stats = traj.reward_stats
    return {
        "reward": float(stats["reward"]), "reward_std": float(stats["reward_std"]),
        "frac_reward_zero_std": float(stats["frac_reward_zero_std"]),
        **{f"rewards/{n}/mean": float(torch.nanmean(per_func[:, j])) for j, n in enumerate(names)},
        **{f"rewards/{n}/std": float(nanstd(per_func[:, j]).nan_to_num()) for j, n in enumerate(names)},
        "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(truncated.mean()),
    }


def log_completions(run: StageRunner, traj: Trajectory, names: list[str], step: int) -> None:
    rows = sample_rows(step, traj.prompts, traj.texts, names, traj.per_func, traj.rewards, traj.advantages,
                       limit=run.config.num_completions_to_log)
    run.log_completions(rows, f"completions/step_{step:06d}.json")


# ----------------------------------------------------------------------------------------------
# The stage


def run_grpo(config: GRPOConfig) -> str:
    """Train with GRPO; returns `config.output_dir` (holding the final model).

    Under `accelerate launch` (or `alignflow train grpo --num_processes N`) every process runs it as one rank.
    """
    run = StageRunner("grpo", config)
    keep_freed_memory()

    # 1. Prompts and reward functions, validated before any model is loaded.
    model_path, tokenizer = model_and_tokenizer(config)
    data, eval_data, rewards = load_rl_inputs(run, tokenizer)
    num_cycles = (config.max_steps if config.max_steps > 0 else
                  int(config.num_epochs * len(data.token_ids) / (config.prompts_per_cycle * run.world)))
    steps = max(1, num_cycles // config.num_iterations) * config.num_iterations
    log.info("GRPO: %d prompts, %d per cycle x G=%d on each of %d ranks, %d optimizer steps, %s rollouts, "
             "rewards %s.", len(data.token_ids), config.prompts_per_cycle, config.num_generations, run.world, steps,
             config.rollout_engine, rewards.names)

    # 2. Policy and reference; optimizer and state through the runner.
    resume = run.resume_checkpoint(model_path, data.rows)
    model = load_causal_lm(resume or model_path, config.dtype, config.trust_remote_code,
                           config.gradient_checkpointing, trainable_adapter=bool(resume and config.lora_r))
    if config.lora_r and not resume:
        model = apply_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules)
    ref_model = None
    if config.beta > 0 and not config.lora_r:
        ref_model = load_causal_lm(model_path, config.dtype, config.trust_remote_code).eval().requires_grad_(False)
    if config.share_prompt:  # the policy gets the same attention in run.prepare
        use_alignflow_attention(ref_model)
    model.train()
    trainable, total = count_parameters(model)
    log.info("Model %s: %.2fM parameters, %.2fM trainable.", config.model, total / 1e6, trainable / 1e6)
    with run.failing():
        run.prepare(model, tokenizer, steps, describe_datasets(config, data.rows, eval_data.rows if eval_data else None, {}),
                    wrap=TargetLM)
        if ref_model is not None:
            ref_model = distributed.prepare_reference(run.accelerator, TargetLM(ref_model))
        engine, sampling = start_engine(run, model, tokenizer, resume or model_path, config.num_generations)
        evaluate_now = (lambda: evaluate(run, engine, eval_data, rewards, tokenizer, sampling)) if eval_data else None
        try:
            # 3. The loop: generate -> score -> advantages -> update -> sync, each phase timed.
            while run.state.global_step < steps:
                cycle, started = run.state.global_step // config.num_iterations, time.perf_counter()
                traj = rollout(run, engine, data, rewards, tokenizer, sampling, cycle, ref_model)
                engine.sleep()  # vllm_enable_sleep_mode: vLLM's GPU memory to the update
                t = time.perf_counter()
                update_stats = update(run, traj)
                traj.timings["timing/update"], t = time.perf_counter() - t, time.perf_counter()
                push_weights(run, engine)
                traj.timings["timing/sync"] = time.perf_counter() - t
                run.state.num_tokens += int(run.sum_over_ranks({"n": float(traj.batch.attention_mask.sum())})["n"])
                step = run.state.global_step
                metrics = {**update_stats, **cycle_metrics(run, traj, rewards.names), **traj.timings,
                           "step_time": time.perf_counter() - started}
                run.log_step(step, metrics, span=config.num_iterations, rank_means=True, evaluate=evaluate_now)
                if config.log_completions_steps and (cycle % config.log_completions_steps == 0 or step >= steps):
                    log_completions(run, traj, rewards.names, step)
                run.maybe_save(step, span=config.num_iterations)

            # 4. Final evaluation and the model.
            run.final_evaluation(evaluate_now)
            with run.gathered():
                run.report.write(model)
            return run.finish()
        finally:
            engine.close()


