"""The Hugging Face Hub side of a final model: its model card (`README.md`) and `push_to_hub`.

Every final checkpoint carries a model card rendered from its manifest (`alignflow.json`): YAML
front matter the Hub reads (`library_name`, `base_model` and `datasets` when they are hub ids,
`tags: [alignflow, <stage>]`, `pipeline_tag`), then the stage, the command that reproduces the
run, the data with its fingerprints, the final metrics, the runtime and the full config.

`push_to_hub` / `hub_model_id` / `hub_private_repo` (TRL's names) upload the final folder with
`huggingface_hub` (`create_repo`, then `upload_folder`) after the final save; the token comes
from `HF_TOKEN` or `hf auth login`, and a run that asks to push without one stops before training
(`check_push`). `HF_ENDPOINT` points the client at another Hub (a mirror, or a test stand-in).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shlex
import tempfile
from pathlib import Path
from typing import Any

from trainer.io import storage

log = logging.getLogger(__name__)

CARD = "README.md"
# What the Hub never gets from an output folder: step checkpoints (resumable state lives there),
# DeepSpeed shards, write probes.
PUSH_IGNORE = ["checkpoint-*", "checkpoint-*/**", "deepspeed/**", "training_state/**", ".alignflow-write-probe-*"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_PIPELINE_TAG = {"reward": "text-classification"}  # every other stage writes a causal LM
_STAGE_TITLE = {"sft": "supervised fine-tuning (SFT)", "reward": "reward modelling (Bradley-Terry)",
                "dpo": "direct preference optimisation (DPO)", "grpo": "group relative policy optimisation (GRPO)",
                "ppo": "proximal policy optimisation (PPO)"}
# Config fields that describe where a run logged or ran, not what it trained: left out of the command.
_NOT_IN_COMMAND = {"mlflow_parent_run_id", "resume_from_checkpoint", "disable_progress_bar"}


def is_hub_id(spec: str | None) -> bool:
    """Whether `spec` names a Hub repo (`name` or `owner/name`), not a local path, s3:// prefix or alignflow name."""
    # `demo`: the built-in data; `split`: an eval set held out of the training data (`describe_datasets`).
    if not spec or spec in ("demo", "split") or storage.is_remote(spec) or spec.startswith(("models:/", "/", ".", "~")):
        return False
    return bool(_HUB_ID.match(spec)) and not Path(spec).exists()


# ----------------------------------------------------------------------------------------------
# The model card


def train_command(manifest: dict[str, Any], config_cls: type | None = None) -> str:
    """`alignflow train STAGE --field value ...` with every field whose value differs from the default in
    `config_cls` (the stage's config class; without it, every field is written)."""
    stage, config = manifest.get("stage", "?"), manifest.get("config", {})
    defaults = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(config_cls)} if config_cls else {}
    parts = ["alignflow", "train", stage]
    for name, value in config.items():
        if name in _NOT_IN_COMMAND or value is None or value == [] or (name in defaults and defaults[name] == value):
            continue  # (an empty list has no flag form; YAML overrides skip it the same way)
        values = value if isinstance(value, list) else [value]
        parts += [f"--{name}", *[str(v).lower() if isinstance(v, bool) else str(v) for v in values]]
    return shlex.join(parts)


def card_data(manifest: dict[str, Any]):
    """The card's YAML front matter (huggingface_hub's `ModelCardData`)."""
    from huggingface_hub import ModelCardData

    stage = manifest.get("stage", "")
    datasets = sorted({d["path"] for d in manifest.get("datasets", {}).values()
                       if isinstance(d, dict) and is_hub_id(d.get("path"))})
    base = manifest.get("base_model")
    config = manifest.get("config", {})
    return ModelCardData(
        library_name="transformers", base_model=base if is_hub_id(base) else None,
        tags=["alignflow", stage] + (["peft", "lora"] if config.get("lora_r") else []),
        datasets=datasets or None, pipeline_tag=_PIPELINE_TAG.get(stage, "text-generation"),
    )


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _image_note(manifest: dict[str, Any]) -> str:
    """`, in container image NAME (DIGEST)` when a container trained it (alignflow.json `image`, `image_digest`)."""
    if not manifest.get("image_digest"):
        return ""
    return f", in container image `{manifest.get('image', '?')}` (`{manifest['image_digest']}`)"


def _metric(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _usage(name: str, stage: str, adapter: bool) -> str:
    if stage == "reward":
        loader = "from transformers import AutoModelForSequenceClassification as Model"
    elif adapter:  # peft loads the adapter's base model, then the adapter
        loader = "from peft import AutoPeftModelForCausalLM as Model"
    else:
        loader = "from transformers import AutoModelForCausalLM as Model"
    chat = "" if stage == "reward" else f'```bash\nalignflow chat {shlex.quote(name)} --prompt "Hello"\n```\n\n'
    return (f"{chat}```python\n{loader}\nfrom transformers import AutoTokenizer\n\n"
            f'model = Model.from_pretrained("{name}")\ntokenizer = AutoTokenizer.from_pretrained("{name}")\n```')


def model_card(manifest: dict[str, Any], config_cls: type | None = None) -> str:
    """The whole `README.md` of a final checkpoint, from its manifest and its stage's config class."""
    from huggingface_hub import ModelCard

    stage, config = manifest.get("stage", "?"), manifest.get("config", {})
    name = config.get("hub_model_id") or Path(str(config.get("output_dir", "model")).rstrip("/")).name
    data_rows = [(split, f"`{d.get('path')}`", d.get("rows", "?"), f"`{d.get('fingerprint', '?')}`")
                 for split, d in manifest.get("datasets", {}).items() if isinstance(d, dict)]
    metric_rows = [(f"`{k}`", _metric(v)) for k, v in sorted(manifest.get("metrics", {}).items())]
    runtime = {k: manifest[k] for k in ("device", "world_size", "distributed_type", "mixed_precision",
                                        "zero_stage") if manifest.get(k) is not None}
    versions = ", ".join(f"{k} {v}" for k, v in manifest.get("versions", {}).items())
    adapter = bool(config.get("lora_r"))
    body = f"""
# {name}

A model trained with alignflow: stage **{_STAGE_TITLE.get(stage, stage)}**, {manifest.get('step', '?')} optimizer
steps, starting from `{manifest.get('base_model', '?')}`{' (a LoRA adapter on it)' if adapter else ''}. Written
{manifest.get('created', '?')}{f" from git commit `{manifest['git_sha']}`" if manifest.get('git_sha') else ''}{_image_note(manifest)}.

## Use

{_usage(name, stage, adapter)}

## Training command

```bash
{train_command(manifest, config_cls)}
```

## Data

{_table(("split", "path", "rows", "fingerprint"), data_rows) if data_rows else "(not recorded)"}

## Final metrics

{_table(("metric", "value"), metric_rows) if metric_rows else "(none logged)"}

## Runtime

{", ".join(f"{k}: {v}" for k, v in runtime.items()) or "(not recorded)"}

Versions: {versions or "(not recorded)"}

<details><summary>Full config</summary>

```json
{json.dumps(config, indent=2, sort_keys=True, default=str)}
```

</details>
"""
    return ModelCard(f"---\n{card_data(manifest).to_yaml()}\n---\n{body}").content


# ----------------------------------------------------------------------------------------------
# Pushing


def hub_token() -> str | None:
    """The Hub token huggingface_hub would use: HF_TOKEN, or the one saved by `hf auth login`."""
    from huggingface_hub import get_token

    return get_token()


def check_push(config: Any) -> None:
    """Before any training: a run that will push needs a token (one line, the fix in it)."""
    from trainer.errors import ConfigError

    if getattr(config, "push_to_hub", False) and not hub_token():
        raise ConfigError("`push_to_hub` is true but no Hugging Face token is set: export HF_TOKEN (a write token; in "
                          "a pipeline on a cluster, the Kubernetes Secret alignflow-hf) or run `hf auth login`, or pass "
                          "--push_to_hub false.")


def repo_name(config: Any) -> str:
    """`hub_model_id`, or (as TRL does) the output folder's name in the token owner's namespace."""
    return config.hub_model_id or Path(config.output_dir.rstrip("/")).name


def _local_final_model(output_dir: str, workdir: str) -> str:
    """A local folder holding the final model's files: `output_dir` itself, or the files its marker
    lists downloaded from s3:// (not the step checkpoints beside them)."""
    if not storage.is_remote(output_dir):
        return output_dir
    from trainer.engine.checkpoint import COMPLETE_MARKER, read_json

    marker = storage.join(output_dir, COMPLETE_MARKER)
    for entry in read_json(marker)["files"]:
        storage.fetch_to_local(storage.join(output_dir, entry["path"]), Path(workdir, entry["path"]))
    storage.fetch_to_local(marker, Path(workdir, COMPLETE_MARKER))
    return workdir


def push_to_hub(output_dir: str, repo_id: str, private: bool = False, token: str | None = None) -> str:
    """Create the repo (when missing) and upload the final model folder with its card; returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="alignflow-push-") as workdir:
        folder = _local_final_model(output_dir, workdir)
        repo = api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(repo_id=repo.repo_id, folder_path=folder, ignore_patterns=PUSH_IGNORE,
                                   commit_message=f"alignflow: upload {Path(output_dir.rstrip('/')).name}")
    log.info("Pushed %s to %s (%s)", output_dir, repo.repo_id, commit.commit_url)
    return commit.commit_url
