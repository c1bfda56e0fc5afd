"""trainer.storage on fsspec's in-memory filesystem (the S3 paths are tested against SeaweedFS in
tests/integration)."""

import fsspec

from trainer import storage


def test_ranks_on_one_node_fetch_into_their_own_folders(tmp_path, monkeypatch):
    fs = fsspec.filesystem("memory")
    fs.pipe({"/ckpt/model.safetensors": b"weights", "/ckpt/sub/config.json": b"{}"})
    monkeypatch.setenv("ALIGNFLOW_CACHE", str(tmp_path))
    fetched = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        fetched[rank] = storage.fetch_to_local("memory://ckpt")
    monkeypatch.delenv("LOCAL_RANK")
    fetched["single"] = storage.fetch_to_local("memory://ckpt")
    assert len(set(fetched.values())) == 3
    for path in fetched.values():
        assert open(f"{path}/model.safetensors", "rb").read() == b"weights"
        assert open(f"{path}/sub/config.json", "rb").read() == b"{}"
