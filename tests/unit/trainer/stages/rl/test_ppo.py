"""PPO config checks, and critics that are refused (or cut to one label) before training."""

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ppo_config
from trainer.engine import checkpoint as ckpt
from trainer.engine.models import load_tokenizer
from trainer.errors import ConfigError, ModelError
from trainer.stages.rl.ppo import load_critic, run_ppo


def test_critic_keeps_the_row_of_reward_label(tiny_model, sentiment_checkpoint, tmp_path):
    """A classifier with several labels becomes a one-label critic: the score row of `reward_label`."""
    sentiment = sentiment_checkpoint
    config = ppo_config(tiny_model, tmp_path, critic="reward_model", critic_model=sentiment, reward_label="POSITIVE")
    critic = load_critic(config, load_tokenizer(tiny_model), sentiment, None)
    torch.testing.assert_close(critic.score.weight, load_file(Path(sentiment) / "model.safetensors")["score.weight"][1:])
    with pytest.raises(ModelError, match=r"set `reward_label` to one of \['NEGATIVE', 'POSITIVE'\]"):
        load_critic(dataclasses.replace(config, reward_label=None), load_tokenizer(tiny_model), sentiment, None)


def test_unusable_critics_are_one_line_errors_before_training(tiny_model, reward_checkpoint, tmp_path):
    """No reward model to start from; another tokenizer; a bidirectional encoder (its value of token t
    would see the tokens after t): each fails before the MLflow run or any checkpoint."""
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = load_tokenizer(tiny_model)
    other = tmp_path / "other-tokenizer"
    shutil.copytree(reward_checkpoint, other)
    tokenizer.add_tokens(["<|new|>"])
    tokenizer.save_pretrained(other)
    encoder = tmp_path / "encoder"
    BertForSequenceClassification(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=64, num_labels=1)
                                  ).save_pretrained(encoder)
    load_tokenizer(tiny_model).save_pretrained(encoder)
    cases = [({}, ConfigError, r"`reward_funcs` has 0 \(\[\]\); set `critic_model`"),
             ({"critic_model": str(other)}, ModelError, "another tokenizer than the policy"),
             ({"critic_model": str(encoder)}, ModelError, "is a BertForSequenceClassification, not a causal-LM")]
    for overrides, error, message in cases:
        out = tmp_path / f"out-{len(overrides)}-{error.__name__}-{message[:5]}"
        with pytest.raises(error, match=message) as err:
            run_ppo(ppo_config(tiny_model, tmp_path, critic="reward_model", output_dir=str(out), **overrides))
        assert "\n" not in str(err.value)
        assert not ckpt.read_history(str(out)) and not ckpt.is_complete(str(out))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"batch_size": 12, "mini_batch_size": 8}, "multiple of mini_batch_size"),
    ({"mini_batch_size": 8, "per_device_batch_size": 3}, "multiple of per_device_batch_size"),
    ({"gradient_accumulation_steps": 2}, "leave `gradient_accumulation_steps` at 1"),
    ({"reward_weights": [1.0, 2.0]}, "reward_weights"),
    ({"adap_kl_ctrl": True, "target_kl": 0.0}, "target_kl"),
    ({"ppo_epochs": 0}, "ppo_epochs"),
    ({"rollout_engine": "nope"}, None),
    ({"critic_model": "rm"}, "`critic_model` .* is used with critic=reward_model only"),
])
def test_bad_config_is_rejected(tiny_model, tmp_path, overrides, message):
    from trainer.config.options import config_from_dict
    from trainer.stages.rl.ppo import PPOConfig

    if message is None:  # a Literal field: rejected by the parser, as for GRPO
        with pytest.raises(ConfigError, match="invalid choice"):
            config_from_dict(PPOConfig, {"model": "m", "dataset": "d", **overrides})
        return
    with pytest.raises(ConfigError, match=message):
        ppo_config(tiny_model, tmp_path, **overrides)


def test_cli_help_lists_ppo_fields(capsys):
    from trainer.cli import main as cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "ppo", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for field in ("--mini_batch_size", "--adap_kl_ctrl", "--horizon", "--rollout_engine", "--reward_funcs", "--critic",
                  "--critic_model", "--reward_label", "--reward_label_score"):
        assert field in out, field
