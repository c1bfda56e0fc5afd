"""Group relative policy optimisation (GRPO), as TRL's GRPOTrainer defines it.

One generation cycle:

    generate  G completions for each of B prompts (rollout engine: hf | vllm | vllm-server)
    score     every reward function -> [B*G, F]; weighted sum -> [B*G]
    advantage normalise within each group of G (`scale_rewards`); zero-variance groups give 0
    reference trainer log-probs before the update (num_iterations > 1), reference model (beta > 0)
    update    `num_iterations` optimizer steps over the cycle's completions, each accumulating
              micro-batches of `per_device_batch_size` completions; clipped per-token ratio,
              optional k3 KL, aggregation by `loss_type`
    sync      push the new weights to the rollout engine

Formulas live in `trainer/losses.py` (Shao et al. 2024 for GRPO, Yu et al. 2025 for DAPO's
token-level loss and epsilon_high, Liu et al. 2025 for Dr. GRPO). Departures from TRL: the
LM head runs only at completion positions; each group's prompt goes through the model once
per micro-batch, not once per completion (`share_prompt`, `trainer.attention.share_prompts`);
and the rollout engine's log-probs feed a truncated importance-sampling correction for the
engine/trainer mismatch (Yao et al. 2025) by default.

As in TRL, `per_device_batch_size` counts completions, and a cycle generates
`per_device_batch_size * gradient_accumulation_steps` completions (that many / G prompts).

Several processes (`accelerate launch`, docs/scaling.md): each rank draws its own, disjoint slice
of the cycle's prompts, so the G completions of a prompt are generated and scored on one rank
and every group stays whole. Rewards are gathered so that advantages and their statistics are
those of the whole cycle; gradients are averaged across ranks by DDP or DeepSpeed, and dapo's
token count is that of the whole cycle. Rank 0 logs and saves. With one process the stage
computes exactly what it did before it could run on several (trainer/distributed.py).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Literal

import torch

from trainer import checkpoint as ckpt
from trainer import distributed
from trainer.completions import batched_logps, build_batch, prompt_token_ids, token_logps, use_block_attention
from trainer.config import ConfigError, TrainConfig, option
from trainer.data import DataError, describe_datasets, is_conversational, load_rows
from trainer.loop import MetricWindow, Progress, build_optimizer, build_scheduler, keep_freed_memory, set_seed
from trainer.losses import combine_rewards, group_advantages, nanstd, policy_loss, rollout_is_weights
from trainer.models import apply_lora, count_parameters, load_causal_lm, load_tokenizer, resolve_model_path
from trainer.rewards import load_reward_function, reward_name, score_completions
from trainer.rollout import SamplingConfig, make_engine
from trainer.storage import fetch_to_local, is_remote

log = logging.getLogger(__name__)


@dataclass
class GRPOConfig(TrainConfig):
    """Group relative policy optimisation with rule, Python or reward-model rewards."""

    learning_rate: float = option(1e-6, "Peak learning rate (AdamW); TRL's GRPO default.")
    per_device_batch_size: int = option(8, "Completions per forward/backward pass (as TRL counts it).")
    max_steps: int = option(100, "Optimizer steps to run (-1 = `num_epochs` passes over the prompts).")
    logging_steps: int = option(1, "Log metrics every this many steps.")
    reward_funcs: list[str] = option(["exact_answer"], "Reward functions: built-ins (exact_answer, answer_format, "
                                     "regex:<pattern>, length:<N>), import paths `pkg.module:fn` with TRL's "
                                     "signature, or reward-model checkpoints.")
    reward_weights: list[float] = option([], "One weight per reward function (default: all 1.0).")
    num_generations: int = option(8, "Completions per prompt (G); advantages are normalised within each group.")
    max_prompt_length: int = option(512, "Prompts longer than this many tokens keep their END (left truncation).")
    max_completion_length: int = option(256, "Most tokens generated per completion.")
    temperature: float = option(1.0, "Sampling temperature.")
    top_p: float = option(1.0, "Nucleus sampling probability mass.")
    top_k: int = option(-1, "Sample from the top k tokens only (-1 = off).")
    beta: float = option(0.0, "KL coefficient against the reference model (k3 estimator; 0 = no reference "
                              "model, TRL's default). https://arxiv.org/abs/2402.03300")
    epsilon: float = option(0.2, "Lower clipping range of the importance ratio (and upper when epsilon_high is unset).")
    epsilon_high: float | None = option(None, "Upper clipping range (DAPO's clip-higher, e.g. 0.28). "
                                              "https://arxiv.org/abs/2503.14476")
    num_iterations: int = option(1, "Optimizer steps per generation cycle (mu in the GRPO paper).")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = option(
        "dapo", "Loss aggregation: grpo (mean per sequence, then batch), bnpo (tokens of the local batch), "
                "dr_grpo (divide by batch x max_completion_length), dapo (tokens of the whole cycle; TRL's default).")
    scale_rewards: Literal["group", "batch", "none"] = option(
        "group", "Divide centred rewards by the group's std, the batch's std, or not at all (Dr. GRPO).")
    mask_truncated_completions: bool = option(False, "Exclude completions that hit max_completion_length from the loss.")
    rollout_engine: Literal["hf", "vllm", "vllm-server"] = option(
        "hf", "hf: transformers generate; vllm: vLLM in this process; vllm-server: a vLLM server child process.")
    vllm_gpu_memory_utilization: float = option(0.3, "Share of GPU memory vLLM may take (vllm engines on GPU).")
    vllm_server_devices: str | None = option(None, "CUDA_VISIBLE_DEVICES for the vllm-server child (e.g. '1').")
    importance_sampling_correction: bool = option(True, "Weight the loss by the truncated ratio of trainer to "
                                                         "rollout-engine probabilities (engine log-probs kept).")
    importance_sampling_cap: float = option(3.0, "Cap of that importance ratio (token level).")
    bf16: bool = option(False, "Mixed precision: forward and backward in bfloat16 under autocast while parameters, "
                               "gradients and optimizer states stay in `dtype` (TRL's `bf16`); vLLM rollouts then run "
                               "in bfloat16 too. `accelerate launch --mixed_precision bf16` turns it on as well.")
    share_prompt: bool = option(True, "Run each group's prompt through the model once per micro-batch instead of "
                                      "once per completion (completions see it through a block attention mask; "
                                      "same log-probs); sdpa then attends block by block. Needs sdpa or eager "
                                      "attention; off for rows > 4096 tokens.")
    log_completions_steps: int = option(10, "Log a table of sample prompts, completions and rewards every this many steps.")
    num_completions_to_log: int = option(8, "Rows in that table.")

    stage = "grpo"

    def validate(self) -> None:
        super().validate()
        total = self.per_device_batch_size * self.gradient_accumulation_steps
        if self.num_generations < 2:
            raise ConfigError(f"`num_generations` must be >= 2 to form groups, got {self.num_generations}.")
        if total % self.num_generations:
            raise ConfigError(f"per_device_batch_size x gradient_accumulation_steps = {total} must be divisible by "
                              f"num_generations = {self.num_generations}; change one of them.")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(f"`reward_weights` has {len(self.reward_weights)} entries for "
                              f"{len(self.reward_funcs)} `reward_funcs`; give one weight per function.")
        if not self.reward_funcs:
            raise ConfigError("`reward_funcs` is empty; give at least one reward function.")
        if self.num_iterations < 1:
            raise ConfigError(f"`num_iterations` must be >= 1, got {self.num_iterations}.")
        if self.max_completion_length < 1 or self.max_prompt_length < 1:
            raise ConfigError("`max_completion_length` and `max_prompt_length` must be >= 1.")

    @property
    def prompts_per_cycle(self) -> int:
        return self.per_device_batch_size * self.gradient_accumulation_steps // self.num_generations


# ----------------------------------------------------------------------------------------------
# The stage


def run_grpo(config: GRPOConfig) -> str:
    """Train with GRPO; returns `config.output_dir` (holding the final model).

    Under `accelerate launch` every process runs this function as one rank.
    """
    accelerator = distributed.make_accelerator(config.bf16)
    keep_freed_memory()
    rank, world, main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    set_seed(config.seed)
    started = time.perf_counter()

    # 1. Prompts and reward functions, validated before any model is loaded.
    model_path = resolve_model_path(config.model)
    tokenizer = load_tokenizer(model_path, config.trust_remote_code)
    rows = load_rows(config.dataset, config.dataset_split)
    if "prompt" not in rows.column_names:
        raise DataError(f"Dataset {config.dataset!r} has columns {sorted(rows.column_names)}; GRPO needs a `prompt` "
                        "column (text or chat messages) plus any columns the reward functions read.")
    funcs = [load_reward_function(spec) for spec in config.reward_funcs]
    names = [reward_name(f) for f in funcs]
    weights = torch.tensor(config.reward_weights or [1.0] * len(funcs))
    prompts_all = rows["prompt"]
    extra_columns = [c for c in rows.column_names if c != "prompt"]
    encoded = [prompt_token_ids(p, tokenizer, config.max_prompt_length) for p in prompts_all]
    prompts_per_step = config.prompts_per_cycle * world  # all ranks together
    check_ranks(config, world, len(rows), distributed.zero_stage(accelerator) >= 0)
    num_cycles = (config.max_steps if config.max_steps > 0 else
                  int(config.num_epochs * len(rows) / prompts_per_step)) // config.num_iterations
    steps = max(1, num_cycles) * config.num_iterations
    log.info("GRPO: %d prompts, %d per cycle x G=%d on each of %d ranks, %d optimizer steps, %s rollouts, "
             "rewards %s.", len(rows), config.prompts_per_cycle, config.num_generations, world, steps,
             config.rollout_engine, names)

    # 2. Policy, reference, optimizer; restored when resuming. `policy` is the model as accelerate
    #    prepared it (DDP or DeepSpeed with several ranks; the model itself with one): training
    #    forwards go through it. `model` is the plain module, for generation and saving.
    resume = ckpt.resolve_resume(config.resume_from_checkpoint, config.output_dir)
    if resume and is_remote(resume):
        resume = fetch_to_local(resume)
    model = load_causal_lm(resume or model_path, config.dtype, config.trust_remote_code,
                           config.gradient_checkpointing, trainable_adapter=bool(resume and config.lora_r))
    if config.lora_r and not resume:
        model = apply_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules)
    ref_model = None
    if config.beta > 0 and not config.lora_r:
        ref_model = load_causal_lm(model_path, config.dtype, config.trust_remote_code).eval().requires_grad_(False)
    if config.share_prompt:
        for m in (model, ref_model):
            use_block_attention(m)
    distributed.seed_rank(config.seed, rank)
    model.train()
    trainable, total = count_parameters(model)
    log.info("Model %s: %.2fM parameters, %.2fM trainable.", config.model, total / 1e6, trainable / 1e6)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, steps)
    distributed.fill_deepspeed_config(accelerator, config.per_device_batch_size, config.gradient_accumulation_steps,
                                      config.max_grad_norm)
    policy, optimizer = accelerator.prepare(model, optimizer)
    ref_model = distributed.prepare_reference(accelerator, ref_model)
    device = accelerator.device
    state = ckpt.TrainState()
    if resume:
        state = ckpt.load_training_state(resume, distributed.checkpoint_optimizer(accelerator, optimizer), scheduler)
        distributed.load_engine_state(accelerator, policy, resume)
        distributed.restore_rank_rng(accelerator, state.extra.get("rank_rng"))
    tracker = distributed.rank_tracker(accelerator, config, "grpo", state.mlflow_run_id)
    if resume:
        tracker.history[:] = ckpt.read_history(resume)
    state.mlflow_run_id = tracker.run_id
    datasets_info = describe_datasets(config, rows, None, {})

    engine = make_engine(config.rollout_engine, model=model, tokenizer=tokenizer, model_path=resume or model_path,
                         max_model_len=config.max_prompt_length + config.max_completion_length,
                         dtype="bfloat16" if accelerator.mixed_precision == "bf16" else config.dtype,
                         seed=config.seed, gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                         server_devices=config.vllm_server_devices)
    sampling = SamplingConfig(max_new_tokens=config.max_completion_length, temperature=config.temperature,
                              top_p=config.top_p, top_k=config.top_k, n=config.num_generations,
                              stop_token_ids=[tokenizer.eos_token_id])
    pad_id = tokenizer.pad_token_id
    G, size = config.num_generations, config.per_device_batch_size
    shared_group = G if config.share_prompt and size % G == 0 else 0  # micro-batches of whole groups
    window = MetricWindow()
    last_metrics: dict[str, float] = {}
    report = distributed.RankReport(accelerator)

    def manifest(metrics: dict[str, float]) -> dict:
        return ckpt.build_manifest("grpo", config, config.model, datasets_info, metrics, state.global_step)

    def push_weights() -> None:
        if config.rollout_engine == "hf":
            return  # the hf engine generates with the training model itself
        with distributed.full_params(accelerator, policy):
            if config.lora_r:
                merged = copy.deepcopy(model).merge_and_unload()
                engine.sync_weights(merged.state_dict().items())
            else:
                engine.sync_weights(model.state_dict().items())

    def save_step_checkpoint(step: int) -> None:
        # Every rank takes part (DeepSpeed shards, RNG states, ZeRO-3 gathers); rank 0 writes the rest.
        distributed.save_engine_state(accelerator, policy, ckpt.step_dir(config.output_dir, step))
        if (rank_rng := distributed.rank_rng_states(accelerator)) is not None:
            state.extra["rank_rng"] = rank_rng
        with distributed.full_params(accelerator, policy):
            if main:
                ckpt.save_step_checkpoint(config.output_dir, step, config.save_total_limit, model=model,
                                          tokenizer=tokenizer, manifest=manifest(last_metrics),
                                          history=tracker.history, state=state,
                                          optimizer=distributed.checkpoint_optimizer(accelerator, optimizer),
                                          scheduler=scheduler, merge_lora=config.lora_merge_on_save)
        accelerator.wait_for_everyone()

    progress = Progress(steps, state.global_step, "grpo", config.disable_progress_bar or not main)
    try:
        while state.global_step < steps:
            cycle = state.global_step // config.num_iterations
            timings: dict[str, float] = {}
            t0 = time.perf_counter()

            # generate: this rank's own prompts, all G completions of each (groups stay whole here)
            picked = distributed.rank_prompts(len(rows), config.prompts_per_cycle, rank, world, config.seed, cycle)
            sampling.seed = distributed.rollout_seed(config.seed + cycle, rank, world)
            completions = engine.generate([encoded[i] for i in picked], sampling)
            batch = build_batch([encoded[i] for i in picked], completions, pad_id).to(device)
            report.add_cycle(cycle, picked, [len(group) for group in completions])
            timings["timing/generate"] = time.perf_counter() - t0

            # score; advantages over the whole cycle: every rank's groups, each whole, in rank order
            t = time.perf_counter()
            texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for group in completions for c in group]
            prompts = [prompts_all[i] for i in picked for _ in range(G)]
            shaped = ([[{"role": "assistant", "content": x}] for x in texts]
                      if is_conversational(prompts[0]) else texts)
            columns = {c: [rows[i][c] for i in picked for _ in range(G)] for c in extra_columns}
            per_func = score_completions(funcs, prompts, shaped, columns)  # [N, F]
            rewards = combine_rewards(per_func, weights)  # [N]
            all_rewards = accelerator.gather(rewards.to(device)).cpu()  # [world*N]
            all_advantages, adv_stats = group_advantages(all_rewards, G, config.scale_rewards)  # [world*N]
            mine = slice(rank * len(rewards), (rank + 1) * len(rewards))
            advantages = all_advantages[mine].to(device)  # [N]
            timings["timing/score"] = time.perf_counter() - t

            # reference and old log-probs
            t = time.perf_counter()
            loss_mask = batch.completion_mask.clone()
            if config.mask_truncated_completions:
                loss_mask[batch.truncated] = 0
            with accelerator.autocast():
                old_logps = batched_logps(policy, batch, size, shared_group) if config.num_iterations > 1 else None
                ref_logps = None
                if config.beta > 0:
                    if ref_model is not None:
                        ref_logps = batched_logps(ref_model, batch, size, shared_group)
                    else:
                        with model.disable_adapter():
                            ref_logps = batched_logps(policy, batch, size, shared_group)
            timings["timing/reference"] = time.perf_counter() - t

            # update: num_iterations optimizer steps over the cycle
            t = time.perf_counter()
            # dapo divides by the active tokens of the whole cycle on all ranks; by world / world of
            # them here, because DDP / DeepSpeed average the ranks' gradients (TRL does the same).
            cycle_tokens = float(accelerator.reduce(loss_mask.sum(), "sum")) / world
            micro_batches = range(0, len(batch.input_ids), size)
            accum = len(micro_batches)
            for _ in range(config.num_iterations):
                step_stats, step_loss = MetricWindow(), 0.0
                for i, start in enumerate(micro_batches):
                    sl = slice(start, start + size)
                    with distributed.micro_batch(accelerator, policy, last=i == accum - 1):
                        with accelerator.autocast():
                            logps, ent = token_logps(policy, batch, sl, with_entropy=True, group_size=shared_group)
                        mask = loss_mask[sl]
                        behaviour = old_logps[sl] if old_logps is not None else logps.detach()
                        is_weights, is_stats = None, {}
                        if config.importance_sampling_correction and config.rollout_engine != "hf":
                            is_weights, is_stats = rollout_is_weights(behaviour, batch.rollout_logps[sl], mask,
                                                                      mode="token_truncate",
                                                                      clip_max=config.importance_sampling_cap)
                        loss, stats = policy_loss(
                            logps, old_logps[sl] if old_logps is not None else None, advantages[sl], mask,
                            loss_type=config.loss_type, epsilon=config.epsilon, epsilon_high=config.epsilon_high,
                            ref_logps=ref_logps[sl] if ref_logps is not None else None, beta=config.beta,
                            max_completion_length=config.max_completion_length, num_items_in_batch=cycle_tokens,
                            is_weights=is_weights)
                        # dapo already divides by the whole cycle's tokens; the others average micro-batches.
                        contribution = loss if config.loss_type == "dapo" else loss / accum
                        distributed.backward(accelerator, contribution)
                    step_loss += float(contribution.detach())
                    step_stats.add({**({"entropy": ent} if ent is not None else {}),
                                    **{k: float(v) for k, v in {**stats, **is_stats}.items() if v.ndim == 0}})
                grad_norm = distributed.clip_and_step(accelerator, policy, optimizer, scheduler, config.max_grad_norm)
                state.global_step += 1
                window.add({**step_stats.pop(), "loss": step_loss, "grad_norm": grad_norm})
            timings["timing/update"] = time.perf_counter() - t

            # sync
            t = time.perf_counter()
            push_weights()
            timings["timing/sync"] = time.perf_counter() - t
            state.num_tokens += int(accelerator.reduce(batch.attention_mask.sum(), "sum"))

            step = state.global_step
            all_per_func = accelerator.gather(per_func.to(device)).cpu()  # [world*N, F]
            lengths = accelerator.gather(batch.completion_lengths).float().cpu()  # [world*N]
            truncated = accelerator.gather(batch.truncated.float()).cpu()  # [world*N]
            window.add({
                "reward": float(adv_stats["reward"]), "reward_std": float(adv_stats["reward_std"]),
                "frac_reward_zero_std": float(adv_stats["frac_reward_zero_std"]),
                **{f"rewards/{n}/mean": float(torch.nanmean(all_per_func[:, j])) for j, n in enumerate(names)},
                **{f"rewards/{n}/std": float(nanstd(all_per_func[:, j]).nan_to_num()) for j, n in enumerate(names)},
                "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                "completions/max_length": float(lengths.max()),
                "completions/clipped_ratio": float(truncated.mean()),
                "step_time": time.perf_counter() - t0, **timings,
            })
            if step % config.logging_steps < config.num_iterations or step >= steps:
                logged = {**distributed.mean_over_ranks(window.pop()), "learning_rate": scheduler.get_last_lr()[0],
                          "num_tokens": float(state.num_tokens)}
                tracker.log_metrics(logged, step)
                last_metrics = logged
                progress.update(step, logged)
            else:
                progress.update(step)
            if config.log_completions_steps and (cycle % config.log_completions_steps == 0 or step >= steps):
                k = min(config.num_completions_to_log, len(texts))
                tracker.log_table({"step": [step] * k, "prompt": [str(p) for p in prompts[:k]],
                                   "completion": texts[:k], "reward": rewards[:k].tolist()},
                                  f"completions/step_{step:06d}.json")
            if config.save_steps and step % config.save_steps < config.num_iterations and step < steps:
                save_step_checkpoint(step)
        progress.close()
        last_metrics["train_runtime"] = time.perf_counter() - started
        with distributed.full_params(accelerator, policy):
            if main:
                ckpt.save_checkpoint(config.output_dir, model=model, tokenizer=tokenizer,
                                     manifest=manifest(last_metrics), history=tracker.history,
                                     merge_lora=config.lora_merge_on_save)
            report.write(model)
        accelerator.wait_for_everyone()
        tracker.log_dict(manifest(last_metrics), ckpt.MANIFEST)
        tracker.finish()
    except BaseException:
        progress.close()
        tracker.finish("FAILED")
        raise
    finally:
        engine.close()
    log.info("GRPO done in %.1fs; model saved to %s", time.perf_counter() - started, config.output_dir)
    return config.output_dir


def check_ranks(config: GRPOConfig, world: int, num_prompts: int, deepspeed: bool) -> None:
    """What several ranks need that one does not; each error says what to change."""
    if world > 1 and num_prompts < config.prompts_per_cycle * world:
        raise ConfigError(f"{world} ranks x {config.prompts_per_cycle} prompts per cycle need at least "
                          f"{config.prompts_per_cycle * world} prompts; the dataset has {num_prompts}. Lower "
                          "per_device_batch_size or gradient_accumulation_steps, or use fewer processes.")
    if world > 1 and config.rollout_engine == "vllm":
        raise ConfigError("rollout_engine=vllm runs vLLM inside the training process, which supports one process "
                          "so far; with several ranks use vllm-server (a sidecar per rank) or hf.")
    if deepspeed and config.save_steps and is_remote(config.output_dir):
        raise ConfigError("Under DeepSpeed every rank writes its optimizer shard into each step checkpoint, which "
                          "needs a local (shared) `output_dir`; use a local path or `save_steps 0`.")

