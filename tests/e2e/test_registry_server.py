"""Promotion against a real MLflow server (artifacts in SeaweedFS S3): string versions, the version as
an MLflow model that pyfunc serves, rollback, and the champion as evaluate's baseline through models:/."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

from tests.helpers import write_jsonl
from trainer.engine import checkpoint as ckpt
from trainer.stages.promote import (
    CHAMPION,
    PREVIOUS_CHAMPION,
    champion_uri,
    download_champion,
    promote,
    rollback,
)


@pytest.fixture(scope="module")
def client(mlflow_server):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)


def _checkpoint(tiny_model: str, folder: Path, tag: str) -> str:
    """The tiny model as a complete alignflow checkpoint with a manifest."""
    shutil.copytree(tiny_model, folder)
    (folder / ckpt.MANIFEST).write_text(json.dumps({
        "stage": "grpo", "base_model": tiny_model,
        "datasets": {"train": {"path": "prompts.jsonl", "fingerprint": f"fp-{tag}", "rows": 4}}}))
    (folder / ckpt.COMPLETE_MARKER).write_text("{}")
    return str(folder)


def _aliases(client, name: str) -> dict:
    return dict(client.get_registered_model(name).aliases)


def test_promote_and_rollback_through_the_server(mlflow_server, client, tiny_model, s3_server, tmp_path):
    name = f"policy-{uuid.uuid4().hex[:8]}"
    first = promote(name, _checkpoint(tiny_model, tmp_path / "a", "a"), {"reward": 0.5}, tracking_uri=mlflow_server)
    worse = promote(name, _checkpoint(tiny_model, tmp_path / "b", "b"), {"reward": 0.2}, tracking_uri=mlflow_server)
    better = promote(name, _checkpoint(tiny_model, tmp_path / "c", "c"), {"reward": 0.9}, tracking_uri=mlflow_server)

    assert [r.version for r in (first, worse, better)] == ["1", "2", "3"]
    assert [r.promoted for r in (first, worse, better)] == [True, False, True]
    assert "gate fails" in worse.reason
    assert _aliases(client, name) == {CHAMPION: "3", PREVIOUS_CHAMPION: "1"}

    version = client.get_model_version(name, "3")
    model_id = version.source.removeprefix("models:/")
    assert model_id.startswith("m-") and version.tags["alignflow.model_format"] == "mlflow-transformers"
    assert version.tags["alignflow.dataset.train.fingerprint"] == "fp-c"
    logged = {Path(a.path).name for a in client.list_logged_model_artifacts(model_id, "model")}
    assert {"config.json", "model.safetensors", "tokenizer.json", ckpt.MANIFEST} <= logged
    # The files really are in the object store behind the server.
    keys = [o["Key"] for page in s3_server.client().get_paginator("list_objects_v2").paginate(
        Bucket=s3_server.bucket, Prefix="mlflow/") for o in page.get("Contents", [])]
    assert any(model_id in k and k.endswith("model/model.safetensors") for k in keys)

    back = rollback(name, mlflow_server)
    assert (back.champion_before, back.champion_after) == ("3", "1")
    assert _aliases(client, name) == {CHAMPION: "1", PREVIOUS_CHAMPION: "3"}

    local = Path(download_champion(name, str(tmp_path / "champion"), mlflow_server))
    assert json.loads((local / ckpt.MANIFEST).read_text())["datasets"]["train"]["fingerprint"] == "fp-a"
    assert (local / "model.safetensors").read_bytes() == Path(tiny_model, "model.safetensors").read_bytes()


def test_champion_serves_with_pyfunc(mlflow_server, client, tiny_model, tmp_path, monkeypatch):
    """The serving test: promote a tiny chat model; `models:/NAME@champion` loads with mlflow.pyfunc and
    answers an OpenAI-style chat request with generated text (offline, through the server and S3)."""
    import mlflow

    name = f"policy-{uuid.uuid4().hex[:8]}"
    result = promote(name, _checkpoint(tiny_model, tmp_path / "a", "a"), {"reward": 0.5}, tracking_uri=mlflow_server)
    assert result.promoted
    assert client.get_model_version(name, result.version).tags["alignflow.promotion.promoted"] == "true"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    assert model.metadata.flavors["transformers"]["inference_task"] == "llm/v1/chat"
    (answer,) = model.predict({"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 8})
    text = answer["choices"][0]["message"]["content"]
    assert isinstance(text, str) and text.strip() and answer["usage"]["completion_tokens"] >= 1
    assert answer["model"] == name


def test_champion_as_evaluate_baseline(mlflow_server, tiny_model, tmp_path):
    """`baseline_model: models:/NAME@champion` downloads the champion; against itself the win rate is 0.5."""
    from trainer.engine.models import load_reward_model, load_tokenizer
    from trainer.stages.evaluate import EvalConfig, run_evaluate

    name = f"policy-{uuid.uuid4().hex[:8]}"
    assert champion_uri(name, mlflow_server) is None
    promote(name, _checkpoint(tiny_model, tmp_path / "a", "a"), {"reward": 0.5}, tracking_uri=mlflow_server)
    tokenizer = load_tokenizer(tiny_model)
    judge = tmp_path / "judge"
    load_reward_model(tiny_model, tokenizer.pad_token_id).save_pretrained(judge)
    tokenizer.save_pretrained(judge)
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in ("Hello", "Name a colour.")])

    metrics = run_evaluate(EvalConfig(model=tiny_model, dataset=str(data), reward_model=str(judge),
                                      baseline_model=champion_uri(name, mlflow_server), max_completion_length=4,
                                      output_dir=str(tmp_path / "eval"), mlflow_tracking_uri=mlflow_server))
    assert metrics["win_rate"] == 0.5 and metrics["num_samples"] == 2


RACE_ROUNDS = int(os.environ.get("ALIGNFLOW_RACE_ROUNDS", "8"))  # docs/reliability.md quotes a run with 50


def _race(uri: str, model: str, folder: str, rewards: list[float], barrier, results) -> None:
    """One of two promoters: each round, wait for the other, then promote a candidate with the round's reward."""
    from trainer.stages.promote import promote

    try:
        for reward in rewards:
            barrier.wait(timeout=120)
            result = promote(model, folder, {"reward": reward}, tracking_uri=uri)
            results.put((result.version, result.promoted, result.champion_before, result.champion_after))
            barrier.wait(timeout=120)  # the test checks the registry between rounds
    except BaseException:
        barrier.abort()  # the test fails at once instead of waiting out its timeout
        raise


def test_two_promoters_racing_leave_one_consistent_champion(mlflow_server, client, tmp_path):
    """Two processes promote to the same model at the same moment, round after round. After every round there is
    one @champion: the best of the versions tagged promoted, each promoted version beat the champion it replaced
    (no promotion is lost to the other's alias move), none is left pending, and @previous-champion is the one
    the champion replaced."""
    import multiprocessing
    import random

    name = f"race-{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "candidate"  # stand-in weights, registered as files (quick): all a race needs
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    (folder / ckpt.MANIFEST).write_text(json.dumps({"stage": "grpo"}))
    (folder / ckpt.COMPLETE_MARKER).write_text("{}")
    rng = random.Random(7)
    # Both candidates of round i beat every earlier round's (i + [0, 1)): both pass the gate they see first, and
    # only the second to move @champion can tell whether it also beats the first.
    rewards = [[round(i + rng.random(), 4) for i in range(RACE_ROUNDS)] for _ in range(2)]
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(3), context.Queue()
    racers = [context.Process(target=_race, args=(mlflow_server, name, str(folder), r, barrier, results))
              for r in rewards]
    for racer in racers:
        racer.start()
    try:
        for round_ in range(RACE_ROUNDS):
            barrier.wait(timeout=120)  # go
            barrier.wait(timeout=120)  # both promotions returned
            outcomes = [results.get(timeout=10) for _ in racers]
            versions = client.search_model_versions(f"name='{name}'")
            tags = {v.version: v.tags for v in versions}
            assert len(versions) == 2 * (round_ + 1)
            assert all(t["alignflow.promotion.promoted"] in ("true", "false") for t in tags.values()), "left pending"
            reward = {v: float(t["alignflow.metric.reward"]) for v, t in tags.items()}
            promoted = [v for v, t in tags.items() if t["alignflow.promotion.promoted"] == "true"]
            aliases = _aliases(client, name)
            champion = aliases[CHAMPION]
            assert champion in promoted and reward[champion] == max(reward[v] for v in promoted), (aliases, tags)
            for version, passed, before, _after in outcomes:
                assert (tags[version]["alignflow.promotion.promoted"] == "true") == passed
                if passed and before is not None:
                    assert reward[version] > reward[before], (version, before, tags[version])
            if PREVIOUS_CHAMPION in aliases:
                previous = aliases[PREVIOUS_CHAMPION]
                assert previous in promoted and reward[previous] < reward[champion]
                assert any(after == champion and before == previous for _, _, before, after in outcomes) or \
                    not any(passed for _, passed, _, _ in outcomes)
    finally:
        barrier.abort()  # (a no-op after the last round; on a failure, the racers stop waiting)
        for racer in racers:
            racer.join(timeout=60)
            if racer.is_alive():
                racer.kill()
    assert [racer.exitcode for racer in racers] == [0, 0]
    assert name + ".alignflow-promotion-lock" not in {m.name for m in client.search_registered_models()}
