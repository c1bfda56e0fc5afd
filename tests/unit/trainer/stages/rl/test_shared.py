"""RL prompts through the tokenized-data cache: the token ids of per-row tokenization, a second load that maps the
first one's Arrow file, one entry per option that changes the tokens, and `drop` keeping rows and ids aligned."""

from __future__ import annotations

import logging

import pytest

from tests.helpers import grpo_config, write_jsonl
from trainer.engine.completions import prompt_token_ids
from trainer.engine.models import load_tokenizer
from trainer.stages.rl import shared
from trainer.stages.rl.shared import load_prompts


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNFLOW_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenized"


def varied_prompts(path, chat: bool) -> str:
    """20 prompts of 1 to 16 words (text) or one or two turns (chat); `target` names the row."""
    rows = []
    for i in range(20):
        text = "word " * (i * 7 % 16 + 1)
        prompt = ([{"role": "system", "content": "be brief"}] * (i % 2) + [{"role": "user", "content": text}]
                  if chat else text)
        rows.append({"prompt": prompt, "target": f"row {i}"})
    return write_jsonl(path, rows)


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
@pytest.mark.parametrize("mode", ["keep_end", "keep_start", "drop"])
def test_the_ids_are_those_of_per_row_tokenization(tiny_model, tmp_path, cache, chat, mode):
    """What `load_prompts` built before the cache: `prompt_token_ids` per row, cut per truncation_mode, long rows
    dropped (rows and ids together) under drop."""
    tokenizer, path = load_tokenizer(tiny_model), varied_prompts(tmp_path / "p.jsonl", chat)
    limit = 12 if not chat else 24
    data = load_prompts(path, "train", tokenizer, grpo_config(tiny_model, tmp_path, max_prompt_length=limit,
                                                              truncation_mode=mode))
    full = [(row["target"], prompt_token_ids(row["prompt"], tokenizer))
            for row in load_prompts(path, "train", tokenizer, grpo_config(tiny_model, tmp_path,
                                                                          max_prompt_length=200)).rows]
    assert 0 < sum(len(ids) > limit for _, ids in full) < len(full)  # some rows are cut, some are not
    if mode == "drop":
        expected = [(target, ids) for target, ids in full if len(ids) <= limit]
    else:
        expected = [(target, ids[-limit:] if mode == "keep_end" else ids[:limit]) for target, ids in full]
    assert list(zip(data.rows["target"], data.token_ids, strict=True)) == expected
    assert len(data.token_ids) == len(data.rows) == len(expected)


def test_a_second_load_maps_the_first_ones_entry(tiny_model, tmp_path, cache, caplog, monkeypatch):
    tokenizer, path = load_tokenizer(tiny_model), varied_prompts(tmp_path / "p.jsonl", chat=True)
    config = grpo_config(tiny_model, tmp_path, max_prompt_length=24)
    first = load_prompts(path, "train", tokenizer, config)
    calls = []
    monkeypatch.setattr(shared, "prompt_token_ids", lambda *args: calls.append(args) or prompt_token_ids(*args))
    with caplog.at_level(logging.INFO, logger="trainer.data.token_cache"):
        second = load_prompts(path, "train", tokenizer, config)
    entries = sorted(cache.iterdir())
    assert len(entries) == 1 and f"tokenized data from cache {entries[0]}" in caplog.text
    assert calls == []  # nothing tokenized again
    assert list(second.token_ids) == list(first.token_ids) and second.rows["target"] == first.rows["target"]


def test_each_option_that_changes_the_tokens_has_its_own_entry(tiny_model, tmp_path, cache):
    tokenizer, path = load_tokenizer(tiny_model), varied_prompts(tmp_path / "p.jsonl", chat=False)
    seen = {}
    for limit, mode in [(12, "keep_end"), (8, "keep_end"), (12, "keep_start"), (12, "drop"), (12, "keep_end")]:
        data = load_prompts(path, "train", tokenizer, grpo_config(tiny_model, tmp_path, max_prompt_length=limit,
                                                                  truncation_mode=mode))
        seen[limit, mode] = list(data.token_ids)
        assert len(list(cache.iterdir())) == len(seen)  # the last one, a repeat, adds no entry
    assert len({str(ids) for ids in seen.values()}) == 4


def test_drop_keeps_rows_and_ids_aligned(tiny_model, tmp_path, cache):
    """Each kept row's ids are its own prompt's, in the rows' order; the view reads them by index, from the end
    too, and iterates."""
    tokenizer, path = load_tokenizer(tiny_model), varied_prompts(tmp_path / "p.jsonl", chat=False)
    data = load_prompts(path, "train", tokenizer, grpo_config(tiny_model, tmp_path, max_prompt_length=8,
                                                              truncation_mode="drop"))
    assert 0 < len(data.rows) < 20 and len(data.token_ids) == len(data.rows)
    for i, row in enumerate(data.rows):
        assert data.token_ids[i] == prompt_token_ids(row["prompt"], tokenizer)
        assert len(data.token_ids[i]) <= 8
    assert data.token_ids[-1] == data.token_ids[len(data.rows) - 1]
    with pytest.raises(IndexError):
        data.token_ids[len(data.rows)]
