"""What a component body calls: build the stage config, call `trainer`, write the outputs.

Component bodies are copied into the compiled YAML and run in the trainer image, so they hold
only an import and one call into this module; everything here is thin glue around `trainer/`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components import report
from components.settings import RUN_ID_ENV
from trainer.engine import shutdown
from trainer.engine.openmp import set_openmp_defaults
from trainer.engine.preemption import PREEMPTED_EXIT_CODE, Preempted
from trainer.io import storage

# trainer.engine.checkpoint (which imports torch, ~1.5 s) is imported where a stage's outputs are read, so that the
# light tasks (start-run, finish-run, promote's report) start without it.

log = logging.getLogger(__name__)
shutdown.collect_then_freeze_at_exit()  # every task imports this module: each ends ~1.4 s sooner after its work
set_openmp_defaults()  # ... before any of them loads torch (trainer.engine.openmp)
SKIPPED = "alignflow.skipped"
PIPELINE_RUN_TAG = "alignflow.pipeline_run"  # the run's display name (not unique)
PIPELINE_RUN_ID_TAG = "alignflow.pipeline_run_id"  # the run's id: how every task finds the parent run

def _setup() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def is_skipped(path: str) -> bool:
    return Path(path, SKIPPED).exists()


def pass_through(source: str, dest: str) -> None:
    """Make `dest` the same model as `source` (a skipped stage hands its input on); hard links when possible."""
    shutil.copytree(source, dest, copy_function=_link_or_copy, dirs_exist_ok=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def mark_skipped(dest: str, why: str) -> None:
    Path(dest).mkdir(parents=True, exist_ok=True)
    Path(dest, SKIPPED).write_text(why)


def _mirror_root() -> str:
    root = os.environ.get("ALIGNFLOW_PIPELINE_ROOT", "")
    return root if storage.is_remote(root) else ""


def publish(path: str) -> None:
    """Mirror an output artifact to ALIGNFLOW_PIPELINE_ROOT when it is an object store.

    kfp.local only writes a local pipeline root; `alignflow pipeline run --local --pipeline-root
    s3://…` sets this variable so every task's outputs also land in the bucket under the same
    <pipeline run>/<task>/<output> layout KFP uses on a cluster.
    """
    root = _mirror_root()
    if not root or not Path(path).exists():
        return
    rel = "/".join(Path(path).parts[-3:])
    dest = storage.join(root, rel)
    if Path(path).is_dir():
        storage.upload_dir(path, dest)
    else:
        storage.filesystem(dest).put_file(path, dest)
    log.info("Published %s to %s", path, dest)


def _log_metrics(metrics_artifact, metrics: dict[str, float]) -> None:
    """The KFP UI reads the metrics from the artifact's metadata; the same numbers also go into its file,
    because kfp.local serves a task from its cache only when every output artifact has a file."""
    numbers = {key.replace("/", "."): float(value) for key, value in metrics.items() if isinstance(value, int | float)}
    for key, value in numbers.items():
        metrics_artifact.log_metric(key, value)
    Path(metrics_artifact.path).parent.mkdir(parents=True, exist_ok=True)
    Path(metrics_artifact.path).write_text(json.dumps(numbers, indent=2, sort_keys=True))


def checkpoint_uri(output_path: str) -> str:
    """Where a pipeline stage saves its step checkpoints: the same prefix for every retry of one task
    in one run, in object storage whenever the pipeline root is.

    KFP uploads an output artifact only when its task succeeds, so checkpoints written inside it die
    with a failed attempt. On a cluster the output URI is <root>/<pipeline>/<run id>/<task>/<salt>/<output>
    and the run id comes from the pod's `pipeline/runid` label (RUN_ID_ENV): checkpoints go to
    <root>/<pipeline>/<run id>/checkpoints/<task>. With kfp.local the output path is
    <root>/<pipeline run>/<task>/<output>: checkpoints go to <root>/<pipeline run>/checkpoints/<task>,
    under the object-store mirror (ALIGNFLOW_PIPELINE_ROOT) when there is one. A stage on several nodes
    writes there too (from the job's pods), so a retried multi-node task resumes as a single-node one does.
    """
    from components.trainjob import remote_uri

    parts = remote_uri(output_path).rstrip("/").split("/")
    run_id = os.environ.get(RUN_ID_ENV, "")
    if run_id and run_id in parts[:-2]:
        i = parts.index(run_id)
        return "/".join([*parts[: i + 1], "checkpoints", parts[i + 1]])
    run, task = parts[-3], parts[-2]
    return storage.join(_mirror_root() or "/".join(parts[:-3]), run, "checkpoints", task)


def train_stage(stage: str, config: dict[str, Any], *, model_in: str, dataset: str, model_out, metrics_out,
                report_out, knobs: dict[str, Any] | None = None, inputs_fingerprint: str = "",
                reward_model: str | None = None) -> None:
    """Run one training stage from a component: config from the pipeline's structured parameter (over
    the top-level `knobs`), model/dataset/output from the artifacts. With `nodes` > 1 in the config the
    stage runs as a TrainJob/PyTorchJob on that many nodes (components/trainjob.py) and this task waits
    for it. `inputs_fingerprint` (the data's, for the cache key) is tagged on the stage's MLflow run.
    `reward_model` (GRPO, PPO): the reward-model task's output, which joins the reward functions unless
    that task was skipped."""
    from components import inputs, trainjob
    from trainer.engine import checkpoint as ckpt
    from trainer.engine import launch
    from trainer.stages import stage_run

    _setup()
    run_values = {}
    if parent := parent_run_id():
        run_values["mlflow_parent_run_id"] = parent
    if inputs_fingerprint:
        tags = config.get("mlflow_tags", [])
        run_values["mlflow_tags"] = [*tags, f"alignflow.inputs_fingerprint={inputs_fingerprint}"]
    # One prefix for every attempt of this task, on one node or several: a retry resumes from the newest checkpoint.
    checkpoints = checkpoint_uri(model_out.path)
    stage_config, multi, values = inputs.resolve_stage(
        stage, config, knobs or {}, model=model_in, dataset=dataset, output_dir=checkpoints,
        reward_model=reward_model if reward_model and not is_skipped(reward_model) else None, run_values=run_values)
    if ckpt.is_complete(checkpoints):
        log.info("%s holds this task's finished model (from an earlier attempt); not training again.", checkpoints)
    else:
        log.info("Checkpoints go to %s; a retry of this task resumes from the newest.", checkpoints)
        if multi.nodes > 1:
            trainjob.run_stage(stage, stage_config, values, multi, output_dir=checkpoints)
        elif launch.needs_launch(stage_config):
            run_ranks(stage, stage_config)
        else:
            stage_run(stage)(stage_config)
    trainjob.download_complete(checkpoints, model_out.path)
    manifest = ckpt.read_json(storage.join(model_out.path, ckpt.MANIFEST))
    _log_metrics(metrics_out, manifest["metrics"])
    report.write(report_out.path, report.render(training_report(stage, model_out.path)))
    publish(model_out.path)
    storage.remove(checkpoints)  # the model is the task's output now; its checkpoints are spent


def training_report(stage: str, model_dir: str) -> report.Report:
    """A training task's page, from its model folder: final metrics and run id (manifest), curves
    (metrics.jsonl) and the completions the stage logged last (manifest `samples`)."""
    from trainer.engine import checkpoint as ckpt
    from trainer.stages import stage_config

    manifest = ckpt.read_json(storage.join(model_dir, ckpt.MANIFEST))
    run_id = manifest.get("mlflow_run_id") or ""
    return report.Report(stage, (stage_config(stage).__doc__ or "").strip().splitlines()[0], manifest["metrics"],
                         ckpt.read_history(model_dir), manifest.get("samples") or [], mlflow_run_id=run_id,
                         mlflow_url=mlflow_run_url(run_id))


def run_ranks(stage: str, config) -> None:
    """`gpus_per_node` > 1 on one node: the stage's ranks in this pod, through `alignflow train`'s launcher.
    The config travels as a file (it may name secrets' holders, never their values: those stay in the env)."""
    import tempfile

    from trainer.engine import launch

    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix=f"alignflow-{stage}-") as fh:
        values = {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
        json.dump(values, fh)
        fh.flush()
        code = launch.launch(stage, ["--config", fh.name], config)
    if code == PREEMPTED_EXIT_CODE:  # stopped by a signal with a checkpoint: this task's retry resumes from it
        raise Preempted(f"The {config.num_processes} ranks of the {stage} stage were stopped by a signal.")
    if code:
        raise RuntimeError(f"The {config.num_processes} ranks of the {stage} stage failed (exit code {code}); "
                           "the rank logs above say why.")


def skip_stage(stage: str, *, model_in: str | None, model_out, metrics_out, report_out, why: str) -> None:
    """A switched-off stage: hand the input model on (or mark the output empty) and say so in the report."""
    _setup()
    _log_metrics(metrics_out, {})
    if model_in:
        pass_through(model_in, model_out.path)
    else:
        mark_skipped(model_out.path, why)
    report.write(report_out.path, report.render(report.Report(f"{stage} skipped", notes=[why])))


def evaluate_stage(config: dict[str, Any], *, model_in: str, reference_in: str, dataset: str, reward_model: str,
                   model_name: str, gate_metric: str, min_improvement: float, metrics_out, report_out,
                   results_out, gate_mode: str = "auto") -> bool:
    """Evaluate the trained policy, compare it with the registry's champion; returns whether the gate passes."""
    from trainer.config.eval_config import EvalConfig
    from trainer.config.options import config_from_dict
    from trainer.stages import promote as registry
    from trainer.stages.evaluate import run_evaluate

    _setup()
    values = {**config, "model": model_in, "dataset": dataset, "reference_model": reference_in,
              "output_dir": results_out.path}
    if reward_model and not is_skipped(reward_model):
        values["reward_model"] = reward_model
    tracking = os.environ.get("MLFLOW_TRACKING_URI")
    if tracking and model_name:
        champion = registry.champion_uri(model_name)
        if champion and values.get("reward_model"):
            values["baseline_model"] = champion
    if parent := parent_run_id():
        values["mlflow_parent_run_id"] = parent
    metrics = run_evaluate(config_from_dict(EvalConfig, values))
    _log_metrics(metrics_out, metrics)
    if tracking and model_name:
        passed, reason = registry.check_gate(model_name, metrics, gate_metric, min_improvement, gate_mode)
    else:
        passed, reason = False, "no MLflow tracking URI: nothing to promote into"
    report.write(report_out.path, report.render(evaluate_report(metrics, results_out.path, passed, reason, parent)))
    Path(results_out.path, "gate.json").write_text(json.dumps({"passed": passed, "reason": reason}))
    publish(results_out.path)
    return passed


def evaluate_report(metrics: dict[str, float], results: str, passed: bool, reason: str, mlflow_run: str,
                    rows: int = 8) -> report.Report:
    """The evaluate task's page: the gate verdict, the metrics, the first `rows` samples (one column per
    reward function) and a link to the pipeline's MLflow run (the evaluate run is its child)."""
    from trainer.engine.completions import flat_sample

    samples_file = Path(results, "samples.jsonl")
    lines = samples_file.read_text().splitlines()[:rows] if samples_file.exists() else []
    samples = [flat_sample(json.loads(line)) for line in lines]
    return report.Report("evaluate", "The trained policy on held-out prompts, against the current champion",
                         metrics, samples=samples, gate=report.Gate(passed, reason), mlflow_run_id=mlflow_run,
                         mlflow_url=mlflow_run_url(mlflow_run))


def mlflow_run_url(run_id: str) -> str:
    """The run's page in the MLflow UI of MLFLOW_TRACKING_URI (credentials left out); '' without an
    HTTP tracking server or when the run cannot be looked up."""
    from urllib.parse import urlsplit, urlunsplit

    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not run_id or not uri.startswith(("http://", "https://")) or (client := _client()) is None:
        return ""
    try:
        experiment = client.get_run(run_id).info.experiment_id
    except Exception as err:  # a report without the link beats a failed task
        log.warning("MLflow: cannot look up run %s for the report's link (%s).", run_id, err)
        return ""
    parts = urlsplit(uri)
    base = urlunsplit((parts.scheme, parts.hostname + (f":{parts.port}" if parts.port else ""), parts.path, "", ""))
    return f"{base.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"


def promote_stage(*, model_in: str, results: str, model_name: str, gate_metric: str, min_improvement: float,
                  gate_mode: str = "auto",
                  pipeline_run: str, report_out) -> str:
    """Register the evaluated model as an MLflow model and move `@champion` (the pipeline calls this only when
    the gate passed). The promote run is a child of the pipeline's MLflow run (found by the run id)."""
    from trainer.stages import promote as registry

    _setup()
    metrics = json.loads(Path(results, "metrics.json").read_text())
    tags = {"alignflow.pipeline_run": pipeline_run}
    if parent := find_pipeline_run():
        tags["alignflow.pipeline_mlflow_run"] = parent
    result = registry.promote(model_name, model_in, metrics, gate_metric=gate_metric, gate_mode=gate_mode,
                              min_improvement=min_improvement, tags=tags, parent_run_id=parent or None)
    page = report.Report(f"promote {model_name}", f"version {result.version}: champion {result.champion_before or 'none'} "
                         f"→ {result.champion_after}", metrics, gate=report.Gate(result.promoted, result.reason),
                         mlflow_run_id=parent, mlflow_url=mlflow_run_url(parent))
    report.write(report_out.path, report.render(page))
    return result.version


@dataclass
class PipelineRunConfig:
    """What the MLflow parent run of a pipeline run records (the fields `Tracker` reads)."""

    mlflow_run_name: str
    mlflow_tags: list[str]
    mlflow_experiment: str = field(default_factory=lambda: os.environ.get("ALIGNFLOW_MLFLOW_EXPERIMENT", "alignflow"))
    mlflow_log_checkpoint: bool = False
    parent_run_id = None

    @property
    def tracking_uri(self) -> str | None:
        return os.environ.get("MLFLOW_TRACKING_URI") or None


def _client():
    """An MlflowClient for MLFLOW_TRACKING_URI, or None (with a warning) when it is unset or unreachable."""
    from trainer.tracking.tracker import cap_mlflow_http_retries, unreachable_reason, use_uri_credentials

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return None
    uri = use_uri_credentials(uri)
    cap_mlflow_http_retries()
    if uri.startswith(("http://", "https://")) and (why := unreachable_reason(uri)) is not None:
        log.warning("MLflow at %s is unreachable (%s); the pipeline's MLflow run is not updated.", uri, why)
        return None
    from mlflow import MlflowClient

    return MlflowClient(uri)


def _pipeline_runs(client) -> list:
    """The MLflow runs tagged with this pipeline run's id (RUN_ID_ENV), oldest first."""
    run_id = os.environ.get(RUN_ID_ENV, "")
    experiment = client.get_experiment_by_name(PipelineRunConfig("", []).mlflow_experiment) if run_id else None
    if experiment is None:
        return []
    return client.search_runs([experiment.experiment_id], f"tags.`{PIPELINE_RUN_ID_TAG}` = '{run_id}'",
                              order_by=["attributes.start_time ASC"])


def find_pipeline_run() -> str:
    """The MLflow parent run of this pipeline run, found by its ``alignflow.pipeline_run_id`` tag; '' when
    there is none, no reachable MLflow, or no run id (outside a pipeline run).

    Tasks find the parent themselves rather than taking its id as an input: an input made fresh by
    every run would enter every cache key (components/settings.py says where the run id comes from)."""
    client = _client()
    try:
        runs = _pipeline_runs(client) if client else []
    except Exception as err:  # a server that fails the search: the stage logs without a parent
        log.warning("MLflow: cannot look up the pipeline's run (%s: %s).", type(err).__name__, err)
        return ""
    return runs[0].info.run_id if runs else ""


def parent_run_id(pipeline_name: str = "", pipeline_run: str = "", params: dict[str, Any] | None = None) -> str:
    """The MLflow parent run of this pipeline run, opened when missing (normally by start-run; a stage
    whose start-run could not reach MLflow opens it itself); '' without tracking or a run id."""
    from trainer.tracking.tracker import Tracker

    run_id = os.environ.get(RUN_ID_ENV, "")
    if not os.environ.get("MLFLOW_TRACKING_URI") or not run_id:
        return ""
    if existing := find_pipeline_run():
        return existing
    name = pipeline_run or run_id
    tags = [f"alignflow.pipeline={pipeline_name}", f"{PIPELINE_RUN_TAG}={name}", f"{PIPELINE_RUN_ID_TAG}={run_id}"]
    # The run stays open until finish_pipeline_run; no system metrics (this task ends at once).
    tracker = Tracker(PipelineRunConfig(mlflow_run_name=name, mlflow_tags=tags), "pipeline", system_metrics=False)
    if params:
        tracker.log_dict(params, "pipeline_params.json")
    tracker.flush(wait_s=Tracker.finish_wait_s)
    return tracker.run_id or ""


def start_pipeline_run(pipeline_name: str, pipeline_run: str, params: dict[str, Any]) -> str:
    """Open the MLflow parent run of a pipeline run, or return the one a retry of this task opened;
    '' when tracking is off or unreachable."""
    _setup()
    return parent_run_id(pipeline_name, pipeline_run, params)


# KFP's final pipeline states (PipelineTaskFinalStatus.state) as MLflow run states.
_KFP_STATES = {"SUCCEEDED": "FINISHED", "FAILED": "FAILED", "CANCELED": "KILLED", "CANCELLED": "KILLED",
               "CANCELING": "KILLED"}


def finish_pipeline_run(pipeline_run: str, pipeline_state: str = "") -> None:
    """End the parent run opened by `start_pipeline_run` (found by its pipeline-run-id tag; `pipeline_run`
    is the run's display name, for the log).

    Its child runs still RUNNING belong to stage processes that died (killed pod, OOM): they are marked
    KILLED with a tag saying so. The parent ends as `pipeline_state` says (a KFP final state, e.g. from an
    exit handler's ``PipelineTaskFinalStatus.state``); without it, FAILED when some stage's last run
    failed or died, else FINISHED."""
    _setup()
    client = _client()
    if client is None:
        return
    experiment = client.get_experiment_by_name(PipelineRunConfig("", []).mlflow_experiment)
    for run in _pipeline_runs(client):
        parent = run.info.run_id
        children = client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'",
                                      order_by=["attributes.start_time ASC"])
        last_status: dict[str, str] = {}  # stage -> status of its latest run (a retry may start a new one)
        for child in children:
            status = child.info.status
            if status == "RUNNING":
                client.set_tag(child.info.run_id, "alignflow.ended_by",
                               "finish-run: the stage process ended without ending its run (killed or crashed)")
                client.set_terminated(child.info.run_id, "KILLED")
                status = "KILLED"
                log.warning("MLflow run %s (%s) of pipeline run %s was left RUNNING by a dead stage process; "
                            "marked KILLED.", child.info.run_id, child.data.tags.get("alignflow.stage", "?"),
                            pipeline_run)
            last_status[child.data.tags.get("alignflow.stage", child.info.run_id)] = status
        if run.info.status == "RUNNING":
            failed = any(s in ("FAILED", "KILLED") for s in last_status.values())
            final = _KFP_STATES.get(pipeline_state.upper(), "FAILED" if failed else "FINISHED")
            client.set_terminated(parent, final)
