"""The rollout server's staging of weight chunks (trainer/rollout/server.py `WeightStage`): chunks sent as HTTP blobs
and as files moved from /dev/shm are staged alike, and an update that lacks weights is named. No vLLM needed."""

import torch
from safetensors.torch import save, save_file

from trainer.rollout.server import WeightStage


def test_blobs_and_moved_files_are_staged_alike_and_missing_weights_are_named(tmp_path):
    stage = WeightStage(frozenset({"a", "b", "c"}))
    assert stage.missing() == ["a", "b", "c"] and not stage.updating
    blob = save({"a": torch.ones(3)})
    assert stage.add(blob) == 1
    source = tmp_path / "chunk.safetensors"
    save_file({"b": torch.zeros(2, 2)}, str(source))
    size = source.stat().st_size
    assert stage.add_file(source) == 1
    assert not source.exists()  # moved, not copied
    assert stage.updating and stage.names == {"a", "b"} and stage.bytes == len(blob) + size
    assert [p.name for p in stage.files] == ["00000.safetensors", "00001.safetensors"]
    assert all(p.parent == stage.dir and p.is_file() for p in stage.files)
    assert stage.missing() == ["c"]
    assert stage.missing(["a", "b", "c"]) == [] and stage.missing(["c"]) == ["a", "b"]
    assert stage.incomplete(["c"]) == ("a weight update needs every weight of the model; 1 of 3 missing "
                                       "(e.g. ['c'])")
    folder = stage.dir
    stage.clear()
    assert not folder.exists() and stage.dir is None and not stage.names and stage.bytes == 0 and not stage.updating
