"""A checkpoint as an MLflow 3 model: the transformers flavour, logged from its local folder.

`log_checkpoint_model` turns a complete alignflow checkpoint into an MLflow LoggedModel that
`mlflow.pyfunc.load_model`, `mlflow.transformers.load_model`, `mlflow models serve` and serving
runtimes that read the registry can use:

- MLflow's local-checkpoint path of ``mlflow.transformers.save_model`` (a folder path as
  ``transformers_model``): the weights are copied, never loaded into memory; only the tokenizer
  is read. Nothing is fetched from a hub (model-card and license look-ups of a local path fail
  fast and are skipped).
- The task is ``llm/v1/chat`` when the tokenizer has a chat template (OpenAI chat-completions
  input and output: ``{"messages": [...], "max_tokens": 32}``), else ``llm/v1/completions``
  (``{"prompt": "...", "max_tokens": 32}``). MLflow gives both their signature; we add an
  input example.
- Requirements are pinned from this environment without MLflow's default inference, which
  imports torchvision (absent here) and would fail.

What is logged is the model folder without training state: a full causal LM at the top of the
checkpoint, or the ``merged/`` copy of a LoRA checkpoint. Anything else (an adapter without a
merged copy, a reward model) is not a servable chat model: `servable_folder` returns None and the
caller registers the files as they are.

The LoggedModel is created with the client's explicit tracking URI (no global MLflow state), as
MLflow's own ``Model.log`` does: create → save locally → upload → link as the run's output →
READY (or FAILED when anything on the way fails).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from trainer.engine import checkpoint as ckpt
from trainer.extras import require

log = logging.getLogger(__name__)

CHAT = "llm/v1/chat"
COMPLETIONS = "llm/v1/completions"
MODEL_SUBDIR = "model"  # where the transformers flavour keeps the checkpoint inside an MLflow model
_NOT_SERVED = (ckpt.STATE_DIR, "merged", ckpt.COMPLETE_MARKER)  # never part of the logged model
_PINNED = ("transformers", "torch", "tokenizers", "accelerate", "safetensors")


def servable_folder(checkpoint: Path) -> Path | None:
    """The folder of a checkpoint that holds a full causal LM: the checkpoint itself, or its
    ``merged/`` copy (a LoRA checkpoint saved with ``lora_merge_on_save``); None when there is none."""
    for folder in (checkpoint, checkpoint / "merged"):
        config = folder / "config.json"
        if not config.is_file():
            continue
        try:
            architectures = json.loads(config.read_text()).get("architectures") or []
        except (OSError, ValueError):
            continue
        if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
            return folder
    return None


def llm_task(folder: Path) -> str:
    """``llm/v1/chat`` when the tokenizer has a chat template, else ``llm/v1/completions``."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return CHAT
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return COMPLETIONS
    return CHAT if config.get("chat_template") else COMPLETIONS


def input_example(task: str) -> dict:
    if task == CHAT:
        return {"messages": [{"role": "user", "content": "What is 7 + 5?"}], "max_tokens": 32}
    return {"prompt": "Question: What is 7 + 5?\nAnswer:", "max_tokens": 32}


def pip_requirements() -> list[str]:
    """Pinned versions of the packages that load and run the model (local labels such as ``+cpu`` dropped)."""
    reqs = []
    for name in _PINNED:
        try:
            reqs.append(f"{name}=={metadata.version(name).split('+')[0]}")
        except metadata.PackageNotFoundError:
            pass
    return reqs


def _stage(folder: Path, dest: Path) -> None:
    """`dest` holds the model files of `folder` (hard links where possible, copies otherwise)."""
    dest.mkdir(parents=True)
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if rel.parts[0] in _NOT_SERVED or not path.is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)


def _model_card(manifest: dict, task: str):
    """A model card with the checkpoint's lineage (stage, base model, data, metrics) for the MLflow UI."""
    from huggingface_hub import ModelCard

    lines = ["---", "library_name: transformers", "tags: [alignflow]", "---", "# alignflow model", "",
             f"Task: `{task}`."]
    for key in ("stage", "base_model", "git_sha", "image", "image_digest", "created"):
        if manifest.get(key):
            lines.append(f"- {key}: `{manifest[key]}`")
    for split, info in (manifest.get("datasets") or {}).items():
        if isinstance(info, dict):
            lines.append(f"- {split} data: `{info.get('path')}` (fingerprint `{info.get('fingerprint')}`, "
                         f"{info.get('rows')} rows)")
    metrics = manifest.get("metrics") or {}
    if metrics:
        lines.append("- metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())
                                                if isinstance(v, int | float)))
    return ModelCard("\n".join(lines) + "\n")


def _tidy(saved: Path, model_name: str, manifest: dict) -> None:
    """MLflow records the staging folder (gone after logging) as the model's source name, which served
    responses echo as ``"model"``, and writes a hub-style license note for that path: name the model
    instead, and say where its license comes from."""
    from mlflow.models import Model

    mlmodel = Model.load(str(saved / "MLmodel"))
    mlmodel.flavors["transformers"]["source_model_name"] = model_name
    mlmodel.save(str(saved / "MLmodel"))
    base = manifest.get("base_model") or "its base model"
    (saved / "LICENSE.txt").write_text(f"{model_name} was post-trained by alignflow from {base}; it is under that "
                                       "model's license (alignflow adds no terms).\n")


def log_checkpoint_model(client, run_id: str, checkpoint: Path, model_name: str) -> str | None:
    """Log `checkpoint` as an MLflow transformers model of run `run_id`; returns the LoggedModel id.

    None (nothing logged) when the checkpoint holds no full causal LM (see `servable_folder`).
    `model_name` names the LoggedModel and the staged folder (so served responses name it)."""
    require("mlflow.transformers", extra="mlflow", feature="Logging the checkpoint as an MLflow model")
    import mlflow.transformers
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model

    folder = servable_folder(checkpoint)
    if folder is None:
        return None
    task = llm_task(folder)
    manifest_path = checkpoint / ckpt.MANIFEST
    manifest = ckpt.read_json(str(manifest_path)) if manifest_path.is_file() else {}
    experiment_id = client.get_run(run_id).info.experiment_id
    logged = client.create_logged_model(experiment_id, name=model_name, source_run_id=run_id,
                                        tags={"alignflow.task": task, "alignflow.stage": str(manifest.get("stage"))})
    try:
        with tempfile.TemporaryDirectory(prefix="alignflow-mlmodel-") as tmp:
            staged = Path(tmp, "checkpoint", model_name)
            _stage(folder, staged)
            if folder != checkpoint and manifest_path.is_file():  # the merged copy keeps the lineage too
                shutil.copy2(manifest_path, staged / ckpt.MANIFEST)
            mlflow_model = Model(artifact_path=logged.artifact_location, model_uuid=logged.model_id, run_id=run_id,
                                 model_id=logged.model_id)
            out = Path(tmp, "mlmodel")
            mlflow.transformers.save_model(
                transformers_model=str(staged), path=str(out), task=task, input_example=input_example(task),
                pip_requirements=pip_requirements(), model_card=_model_card(manifest, task), mlflow_model=mlflow_model)
            _tidy(out, model_name, manifest)
            client.log_model_artifacts(logged.model_id, str(out))
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
        client.finalize_logged_model(logged.model_id, "READY")
    except BaseException:
        try:
            client.finalize_logged_model(logged.model_id, "FAILED")
        except Exception:  # the original error is the one to report
            pass
        raise
    log.info("Logged %s as MLflow model %s (%s) of run %s.", checkpoint, logged.model_id, task, run_id)
    return logged.model_id


def checkpoint_folder(downloaded: str) -> str:
    """The checkpoint inside a downloaded MLflow transformers model (its ``model/`` folder); a
    downloaded plain checkpoint folder is returned as it is."""
    inner = Path(downloaded, MODEL_SUBDIR)
    if Path(downloaded, "MLmodel").is_file() and inner.is_dir():
        return str(inner)
    return downloaded
