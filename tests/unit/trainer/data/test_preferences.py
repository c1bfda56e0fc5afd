"""Preference pairs (trainer/data/preferences.py): truncation of prompt and replies, batches and their masks, and the
tokenized pairs in the tokenized-data cache (one entry per rows, tokenizer and options; counts from its `status`)."""

import json
import logging

import datasets
import pytest

from trainer.data.preferences import (
    DROPPED_LONG,
    KEPT,
    SAME_TEXT,
    SAME_TOKENS,
    tokenize_dpo_pairs,
    tokenize_reward_pairs,
)
from trainer.engine.models import load_tokenizer
from trainer.errors import DataError
from trainer.stages.dpo import collate


def test_tokenization_truncates_prompt_left_and_completion_per_mode(tiny_model, caplog):
    tokenizer = load_tokenizer(tiny_model)
    eos = tokenizer.eos_token_id
    prompt = " ".join(str(i) for i in range(40))
    pair = datasets.Dataset.from_list([{"prompt": prompt, "chosen": " yes " * 30, "rejected": " no"}])
    prompt_ids = tokenizer(prompt)["input_ids"]
    long_ids = tokenizer(" yes " * 30, add_special_tokens=False)["input_ids"] + [eos]

    def run(mode):
        return tokenize_dpo_pairs(pair, tokenizer, "t", max_length=30, max_prompt_length=10, truncation_mode=mode)

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


# -- Tokenized pairs in the tokenized-data cache (trainer.data.token_cache) ------------------------------------------

WORDS = " ".join(f"w{i}" for i in range(30))
# One row per outcome: kept; chosen == rejected as text; a long prompt (cut); long replies that differ at their
# start (truncated, kept); long replies that differ only at their end (keep_start cuts the difference away).
OUTCOME_ROWS = [
    {"prompt": "Q:", "chosen": " yes", "rejected": " no", "margin": 0.5},
    {"prompt": "Q:", "chosen": " same", "rejected": " same", "margin": 1.5},
    {"prompt": "Q: " + WORDS, "chosen": " yes", "rejected": " no", "margin": 2.5},
    {"prompt": "Q:", "chosen": " yes" + WORDS, "rejected": " no" + WORDS, "margin": 3.5},
    {"prompt": "Q:", "chosen": WORDS + " yes", "rejected": WORDS + " no", "margin": 4.5},
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNFLOW_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenized"


def _tokens(data) -> list:
    return [data.pair(i) for i in range(len(data))]


def test_dpo_outcomes_are_counted_per_row_and_warned_as_before(tiny_model, cache, caplog):
    """The `status` column says what became of each row; the warnings count it (the same messages, and numbers, as
    the in-memory path had: 1 identical text, 1 prompt cut, 2 truncated of which 1 lost its only difference)."""
    tokenizer = load_tokenizer(tiny_model)
    rows = datasets.Dataset.from_list(OUTCOME_ROWS)
    with caplog.at_level(logging.WARNING, logger="trainer.data.preferences"):
        data = tokenize_dpo_pairs(rows, tokenizer, "t", max_length=16, max_prompt_length=8, truncation_mode="keep_start")
    assert data.status.tolist() == [KEPT, SAME_TEXT, KEPT, KEPT, SAME_TOKENS]
    assert data.rows.tolist() == [0, 2, 3] and len(data) == 3
    messages = [r.getMessage() for r in caplog.records]
    assert messages[:2] == ["t: dropped 1 of 5 pairs whose chosen equals their rejected.",
                            "t: 1 of 5 prompts are longer than max_prompt_length=8 and lost their start."]
    assert messages[2].startswith("t: dropped 1 of 5 pairs whose chosen and rejected tokens are identical after "
                                  "truncation to max_length=16 (truncation_mode=keep_start); raise `max_length`")
    assert messages[3:] == ["t: 2 of 5 rows are longer than max_length=16 and were truncated (keep_start)."]
    assert data.pair(1).prompt == tokenizer("Q: " + WORDS)["input_ids"][-8:]
    assert [data.pair_length(i) for i in range(3)] == [2 * len(p.prompt) + len(p.chosen) + len(p.rejected)
                                                       for p in _tokens(data)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.data.preferences"):
        dropped = tokenize_dpo_pairs(rows, tokenizer, "t", max_length=16, max_prompt_length=8, truncation_mode="drop")
    assert dropped.status.tolist() == [KEPT, SAME_TEXT, KEPT, DROPPED_LONG, DROPPED_LONG]
    assert "t: dropped 2 of 5 rows longer than max_length=16 (truncation_mode=drop)." in caplog.text


def test_reward_outcomes_and_margins_of_the_kept_pairs(tiny_model, cache, caplog):
    """Prompt + reply as one text: keep_start cuts the end, where the texts of rows 2 (after its long prompt) and 4
    differ (dropped, counted among the 4 pairs left after the identical text); keep_end cuts the start, where row
    3's differ. Margins follow their own rows."""
    tokenizer = load_tokenizer(tiny_model)
    rows = datasets.Dataset.from_list(OUTCOME_ROWS)
    with caplog.at_level(logging.WARNING, logger="trainer.data.preferences"):
        start = tokenize_reward_pairs(rows, tokenizer, "t", 16, "keep_start")
    assert start.status.tolist() == [KEPT, SAME_TEXT, SAME_TOKENS, KEPT, SAME_TOKENS]
    assert start.margins == [0.5, 3.5]
    assert all(p.prompt == [] and len(p.chosen) <= 16 for p in _tokens(start))
    assert "t: dropped 2 of 4 pairs whose chosen and rejected tokens are identical after truncation" in caplog.text
    assert "t: 3 of 4 rows are longer than max_length=16 and were truncated (keep_start)." in caplog.text
    tokenizer.truncation_side = "left"  # as the stage sets it for keep_end
    end = tokenize_reward_pairs(rows, tokenizer, "t", 16, "keep_end")
    assert end.status.tolist() == [KEPT, SAME_TEXT, KEPT, SAME_TOKENS, KEPT] and end.margins == [0.5, 2.5, 4.5]
    assert end.pair(2).chosen[-1] == tokenizer.eos_token_id and end.longest() == 16
    no_margin = tokenize_reward_pairs(rows.remove_columns("margin"), tokenizer, "t", 16, "drop")
    assert no_margin.margins is None and no_margin.status.tolist() == [KEPT, SAME_TEXT, DROPPED_LONG, DROPPED_LONG,
                                                                       DROPPED_LONG]
    with pytest.raises(DataError, match=r"t: row 3: `margin` must be a finite number, got nan"):
        tokenize_reward_pairs(rows.map(lambda r, i: {"margin": float("nan") if i == 3 else r["margin"]},
                                       with_indices=True), tokenizer, "t", 16, "drop")


@pytest.mark.parametrize("stage", ["dpo", "reward"])
def test_second_call_maps_the_cached_entry(tiny_model, cache, caplog, monkeypatch, stage):
    """The same rows (a new object), tokenizer and options: no row is tokenized again, the same tokens and
    margins come back, and the warnings are the same (they are counted from the entry's `status` column)."""
    import trainer.data.preferences as preferences

    tokenizer = load_tokenizer(tiny_model)

    def tokenize(rows):
        if stage == "dpo":
            return tokenize_dpo_pairs(rows, tokenizer, "t", 16, 8, "keep_start")
        return tokenize_reward_pairs(rows, tokenizer, "t", 16, "keep_start")

    rows = datasets.Dataset.from_list(OUTCOME_ROWS * 3)
    with caplog.at_level(logging.INFO):
        first = tokenize(rows)
    first_warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    (entry,) = cache.iterdir()
    assert entry.name.startswith(f"{stage}-") and first.table.cache_files[0]["filename"].startswith(str(entry))
    calls = []
    monkeypatch.setattr(preferences, "preference_texts", lambda *args: calls.append(args))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again = tokenize(rows.map(lambda r: r))
    assert f"tokenized data from cache {entry}" in caplog.text and not calls
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == first_warnings
    assert _tokens(again) == _tokens(first) and again.margins == first.margins and len(again) == len(first) > 0
    assert list(again.chosen_ids) == [p.chosen for p in _tokens(first)]


@pytest.mark.parametrize("change", ["max_length", "max_prompt_length", "truncation_mode", "rows", "template",
                                    "truncation_side", "stage"])
def test_anything_that_changes_the_pairs_tokens_gets_its_own_entry(tiny_model, cache, change):
    tokenizer = load_tokenizer(tiny_model)
    rows = datasets.Dataset.from_list(OUTCOME_ROWS)
    args = dict(max_length=16, max_prompt_length=8, truncation_mode="keep_start")
    tokenize_dpo_pairs(rows, tokenizer, "t", **args)
    if change == "rows":
        rows = rows.select(range(4))
    elif change == "template":
        tokenizer = load_tokenizer(tiny_model)
        tokenizer.chat_template += " "
    elif change in args:
        args[change] = {"max_length": 20, "max_prompt_length": 4, "truncation_mode": "keep_end"}[change]
    if change in ("truncation_side", "stage"):
        tokenize_reward_pairs(rows, tokenizer, "t", 16, "keep_start")
        if change == "truncation_side":
            tokenizer.truncation_side = "left"
            tokenize_reward_pairs(rows, tokenizer, "t", 16, "keep_start")
    else:
        tokenize_dpo_pairs(rows, tokenizer, "t", **args)
    assert len(list(cache.iterdir())) == (3 if change == "truncation_side" else 2)


def test_chat_pairs_are_keyed_and_rendered_as_chat(tiny_model, cache):
    """Chat pairs render through the template (no eos after the template's end of turn), and their entry is
    separate from the same conversations' text."""
    tokenizer = load_tokenizer(tiny_model)
    row = {"prompt": [{"role": "user", "content": "Capital of Peru?"}],
           "chosen": [{"role": "assistant", "content": "Lima."}],
           "rejected": [{"role": "assistant", "content": "Paris."}]}
    data = tokenize_dpo_pairs(datasets.Dataset.from_list([row] * 2), tokenizer, "chat", 64, 32, "keep_start")
    assert tokenizer.decode(data.chosen_ids[1]) == "Lima.<|im_end|>\n"
    assert tokenizer.decode(data.prompt_ids[0]).endswith("<|im_start|>assistant\n")
    (entry,) = cache.iterdir()
    assert json.loads((entry / "meta.json").read_text())["key"]["chat"] is True


def test_empty_or_wrong_data_is_refused_before_any_entry(tiny_model, cache):
    tokenizer = load_tokenizer(tiny_model)
    with pytest.raises(DataError, match="every pair has chosen == rejected"):
        tokenize_dpo_pairs(datasets.Dataset.from_dict({"chosen": [], "rejected": []}), tokenizer, "t", 16, 8,
                           "keep_start")
    with pytest.raises(DataError, match="looks like SFT data"):
        tokenize_reward_pairs(datasets.Dataset.from_list([{"text": "a"}]), tokenizer, "t", 16, "keep_start")
    reply = [{"role": "assistant", "content": "b"}]
    rows = [{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
             "rejected": reply},
            {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": None, "content": "a"}], "rejected": reply}]
    with pytest.raises(DataError, match="Row 1"):
        tokenize_dpo_pairs(datasets.Dataset.from_list(rows), tokenizer, "t", 16, 8, "keep_start")
    assert not cache.exists() or not any(cache.iterdir())
