"""Compile and run locally the post-training pipeline from one config file (pipelines/cluster.py
submits and schedules it on a Kubeflow cluster).

A pipeline config (YAML) sets everything a user changes: the base model, the datasets, the
algorithm and switches, each stage's options (the same names as `alignflow train STAGE`), the
promotion gate and the cluster resources. Everything in it is checked before any task runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.engine.openmp import set_openmp_defaults
from trainer.errors import ConfigError
from trainer.io import storage

log = logging.getLogger(__name__)

DATASET_KEYS = ("sft", "preferences", "prompts", "eval")


@dataclass
class PipelineConfig:
    """Everything a post-training pipeline run needs; load with `load_pipeline_config`."""

    base_model: str = ""
    datasets: dict[str, str] = field(default_factory=dict)
    algorithm: str = "grpo"
    skip_sft: bool = False
    skip_reward_model: bool = False
    max_steps: int = 0
    learning_rate: float = 0.0
    num_generations: int = 0
    sft: dict[str, Any] = field(default_factory=dict)
    reward: dict[str, Any] = field(default_factory=dict)
    dpo: dict[str, Any] = field(default_factory=dict)
    grpo: dict[str, Any] = field(default_factory=dict)
    ppo: dict[str, Any] = field(default_factory=dict)
    evaluate: dict[str, Any] = field(default_factory=dict)
    model_name: str = "alignflow-policy"
    gate_metric: str = "reward"
    gate_mode: str = "auto"
    min_improvement: float = 0.0
    cluster: dict[str, dict[str, Any]] = field(default_factory=dict)

    def arguments(self) -> dict[str, Any]:
        """The pipeline's parameters."""
        return {
            "base_model_uri": _artifact_uri(self.base_model),
            "sft_data_uri": _dataset_uri(self.datasets["sft"]),
            "preference_data_uri": _dataset_uri(self.datasets["preferences"]),
            "prompts_uri": _dataset_uri(self.datasets["prompts"]),
            "eval_prompts_uri": _dataset_uri(self.datasets["eval"]),
            "algorithm": self.algorithm, "skip_sft": self.skip_sft, "skip_reward_model": self.skip_reward_model,
            "max_steps": int(self.max_steps), "learning_rate": float(self.learning_rate),
            "num_generations": int(self.num_generations),
            "sft_config": self.sft, "reward_config": self.reward, "dpo_config": self.dpo,
            "grpo_config": self.grpo, "ppo_config": self.ppo, "eval_config": self.evaluate, "model_name": self.model_name,
            "gate_metric": self.gate_metric, "gate_mode": self.gate_mode, "min_improvement": float(self.min_improvement),
        }


def _artifact_uri(path: str) -> str:
    return path if storage.is_remote(path) else str(Path(path).expanduser().resolve())


def _dataset_uri(spec: str) -> str:
    from trainer.data.sources import demo_path

    if spec == "demo" or spec.startswith("demo:"):
        return str(demo_path(spec.partition(":")[2] or "sft"))
    return _artifact_uri(spec)


def load_pipeline_config(path: str | None, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    from trainer.config.strict_yaml import load_yaml

    values = {**(load_yaml(path) if path else {}), **(overrides or {})}
    known = {f.name for f in dataclasses.fields(PipelineConfig)}
    for key in values:
        if key not in known:
            import difflib

            close = difflib.get_close_matches(key, known, n=1)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise ConfigError(f"Unknown pipeline option `{key}`.{hint} Options: {', '.join(sorted(known))}.")
    sections = [f.name for f in dataclasses.fields(PipelineConfig) if f.default_factory is dict]
    for key in sections:
        if key in values and not isinstance(values[key], dict):
            example = {"datasets": "{sft: FILE, ...}", "cluster": "{train: {gpus: 1}}"}.get(key, "{max_steps: 100}")
            raise ConfigError(f"Pipeline option `{key}` is a {type(values[key]).__name__} ({values[key]!r}); it is a "
                              f"section of `name: value` lines, e.g. `{key}: {example}`.")
    return PipelineConfig(**values)


def validate(config: PipelineConfig, promotion: bool = True, local: bool = False) -> None:
    """Check every stage option, dataset and service the run will touch, before any task starts
    (the pipeline's first task checks the parameters again, for runs started from the KFP UI). `local`: a
    kfp.local run, whose tasks have no pods (`cluster.train` is not checked against the stage sections)."""
    from components.inputs import check_parameters

    if not config.base_model:
        raise ConfigError("`base_model` is required: a model folder, an s3:// prefix (e.g. from "
                          "`alignflow model init-tiny --out DIR`).")
    missing = [k for k in DATASET_KEYS if k not in config.datasets]
    if missing:
        raise ConfigError(f"`datasets` needs the keys {', '.join(DATASET_KEYS)}; missing {', '.join(missing)}.")
    knobs = {"max_steps": config.max_steps, "learning_rate": config.learning_rate,
             "num_generations": config.num_generations}
    pod_gpus = None if local else train_resources(config).gpus
    stage_configs = {"sft": config.sft, "reward": config.reward, "dpo": config.dpo, "grpo": config.grpo,
                     "ppo": config.ppo}
    check_parameters(config.algorithm, stage_configs, config.evaluate, knobs, config.model_name, config.gate_metric,
                     config.gate_mode, pod_gpus)
    for name in ("base_model", *[f"datasets.{k}" for k in DATASET_KEYS]):
        value = config.base_model if name == "base_model" else config.datasets[name.split(".")[1]]
        uri = _artifact_uri(value) if name == "base_model" else _dataset_uri(value)
        _check_exists(name, uri)
    if promotion:
        _check_tracking()


def _check_single_node(config: PipelineConfig) -> None:
    from components.trainjob import split_config

    multi = [s for s in ("sft", "reward", "dpo", "grpo", "ppo") if split_config(getattr(config, s))[0].nodes > 1]
    if multi:
        raise ConfigError(f"`nodes` > 1 in the {', '.join(multi)} section: a local run trains on this machine; the "
                          "multi-node job needs a Kubeflow cluster (`alignflow pipeline submit`). Remove `nodes`.")


def _check_exists(name: str, uri: str) -> None:
    try:
        found = storage.exists(uri, retry=False)  # before any task: fail in seconds, not after the retry budget
    except Exception as err:  # botocore/aiohttp raise many types for a dead endpoint
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS default"
        raise ConfigError(f"`{name}` = {uri!r}: the object store cannot be reached ({type(err).__name__}: {err}). "
                          f"Check the S3 endpoint ({endpoint}) and credentials (AWS_ACCESS_KEY_ID / "
                          "AWS_SECRET_ACCESS_KEY).") from None
    if not found:
        raise ConfigError(f"`{name}` = {uri!r} does not exist.")


def _check_tracking() -> None:
    from trainer.tracking.tracker import unreachable_reason

    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith(("http://", "https://")) and (why := unreachable_reason(uri)) is not None:
        raise ConfigError(f"The MLflow server at {uri} cannot be reached ({why}), and the pipeline ends by promoting "
                          "a model in its registry. Start the server or point MLFLOW_TRACKING_URI at one that "
                          "answers /health.")


def train_resources(config: PipelineConfig | None):
    """What a training task's pod asks for: `components.settings.TRAINING` with the config's `cluster.train`."""
    from components.settings import TRAINING

    cluster = (config.cluster if config else None) or {}
    try:
        return dataclasses.replace(TRAINING, **cluster.get("train", {}))
    except TypeError as err:
        raise ConfigError(f"`cluster.train`: {err}; its keys are {', '.join(f.name for f in dataclasses.fields(TRAINING))}."
                          ) from None


def build_pipeline(config: PipelineConfig | None = None, retries: int = 2, backoff: str = "60s", cache: bool = True,
                   local: bool = False):
    """The pipeline function with the config's cluster resources (`cluster.train`, `cluster.light`); `local`:
    for kfp.local, which runs no pods."""
    from pipelines.kubernetes import LIGHT
    from pipelines.post_training import make_pipeline

    cluster = (config.cluster if config else None) or {}
    return make_pipeline(train_resources(config), dataclasses.replace(LIGHT, **cluster.get("light", {})), retries,
                         backoff, cache, pod=not local)


def compile_pipeline(out: str, config: PipelineConfig | None = None, cache: bool = True) -> str:
    from kfp import compiler

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build_pipeline(config, cache=cache), package_path=out)
    return out


class PipelineFailed(RuntimeError):
    """A task of a local run failed; the message names it and its log file."""


def run_local(config: PipelineConfig, output: str, pipeline_root: str | None = None, retries: int = 0,
              cache: bool = False, verbose: bool = False, image: str | None = None) -> dict[str, Any]:
    """Run the whole DAG on this machine with kfp.local: each task in a subprocess, or with `image`, each
    in its own container of that image (kfp.local.DockerRunner; pipelines/containers.py).

    No retries by default: a failure on a laptop is a bug to see at once, not a flaky node. With
    `retries`, a failed task is run again after a few seconds and a training task resumes from its
    newest checkpoint, as on a cluster. `cache` turns on kfp.local's task cache (off by default there).
    The console gets a line per task start and end (pipelines/console.py); each task's full log goes
    to OUTPUT/logs/<task>.log, and also to the console as it comes with `verbose`.
    """
    import uuid

    from kfp import local

    from components.settings import RUN_ID_ENV
    from pipelines.console import task_console

    output_path = Path(output).resolve()
    output_path.mkdir(parents=True, exist_ok=True)
    local_root = output_path / "pipeline-root"
    if pipeline_root and not storage.is_remote(pipeline_root):
        local_root = Path(pipeline_root).resolve()
    if image:  # Docker and the image first: a missing daemon is one line, before any work
        from pipelines import containers

        found = containers.check_docker(image)
        containers.writable_by_tasks(local_root)
        os.environ["MLFLOW_TRACKING_URI"] = containers.tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", ""),
                                                                    local_root)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{output_path / 'mlflow.db'}")
    set_openmp_defaults()  # the tasks inherit it (trainer.engine.openmp)
    validate(config, local=True)
    _check_single_node(config)
    if pipeline_root and storage.is_remote(pipeline_root):
        os.environ["ALIGNFLOW_PIPELINE_ROOT"] = pipeline_root  # components mirror their outputs there
    # Components import `components`/`pipelines`/`trainer` from this checkout in the subprocesses.
    repo = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    # What KFP's pod label gives every task on a cluster: the run id they find the MLflow parent run by.
    os.environ[RUN_ID_ENV] = uuid.uuid4().hex
    arguments = config.arguments()
    if image:
        from components.definitions import image as stages_image

        arguments = containers.stage_inputs(arguments, local_root)
        runner, on_image = containers.runner(found), stages_image(image)
    else:
        runner, on_image = local.SubprocessRunner(use_venv=False), contextlib.nullcontext()
    started = time.perf_counter()
    log_dir = output_path / "logs"
    with task_console(log_dir, verbose) as console, on_image:
        # inside the console: DockerRunner's set-up message goes to pipeline.log with kfp.local's others
        local.init(runner=runner, pipeline_root=str(local_root), raise_on_error=True, enable_caching=cache)
        try:
            build_pipeline(config, retries=retries, backoff="2s", local=True)(**arguments)
        except RuntimeError as err:
            if not console.summary.failed:
                raise
            raise PipelineFailed(f"task {console.summary.failed} failed; its full log: "
                                 f"{console.summary.failed_log}") from err
    return {"pipeline_root": str(local_root), "tracking_uri": os.environ["MLFLOW_TRACKING_URI"],
            "seconds": time.perf_counter() - started, "logs": str(log_dir),
            "gate": _gate_reason(console.summary.outputs), "champion": _champion(config.model_name)}


def _gate_reason(outputs: dict[str, dict[str, Any]]) -> str | None:
    """The promotion gate's verdict, from the evaluate task's results (gate.json)."""
    import json

    for task in outputs.values():
        uri = task.get("results", {}).get("uri") if isinstance(task.get("results"), dict) else None
        if uri and Path(uri, "gate.json").exists():
            gate = json.loads(Path(uri, "gate.json").read_text())
            return f"{'passed' if gate['passed'] else 'failed'}: {gate['reason']}"
    return None


def _champion(model_name: str) -> str | None:
    """The registry's @champion version of `model_name` after the run; None without one (or without MLflow)."""
    from trainer.stages import promote as registry

    try:
        return registry.connect().get_registered_model(model_name).aliases.get(registry.CHAMPION)
    except Exception as err:  # no such model yet, or the server went away: the summary just leaves it out
        log.debug("No champion for %s: %s", model_name, err)
        return None
