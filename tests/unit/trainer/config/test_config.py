"""Stage configs: defaults and help, YAML < CLI priority, error messages, and every shipped YAML."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from trainer.cli import main as cli
from trainer.config.options import config_from_dict, parse_config
from trainer.errors import ConfigError
from trainer.stages import stage_parts
from trainer.stages.sft import SFTConfig

CONFIGS = sorted((Path(cli.__file__).resolve().parents[1] / "configs").glob("*.yaml"))  # trainer/configs
REQUIRED = ["--model", "m", "--dataset", "demo"]


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_every_field_has_a_default_and_help():
    fields = dataclasses.fields(SFTConfig)
    assert len(fields) > 40
    for f in fields:
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        assert has_default, f"{f.name} has no default"
        assert isinstance(f.metadata.get("help"), str) and f.metadata["help"].strip(), f"{f.name} has no help"


def test_list_defaults_are_not_shared_between_instances():
    a, b = SFTConfig(model="m", dataset="d"), SFTConfig(model="m", dataset="d")
    a.lora_target_modules.append("q_proj")
    assert b.lora_target_modules == ["all-linear"]


def test_defaults_then_yaml_then_cli(tmp_path):
    path = _yaml(tmp_path, "model: from-yaml\ndataset: demo\nlearning_rate: 1.0e-3\nseed: 7\n"
                           "dtype: bfloat16\n")
    config = parse_config(SFTConfig, ["--config", path, "--learning_rate", "5e-4", "--dtype", "float16"])
    assert config.model == "from-yaml"  # YAML over the default ""
    assert config.seed == 7  # YAML over the default 42
    assert config.learning_rate == 5e-4  # CLI over YAML
    assert config.dtype == "float16"  # CLI over YAML
    assert config.max_length == 1024  # untouched default
    # Position of --config among the flags does not matter: flags always win.
    config = parse_config(SFTConfig, ["--learning_rate", "5e-4", "--config", path])
    assert config.learning_rate == 5e-4


def test_unknown_yaml_key_names_it_and_suggests_the_field(tmp_path):
    path = _yaml(tmp_path, "model: m\ndataset: demo\nlearnin_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        parse_config(SFTConfig, ["--config", path])
    message = str(err.value)
    assert "`learnin_rate`" in message
    assert path in message
    assert "Did you mean `learning_rate`?" in message


@pytest.mark.parametrize("argv", [["--learnin_rate", "0.1"], ["--learnin_rate=0.1"], ["--per_device_batchsize", "2"]])
def test_unknown_cli_flag_names_it_and_suggests_the_field(argv):
    with pytest.raises(ConfigError) as err:
        parse_config(SFTConfig, REQUIRED + argv)
    message = str(err.value)
    bad = argv[0].lstrip("-").split("=")[0]
    assert f"`{bad}`" in message and "on the command line" in message
    expected = {"learnin_rate": "learning_rate", "per_device_batchsize": "per_device_batch_size"}[bad]
    assert f"Did you mean `{expected}`?" in message
    assert "alignflow train sft --help" in message


def test_unknown_key_without_a_close_match_has_no_suggestion():
    with pytest.raises(ConfigError) as err:
        config_from_dict(SFTConfig, {"model": "m", "dataset": "demo", "zzzz": 1})
    assert "`zzzz`" in str(err.value) and "Did you mean" not in str(err.value)


@pytest.mark.parametrize("source", ["cli", "yaml"])
def test_wrong_type_is_an_error_naming_the_field(source, tmp_path, capsys):
    if source == "cli":
        argv = REQUIRED + ["--learning_rate", "abc"]
    else:
        argv = ["--config", _yaml(tmp_path, "model: m\ndataset: demo\nlearning_rate: abc\n")]
    with pytest.raises(ConfigError) as exc:
        parse_config(SFTConfig, argv)
    assert "--learning_rate" in str(exc.value) and "invalid float value: 'abc'" in str(exc.value)


def test_wrong_choice_lists_the_choices(capsys):
    with pytest.raises(ConfigError) as exc:
        parse_config(SFTConfig, REQUIRED + ["--truncation_mode", "middle"])
    assert "--truncation_mode" in str(exc.value) and "'keep_start', 'keep_end', 'drop'" in str(exc.value)


@pytest.mark.parametrize(("argv", "field"), [
    (["--model", "m"], "dataset"),
    (["--dataset", "demo"], "model"),
    (REQUIRED + ["--max_steps", "0"], "max_steps"),
    (REQUIRED + ["--max_steps", "-5"], "max_steps"),
    (REQUIRED + ["--eval_dataset", "x.jsonl", "--eval_split_ratio", "0.1"], "eval_split_ratio"),
    (REQUIRED + ["--eval_split_ratio", "1.0"], "eval_split_ratio"),
    (REQUIRED + ["--warmup_ratio", "1"], "warmup_ratio"),
    (REQUIRED + ["--per_device_batch_size", "0"], "per_device_batch_size"),
    (REQUIRED + ["--lora_r", "-1"], "lora_r"),
    (REQUIRED + ["--num_epochs", "0"], "num_epochs"),
    (REQUIRED + ["--mlflow_tags", "novalue"], "mlflow_tags"),
])
def test_cross_field_checks_name_the_field(argv, field):
    with pytest.raises(ConfigError) as err:
        parse_config(SFTConfig, argv)
    assert f"`{field}`" in str(err.value)


def test_eval_dataset_and_ratio_error_names_both():
    with pytest.raises(ConfigError) as err:
        SFTConfig(model="m", dataset="d", eval_dataset="e", eval_split_ratio=0.1)
    assert "`eval_dataset`" in str(err.value) and "`eval_split_ratio`" in str(err.value)


@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_a_switch_built_from_python_takes_only_a_boolean(value):
    """`packing="no"` is truthy: it would have packed. The CLI and YAML parse their booleans before this."""
    with pytest.raises(ConfigError, match=rf"`packing` is {re.escape(repr(value))} .*True or False"):
        SFTConfig(model="m", dataset="d", packing=value)
    assert SFTConfig(model="m", dataset="d", packing=False).packing is False


def test_list_fields_from_yaml_and_cli(tmp_path):
    path = _yaml(tmp_path, "model: m\ndataset: demo\nlora_target_modules: [q_proj, v_proj]\n"
                           "mlflow_tags:\n  - team=align\n  - run=1\n")
    config = parse_config(SFTConfig, ["--config", path])
    assert config.lora_target_modules == ["q_proj", "v_proj"]
    assert config.mlflow_tags == ["team=align", "run=1"]
    # A CLI list replaces the YAML one, it does not extend it.
    config = parse_config(SFTConfig, ["--config", path, "--lora_target_modules", "o_proj"])
    assert config.lora_target_modules == ["o_proj"]
    assert config.mlflow_tags == ["team=align", "run=1"]
    config = parse_config(SFTConfig, REQUIRED + ["--mlflow_tags", "a=1", "b=2"])
    assert config.mlflow_tags == ["a=1", "b=2"] and config.lora_target_modules == ["all-linear"]


@pytest.mark.parametrize("value", [True, False])
def test_bool_fields_from_yaml(tmp_path, value):
    # packing defaults to False and completion_only_loss to True: both directions are exercised.
    text = "true" if value else "false"
    path = _yaml(tmp_path, f"model: m\ndataset: demo\npacking: {text}\ncompletion_only_loss: {text}\n"
                           f"gradient_checkpointing: {text}\n")
    config = parse_config(SFTConfig, ["--config", path])
    assert config.packing is value
    assert config.completion_only_loss is value
    assert config.gradient_checkpointing is value


def test_bool_flags_on_the_cli():
    config = parse_config(SFTConfig, REQUIRED + ["--packing", "--no_completion_only_loss",
                                                 "--assistant_only_loss", "false"])
    assert config.packing is True
    assert config.completion_only_loss is False
    assert config.assistant_only_loss is False


def test_config_from_dict_matches_the_cli():
    values = {"model": "m", "dataset": "demo", "learning_rate": 1e-4, "packing": True,
              "lora_target_modules": ["q_proj"], "eval_dataset": None, "mlflow_tags": []}
    config = config_from_dict(SFTConfig, values)
    assert (config.learning_rate, config.packing, config.lora_target_modules) == (1e-4, True, ["q_proj"])
    assert config.eval_dataset is None and config.mlflow_tags == []
    with pytest.raises(ConfigError) as err:
        config_from_dict(SFTConfig, {"model": "m", "dataset": "demo", "lora_target_modules": {"a": 1}})
    assert "`lora_target_modules`" in str(err.value) and "mapping" in str(err.value)


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(SFTConfig, ["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_config(SFTConfig, ["--config", _yaml(tmp_path, "model: [unclosed\n")])
    with pytest.raises(ConfigError, match="must hold a mapping"):
        parse_config(SFTConfig, ["--config", _yaml(tmp_path, "- a\n- b\n")])


def test_there_are_shipped_configs():
    assert CONFIGS, "trainer/configs/*.yaml is empty"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_yaml_loads_with_its_stage(path, tmp_path):
    first = path.read_text().splitlines()[0]
    match = re.match(r"#\s*alignflow train (\w+) --config (\S+)", first)
    assert match, f"{path.name} must start with `# alignflow train <stage> --config ...`, got {first!r}"
    stage, named = match.groups()
    assert named.endswith(f"configs/{path.name}"), f"{path.name}'s command names another file: {named}"
    config_cls, _ = stage_parts(stage)
    config = parse_config(config_cls, ["--config", str(path), "--model", "m", "--output_dir", str(tmp_path)])
    assert isinstance(config, config_cls) and config.output_dir == str(tmp_path)
    for key, value in yaml.safe_load(path.read_text()).items():
        assert getattr(config, key) == value, f"{path.name}: `{key}` did not reach the config"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_yaml_holds_overrides_only(path):
    """STYLE rule 4: a YAML that repeats a default hides which knobs the recipe really changes."""
    stage = re.match(r"#\s*alignflow train (\w+)", path.read_text()).group(1)
    config_cls, _ = stage_parts(stage)
    defaults = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(config_cls)}
    repeated = {key: value for key, value in yaml.safe_load(path.read_text()).items() if defaults[key] == value}
    assert not repeated, f"{path.name} repeats defaults: {repeated}"


def test_cli_help_lists_fields_with_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "sft", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: alignflow train sft")
    squeezed = "".join(out.split())  # immune to argparse's line wrapping
    for f in dataclasses.fields(SFTConfig):
        assert f"--{f.name}" in out, f.name
        assert "".join(f.metadata["help"].split()) in squeezed, f"help of {f.name} missing"
    assert "--config" in out


def test_cli_reports_config_errors_with_status_2(capsys):
    assert cli.main(["train", "sft", "--model", "m", "--dataset", "demo", "--max_steps", "0"]) == 2
    assert "`max_steps`" in capsys.readouterr().err
