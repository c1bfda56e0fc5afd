"""Checkpoint integrity and `resume_from_checkpoint auto`: the marker lists every file's size and
sha256, a corrupt checkpoint is passed over (auto) or refused (explicit path), a finished run is
recognised, and a changed run is refused (each identity field: tests/stage/test_resume_identity.py)."""

import json
import logging
import shutil
from pathlib import Path

import pytest

from tests.helpers import history, write_jsonl
from trainer.cli.main import main
from trainer.engine import checkpoint as ckpt
from trainer.stages.sft import SFTConfig, run_sft


def sft_config(model: str, out: Path, **overrides) -> SFTConfig:
    values = dict(model=model, dataset="demo", output_dir=str(out), max_steps=6, per_device_batch_size=8,
                  learning_rate=3e-3, logging_steps=1, max_length=128, num_sample_completions=0,
                  disable_progress_bar=True, save_steps=2, save_total_limit=0)
    values.update(overrides)
    return SFTConfig(**values)


def marker(folder: Path) -> dict:
    return json.loads((folder / ckpt.COMPLETE_MARKER).read_text())


@pytest.fixture(scope="module")
def four_steps(tiny_model, tmp_path_factory) -> Path:
    """A finished 4-step run with its step checkpoint 2 (`sft_config(max_steps=4)`). Tests that change it copy it."""
    out = tmp_path_factory.mktemp("four-steps") / "run"
    run_sft(sft_config(tiny_model, out, max_steps=4))
    return out


def test_marker_lists_sizes_and_hashes_and_auto_passes_over_a_truncated_file(tiny_model, tmp_path, caplog):
    out = tmp_path / "run"
    run_sft(sft_config(tiny_model, out))
    newest = out / "checkpoint-4"
    listed = {f["path"]: f for f in marker(newest)["files"]}
    weights = newest / "model.safetensors"
    assert listed["model.safetensors"]["size"] == weights.stat().st_size
    assert "training_state/optimizer.pt" in listed and ckpt.MANIFEST in listed
    # The final model's marker lists its own files, not the step checkpoints beside them.
    assert not any(p.startswith("checkpoint-") for p in (f["path"] for f in marker(out)["files"]))
    assert ckpt.verify_checkpoint(str(newest)) == []

    # A file cut short under a marker (a disk that filled up, a copy that stopped).
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert "model.safetensors has" in ckpt.verify_checkpoint(str(newest))[0]
    with caplog.at_level(logging.WARNING, logger="trainer.engine.checkpoint"):
        assert ckpt.resolve_resume("auto", str(out)) == str(out / "checkpoint-2")
    assert any("checkpoint-4 is corrupt" in r.getMessage() for r in caplog.records)
    assert [s for s, _ in ckpt.list_checkpoints(str(out), verify=True)] == [2]
    assert [s for s, _ in ckpt.list_checkpoints(str(out))] == [2, 4]  # the plain listing reads markers only
    with pytest.raises(ckpt.CheckpointError, match="corrupt: model.safetensors has"):
        ckpt.resolve_resume(str(newest), str(out))

    # Same size, different bytes: only the hash sees it.
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(flipped))
    assert ckpt.verify_checkpoint(str(newest)) == ["model.safetensors does not match its sha256 in the marker"]
    assert ckpt.verify_checkpoint(str(newest), hashes=False) == []

    # A longer run resumes from checkpoint-2, rewrites checkpoint-4 and finishes; with save_total_limit
    # 1 the corrupt newer checkpoint never pushes out the one just written.
    run_sft(sft_config(tiny_model, out, max_steps=8, save_total_limit=1, resume_from_checkpoint="auto"))
    assert [r["step"] for r in history(out)] == list(range(1, 9))
    assert [s for s, _ in ckpt.list_checkpoints(str(out), verify=True)] == [6]


def test_markers_without_a_file_list_still_count(four_steps, tmp_path):
    out = tmp_path / "old"
    shutil.copytree(four_steps, out)
    (out / "checkpoint-2" / ckpt.COMPLETE_MARKER).write_text(json.dumps({"step": 2, "time": 0}))
    assert ckpt.verify_checkpoint(str(out / "checkpoint-2")) == []
    assert ckpt.resolve_resume("auto", str(out)) == str(out / "checkpoint-2")
    (out / "checkpoint-2" / ckpt.COMPLETE_MARKER).write_text("not json")
    assert "unreadable" in ckpt.verify_checkpoint(str(out / "checkpoint-2"))[0]


def cli(model: str, out: Path, *extra: str) -> list[str]:
    return ["train", "sft", "--model", model, "--dataset", "demo", "--output_dir", str(out), "--max_steps", "4",
            "--save_steps", "2", "--per_device_batch_size", "8", "--learning_rate", "0.003", "--max_length", "128",
            "--num_sample_completions", "0", "--disable_progress_bar", "true", "--logging_steps", "1", *extra]


def test_rerunning_a_finished_run_with_auto_trains_nothing(tiny_model, tmp_path, capsys):
    out = tmp_path / "done"
    assert main(cli(tiny_model, out, "--resume_from_checkpoint", "auto")) == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(cli(tiny_model, out, "--resume_from_checkpoint", "auto")) == 0
    said = capsys.readouterr().out
    assert "already holds this run's finished model (step 4" in said and "Saved to" not in said
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before, "files were rewritten"
    # The library call says so with an exception (the CLI turns it into exit 0).
    with pytest.raises(ckpt.RunFinished):
        run_sft(sft_config(tiny_model, out, max_steps=4, per_device_batch_size=8, resume_from_checkpoint="auto"))
    # A longer plan is not finished: it continues from the newest step checkpoint.
    assert main(cli(tiny_model, out, "--resume_from_checkpoint", "auto", "--max_steps", "5")) == 0
    assert [r["step"] for r in history(out)] == [1, 2, 3, 4, 5]


def test_auto_and_an_explicit_path_refuse_a_changed_run_unless_changes_are_allowed(tiny_model, tmp_path, capsys,
                                                                                  caplog):
    out = tmp_path / "changed"
    data = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"Say {w}.", "completion": f" {w}"}
                                                  for w in ["red", "green", "blue", "pink"] * 8])
    run_sft(sft_config(tiny_model, out, dataset=data, max_steps=4))
    weights = (out / "model.safetensors").read_bytes()
    capsys.readouterr()

    # A new learning rate: one line, exit 2, nothing trained or overwritten.
    assert main(cli(tiny_model, out, "--dataset", data, "--learning_rate", "0.01",
                    "--resume_from_checkpoint", "auto")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "different run (learning_rate 0.003 -> 0.01)" in err
    assert "already holds" not in err and "--resume_allow_changes true" in err

    # New rows in the same file: the fingerprint differs.
    write_jsonl(Path(data), [{"prompt": f"Say {w}.", "completion": f" {w}"} for w in ["gold", "cyan"] * 16])
    with pytest.raises(ckpt.CheckpointError, match="training data fingerprint"):
        run_sft(sft_config(tiny_model, out, dataset=data, max_steps=4, resume_from_checkpoint="auto"))
    assert (out / "model.safetensors").read_bytes() == weights
    assert ckpt.is_complete(str(out))

    # Naming the checkpoint is refused the same way; `resume_allow_changes` continues it, loudly and on record.
    changed = dict(dataset=data, max_steps=4, learning_rate=0.01, resume_from_checkpoint=str(out / "checkpoint-2"))
    with pytest.raises(ckpt.CheckpointError, match="that checkpoint is from a different run .*fingerprint.*learning"):
        run_sft(sft_config(tiny_model, tmp_path / "branch", **changed))
    with caplog.at_level(logging.WARNING, logger="trainer.engine.runner"):
        run_sft(sft_config(tiny_model, tmp_path / "branch", resume_allow_changes=True, **changed))
    warned = [r.getMessage() for r in caplog.records if "RESUMING A CHANGED RUN" in r.getMessage()]
    assert any("learning_rate" in w and "fingerprint" in w for w in warned)
    assert [r["step"] for r in history(tmp_path / "branch")] == [1, 2, 3, 4]
    manifest = json.loads((tmp_path / "branch" / ckpt.MANIFEST).read_text())
    assert manifest["resumed_from"] == str(out / "checkpoint-2")
    assert {c["field"]: (c["old"], c["new"]) for c in manifest["resume_changes"]}["learning_rate"] == (0.003, 0.01)


class _RunsCode:
    """A pickle whose loading would run code (it creates the file named by `path`)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.mark.parametrize("target", ["training_state/optimizer.pt", "training_state/scheduler.pt",
                                    "training_state/rng.pt"])
def test_a_crafted_pickle_in_a_checkpoint_is_refused_not_run(target, tiny_model, four_steps, tmp_path, capsys):
    """Someone who can write to a run's output prefix plants a pickle that runs code, and rewrites
    the marker to match: resuming (as pipelines do, with `auto`) refuses it in one line and exits 2;
    the code never runs and no final model is written."""
    import torch

    out = tmp_path / "run"
    shutil.copytree(four_steps, out)  # sft_config(max_steps=4): the run the command line below continues
    ckpt_dir, ran = out / "checkpoint-2", tmp_path / "code-ran"
    for name in (ckpt.COMPLETE_MARKER, "model.safetensors", "alignflow.json"):  # back to "killed after step 2"
        (out / name).unlink()
    torch.save({"state": _RunsCode(str(ran))}, ckpt_dir / target)
    data = marker(ckpt_dir)
    data["files"] = ckpt.file_list(ckpt_dir)  # the attacker makes the marker agree
    (ckpt_dir / ckpt.COMPLETE_MARKER).write_text(json.dumps(data))

    argv = ["train", "sft", "--model", tiny_model, "--dataset", "demo", "--output_dir", str(out), "--max_steps", "4",
            "--per_device_batch_size", "8", "--learning_rate", "3e-3", "--logging_steps", "1", "--max_length", "128",
            "--num_sample_completions", "0", "--disable_progress_bar", "true", "--save_steps", "2",
            "--save_total_limit", "0", "--resume_from_checkpoint", "auto"]
    code = main(argv)
    err = capsys.readouterr().err
    assert not ran.exists(), "the crafted pickle ran"
    if target.endswith("rng.pt"):  # not read at all any more (rng.json replaced it): the run resumes and finishes
        assert code == 0 and ckpt.is_complete(str(out))
        return
    assert code == 2 and "refuses to unpickle" in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if "error" in line.lower()]) == 1, err
    assert not ckpt.is_complete(str(out))
