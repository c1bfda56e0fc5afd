"""Preference pairs (trainer/data/preferences.py): truncation of prompt and replies, batches and their masks."""

import logging

import pytest

from trainer.data.preferences import PreferenceText, tokenize_dpo_pairs
from trainer.engine.models import load_tokenizer
from trainer.errors import DataError
from trainer.stages.dpo import collate


def test_tokenization_truncates_prompt_left_and_completion_per_mode(tiny_model, caplog):
    tokenizer = load_tokenizer(tiny_model)
    eos = tokenizer.eos_token_id
    prompt = " ".join(str(i) for i in range(40))
    pair = PreferenceText(prompt, " yes " * 30, " no")
    prompt_ids = tokenizer(prompt)["input_ids"]
    long_ids = tokenizer(" yes " * 30, add_special_tokens=False)["input_ids"] + [eos]

    def run(mode):
        return tokenize_dpo_pairs([pair], tokenizer, "t", chat=False, max_length=30, max_prompt_length=10,
                                  truncation_mode=mode, total_rows=1)

    with caplog.at_level(logging.WARNING):
        start = run("keep_start")
    assert start.prompt_ids[0] == prompt_ids[-10:]  # the end of the prompt survives
    assert start.chosen_ids[0] == long_ids[:20]  # the reply gets max_length - prompt tokens
    assert start.rejected_ids[0] == tokenizer(" no", add_special_tokens=False)["input_ids"] + [eos]
    assert run("keep_end").chosen_ids[0] == long_ids[-20:]
    with pytest.raises(DataError, match="no rows left"):
        run("drop")
    assert "lost their start" in caplog.text and "truncated" in caplog.text
    # Batches: chosen rows first, loss mask only on completion tokens.
    batch = collate(start, [0], tokenizer.pad_token_id)
    assert batch.input_ids.shape == (2, 30)
    assert batch.completion_mask[0].tolist() == [0] * 10 + [1] * 20
    assert batch.completion_mask[1].tolist() == [0] * 10 + [1] * len(start.rejected_ids[0]) + [0] * (
        20 - len(start.rejected_ids[0]))
    assert batch.attention_mask[1].sum() == 10 + len(start.rejected_ids[0])
