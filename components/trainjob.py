"""A stage on several nodes: a Kubeflow Trainer `TrainJob` (or a Training Operator `PyTorchJob`)
that runs the stage's own entry point under `accelerate launch` with DeepSpeed, submitted and
followed from the KFP task.

`runtime.train_stage` comes here when a stage's pipeline config says `nodes: N` with N > 1:

1. **Config.** The multi-node keys (`MultiNode`) are split off; the rest is the stage config, checked
   as the single-node path checks it, and handed to the pods as JSON in ALIGNFLOW_STAGE_CONFIG (an
   ordinary env var: it holds options and URIs; credentials come from the Secrets, by reference).
2. **Inputs and outputs.** The pods cannot see the task's local artifact paths (KFP copies inputs
   to /s3/..., /minio/... inside the task's own pod), so they get the artifacts' object-store URIs
   (KFP's own path -> URI mapping; minio:// is read as s3://, the endpoint being AWS_ENDPOINT_URL).
   Each node copies the inputs to its disk once before its ranks start (`prepare-config`): N ranks
   fetching one URI into one cache folder would overwrite each other's files. The stage writes its
   checkpoints and final model to the task's checkpoint prefix (`runtime.checkpoint_uri`: keyed by the
   pipeline run and the task, the same for every attempt, never the attempt's own output URI), with
   `resume_from_checkpoint auto`, so a retried task's job resumes from the newest checkpoint; after the
   job succeeds the task downloads the final model, only when `alignflow.complete` is there, into the
   output artifact's path, and KFP uploads it as it does for a single-node stage.
3. **Launch.** Every pod runs `accelerate launch` with the repository's accelerate/DeepSpeed config
   (the image's working directory is the repository root), `--num_machines N`, its rank and the
   rendezvous address from the operator's environment (TrainJob's torch plugin: PET_NODE_RANK,
   PET_MASTER_ADDR, PET_MASTER_PORT; PyTorchJob: RANK, MASTER_ADDR, MASTER_PORT) and
   `--deepspeed_multinode_launcher standard` (torchrun on every node; accelerate's default, pdsh,
   needs ssh between pods).
4. **The rollout server** (GRPO/PPO, `rollout_engine: vllm-server`): one per node, shared by the node's
   ranks, whose rank 0 pushes it the weights. With `rollout_gpus: N` >= 1 it is a native sidecar
   container of each pod (an init container with restartPolicy Always, N GPUs of its own,
   startup/readiness/liveness probes, reached on 127.0.0.1). A PyTorchJob's pods get it from the
   manifest (`rollout_sidecar`). A TrainJob's `runtimePatches` cannot add a container or set its
   resources (only the env, mounts and security context of the runtime's own containers), so a
   TrainJob names the chart's ClusterTrainingRuntime `alignflow-rollout-<N>gpu`
   (charts/alignflow/templates/training-runtimes.yaml), whose pods already have the `rollout-server`
   sidecar with N GPUs; the TrainJob's patch gives it the stage config and the server's options
   (ALIGNFLOW_ROLLOUT_ARGS), which `serve-rollout` reads (`rollout_patch`). `MultiNode.check_sidecar`
   refuses a TrainJob sidecar on another runtime, or on one with another GPU count, before any job
   exists. With `rollout_gpus: 0` each node gets one GPU more than it has training ranks and the
   node's rank 0 starts the server on it as a child process (`vllm_server_devices`, docs/scaling.md).
5. **Wait.** `components.kubejob.submit_and_wait` creates the job, streams the rank-0 pod's log into
   the task's log, polls the job's conditions, raises with the job's reason when it fails, and
   deletes the job when it succeeds or when the task is stopped (KFP cancels a task with SIGTERM).

Resources: each node asks for `gpus_per_node` GPUs (+1 for a rollout server without a sidecar), CPUs
and memory per GPU as `components.settings.TRAINING` gives a one-GPU task, its tolerations, a memory-backed
/dev/shm, the S3 / MLflow Secrets of `components.settings.SECRET_ENV` and the Hub token's
(`HUB_SECRET_ENV`).

Security: the pods run as the trainer image's non-root user with the RuntimeDefault seccomp profile,
no privilege escalation and no capabilities (`components.settings.POD_SECURITY_CONTEXT`), carry
the label that admits them to MLflow (`MLFLOW_CLIENT_LABEL`), and run as `service_account` when it is
set. They never call the Kubernetes API (the task that submits the job does). A PyTorchJob's pods get
no ServiceAccount token (`automountServiceAccountToken: false`), nor do those of the chart's
`alignflow-rollout-<N>gpu` runtimes (the runtime's pod template says so); a TrainJob's runtime patch
cannot carry that field (Trainer 2.3's `runtimePatches` pod spec has no such property: the API server
drops or refuses it), so a TrainJob on `torch-distributed` keeps the token unless `service_account`
names an account whose `automountServiceAccountToken` is false, as the chart's is. The manifests are
validated against the CRDs the Kubeflow projects publish (tests/data/crds/).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import re
import secrets
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from components.images import TRAINER_IMAGE
from components.kubejob import KINDS, submit_and_wait
from components.settings import (
    CONTAINER_SECURITY_CONTEXT,
    HUB_SECRET_ENV,
    MLFLOW_CLIENT_LABEL,
    POD_SECURITY_CONTEXT,
    REGISTRY_SECRET,
    SECRET_ENV,
    TRAINING,
)
from trainer.config.options import option
from trainer.errors import ConfigError
from trainer.io import storage

CONFIG_ENV = "ALIGNFLOW_STAGE_CONFIG"
CONFIG_FILE = "/tmp/alignflow-stage.json"
ACCELERATE_CONFIGS = "trainer/configs/accelerate"  # relative to the repository root = the image's WORKDIR
CPU_PER_GPU, MEMORY_GI_PER_GPU = int(TRAINING.cpu), 32  # what the pipeline gives a one-GPU training task
INPUT_KEYS = ("model", "dataset", "eval_dataset", "ref_model", "reward_funcs")  # stage fields naming inputs
ISTIO_INJECT = "sidecar.istio.io/inject"  # an injected proxy would keep a finished pod running
ROLLOUT_PORT = 8000  # the rollout sidecar's port on the pod's loopback (TRL's vllm-serve default)
PATCH_MANAGER = "alignflow/launcher"  # owner of this launcher's entry in a TrainJob's runtimePatches
SIDECAR = "rollout-server"  # the sidecar's container name (PyTorchJob pods, the chart's alignflow-rollout runtimes)
# The chart's ClusterTrainingRuntimes with the sidecar are named f"{ROLLOUT_RUNTIME}-{N}gpu" (`rollout_runtime`):
# a TrainJob cannot patch a container's resources, so the name is how a stage section says how many GPUs it gets.
ROLLOUT_RUNTIME = "alignflow-rollout"
ROLLOUT_ARGS_ENV = "ALIGNFLOW_ROLLOUT_ARGS"  # the server's options for `serve-rollout` without arguments (TrainJob)


@dataclass
class MultiNode:
    """Keys of a stage's pipeline config that say how it runs on several nodes (none reach the stage)."""

    nodes: int = option(
        1, "Nodes (pods) to train on; more than 1 submits a TrainJob or PyTorchJob and waits for it."
    )
    gpus_per_node: int = option(1, "Training processes per node, one per GPU; on one node more than 1 starts that "
                                   "many ranks inside the task's pod (`alignflow train --num_processes`).")
    job_kind: str = option(
        "TrainJob",
        "TrainJob (Kubeflow Trainer v2, trainer.kubeflow.org/v1alpha1) or PyTorchJob "
        "(Training Operator v1, kubeflow.org/v1).",
        choices=("TrainJob", "PyTorchJob"),
    )
    training_runtime: str = option(
        "torch-distributed", "The ClusterTrainingRuntime a TrainJob runs on; with `rollout_gpus: N`, the chart's "
                             f"{ROLLOUT_RUNTIME}-<N>gpu (its pods have the rollout-server sidecar with N GPUs).")
    deepspeed: str = option(
        "zero2",
        "DeepSpeed preset as `alignflow train --deepspeed` takes it (trainer/configs/deepspeed_<value>.json): zero2, "
        "zero3, zero3_offload (optimizer state in CPU memory), or none for plain data parallelism (DDP). Used on "
        "several ranks; on one GPU (gpus_per_node 1, nodes 1) only when given.",
        choices=("zero2", "zero3", "zero3_offload", "none"),
    )
    mixed_precision: str = option(
        "", "accelerate's --mixed_precision: bf16, fp16 or no. Unset: the section's `bf16` / `fp16` when it sets "
            "them, else bf16 on several ranks; a value that contradicts the section's `bf16` / `fp16` is an error.",
        choices=("", "bf16", "fp16", "no"))
    cpu_per_node: str = option("", f"CPU request of each node; empty = {CPU_PER_GPU} per GPU.")
    memory_per_node: str = option(
        "", f"Memory request and limit of each node; empty = {MEMORY_GI_PER_GPU}Gi per GPU."
    )
    shm_size: str = option(
        TRAINING.shm_size, "Size of the memory-backed /dev/shm of each node (NCCL, DataLoader)."
    )
    accelerator: str = option(TRAINING.accelerator, "Extended resource name of the GPUs.")
    service_account: str = option(
        "", "ServiceAccount the job's pods run as (serviceAccountName); empty: the namespace's `default`. A "
            "TrainJob cannot turn off the token mount of its pods itself: name an account with "
            "automountServiceAccountToken false (the chart's `<release>-alignflow`) to keep the token out.")
    rollout_gpus: int = option(
        0, "GPUs of each node's rollout server (rollout_engine vllm-server, GRPO and PPO). N >= 1: "
           "`alignflow rollout-server` runs as a native sidecar of each pod (an init container with restartPolicy "
           "Always: it starts, and answers /ready, before the trainer, and stops after it) with N GPUs (N data-parallel "
           "replicas), its own resources and probes; the node's ranks reach it on 127.0.0.1. A TrainJob gets it from "
           f"its runtime: set training_runtime {ROLLOUT_RUNTIME}-<N>gpu (the chart's rolloutRuntimes), whose sidecar has "
           "the N GPUs. 0: the training container gets one GPU more, and the node's first rank starts the server on "
           "it as a child process.")
    node_selector: dict = option({}, "Node labels the pods must match.")
    tolerations: list = option(TRAINING.tolerations, "Pod tolerations (default: tolerate the GPU taint).")

    # Set by `split_config`: the keys above the section gave, and its own `bf16` / `fp16` (stage options).
    given: ClassVar[frozenset[str]] = frozenset()
    stage_precision: ClassVar[dict[str, bool]] = {}

    def precision(self) -> str:
        """accelerate's --mixed_precision for these ranks: `mixed_precision`, else the section's bf16/fp16, else bf16."""
        asked = "bf16" if self.stage_precision.get("bf16") else "fp16" if self.stage_precision.get("fp16") else "no"
        if self.mixed_precision:
            if self.stage_precision and asked != self.mixed_precision:
                said = ", ".join(f"{k}: {str(v).lower()}" for k, v in self.stage_precision.items())
                raise ConfigError(f"`mixed_precision: {self.mixed_precision}` contradicts the section's {said}; keep "
                                  "one of them (bf16 / fp16 are the stage's own options, as in TRL).")
            return self.mixed_precision
        return asked if self.stage_precision else "bf16"

    def check(self, stage: str, stage_config: Any = None) -> None:
        """Errors that say what to change; `stage_config` (the parsed stage config) enables the GRPO checks."""
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`{name}` must be a whole number >= 1, got {getattr(self, name)}.")
        if getattr(stage_config, "num_processes", 1) > 1:
            raise ConfigError("`num_processes` is set by the pipeline from `gpus_per_node` (and `nodes`); "
                              "remove it from the section and set `gpus_per_node`.")
        self.precision()
        if self.nodes == 1:
            for key in sorted(self.given & set(POD_KEYS)):
                where = POD_KEYS[key]
                raise ConfigError(
                    f"`{key}` sets the pods of a multi-node job (`nodes` > 1); with `nodes: 1` the {stage} stage runs "
                    "in the pipeline's training task, whose pod comes from the pipeline config's `cluster.train`"
                    + (f": set `cluster.train.{where}` there instead." if where else ": remove it (one node needs no "
                       "job)."))
        if self.nodes == 1 and self.gpus_per_node == 1:
            return
        engine = getattr(stage_config, "rollout_engine", "hf")
        if engine == "vllm":
            raise ConfigError(
                "rollout_engine=vllm runs vLLM inside the training process, one process only; with "
                "`gpus_per_node` or `nodes` > 1 use vllm-server (one server per node) or hf."
            )
        if self.nodes == 1:
            return
        if self.rollout_gpus:
            self.check_sidecar(engine, stage_config)
            return
        if self.job_kind == "TrainJob" and self.training_runtime.startswith(f"{ROLLOUT_RUNTIME}-"):
            raise ConfigError(
                f"`training_runtime: {self.training_runtime}` starts a rollout-server sidecar in every pod, which "
                "serves only with `rollout_gpus` (its GPUs) and rollout_engine vllm-server: set rollout_gpus "
                f"{runtime_gpus(self.training_runtime) or 'N'} and rollout_engine vllm-server, or training_runtime "
                "torch-distributed.")
        if engine == "vllm-server":
            if stage_config.vllm_server_devices not in (None, "", str(self.gpus_per_node)):
                raise ConfigError(
                    f"`vllm_server_devices` is set by the multi-node launcher (GPU "
                    f"{self.gpus_per_node} of each node, after the training GPUs); remove it."
                )

    def check_sidecar(self, engine: str, stage_config: Any) -> None:
        """`rollout_gpus` >= 1: a sidecar container serves the node's rollouts (vllm-server, no address of its own;
        a TrainJob on the chart's runtime whose sidecar has exactly `rollout_gpus` GPUs)."""
        if engine != "vllm-server":
            raise ConfigError(f"`rollout_gpus` gives the server of rollout_engine vllm-server its own GPUs, but the "
                              f"section's rollout_engine is {engine}: set rollout_engine vllm-server, or remove it.")
        wanted = rollout_runtime(self.rollout_gpus)
        if self.job_kind == "TrainJob" and self.training_runtime != wanted:
            has = runtime_gpus(self.training_runtime)
            if has is None:
                raise ConfigError(
                    f"`rollout_gpus: {self.rollout_gpus}` on a TrainJob needs a runtime whose pods have the "
                    f"rollout-server sidecar (Trainer 2.3's runtimePatches cannot add a container), but "
                    f"training_runtime is {self.training_runtime}: set training_runtime {wanted} (the chart's, with "
                    f"rolloutRuntimes.enabled and {self.rollout_gpus} in rolloutRuntimes.gpus), or job_kind PyTorchJob.")
            raise ConfigError(
                f"`training_runtime: {self.training_runtime}` gives the rollout-server sidecar {has} GPU(s) (a "
                f"TrainJob cannot patch a container's resources), but rollout_gpus is {self.rollout_gpus}: set "
                f"training_runtime {wanted} (with {self.rollout_gpus} in the chart's rolloutRuntimes.gpus), or "
                f"rollout_gpus {has}.")
        given = [k for k in ("vllm_server_host", "vllm_server_port", "vllm_server_base_url", "vllm_server_devices")
                 if getattr(stage_config, k, None) not in (None, "")]
        if given:
            raise ConfigError(f"`rollout_gpus` starts each node's own server (on 127.0.0.1:{ROLLOUT_PORT}); remove "
                              f"{', '.join(f'`{k}`' for k in given)}, or set rollout_gpus 0 to use that server.")

    def check_pod(self, pod_gpus: int, stage_config: Any = None) -> None:
        """A one-node section's ranks match the GPUs of the training task's pod (`cluster.train.gpus`), which
        every training task gets: the vLLM server of rollout_engine vllm-server may use GPUs beyond them."""
        if self.nodes > 1:
            return
        server = getattr(stage_config, "rollout_engine", "hf") == "vllm-server"
        if pod_gpus == self.gpus_per_node or (server and pod_gpus > self.gpus_per_node) or (
                pod_gpus == 0 and self.gpus_per_node == 1):
            return
        raise ConfigError(
            f"`gpus_per_node` is {self.gpus_per_node} but the training tasks' pods have {pod_gpus} GPU(s) "
            f"(`cluster.train.gpus`, the same for every training stage): make them equal"
            + (" (more pod GPUs only for rollout_engine vllm-server's server)." if not server else "."))

    def rank_options(self) -> dict[str, Any]:
        """Stage options that make one node's task train on `gpus_per_node` ranks; on one GPU, only a `deepspeed`
        the section gave (one rank under DeepSpeed, as `alignflow train --deepspeed` runs it)."""
        deepspeed = None if self.deepspeed == "none" else self.deepspeed
        if self.gpus_per_node == 1:
            return {"deepspeed": deepspeed} if "deepspeed" in self.given else {}
        precision = self.precision()
        return {"num_processes": self.gpus_per_node, "deepspeed": deepspeed,
                "bf16": precision == "bf16", "fp16": precision == "fp16"}

    def resources(self, gpus: int) -> dict[str, dict[str, str]]:
        cpu = self.cpu_per_node or str(CPU_PER_GPU * gpus)
        memory = self.memory_per_node or f"{MEMORY_GI_PER_GPU * gpus}Gi"
        return {
            "requests": {"cpu": cpu, "memory": memory, self.accelerator: str(gpus)},
            "limits": {"memory": memory, self.accelerator: str(gpus)},
        }


# Keys that set the pods of a multi-node job -> the `cluster.train` key that sets a one-node task's pod
# ("" when one node has nothing to set).
POD_KEYS = {"node_selector": "node_selector", "tolerations": "tolerations", "cpu_per_node": "cpu",
            "memory_per_node": "memory", "shm_size": "shm_size", "accelerator": "accelerator", "job_kind": "",
            "training_runtime": "", "service_account": "", "rollout_gpus": "gpus"}


def split_config(config: dict[str, Any]) -> tuple[MultiNode, dict[str, Any]]:
    """(the multi-node keys as a `MultiNode`, the rest: the stage's own config). Type errors name the key."""
    fields = {f.name: f for f in dataclasses.fields(MultiNode)}
    values = {}
    for name, value in config.items():
        if name in fields:
            values[name] = _coerce(fields[name], value)
    multi = MultiNode(**values)
    multi.given = frozenset(values)
    multi.stage_precision = {k: bool(config[k]) for k in ("bf16", "fp16") if config.get(k) is not None}
    return multi, {k: v for k, v in config.items() if k not in fields}


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(default, int):  # KFP's structured parameters turn ints into floats
        if isinstance(value, bool) or not (
            isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        ):
            raise ConfigError(f"`{f.name}` must be a whole number >= 1, got {value!r}.")
        return int(value)
    if not isinstance(value, type(default)):
        raise ConfigError(f"`{f.name}` must be a {type(default).__name__}, got {value!r}.")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"`{f.name}` must be one of {', '.join(choices)}, got {value!r}.")
    return value


# ----------------------------------------------------------------------------------------------
# The manifest (pure)


def node_script(stage: str, multi: MultiNode) -> str:
    """The shell script every pod runs: copy the inputs to this node, then start this node's ranks."""
    if multi.deepspeed == "none":
        flags = {"--multi_gpu": None}
    else:
        config = f"{ACCELERATE_CONFIGS}/deepspeed_{multi.deepspeed}.yaml"
        flags = {"--config_file": config, "--deepspeed_multinode_launcher": "standard"}
    flags |= {
        "--num_machines": multi.nodes,
        "--num_processes": multi.nodes * multi.gpus_per_node,  # accelerate counts all machines' processes
        "--gpu_ids": ",".join(str(i) for i in range(multi.gpus_per_node)),
        "--mixed_precision": multi.precision(),
        "--same_network": None,
        "--rdzv_backend": "static",
    }
    launch = ["accelerate", "launch", *(str(x) for kv in flags.items() for x in kv if x is not None)]
    # TrainJob's torch plugin sets PET_*; a PyTorchJob sets RANK (the node's) and MASTER_*.
    rank = (
        '--machine_rank "${PET_NODE_RANK:-${RANK}}" --main_process_ip "${PET_MASTER_ADDR:-${MASTER_ADDR}}" '
        '--main_process_port "${PET_MASTER_PORT:-${MASTER_PORT}}"'
    )
    stage_cmd = shlex.join(["-m", "trainer.cli", "train", stage, "--config", CONFIG_FILE])
    prepare = shlex.join(["python", "-m", "components.trainjob", "prepare-config", CONFIG_FILE])
    return f"set -euo pipefail\n{prepare}\nexec {shlex.join(launch)} {rank} {stage_cmd}"


def rollout_runtime(gpus: int) -> str:
    """The chart's ClusterTrainingRuntime whose pods have the rollout-server sidecar with `gpus` GPUs."""
    return f"{ROLLOUT_RUNTIME}-{gpus}gpu"


def runtime_gpus(name: str) -> int | None:
    """The sidecar GPUs of a runtime `rollout_runtime` names; None for any other runtime."""
    m = re.fullmatch(rf"{re.escape(ROLLOUT_RUNTIME)}-([1-9][0-9]*)gpu", name)
    return int(m.group(1)) if m else None


def rollout_server_args(config, multi: MultiNode) -> list[str]:
    """`alignflow rollout-server` options for the sidecar of a pod whose ranks train with the RL stage `config`:
    the length, dtype and memory share the trainer would give the server it starts itself (shared.start_engine)."""
    dtype = "bfloat16" if multi.precision() == "bf16" else config.dtype
    return ["--host", "127.0.0.1", "--port", str(ROLLOUT_PORT),
            "--max_model_len", str(config.max_prompt_length + config.max_completion_length),
            "--dtype", dtype, "--gpu_memory_utilization", str(config.vllm_gpu_memory_utilization),
            "--data_parallel_size", str(multi.rollout_gpus)]


def rollout_sidecar(server_args: list[str], env: list[dict[str, Any]], multi: MultiNode, image: str,
                    shm_mount: dict[str, str]) -> dict[str, Any]:
    """The pod's rollout server as a native sidecar (Kubernetes >= 1.29): an init container with restartPolicy
    Always. The trainer container starts once its startup probe passes (the model is loaded and served); the
    kubelet stops it, SIGTERM then drain, after the trainer exits. It copies the stage's `model` to its own disk
    (`serve-rollout`) and serves it; the trainer pushes its weights first thing, and after every update."""
    ready = {"httpGet": {"path": "/ready", "port": ROLLOUT_PORT}, "periodSeconds": 10, "timeoutSeconds": 5}
    return {
        "name": SIDECAR,
        "image": image,
        "restartPolicy": "Always",
        "command": ["python", "-m", "components.trainjob", "serve-rollout", *server_args],
        "env": env,
        "resources": multi.resources(multi.rollout_gpus),
        "volumeMounts": [shm_mount],
        "ports": [{"name": "rollout", "containerPort": ROLLOUT_PORT}],
        # Loading the model and starting vLLM may take minutes: up to 20 before the pod fails.
        "startupProbe": {**ready, "failureThreshold": 120},
        # /ready answers 503 while a weight update loads; /health only when the engine is gone.
        "readinessProbe": {**ready, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", "port": ROLLOUT_PORT}, "periodSeconds": 30,
                          "timeoutSeconds": 10, "failureThreshold": 4},
        "securityContext": CONTAINER_SECURITY_CONTEXT,
    }


def secret_env() -> list[dict[str, Any]]:
    """The S3 and MLflow variables and the Hub token (training pods), by reference to the Secrets the pipeline's
    tasks read (optional keys)."""
    return [
        {"name": env, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
        for secret, keys in {**SECRET_ENV, **HUB_SECRET_ENV}.items()
        for key, env in keys.items()
    ]


def render(
    stage: str, config, values: dict[str, Any], multi: MultiNode, *, name: str, image: str = TRAINER_IMAGE
) -> dict[str, Any]:
    """The TrainJob or PyTorchJob running `stage` on `multi.nodes` nodes: its pods parse the stage config from
    `values`, which `config` was resolved from (components.inputs.resolve_stage)."""
    gpus = multi.gpus_per_node
    sidecar = multi.rollout_gpus > 0 and values.get("rollout_engine") == "vllm-server"
    if sidecar:  # each pod's own server, beside the trainer
        server_args = rollout_server_args(config, multi)
        values = {**values, "vllm_server_host": "127.0.0.1", "vllm_server_port": ROLLOUT_PORT}
    elif values.get("rollout_engine") == "vllm-server":
        # One more GPU per node, after the training ones, for the server the node's first rank starts.
        values = {**values, "vllm_server_devices": str(multi.gpus_per_node)}
        gpus += 1
    env = [{"name": CONFIG_ENV, "value": json.dumps(values, sort_keys=True)}, *secret_env()]
    command = ["bash", "-c", node_script(stage, multi)]
    shm_volume = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": multi.shm_size}}
    shm_mount = {"name": "dshm", "mountPath": "/dev/shm"}
    placement = {"tolerations": multi.tolerations}
    if multi.node_selector:
        placement["nodeSelector"] = multi.node_selector
    labels = {"app.kubernetes.io/name": "alignflow", "app.kubernetes.io/component": stage.replace("_", "-")}
    metadata = {"name": name, "labels": labels}
    pod_metadata = {"labels": dict([MLFLOW_CLIENT_LABEL]), "annotations": {ISTIO_INJECT: "false"}}
    # The pods never call the Kubernetes API: non-root, no privilege escalation, no capabilities, and no
    # token where the API lets the job say so (a TrainJob's runtime patch has no automountServiceAccountToken).
    pod_security = {"securityContext": POD_SECURITY_CONTEXT, "imagePullSecrets": [{"name": REGISTRY_SECRET}]}
    if multi.service_account:
        pod_security["serviceAccountName"] = multi.service_account
    if multi.job_kind == "TrainJob":
        trainer = {
            "image": image,
            "command": command,
            "env": env,
            "numNodes": multi.nodes,
            "numProcPerNode": multi.gpus_per_node,
            "resourcesPerNode": multi.resources(gpus),
        }
        # The runtime's `node` container gets the mount; its pods the volume, placement and Istio opt-out.
        pod_patch = {
            "metadata": pod_metadata,
            "spec": {
                "volumes": [shm_volume],
                **placement,
                **pod_security,
                "containers": [
                    {"name": "node", "volumeMounts": [shm_mount], "securityContext": CONTAINER_SECURITY_CONTEXT}
                ],
            },
        }
        if sidecar:  # the runtime's own sidecar (check_sidecar: alignflow-rollout-<N>gpu) gets this job's server
            pod_patch["spec"]["initContainers"] = [rollout_patch(server_args, env, shm_mount)]
        spec = {
            "runtimeRef": {"name": multi.training_runtime},
            "trainer": trainer,
            "runtimePatches": [_node_patch(pod_patch)],
        }
        return {
            "apiVersion": KINDS["TrainJob"].api_version,
            "kind": "TrainJob",
            "metadata": metadata,
            "spec": spec,
        }
    container = {
        "name": "pytorch",
        "image": image,
        "command": command,
        "env": env,
        "resources": multi.resources(gpus),
        "volumeMounts": [shm_mount],
        "ports": [{"name": "pytorchjob-port", "containerPort": 23456}],
        "securityContext": CONTAINER_SECURITY_CONTEXT,
    }
    pod = {
        "metadata": {**pod_metadata, "labels": {**labels, **pod_metadata["labels"]}},
        "spec": {"containers": [container], "volumes": [shm_volume], **placement, **pod_security,
                 "automountServiceAccountToken": False},
    }
    if sidecar:
        pod["spec"]["initContainers"] = [rollout_sidecar(server_args, env, multi, image, shm_mount)]
    replicas = {"Master": 1, "Worker": multi.nodes - 1}
    replica_specs = {
        role: {"replicas": n, "restartPolicy": "Never", "template": pod} for role, n in replicas.items() if n
    }
    spec = {"runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None"}, "pytorchReplicaSpecs": replica_specs}
    return {
        "apiVersion": KINDS["PyTorchJob"].api_version,
        "kind": "PyTorchJob",
        "metadata": metadata,
        "spec": spec,
    }


def rollout_patch(server_args: list[str], env: list[dict[str, Any]], shm_mount: dict[str, str]) -> dict[str, Any]:
    """A TrainJob's patch of its runtime's rollout-server sidecar: all a patch may set there is the env, mounts and
    security context (Trainer 2.3), so the server's options travel as ALIGNFLOW_ROLLOUT_ARGS, which the runtime's
    `python -m components.trainjob serve-rollout` (no arguments) reads; its image, GPUs and probes are the runtime's."""
    return {"name": SIDECAR, "env": [*env, {"name": ROLLOUT_ARGS_ENV, "value": shlex.join(server_args)}],
            "volumeMounts": [shm_mount], "securityContext": CONTAINER_SECURITY_CONTEXT}


def _node_patch(pod_patch: dict[str, Any]) -> dict[str, Any]:
    """A TrainJob `runtimePatches` entry (Kubeflow Trainer >= 2.2, which replaced `podTemplateOverrides`)
    applying a pod template patch to the runtime's `node` job."""
    job = {"name": "node", "template": {"spec": {"template": pod_patch}}}
    return {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [job]}}},
    }


def pod_templates(manifest: dict[str, Any], runtime: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The pod template(s) a manifest makes, as the operator will build them (for validation and tests).

    A TrainJob's pod is its runtime's `node` pod template (`runtime`, the ClusterTrainingRuntime it names; without
    it, a bare `node` container) with the runtime patch merged in as Trainer 2.3 merges it (a strategic merge patch:
    containers, init containers, volumes and env by name, mounts by path), then `spec.trainer` set on `node`.
    A patch of an init container needs the runtime that has it.
    """
    if manifest["kind"] == "PyTorchJob":
        return [r["template"] for r in manifest["spec"]["pytorchReplicaSpecs"].values()]
    trainer = manifest["spec"]["trainer"]
    (job,) = manifest["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"
    ]
    patch = job["template"]["spec"]["template"]
    if runtime is None:
        if patch["spec"].get("initContainers"):
            raise ValueError("the TrainJob patches the init containers of its runtime: pass the runtime "
                             f"({manifest['spec']['runtimeRef']['name']}) to build its pods")
        base = {"spec": {"containers": [{"name": "node"}]}}
    else:
        if runtime["metadata"]["name"] != manifest["spec"]["runtimeRef"]["name"]:
            raise ValueError(f"the TrainJob runs on {manifest['spec']['runtimeRef']['name']}, "
                             f"not on {runtime['metadata']['name']}")
        jobs = {j["name"]: j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
        base = jobs[job["name"]]["template"]["spec"]["template"]
    pod = copy.deepcopy(_merge(base, patch))
    (node,) = [c for c in pod["spec"]["containers"] if c["name"] == "node"]
    node |= {"image": trainer["image"], "command": trainer["command"],
             "env": _merge(node.get("env", []), trainer["env"]), "resources": trainer["resourcesPerNode"]}
    return [{"metadata": pod.get("metadata", {}), "spec": pod["spec"]}]


def _merge(base: Any, patch: Any) -> Any:
    """`patch` merged into `base` as a strategic merge patch merges the pod fields alignflow patches: mappings key by
    key, lists of objects by `name` (`mountPath` for volume mounts), other lists and values replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: _merge(base[k], v) if k in base else v for k, v in patch.items()}}
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(x, dict) for x in base + patch):
        key = next((k for k in ("mountPath", "name") if all(k in x for x in base + patch)), None)
        if key:
            merged = {x[key]: x for x in base}
            for x in patch:
                merged[x[key]] = _merge(merged[x[key]], x) if x[key] in merged else x
            return list(merged.values())
    return patch


# ----------------------------------------------------------------------------------------------
# Artifacts: task paths <-> object-store URIs, staging, download


def remote_uri(path: str) -> str:
    """The object-store URI behind a KFP task's local artifact path (/s3/b/k -> s3://b/k); other values unchanged."""
    from kfp.dsl.types.artifact_types import convert_local_path_to_remote_path

    uri = convert_local_path_to_remote_path(path)
    return "s3://" + uri[len("minio://") :] if uri.startswith("minio://") else uri


def remote_inputs(values: dict[str, Any]) -> dict[str, Any]:
    """The stage config with its inputs as URIs the pods can read; a local-only input is an error."""
    out = dict(values)
    for key in INPUT_KEYS:
        value = out.get(key)
        if isinstance(value, str):
            out[key] = remote_uri(value)
        elif isinstance(value, list):
            out[key] = [remote_uri(v) if isinstance(v, str) else v for v in value]
    for key in ("model", "dataset"):
        if not storage.is_remote(out.get(key, "")):
            raise ConfigError(
                f"`nodes` > 1 trains in other pods, which read their inputs from object storage, but "
                f"`{key}` is the local path {out.get(key)!r}. Run the pipeline on a cluster with an "
                "s3:// pipeline root (a laptop run trains on one node)."
            )
    return out


def download_complete(staging: str, dest: str) -> None:
    """Copy the final model in `staging` to the local folder `dest`, without step checkpoints;
    only a folder with the completion marker counts."""
    from trainer.engine.checkpoint import COMPLETE_MARKER, is_complete

    if not is_complete(staging):
        raise RuntimeError(f"The job ended but {staging} holds no complete model (no {COMPLETE_MARKER}).")
    fs = storage.filesystem(staging)
    root = fs._strip_protocol(staging).rstrip("/")
    for path in sorted(fs.find(root)):
        rel = path[len(root) + 1 :]
        if not rel.split("/")[0].startswith("checkpoint-"):
            Path(dest, rel).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(path, str(Path(dest, rel)))


def job_name(stage: str) -> str:
    # Short: a TrainJob's rank-0 host name is <name>-node-0-0.<name>, each label at most 63 characters.
    return f"alignflow-{stage.replace('_', '-')}-{secrets.token_hex(4)}"


def run_stage(stage: str, config, values: dict[str, Any], multi: MultiNode, *, output_dir: str, **wait: Any) -> None:
    """Train `stage` on `multi.nodes` nodes into `output_dir`: the task's checkpoint prefix in object storage, the
    same for every attempt of the task, so a retry's job resumes from the newest checkpoint (`auto`). `config`,
    `values` and `multi` come from `components.inputs.resolve_stage`, which has checked them together."""
    values = {**remote_inputs(values), "output_dir": output_dir}
    if not storage.is_remote(output_dir):
        raise ConfigError(
            f"`nodes` > 1 trains in other pods, which write to object storage, but this task's checkpoints would go "
            f"to the local path {output_dir!r}. Run the pipeline with an s3:// pipeline root."
        )
    submit_and_wait(render(stage, config, values, multi, name=job_name(stage)), **wait)


# ----------------------------------------------------------------------------------------------
# Inside each pod


def prepare_config(path: str) -> str:
    """Write the stage config from ALIGNFLOW_STAGE_CONFIG to `path`, its object-store inputs copied to this node."""
    values = json.loads(os.environ[CONFIG_ENV])
    for key in INPUT_KEYS:
        value = values.get(key)
        if isinstance(value, str) and storage.is_remote(value):
            values[key] = storage.fetch_to_local(value)
        elif isinstance(value, list):
            values[key] = [
                storage.fetch_to_local(v) if isinstance(v, str) and storage.is_remote(v) else v for v in value
            ]
    Path(path).write_text(json.dumps(values, indent=2, sort_keys=True))
    return path


def serve_rollout(server_args: list[str]) -> None:
    """The rollout sidecar: copy the stage's `model` (ALIGNFLOW_STAGE_CONFIG) to this container, then become
    `alignflow rollout-server --model <it> <server_args>` (exec: the kubelet's SIGTERM reaches the server, which
    drains). No `server_args`: they come from ALIGNFLOW_ROLLOUT_ARGS (a TrainJob's patch of its runtime's sidecar)."""
    if not server_args:
        if not os.environ.get(ROLLOUT_ARGS_ENV):
            raise SystemExit(f"serve-rollout: no server options: give them as arguments or in {ROLLOUT_ARGS_ENV} "
                             f"(a TrainJob on {ROLLOUT_RUNTIME}-<N>gpu gets them from alignflow's runtime patch).")
        server_args = shlex.split(os.environ[ROLLOUT_ARGS_ENV])
    model = json.loads(os.environ[CONFIG_ENV])["model"]
    if storage.is_remote(model):
        model = storage.fetch_to_local(model)
    command = [sys.executable, "-m", "trainer.cli", "rollout-server", "--model", model, *server_args]
    print("Rollout server:", shlex.join(command), flush=True)
    os.execv(sys.executable, command)


USAGE = ("usage: python -m components.trainjob prepare-config FILE\n"
         "       python -m components.trainjob serve-rollout [alignflow rollout-server options, without --model;\n"
         f"                                                    none: those in {ROLLOUT_ARGS_ENV}]")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv[:1] == ["serve-rollout"]:
        serve_rollout(argv[1:])
    if len(argv) != 2 or argv[0] != "prepare-config":
        print(USAGE, file=sys.stderr)
        return 2
    print(f"Stage config with local inputs: {prepare_config(argv[1])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
