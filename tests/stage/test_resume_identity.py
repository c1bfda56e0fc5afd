"""Resume identity: a short SFT run, killed (its final model removed) or finished, is resumed with one identity
field changed at a time — seed, base model, lora_r, stage, dataset — through `auto` and through an explicit
checkpoint path. Each is refused in one line naming the field (old -> new), exit 2, before any model loads,
with the model folder and the run's folder byte-identical afterwards. `--resume_allow_changes` continues one
on purpose and the manifest records the change; the same model copied elsewhere is the same run."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.helpers import history
from trainer.cli.main import main
from trainer.engine import checkpoint as ckpt

COMMON = ["--max_steps", "4", "--save_steps", "2", "--save_total_limit", "0", "--per_device_batch_size", "8",
          "--learning_rate", "0.003", "--max_length", "128", "--disable_progress_bar", "true", "--logging_steps", "1"]


def train(stage: str, model: str, out: Path, *extra: str, dataset: str = "demo") -> int:
    quiet = ["--num_sample_completions", "0"] if stage == "sft" else []
    return main(["train", stage, "--model", model, "--dataset", dataset, "--output_dir", str(out), *COMMON, *quiet,
                 *extra])


def snapshot(folder: Path | str) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tiny_model, tmp_path_factory) -> Path:
    """A finished 4-step SFT run with step checkpoint 2 (read-only: tests copy it)."""
    out = tmp_path_factory.mktemp("identity") / "finished"
    assert train("sft", tiny_model, out) == 0
    return out


def killed_copy(finished: Path, dest: Path) -> Path:
    """The run as a kill after checkpoint-2 leaves it: no final model."""
    shutil.copytree(finished, dest)
    for path in dest.iterdir():
        if not path.name.startswith("checkpoint-"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return dest


@pytest.fixture(scope="module")
def other_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model with different weights (same config and tokenizer)."""
    out = tmp_path_factory.mktemp("other-model") / "model"
    shutil.copytree(tiny_model, out)
    weights = load_file(out / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, out / "model.safetensors")
    return str(out)


# field -> (stage, extra flags, dataset, words the error line holds)
CHANGES = {
    "seed": ("sft", ["--seed", "7"], "demo", ["seed 42 -> 7"]),
    "model": ("sft", [], "demo", ["model ", "sha256-", " -> "]),
    "lora_r": ("sft", ["--lora_r", "8"], "demo", ["lora_r 0 -> 8"]),
    "stage": ("dpo", [], "demo:preferences", ["is from the sft stage, not dpo", "cannot continue in another stage"]),
    "dataset": ("sft", [], "demo:math_sft", ["training data fingerprint sha256-"]),
}


@pytest.mark.parametrize("how", ["killed, auto", "finished, auto", "explicit path"])
@pytest.mark.parametrize("field", list(CHANGES))
def test_each_changed_identity_field_is_refused_in_one_line(field, how, finished, tiny_model, other_model, tmp_path,
                                                            capsys, no_model_loads):
    stage, extra, dataset, words = CHANGES[field]
    model = other_model if field == "model" else tiny_model
    if how == "killed, auto":
        out, resume = killed_copy(finished, tmp_path / "run"), "auto"
    elif how == "finished, auto":
        out, resume = Path(shutil.copytree(finished, tmp_path / "run")), "auto"
    else:
        out, resume = tmp_path / "new", str(finished / "checkpoint-2")
    inputs, before = snapshot(model), snapshot(out) if out.exists() else {}
    capsys.readouterr()

    code = train(stage, model, out, *extra, "--resume_from_checkpoint", resume, dataset=dataset)
    said, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2, err[-3000:]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert all(w in errors[0] for w in words), errors[0]
    assert "already holds" not in said + err
    assert snapshot(model) == inputs, "the model folder changed"
    assert (snapshot(out) if out.exists() else {}) == before, "the run's folder changed"


def test_allowed_changes_continue_and_are_recorded(finished, tiny_model, tmp_path, capsys):
    out = tmp_path / "branch"
    checkpoint = str(finished / "checkpoint-2")
    assert train("sft", tiny_model, out, "--seed", "7", "--resume_from_checkpoint", checkpoint,
                 "--resume_allow_changes", "true") == 0
    manifest = json.loads((out / ckpt.MANIFEST).read_text())
    assert manifest["resumed_from"] == checkpoint
    assert manifest["resume_changes"] == [{"step": 2, "from": checkpoint, "field": "seed", "old": 42, "new": 7}]
    assert manifest["identity"]["seed"] == 7 and manifest["config"]["seed"] == 7
    assert [r["step"] for r in history(out)] == [1, 2, 3, 4]
    # Its identity is now the changed run's: `auto` finds it finished with seed 7 and refuses seed 42.
    capsys.readouterr()
    assert train("sft", tiny_model, out, "--seed", "7", "--resume_from_checkpoint", "auto") == 0
    assert "already holds this run's finished model" in capsys.readouterr().out
    assert train("sft", tiny_model, out, "--resume_from_checkpoint", "auto") == 2
    assert "seed 7 -> 42" in capsys.readouterr().err


def test_the_same_run_resumes_with_the_model_copied_elsewhere(finished, tiny_model, tmp_path):
    """The model is compared by content: a copy at another path (a pipeline's download) is the same run."""
    copy = shutil.copytree(tiny_model, tmp_path / "copy")
    out = killed_copy(finished, tmp_path / "run")
    assert train("sft", str(copy), out, "--resume_from_checkpoint", "auto") == 0
    assert ckpt.is_complete(str(out))
    assert json.loads((out / ckpt.MANIFEST).read_text())["resume_changes"] == []


@pytest.fixture(scope="module")
def reward_run(tiny_model, tmp_path_factory) -> Path:
    """A 2-step reward-model run with step checkpoint 1 (module scope: built before `no_model_loads` applies)."""
    out = tmp_path_factory.mktemp("reward") / "reward"
    assert main(["train", "reward", "--model", tiny_model, "--dataset", "demo:preferences", "--output_dir", str(out),
                 "--max_steps", "2", "--save_steps", "1", "--per_device_batch_size", "4", "--max_length", "128",
                 "--disable_progress_bar", "true"]) == 0
    return out


@pytest.mark.parametrize("source", ["a reward-model checkpoint", "a final model"])
def test_sft_from_a_reward_checkpoint_or_a_final_model_is_one_line(source, reward_run, finished, tiny_model, tmp_path,
                                                                   capsys, no_model_loads):
    resume, words = ((reward_run / "checkpoint-1", "is from the reward stage, not sft") if source.startswith("a reward")
                     else (finished, "is a final model, not a step checkpoint"))
    before = snapshot(resume)
    capsys.readouterr()
    code = train("sft", tiny_model, tmp_path / "o", "--resume_from_checkpoint", str(resume))
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if ": error: " in x]
    assert code == 2 and len(errors) == 1 and words in errors[0] and "Traceback" not in err, err[-3000:]
    assert snapshot(resume) == before and not (tmp_path / "o" / "model.safetensors").exists()
