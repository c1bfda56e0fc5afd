"""trainer/checkpoint.py without a model: which write errors count as a full disk (`DiskFullError`, one line)."""

from __future__ import annotations

import errno

import pytest
import torch

from trainer import checkpoint as ckpt


class FailingModel(torch.nn.Linear):
    """A module whose save fails with `error` after writing part of its weights."""

    def __init__(self, error: Exception) -> None:
        super().__init__(4, 4)
        self.error = error

    def save_pretrained(self, folder, **_) -> None:
        (folder / "model.safetensors").write_bytes(b"partial")
        raise self.error


def test_a_no_space_error_is_one_line_and_the_unfinished_step_checkpoint_goes(tmp_path):
    dest = tmp_path / "run" / "checkpoint-2"
    error = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(ckpt.DiskFullError, match=r"checkpoint-2' while saving a checkpoint \(OSError\): it needs about"):
        ckpt.save_checkpoint(str(dest), FailingModel(error), None, {}, [])
    assert not dest.exists()


def test_any_other_error_on_a_roomy_disk_passes_through_and_leaves_the_folder(tmp_path):
    """A bug in a writer (here a RuntimeError, as torch.save raises on a full disk) is not called a full disk when
    the disk has room for the checkpoint; the unmarked folder stays for whoever debugs it."""
    dest = tmp_path / "run" / "checkpoint-2"
    with pytest.raises(RuntimeError, match="a bug"):
        ckpt.save_checkpoint(str(dest), FailingModel(RuntimeError("a bug")), None, {}, [])
    assert (dest / "model.safetensors").exists() and not ckpt.is_complete(str(dest))
