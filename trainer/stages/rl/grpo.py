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

Formulas live in `trainer/algorithms/losses.py` (Shao et al. 2024 for GRPO, Yu et al. 2025 for DAPO's
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
import socket
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trainer.algorithms.logprobs import TargetLM, logit_temperature
from trainer.algorithms.losses import (
    combine_rewards,
    group_advantages,
    nanstd,
    policy_loss,
    rloo_advantages,
    rollout_is_weights,
)
from trainer.config.options import TrainConfig, option
from trainer.data.chat_templates import check_messages, is_conversational
from trainer.data.sources import dataset_label, describe_datasets, load_rows, test_split_rows, train_rows
from trainer.engine import distributed
from trainer.engine.completions import (
    RolloutBatch,
    batched_logps,
    build_batch,
    prompt_token_ids,
    sample_rows,
    token_logps,
    use_block_attention,
)
from trainer.engine.loop import MetricWindow, keep_freed_memory
from trainer.engine.models import apply_lora, count_parameters, load_causal_lm, model_and_tokenizer
from trainer.engine.runner import StageRunner
from trainer.errors import ConfigError, DataError
from trainer.rewards.functions import load_reward_function, reward_names, score_completions
from trainer.rollout import SamplingConfig, make_engine
from trainer.rollout.server_client import on_each_node, server_url

log = logging.getLogger(__name__)


@dataclass
class GRPOConfig(TrainConfig):
    """Group relative policy optimisation with rule, Python or reward-model rewards."""

    learning_rate: float = option(1e-6, "Peak learning rate (AdamW); TRL's GRPO default.")
    per_device_batch_size: int = option(8, "Completions per forward/backward pass (as TRL counts it).",
                                        aliases=("per_device_train_batch_size",))
    max_steps: int = option(100, "Optimizer steps to run (-1 = `num_epochs` passes over the prompts).")
    logging_steps: int = option(1, "Log metrics every this many steps.")
    reward_funcs: list[str] = option(["exact_answer"], "Reward functions: built-ins (exact_answer, accuracy_reward, "
                                     "answer_format, regex:<pattern>, length:<N>, "
                                     "soft_overlong_punishment:<max>:<cache>), import paths `pkg.module:fn` with "
                                     "TRL's signature, or reward models: checkpoint folders, s3:// URIs or hub ids "
                                     "(org/name, from the local HF cache or downloaded).")
    reward_weights: list[float] = option([], "One weight per reward function (default: all 1.0).")
    reward_label: str | None = option(None, "For reward models that are classifiers with several labels (e.g. a "
                                            "sentiment model): the label whose score is the reward, a name from the "
                                            "model's config.id2label (e.g. POSITIVE). One-label reward models ignore it.")
    reward_label_score: Literal["logit", "probability"] = option(
        "logit", "What `reward_label` scores: its logit, or its softmax probability over the model's labels.")
    num_generations: int = option(8, "Completions per prompt (G); advantages are normalised within each group.")
    max_prompt_length: int = option(512, "Longest prompt in tokens (see `truncation_mode`).")
    max_completion_length: int = option(256, "Most tokens generated per completion.")
    temperature: float = option(1.0, "Sampling temperature T. The trainer's log-probs, entropy and KL are those of "
                                     "softmax(logits / T), the distribution completions are drawn from (as in TRL).")
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
    advantage_estimator: Literal["grpo", "rloo"] = option(
        "grpo", "grpo: (r − group mean) / std (`scale_rewards`); rloo: r minus the mean of the group's other "
                "G − 1 rewards (REINFORCE leave-one-out, TRL's RLOOTrainer; `scale_rewards` unused). "
                "https://arxiv.org/abs/2402.14740")
    scale_rewards: Literal["group", "batch", "none"] = option(
        "group", "Divide centred rewards by the group's std, the batch's std, or not at all (Dr. GRPO).")
    mask_truncated_completions: bool = option(False, "Exclude completions that hit max_completion_length from the loss.")
    rollout_engine: Literal["hf", "vllm", "vllm-server"] = option(
        "hf", "hf: transformers generate; vllm: vLLM in this process; vllm-server: one `alignflow rollout-server` "
              "for the whole job (a running one at vllm_server_host/port, or one the first rank starts).")
    vllm_gpu_memory_utilization: float = option(0.3, "Share of GPU memory vLLM may take (vllm engines on GPU).")
    vllm_server_devices: str | None = option(None, "CUDA_VISIBLE_DEVICES for the vllm-server the job starts itself "
                                                   "(e.g. '1').")
    vllm_server_host: str | None = option(None, "Host of a running `alignflow rollout-server` (TRL's name; port "
                                                "vllm_server_port). Unset with the port: the job starts one server, "
                                                "on its first rank.")
    vllm_server_port: int | None = option(None, "Port of that server (8000 when only the host is given).")
    vllm_server_base_url: str | None = option(None, "URL of that server, e.g. http://rollout:8000 (instead of host "
                                                    "and port).")
    vllm_server_timeout: float = option(240.0, "Seconds to wait for the rollout server to answer (TRL's default).")
    importance_sampling_correction: bool = option(True, "Weight the loss by the truncated ratio of trainer to "
                                                         "rollout-engine probabilities (engine log-probs kept).",
                                                  aliases=("vllm_importance_sampling_correction",))
    importance_sampling_cap: float = option(3.0, "Cap of that importance ratio (token level).",
                                            aliases=("vllm_importance_sampling_cap",
                                                     "vllm_importance_sampling_clip_max"))
    share_prompt: bool = option(True, "Run each group's prompt through the model once per micro-batch instead of "
                                      "once per completion (completions see it through a block attention mask; "
                                      "same log-probs); sdpa then attends block by block. Needs sdpa or eager "
                                      "attention; off for rows > 4096 tokens.")
    truncation_mode: Literal["keep_end", "keep_start", "drop"] = option(
        "keep_end", "Prompts longer than `max_prompt_length`: keep their end (left truncation, TRL's behaviour), "
                    "keep their start, or drop them. The count is logged.")
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
        if self.temperature < 0:
            raise ConfigError(f"`temperature` must be > 0, got {self.temperature}.")
        if self.temperature == 0:
            raise ConfigError("`temperature` 0 samples greedily: every completion of a prompt is the same, so every "
                              "group advantage is 0 and GRPO learns nothing. Use a temperature > 0 (TRL's default "
                              "is 1.0).")
        if self.max_completion_length < 1 or self.max_prompt_length < 1:
            raise ConfigError("`max_completion_length` and `max_prompt_length` must be >= 1.")
        check_server_options(self)
        if self.max_prompt_length + self.max_completion_length > self.max_length:
            raise ConfigError(f"max_prompt_length + max_completion_length = "
                              f"{self.max_prompt_length + self.max_completion_length} exceeds `max_length` "
                              f"({self.max_length}), the longest sequence; raise max_length or shorten one of them.")

    @property
    def prompts_per_cycle(self) -> int:
        return self.per_device_batch_size * self.gradient_accumulation_steps // self.num_generations


def check_server_options(config) -> None:
    """The rollout-server options of GRPO and PPO: only with rollout_engine vllm-server, one address at a time."""
    given = [f for f in ("vllm_server_host", "vllm_server_port", "vllm_server_base_url") if getattr(config, f)]
    if given and config.rollout_engine != "vllm-server":
        raise ConfigError(f"`{given[0]}` addresses a rollout server, but rollout_engine is {config.rollout_engine}: "
                          "set rollout_engine vllm-server (TRL: use_vllm true, vllm_mode server) or remove it.")
    if config.vllm_server_base_url and {"vllm_server_host", "vllm_server_port"} & set(given):
        raise ConfigError("Set either `vllm_server_base_url` or `vllm_server_host`/`vllm_server_port`, not both.")
    if config.vllm_server_port is not None and not 0 < config.vllm_server_port < 65536:
        raise ConfigError(f"`vllm_server_port` must be in 1..65535, got {config.vllm_server_port}.")
    if config.vllm_server_timeout <= 0:
        raise ConfigError(f"`vllm_server_timeout` must be > 0 seconds, got {config.vllm_server_timeout}.")
    if not 0 < config.vllm_gpu_memory_utilization <= 1:
        raise ConfigError("`vllm_gpu_memory_utilization` is the share of the rollout GPU's memory vLLM may take: "
                          f"give a number in (0, 1], got {config.vllm_gpu_memory_utilization}.")


# ----------------------------------------------------------------------------------------------
# Prompts, rewards and one cycle's trajectory


@dataclass
class PromptSet:
    """A prompt dataset: the rows (their other columns feed the reward functions) and token ids."""

    rows: Any  # datasets.Dataset
    token_ids: list[list[int]]  # [num_prompts] truncated per `truncation_mode`

    @property
    def columns(self) -> list[str]:
        return [c for c in self.rows.column_names if c != "prompt"]


def load_prompts(spec: str, split: str, tokenizer, config: GRPOConfig, rows=None) -> PromptSet:
    """Prompt rows (a `prompt` column, text or chat; loaded from `spec` unless given) tokenized and cut to
    `max_prompt_length`."""
    rows = load_rows(spec, split) if rows is None else rows
    if "prompt" not in rows.column_names:
        raise DataError(f"Dataset {spec!r} has columns {sorted(rows.column_names)}; GRPO needs a `prompt` column "
                        "(text or chat messages) plus any columns the reward functions read.")
    prompts = rows["prompt"]  # (each read of an Arrow column builds a new Python list)
    for index, prompt in enumerate(prompts):
        if is_conversational(prompt):
            check_messages(prompt, index, "prompt", tokenizer)
    ids = [prompt_token_ids(p, tokenizer) for p in prompts]
    limit, long = config.max_prompt_length, [i for i, x in enumerate(ids) if len(x) > config.max_prompt_length]
    if long and config.truncation_mode == "drop":
        keep = sorted(set(range(len(ids))) - set(long))
        rows, ids = rows.select(keep), [ids[i] for i in keep]
    else:
        ids = [x[-limit:] if config.truncation_mode == "keep_end" else x[:limit] for x in ids]
    if long:
        log.warning("%s: %d of %d prompts are longer than max_prompt_length=%d (%s).", spec, len(long),
                    len(rows) + (len(long) if config.truncation_mode == "drop" else 0), limit,
                    {"keep_end": "their start was cut", "keep_start": "their end was cut", "drop": "dropped"}[
                        config.truncation_mode])
    if not ids:
        raise DataError(f"Dataset {spec!r} has no prompts left: all {len(long)} are longer than max_prompt_length="
                        f"{limit} (truncation_mode=drop); raise `max_prompt_length`, or set `truncation_mode "
                        "keep_end` to cut their start instead.")
    return PromptSet(rows, ids)


@dataclass
class RewardSet:
    """The reward functions, their names (for metrics) and weights."""

    funcs: list
    names: list[str]
    weights: torch.Tensor  # [F]

    def score(self, data: PromptSet, picked: list[int], completions: list[list], tokenizer
              ) -> tuple[list, list[str], torch.Tensor]:
        """Decode and score the completions of `data`'s prompts `picked` (one group per prompt): each
        completion's prompt, its text, and the rewards of every function, [N, F] (NaN where a function
        returned None). TRL's calling convention: chat completions for chat prompts, the dataset's other
        columns and `completion_ids` as keyword arguments."""
        owners = [i for i, group in zip(picked, completions) for _ in group]  # [N] dataset row of each completion
        flat = [c for group in completions for c in group]
        prompts = [data.rows[i]["prompt"] for i in owners]
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in flat]
        shaped = [[{"role": "assistant", "content": x}] for x in texts] if is_conversational(prompts[0]) else texts
        columns = {c: [data.rows[i][c] for i in owners] for c in data.columns}
        columns["completion_ids"] = [list(c.token_ids) for c in flat]
        return prompts, texts, score_completions(self.funcs, prompts, shaped, columns)


def load_rl_inputs(config, tokenizer, world: int) -> tuple[PromptSet, PromptSet | None, RewardSet]:
    """An RL stage's (GRPO, PPO) prompts, held-out prompts and reward functions, checked before any model loads."""
    if config.eval_split_ratio:
        raise ConfigError(f"{config.stage.upper()} evaluates on held-out prompts from `eval_dataset`; "
                          "`eval_split_ratio` is not supported: pass --eval_dataset PATH instead.")
    data = load_prompts(dataset_label(config), config.dataset_split, tokenizer, config, rows=train_rows(config))
    eval_data = (load_prompts(config.eval_dataset, config.dataset_split, tokenizer, config)
                 if config.eval_dataset else None)
    if config.dataset_test_split:
        eval_data = load_prompts(f"{config.dataset} [{config.dataset_test_split}]", config.dataset_test_split,
                                 tokenizer, config, rows=test_split_rows(config))
    funcs = [load_reward_function(spec, label=config.reward_label, label_score=config.reward_label_score)
             for spec in config.reward_funcs]
    rewards = RewardSet(funcs, reward_names(funcs),
                        torch.tensor(config.reward_weights or [1.0] * len(funcs)))
    check_ranks(config, world, len(data.token_ids))
    return data, eval_data, rewards


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
    if config.advantage_estimator == "rloo":
        advantages, stats = rloo_advantages(everyone, G)
    else:
        advantages, stats = group_advantages(everyone, G, config.scale_rewards)
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


def update(run: StageRunner, traj: Trajectory) -> dict[str, float]:
    """`num_iterations` optimizer steps over the trajectory's completions; returns this rank's means."""
    config, batch, size = run.config, traj.batch, run.config.per_device_batch_size
    # dapo divides by the active tokens of the whole cycle on all ranks; by world / world of them
    # here, because DDP / DeepSpeed average the ranks' gradients (TRL does the same).
    cycle_tokens = run.sum_over_ranks({"n": float(traj.loss_mask.sum())})["n"] / run.world
    starts = range(0, len(batch.input_ids), size)
    correct_engine = config.importance_sampling_correction and config.rollout_engine != "hf"
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
                if correct_engine:
                    is_weights, is_stats = rollout_is_weights(old if old is not None else logps.detach(),
                                                              batch.rollout_logps[rows], mask, mode="token_truncate",
                                                              clip_max=config.importance_sampling_cap)
                loss, stats = policy_loss(
                    logps, old, traj.advantages[rows], mask, loss_type=config.loss_type, epsilon=config.epsilon,
                    epsilon_high=config.epsilon_high, ref_logps=traj.ref_logps[rows] if traj.ref_logps is not None
                    else None, beta=config.beta, max_completion_length=config.max_completion_length,
                    num_items_in_batch=cycle_tokens, is_weights=is_weights)
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


def eval_prompts_per_batch(config) -> int:
    """Prompts per evaluation batch on each device: `per_device_eval_batch_size` completions (as in TRL), in whole
    groups of `num_generations`; unset, a training cycle's prompts."""
    if not config.per_device_eval_batch_size:
        return max(1, config.prompts_per_cycle)
    return max(1, config.per_device_eval_batch_size // getattr(config, "num_generations", 1))


def evaluate(run: StageRunner, engine, data: PromptSet, rewards: RewardSet, tokenizer,
             sampling: SamplingConfig) -> dict[str, float]:
    """Mean rewards of G sampled completions per held-out prompt (TRL's eval_reward); each rank its share."""
    per_func = []
    for part in run.rank_slice(len(data.token_ids), eval_prompts_per_batch(run.config)):
        picked = list(part) or [0]  # an empty share still generates (collectives and ZeRO-3 stay in step)
        call = dataclasses.replace(sampling, seed=run.config.seed, prompt_keys=picked)  # the same draws every eval
        completions = engine.generate([data.token_ids[i] for i in picked], call)
        scores = rewards.score(data, picked, completions, tokenizer)[2]
        per_func.append(scores if len(part) else scores[:0])
    mine = torch.cat(per_func)  # [n, F]
    sums = run.sum_over_ranks({"n": float(len(mine)),
                               "eval_reward": float(torch.nansum(combine_rewards(mine, rewards.weights))),
                               **{f"eval_rewards/{n}/mean": float(torch.nansum(mine[:, j]))
                                  for j, n in enumerate(rewards.names)}})
    count = max(sums.pop("n"), 1.0)
    return {k: v / count for k, v in sums.items()}


def start_engine(run: StageRunner, model, tokenizer, model_path: str, n: int) -> tuple[object, SamplingConfig]:
    """The rollout engine (`rollout_engine`) for `model`, and the sampling of `n` completions per prompt.

    vllm-server: the server at vllm_server_host/port (or base URL), which then gets this run's weights
    first; unset, ONE server per node (so one for a one-node job), started from `model_path` by the
    node's first rank, which the node's other ranks connect to once it answers. Shared with PPO, whose
    config has the same fields."""
    config = run.config
    url = (server_url(config.vllm_server_host, config.vllm_server_port, config.vllm_server_base_url)
           if config.rollout_engine == "vllm-server" else None)

    def make(server: str | None):
        return make_engine(config.rollout_engine, model=model, tokenizer=tokenizer, model_path=model_path,
                           max_model_len=config.max_prompt_length + config.max_completion_length,
                           dtype="bfloat16" if run.accelerator.mixed_precision == "bf16" else config.dtype,
                           seed=config.seed, gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                           server_devices=config.vllm_server_devices, server_url=server,
                           server_timeout_s=config.vllm_server_timeout,
                           synced_gpus=run.world > 1 and run.runtime["zero_stage"] == 3)

    if config.rollout_engine == "vllm-server" and url is None and run.world > 1:
        # Rank 0 of each node starts it and waits until it answers; the node's other ranks then connect to it
        # (127.0.0.1: one server per node, so one for a one-node job).
        local_main = run.accelerator.is_local_main_process
        engine = make(None) if local_main else None
        host = socket.gethostname()
        started = distributed.every_rank(run.accelerator, [host, engine.url, engine.pid] if local_main else None)
        ours = next(entry for entry in started if entry is not None and entry[0] == host)
        engine = engine or make(ours[1])
        hosts = distributed.every_rank(run.accelerator, host)
        log.info("Rollout server %s (pid %s) serves the %d ranks on %s; %d server(s) in the job.", ours[1], ours[2],
                 hosts.count(host), host, sum(1 for e in started if e is not None))
    else:
        engine = make(url)
    if url is not None:  # a running server holds whatever it last got: start from this run's weights
        log.info("Rollout server %s (model %s, max_model_len %d): pushing this run's weights.", url,
                 engine.info["model"], engine.info["max_model_len"])
        push_weights(run, engine)
    sampling = SamplingConfig(max_new_tokens=config.max_completion_length, temperature=config.temperature,
                              top_p=config.top_p, top_k=config.top_k, n=n, stop_token_ids=[tokenizer.eos_token_id])
    return engine, sampling


def push_weights(run: StageRunner, engine) -> None:
    """The new weights to the rollout engine (the hf engine generates with the training model itself).

    One rank sends them, module by module (`distributed.full_weights`; LoRA merged): rank 0 to a server
    given by address, each node's rank 0 to its node's own server (one it started, or a sidecar on
    127.0.0.1); under ZeRO-3 every rank takes part in each module's gather. The other ranks wait at a
    barrier until the engine has them."""
    config = run.config
    if config.rollout_engine == "hf":
        return
    given = server_url(config.vllm_server_host, config.vllm_server_port, config.vllm_server_base_url)
    sends = run.accelerator.is_local_main_process if config.rollout_engine == "vllm-server" and on_each_node(given) \
        else run.is_main
    weights = distributed.full_weights(run.accelerator, run.model, run.module)
    if sends:
        engine.sync_weights(weights)
    elif run.runtime["zero_stage"] == 3:
        for _ in weights:  # the gathers are collectives
            pass
    if run.world > 1:
        run.accelerator.wait_for_everyone()


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
    data, eval_data, rewards = load_rl_inputs(config, tokenizer, run.world)
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
    if config.share_prompt:
        for m in (model, ref_model):
            use_block_attention(m)
    model.train()
    trainable, total = count_parameters(model)
    log.info("Model %s: %.2fM parameters, %.2fM trainable.", config.model, total / 1e6, trainable / 1e6)
    run.tokenizer = tokenizer
    run.report = distributed.RankReport(run.accelerator)
    with run.failing():
        run.prepare(model, steps, describe_datasets(config, data.rows, eval_data.rows if eval_data else None, {}),
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


def check_ranks(config: GRPOConfig, world: int, num_prompts: int) -> None:
    """What several ranks need that one does not; each error says what to change."""
    if world > 1 and num_prompts < config.prompts_per_cycle * world:
        raise ConfigError(f"{world} ranks x {config.prompts_per_cycle} prompts per cycle need at least "
                          f"{config.prompts_per_cycle * world} prompts; the dataset has {num_prompts}. Lower "
                          "per_device_batch_size or gradient_accumulation_steps, or use fewer processes.")
    if world > 1 and config.rollout_engine == "vllm":
        raise ConfigError("rollout_engine=vllm runs vLLM inside the training process, which supports one process "
                          "so far; with several ranks use vllm-server (one rollout server for the job) or hf.")
