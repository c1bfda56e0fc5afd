"""Kubernetes settings that components need at run time as well as at compile time.

The Secrets that hold S3 and MLflow credentials, the label that lets a pod through the chart's
MLflow NetworkPolicy, the security context of training pods, and the default task resources. The
pipeline applies them to every task (`pipelines/kubernetes.py`); the multi-node launcher
(`components/trainjob.py`) gives the pods of a TrainJob the same ones. They live here, the
lowest layer that needs them, so that no component imports the pipeline layer.
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


# Pods with this label may reach MLflow (and SeaweedFS) through the chart's NetworkPolicy
# (charts/alignflow: networkPolicy.clientLabel must name the same key).
MLFLOW_CLIENT_LABEL = ("alignflow.io/mlflow-client", "true")

# The trainer image's user (images/trainer/Dockerfile: USER 10001:10001; the chart's runAsUser).
RUN_AS_USER = 10001
# The Pod Security Standards "restricted" profile for training pods. Not readOnlyRootFilesystem:
# stages write caches (HF, torch extensions) and the stage config under the image's home and /tmp.
POD_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_USER,
    "runAsGroup": RUN_AS_USER,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


# The pipeline run's id in every task's environment, without a task input (an input that changes
# with every run would enter every cache key). On a cluster it is the downward API's view of the
# `pipeline/runid` label that KFP puts on every pod of a run, one-off or recurring
# (pipelines/kubernetes.py sets it on each task); `alignflow pipeline run --local` sets it itself.
RUN_ID_ENV = "ALIGNFLOW_PIPELINE_RUN_ID"
RUN_ID_FIELD = "metadata.labels['pipeline/runid']"


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
