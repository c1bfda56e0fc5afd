"""MLflow tracking for one training stage, which never stops training.

A `Tracker` opens one MLflow run per stage (a child run when the config names a parent),
logs the flattened config as params, step metrics in one `log_batch` call per step, and
tables, dicts and files as artifacts. Every record also goes to `Tracker.history`, which the
checkpoint code writes to ``metrics.jsonl``: MLflow is a mirror of the metrics, not their
only home.

An MLflow server that is down, slow or refusing writes must not kill or stall a training
run. So the tracker checks an http(s) server's ``/health`` with a short timeout before
starting, caps MLflow's own HTTP retries (the defaults back off for minutes), and wraps every
MLflow call: the first exception logs one warning and turns MLflow off for the rest of the
run. Non-http URIs (``sqlite:///…``, a folder) run MLflow embedded in this process.

Usage::

    with Tracker(config, stage="dpo") as tracker:   # FAILED on an exception, FINISHED otherwise
        tracker.log_metrics({"loss": 0.7, "rewards/chosen": 0.1}, step=10)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 3.0
# MLflow's limits (mlflow.utils.validation): values past them are rejected, so we truncate.
_MAX_PARAM_VALUE = 6000
_MAX_TAG_VALUE = 8000
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000


def cap_mlflow_http_retries() -> None:
    """MLflow retries a failed request 7 times with exponential backoff and a 120 s timeout:
    minutes of stalled training per call when the server is gone. Keep it to seconds, unless
    the user set these variables themselves."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


@functools.cache
def git_sha() -> str | None:
    """The commit of the alignflow source: ``ALIGNFLOW_GIT_SHA`` (images bake it in, having no
    .git), else ``git rev-parse HEAD`` next to this file; None without git or commits."""
    if sha := os.environ.get("ALIGNFLOW_GIT_SHA"):
        return sha
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and sha else None


def alignflow_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("alignflow")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def flatten_params(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": "1", "c": "[1, 2]"}`` (MLflow params are strings)."""
    out: dict[str, str] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_params(value, prefix=f"{name}."))
        elif isinstance(value, list | tuple):
            out[name] = json.dumps(list(value), default=str)
        else:
            out[name] = str(value)
    return {k: v[:_MAX_PARAM_VALUE] for k, v in out.items()}


def mlflow_key(key: str) -> str:
    """Make a metric key acceptable to MLflow: it allows ``[/\\w.\\- :]`` and no empty, ``.`` or
    ``..`` path parts; anything else becomes ``_`` (``rewards/chosen`` is kept as is)."""
    key = re.sub(r"[^/\w.\- :]", "_", key)
    return "/".join(part for part in key.split("/") if part not in ("", ".", "..")) or "_"


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def unreachable_reason(uri: str, timeout: float = HEALTH_TIMEOUT_S) -> str | None:
    """None when an http(s) tracking server answers ``/health``, else why not.

    Any HTTP answer counts (a proxy may not route /health, a server may want auth): the point
    is to catch a server that is down or unroutable before MLflow's client stalls on it. A TLS
    error also counts as an answer; MLflow's client has its own certificate settings."""
    import ssl

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as err:
        if isinstance(err.reason, ssl.SSLError):
            return None
        return f"{type(err.reason).__name__}: {err.reason}"
    except (OSError, ValueError) as err:  # timeouts, resets, malformed URIs
        return f"{type(err).__name__}: {err}"


def sqlite_artifact_location(uri: str) -> str | None:
    """For an embedded ``sqlite:///DIR/mlflow.db`` store: create DIR and keep artifacts in
    ``DIR/mlartifacts`` (MLflow's default is ``./mlruns`` under whatever the working folder is)."""
    if not uri.startswith("sqlite:///") or uri == "sqlite:///:memory:":
        return None
    db = Path(uri[len("sqlite:///"):].split("?")[0])
    db.parent.mkdir(parents=True, exist_ok=True)
    return (db.parent.resolve() / "mlartifacts").as_uri()


class Tracker:
    """One stage's MLflow run plus the in-memory metric history.

    config: a `trainer.config.TrainConfig` (any dataclass with the ``mlflow_*`` fields and the
        ``tracking_uri`` / ``parent_run_id`` properties). No tracking URI: MLflow stays off.
    stage: the stage name, tagged as ``alignflow.stage``.
    run_id: resume this MLflow run (after a crash or restart) instead of starting one. Params
        it already has keep their values; params it lacks are added.

    A child run (``config.parent_run_id`` set) goes into its parent's experiment, so that the
    MLflow UI nests it; ``config.mlflow_experiment`` names the experiment otherwise.

    ``run_id`` is None when MLflow is off or could not start a run; if MLflow fails later,
    ``run_id`` keeps naming the run that exists and ``active`` turns False.
    """

    def __init__(self, config: Any, stage: str, run_id: str | None = None) -> None:
        self.config = config
        self.stage = stage
        self.tracking_uri: str | None = config.tracking_uri
        self.run_id: str | None = None
        self.history: list[dict[str, Any]] = []
        self._client: Any = None
        self._finished = False
        if self.tracking_uri is None:
            return
        cap_mlflow_http_retries()
        if self.tracking_uri.startswith(("http://", "https://")):
            if (why := unreachable_reason(self.tracking_uri)) is not None:
                self._disable("checking /health", why)
                return
        self._guard("starting the run", lambda: self._start(run_id))

    # --- the run -----------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True while MLflow calls are being made (a run exists and nothing has failed)."""
        return self._client is not None and self.run_id is not None

    def _start(self, resume_run_id: str | None) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        artifact_location = sqlite_artifact_location(self.tracking_uri)
        self._client = client = MlflowClient(tracking_uri=self.tracking_uri)
        params = flatten_params(dataclasses.asdict(self.config))
        if resume_run_id is not None:
            run = client.get_run(resume_run_id)
            client.update_run(resume_run_id, status="RUNNING")
            self.run_id = resume_run_id
            params = {k: v for k, v in params.items() if k not in run.data.params}
        else:
            parent = self.config.parent_run_id
            if parent:
                experiment_id = client.get_run(parent).info.experiment_id
            else:
                experiment_id = self._experiment_id(client, self.config.mlflow_experiment, artifact_location)
            run_name = self.config.mlflow_run_name or f"{self.stage}-{time.strftime('%Y%m%d-%H%M%S')}"
            tags = self._tags()
            if parent:
                tags["mlflow.parentRunId"] = parent
            self.run_id = client.create_run(experiment_id, tags=tags, run_name=run_name).info.run_id
        for chunk in _chunks(sorted(params.items()), _PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=[Param(k, v) for k, v in chunk])

    @staticmethod
    def _experiment_id(client: Any, name: str, artifact_location: str | None) -> str:
        from mlflow.exceptions import MlflowException

        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException:  # a parallel stage created it first
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def _tags(self) -> dict[str, str]:
        tags = {"alignflow.stage": self.stage, "alignflow.version": alignflow_version()}
        if sha := git_sha():
            tags["mlflow.source.git.commit"] = sha
        for tag in self.config.mlflow_tags:
            key, _, value = tag.partition("=")
            tags[key.strip()] = value[:_MAX_TAG_VALUE]
        return tags

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with ``status`` (FINISHED, FAILED or KILLED); later calls do nothing."""
        if self._finished:
            return
        self._finished = True
        if self.active:
            self._guard("ending the run", lambda: self._client.set_terminated(self.run_id, status))

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: Any) -> None:
        if exc_type is None:
            self.finish("FINISHED")
        else:
            self.finish("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")

    # --- logging -----------------------------------------------------------------------------

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at ``step`` in `history`, and in MLflow when active.

        Values go through ``float()`` (0-d tensors and numpy scalars work); None values are
        dropped. Keys MLflow rejects are sanitised there (see `mlflow_key`), kept in history."""
        record = {k: float(v) for k, v in metrics.items() if v is not None}
        self.history.append({"step": int(step), **record})
        if not self.active or not record:
            return

        def send() -> None:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            batch = [Metric(mlflow_key(k), v, now, int(step)) for k, v in record.items()]
            for chunk in _chunks(batch, _METRICS_PER_BATCH):
                self._client.log_batch(self.run_id, metrics=chunk, synchronous=True)

        self._guard("logging metrics", send)

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.active:
            self._guard(f"logging {artifact_file}", lambda: self._client.log_text(self.run_id, text, artifact_file))

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:
        """A table of columns (e.g. prompts and sampled completions); ``artifact_file`` ends in
        ``.json``. Logging to the same file again appends rows, as MLflow does."""
        if self.active:
            self._guard(f"logging {artifact_file}",
                        lambda: self._client.log_table(self.run_id, data=data, artifact_file=artifact_file))

    def log_dict(self, d: dict, artifact_file: str) -> None:
        if self.active:
            self._guard(f"logging {artifact_file}", lambda: self._client.log_dict(self.run_id, d, artifact_file))

    def log_params(self, params: dict[str, Any]) -> None:
        """Add params to the run (ones it already has keep their values, as on resume)."""
        if self.active and params:
            from mlflow.entities import Param

            def send() -> None:
                have = self._client.get_run(self.run_id).data.params
                fresh = [Param(mlflow_key(k), str(v)) for k, v in sorted(params.items()) if mlflow_key(k) not in have]
                for chunk in _chunks(fresh, _PARAMS_PER_BATCH):
                    self._client.log_batch(self.run_id, params=chunk)

            self._guard("logging params", send)

    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        if self.active:
            self._guard(f"uploading {local_dir}",
                        lambda: self._client.log_artifacts(self.run_id, local_dir, artifact_path))

    def log_checkpoint(self, local_dir: str, artifact_path: str = "checkpoint") -> None:
        """Upload a checkpoint folder when ``config.mlflow_log_checkpoint`` asks for it."""
        if self.config.mlflow_log_checkpoint:
            self.log_artifacts(local_dir, artifact_path)

    # --- failure handling --------------------------------------------------------------------

    def _guard(self, what: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as err:  # whatever MLflow raises, training goes on
            self._disable(what, f"{type(err).__name__}: {str(err)[:500]}")

    def _disable(self, what: str, why: str) -> None:
        self._client = None
        logger.warning(
            "MLflow at %s is unavailable (%s: %s). MLflow logging is off for the rest of this %s run; "
            "metrics keep going to metrics.jsonl.", self.tracking_uri, what, why, self.stage)
