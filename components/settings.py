"""Kubernetes settings that components need at run time as well as at compile time.

The Secrets that hold S3 and MLflow credentials and the Hugging Face token, the label that lets a pod through the chart's
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

# The Hugging Face token, only for the pods that load or push models (`Resources.hub_token`: training and
# evaluation tasks, and every pod of a multi-node job): `push_to_hub`, a gated model or reward model from the
# Hub. Optional: without the Secret the variable is unset. Never a pipeline parameter, never in the YAML.
HF_SECRET = "alignflow-hf"
HUB_SECRET_ENV = {HF_SECRET: {"HF_TOKEN": "HF_TOKEN"}}

# Credentials for a private registry that serves the trainer image: a `kubernetes.io/dockerconfigjson` Secret every
# task pod and multi-node job pod names in `imagePullSecrets`. Optional as the others are: when it does not exist
# the kubelet records a warning event and pulls without it (a public registry, or nodes with their own credentials).
REGISTRY_SECRET = "alignflow-registry"


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
    hub_token: bool = False  # HF_TOKEN from the HF_SECRET Secret (HUB_SECRET_ENV) in the task's environment


LIGHT = Resources(cpu="1", memory="2Gi", shm_size="")
TRAINING = Resources(cpu="8", memory="32Gi", gpus=1, tolerations=[
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}], hub_token=True)
