"""Object-store faults against a real SeaweedFS: the server is SIGKILLed in the middle of a checkpoint
upload (after its third file). Restarted within the retry budget, the upload completes and the
checkpoint verifies; left down past the budget, the save fails with one line and the previous
checkpoint stays the newest complete one."""

import logging
import threading
import time

import pytest
import torch

from trainer.engine import checkpoint as ckpt
from trainer.engine.models import load_causal_lm, load_tokenizer
from trainer.io import storage


@pytest.fixture
def faulty_s3(restartable_s3, monkeypatch):
    """The restartable store, up, with the environment pointing at it; started again after the test."""
    if not restartable_s3.running:
        restartable_s3.start()
    for key, value in restartable_s3.server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield restartable_s3
    if not restartable_s3.running:
        restartable_s3.start()


def kill_during_upload(monkeypatch, s3, after_files: int, down_for: float | None) -> dict:
    """Kill `s3` right after the `after_files`-th file of an upload; start it again `down_for` s later
    (None: leave it down). Returns timings (filled in as it happens)."""
    timings: dict = {}
    real_filesystem = storage.filesystem
    uploaded = []

    def filesystem(uri):
        fs = real_filesystem(uri)
        original = fs.put_file

        def put_file(lpath, rpath, *args, **kwargs):
            result = original(lpath, rpath, *args, **kwargs)
            uploaded.append(rpath)
            if len(uploaded) == after_files:
                s3.kill()
                timings["killed"] = time.monotonic()
                if down_for is not None:
                    def restart():
                        s3.start()
                        timings["up"] = time.monotonic()

                    # The upload may succeed as soon as the store answers, before start() returns:
                    # tests join this timer before reading timings["up"].
                    timings["restart"] = threading.Timer(down_for, restart)
                    timings["restart"].start()
            return result

        fs.put_file = put_file
        return fs

    monkeypatch.setattr(storage, "filesystem", filesystem)
    return timings


def save(model, tokenizer, dest: str, step: int) -> None:
    state = ckpt.TrainState(global_step=step)
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt.save_checkpoint(dest, model=model, tokenizer=tokenizer, manifest={"step": step}, history=[],
                         state=state, optimizer=optimizer)


def test_upload_survives_a_20s_outage(tiny_model, faulty_s3, monkeypatch, caplog):
    out = f"s3://{faulty_s3.server.bucket}/survive-{time.time_ns()}"
    model, tokenizer = load_causal_lm(tiny_model), load_tokenizer(tiny_model)
    save(model, tokenizer, ckpt.step_dir(out, 1), 1)
    monkeypatch.setenv(storage.RETRY_ENV, "120")
    timings = kill_during_upload(monkeypatch, faulty_s3, after_files=3, down_for=20)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="trainer.io.storage"):
        save(model, tokenizer, ckpt.step_dir(out, 2), 2)
    finished = time.monotonic()
    if "restart" in timings:
        timings.pop("restart").join(60)
    monkeypatch.undo()
    for key, value in faulty_s3.server.env().items():
        monkeypatch.setenv(key, value)
    assert "killed" in timings and "up" in timings, timings
    assert timings["up"] - timings["killed"] >= 20
    assert any("retrying" in r.getMessage() for r in caplog.records), "no retry was logged"
    assert [s for s, _ in ckpt.list_checkpoints(out, verify=True)] == [1, 2]
    local = ckpt.resolve_resume("auto", out, fetch=True)  # downloads and checks every sha256
    assert local and ckpt.verify_checkpoint(local) == []
    print(f"outage {timings['up'] - timings['killed']:.1f} s; save took {finished - started:.1f} s; "
          f"completed {finished - timings['up']:.1f} s after the store came back")


def test_outage_past_the_budget_fails_in_one_line_and_keeps_the_previous_checkpoint(tiny_model, faulty_s3,
                                                                                      monkeypatch):
    out = f"s3://{faulty_s3.server.bucket}/down-{time.time_ns()}"
    model, tokenizer = load_causal_lm(tiny_model), load_tokenizer(tiny_model)
    save(model, tokenizer, ckpt.step_dir(out, 1), 1)
    monkeypatch.setenv(storage.RETRY_ENV, "5")
    timings = kill_during_upload(monkeypatch, faulty_s3, after_files=3, down_for=None)
    with pytest.raises(storage.StorageError) as err:
        save(model, tokenizer, ckpt.step_dir(out, 2), 2)
    failed = time.monotonic()
    message = str(err.value)
    assert "\n" not in message and "did not answer for 5 s" in message and storage.RETRY_ENV in message
    assert failed - timings["killed"] < 60
    print(f"failed {failed - timings['killed']:.1f} s after the kill with: {message}")

    monkeypatch.undo()
    for key, value in faulty_s3.server.env().items():
        monkeypatch.setenv(key, value)
    faulty_s3.start()
    assert not ckpt.is_complete(ckpt.step_dir(out, 2))
    assert [s for s, _ in ckpt.list_checkpoints(out, verify=True)] == [1]
    assert ckpt.resolve_resume("auto", out) == ckpt.step_dir(out, 1)


def test_a_training_run_survives_a_20s_outage_mid_checkpoint(tiny_model, faulty_s3, monkeypatch, tmp_path):
    """The whole stage: SFT saving every step to the store, which dies during the second checkpoint's upload."""
    from tests.helpers import history
    from trainer.stages.sft import SFTConfig, run_sft

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = f"s3://{faulty_s3.server.bucket}/run-{time.time_ns()}"
    monkeypatch.setenv(storage.RETRY_ENV, "120")
    timings = kill_during_upload(monkeypatch, faulty_s3, after_files=16, down_for=20)
    started = time.monotonic()
    run_sft(SFTConfig(model=tiny_model, dataset="demo", output_dir=out, max_steps=4, per_device_batch_size=8,
                      learning_rate=3e-3, logging_steps=1, max_length=128, num_sample_completions=0,
                      disable_progress_bar=True, save_steps=1, save_total_limit=0))
    took = time.monotonic() - started
    assert "up" in timings, "the store was never killed and restarted"
    assert ckpt.is_complete(out) and ckpt.verify_checkpoint(out) == []
    assert [s for s, _ in ckpt.list_checkpoints(out, verify=True)] == [1, 2, 3]
    assert [r["step"] for r in history(out)] == [1, 2, 3, 4]
    print(f"run with a {timings['up'] - timings['killed']:.1f} s outage took {took:.1f} s")
