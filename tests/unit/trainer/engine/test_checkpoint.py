"""trainer/engine/checkpoint.py without a model: which write errors count as a full disk (`DiskFullError`, one line)."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer.engine import checkpoint as ckpt


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


class FailingEngine:
    """A DeepSpeed engine's `save_checkpoint` that fails with `error` after writing part of a shard."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def save_checkpoint(self, folder, tag, save_latest) -> None:
        (Path(folder) / tag).mkdir(parents=True)
        (Path(folder) / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"partial")
        raise self.error


def zero_accelerator():
    return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=object()), process_index=0)


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64")])
def test_a_zero_shard_on_a_full_disk_is_one_line_and_the_unfinished_step_checkpoint_goes(error, tmp_path, monkeypatch):
    """Every DeepSpeed rank writes its ZeRO shard into the step checkpoint before rank 0 writes the rest. torch.save's
    RuntimeError carries no errno: with under 1 MiB left on the disk after it, it is a full disk too."""
    from trainer.engine import distributed

    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: SimpleNamespace(free=4096))
    step = tmp_path / "run" / "checkpoint-4"
    with pytest.raises(ckpt.DiskFullError, match=rf"'{step}' while saving a checkpoint \({type(error).__name__}\): "
                                                 r"0\.0 MiB is free there\. .*larger volume"):
        distributed.save_engine_state(zero_accelerator(), FailingEngine(error), str(step))
    assert not step.exists()


def test_a_zero_shard_error_on_a_roomy_disk_passes_through(tmp_path):
    from trainer.engine import distributed

    step = tmp_path / "run" / "checkpoint-4"
    with pytest.raises(RuntimeError, match="a bug"):
        distributed.save_engine_state(zero_accelerator(), FailingEngine(RuntimeError("a bug")), str(step))
    assert (step / "deepspeed" / "state").is_dir()


def test_a_full_tmpdir_while_staging_an_object_store_checkpoint_is_one_line_naming_tmpdir(tmp_path, monkeypatch):
    """An `s3://` (here fsspec's `memory://`) checkpoint is written under TMPDIR first: a full TMPDIR is the same one
    line, naming the staging folder and TMPDIR; the staging folder is removed and nothing is marked complete."""
    import tempfile

    from trainer.engine import distributed
    from trainer.io import storage

    staging = tmp_path / "tmpdir"
    staging.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging))
    dest = f"memory://bucket/{tmp_path.name}/run/checkpoint-2"
    error = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(ckpt.DiskFullError, match=rf"the local staging folder '{staging}/alignflow-ckpt-\w+' of "
                                                 rf"'{dest}' .*point TMPDIR at a larger volume"):
        ckpt.save_checkpoint(dest, FailingModel(error), None, {}, [])
    with pytest.raises(ckpt.DiskFullError, match=rf"the local staging folder '{staging}/alignflow-zero-rank0-\w+' of "
                                                 rf"'{dest}' .*point TMPDIR at a larger volume"):
        distributed.save_engine_state(zero_accelerator(), FailingEngine(error), dest)
    assert not list(staging.iterdir())
    assert not ckpt.is_complete(dest) and not storage.filesystem(dest).exists(dest)


def test_saving_a_model_loads_neither_deepspeed_nor_mlflow(tmp_path):
    """transformers' `save_pretrained` unwraps with accelerate's helper, which imports DeepSpeed (and MLflow with it)
    to recognise its engine: a second of every run that uses neither. A fresh process saves a whole checkpoint
    without them."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from trainer.engine import checkpoint as ckpt\n"
        "model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,"
        " num_attention_heads=2, num_key_value_heads=2))\n"
        f"ckpt.save_checkpoint({str(tmp_path / 'out')!r}, model, None, {{}}, [])\n"
        "print(sorted(m for m in ('deepspeed', 'mlflow') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert ckpt.is_complete(str(tmp_path / "out")) and (tmp_path / "out" / "model.safetensors").stat().st_size > 1000


def test_a_model_loaded_by_the_zero3_loader_is_saved_under_its_own_tensor_names(tmp_path):
    """transformers' ZeRO-3 loader attaches every key renaming it tried to the model, the legacy
    `LayerNorm.gamma -> LayerNorm.weight` among them, and `save_pretrained` reverts each attached one. A BERT
    checkpoint is saved with the names of its model, as without ZeRO-3 (a real ZeRO-3 load and save:
    tests/e2e/test_ranks.py::test_padding_free_two_ranks_under_zero3_match_one[reward-encoder])."""
    from safetensors.torch import load_file
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.conversion_mapping import get_model_conversion_mapping

    model = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32, num_labels=1))
    # What `integrations.deepspeed._load_state_dict_into_zero3_model` keeps: the whole mapping, none of it used.
    model._weight_conversions = get_model_conversion_mapping(model)
    assert any("gamma" in str(c.source_patterns) for c in model._weight_conversions)  # (the legacy renaming)
    ckpt.save_checkpoint(str(tmp_path / "out"), model, None, {}, [])
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert saved.keys() == model.state_dict().keys()
    assert "bert.embeddings.LayerNorm.weight" in saved
