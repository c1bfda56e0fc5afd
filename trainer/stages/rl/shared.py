"""What the RL stages (GRPO, PPO) share: prompts and reward functions, the rollout engine with its weight
pushes, and evaluation on held-out prompts.

A stage brings its own loop and loss; `prompts_per_cycle` (on the config) is how many prompts each rank
rolls out per generation cycle. The shared options are `RolloutConfig` in `trainer/config/rl_config.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch

from trainer.algorithms.advantages import combine_rewards
from trainer.config.rl_config import RolloutConfig
from trainer.data.chat_templates import check_messages, is_conversational
from trainer.data.sources import dataset_fingerprint, dataset_label, load_rows, test_split_rows, train_rows
from trainer.data.token_cache import cached_map, tokenizer_fingerprint
from trainer.engine import distributed
from trainer.engine.completions import prompt_token_ids
from trainer.engine.runner import StageRunner
from trainer.errors import ConfigError, DataError
from trainer.rewards.functions import load_reward_function, reward_names, score_completions
from trainer.rewards.scorer import RewardModelScorer
from trainer.rollout import SamplingConfig, make_engine
from trainer.rollout.server_client import on_each_node, server_url

log = logging.getLogger(__name__)


class PromptTokens(Sequence):
    """The prompts' token ids, read one prompt at a time from the memory-mapped Arrow table of the tokenized-data
    cache (`trainer.data.token_cache`), so a process holds no Python list per row. Read-only: `len()`, indexing by
    int and iteration, what the stages use. `kept` maps prompt i to its table row when truncation_mode=drop
    dropped some (the table has one row per input row)."""

    def __init__(self, table, kept=None) -> None:
        self.table, self.kept = table, kept  # datasets.Dataset with `input_ids`; np.ndarray [num_prompts] or None

    def __len__(self) -> int:
        return len(self.table) if self.kept is None else len(self.kept)

    def __getitem__(self, i: int) -> list[int]:
        i = operator.index(i)  # an int; a slice is not something the stages take
        if not -len(self) <= i < len(self):
            raise IndexError(f"prompt {i} of {len(self)}")
        i %= len(self)
        row = i if self.kept is None else int(self.kept[i])
        return self.table.data.fast_slice(row, 1).column("input_ids")[0].as_py()


@dataclass
class PromptSet:
    """A prompt dataset: the rows (their other columns feed the reward functions) and token ids."""

    rows: Any  # datasets.Dataset
    token_ids: PromptTokens  # [num_prompts] lists of ints, truncated per `truncation_mode`

    @property
    def columns(self) -> list[str]:
        return [c for c in self.rows.column_names if c != "prompt"]


PROMPT_FEATURES = datasets.Features({
    "input_ids": datasets.Sequence(datasets.Value("int32")),  # cut to max_prompt_length; [] when dropped
    "length": datasets.Value("int32"),  # before truncation
})
# What `prompt_token_ids` does, part of the cache key: change it when that changes the tokens.
PROMPT_ENCODING = "chat: template with generation prompt, no special tokens; text: special tokens"


def check_chat_prompts(prompts, tokenizer) -> None:
    """`check_messages` on every chat prompt (a column of text prompts has none), read 1,000 rows at a time."""
    if isinstance(prompts.features["prompt"], datasets.Value):  # strings (or scalars): nothing to check
        return
    for start in range(0, len(prompts), 1000):
        for index, prompt in enumerate(prompts[start:start + 1000]["prompt"], start):
            if is_conversational(prompt):
                check_messages(prompt, index, "prompt", tokenizer)


def load_prompts(spec: str, split: str, tokenizer, config: RolloutConfig, rows=None) -> PromptSet:
    """Prompt rows (a `prompt` column, text or chat; loaded from `spec` unless given) tokenized and cut to
    `max_prompt_length`, through the tokenized-data cache: a second call with the same prompts, tokenizer and
    options maps the Arrow file the first one wrote."""
    rows = load_rows(spec, split) if rows is None else rows
    if "prompt" not in rows.column_names:
        raise DataError(f"Dataset {spec!r} has columns {sorted(rows.column_names)}; GRPO needs a `prompt` column "
                        "(text or chat messages) plus any columns the reward functions read.")
    prompts = rows.select_columns(["prompt"])
    check_chat_prompts(prompts, tokenizer)  # also on a cache hit: the same errors before training
    limit, mode = config.max_prompt_length, config.truncation_mode

    def tokenize_batch(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "length": []}
        for prompt in batch["prompt"]:
            ids = prompt_token_ids(prompt, tokenizer)
            out["length"].append(len(ids))
            if len(ids) > limit:
                ids = [] if mode == "drop" else ids[-limit:] if mode == "keep_end" else ids[:limit]
            out["input_ids"].append(ids)
        return out

    key = {"data": dataset_fingerprint(prompts), "tokenizer": tokenizer_fingerprint(tokenizer),
           "max_prompt_length": limit, "truncation_mode": mode, "encoding": PROMPT_ENCODING}
    table = cached_map(prompts, "prompts", key, tokenize_batch, PROMPT_FEATURES, f"Tokenizing prompts of {spec}",
                       config.dataset_num_proc)
    long = table.data.column("length").to_numpy() > limit  # [num_rows]
    num_long, kept = int(long.sum()), None
    if num_long and mode == "drop":
        kept = np.flatnonzero(~long)
        rows = rows.select(kept)
    token_ids = PromptTokens(table, kept)
    if num_long:
        log.warning("%s: %d of %d prompts are longer than max_prompt_length=%d (%s).", spec, num_long, len(table),
                    limit, {"keep_end": "their start was cut", "keep_start": "their end was cut", "drop": "dropped"}[
                        mode])
    if not len(token_ids):
        raise DataError(f"Dataset {spec!r} has no prompts left: all {num_long} are longer than max_prompt_length="
                        f"{limit} (truncation_mode=drop); raise `max_prompt_length`, or set `truncation_mode "
                        "keep_end` to cut their start instead.")
    return PromptSet(rows, token_ids)


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


def load_rl_inputs(run: StageRunner, tokenizer) -> tuple[PromptSet, PromptSet | None, RewardSet]:
    """An RL stage's (GRPO, PPO) prompts, held-out prompts and reward functions, checked before any model loads."""
    config = run.config
    if config.eval_split_ratio:
        raise ConfigError(f"{config.stage.upper()} evaluates on held-out prompts from `eval_dataset`; "
                          "`eval_split_ratio` is not supported: pass --eval_dataset PATH instead.")
    # One process per node tokenizes into the shared cache; the others then map the files it wrote.
    with run.accelerator.local_main_process_first():
        data = load_prompts(dataset_label(config), config.dataset_split, tokenizer, config, rows=train_rows(config))
        eval_data = (load_prompts(config.eval_dataset, config.dataset_split, tokenizer, config)
                     if config.eval_dataset else None)
        if config.dataset_test_split:
            eval_data = load_prompts(f"{config.dataset} [{config.dataset_test_split}]", config.dataset_test_split,
                                     tokenizer, config, rows=test_split_rows(config))
    funcs = [load_reward_function(spec, label=config.reward_label, label_score=config.reward_label_score)
             for spec in config.reward_funcs]
    for fn in funcs:  # reward models score under the run's mixed precision (RewardModelScorer)
        if isinstance(fn, RewardModelScorer):
            fn.autocast = run.accelerator.autocast
    rewards = RewardSet(funcs, reward_names(funcs),
                        torch.tensor(config.reward_weights or [1.0] * len(funcs)))
    check_ranks(config, run.world, len(data.token_ids))
    if config.vllm_enable_sleep_mode and run.device.type != "cuda":
        raise ConfigError("`vllm_enable_sleep_mode` needs a GPU: vLLM on the CPU keeps its weights and KV cache in "
                          "host memory and cannot sleep. Remove it (or set it false).")
    return data, eval_data, rewards


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
    sequences = max(config.prompts_per_cycle, eval_prompts_per_batch(config)) * n  # of one generate() call
    if config.rollout_engine == "vllm-server" and url is None:  # the server started here serves the node's ranks
        sequences *= int(os.environ.get("LOCAL_WORLD_SIZE", run.world))

    def make(server: str | None):
        return make_engine(config.rollout_engine, model=model, tokenizer=tokenizer, model_path=model_path,
                           max_model_len=config.max_prompt_length + config.max_completion_length,
                           dtype="bfloat16" if run.accelerator.mixed_precision == "bf16" else config.dtype,
                           seed=config.seed, gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                           server_devices=config.vllm_server_devices, server_url=server,
                           server_timeout_s=config.vllm_server_timeout, group_port=config.vllm_group_port,
                           synced_gpus=run.world > 1 and run.runtime["zero_stage"] == 3,
                           sleep_mode=config.vllm_enable_sleep_mode,
                           max_sequences=sequences)

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


def check_ranks(config: RolloutConfig, world: int, num_prompts: int) -> None:
    """What several ranks need that one does not; each error says what to change."""
    if world > 1 and num_prompts < config.prompts_per_cycle * world:
        raise ConfigError(f"{world} ranks x {config.prompts_per_cycle} prompts per cycle need at least "
                          f"{config.prompts_per_cycle * world} prompts; the dataset has {num_prompts}. Lower "
                          "per_device_batch_size or gradient_accumulation_steps, or use fewer processes.")
    if world > 1 and config.rollout_engine == "vllm":
        raise ConfigError("rollout_engine=vllm runs vLLM inside the training process, which supports one process "
                          "so far; with several ranks use vllm-server (one rollout server for the job) or hf.")
