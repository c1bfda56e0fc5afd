"""Gated promotion in the MLflow model registry: register a checkpoint, move `@champion` only when it wins.

One registered model per product line (e.g. ``alignflow-policy``); each promotion attempt adds a
version whose tags carry its metrics, dataset fingerprints and base model. The version is an MLflow 3
transformers-flavour model (a LoggedModel of the promote run, source ``models:/<model id>``; see
`trainer.stages.mlflow_model`), so ``mlflow.pyfunc.load_model("models:/NAME@champion")`` serves it; a
checkpoint that holds no full causal LM (a LoRA adapter without a merged copy, a reward model) is
registered as its plain files (source ``runs:/<run>/checkpoint``). Two aliases (MLflow's replacement
for the deprecated stages) mark the state:

    champion            the version serving / the baseline of the next evaluation
    previous-champion   the champion it replaced; `rollback` swaps the two back

The gate: the candidate's ``metrics[gate_metric]`` must beat the champion's stored value of the
same metric (the ``alignflow.metric.<name>`` tag written when the champion was registered) by
more than ``min_improvement`` (in the better direction). The direction (`gate_direction`) is known for
the metrics alignflow logs (loss and KL: lower is better; rewards, accuracy, win rate, reward-model
score: higher); any other metric needs ``gate_mode`` ``max`` or ``min``, and a gate that cannot tell
is refused before anything is registered. A candidate that loses is still
registered, tagged with the decision, so every evaluated model stays in the registry's history.
The first version of a model always becomes champion.

Promotion is all-or-nothing in what it claims: a version that passes the gate is registered with
``alignflow.promotion.promoted=pending``; the tag becomes ``true`` only after `@champion` has moved,
and ``false`` (with ``alignflow.promotion.error``) when the alias call fails — then the aliases are
put back and `promote` raises a one-line `RegistryError`.

Every call takes an explicit tracking URI (else ``MLFLOW_TRACKING_URI``) and an http(s) server is
checked with a short ``/health`` probe before anything is written, so an unreachable server is a
clear error in seconds rather than minutes of MLflow's client retries. Registry versions come
back as strings through a server and as ints from an embedded sqlite store: this module returns
strings everywhere. Two promotions of the same model at the same moment can race on the aliases
(MLflow has no compare-and-set); pipelines run one promote step at a time.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.engine import checkpoint as ckpt
from trainer.engine.models import resolve_model_path
from trainer.errors import RegistryError
from trainer.extras import require
from trainer.stages.mlflow_model import checkpoint_folder, log_checkpoint_model
from trainer.tracking.gate import gate_direction
from trainer.tracking.provenance import redact_uri
from trainer.tracking.tracker import (
    cap_mlflow_http_retries,
    sqlite_artifact_location,
    unreachable_reason,
    use_uri_credentials,
)

log = logging.getLogger(__name__)

CHAMPION = "champion"
PREVIOUS_CHAMPION = "previous-champion"
CHECKPOINT_ARTIFACT = "checkpoint"  # artifact folder of the run holding the checkpoint's files
METRIC_TAG = "alignflow.metric."  # version tag prefix: one tag per metric
PROMOTED_TAG = "alignflow.promotion.promoted"  # "true" only once @champion points at the version
_SKIPPED_DIRS = (ckpt.STATE_DIR,)  # optimizer states are not part of a served model


@dataclass(frozen=True)
class PromotionResult:
    """What `promote` (or `rollback`) did. Versions are strings; None where there is no champion."""

    version: str  # the version registered (for rollback: the version that is champion now)
    promoted: bool  # whether `@champion` moved to `version`
    reason: str  # the gate's verdict in words (metric values and threshold)
    champion_before: str | None
    champion_after: str | None


# ----------------------------------------------------------------------------------------------
# Connection


def resolve_tracking_uri(tracking_uri: str | None = None) -> str:
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise RegistryError("No MLflow tracking URI: set MLFLOW_TRACKING_URI (e.g. http://mlflow:5000, or "
                            "sqlite:///mlflow.db for an embedded registry) or pass --tracking-uri.")
    return uri


def connect(tracking_uri: str | None = None):
    """An `MlflowClient` for the registry at `tracking_uri`, after checking that an http(s) server answers."""
    MlflowClient = require("mlflow", feature="The MLflow model registry").MlflowClient  # noqa: N806

    uri = use_uri_credentials(resolve_tracking_uri(tracking_uri))  # user:password@ -> MLflow's auth variables
    cap_mlflow_http_retries()
    if uri.startswith(("http://", "https://")) and (why := unreachable_reason(uri)) is not None:
        raise RegistryError(f"The MLflow tracking server at {redact_uri(uri)} cannot be reached ({why}); nothing was "
                            "registered. Start the server, or set MLFLOW_TRACKING_URI (or --tracking-uri) to one "
                            "that answers /health.")
    sqlite_artifact_location(uri)  # creates the folder of an embedded sqlite store
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _aliases(client, model_name: str) -> dict[str, str]:
    """The model's aliases as {alias: version}; {} when the model is not registered yet."""
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_registered_model(model_name)
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return {}
        raise
    return {alias: str(version) for alias, version in model.aliases.items()}


def _ensure_registered_model(client, model_name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(model_name, tags={"alignflow.managed": "true"})
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


# ----------------------------------------------------------------------------------------------
# Registering


def _local_checkpoint(checkpoint_dir: str) -> Path:
    """A complete local checkpoint folder (s3:// prefixes are downloaded), or a RegistryError."""
    try:
        local = Path(resolve_model_path(checkpoint_dir))
    except (ValueError, OSError) as err:
        raise RegistryError(f"Cannot register {checkpoint_dir!r}: {err}") from err
    if not local.is_dir():
        raise RegistryError(f"Checkpoint folder {checkpoint_dir!r} does not exist.")
    return local


def metric_tags(metrics: dict[str, float]) -> dict[str, str]:
    return {f"{METRIC_TAG}{name}": repr(float(value)) for name, value in metrics.items()}


def manifest_tags(manifest: dict[str, Any]) -> dict[str, str]:
    """Lineage from a checkpoint's alignflow.json: stage, base model, git sha, image, dataset fingerprints."""
    tags = {f"alignflow.{key}": str(manifest[key]) for key in ("stage", "base_model", "git_sha",
                                                                            "image", "image_digest")
            if manifest.get(key)}
    for split, info in (manifest.get("datasets") or {}).items():
        for key in ("path", "fingerprint", "rows"):
            if isinstance(info, dict) and info.get(key) not in (None, ""):
                tags[f"alignflow.dataset.{split}.{key}"] = str(info[key])
    return tags


def _experiment_id(client, name: str) -> str:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name, artifact_location=sqlite_artifact_location(client.tracking_uri))
    except MlflowException:  # created by a parallel step in the meantime
        return client.get_experiment_by_name(name).experiment_id


def _log_checkpoint_files(client, run_id: str, local: Path) -> None:
    for path in sorted(local.rglob("*")):
        rel = path.relative_to(local)
        if path.is_file() and rel.parts[0] not in _SKIPPED_DIRS:
            parent = rel.parent.as_posix()
            client.log_artifact(run_id, str(path), CHECKPOINT_ARTIFACT + ("" if parent == "." else f"/{parent}"))


@contextlib.contextmanager
def _global_tracking_uri(uri: str) -> Iterator[None]:
    """An embedded (sqlite) registry looks a ``models:/<id>`` source up through MLflow's *global* tracking
    URI when it creates a version (a server uses its own store): point that at `uri` meanwhile."""
    if uri.startswith(("http://", "https://")):
        yield
        return
    import mlflow
    from mlflow.tracking._tracking_service import utils as tracking_utils

    old_global, old_env = tracking_utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(old_global)  # None also unsets the variable: put the user's back
        if old_env is not None:
            os.environ["MLFLOW_TRACKING_URI"] = old_env


def _download_logged_checkpoint(client, run_id: str, dest: str) -> Path:
    """The checkpoint a stage run logged as its ``checkpoint/`` artifacts, downloaded into `dest`."""
    names = {Path(a.path).name for a in client.list_artifacts(run_id, CHECKPOINT_ARTIFACT)}
    if "config.json" not in names and "adapter_config.json" not in names:
        raise RegistryError(f"Run {run_id} has no checkpoint in its `{CHECKPOINT_ARTIFACT}/` artifacts (no "
                            "config.json). Train with --mlflow_log_checkpoint true, or pass --checkpoint DIR.")
    return Path(client.download_artifacts(run_id, CHECKPOINT_ARTIFACT, dest))


def register_checkpoint(model_name: str, checkpoint_dir: str | None, metrics: dict[str, float],
                        tags: dict[str, str] | None = None, run_id: str | None = None,
                        tracking_uri: str | None = None, experiment: str = "alignflow",
                        parent_run_id: str | None = None) -> str:
    """Register a checkpoint as a new version of `model_name`; returns the version (a string).

    checkpoint_dir: a complete checkpoint folder or s3:// prefix, logged as an MLflow transformers
        model of `run_id`, or of a new "promote" run in `experiment`. None: `run_id`'s ``checkpoint/``
        artifacts (a stage run with ``mlflow_log_checkpoint``) are downloaded and logged that way.
    metrics: stored as version tags ``alignflow.metric.<name>`` (the gate reads them back) and logged
        to a newly created run.
    tags: extra version tags; lineage tags (stage, base model, dataset fingerprints from the manifest,
        source and pipeline run ids) are added.
    parent_run_id: the pipeline's MLflow parent run, under which a new promote run is nested
        (default: MLFLOW_PARENT_RUN_ID).
    """
    if checkpoint_dir is None and run_id is None:
        raise RegistryError("Give a checkpoint folder, or the id of a run whose artifacts hold one.")
    client = connect(tracking_uri)
    local = _local_checkpoint(checkpoint_dir) if checkpoint_dir is not None else None
    return _register(client, model_name, local, metrics, tags, run_id, experiment, parent_run_id)


def _register(client, model_name: str, local: Path | None, metrics: dict[str, float], tags: dict[str, str] | None,
              run_id: str | None, experiment: str, parent_run_id: str | None = None) -> str:
    parent = parent_run_id or os.environ.get("MLFLOW_PARENT_RUN_ID") or None
    if run_id is None:
        from mlflow.entities import Metric

        run_tags = {"alignflow.stage": "promote", "alignflow.registered_model": model_name}
        if parent:
            run_tags["mlflow.parentRunId"] = parent
        experiment_id = client.get_run(parent).info.experiment_id if parent else _experiment_id(client, experiment)
        run_id = client.create_run(experiment_id, tags=run_tags, run_name=f"promote-{model_name}").info.run_id
        finite = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        if finite:
            client.log_batch(run_id, metrics=[Metric(k, v, 0, 0) for k, v in finite.items()], synchronous=True)
        created = True
    else:
        parent = client.get_run(run_id).data.tags.get("mlflow.parentRunId") or parent
        created = False
    try:
        with tempfile.TemporaryDirectory(prefix="alignflow-register-") as tmp:
            logged_files = local is None  # the run's checkpoint/ artifacts already hold the files
            if local is None:
                local = _download_logged_checkpoint(client, run_id, tmp)
            manifest_path = local / ckpt.MANIFEST
            manifest = ckpt.read_json(str(manifest_path)) if manifest_path.exists() else {}
            model_id = log_checkpoint_model(client, run_id, local, model_name)
            if model_id is None:
                log.warning("%s holds no full causal LM (a LoRA adapter without merged/, or not a causal LM): "
                            "registering its files; mlflow.pyfunc cannot load this version (save LoRA "
                            "checkpoints with lora_merge_on_save to make them servable).", local)
                if not logged_files:
                    _log_checkpoint_files(client, run_id, local)
                source, fmt = f"runs:/{run_id}/{CHECKPOINT_ARTIFACT}", "checkpoint-files"
            else:
                source, fmt = f"models:/{model_id}", "mlflow-transformers"
            version_tags = {**manifest_tags(manifest), **metric_tags(metrics), "alignflow.source_run_id": run_id,
                            "alignflow.model_format": fmt}
            if parent:
                version_tags["alignflow.pipeline_run_id"] = parent
            version_tags.update(tags or {})
            _ensure_registered_model(client, model_name)
            with _global_tracking_uri(client.tracking_uri):
                version = client.create_model_version(model_name, source, run_id=run_id, tags=version_tags,
                                                      model_id=model_id).version
    except BaseException:
        if created:
            client.set_terminated(run_id, "FAILED")
        raise
    if created:
        client.set_terminated(run_id, "FINISHED")
    log.info("Registered %s version %s from run %s (%s).", model_name, version, run_id, source)
    return str(version)


# ----------------------------------------------------------------------------------------------
# The gate


def _stored_metric(client, model_name: str, version: str, metric: str) -> float | None:
    value = client.get_model_version(model_name, version).tags.get(METRIC_TAG + metric)
    return float(value) if value is not None else None


def gate(candidate: float, champion: float | None, metric: str, min_improvement: float,
         higher_is_better: bool) -> tuple[bool, str]:
    """Whether `candidate` beats `champion` by more than `min_improvement`, and why (in words)."""
    if champion is None:
        return True, f"no champion yet: {metric}={candidate:.6g} becomes the first champion"
    improvement = candidate - champion if higher_is_better else champion - candidate
    direction = "higher" if higher_is_better else "lower"
    verdict = "passes" if improvement > min_improvement else "fails"
    return improvement > min_improvement, (
        f"gate {verdict}: {metric}={candidate:.6g} vs champion {champion:.6g} ({direction} is better; "
        f"improvement {improvement:+.6g} must exceed min_improvement={min_improvement:g})")


def _check_gate(client, model_name: str, candidate: float, gate_metric: str, min_improvement: float,
                higher_is_better: bool) -> tuple[bool, str, str | None]:
    """(passed, reason, champion version) for a candidate's value of the gate metric."""
    before = _aliases(client, model_name).get(CHAMPION)
    champion_value = _stored_metric(client, model_name, before, gate_metric) if before else None
    if before is not None and champion_value is None:
        return False, (f"gate cannot compare: champion version {before} has no stored `{gate_metric}`; "
                       "re-evaluate it, pick another --gate-metric, or promote with --force"), before
    return (*gate(candidate, champion_value, gate_metric, min_improvement, higher_is_better), before)


def check_gate(model_name: str, metrics: dict[str, float], gate_metric: str = "reward", min_improvement: float = 0.0,
               gate_mode: str = "auto", tracking_uri: str | None = None) -> tuple[bool, str]:
    """Whether a candidate with `metrics` would become champion, and why; registers nothing."""
    higher_is_better = gate_direction(gate_metric, gate_mode)
    if gate_metric not in metrics or not math.isfinite(float(metrics[gate_metric])):
        return False, f"gate metric `{gate_metric}` missing or not finite in {sorted(metrics)}"
    passed, reason, _ = _check_gate(connect(tracking_uri), model_name, float(metrics[gate_metric]), gate_metric,
                                    min_improvement, higher_is_better)
    return passed, reason


def promote(model_name: str, checkpoint_dir: str | None, metrics: dict[str, float], gate_metric: str = "reward",
            min_improvement: float = 0.0, gate_mode: str = "auto", tags: dict[str, str] | None = None,
            tracking_uri: str | None = None, run_id: str | None = None, force: bool = False,
            experiment: str = "alignflow", parent_run_id: str | None = None) -> PromotionResult:
    """Register `checkpoint_dir` as a new version and make it `@champion` if it beats the current one.

    The gate compares ``metrics[gate_metric]`` with the champion's stored value (see module doc), in the
    direction `gate_mode` gives (`gate_direction`);
    the replaced champion gets the alias ``previous-champion``. `force` skips the gate (e.g. when
    the champion has no stored value of a newly chosen gate metric). Everything that can be checked
    (server, metric, checkpoint folder) is checked before anything is written. `parent_run_id` nests
    the promote run under the pipeline's run (default: MLFLOW_PARENT_RUN_ID).

    Raises `RegistryError` when the version was registered but `@champion` could not be moved: the
    version is then tagged ``promoted=false`` with the error, and the aliases are as before.
    """
    higher_is_better = gate_direction(gate_metric, gate_mode)
    if gate_metric not in metrics:
        raise RegistryError(f"Gate metric `{gate_metric}` is not among the candidate's metrics "
                            f"({', '.join(sorted(metrics)) or 'none'}); pick one with --gate-metric.")
    candidate = float(metrics[gate_metric])
    if not math.isfinite(candidate):
        raise RegistryError(f"Gate metric `{gate_metric}` is {candidate}; the evaluation produced no usable value.")
    if checkpoint_dir is None and run_id is None:
        raise RegistryError("Give a checkpoint folder, or the id of a run whose artifacts hold one.")
    client = connect(tracking_uri)
    local = _local_checkpoint(checkpoint_dir) if checkpoint_dir is not None else None
    if force:
        before = _aliases(client, model_name).get(CHAMPION)
        passed, reason = True, f"forced: {gate_metric}={candidate:.6g}, gate skipped"
    else:
        passed, reason, before = _check_gate(client, model_name, candidate, gate_metric, min_improvement,
                                             higher_is_better)

    decision = {"alignflow.promotion.gate_metric": gate_metric, "alignflow.promotion.reason": reason[:5000],
                PROMOTED_TAG: "pending" if passed else "false"}
    version = _register(client, model_name, local, metrics, {**(tags or {}), **decision}, run_id, experiment,
                        parent_run_id)
    after = before
    if passed:
        with promotion_lock(client, model_name):
            # Compare-and-set: another promotion may have moved @champion since the gate looked.
            current = _aliases(client, model_name).get(CHAMPION)
            if current != before:
                if force:
                    before = current
                else:
                    passed, again, before = _check_gate(client, model_name, candidate, gate_metric, min_improvement,
                                                        higher_is_better)
                    reason = (f"@{CHAMPION} moved from {after} to {current} while this candidate was checked; "
                              f"against {current}: {again}")
                    client.set_model_version_tag(model_name, version, "alignflow.promotion.reason", reason[:5000])
                    if not passed:
                        client.set_model_version_tag(model_name, version, PROMOTED_TAG, "false")
                after = before
            if passed:
                _move_champion(client, model_name, version, before)
                after = version
                try:
                    client.set_model_version_tag(model_name, version, PROMOTED_TAG, "true")
                except Exception as err:  # the alias did move: report success, but say the tag lags
                    log.warning("%s v%s is champion, but its %s tag could not be set to true (%s); it reads "
                                "'pending'.", model_name, version, PROMOTED_TAG, redact_uri(str(err))[:300])
    log.info("%s v%s: %s; champion %s -> %s.", model_name, version, reason, before, after)
    return PromotionResult(version, passed, reason, before, after)


# ----------------------------------------------------------------------------------------------
# One promotion of a model at a time

LOCK_SUFFIX = ".alignflow-promotion-lock"
LOCK_SINCE_TAG = "alignflow.lock.since"
LOCK_WAIT_S = 120.0  # how long a promotion waits for another one of the same model
LOCK_STALE_S = 600.0  # a lock older than this was left by a promoter that died: it is broken


@contextlib.contextmanager
def promotion_lock(client, model_name: str, wait_s: float = LOCK_WAIT_S, stale_s: float = LOCK_STALE_S
                   ) -> Iterator[None]:
    """Hold the promotion lock of `model_name` for the duration: moving `@champion` (and the gate's last look
    at it) happens in one process at a time, on any machine.

    The lock is a registered model named `<model_name>.alignflow-promotion-lock`, which exists while held: the
    tracking server's store creates a name once, so of two promoters exactly one creates it, and the other waits
    (up to `wait_s`) until it is deleted. A lock older than `stale_s` belongs to a promoter that died; it is
    broken with a warning."""
    from mlflow.exceptions import MlflowException

    name = model_name + LOCK_SUFFIX
    holder = f"{socket.gethostname()}:{os.getpid()}"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.create_registered_model(name, tags={LOCK_SINCE_TAG: f"{time.time():.3f}", "alignflow.lock.holder": holder},
                                           description=f"Held while alignflow promotes a version of {model_name}; "
                                                       "deleted when it is done.")
            break
        except MlflowException as err:
            # (RESOURCE_DOES_NOT_EXIST: the server created the name, then found it gone before it set the tags)
            if err.error_code not in ("RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST"):
                raise
        try:
            held = client.get_registered_model(name)
        except MlflowException:
            continue  # released in between: try again at once
        # Its age from the server's creation time: the server sets the tags after it creates the name, so a lock
        # being taken right now may not have them yet (read as age 0, it was broken as stale from under its holder).
        since = held.creation_timestamp / 1000 if held.creation_timestamp else float(held.tags.get(LOCK_SINCE_TAG) or 0)
        if time.time() - since > stale_s:
            log.warning("Breaking the promotion lock of %s held by %s since %s (older than %.0f s: its promoter "
                        "died).", model_name, held.tags.get("alignflow.lock.holder", "?"),
                        time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(since)), stale_s)
            with contextlib.suppress(MlflowException):
                client.delete_registered_model(name)
            continue
        if time.monotonic() > deadline:
            raise RegistryError(f"Another promotion of {model_name} has held its lock (registered model {name}, "
                                f"holder {held.tags.get('alignflow.lock.holder', '?')}) for over {wait_s:.0f} s; "
                                f"try again later, or delete {name} if no promotion is running.")
        time.sleep(0.05 + 0.15 * random.random())
    try:
        yield
    finally:
        try:
            client.delete_registered_model(name)
        except Exception as err:  # it goes stale and is broken after `stale_s`
            log.warning("Could not release the promotion lock %s (%s); the next promotion breaks it after %.0f s.",
                        name, redact_uri(str(err))[:300], stale_s)


def _set_alias(client, model_name: str, alias: str, version: str | None) -> None:
    if version is None:
        client.delete_registered_model_alias(model_name, alias)
    else:
        client.set_registered_model_alias(model_name, alias, version)


def _move_champion(client, model_name: str, version: str, before: str | None) -> None:
    """`@previous-champion` -> `before`, then `@champion` -> `version`; on failure put both back, tag the
    version ``promoted=false`` with the error, and raise a one-line RegistryError."""
    previous_before = _aliases(client, model_name).get(PREVIOUS_CHAMPION)
    moved_previous = False
    try:
        if before is not None and before != version:
            client.set_registered_model_alias(model_name, PREVIOUS_CHAMPION, before)
            moved_previous = True
        client.set_registered_model_alias(model_name, CHAMPION, version)
    except Exception as err:
        why = redact_uri(f"{type(err).__name__}: {err}").replace("\n", " ")[:300]
        notes = []
        if moved_previous:
            try:
                _set_alias(client, model_name, PREVIOUS_CHAMPION, previous_before)
            except Exception:
                notes.append(f"@{PREVIOUS_CHAMPION} could not be put back to {previous_before}")
        try:
            client.set_model_version_tag(model_name, version, PROMOTED_TAG, "false")
            client.set_model_version_tag(model_name, version, "alignflow.promotion.error", why)
            marked = f"version {version} is tagged {PROMOTED_TAG}=false"
        except Exception:
            marked = f"version {version} still reads {PROMOTED_TAG}=pending"
        raise RegistryError(f"Registered {model_name} version {version}, but moving @{CHAMPION} failed ({why}); "
                            f"@{CHAMPION} stays {before}; {marked}" + "".join(f"; {n}" for n in notes)
                            + ".") from err


def rollback(model_name: str, tracking_uri: str | None = None) -> PromotionResult:
    """Swap `@champion` and `@previous-champion` (a second rollback undoes the first)."""
    client = connect(tracking_uri)
    with promotion_lock(client, model_name):
        return _rollback(client, model_name)


def _rollback(client, model_name: str) -> PromotionResult:
    aliases = _aliases(client, model_name)
    current, previous = aliases.get(CHAMPION), aliases.get(PREVIOUS_CHAMPION)
    if current is None or previous is None:
        raise RegistryError(f"Cannot roll back {model_name!r}: it needs both @{CHAMPION} and @{PREVIOUS_CHAMPION} "
                            f"aliases, and has {aliases or 'none'}.")
    client.set_registered_model_alias(model_name, CHAMPION, previous)
    try:
        client.set_registered_model_alias(model_name, PREVIOUS_CHAMPION, current)
    except Exception as err:
        client.set_registered_model_alias(model_name, CHAMPION, current)
        raise RegistryError(f"Rollback of {model_name} failed ({redact_uri(str(err))[:300]}); "
                            f"@{CHAMPION} stays {current}.") from err
    reason = f"rolled back: champion {current} -> {previous} ({current} is now {PREVIOUS_CHAMPION})"
    log.info("%s: %s.", model_name, reason)
    return PromotionResult(previous, True, reason, current, previous)


# ----------------------------------------------------------------------------------------------
# Reading


def run_metrics(run_id: str, tracking_uri: str | None = None) -> dict[str, float]:
    """The latest value of each metric of a run (the candidate's metrics for ``promote --run``)."""
    return dict(connect(tracking_uri).get_run(run_id).data.metrics)


def champion_uri(model_name: str, tracking_uri: str | None = None) -> str | None:
    """``models:/<name>@champion`` when the model has a champion, else None (the first pipeline run)."""
    client = connect(tracking_uri)
    return f"models:/{model_name}@{CHAMPION}" if CHAMPION in _aliases(client, model_name) else None


def download_model(model_uri: str, dest: str, tracking_uri: str | None = None) -> str:
    """Download ``models:/<name>@<alias>`` or ``models:/<name>/<version>`` into `dest`; returns the checkpoint
    folder (for an MLflow transformers model, its ``model/`` folder)."""
    from mlflow.exceptions import MlflowException

    if not model_uri.startswith("models:/"):
        raise RegistryError(f"{model_uri!r} is not a models:/<name>@<alias> or models:/<name>/<version> URI.")
    client = connect(tracking_uri)
    ref = model_uri[len("models:/"):]
    try:
        if "@" in ref:
            name, alias = ref.split("@", 1)
            version = client.get_model_version_by_alias(name, alias)
        else:
            name, _, number = ref.rpartition("/")
            version = client.get_model_version(name, number)
    except MlflowException as err:
        raise RegistryError(f"{model_uri} is not in the registry at {client.tracking_uri}: {err.message}") from err
    Path(dest).mkdir(parents=True, exist_ok=True)
    source = version.source
    if source.startswith("runs:/"):
        run_id, _, path = source[len("runs:/"):].partition("/")
        return checkpoint_folder(client.download_artifacts(run_id, path or CHECKPOINT_ARTIFACT, dest))
    import mlflow.artifacts

    if source.startswith("models:/m-"):  # a LoggedModel: resolved with this client, not MLflow's global URI
        source = client.get_logged_model(source[len("models:/"):]).artifact_location
    # An MLflow transformers model: the checkpoint is its model/ folder.
    return checkpoint_folder(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=dest,
                                                                 tracking_uri=client.tracking_uri))


def download_champion(model_name: str, dest: str, tracking_uri: str | None = None) -> str | None:
    """Download the current champion's checkpoint into `dest`; None when there is no champion."""
    if champion_uri(model_name, tracking_uri) is None:
        return None
    return download_model(f"models:/{model_name}@{CHAMPION}", dest, tracking_uri)
