"""The pipeline's run-time parameters: checked in its first task, the common knobs merged into the
stage configs, and the input fingerprints that make cache keys follow the data.

A run started from the KFP UI never passes through `alignflow pipeline submit`'s checks, so the
pipeline checks its own parameters in its first task (`stages.check_inputs`): a wrong value fails
in seconds, naming the field and the allowed values, before any GPU is requested. The CLI runs the
same checks before it submits (`alignflow pipeline validate` runs them alone). They include each
`reward_funcs` import path, resolved without running it (`trainer.rewards.specs`), so a misspelt
reward function fails here and not after SFT and the reward model have trained.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from trainer.errors import ConfigError
from trainer.io import storage

# One `dsl.If` branch each in pipelines/post_training.py (a test holds the two together).
ALGORITHMS = ("grpo", "dpo", "ppo")
TRAINING_STAGES = ("sft", "reward", "dpo", "grpo", "ppo")
# The online-RL stages: the trained reward model (the reward-model task's output) joins their reward
# functions, weighted by their section's `reward_model_weight`, a key of the pipeline, not of the stage.
RL_STAGES = ("grpo", "ppo")
REWARD_MODEL_WEIGHT = "reward_model_weight"
# The typed top-level knobs of the pipeline and the stages each reaches. 0 leaves a stage its own
# value; a key in the stage's config dict overrides the knob.
KNOBS = {
    "max_steps": TRAINING_STAGES,
    "learning_rate": TRAINING_STAGES,
    "num_generations": ("grpo",),
}
# The datasets and model each training task reads, by pipeline parameter: their fingerprints make
# the task's cache key change when the data at an unchanged URI changes.
TASK_INPUTS = {
    "sft": ("base_model_uri", "sft_data_uri"),
    "reward": ("base_model_uri", "preference_data_uri"),
    "dpo": ("preference_data_uri",),
    "grpo": ("prompts_uri",),
    "ppo": ("prompts_uri",),
}
# Every stage in a pipeline saves a checkpoint every 30 minutes (and every `save_steps`), keeps
# the newest, and resumes a retried task from it.
PIPELINE_DEFAULTS = {"resume_from_checkpoint": "auto", "save_minutes": 30, "save_total_limit": 1,
                     "disable_progress_bar": True}
# What check-inputs gives for the paths only the tasks know (artifacts, the checkpoint prefix).
_PLACEHOLDERS = {"model": "placeholder", "dataset": "placeholder", "output_dir": "placeholder"}


def resolve_stage(stage: str, section: dict[str, Any], knobs: dict[str, Any], *, model: str, dataset: str,
                  output_dir: str, reward_model: str | None = None, run_values: dict[str, Any] | None = None):
    """A training stage's config exactly as its task reads it: the pipeline config's `section` for the stage,
    the top-level `knobs` it takes, the pipeline's defaults, and the artifacts (`model`, `dataset`, the
    trained `reward_model` of an RL stage, the `output_dir` checkpoint prefix). `run_values` are what
    only the running task knows (the MLflow parent run, tags).

    Returns (the stage's config object, its `MultiNode` keys, checked together, and the values the config
    was built from: what a multi-node job's pods parse). Pure: it reads no file and no environment, so
    check-inputs and the training task (which hands the values to a multi-node job) both call it, and a
    value is checked as the stage will read it. Errors are ConfigErrors naming the field."""
    from components.trainjob import split_config
    from trainer.config.options import config_from_dict
    from trainer.stages import stage_config

    config_cls = stage_config(stage)
    weight, section = split_reward_model_weight(stage, section)
    # `nodes` and the other multi-node keys (components/trainjob.py) are the launcher's, not the stage's.
    multi, section = split_config(with_knobs(stage, section, knobs))
    if reward_model:
        section = with_reward_model(config_cls, section, reward_model, weight)
    values = {**PIPELINE_DEFAULTS, **section, **(run_values or {}), "model": model, "dataset": dataset,
              "output_dir": output_dir}
    config = config_from_dict(config_cls, values)
    multi.check(stage, config)  # (on the section's own values: `num_processes` is the launcher's to set)
    ranks = multi.rank_options()  # (canonical fields: no second parse, the same checks in __post_init__)
    return (dataclasses.replace(config, **ranks) if ranks else config), multi, values


def with_reward_model(config_cls, config: dict[str, Any], reward_model: str, weight: float) -> dict[str, Any]:
    """An RL stage's config with the trained reward model after its reward functions (the section's
    `reward_funcs`, else the stage's default); with `reward_weights`, `weight` is the model's."""
    funcs = config.get("reward_funcs") or config_cls.__dataclass_fields__["reward_funcs"].default_factory()
    config = {**config, "reward_funcs": [*funcs, reward_model]}
    if config.get("reward_weights"):
        config["reward_weights"] = [*config["reward_weights"], weight]
    return config


def with_knobs(stage: str, config: dict[str, Any], knobs: dict[str, Any]) -> dict[str, Any]:
    """The stage's config dict with the top-level knobs it takes, where the dict leaves them out."""
    filled = {name: value for name, value in knobs.items() if value and stage in KNOBS[name] and name not in config}
    return {**filled, **config}


def split_reward_model_weight(stage: str, config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(the weight of the trained reward model among an RL stage's rewards, the section without the key)."""
    weight = config.get(REWARD_MODEL_WEIGHT, 1.0)
    if stage not in RL_STAGES:
        return weight, config
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise ConfigError(f"`{REWARD_MODEL_WEIGHT}` must be a number (the reward model's weight among "
                          f"`reward_weights`), got {weight!r}.")
    return float(weight), {k: v for k, v in config.items() if k != REWARD_MODEL_WEIGHT}


def check_knobs(knobs: dict[str, Any]) -> None:
    for name, value in knobs.items():
        if name not in KNOBS:
            raise ConfigError(f"Unknown pipeline knob `{name}`; the knobs are {', '.join(KNOBS)}.")
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"`{name}` must be 0 (each stage's own value) or a finite positive number, got {value}.")
    if knobs.get("num_generations") == 1:
        raise ConfigError("`num_generations` must be 0 (the grpo section's value) or >= 2: GRPO compares "
                          "completions within a group.")


def check_parameters(algorithm: str, stage_configs: dict[str, dict[str, Any]], eval_config: dict[str, Any],
                     knobs: dict[str, Any], model_name: str, gate_metric: str = "reward", gate_mode: str = "auto",
                     pod_gpus: int | None = None) -> None:
    """Every parameter a run reads, checked as the stages will read it; raises ConfigError naming the field.

    `pod_gpus`: the GPUs of a training task's pod (`cluster.train.gpus`), which a one-node section's
    `gpus_per_node` must match; None for a local run (no pods)."""
    from trainer.config.eval_config import EvalConfig
    from trainer.config.options import config_from_dict
    from trainer.rewards.specs import check_reward_specs

    if algorithm not in ALGORITHMS:
        raise ConfigError(f"`algorithm` must be one of {', '.join(ALGORITHMS)} (lower case), got {algorithm!r}.")
    if not model_name:
        raise ConfigError("`model_name` is required: the MLflow registered model the pipeline promotes into.")
    check_knobs(knobs)
    check_gate(gate_metric, gate_mode)
    for stage in TRAINING_STAGES:
        try:
            config, multi, _ = resolve_stage(stage, stage_configs.get(stage) or {}, knobs, **_PLACEHOLDERS)
            if pod_gpus is not None and stage in ("sft", "reward", algorithm):
                multi.check_pod(pod_gpus, config)
            # Import paths resolve (and are allowed) before any task runs, not when GRPO starts.
            check_reward_specs(getattr(config, "reward_funcs", []))
        except ConfigError as err:
            raise ConfigError(f"In the `{stage}` section of the pipeline config: {err}") from None
    try:
        check_reward_specs(config_from_dict(EvalConfig, {**eval_config, **_PLACEHOLDERS}).reward_funcs)
    except ConfigError as err:
        raise ConfigError(f"In the `evaluate` section of the pipeline config: {err}") from None


def check_gate(gate_metric: str, gate_mode: str) -> None:
    """The promotion gate knows which way `gate_metric` improves (`trainer.tracking.gate.gate_direction`)."""
    from trainer.errors import RegistryError
    from trainer.tracking.gate import gate_direction

    try:
        gate_direction(gate_metric, gate_mode)
    except RegistryError as err:
        raise ConfigError(str(err)) from None


def fingerprints(uris: dict[str, str]) -> dict[str, str]:
    """Each training stage's input fingerprint: its datasets' and model's `storage.fingerprint`s, joined.

    `uris` maps the pipeline's URI parameters (base_model_uri, sft_data_uri, ...) to their values; one
    that cannot be listed is an error naming it."""
    prints = {}
    for name, uri in uris.items():
        try:
            prints[name] = storage.fingerprint(uri.replace("minio://", "s3://", 1))
        except FileNotFoundError:
            raise ConfigError(f"`{name}` = {uri!r} does not exist.") from None
        except Exception as err:  # botocore/aiohttp raise many types for a dead endpoint or a refused key
            raise ConfigError(f"`{name}` = {uri!r} cannot be read ({type(err).__name__}: {err}). Check the "
                              "S3 endpoint and credentials (the alignflow-s3 Secret).") from None
    return {stage: "-".join(prints[name] for name in names) for stage, names in TASK_INPUTS.items()}
