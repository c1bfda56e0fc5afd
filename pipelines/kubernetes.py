"""Every Kubernetes setting of the pipeline, applied in one place.

CPU/memory/GPU requests and the accelerator type, tolerations and node selectors, a
memory-backed /dev/shm, S3 and MLflow credentials (and, for the tasks that load or push models, the Hugging Face
token) from Kubernetes Secrets, the image pull Secret of a private registry, the run id from the
pod's labels, the label that admits the pod to MLflow through the chart's NetworkPolicy, a non-root
user, retries with backoff, and caching. `kfp.kubernetes` settings are ignored by kfp.local but compile into the
YAML that the KFP UI runs. The values themselves (Secrets, default resources) live in
`components/settings.py`, because the multi-node launcher needs them at run time too.

Security context: kfp-kubernetes sets only runAsUser / runAsGroup / runAsNonRoot on a task's
container (`set_security_context`); its documentation says the KFP backend applies
allowPrivilegeEscalation=false, dropped capabilities and the RuntimeDefault seccomp profile itself.
There is no per-task ServiceAccount or automountServiceAccountToken: KFP runs every task as the
run's ServiceAccount (docs/deploy.md, Security).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from kfp import kubernetes

from components.settings import (
    HUB_SECRET_ENV,
    LIGHT,
    MLFLOW_CLIENT_LABEL,
    MLFLOW_SECRET,
    REGISTRY_SECRET,
    RUN_AS_USER,
    RUN_ID_ENV,
    RUN_ID_FIELD,
    S3_SECRET,
    SECRET_ENV,
    TRAINING,
    Resources,
)

__all__ = ["LIGHT", "MLFLOW_SECRET", "S3_SECRET", "SECRET_ENV", "TRAINING", "Resources", "apply"]


def apply(task, resources: Resources, retries: int = 2, cache: bool = True, backoff: str = "60s"):
    """Apply requests, placement, shared memory, secrets, the run id, the MLflow client label, a non-root
    user, retries and caching to one pipeline task."""
    with _setters_name_themselves_cheaply():
        task.set_cpu_request(resources.cpu).set_memory_request(resources.memory)
        task.set_memory_limit(resources.memory)
        if resources.gpus:
            task.set_accelerator_type(resources.accelerator).set_accelerator_limit(resources.gpus)
    for key, value in resources.node_selector.items():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for tol in resources.tolerations:
        kubernetes.add_toleration(task, key=tol.get("key"), operator=tol.get("operator", "Equal"),
                                  value=tol.get("value"), effect=tol.get("effect"))
    if resources.shm_size:
        # DataLoader workers and NCCL use /dev/shm; the container default (64 MiB) is too small.
        kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory",
                                   size_limit=resources.shm_size)
    for secret, env in {**SECRET_ENV, **(HUB_SECRET_ENV if resources.hub_token else {})}.items():
        kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env=env, optional=True)
    kubernetes.set_image_pull_secrets(task, [REGISTRY_SECRET])
    # Not an input: env vars stay out of KFP's cache key (backend/src/v2/cacheutils: inputs, outputs, image, command).
    kubernetes.use_field_path_as_env(task, env_name=RUN_ID_ENV, field_path=RUN_ID_FIELD)
    kubernetes.add_pod_label(task, label_key=MLFLOW_CLIENT_LABEL[0], label_value=MLFLOW_CLIENT_LABEL[1])
    kubernetes.set_security_context(task, run_as_user=RUN_AS_USER, run_as_group=RUN_AS_USER, run_as_non_root=True)
    task.set_retry(num_retries=retries, backoff_duration=backoff, backoff_factor=2, backoff_max_duration="600s")
    task.set_caching_options(cache)
    return task


class _CallerNameOnly:
    """What kfp's pipeline_task module sees as `inspect` inside `_setters_name_themselves_cheaply`: the real
    module, except that `stack()[1][3]`, its one use there, is read from the calling frame alone."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    @staticmethod
    def stack(context: int = 1) -> list:
        caller = sys._getframe(2)  # (0: this, 1: kfp's _ensure_container_spec_exists, 2: the setter)
        return [None, (caller, caller.f_code.co_filename, caller.f_lineno, caller.f_code.co_name)]


@contextlib.contextmanager
def _setters_name_themselves_cheaply() -> Iterator[None]:
    """kfp's resource setters (`set_cpu_request`, `set_memory_limit`, ...) call `inspect.stack()` only to name
    themselves in an error (kfp/dsl/pipeline_task.py, `_ensure_container_spec_exists`). That formats every frame of
    the stack with its source line, and the first call in a process maps the file of every loaded module. With
    about 60 such calls, it made up most of a compile: the first one in a process took 1.8 s (7.4 s under coverage,
    as in the tests), against 1.3 s under coverage without it. The errors still name the setter."""
    from kfp.dsl import pipeline_task

    real = pipeline_task.inspect
    pipeline_task.inspect = _CallerNameOnly(real)
    try:
        yield
    finally:
        pipeline_task.inspect = real
