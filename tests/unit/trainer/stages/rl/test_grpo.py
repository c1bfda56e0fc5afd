"""GRPO inputs: config, data and reward checks that fail before training, prompt truncation."""

import pytest

from tests.helpers import grpo_config, prompts_file, write_jsonl
from trainer.errors import ConfigError, DataError
from trainer.stages.rl.grpo import run_grpo


def test_bad_inputs_fail_before_training(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="divisible by num_generations"):
        grpo_config(tiny_model, tmp_path, per_device_batch_size=6, num_generations=4)
    with pytest.raises(ConfigError, match="reward_weights"):
        grpo_config(tiny_model, tmp_path, reward_weights=[1.0, 2.0])
    sft_data = write_jsonl(tmp_path / "sft.jsonl", [{"text": "hello"}])
    with pytest.raises(DataError, match="needs a `prompt` column"):
        run_grpo(grpo_config(tiny_model, tmp_path, dataset=str(sft_data)))
    with pytest.raises(ValueError, match="Unknown reward function"):
        run_grpo(grpo_config(tiny_model, tmp_path, reward_funcs=["no_such_reward"]))


def test_truncation_mode_and_unsupported_eval_split(tiny_model, tmp_path):
    from trainer.engine.models import load_tokenizer
    from trainer.stages.rl.shared import load_prompts

    tokenizer = load_tokenizer(tiny_model)
    path = prompts_file(tmp_path / "p.jsonl", n=4)
    full = load_prompts(path, "train", tokenizer, grpo_config(tiny_model, tmp_path, max_prompt_length=64))
    cut = {mode: load_prompts(path, "train", tokenizer, grpo_config(tiny_model, tmp_path, max_prompt_length=3,
                                                                     truncation_mode=mode))
           for mode in ("keep_end", "keep_start")}
    assert all(len(ids) > 3 for ids in full.token_ids)
    assert list(cut["keep_end"].token_ids) == [ids[-3:] for ids in full.token_ids]
    assert list(cut["keep_start"].token_ids) == [ids[:3] for ids in full.token_ids]
    with pytest.raises(DataError, match="no prompts left"):
        load_prompts(path, "train", tokenizer, grpo_config(tiny_model, tmp_path, max_prompt_length=3,
                                                           truncation_mode="drop"))
    with pytest.raises(ConfigError, match="eval_split_ratio"):
        run_grpo(grpo_config(tiny_model, tmp_path, eval_split_ratio=0.1))


def test_the_engine_correction_takes_every_importance_sampling_option(tiny_model, tmp_path):
    """TRL's four importance-sampling modes and both bounds reach `rollout_is_weights` (its maths:
    tests/unit/trainer/algorithms/test_losses.py); the hf engine, which samples with the trainer's weights, and
    `importance_sampling_correction: false` get none."""
    from trainer.config.options import parse_config
    from trainer.stages.rl.grpo import GRPOConfig, engine_correction

    config = parse_config(GRPOConfig, ["--model", tiny_model, "--dataset", "demo:math", "--use_vllm", "true",
                                       "--vllm_importance_sampling_mode", "sequence_mask",
                                       "--vllm_importance_sampling_clip_min", "0.5",
                                       "--vllm_importance_sampling_clip_max", "2.0"])
    assert engine_correction(config) == {"mode": "sequence_mask", "clip_min": 0.5, "clip_max": 2.0}
    assert engine_correction(grpo_config(tiny_model, tmp_path, rollout_engine="vllm")) == {
        "mode": "token_truncate", "clip_min": None, "clip_max": 3.0}
    assert engine_correction(grpo_config(tiny_model, tmp_path)) is None  # hf
    assert engine_correction(grpo_config(tiny_model, tmp_path, rollout_engine="vllm",
                                         importance_sampling_correction=False)) is None
    with pytest.raises(ConfigError, match=r"`importance_sampling_min` must be in \[0, importance_sampling_cap"):
        grpo_config(tiny_model, tmp_path, importance_sampling_min=3.0)
