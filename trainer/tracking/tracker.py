"""MLflow tracking for one training stage: it never stops training and, in the end, loses no metric.

A `Tracker` opens one MLflow run per stage (a child run when the config names a parent), logs the
flattened config as params, step metrics in one `log_batch` call per step, the datasets as run
inputs, tables, dicts and files as artifacts, and starts MLflow's system-metrics monitor
(``system/*``). Every record also goes to `Tracker.history`, which the checkpoint code writes to
``metrics.jsonl``: MLflow is a mirror of the metrics, not their only home.

An MLflow server that is down, slow or restarting must neither kill nor stall a training run,
and must not leave holes in it. So:

- an http(s) server's ``/health`` is probed with a short timeout before the run starts, and
  MLflow's own HTTP retries are capped (the defaults back off for minutes);
- a call that fails with a transient error (connection refused, timeout, 5xx) is queued, and
  every later call goes behind it; the queue is retried after a growing pause (5 s to 60 s),
  each retry first probing ``/health``, so a dead server costs training milliseconds per step;
- a call that fails for good (a 4xx: bad value, no permission) is dropped with a warning;
- at the end, queued calls get a last chance (up to `finish_wait_s`), and when the run had an
  outage, dropped points or was resumed, the metrics the server lacks are backfilled from
  `history` (so a run whose server was down for a while still ends with every point);
- a run that is resumed while still RUNNING (its process died) gets the death recorded in its
  tags, and the pipeline's finish task marks RUNNING child runs KILLED.

Credentials in the tracking URI (``http://user:password@host:5000``) are moved into MLflow's own
``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD`` settings and the URI MLflow sees has
none, so neither MLflow's error messages nor ours can print the password; `redact_uri` and
`redact_secrets` hide it wherever a URI is logged or stored (params, manifests).

Non-http URIs (``sqlite:///…``, a folder) run MLflow embedded in this process.

Usage::

    with Tracker(config, stage="dpo") as tracker:   # FAILED on an exception, FINISHED otherwise
        tracker.log_datasets(datasets)              # trainer.data.sources.describe_datasets(...)
        tracker.log_metrics({"loss": 0.7, "rewards/chosen": 0.1}, step=10)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trainer import extras
from trainer.tracking.provenance import (
    alignflow_version,
    container_image,
    git_sha,
    redact_secrets,
    redact_uri,
)

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 3.0
# MLflow's limits (mlflow.utils.validation): values past them are rejected, so we truncate.
_MAX_PARAM_VALUE = 6000
_MAX_TAG_VALUE = 8000
_MAX_DIGEST = 36
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000


def cap_mlflow_http_retries() -> None:
    """MLflow retries a failed request 7 times with exponential backoff and a 120 s timeout:
    minutes of stalled training per call when the server is gone. Keep it to seconds, unless
    the user set these variables themselves."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


# ----------------------------------------------------------------------------------------------
# Credentials in URIs


def use_uri_credentials(uri: str) -> str:
    """The tracking URI MLflow should see: for ``http(s)://user:password@host…`` the user and password
    go to ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD`` (MLflow's basic-auth settings,
    which also cover artifact uploads through the server) and the URI comes back without them, so no
    MLflow message can contain the password. Other URIs come back unchanged."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    os.environ["MLFLOW_TRACKING_USERNAME"] = urllib.parse.unquote(user)
    os.environ["MLFLOW_TRACKING_PASSWORD"] = urllib.parse.unquote(password)
    return urllib.parse.urlunsplit(parts._replace(netloc=host))


# ----------------------------------------------------------------------------------------------
# Small helpers


def flatten_params(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": "1", "c": "[1, 2]"}`` (MLflow params are
    strings); credentials in URIs are redacted."""
    out: dict[str, str] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_params(value, prefix=f"{name}."))
        elif isinstance(value, list | tuple):
            out[name] = json.dumps(list(value), default=str)
        else:
            out[name] = str(value)
    return {k: redact_uri(v)[:_MAX_PARAM_VALUE] for k, v in out.items()}


def mlflow_key(key: str) -> str:
    """Make a metric key acceptable to MLflow: it allows ``[/\\w.\\- :]`` and no empty, ``.`` or
    ``..`` path parts; anything else becomes ``_`` (``rewards/chosen`` is kept as is)."""
    key = re.sub(r"[^/\w.\- :]", "_", key)
    return "/".join(part for part in key.split("/") if part not in ("", ".", "..")) or "_"


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def unreachable_reason(uri: str, timeout: float = HEALTH_TIMEOUT_S) -> str | None:
    """None when an http(s) tracking server answers ``/health``, else why not (without credentials).

    Any HTTP answer counts (a proxy may not route /health, a server may want auth): the point
    is to catch a server that is down or unroutable before MLflow's client stalls on it. A TLS
    error also counts as an answer; MLflow's client has its own certificate settings. Credentials
    in the URI are not sent (and not needed) for the probe."""
    import ssl

    parts = urllib.parse.urlsplit(uri)
    url = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as err:
        if isinstance(err.reason, ssl.SSLError):
            return None
        return redact_uri(f"{type(err.reason).__name__}: {err.reason}")
    except (OSError, ValueError) as err:  # timeouts, resets, malformed URIs
        return redact_uri(f"{type(err).__name__}: {err}")


def sqlite_artifact_location(uri: str) -> str | None:
    """For an embedded ``sqlite:///DIR/mlflow.db`` store: create DIR and keep artifacts in
    ``DIR/mlartifacts`` (MLflow's default is ``./mlruns`` under whatever the working folder is)."""
    if not uri.startswith("sqlite:///") or uri == "sqlite:///:memory:":
        return None
    db = Path(uri[len("sqlite:///"):].split("?")[0])
    db.parent.mkdir(parents=True, exist_ok=True)
    return (db.parent.resolve() / "mlartifacts").as_uri()


def is_permanent(err: BaseException) -> bool:
    """Whether retrying a failed MLflow call is pointless: the server answered with a 4xx (bad value,
    missing resource, no permission) other than 408/429. Connection errors, timeouts and 5xx are
    transient."""
    from mlflow.exceptions import MlflowException

    status = None
    if isinstance(err, MlflowException):
        status = err.get_http_status_code()
    elif (response := getattr(err, "response", None)) is not None:  # requests.HTTPError (artifact uploads)
        status = getattr(response, "status_code", None)
    elif isinstance(err, FileNotFoundError | IsADirectoryError | NotADirectoryError):  # a local file to upload is gone
        return True
    return status is not None and 400 <= status < 500 and status not in (408, 429)


def is_connection_error(err: BaseException) -> bool:
    """Whether the server was not reached at all (refused, reset, timed out), looking through MLflow's
    wrapping of the underlying exception. Such failures say nothing about the call itself."""
    import requests

    seen: BaseException | None = err
    for _ in range(8):  # the chain of causes is short; bound it anyway
        if seen is None:
            return False
        if isinstance(seen, ConnectionError | TimeoutError | requests.ConnectionError | requests.Timeout):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def dataset_inputs(datasets: dict[str, dict]) -> list:
    """MLflow `DatasetInput`s for a stage's datasets (`trainer.data.sources.describe_datasets`'s dict: split ->
    path, fingerprint, rows, counts): name = the path's last part, digest = the fingerprint, source =
    the path, profile = rows and counts, context tag = the split ("train", "eval")."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    inputs = []
    for split, info in datasets.items():
        if not isinstance(info, dict):
            continue
        path = redact_uri(str(info.get("path") or split))
        digest = str(info.get("fingerprint") or "")
        if not digest:  # a dataset without a fingerprint is identified by what we know of it
            digest = hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()
        if path == "demo" or path.startswith("demo:"):
            source_type = "builtin"  # alignflow's packaged demo data
        elif path.startswith(("s3://", "http://", "https://")):
            source_type = path.split(":", 1)[0].removesuffix("s")
        else:
            source_type = "local" if path.startswith(("/", ".", "file:")) or Path(path).exists() else "hub"
        profile = {k: v for k, v in info.items() if k not in ("path", "fingerprint")}
        dataset = Dataset(name=path.rstrip("/").rsplit("/", 1)[-1][:500] or split, digest=digest[:_MAX_DIGEST],
                          source_type=source_type, source=json.dumps({"uri": path}),
                          profile=json.dumps(profile, default=str))
        inputs.append(DatasetInput(dataset, tags=[InputTag("mlflow.data.context", split)]))
    return inputs


@dataclasses.dataclass
class _Call:
    """A queued MLflow call. Metric calls carry their points so that later points can join the batch."""

    what: str
    fn: Callable[[], None]
    points: list | None = None
    attempts: int = 0


# ----------------------------------------------------------------------------------------------
# The tracker


class Tracker:
    """One stage's MLflow run plus the in-memory metric history.

    config: a `trainer.config.options.TrainConfig` (any dataclass with the ``mlflow_*`` fields and the
        ``tracking_uri`` / ``parent_run_id`` properties). No tracking URI: MLflow stays off.
    stage: the stage name, tagged as ``alignflow.stage``.
    run_id: resume this MLflow run (after a crash or restart) instead of starting one. Params
        it already has keep their values; params it lacks are added. When the run is still
        RUNNING, the process that wrote it died: tags ``alignflow.attempts`` and
        ``alignflow.attempt.<n>`` record that the earlier attempt ended KILLED.
    system_metrics: run MLflow's system-metrics monitor (``system/*``: CPU, memory, disk, network,
        GPU) while the run is open; ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=false`` turns it off.

    A child run (``config.parent_run_id`` set) goes into its parent's experiment, so that the
    MLflow UI nests it; ``config.mlflow_experiment`` names the experiment otherwise.

    ``run_id`` is None while no run exists (MLflow off, or the server unreachable so far: the
    start is queued like any other call). ``active`` is True while calls go straight through.
    """

    retry_min_s = 5.0  # first pause after a failure; doubles up to retry_max_s
    retry_max_s = 60.0
    finish_wait_s = float(os.environ.get("ALIGNFLOW_MLFLOW_FINISH_WAIT_S", "30"))
    max_attempts = 5  # a call that keeps failing while the server answers /health is dropped after this
    max_queued_points = 200_000  # past this, queued metric points are dropped (the backfill sends them)

    def __init__(self, config: Any, stage: str, run_id: str | None = None, system_metrics: bool = True) -> None:
        self.config = config
        self.stage = stage
        uri = config.tracking_uri
        self.tracking_uri: str | None = use_uri_credentials(uri) if uri else None
        self.run_id: str | None = None
        self.history: list[dict[str, Any]] = []
        self._client: Any = None
        self._queue: deque[_Call] = deque()
        self._queued_points = 0
        self._down_since: float | None = None  # monotonic start of the current outage
        self._next_retry = 0.0
        self._pause = self.retry_min_s
        self._outages = 0
        self._dropped_points = False
        self._resumed = run_id is not None
        self._warned: set[str] = set()
        self._system_metrics = system_metrics and os.environ.get(
            "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "").lower() not in ("false", "0")
        self._monitor: Any = None
        self._finished = False
        if self.tracking_uri is None:
            if not extras.available("mlflow"):
                logger.info("MLflow tracking is off (no tracking URI, and the mlflow extra is not installed); "
                            "metrics go to metrics.jsonl.")
            return
        mlflow = extras.require("mlflow", feature="MLflow tracking (a tracking URI is set)")
        cap_mlflow_http_retries()
        self._client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        if self._is_http and (why := unreachable_reason(self.tracking_uri)) is not None:
            self._queue.append(_Call("starting the run", lambda: self._start(run_id)))
            self._went_down("checking /health", why)
            return
        self._submit("starting the run", lambda: self._start(run_id))

    # --- the run -----------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True while a run exists and MLflow calls go straight through (nothing queued)."""
        return self._client is not None and self.run_id is not None and not self._queue

    @property
    def pending(self) -> int:
        """How many MLflow calls wait in the queue for the server to come back."""
        return len(self._queue)

    @property
    def _is_http(self) -> bool:
        return bool(self.tracking_uri) and self.tracking_uri.startswith(("http://", "https://"))

    def _start(self, resume_run_id: str | None) -> None:
        client = self._client
        params = flatten_params(dataclasses.asdict(self.config))
        if resume_run_id is not None:
            run = client.get_run(resume_run_id)
            attempt = int(run.data.tags.get("alignflow.attempts", "1")) + 1
            died = run.info.status == "RUNNING"
            client.set_tag(resume_run_id, f"alignflow.attempt.{attempt - 1}", "KILLED" if died else run.info.status)
            client.set_tag(resume_run_id, "alignflow.attempts", str(attempt))
            if died:
                logger.warning("MLflow run %s was still RUNNING: the process that wrote it died. Marked that "
                               "attempt KILLED (tag alignflow.attempt.%d) and continuing the run.",
                               resume_run_id, attempt - 1)
            client.update_run(resume_run_id, status="RUNNING")
            self.run_id = resume_run_id
            params = {k: v for k, v in params.items() if k not in run.data.params}
        else:
            parent = self.config.parent_run_id
            if parent:
                experiment_id = client.get_run(parent).info.experiment_id
            else:
                experiment_id = self._experiment_id(client, self.config.mlflow_experiment,
                                                    sqlite_artifact_location(self.tracking_uri))
            run_name = self.config.mlflow_run_name or f"{self.stage}-{time.strftime('%Y%m%d-%H%M%S')}"
            tags = self._tags()
            if parent:
                tags["mlflow.parentRunId"] = parent
            self.run_id = client.create_run(experiment_id, tags=tags, run_name=run_name).info.run_id
        # The params go first in the queue (before anything logged meanwhile): the run exists now,
        # and a failure from here on must not start a second run.
        for chunk in reversed(list(_chunks(sorted(params.items()), _PARAMS_PER_BATCH))):
            self._queue.appendleft(_Call("logging params", functools.partial(self._log_params, chunk)))
        self._start_system_metrics(resume=self._resumed)

    def _log_params(self, chunk: list[tuple[str, str]]) -> None:
        from mlflow.entities import Param

        self._client.log_batch(self.run_id, params=[Param(k, v) for k, v in chunk])

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
        tags.update({f"alignflow.{key}": value for key, value in container_image().items()})
        for tag in self.config.mlflow_tags:
            key, _, value = tag.partition("=")
            tags[key.strip()] = redact_uri(value)[:_MAX_TAG_VALUE]
        return tags

    def _start_system_metrics(self, resume: bool) -> None:
        if not self._system_metrics or self.run_id is None or self._finished:
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        if self._monitor is not None:  # after an outage its thread has stopped: a new one resumes the steps
            self._monitor.finish()
        self._monitor = SystemMetricsMonitor(self.run_id, resume_logging=resume, tracking_uri=self.tracking_uri)
        self._monitor.start()

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with ``status`` (FINISHED, FAILED or KILLED); later calls do nothing.

        Queued calls get up to `finish_wait_s` for the server to come back; then, if this run saw
        an outage, dropped queued points or was resumed, the metric points of `history` that the
        server lacks are sent (the backfill); then the run is ended."""
        if self._finished:
            return
        self._finished = True
        if self._client is None:
            return
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None
        # A server never reached gets one last try, without waiting (it is likely misconfigured).
        self.flush(wait_s=self.finish_wait_s if self.run_id is not None else 0.0)
        if self.run_id is not None and not self._queue:
            if self._outages or self._dropped_points or self._resumed:
                self._submit("backfilling metrics", self._backfill)
            self._submit("ending the run", functools.partial(self._client.set_terminated, self.run_id, status))
            if self._queue:
                self.flush(wait_s=self.finish_wait_s)
        if self.run_id is not None and self._queue:
            self._warn_once("finish", "MLflow run %s of this %s stage stays incomplete: %d calls could not be sent "
                            "to %s. metrics.jsonl holds every metric; the pipeline's finish task marks the run KILLED.",
                            self.run_id, self.stage, len(self._queue), self.tracking_uri)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: Any) -> None:
        if exc_type is None:
            self.finish("FINISHED")
        else:
            self.finish("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")

    # --- logging -----------------------------------------------------------------------------

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at ``step`` in `history`, and in MLflow (queued while it is down).

        Values go through ``float()`` (0-d tensors and numpy scalars work); None values are
        dropped. Keys MLflow rejects are sanitised there (see `mlflow_key`), kept in history."""
        record = {k: float(v) for k, v in metrics.items() if v is not None}
        self.history.append({"step": int(step), **record})
        if self._client is None or not record:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = [Metric(mlflow_key(k), v, now, int(step)) for k, v in record.items()]
        last = self._queue[-1] if self._queue else None
        if last is not None and last.points is not None and len(last.points) < _METRICS_PER_BATCH:
            last.points.extend(points)  # joins the batch waiting in the queue
            self._queued_points += len(points)
            self._trim_queued_points()
            self._maybe_retry()
            return
        self._submit("logging metrics", functools.partial(self._send_points, points), points=points)

    def _send_points(self, points: list) -> None:
        for chunk in _chunks(points, _METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=chunk, synchronous=True)

    def log_datasets(self, datasets: dict[str, dict]) -> None:
        """Record the stage's datasets as run inputs (`dataset_inputs`): the MLflow UI lists them with
        their fingerprints as digests. `datasets` is `trainer.data.sources.describe_datasets`'s dict."""
        if self._client is not None and (inputs := dataset_inputs(datasets)):
            self._submit("logging datasets", lambda: self._client.log_inputs(self.run_id, datasets=inputs))

    def log_text(self, text: str, artifact_file: str) -> None:
        if self._client is not None:
            self._submit(f"logging {artifact_file}", lambda: self._client.log_text(self.run_id, text, artifact_file))

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:
        """A table of columns (e.g. prompts and sampled completions); ``artifact_file`` ends in
        ``.json``. Logging to the same file again appends rows, as MLflow does."""
        if self._client is not None:
            data = copy.deepcopy(data)
            self._submit(f"logging {artifact_file}",
                         lambda: self._client.log_table(self.run_id, data=data, artifact_file=artifact_file))

    def log_dict(self, d: dict, artifact_file: str) -> None:
        if self._client is not None:
            d = redact_secrets(copy.deepcopy(d))
            self._submit(f"logging {artifact_file}", lambda: self._client.log_dict(self.run_id, d, artifact_file))

    def log_params(self, params: dict[str, Any]) -> None:
        """Add params to the run (ones it already has keep their values, as on resume); values become
        strings, with credentials in URIs redacted. Queued like any call while MLflow is down."""
        if self._client is None or not params:
            return
        flat = {mlflow_key(k): redact_uri(str(v))[:_MAX_PARAM_VALUE] for k, v in params.items()}

        def send() -> None:
            from mlflow.entities import Param

            have = self._client.get_run(self.run_id).data.params
            fresh = [Param(k, v) for k, v in sorted(flat.items()) if k not in have]
            for chunk in _chunks(fresh, _PARAMS_PER_BATCH):
                self._client.log_batch(self.run_id, params=chunk)

        self._submit("logging params", send)

    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        if self._client is not None:
            self._submit(f"uploading {local_dir}",
                         lambda: self._client.log_artifacts(self.run_id, local_dir, artifact_path))

    def log_checkpoint(self, local_dir: str, artifact_path: str = "checkpoint") -> None:
        """Upload a checkpoint folder when ``config.mlflow_log_checkpoint`` asks for it."""
        if self.config.mlflow_log_checkpoint:
            self.log_artifacts(local_dir, artifact_path)

    # --- the queue ---------------------------------------------------------------------------

    def _submit(self, what: str, fn: Callable[[], None], points: list | None = None) -> None:
        """Run an MLflow call now, or queue it behind earlier ones that are waiting for the server."""
        self._queue.append(_Call(what, fn, points))
        if points is not None:
            self._queued_points += len(points)
        if self._down_since is None:
            self.flush()
        else:
            self._trim_queued_points()
            self._maybe_retry()

    def _maybe_retry(self) -> None:
        if self._down_since is not None and time.monotonic() >= self._next_retry:
            self.flush()

    def flush(self, wait_s: float = 0.0) -> bool:
        """Send the queued calls in order; True when the queue is empty. With `wait_s`, keep retrying
        (with the usual pauses) for up to that many seconds while the server is down."""
        deadline = time.monotonic() + wait_s
        while True:
            if self._flush_once():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(max(0.05, min(self._next_retry, deadline) - time.monotonic()))

    def _flush_once(self) -> bool:
        if self._client is None:
            self._queue.clear()
            return True
        reached = False
        if self._down_since is not None and self._is_http:
            if (why := unreachable_reason(self.tracking_uri)) is not None:
                self._went_down("checking /health", why)
                return False
            reached = True
        while self._queue:
            call = self._queue.popleft()
            try:
                call.fn()
            except Exception as err:  # whatever MLflow raises, training goes on
                why = redact_uri(f"{type(err).__name__}: {str(err)[:500]}")
                if call.what == "starting the run" and is_permanent(err):
                    self._disable(call.what, why)
                    return True
                # A call that keeps failing although the server answers is dropped after a few tries.
                call.attempts += 0 if is_connection_error(err) else 1
                if is_permanent(err) or call.attempts >= self.max_attempts:
                    self._drop(call, why)
                    continue
                self._queue.appendleft(call)
                self._went_down(call.what, why)
                return False
            reached = True
            if call.points is not None:
                self._queued_points -= len(call.points)
        if self._down_since is not None and reached:
            logger.warning("MLflow at %s is back after %.0f s; the queued calls of this %s run were sent.",
                           self.tracking_uri, time.monotonic() - self._down_since, self.stage)
            self._down_since = None
            self._pause = self.retry_min_s
            if self._monitor is not None and not self._finished:
                self._start_system_metrics(resume=True)
        return True

    def _went_down(self, what: str, why: str) -> None:
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            self._outages += 1
            self._pause = self.retry_min_s
            logger.warning(
                "MLflow at %s is unavailable (%s: %s). Calls of this %s run are queued and retried (first in "
                "%.0f s); metrics keep going to metrics.jsonl and are backfilled at the end.",
                self.tracking_uri, what, why, self.stage, self._pause)
        else:
            self._pause = min(self._pause * 2, self.retry_max_s)
        self._next_retry = now + self._pause

    def _drop(self, call: _Call, why: str) -> None:
        if call.points is not None:
            self._queued_points -= len(call.points)
            self._dropped_points = True  # the backfill sends them
        self._warn_once(call.what, "MLflow refused %s for run %s (%s); skipped it (metrics are backfilled from "
                        "metrics.jsonl at the end).", call.what, self.run_id, why)

    def _trim_queued_points(self) -> None:
        """Bound the memory a long outage takes: the oldest queued metric batches go (history keeps them)."""
        while self._queued_points > self.max_queued_points:
            batch = next((c for c in self._queue if c.points is not None), None)
            if batch is None:
                return
            self._queue.remove(batch)
            self._queued_points -= len(batch.points)
            self._dropped_points = True

    def _disable(self, what: str, why: str) -> None:
        self._client = None
        self._queue.clear()
        logger.warning("MLflow at %s refused %s (%s). MLflow logging is off for the rest of this %s run; "
                       "metrics keep going to metrics.jsonl.", self.tracking_uri, what, why, self.stage)

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    # --- backfill ----------------------------------------------------------------------------

    def _backfill(self) -> None:
        """Send every (metric, step) of `history` that the run lacks on the server."""
        from mlflow.entities import Metric

        wanted: dict[str, dict[int, float]] = {}
        for record in self.history:
            for key, value in record.items():
                if key != "step":
                    wanted.setdefault(mlflow_key(key), {}).setdefault(int(record["step"]), value)
        now = int(time.time() * 1000)
        missing = []
        for key, points in wanted.items():
            have = {m.step for m in self._client.get_metric_history(self.run_id, key)}
            missing += [Metric(key, value, now, step) for step, value in points.items() if step not in have]
        if missing:
            self._send_points(missing)
            logger.info("Backfilled %d metric points of MLflow run %s from the metrics history.",
                        len(missing), self.run_id)
