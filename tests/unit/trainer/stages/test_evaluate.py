"""Evaluation config, the win-rate rule, and bad input that fails before any generation."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import write_jsonl
from trainer.config.options import parse_config
from trainer.errors import ConfigError, DataError, ModelError
from trainer.stages.evaluate import EvalConfig, run_evaluate, win_rates


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    rows = [{"prompt": p} for p in ("Hello there", "Name a colour.", "What is 2 + 2?", "Tell me about rivers")]
    return write_jsonl(tmp_path_factory.mktemp("data") / "prompts.jsonl", rows)


def _config(tmp_path: Path, **overrides) -> EvalConfig:
    overrides.setdefault("output_dir", str(tmp_path / "eval"))
    overrides.setdefault("max_completion_length", 8)
    return EvalConfig(**overrides)


@pytest.fixture
def no_generation(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("generation started before the inputs were checked")

    monkeypatch.setattr("trainer.stages.evaluate.generate", fail)


def test_win_rate_rule():
    assert win_rates(["a", "b", "c", "d"], ["a", "x", "y", "z"], [1.0, 2.0, 0.0, 3.0], [9.0, 1.0, 1.0, 3.0]) == [
        0.5, 1.0, 0.0, 0.5]


def test_missing_prompt_column(tiny_model, tmp_path, no_generation):
    data = write_jsonl(tmp_path / "bad.jsonl", [{"question": "hi", "answer": "#### 1"}])
    with pytest.raises(DataError, match="`prompt` column"):
        run_evaluate(_config(tmp_path, model=tiny_model, dataset=data))


def test_missing_model_path(prompts_file, tmp_path, no_generation):
    with pytest.raises(ModelError, match="does not exist"):
        run_evaluate(_config(tmp_path, model=str(tmp_path / "nope"), dataset=prompts_file))


def test_bad_reward_function_specs(tiny_model, prompts_file, tmp_path, no_generation):
    with pytest.raises(ValueError, match="no_such_function"):
        run_evaluate(_config(tmp_path, model=tiny_model, dataset=prompts_file,
                             reward_funcs=["tests.unit.trainer.stages.test_evaluate:no_such_function"]))
    with pytest.raises(ValueError, match="Unknown reward function 'exact_answr'"):
        run_evaluate(_config(tmp_path, model=tiny_model, dataset=prompts_file, reward_funcs=["exact_answr"]))
    with pytest.raises(DataError, match="`answer` column"):
        run_evaluate(_config(tmp_path, model=tiny_model, dataset=prompts_file, reward_funcs=["exact_answer"]))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model": ""}, "`model` is required"),
    ({"dataset": ""}, "`dataset` is required"),
    ({"baseline_model": "x"}, "needs a judge"),
    ({"reward_funcs": ["exact_answer"], "reward_weights": [1.0, 2.0]}, "one weight per function"),
    ({"temperature": -1.0}, "temperature"),
    ({"max_samples": 0}, "max_samples"),
    ({"mlflow_tags": ["novalue"]}, "KEY=VALUE"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        EvalConfig(**{"model": "m", "dataset": "d", **overrides})


def test_parse_config_and_environment_fallbacks(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///x.db")
    monkeypatch.setenv("MLFLOW_PARENT_RUN_ID", "parent123")
    config = parse_config(EvalConfig, ["--model", "m", "--dataset", "d", "--reward_funcs", "exact_answer",
                                       "length:20", "--temperature", "0.7", "--max_samples", "5"])
    assert config.reward_funcs == ["exact_answer", "length:20"] and config.temperature == 0.7
    assert config.max_samples == 5 and config.reward_model is None
    assert config.tracking_uri == "sqlite:///x.db" and config.parent_run_id == "parent123"
    with pytest.raises(ConfigError, match="reward_func"):
        parse_config(EvalConfig, ["--model", "m", "--dataset", "d", "--reward_func", "x"])


def test_cli_eval_reports_bad_input(prompts_file, tmp_path, capsys):
    from trainer.cli.main import main

    assert main(["eval", "--model", str(tmp_path / "missing"), "--dataset", prompts_file]) == 2
    assert "does not exist" in capsys.readouterr().err
