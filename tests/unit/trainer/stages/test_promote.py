"""Gated promotion in an embedded MLflow registry (sqlite): champion, gate, previous-champion, rollback,
the champion as an MLflow model, and promotion that claims nothing when the alias does not move."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import pytest

from trainer.engine import checkpoint as ckpt
from trainer.errors import RegistryError
from trainer.stages.promote import (
    CHAMPION,
    PREVIOUS_CHAMPION,
    PromotionResult,
    champion_uri,
    download_champion,
    gate,
    promote,
    register_checkpoint,
    rollback,
    run_metrics,
)
from trainer.tracking.gate import gate_direction


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    """One embedded store for the module (creating its tables takes seconds); each test its own model name."""
    return f"sqlite:///{tmp_path_factory.mktemp('registry') / 'mlflow.db'}"


@pytest.fixture(scope="module")
def client(uri):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def fake_checkpoint(folder: Path, tag: str, complete: bool = True) -> str:
    """A checkpoint folder as the stages write it (weights are stand-in bytes: nothing loads them here)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "tag": tag}))
    (folder / "model.safetensors").write_bytes(tag.encode() * 100)
    (folder / ckpt.MANIFEST).write_text(json.dumps({
        "stage": "grpo", "base_model": "outputs/sft", "git_sha": "abc123",
        "datasets": {"train": {"path": "gsm8k/train.jsonl", "fingerprint": f"fp-{tag}", "rows": 100}},
        "metrics": {"reward": 0.1}}))
    (folder / ckpt.STATE_DIR).mkdir()
    (folder / ckpt.STATE_DIR / "optimizer.pt").write_bytes(b"big")
    if complete:
        (folder / ckpt.COMPLETE_MARKER).write_text("{}")
    return str(folder)


def _name() -> str:
    return f"policy-{uuid.uuid4().hex[:8]}"


def _aliases(client, name: str) -> dict[str, str]:
    return {alias: str(v) for alias, v in client.get_registered_model(name).aliases.items()}


def test_promotion_flow_and_rollback(uri, client, tmp_path):
    name = _name()
    first = promote(name, fake_checkpoint(tmp_path / "a", "a"), {"reward": 0.5, "accuracy": 0.2}, tracking_uri=uri)
    assert first == PromotionResult("1", True, first.reason, None, "1")
    assert "first champion" in first.reason
    assert champion_uri(name, uri) == f"models:/{name}@champion"

    worse = promote(name, fake_checkpoint(tmp_path / "b", "b"), {"reward": 0.4}, tracking_uri=uri)
    assert (worse.version, worse.promoted, worse.champion_before, worse.champion_after) == ("2", False, "1", "1")
    assert "gate fails" in worse.reason and "reward=0.4" in worse.reason and "0.5" in worse.reason
    assert _aliases(client, name) == {CHAMPION: "1"}
    assert client.get_model_version(name, "2").tags["alignflow.promotion.promoted"] == "false"

    better = promote(name, fake_checkpoint(tmp_path / "c", "c"), {"reward": 0.7}, tracking_uri=uri)
    assert (better.version, better.promoted, better.champion_before, better.champion_after) == ("3", True, "1", "3")
    assert _aliases(client, name) == {CHAMPION: "3", PREVIOUS_CHAMPION: "1"}

    back = rollback(name, uri)
    assert (back.champion_before, back.champion_after) == ("3", "1")
    assert _aliases(client, name) == {CHAMPION: "1", PREVIOUS_CHAMPION: "3"}
    # The gate now compares with the restored champion's 0.5: 0.6 passes, 0.45 would not.
    assert promote(name, fake_checkpoint(tmp_path / "d", "d"), {"reward": 0.6}, tracking_uri=uri).promoted


def test_version_tags_and_artifacts(uri, client, tmp_path):
    name = _name()
    result = promote(name, fake_checkpoint(tmp_path / "a", "a"), {"reward": 0.5, "kl": 0.01}, tracking_uri=uri,
                     tags={"pipeline": "nightly"})
    version = client.get_model_version(name, result.version)
    tags = version.tags
    assert tags["alignflow.metric.reward"] == "0.5" and tags["alignflow.metric.kl"] == "0.01"
    assert tags["alignflow.dataset.train.fingerprint"] == "fp-a" and tags["alignflow.dataset.train.rows"] == "100"
    assert tags["alignflow.base_model"] == "outputs/sft" and tags["alignflow.stage"] == "grpo"
    assert tags["pipeline"] == "nightly" and tags["alignflow.promotion.gate_metric"] == "reward"
    assert tags["alignflow.promotion.promoted"] == "true"
    # Stand-in weights are no causal LM: the version is the checkpoint's files, not an MLflow model.
    assert version.source == f"runs:/{version.run_id}/checkpoint"
    assert tags["alignflow.model_format"] == "checkpoint-files"
    run = client.get_run(version.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["alignflow.stage"] == "promote"
    assert run.data.metrics == {"reward": 0.5, "kl": 0.01}

    local = Path(download_champion(name, str(tmp_path / "download"), uri))
    assert sorted(p.name for p in local.iterdir()) == sorted(["config.json", "model.safetensors", ckpt.MANIFEST,
                                                               ckpt.COMPLETE_MARKER])  # no training_state/
    assert json.loads((local / "config.json").read_text())["tag"] == "a"
    assert download_champion(_name(), str(tmp_path / "none"), uri) is None
    assert champion_uri(_name(), uri) is None


def test_lower_is_better_and_min_improvement(uri, client, tmp_path):
    """`loss` is known to improve downwards: the default gate_mode (auto) never promotes a higher loss."""
    name = _name()
    assert promote(name, fake_checkpoint(tmp_path / "a", "a"), {"loss": 1.0}, gate_metric="loss",
                   tracking_uri=uri).promoted
    higher = promote(name, fake_checkpoint(tmp_path / "b", "b"), {"loss": 1.2}, gate_metric="loss",
                     tracking_uri=uri)
    small = promote(name, fake_checkpoint(tmp_path / "c", "c"), {"loss": 0.95}, gate_metric="loss",
                    min_improvement=0.1, tracking_uri=uri)
    big = promote(name, fake_checkpoint(tmp_path / "d", "d"), {"loss": 0.8}, gate_metric="loss",
                  min_improvement=0.1, tracking_uri=uri)
    assert (higher.promoted, small.promoted, big.promoted) == (False, False, True)
    assert _aliases(client, name) == {CHAMPION: big.version, PREVIOUS_CHAMPION: "1"}


@pytest.mark.parametrize("metric, mode, higher", [
    ("loss", "auto", False), ("eval_loss", "auto", False), ("kl", "auto", False), ("objective/kl", "auto", False),
    ("reward", "auto", True), ("rewards/exact_answer/mean", "auto", True), ("accuracy", "auto", True),
    ("win_rate", "auto", True), ("rm_score", "auto", True), ("rewards/kl/mean", "auto", True),
    ("completions/mean_length", "max", True), ("completions/mean_length", "min", False), ("reward", "min", False),
])
def test_gate_direction_is_known_for_alignflows_metrics_and_set_for_others(metric, mode, higher):
    assert gate_direction(metric, mode) is higher


def test_a_gate_without_a_direction_is_refused_before_anything_is_written(uri, tmp_path):
    with pytest.raises(RegistryError, match="no known direction.*gate_mode"):
        promote(_name(), fake_checkpoint(tmp_path / "a", "a"), {"perplexity": 3.0}, gate_metric="perplexity",
                tracking_uri=uri)
    with pytest.raises(RegistryError, match="gate_mode"):
        gate_direction("reward", "up")
    assert promote(_name(), fake_checkpoint(tmp_path / "b", "b"), {"perplexity": 3.0}, gate_metric="perplexity",
                   gate_mode="min", tracking_uri=uri).promoted


def test_gate_rule():
    assert gate(0.5, None, "reward", 0.0, True)[0]
    assert not gate(0.5, 0.5, "reward", 0.0, True)[0], "a tie does not beat the champion"
    assert gate(0.51, 0.5, "reward", 0.0, True)[0]
    assert not gate(0.55, 0.5, "reward", 0.1, True)[0]
    assert gate(0.45, 0.5, "reward", -0.1, True)[0], "a negative margin tolerates a small regression"
    assert gate(0.4, 0.5, "loss", 0.05, False)[0] and not gate(0.6, 0.5, "loss", 0.0, False)[0]


def test_champion_without_the_gate_metric_blocks_until_forced(uri, client, tmp_path):
    name = _name()
    promote(name, fake_checkpoint(tmp_path / "a", "a"), {"reward": 0.5}, tracking_uri=uri)
    blocked = promote(name, fake_checkpoint(tmp_path / "b", "b"), {"accuracy": 0.9}, gate_metric="accuracy",
                      tracking_uri=uri)
    assert not blocked.promoted and "no stored `accuracy`" in blocked.reason
    forced = promote(name, fake_checkpoint(tmp_path / "c", "c"), {"accuracy": 0.9}, gate_metric="accuracy",
                     tracking_uri=uri, force=True)
    assert forced.promoted and _aliases(client, name)[CHAMPION] == forced.version


def test_register_from_a_runs_logged_checkpoint(uri, client, tmp_path):
    """`promote --run RUN_ID`: a stage run that logged its checkpoint (mlflow_log_checkpoint) is registered as is."""
    name = _name()
    experiment = client.create_experiment(f"exp-{name}", artifact_location=(tmp_path / "art").as_uri())
    run = client.create_run(experiment)
    client.log_artifacts(run.info.run_id, fake_checkpoint(tmp_path / "a", "a"), "checkpoint")
    client.log_metric(run.info.run_id, "reward", 0.3)
    client.set_terminated(run.info.run_id)

    metrics = run_metrics(run.info.run_id, uri)
    assert metrics == {"reward": 0.3}
    result = promote(name, None, metrics, run_id=run.info.run_id, tracking_uri=uri)
    version = client.get_model_version(name, result.version)
    assert result.promoted and version.run_id == run.info.run_id
    assert version.tags["alignflow.dataset.train.fingerprint"] == "fp-a"

    empty = client.create_run(experiment)
    with pytest.raises(RegistryError, match="no checkpoint"):
        register_checkpoint(name, None, {"reward": 1.0}, run_id=empty.info.run_id, tracking_uri=uri)


def _tiny_checkpoint(tiny_model: str, folder: Path, tag: str) -> str:
    shutil.copytree(tiny_model, folder)
    (folder / ckpt.MANIFEST).write_text(json.dumps({
        "stage": "dpo", "base_model": "tiny-base", "metrics": {"reward": 0.5},
        "datasets": {"train": {"path": "pairs.jsonl", "fingerprint": f"fp-{tag}", "rows": 8}}}))
    (folder / ckpt.METRICS_FILE).write_text('{"step": 1, "loss": 0.7}\n')
    (folder / ckpt.STATE_DIR).mkdir()
    (folder / ckpt.STATE_DIR / "optimizer.pt").write_bytes(b"big")
    (folder / ckpt.COMPLETE_MARKER).write_text("{}")
    return str(folder)


def test_champion_is_an_mlflow_model(uri, client, tiny_model, tmp_path, monkeypatch):
    """The registered version is a transformers-flavour LoggedModel: pyfunc loads `@champion` and chats."""
    import mlflow
    from mlflow.models import Model

    name = _name()
    parent_experiment = client.create_experiment(f"pipeline-{name}", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(parent_experiment, run_name="pipeline").info.run_id
    result = promote(name, _tiny_checkpoint(tiny_model, tmp_path / "a", "a"), {"reward": 0.5}, tracking_uri=uri,
                     parent_run_id=parent)
    version = client.get_model_version(name, result.version)
    assert version.source.startswith("models:/m-") and version.tags["alignflow.model_format"] == "mlflow-transformers"
    assert version.tags["alignflow.promotion.promoted"] == "true"
    promote_run = client.get_run(version.run_id)
    assert promote_run.data.tags["mlflow.parentRunId"] == parent  # nested under the pipeline's run
    assert [o.model_id for o in promote_run.outputs.model_outputs] == [version.source[len("models:/"):]]

    local = Path(download_champion(name, str(tmp_path / "download"), uri))
    assert local.name == "model" and (local / "config.json").is_file() and (local / ckpt.MANIFEST).is_file()
    assert not (local / ckpt.STATE_DIR).exists() and not (local / ckpt.COMPLETE_MARKER).exists()
    mlmodel = Model.load(str(local.parent / "MLmodel"))
    assert mlmodel.flavors["transformers"]["inference_task"] == "llm/v1/chat"
    assert mlmodel.signature is not None and mlmodel.saved_input_example_info is not None

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    (answer,) = model.predict({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
    assert answer["object"] == "chat.completion" and answer["model"] == name
    assert isinstance(answer["choices"][0]["message"]["content"], str)
    assert answer["usage"]["completion_tokens"] >= 1


def test_alias_failure_leaves_no_false_record(uri, client, tmp_path, monkeypatch):
    """The alias call fails after the version exists: no promoted=true tag, aliases as before, one line."""
    from mlflow import MlflowClient

    name = _name()
    promote(name, fake_checkpoint(tmp_path / "a", "a"), {"reward": 0.5}, tracking_uri=uri)
    real = MlflowClient.set_registered_model_alias

    def refuse_champion(self, model_name, alias, version):
        if alias == CHAMPION:
            raise ConnectionError("server went away\nmid-call")
        return real(self, model_name, alias, version)

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", refuse_champion)
    with pytest.raises(RegistryError) as err:
        promote(name, fake_checkpoint(tmp_path / "b", "b"), {"reward": 0.9}, tracking_uri=uri)
    message = str(err.value)
    assert "\n" not in message and "moving @champion failed" in message and "server went away" in message
    assert "@champion stays 1" in message and "promoted=false" in message
    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", real)
    tags = client.get_model_version(name, "2").tags
    assert tags["alignflow.promotion.promoted"] == "false" and "server went away" in tags["alignflow.promotion.error"]
    assert _aliases(client, name) == {CHAMPION: "1"}  # @previous-champion was put back (it did not exist)


# ----------------------------------------------------------------------------------------------
# Errors come before any write


def test_unreachable_server_is_a_fast_clear_error(dead_mlflow_uri, tmp_path):
    start = time.monotonic()
    with pytest.raises(RegistryError) as err:
        promote("policy", fake_checkpoint(tmp_path / "a", "a"), {"reward": 0.5}, tracking_uri=dead_mlflow_uri)
    assert time.monotonic() - start < 10
    assert dead_mlflow_uri in str(err.value) and "MLFLOW_TRACKING_URI" in str(err.value)
    with pytest.raises(RegistryError, match="cannot be reached"):
        rollback("policy", dead_mlflow_uri)


def test_no_tracking_uri(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(RegistryError, match="MLFLOW_TRACKING_URI"):
        promote("policy", fake_checkpoint(tmp_path / "a", "a"), {"reward": 0.5})


def test_bad_candidates_register_nothing(uri, client, tmp_path):
    name = _name()
    with pytest.raises(RegistryError, match="Gate metric `reward`.*accuracy"):
        promote(name, fake_checkpoint(tmp_path / "a", "a"), {"accuracy": 0.5}, tracking_uri=uri)
    with pytest.raises(RegistryError, match="nan"):
        promote(name, fake_checkpoint(tmp_path / "b", "b"), {"reward": float("nan")}, tracking_uri=uri)
    with pytest.raises(RegistryError, match="incomplete"):
        promote(name, fake_checkpoint(tmp_path / "c", "c", complete=False), {"reward": 0.5}, tracking_uri=uri)
    with pytest.raises(RegistryError, match="does not exist"):
        promote(name, str(tmp_path / "missing"), {"reward": 0.5}, tracking_uri=uri)
    with pytest.raises(RegistryError, match="previous-champion"):
        rollback(name, uri)
    assert client.search_model_versions(f"name = '{name}'") == []


# ----------------------------------------------------------------------------------------------
# Command line


def test_cli_promote_and_rollback(uri, client, tmp_path, capsys):
    from trainer.cli.main import main

    name = _name()
    for i, reward in enumerate([0.5, 0.8]):
        metrics = tmp_path / f"metrics{i}.json"
        metrics.write_text(json.dumps({"reward": reward, "completions/mean_length": 12.0}))
        code = main(["promote", "--model-name", name, "--checkpoint", fake_checkpoint(tmp_path / f"c{i}", str(i)),
                     "--metrics", str(metrics), "--gate", "reward", "--tracking-uri", uri, "--tag", "k=v"])
        assert code == 0
        assert json.loads(capsys.readouterr().out)["promoted"] is True
    assert _aliases(client, name) == {CHAMPION: "2", PREVIOUS_CHAMPION: "1"}
    assert client.get_model_version(name, "2").tags["k"] == "v"

    assert main(["promote", "--rollback", name, "--tracking-uri", uri]) == 0
    assert json.loads(capsys.readouterr().out)["champion_after"] == "1"
    assert _aliases(client, name) == {CHAMPION: "1", PREVIOUS_CHAMPION: "2"}

    assert main(["promote", "--model-name", name, "--checkpoint", str(tmp_path / "c0"), "--metrics",
                 str(tmp_path / "missing.json"), "--tracking-uri", uri]) == 2
    assert "missing.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["promote", "--model-name", name, "--checkpoint", str(tmp_path / "c0")])  # no --metrics


def test_a_lock_being_taken_is_not_broken_as_stale(uri, client):
    """The server creates the lock's name before it sets its tags: a lock seen in between has no `since` tag. It
    is as old as its creation, not as 1970 (a promoter racing another broke its fresh lock that way), and only a
    lock older than `stale_s` is broken."""
    from trainer.stages.promote import LOCK_SUFFIX, promotion_lock

    name = "lock-race"
    client.create_registered_model(name + LOCK_SUFFIX)  # a lock whose holder has not set its tags yet
    with pytest.raises(RegistryError, match="has held its lock"), promotion_lock(client, name, wait_s=0.3):
        pass
    assert client.get_registered_model(name + LOCK_SUFFIX)  # still held
    with promotion_lock(client, name, wait_s=0.3, stale_s=0.0):  # older than stale_s: broken, then taken
        assert client.get_registered_model(name + LOCK_SUFFIX).tags["alignflow.lock.since"]
    assert name + LOCK_SUFFIX not in {m.name for m in client.search_registered_models()}
