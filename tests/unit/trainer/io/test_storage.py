"""trainer.io.storage on fsspec's in-memory filesystem (the S3 paths are tested against SeaweedFS in
tests/e2e)."""

import fsspec
import pytest

from trainer.io import storage


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


def test_remote_calls_retry_connection_errors_then_fail_in_one_line(monkeypatch):
    from botocore.exceptions import EndpointConnectionError

    slept = []
    monkeypatch.setattr(storage.time, "sleep", slept.append)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
        return "done"

    monkeypatch.setenv(storage.RETRY_ENV, "60")
    assert storage.retrying("s3://b/x", "read", flaky) == "done"
    assert len(calls) == 3 and slept == [1.0, 2.0]  # exponential backoff

    monkeypatch.setenv(storage.RETRY_ENV, "0")
    calls.clear()
    with pytest.raises(storage.StorageError) as err:
        storage.retrying("s3://b/x", "read", lambda: flaky() and flaky())
    assert "\n" not in str(err.value) and "did not answer for 0 s" in str(err.value)

    # Not a connection problem (a missing key, a denied request): no retry.
    calls.clear()

    def missing():
        calls.append(1)
        raise FileNotFoundError("s3://b/x")

    with pytest.raises(FileNotFoundError):
        storage.retrying("s3://b/x", "read", missing)
    assert len(calls) == 1
    # Local paths are never retried.
    with pytest.raises(ConnectionResetError):
        storage.retrying("/tmp/x", "read", lambda: (_ for _ in ()).throw(ConnectionResetError()))


def test_retry_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(storage.RETRY_ENV, raising=False)
    assert storage.retry_seconds() >= 120
    monkeypatch.setenv(storage.RETRY_ENV, "abc")
    with pytest.raises(storage.StorageError, match="not a number"):
        storage.retry_seconds()
