"""Run identity (trainer/engine/identity.py) and the config checks that keep a run from harming its inputs: the
identity's fields and what is left out of it, the model digest, how two identities differ, an `output_dir`
that meets an input, duplicate YAML keys and a list where one value is due. No training here: the
resume-identity runs are in tests/stage/test_resume_identity.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from trainer.config.options import config_from_dict, parse_config
from trainer.engine import identity
from trainer.errors import ConfigError
from trainer.stages.dpo import DPOConfig
from trainer.stages.rl.grpo import GRPOConfig
from trainer.stages.sft import SFTConfig


def sft_values(**overrides) -> dict:
    return dataclasses.asdict(SFTConfig(**{"model": "m", "dataset": "demo", **overrides}))


def model_folder(path: Path, weights: bytes = b"\0" * 64) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"hidden_size": 8}')
    (path / "model.safetensors").write_bytes(weights)
    return path


# --- identity ------------------------------------------------------------------------------------------------


def test_identity_holds_what_changes_the_result_and_leaves_out_the_rest():
    ident = identity.run_identity("sft", sft_values(), 1, data="sha256-0")
    assert ident["stage"] == "sft" and ident["data"] == "sha256-0" and ident["seed"] == 42
    assert ident["model"] == {"path": "m", "digest": None}  # a hub id: no folder to hash
    for name in ("learning_rate", "gradient_accumulation_steps", "lora_r", "packing", "max_length", "dtype"):
        assert name in ident, name
    for name in ("output_dir", "logging_steps", "save_steps", "max_steps", "num_epochs", "mlflow_experiment",
                 "resume_from_checkpoint", "resume_allow_changes", "num_sample_completions", "lora_alpha"):
        assert name not in ident, name  # LoRA details only with LoRA on
    assert "lora_alpha" in identity.run_identity("sft", sft_values(lora_r=8), 1)
    json.dumps(ident)  # goes into alignflow.json as it is


def test_global_batch_for_stages_whose_ranks_share_one_update_and_processes_for_the_others():
    one = identity.run_identity("sft", sft_values(per_device_batch_size=4), 1)
    two = identity.run_identity("sft", sft_values(per_device_batch_size=2), 2)
    assert one["global_batch_size"] == two["global_batch_size"] == 4 and "per_device_batch_size" not in one
    assert identity.differences(one, two) == []  # 1 x 4 and 2 x 2 take the same update
    same_size = identity.run_identity("sft", sft_values(per_device_batch_size=4), 2)
    assert [str(c) for c in identity.differences(one, same_size)] == [
        "global batch (per_device_batch_size x processes) 4 -> 8"]
    grpo = dataclasses.asdict(GRPOConfig(model="m", dataset="demo"))
    assert [c.field for c in identity.differences(identity.run_identity("grpo", grpo, 1),
                                                  identity.run_identity("grpo", grpo, 2))] == ["processes"]


def test_differences_name_each_field_stage_first_and_skip_what_one_side_lacks():
    old = identity.run_identity("sft", sft_values(), 1, data="sha256-a")
    new = identity.run_identity("dpo", dataclasses.asdict(DPOConfig(model="m", dataset="demo", seed=7)), 1,
                                data="sha256-b")
    changes = identity.differences(old, new)
    assert [c.field for c in changes[:3]] == ["stage", "data", "seed"]
    assert "training data fingerprint sha256-a -> sha256-b" in [str(c) for c in changes]
    assert "beta" not in [c.field for c in changes]  # only DPO has it: not comparable
    assert [str(c) for c in identity.differences(identity.run_identity("sft", sft_values(), 1),
                                                 identity.run_identity("sft", sft_values(lora_r=8), 1))] == [
        "lora_r 0 -> 8"]  # not the details LoRA-less run never had


def test_model_digest_follows_content_not_path_and_skips_bookkeeping(tmp_path):
    a = model_folder(tmp_path / "a")
    copy = Path(shutil.copytree(a, tmp_path / "copy"))
    other = model_folder(tmp_path / "other", b"\1" * 64)
    digest = identity.model_digest(str(a))
    assert digest.startswith("sha256-") and digest == identity.model_digest(str(copy))
    assert identity.model_digest(str(other)) != digest
    (copy / "alignflow.json").write_text("{}")  # a manifest, step checkpoints and hidden caches are not the model
    (copy / "checkpoint-2").mkdir()
    (copy / "checkpoint-2" / "model.safetensors").write_bytes(b"x")
    (copy / ".cache").mkdir()
    (copy / ".cache" / "x").write_text("y")
    assert identity.model_digest(str(copy)) == digest
    (copy / "tokenizer.json").write_text("{}")
    assert identity.model_digest(str(copy)) != digest
    assert identity.model_digest("org/name") is None and identity.model_digest(None) is None

    old = identity.run_identity("sft", sft_values(model=str(a)), 1, str(a))
    moved = identity.run_identity("sft", sft_values(model=str(tmp_path / "moved")), 1, model_hash=digest)
    assert identity.differences(old, moved) == []  # the same weights elsewhere: the same run
    changed = identity.differences(old, identity.run_identity("sft", sft_values(model=str(a)), 1, str(other)))
    assert [c.field for c in changed] == ["model"] and "its content changed" in str(changed[0])


def test_large_files_are_hashed_by_their_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "FULL_HASH_BYTES", 4 << 20)
    folder = model_folder(tmp_path / "big", bytes(5 << 20))
    digest = identity.model_digest(str(folder))
    with open(folder / "model.safetensors", "r+b") as fh:
        fh.seek((5 << 20) - 10)
        fh.write(b"changed")  # inside the last MiB
    assert identity.model_digest(str(folder)) != digest


def test_manifests_from_before_identities_compare_what_they_hold():
    config = sft_values(learning_rate=3e-3)
    old = {"stage": "sft", "config": config, "world_size": 1,
           "datasets": {"train": {"fingerprint": "b1f4c2"}}}  # datasets' cache fingerprint: not comparable
    derived = identity.manifest_identity(old)
    assert "model" not in derived and "data" not in derived and derived["learning_rate"] == 3e-3
    new = identity.run_identity("sft", sft_values(learning_rate=1e-2), 1, data="sha256-x")
    assert [str(c) for c in identity.differences(derived, new)] == ["learning_rate 0.003 -> 0.01"]
    assert identity.manifest_identity({"identity": {"stage": "dpo"}}) == {"stage": "dpo"}


def test_length_changes_are_apart_from_the_identity():
    manifest = {"config": sft_values(max_steps=4)}
    assert [str(c) for c in identity.length_changes(manifest, sft_values(max_steps=6))] == ["max_steps 4 -> 6"]
    assert identity.length_changes(manifest, sft_values(max_steps=4)) == []


# --- output_dir apart from the inputs ---------------------------------------------------------------------------


@pytest.mark.parametrize("output, words", [
    ("{model}", "is the `model` input"),
    ("{model}/run", "lies inside the `model` input"),
    ("{root}", "contains the `model` input"),
])
def test_output_dir_meeting_the_model_is_refused(tmp_path, output, words):
    model = model_folder(tmp_path / "m")
    with pytest.raises(ConfigError, match=words) as err:
        SFTConfig(model=str(model), dataset="demo", output_dir=output.format(model=model, root=tmp_path))
    assert "`output_dir`" in str(err.value) and "of its own" in str(err.value)


def test_output_dir_is_compared_with_every_input(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "a"}\n')
    ref = model_folder(tmp_path / "ref")
    link = tmp_path / "link"
    link.symlink_to(ref)
    with pytest.raises(ConfigError, match="contains the `dataset` input"):
        SFTConfig(model="m", dataset=str(data / "train.jsonl"), output_dir=str(data))
    with pytest.raises(ConfigError, match="is the `ref_model` input"):
        DPOConfig(model="m", dataset="demo", ref_model=str(ref), output_dir=str(link))  # through a symlink
    with pytest.raises(ConfigError, match="lies inside the `reward_funcs` input"):
        GRPOConfig(model="m", dataset="demo", reward_funcs=["exact_answer", str(ref)], output_dir=str(ref / "o"))
    mixture = json.dumps([{"path": str(data / "train.jsonl")}])
    with pytest.raises(ConfigError, match=r"`dataset_mixture\[0\]` input"):
        SFTConfig(model="m", dataset_mixture=mixture, output_dir=str(data))
    # s3:// compares as prefixes, without reaching the store; a local path never meets a remote one.
    with pytest.raises(ConfigError, match="lies inside the `model` input 's3://b/base/'"):
        SFTConfig(model="s3://b/base/", dataset="demo", output_dir="s3://b/base/run")
    SFTConfig(model="s3://b/base", dataset="demo", output_dir="s3://b/base-sft")
    SFTConfig(model=str(ref), dataset="demo", output_dir=str(tmp_path / "ref-sft"))
    SFTConfig(model="org/name", dataset="demo", output_dir="org/name")  # a hub id is not a local folder


# --- config hygiene ---------------------------------------------------------------------------------------------


def test_duplicate_yaml_keys_name_the_key_and_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("learning_rate: 0.001\nseed: 3\nlearning_rate: 50\n")
    with pytest.raises(ConfigError, match=r"dup.yaml.*`learning_rate` is set twice, on line 1 and again on line 3"):
        parse_config(SFTConfig, ["--model", "m", "--dataset", "demo", "--config", str(path)])
    path.write_text("base: &b {seed: 1}\nmerged:\n  <<: *b\n  lr: 2\n")  # merge keys are not duplicates
    from trainer.config.strict_yaml import strict_yaml

    assert strict_yaml(path.read_text())["merged"] == {"seed": 1, "lr": 2}


def test_a_list_where_one_value_is_due_names_the_option_and_type(tmp_path):
    path = tmp_path / "lr.yaml"
    path.write_text("learning_rate: [0.001, 0.002]\n")
    with pytest.raises(ConfigError, match=r"`learning_rate` in .*lr.yaml is a list \(\[0.001, 0.002\]\); it takes "
                                          "a number"):
        parse_config(SFTConfig, ["--model", "m", "--dataset", "demo", "--config", str(path)])
    with pytest.raises(ConfigError, match="`truncation_mode` in the stage config is a list .* one of keep_start"):
        config_from_dict(SFTConfig, {"model": "m", "dataset": "demo", "truncation_mode": ["drop"]})
    with pytest.raises(ConfigError, match=r"`--learning_rate` takes a number; it was given more than one value "
                                          r"\(`0.002` is left over\)"):
        parse_config(SFTConfig, ["--model", "m", "--dataset", "demo", "--learning_rate", "0.001", "0.002"])
    # Lists stay lists.
    assert config_from_dict(SFTConfig, {"model": "m", "dataset": "demo", "lora_target_modules": ["q_proj", "v_proj"]}
                            ).lora_target_modules == ["q_proj", "v_proj"]


def test_resume_allow_changes_needs_a_resume():
    with pytest.raises(ConfigError, match="`resume_allow_changes` applies to a resumed run"):
        SFTConfig(model="m", dataset="demo", resume_allow_changes=True)
    assert SFTConfig(model="m", dataset="demo", resume_allow_changes=True, resume_from_checkpoint="auto")
