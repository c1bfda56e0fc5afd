"""`alignflow pipeline run --local --containers`: every task of the local run in its own container of
the trainer image, through kfp.local's DockerRunner, as a cluster would run it.

What differs from the subprocess runner, and why:
- Docker is checked first (daemon answers, image present) and a missing piece is one line naming
  the fix, before any task starts.
- A container sees only the pipeline root (kfp.local mounts it at the same path), so local inputs
  (the base model folder, dataset files, the built-in demo data) are copied into
  PIPELINE_ROOT/inputs first, and an embedded MLflow store (sqlite) lives under the pipeline root too.
- The containers run as the image's user (uid 10001, as on a cluster): the folders they write into
  are made writable for it (mode 1777, like /tmp).
- Host network, so `localhost` endpoints (S3, MLflow) mean the same inside; the S3/MLflow endpoints,
  credentials and run settings reach the tasks as environment variables, never through the image.
- Each task gets ALIGNFLOW_IMAGE and ALIGNFLOW_IMAGE_DIGEST (the image's registry digest when it
  has one, else its local image id), which the trainer writes into the model's alignflow.json, model
  card and MLflow run.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError
from trainer.io import storage

# Environment a task may need from the host: S3 and MLflow endpoints and credentials, run settings.
PASS_PREFIXES = ("ALIGNFLOW_", "MLFLOW_", "AWS_", "HF_", "TRANSFORMERS_", "VLLM_", "OMP_", "TOKENIZERS_")
# Host paths (not mounted) and settings the image fixes for itself.
NOT_PASSED = {"ALIGNFLOW_CACHE", "ALIGNFLOW_GIT_SHA", "ALIGNFLOW_TRAINER_IMAGE", "ALIGNFLOW_TRAINER_CPU_IMAGE",
              "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "AWS_SHARED_CREDENTIALS_FILE",
              "AWS_CONFIG_FILE"}
# The pipeline parameters that name an input file or folder.
INPUT_PARAMETERS = ("base_model_uri", "sft_data_uri", "preference_data_uri", "prompts_uri", "eval_prompts_uri")


@dataclass(frozen=True)
class Image:
    name: str
    digest: str  # repo digest (name@sha256:...) when the image was pushed or pulled, else its id (sha256:...)


def check_docker(image: str) -> Image:
    """The image as the local Docker daemon has it; ConfigError (one line, the fix) without a daemon or image."""
    try:
        import docker
    except ImportError:
        raise ConfigError("--containers needs the `docker` Python package (pip install docker), which kfp's "
                          "DockerRunner drives.") from None
    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as err:  # DockerException, connection refused, no socket, permission denied
        raise ConfigError(f"--containers needs a running Docker daemon, and none answers ({type(err).__name__}): start "
                          "one (`dockerd`, or `sudo systemctl start docker`; set DOCKER_HOST if it listens "
                          "elsewhere), or run without --containers.") from None
    try:
        found = client.images.get(image)
    except docker.errors.ImageNotFound:
        raise ConfigError(f"--containers: Docker has no image {image}. Build it (`bash images/build.sh --no-push "
                          "--cpu`) or pull it, or name another with --image.") from None
    finally:
        client.close()
    digests = found.attrs.get("RepoDigests") or []
    return Image(image, digests[0] if digests else found.id)


def environment(image: Image) -> dict[str, str]:
    """The variables every task's container gets."""
    env = {k: v for k, v in os.environ.items() if k.startswith(PASS_PREFIXES) and k not in NOT_PASSED}
    env.update(ALIGNFLOW_IMAGE=image.name, ALIGNFLOW_IMAGE_DIGEST=image.digest)
    return env


def runner(image: Image):
    """kfp.local's DockerRunner for these tasks: host network, the environment above."""
    from kfp import local

    return local.DockerRunner(network_mode="host", environment=environment(image))


def writable_by_tasks(path: Path) -> Path:
    """Make `path` (and create it) a folder the image's user can write into, as /tmp (mode 1777)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o1777)
    return path


def stage_inputs(arguments: dict[str, Any], root: Path) -> dict[str, Any]:
    """Copy the local files and folders the pipeline parameters name into ROOT/inputs (the containers see
    only the pipeline root) and point the parameters at the copies; s3:// inputs are left as they are."""
    staged = dict(arguments)
    inputs = root / "inputs"
    for name in INPUT_PARAMETERS:
        uri = arguments.get(name)
        if not uri or storage.is_remote(uri) or Path(uri).resolve().is_relative_to(root.resolve()):
            continue
        source = Path(uri)
        target = inputs / name / source.name
        if target.exists():
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
        _readable(target)
        staged[name] = str(target)
    return staged


def _readable(path: Path) -> None:
    """Readable by the image's user (safetensors files are written 0600)."""
    for item in [path, *(path.rglob("*") if path.is_dir() else [])]:
        item.chmod(item.stat().st_mode | (0o555 if item.is_dir() else 0o444))


def tracking_uri(uri: str, root: Path) -> str:
    """The MLflow tracking URI the containers use: an http(s) server as it is; the embedded sqlite store
    under the pipeline root (where the containers can reach it). Another local store cannot be shared."""
    if uri.startswith(("http://", "https://", "databricks")):
        return uri
    if uri.startswith("sqlite:///") and Path(uri[len("sqlite:///"):]).resolve().is_relative_to(root.resolve()):
        return uri
    if not uri:
        return f"sqlite:///{writable_by_tasks(root / 'mlflow')}/mlflow.db"
    raise ConfigError(f"--containers: MLFLOW_TRACKING_URI={uri} is a local store the task containers cannot "
                      "reach. Point it at an MLflow server (http://...) or unset it (an embedded store under "
                      "the pipeline root is used).")
