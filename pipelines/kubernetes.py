"""Every Kubernetes setting of the pipeline, applied in one place.

CPU/memory/GPU requests and the accelerator type, tolerations and node selectors, a
memory-backed /dev/shm, S3 and MLflow credentials from Kubernetes Secrets, retries with
backoff, and caching. `kfp.kubernetes` settings are ignored by kfp.local but compile into the
YAML that the KFP UI runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Secret name -> {secret key: environment variable}. Values never appear in the compiled YAML.
S3_SECRET = "alignflow-s3"
MLFLOW_SECRET = "alignflow-mlflow"
SECRET_ENV = {
    S3_SECRET: {"AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
                "AWS_ENDPOINT_URL": "AWS_ENDPOINT_URL"},
    MLFLOW_SECRET: {"MLFLOW_TRACKING_URI": "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME": "MLFLOW_TRACKING_USERNAME",
                    "MLFLOW_TRACKING_PASSWORD": "MLFLOW_TRACKING_PASSWORD"},
}


@dataclass
class Resources:
    """What one task asks the cluster for."""

    cpu: str = "2"
    memory: str = "8Gi"
    gpus: int = 0
    accelerator: str = "nvidia.com/gpu"
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, str]] = field(default_factory=list)
    shm_size: str = "8Gi"


LIGHT = Resources(cpu="1", memory="2Gi", shm_size="")
TRAINING = Resources(cpu="8", memory="32Gi", gpus=1, tolerations=[
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])


def apply(task, resources: Resources, retries: int = 2, cache: bool = True):
    """Apply requests, placement, shared memory, secrets, retries and caching to one pipeline task."""
    # Imported here: this module's settings are also read inside running components
    # (components/trainjob.py), where KFP's executor cannot import kfp.kubernetes.
    from kfp import kubernetes

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
    for secret, env in SECRET_ENV.items():
        kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env=env, optional=True)
    task.set_retry(num_retries=retries, backoff_duration="60s", backoff_factor=2, backoff_max_duration="600s")
    task.set_caching_options(cache)
    return task
