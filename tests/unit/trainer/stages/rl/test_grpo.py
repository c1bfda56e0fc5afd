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
    assert cut["keep_end"].token_ids == [ids[-3:] for ids in full.token_ids]
    assert cut["keep_start"].token_ids == [ids[:3] for ids in full.token_ids]
    with pytest.raises(DataError, match="no prompts left"):
        load_prompts(path, "train", tokenizer, grpo_config(tiny_model, tmp_path, max_prompt_length=3,
                                                           truncation_mode="drop"))
    with pytest.raises(ConfigError, match="eval_split_ratio"):
        run_grpo(grpo_config(tiny_model, tmp_path, eval_split_ratio=0.1))
