"""TRL's option names: aliases, translations, ignored and rejected names; TRL's dataset options
(`dataset_config`, `datasets:` mixtures, `chat_template_path`); the CLI's --version and flag spellings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.helpers import CHAT_TEMPLATE, DEMO_DATA, ROOT, without_chat_template, write_jsonl
from trainer.cli import main as cli
from trainer.config import options as config_module
from trainer.config.mixtures import parse_mixture
from trainer.config.options import TrainConfig, aliases, config_from_dict, parse_config
from trainer.data.chat_templates import read_chat_template
from trainer.data.sources import load_mixture, load_rows, train_rows
from trainer.errors import ConfigError, DataError
from trainer.stages.dpo import DPOConfig
from trainer.stages.reward_model import RewardConfig
from trainer.stages.rl.grpo import GRPOConfig
from trainer.stages.rl.ppo import PPOConfig
from trainer.stages.sft import SFTConfig

STAGES = [SFTConfig, DPOConfig, RewardConfig, GRPOConfig, PPOConfig]


@pytest.fixture(autouse=True)
def fresh_notes():
    config_module._noted.clear()  # notes are once per process; each test checks its own


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "trl.yaml"
    path.write_text(text)
    return str(path)


# -- the common TRL keys of each trainer (TRL's SFTConfig/DPOConfig/GRPOConfig/RewardConfig, TrainingArguments,
#    ModelConfig and ScriptArguments as a `trl <stage> --config` file holds them) all parse -----------------------

COMMON = {
    "model_name_or_path": "m", "dataset_name": "demo", "dataset_config": None, "dataset_train_split": "train",
    "dataset_test_split": "test", "output_dir": "out", "num_train_epochs": 2, "max_steps": -1,
    "per_device_train_batch_size": 4, "per_device_eval_batch_size": 8, "gradient_accumulation_steps": 2,
    "learning_rate": 1e-5, "lr_scheduler_type": "cosine", "warmup_steps": 0.05, "weight_decay": 0.01,
    "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "max_grad_norm": 1.0, "optim": "adamw_torch",
    "bf16": False, "fp16": False, "torch_dtype": "float32", "gradient_checkpointing": True,
    "gradient_checkpointing_kwargs": {"use_reentrant": False}, "logging_steps": 5, "logging_strategy": "steps",
    "save_strategy": "steps", "save_steps": 100, "save_total_limit": 1, "eval_strategy": "no", "seed": 0,
    "report_to": "none", "run_name": "r", "push_to_hub": False, "hub_model_id": None, "use_peft": True,
    "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "lora_target_modules": ["q_proj", "v_proj"],
    "trust_remote_code": False, "attn_implementation": None, "dataloader_num_workers": 2, "dataset_num_proc": 4,
    "remove_unused_columns": False, "disable_tqdm": True, "max_length": 512,
}
PER_STAGE = {
    SFTConfig: {"packing": True, "packing_strategy": "bfd", "completion_only_loss": True, "assistant_only_loss": True,
                "dataset_text_field": "text", "padding_free": True, "max_seq_length": 256, "chat_template_path": None},
    DPOConfig: {"beta": 0.2, "loss_type": "ipo", "precompute_ref_log_probs": True, "padding_free": True,
                "truncation_mode": "keep_end", "disable_dropout": True, "max_prompt_length": 128, "rpo_alpha": None},
    RewardConfig: {"center_rewards_coefficient": 0.01, "disable_dropout": True, "chat_template_path": None},
    GRPOConfig: {"reward_funcs": ["exact_answer"], "num_generations": 4, "max_prompt_length": 128,
                 "max_completion_length": 64, "temperature": 0.9, "top_p": 0.95, "top_k": 0, "beta": 0.04,
                 "epsilon": 0.2, "epsilon_high": 0.28, "num_iterations": 2, "loss_type": "dr_grpo",
                 "scale_rewards": "batch", "mask_truncated_completions": True, "use_vllm": True,
                 "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.5, "log_completions": True,
                 "vllm_importance_sampling_correction": True, "vllm_importance_sampling_cap": 2.0,
                 "shuffle_dataset": True, "ds3_gather_for_generation": True, "repetition_penalty": 1.0},
}


@pytest.mark.parametrize("cls", list(PER_STAGE))
def test_a_typical_trl_config_parses_under_alignflow(cls, tmp_path, capsys):
    import yaml

    values = {**COMMON, **PER_STAGE[cls]}
    if cls is SFTConfig:
        values.pop("max_length")  # the file uses TRL's older `max_seq_length` instead
    config = parse_config(cls, ["--config", _yaml(tmp_path, yaml.safe_dump(values))])
    assert (config.model, config.dataset, config.num_epochs, config.per_device_batch_size) == ("m", "demo", 2, 4)
    assert (config.lr_scheduler, config.warmup_ratio, config.mlflow_run_name) == ("cosine", 0.05, "r")
    assert config.lora_r == 8 and config.report_to == ["none"] and config.tracking_uri is None
    assert config.disable_progress_bar and config.gradient_checkpointing
    if cls is SFTConfig:
        assert config.max_length == 256 and config.packing
    if cls is GRPOConfig:
        assert config.rollout_engine == "vllm" and config.top_k == -1 and config.importance_sampling_cap == 2.0
    err = capsys.readouterr().err
    assert err.count("note: model_name_or_path is TRL's name for model") == 1
    assert "note: dataloader_num_workers ignored" in err
    assert config.push_to_hub is False and config.hub_model_id is None  # the same names in alignflow


def test_aliases_of_shared_fields_reach_every_stage():
    shared = aliases(TrainConfig)
    assert {"model_name_or_path", "dataset_name", "num_train_epochs", "per_device_train_batch_size",
            "lr_scheduler_type", "datasets"} <= set(shared)
    for cls in STAGES:
        assert shared.items() <= aliases(cls).items(), cls.__name__


@pytest.mark.parametrize("argv", [
    ["--model_name_or_path", "m", "--dataset_name", "demo", "--per_device_train_batch_size", "2"],
    ["--model-name-or-path", "m", "--dataset-name=demo", "--per-device-train-batch-size", "2"],
])
def test_trl_flags_with_underscores_or_dashes(argv, capsys):
    config = parse_config(SFTConfig, argv)
    assert (config.model, config.dataset, config.per_device_batch_size) == ("m", "demo", 2)
    assert "note: per_device_train_batch_size is TRL's name for per_device_batch_size" in capsys.readouterr().err


def test_flags_win_over_trl_names_in_the_file(tmp_path):
    path = _yaml(tmp_path, "model_name_or_path: m\ndataset_name: demo\nnum_train_epochs: 3\n")
    assert parse_config(SFTConfig, ["--config", path, "--num_epochs", "2"]).num_epochs == 2
    assert parse_config(SFTConfig, ["--config", path, "--num_train_epochs", "4"]).num_epochs == 4


def test_pipeline_stage_configs_take_trl_names_too():
    config = config_from_dict(DPOConfig, {"model_name_or_path": "m", "dataset_name": "demo", "use_peft": True})
    assert (config.model, config.lora_r) == ("m", 16)


@pytest.mark.parametrize("key, value, words", [
    ("hub_token", "hf_abc", ["hub_token", "HF_TOKEN", "Remove it"]),
    ("hub_strategy", "every_save", ["hub_strategy", "pushes once", "Remove it"]),
    ("use_liger_kernel", True, ["use_liger_kernel", "Liger kernels are not supported"]),
    ("optim", "adafactor", ["optim", "torch's AdamW"]),
    ("save_strategy", "epoch", ["save_strategy", "save_steps"]),
    ("load_in_4bit", True, ["load_in_4bit", "bitsandbytes"]),
    ("fsdp", "full_shard", ["fsdp", "deepspeed zero3"]),
    ("dataset_text_field", "content", ["dataset_text_field", "rename the column to `text`"]),
    ("warmup_steps", 100, ["warmup_steps", "warmup_ratio"]),
    ("eval_strategy", "epoch", ["eval_strategy", "eval_steps"]),
    ("report_to", "wandb", ["report_to", "wandb", "MLflow only"]),
    ("report_to", ["mlflow", "tensorboard"], ["report_to", "tensorboard", "MLflow only"]),
])
def test_unsupported_trl_settings_are_rejected_with_the_reason(key, value, words, tmp_path):
    import yaml

    path = _yaml(tmp_path, yaml.safe_dump({"model": "m", "dataset": "demo", key: value}))
    with pytest.raises(ConfigError) as err:
        parse_config(SFTConfig, ["--config", path])
    for word in words:
        assert word in str(err.value)


def test_a_trl_option_without_equivalent_is_named_as_such():
    with pytest.raises(ConfigError, match="`torch_compile_mode: max-autotune` .*is a TRL option alignflow does not"):
        config_from_dict(SFTConfig, {"model": "m", "dataset": "demo", "torch_compile_mode": "max-autotune"})
    config = config_from_dict(SFTConfig, {"model": "m", "dataset": "demo", "torch_compile": True,
                                          "torch_compile_backend": "inductor"})
    assert config.torch_compile
    with pytest.raises(ConfigError, match="torch_compile_backend: eager"):
        config_from_dict(SFTConfig, {"model": "m", "dataset": "demo", "torch_compile_backend": "eager"})
    with pytest.raises(ConfigError) as err:  # a TrainingArguments name with no table entry
        parse_config(SFTConfig, ["--model", "m", "--dataset", "demo", "--length_column_name", "n"])
    assert "is a TRL option the sft stage has no equivalent for" in str(err.value)
    with pytest.raises(ConfigError, match="TRL option the sft stage"):  # a GRPO option given to SFT
        config_from_dict(SFTConfig, {"model": "m", "dataset": "demo", "num_generations": 4})


@pytest.mark.parametrize("use_peft, lora_r, expected", [(True, None, 16), (True, 4, 4), (False, 4, 0), (False, None, 0)])
def test_use_peft(use_peft, lora_r, expected):
    values = {"model": "m", "dataset": "demo", "use_peft": use_peft, **({"lora_r": lora_r} if lora_r else {})}
    assert config_from_dict(SFTConfig, values).lora_r == expected


@pytest.mark.parametrize("argv, engine", [
    (["--use_vllm", "true"], "vllm"), (["--use_vllm"], "vllm"), (["--use_vllm", "false"], "hf"),
    (["--use_vllm", "true", "--vllm_mode", "server"], "vllm-server"), (["--vllm_mode", "server"], "hf"),
])
def test_use_vllm_and_vllm_mode_pick_the_rollout_engine(argv, engine):
    assert parse_config(GRPOConfig, ["--model", "m", "--dataset", "demo", *argv]).rollout_engine == engine


def test_use_vllm_is_refused_by_stages_that_do_not_generate():
    with pytest.raises(ConfigError, match="use_vllm"):
        config_from_dict(DPOConfig, {"model": "m", "dataset": "demo", "use_vllm": True})


def test_trl_top_k_zero_means_off(tmp_path):
    assert parse_config(GRPOConfig, ["--model", "m", "--dataset", "demo", "--top_k", "0"]).top_k == -1
    assert config_from_dict(PPOConfig, {"model": "m", "dataset": "demo", "top_k": 0}).top_k == -1
    assert config_from_dict(GRPOConfig, {"model": "m", "dataset": "demo", "top_k": 5}).top_k == 5


def test_ppo_takes_trl_ppo_names():
    config = config_from_dict(PPOConfig, {"model": "m", "dataset": "demo", "num_ppo_epochs": 2, "kl_coef": 0.1,
                                          "response_length": 32})
    assert (config.ppo_epochs, config.init_kl_coef, config.max_completion_length) == (2, 0.1, 32)


def test_help_lists_trl_names(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "sft", "--help"])
    out = capsys.readouterr().out
    assert "--model_name_or_path" in out and "--num_train_epochs" in out


# -- dataset_config, dataset_mixture, chat_template_path ---------------------------------------------------------


def _card_folder(tmp_path: Path) -> Path:
    """A local dataset with two configurations declared in its card, as on the hub."""
    folder = tmp_path / "carded"
    folder.mkdir()
    write_jsonl(folder / "easy.jsonl", [{"text": f"easy {i}"} for i in range(3)])
    write_jsonl(folder / "hard.jsonl", [{"text": f"hard {i}"} for i in range(5)])
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: easy\n  data_files: easy.jsonl\n"
                                      "- config_name: hard\n  data_files: hard.jsonl\n---\n")
    return folder


def test_dataset_config_picks_a_configuration(tmp_path):
    folder = _card_folder(tmp_path)
    config = config_from_dict(SFTConfig, {"model": "m", "dataset_name": str(folder), "dataset_config": "hard"})
    rows = train_rows(config)
    assert rows["text"] == [f"hard {i}" for i in range(5)]
    with pytest.raises(DataError, match="configuration 'medium'"):
        load_rows(str(folder), "train", "medium")
    with pytest.raises(DataError, match="dataset_config"):
        load_rows(str(DEMO_DATA / "sft.jsonl"), "train", "hard")


def test_mixture_concatenates_selects_columns_and_mixes_fractions(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "completion": "x", "extra": i} for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "completion": "y"} for i in range(4)])
    mixture = [{"path": a, "columns": ["prompt", "completion"]}, {"path": b}]
    rows = load_mixture(json.dumps(mixture))
    assert len(rows) == 14 and sorted(rows.column_names) == ["completion", "prompt"]
    # fractions 0.75:0.25 -> N = min(10 / 0.75, 4 / 0.25) = 13.33: the first round(10) of a, round(3.33) = 3 of b.
    mixture = [{**mixture[0], "fraction": 0.75}, {"path": b, "fraction": 0.25}]
    rows = load_mixture(json.dumps(mixture))
    assert rows["prompt"] == [f"a{i}" for i in range(10)] + ["b0", "b1", "b2"]
    # TRL's builder form: `path: json` with data_files.
    rows = load_mixture(json.dumps([{"path": "json", "data_files": b, "split": "train"}]))
    assert rows["prompt"] == [f"b{i}" for i in range(4)]


def test_mixture_from_a_trl_yaml_trains_on_both(tmp_path):
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p", "completion": "c"}] * 3)
    path = _yaml(tmp_path, f"model_name_or_path: m\ndatasets:\n  - path: demo\n  - path: {b}\ntest_split_size: 0.1\n")
    config = parse_config(SFTConfig, ["--config", path])
    assert [p.path for p in parse_mixture(config.dataset_mixture)] == ["demo", b]
    assert config.eval_split_ratio == 0.1
    assert len(train_rows(config)) == len(load_rows("demo")) + 3


@pytest.mark.parametrize("mixture, words", [
    ([], "non-empty list"),
    ([{"name": "x"}], "needs a `path`"),
    ([{"path": "demo", "weight": 2}], "unknown keys ['weight']"),
    ([{"path": "demo", "fraction": 1}, {"path": "demo"}], "every entry or on none"),
    ([{"path": "demo", "fraction": -1}], "fraction` must be a number in (0, 1]"),
    ([{"path": "demo", "fraction": 1.5}], "fraction` must be a number in (0, 1]"),
    ("[{path: demo, fraction: 0.5, fraction: 1}]", "`fraction` is set twice, on line 1 and again on line 1"),
])
def test_bad_mixtures_are_config_errors(mixture, words):
    with pytest.raises(ConfigError) as err:
        text = mixture if isinstance(mixture, str) else json.dumps(mixture)
        config_from_dict(SFTConfig, {"model": "m", "dataset_mixture": text})
    assert words in str(err.value)


def test_mixture_with_different_columns_names_them(tmp_path):
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "t"}])
    with pytest.raises(DataError, match=r"dataset_mixture\[1\].*columns"):
        load_mixture(json.dumps([{"path": "demo"}, {"path": b}]))


def test_dataset_and_mixture_together_is_an_error():
    with pytest.raises(ConfigError, match="either `dataset` or `dataset_mixture`"):
        config_from_dict(SFTConfig, {"model": "m", "dataset": "demo", "datasets": [{"path": "demo"}]})


def test_chat_template_path_from_a_file_or_a_tokenizer_folder(tiny_model, tmp_path):
    from trainer.engine.models import model_and_tokenizer

    base = without_chat_template(tiny_model, tmp_path)
    assert not model_and_tokenizer(SFTConfig(model=str(base), dataset="demo"))[1].chat_template
    jinja = tmp_path / "chat.jinja"
    jinja.write_text(CHAT_TEMPLATE)
    _, tokenizer = model_and_tokenizer(SFTConfig(model=str(base), dataset="demo", chat_template_path=str(jinja)))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    _, tokenizer = model_and_tokenizer(SFTConfig(model=str(base), dataset="demo", chat_template_path=tiny_model))
    assert tokenizer.chat_template == read_chat_template(tiny_model) and "{%" in tokenizer.chat_template


def test_chat_template_path_errors(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="`chat_template_path` './missing.jinja' does not exist"):
        SFTConfig(model="m", dataset="demo", chat_template_path="./missing.jinja")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(DataError, match="not a valid Jinja template"):
        read_chat_template(str(bad))
    with pytest.raises(DataError, match="holds no chat template"):
        read_chat_template(str(without_chat_template(tiny_model, tmp_path)))


# -- the CLI -----------------------------------------------------------------------------------------------------


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"alignflow {version('alignflow')}"


@pytest.mark.parametrize("spelling", ["--model-name", "--model_name"])
def test_promote_takes_both_spellings(spelling, capsys):
    with pytest.raises(SystemExit) as exc:  # the names parse; the missing --checkpoint/--run is what fails
        cli.main(["promote", spelling, "x", "--tracking_uri", "sqlite:///nowhere.db"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "unrecognized arguments" not in err and "give --model-name and --checkpoint" in err


@pytest.mark.parametrize("flag", ["--hidden-size", "--hidden_size"])
def test_model_takes_both_spellings(flag, tmp_path):
    assert cli.main(["model", "init-tiny", "--out", str(tmp_path / "m"), flag, "32", "--num_heads", "1"]) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["hidden_size"] == 32


@pytest.mark.parametrize("flag", ["--pipeline-root", "--pipeline_root"])
def test_pipeline_takes_both_spellings(flag, tmp_path, capsys):
    from pipelines import cli as pipelines_cli

    code = pipelines_cli.main(["pipeline", "run", "--local", "--config", str(tmp_path / "none.yaml"), flag, "x"])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_every_field_keeps_a_default_and_help_with_aliases():
    for cls in STAGES:
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize("values", [{"model": "a", "model_name_or_path": "b"}, {"model_name_or_path": "b", "model": "a"},
                                    {"vllm_importance_sampling_cap": 2, "vllm_importance_sampling_clip_max": 2}])
def test_a_field_set_twice_under_two_names_is_an_error(values):
    with pytest.raises(ConfigError, match="twice"):
        config_from_dict(GRPOConfig, {"dataset": "demo", **({"model": "m"} if "model" not in values else {}), **values})


def test_docs_list_every_trl_name():
    from trainer.config.trl_names import KNOWN, TRANSLATED

    doc = (ROOT / "docs" / "trl.md").read_text()
    names = set(KNOWN) | set(TRANSLATED) | {a for cls in STAGES for a in aliases(cls)}
    missing = sorted(name for name in names if f"`{name}" not in doc)
    assert not missing, f"docs/trl.md does not mention {missing}"


@pytest.mark.parametrize("report_to, tracked", [("none", False), ("mlflow", True), ("all", True)])
def test_report_to_none_turns_mlflow_off(report_to, tracked, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    config = config_from_dict(SFTConfig, {"model": "m", "dataset": "demo", "report_to": report_to})
    assert config.tracking_uri == ("http://mlflow:5000" if tracked else None)


def test_mixture_as_a_json_flag(tmp_path):
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "t"}])
    config = parse_config(SFTConfig, ["--model", "m", "--datasets", json.dumps([{"path": b}, {"path": b}])])
    assert len(train_rows(config)) == 2
