"""Reward-model stage inputs that fail before the model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import write_jsonl
from trainer.errors import DataError
from trainer.stages import reward_model as reward
from trainer.stages.reward_model import RewardConfig, run_reward


def rm_config(model: str, dataset: str, out: Path, **overrides) -> RewardConfig:
    values = dict(model=model, dataset=dataset, output_dir=str(out), max_steps=60, per_device_batch_size=16,
                  learning_rate=3e-3, logging_steps=10, max_length=64, disable_progress_bar=True)
    values.update(overrides)
    return RewardConfig(**values)


def test_margin_values_must_be_numbers(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", [{"chosen": "a b", "rejected": "a c", "margin": None}])
    with pytest.raises(DataError, match="row 0: `margin`"):
        run_reward(rm_config(tiny_model, data, tmp_path / "out"))


def test_sft_data_fails_before_the_model_loads_naming_the_columns(tiny_model, tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(reward, "load_reward_model", no_model)
    with pytest.raises(DataError) as err:
        run_reward(rm_config(tiny_model, "demo", tmp_path / "out"))
    assert "`chosen`" in str(err.value) and "`rejected`" in str(err.value)
    assert "SFT" in str(err.value)


def packing_pairs() -> list[dict]:
    """Pairs of different lengths, so that best fit puts several texts in a row and rows end in padding."""
    words = "apple river stone cloud green music paper light table window".split()
    return [{"prompt": f"Answer {'yes' if i % 2 else 'no'}:", "chosen": " " + " ".join(words[:2 + i]) + " yes",
             "rejected": " " + " ".join(words[:1 + i // 2]) + " no"} for i in range(6)]


@pytest.mark.parametrize("pad", ["pad", "eos"])
def test_packed_rows_score_like_padded_ones(tiny_model, pad):
    """`padding_free` packs the 2B texts into fewer rows with restarting position ids and reads each reward at its
    text's last token: the rewards of padded rows, in the same order (chosen, then rejected). Without the position
    ids the packed texts would attend to each other and the numbers would differ. Where pad == eos, transformers
    reads a padded row before its final eos (taking it for padding); packed rows must read the same token."""
    import datasets
    import torch

    from trainer.data.preferences import tokenize_reward_pairs
    from trainer.engine.models import load_reward_model, load_tokenizer

    tokenizer = load_tokenizer(tiny_model)
    data = tokenize_reward_pairs(datasets.Dataset.from_list(packing_pairs()), tokenizer, "pairs", 64, "keep_end")
    pad_id = tokenizer.pad_token_id if pad == "pad" else tokenizer.eos_token_id
    assert all(ids[-1] == tokenizer.eos_token_id != tokenizer.pad_token_id for ids in data.chosen_ids)
    torch.manual_seed(0)
    model = load_reward_model(tiny_model, pad_id).eval()
    indices = list(range(len(data)))
    padded = reward.collate(data, indices, pad_id)
    packed = reward.collate(data, indices, pad_id, pack_to=64)
    assert packed.input_ids.shape[0] < 2 * len(data) and packed.input_ids.shape[1] <= 64
    assert packed.attention_mask is None and packed.num_tokens == padded.num_tokens == int(padded.attention_mask.sum())
    assert packed.num_pairs == padded.num_pairs == len(data)
    with torch.no_grad():
        a, b = torch.cat(reward.pair_rewards(model, padded)), torch.cat(reward.pair_rewards(model, packed))
    assert a.std() > 1e-3, "the rewards must tell the texts apart for the comparison to mean anything"
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_padding_free_refuses_encoders():
    """An encoder reads its reward at a pooled first token and attends across packed texts: refused by name."""
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=1, intermediate_size=8, num_labels=1))
    with pytest.raises(reward.ModelError, match="BertForSequenceClassification.*`padding_free false`"):
        reward.packed_parts(model)
