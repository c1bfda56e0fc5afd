"""Submit a multi-node training job (Kubeflow Trainer `TrainJob` or Training Operator `PyTorchJob`),
stream its rank-0 pod's log, and wait for its outcome; `components/trainjob.py` renders the job.

The job is deleted once it succeeds (its log has been read) and when this process is stopped
(Ctrl-C, or SIGTERM: how KFP cancels a task), so no GPUs keep running unattended; a failed job is
kept for `kubectl describe`. Every call goes through a kubernetes `CustomObjectsApi` and
`CoreV1Api`, which the tests replace with fakes.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class JobKind:
    """Where a kind of job lives in the API and how its pods and conditions read."""

    group: str
    version: str
    plural: str
    container: str  # the training container: logs are read from it
    rank0_selector: str  # label selector of the rank-0 pod ({name} = the job's name)
    succeeded: str  # the condition type that means done

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


KINDS = {
    # A TrainJob makes a JobSet whose replicated job `node` is an Indexed Job: rank 0 has completion index 0.
    "TrainJob": JobKind(
        "trainer.kubeflow.org",
        "v1alpha1",
        "trainjobs",
        "node",
        "jobset.sigs.k8s.io/jobset-name={name},jobset.sigs.k8s.io/replicatedjob-name=node",
        "Complete",
    ),
    "PyTorchJob": JobKind(
        "kubeflow.org",
        "v1",
        "pytorchjobs",
        "pytorch",
        "training.kubeflow.org/job-name={name},training.kubeflow.org/replica-type=master",
        "Succeeded",
    ),
}
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


def job_outcome(job: dict[str, Any]) -> tuple[str | None, str]:
    """("succeeded" | "failed" | None while running, the reason and message of the deciding condition)."""
    kind = KINDS[job["kind"]]
    conditions = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    for outcome, kind_type in (("failed", "Failed"), ("succeeded", kind.succeeded)):
        for c in conditions:
            if c.get("type") == kind_type:
                return outcome, ": ".join(p for p in (c.get("reason"), c.get("message")) if p) or kind_type
    return None, ""


def current_namespace() -> str:
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    if path.exists():
        return path.read_text().strip()
    from kubernetes import config

    try:
        return config.list_kube_config_contexts()[1]["context"].get("namespace", "default")
    except Exception:  # no kube config: the default namespace, as kubectl would use
        return "default"


def _clients():
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CustomObjectsApi(), client.CoreV1Api()


def _lines(response) -> Iterator[str]:
    """Lines of a streamed (`_preload_content=False`) log response, the last one even without a newline."""
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk.encode() if isinstance(chunk, str) else chunk
        *lines, buffer = buffer.split(b"\n")
        yield from (line.decode(errors="replace") for line in lines)
    if buffer:
        yield buffer.decode(errors="replace")


def _rank0_pod(core, namespace: str, kind: JobKind, name: str):
    pods = core.list_namespaced_pod(namespace, label_selector=kind.rank0_selector.format(name=name)).items
    for pod in pods:
        index = {**(pod.metadata.labels or {}), **(pod.metadata.annotations or {})}.get(COMPLETION_INDEX, "0")
        if index == "0":
            return pod
    return None


def _follow_logs(
    core,
    namespace: str,
    kind: JobKind,
    name: str,
    done: threading.Event,
    emit: Callable[[str], None],
    poll_s: float,
) -> None:
    """Stream the rank-0 pod's log until `done` is set; a stream cut while the pod runs is resumed."""
    finished: set[str] = set()
    last_line: dict[str, float] = {}
    while True:
        final = done.is_set()  # the job has ended: read what is left once, then stop
        try:
            pod = _rank0_pod(core, namespace, kind, name)
            if pod is not None and pod.metadata.name not in finished and pod.status.phase != "Pending":
                pod_name = pod.metadata.name
                since = (
                    {"since_seconds": math.ceil(time.time() - last_line[pod_name]) + 1}
                    if pod_name in last_line
                    else {}
                )
                response = core.read_namespaced_pod_log(
                    pod_name,
                    namespace,
                    container=kind.container,
                    follow=not final,
                    _preload_content=False,
                    **since,
                )
                try:
                    for line in _lines(response):
                        emit(line)
                        last_line[pod_name] = time.time()
                finally:
                    getattr(response, "release_conn", lambda: None)()
                phase = _rank0_pod(core, namespace, kind, name)
                if final or phase is None or phase.status.phase in ("Succeeded", "Failed"):
                    finished.add(pod_name)
        except Exception as err:  # the log is a convenience: never let it fail the task
            emit(f"[alignflow] reading the rank-0 log of {name}: {type(err).__name__}: {err}")
        if final:
            return
        done.wait(poll_s)


def submit_and_wait(
    manifest: dict[str, Any],
    namespace: str | None = None,
    *,
    custom=None,
    core=None,
    poll_s: float = 15.0,
    emit: Callable[[str], None] | None = None,
    delete_on_success: bool = True,
    max_api_errors: int = 5,
) -> None:
    """Create the job, stream its rank-0 log, and return when it succeeds; raise RuntimeError with the
    job's reason when it fails. The job is deleted when it succeeds (its log has been read) and when
    this process is interrupted (Ctrl-C, or SIGTERM from KFP cancelling the task); a failed job stays
    for `kubectl describe`. `custom`/`core` are kubernetes CustomObjectsApi/CoreV1Api (made here by default)."""
    emit = emit or (lambda line: print(line, flush=True))
    if custom is None or core is None:
        custom, core = _clients()
    namespace = namespace or current_namespace()
    kind, name = KINDS[manifest["kind"]], manifest["metadata"]["name"]
    where = (kind.group, kind.version, namespace, kind.plural)
    try:
        custom.create_namespaced_custom_object(*where, manifest)
    except Exception as err:
        hint = {
            404: f"is the {kind.plural}.{kind.group} CRD installed (Kubeflow Trainer for TrainJob, the Training "
            "Operator for PyTorchJob)?",
            403: "may this pod's service account create it? (charts/alignflow binds a Role for that: rbac)",
        }
        raise RuntimeError(
            f"Cannot create {manifest['kind']} {namespace}/{name}: {err}. "
            f"{hint.get(getattr(err, 'status', None), '')}".rstrip()
        ) from err
    emit(f"[alignflow] submitted {manifest['kind']} {namespace}/{name}; following its rank-0 pod")

    done = threading.Event()
    follower = threading.Thread(
        target=_follow_logs, args=(core, namespace, kind, name, done, emit, poll_s), daemon=True
    )
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_system_exit)
    follower.start()
    outcome, detail, errors = None, "", 0
    try:
        while outcome is None:
            time.sleep(poll_s)
            try:
                outcome, detail = job_outcome(custom.get_namespaced_custom_object(*where, name))
                errors = 0
            except Exception as err:
                errors += 1
                if getattr(err, "status", None) == 404 or errors > max_api_errors:
                    raise RuntimeError(
                        f"{manifest['kind']} {namespace}/{name} cannot be read: {err}"
                    ) from err
                emit(f"[alignflow] reading {name} failed ({errors}/{max_api_errors}): {err}")
    except BaseException:
        if outcome is None:  # interrupted or lost: do not leave GPUs running unattended
            emit(f"[alignflow] deleting {manifest['kind']} {namespace}/{name}")
            _delete(custom, where, name, emit)
        raise
    finally:
        done.set()
        follower.join(timeout=60)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if outcome == "failed":
        raise RuntimeError(
            f"{manifest['kind']} {namespace}/{name} failed: {detail}. Inspect it with "
            f"`kubectl -n {namespace} describe {kind.plural} {name}` and the logs of its pods."
        )
    emit(f"[alignflow] {manifest['kind']} {name} succeeded: {detail}")
    if delete_on_success:
        _delete(custom, where, name, emit)


def _raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)


def _delete(custom, where: tuple, name: str, emit: Callable[[str], None]) -> None:
    try:
        custom.delete_namespaced_custom_object(*where, name, propagation_policy="Background")
    except Exception as err:
        emit(f"[alignflow] could not delete {name}: {err}")
