"""Run identity: what makes a checkpoint's run the same run as the one being started.

Every checkpoint's manifest (`alignflow.json`) records `identity`: the stage, the base model (its
path and a content digest), the training data's fingerprint, the seed, the LoRA configuration and
every option that changes the trained weights. `resume_from_checkpoint` (a path, or `auto`)
continues a run only when the recorded identity equals this run's; otherwise it stops before any
model loads with one line naming each difference (`old -> new`). `resume_allow_changes` continues
anyway, on purpose, and the manifest then records the changes (`resume_changes`). A checkpoint of
another stage is never continued.

Not part of the identity: where the run writes and how it is watched (output_dir, logging, saving,
MLflow, the Hub, progress bars, sample completions), how it is spread over devices when that does not
change the update (DeepSpeed, and the process count of SFT, reward and DPO, whose ranks together take
one process's update: the global batch is compared instead), paths of the data (the rows are: the
same rows moved elsewhere are the same run) and the run's length (`max_steps`, `num_epochs`: a
longer or shorter plan of the same run, with a warning). docs/reliability.md gives the rules.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

# Config fields that never change the trained weights, or that are compared in another form.
NOT_IDENTITY = frozenset({
    "model",  # compared as `model` (path and content digest)
    "dataset", "dataset_config", "dataset_split", "dataset_mixture", "eval_split_ratio",  # as `data`: the rows
    "eval_dataset", "eval_steps", "output_dir", "resume_from_checkpoint", "resume_allow_changes",
    "max_steps", "num_epochs",  # the length: a warning, not a different run
    "num_processes", "deepspeed", "gradient_checkpointing", "trust_remote_code", "disable_progress_bar",
    "dataset_num_proc",  # how many processes tokenize: the same tokens
    "save_steps", "save_minutes", "save_total_limit", "stop_budget_seconds", "logging_steps", "lora_merge_on_save",
    "report_to", "mlflow_tracking_uri", "mlflow_experiment", "mlflow_run_name", "mlflow_parent_run_id",
    "mlflow_tags", "mlflow_log_checkpoint", "push_to_hub", "hub_model_id", "hub_private_repo",
    "num_sample_completions", "sample_max_new_tokens", "log_completions_steps", "num_completions_to_log",
    "precompute_ref_batch_size", "vllm_gpu_memory_utilization", "vllm_server_devices",
    "vllm_server_host", "vllm_server_port", "vllm_server_base_url", "vllm_server_timeout",  # where rollouts run
    "vllm_group_port",  # how weights reach the rollout server
    "vllm_enable_sleep_mode",  # where vLLM's memory is during the update
    "dataset_test_split", "per_device_eval_batch_size",  # what is evaluated, and in which batches
    "use_cpu", "ddp_timeout", "ddp_find_unused_parameters",  # the devices and how long ranks wait for each other
})
LENGTH = ("max_steps", "num_epochs")
LORA_DETAILS = ("lora_alpha", "lora_dropout", "lora_target_modules")  # compared only when LoRA is on
# Stages whose N ranks take exactly one process's update at N times the per-device batch
# (`StageRunner.rank_batches`): for them the global batch is the identity, not the process count.
WORLD_INVARIANT = frozenset({"sft", "reward", "dpo"})

# Model files hashed whole up to this size; larger ones by their size and first and last MiB, so
# that a 7B model's digest costs milliseconds, not a full read (a retrained model of the same shape
# differs in those bytes as well).
FULL_HASH_BYTES = 64 << 20
_SAMPLE = 1 << 20
# Not content of the model: alignflow's bookkeeping, step checkpoints and shards beside a final
# model, a merged copy derived from an adapter, hidden folders (the hub's .cache).
_SKIPPED = frozenset({"alignflow.json", "alignflow.complete", "metrics.jsonl", "README.md", "training_state",
                      "deepspeed", "merged"})


def model_digest(path: str | None) -> str | None:
    """A content digest of a local model folder (`sha256-` + 16 hex digits), or None for a hub id.

    Every file counts by its relative path and size; files up to FULL_HASH_BYTES by their whole
    content, larger ones by their first and last MiB."""
    folder = Path(path) if path else None
    if folder is None or not folder.is_dir():
        return None
    digest = hashlib.sha256()
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED and not d.startswith((".", "checkpoint-")))
        for name in sorted(names):
            if name in _SKIPPED or name.startswith("."):
                continue
            file = Path(root, name)
            size = file.stat().st_size
            part = hashlib.sha256()
            with open(file, "rb") as fh:
                if size <= FULL_HASH_BYTES:
                    while chunk := fh.read(1 << 20):
                        part.update(chunk)
                else:
                    part.update(fh.read(_SAMPLE))
                    fh.seek(size - _SAMPLE)
                    part.update(fh.read(_SAMPLE))
            digest.update(f"{file.relative_to(folder).as_posix()}\0{size}\0{part.hexdigest()}\n".encode())
    return "sha256-" + digest.hexdigest()[:16]


def _plain(value: Any) -> Any:
    """`value` as it reads back from a manifest (tuples become lists, ...)."""
    return json.loads(json.dumps(value, default=str))


def run_identity(stage: str, values: dict[str, Any], world: int | None, model_path: str | None = None,
                 data: str | None = None, model_hash: str | None = None) -> dict[str, Any]:
    """The identity of a run of `stage` with config `values` (a config as a dict) on `world` processes;
    `model_path`, the local folder of `values["model"]`, is hashed (or `model_hash` given); `data` is the
    training rows' fingerprint (`trainer.data.sources.dataset_fingerprint`)."""
    identity: dict[str, Any] = {"stage": stage, "model": {"path": values.get("model"),
                                                          "digest": model_hash or model_digest(model_path)}}
    if data:
        identity["data"] = data
    lora = bool(values.get("lora_r"))
    options = {}
    for name, value in sorted(values.items()):
        if name in NOT_IDENTITY or (name in LORA_DETAILS and not lora):
            continue
        options[name] = value
    if world is not None:
        if stage in WORLD_INVARIANT and "per_device_batch_size" in options:
            options["global_batch_size"] = options.pop("per_device_batch_size") * world
        else:
            options["processes"] = world
    identity.update(_plain(options))
    return identity


def manifest_identity(manifest: dict[str, Any]) -> dict[str, Any]:
    """The identity a manifest records; for one written before identities were recorded, what its stage,
    config, world size and data fingerprint tell (its model's content is unknown: not compared)."""
    if "identity" in manifest:
        return manifest["identity"]
    fingerprint = str(manifest.get("datasets", {}).get("train", {}).get("fingerprint") or "")
    # Older manifests hold datasets' cache fingerprint, which changes with every download: not comparable.
    identity = run_identity(manifest.get("stage", "?"), manifest.get("config", {}), manifest.get("world_size"),
                            data=fingerprint if fingerprint.startswith("sha256-") else None)
    identity.pop("model")
    return identity


@dataclasses.dataclass
class Change:
    """One identity field that differs between a checkpoint's run and this one."""

    field: str
    old: Any
    new: Any

    def __str__(self) -> str:
        if self.field == "model":
            old, new = self.old or {}, self.new or {}
            if old.get("path") == new.get("path"):
                return f"model {new.get('path')}: its content changed ({old.get('digest')} -> {new.get('digest')})"
            return f"model {old.get('path')} ({old.get('digest')}) -> {new.get('path')} ({new.get('digest')})"
        if self.field == "data":
            return f"training data fingerprint {self.old} -> {self.new}"
        if self.field == "global_batch_size":
            return f"global batch (per_device_batch_size x processes) {self.old!r} -> {self.new!r}"
        if self.old is None:
            return f"{self.field} (not set) -> {self.new!r}"
        if self.new is None:
            return f"{self.field} {self.old!r} -> (not set)"
        return f"{self.field} {self.old!r} -> {self.new!r}"


def _same_model(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Same content when both digests are known (the path may differ: a copy, a pipeline's download);
    else the same path (a hub id)."""
    if old.get("digest") and new.get("digest"):
        return old["digest"] == new["digest"]
    return not (old.get("digest") or new.get("digest")) and old.get("path") == new.get("path")


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """The fields of identity `new` that differ from `old`, stage first. A field only one side records (an
    option added to alignflow since, a fingerprint an older manifest lacks, LoRA details of a run without
    LoRA) is not compared."""
    changes = []
    for name in dict.fromkeys(("stage", "model", "data", "seed", "lora_r", *sorted(new))):
        if name not in old or name not in new:
            continue
        same = _same_model(old[name], new[name]) if name == "model" else old[name] == new[name]
        if not same:
            changes.append(Change(name, old[name], new[name]))
    return changes


def length_changes(manifest: dict[str, Any], values: dict[str, Any]) -> list[Change]:
    """`max_steps` / `num_epochs` changed since the checkpoint: a longer or shorter plan of the same run."""
    saved = manifest.get("config", {})
    return [Change(name, saved[name], values[name]) for name in LENGTH
            if name in saved and name in values and saved[name] != values[name]]
