"""Data loading, SFT format detection, tokenization with loss masks, truncation and packing."""

from __future__ import annotations

import gzip
import json
import logging
import math
import random
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import write_jsonl
from trainer.data.chat_templates import render_chat
from trainer.data.formatting import detect_sft_format, pack_best_fit, tokenize_sft
from trainer.data.sources import demo_path, load_rows
from trainer.errors import DataError

ROWS = [
    {"prompt": "What is 2 plus 2?", "completion": " 4"},
    {"prompt": "Spell cat backwards.", "completion": " tac"},
    {"prompt": "Say hi.", "completion": " hi"},
]


def _write(path: Path, rows: list[dict]) -> str:
    """Write `rows` in the format the file name asks for; returns the path as a string."""
    name = path.name
    if name.endswith(".jsonl.gz"):
        with gzip.open(path, "wt") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    elif name.endswith(".jsonl"):
        write_jsonl(path, rows)
    elif name.endswith(".json"):
        path.write_text(json.dumps(rows))
    elif name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif name.endswith(".csv"):
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    else:
        raise AssertionError(name)
    return str(path)


def _dataset(rows: list[dict]) -> datasets.Dataset:
    return datasets.Dataset.from_list(rows)


# ----------------------------------------------------------------------------------------------
# load_rows


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.parquet", "d.csv", "d.jsonl.gz"])
def test_load_rows_reads_files(tmp_path, name):
    ds = load_rows(_write(tmp_path / name, ROWS))
    assert ds.to_list() == ROWS


def test_load_rows_reads_saved_dataset(tmp_path):
    _dataset(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert load_rows(str(tmp_path / "saved")).to_list() == ROWS


def test_load_rows_selects_split_of_saved_dataset_dict(tmp_path):
    folder = str(tmp_path / "dd")
    datasets.DatasetDict({"train": _dataset(ROWS[:1]), "test": _dataset(ROWS[1:])}).save_to_disk(folder)
    assert load_rows(folder).to_list() == ROWS[:1]
    assert load_rows(folder, split="test").to_list() == ROWS[1:]
    with pytest.raises(DataError) as err:
        load_rows(folder, split="validation")
    message = str(err.value)
    assert "'validation'" in message and "['train', 'test']" in message and "dataset_split" in message


def test_load_rows_reads_a_folder_of_files(tmp_path):
    (tmp_path / "data" / "more").mkdir(parents=True)
    _write(tmp_path / "data" / "a.jsonl", ROWS[:2])
    _write(tmp_path / "data" / "more" / "b.jsonl", ROWS[2:])
    (tmp_path / "data" / "README.md").write_text("not data")
    assert sorted(load_rows(str(tmp_path / "data"))["prompt"]) == sorted(r["prompt"] for r in ROWS)


def test_load_rows_folder_errors(tmp_path):
    (tmp_path / "mixed").mkdir()
    _write(tmp_path / "mixed" / "a.jsonl", ROWS)
    _write(tmp_path / "mixed" / "b.csv", ROWS)
    with pytest.raises(DataError, match=r"mixes file types \['csv', 'json'\]"):
        load_rows(str(tmp_path / "mixed"))
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="holds no .jsonl/.json/.parquet/.csv files"):
        load_rows(str(tmp_path / "nothing"))


def test_load_rows_demo_data():
    sft = load_rows("demo")
    assert sft.column_names == ["prompt", "completion"] and len(sft) > 100
    chat = load_rows("demo:chat")
    assert chat.column_names == ["messages"] and chat[0]["messages"][0]["role"] == "system"
    with pytest.raises(DataError) as err:
        load_rows("demo:nope")
    available = sorted(f.stem for f in demo_path("sft").parent.glob("*.jsonl"))
    assert {"chat", "sft"} <= set(available)
    assert "`demo:nope`" in str(err.value) and f"available: {', '.join(available)}." in str(err.value)


@pytest.mark.parametrize("spec", ["{tmp}/missing.jsonl", "{tmp}/missing_folder", "missing.parquet",
                                  "./missing", "a/b/c"])
def test_load_rows_missing_path(tmp_path, spec):
    spec = spec.format(tmp=tmp_path)
    with pytest.raises(DataError) as err:
        load_rows(spec)
    assert f"{spec!r} does not exist" in str(err.value)


def test_load_rows_unsupported_extension(tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    with pytest.raises(DataError) as err:
        load_rows(str(tmp_path / "data.txt"))
    assert "unsupported file type" in str(err.value) and ".jsonl" in str(err.value)


@pytest.mark.parametrize(("name", "content"), [
    ("empty.jsonl", ""),
    ("blank.jsonl", "\n\n"),
    ("empty.json", "[]"),
    ("empty.csv", ""),
    ("header_only.csv", "prompt,completion\n"),
    ("empty.jsonl.gz", None),
    ("empty.parquet", None),
])
def test_load_rows_empty_file(tmp_path, name, content):
    path = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(path, "wt"):
            pass
    elif name.endswith(".parquet"):
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    else:
        path.write_text(content)
    with pytest.raises(DataError) as err:
        load_rows(str(path))
    assert "is empty" in str(err.value)


def test_load_rows_empty_saved_dataset(tmp_path):
    empty = datasets.Dataset.from_dict({"text": []})
    empty.save_to_disk(str(tmp_path / "one_shard"), num_shards=1)  # readable: a shard with no rows
    with pytest.raises(DataError) as err:
        load_rows(str(tmp_path / "one_shard"))
    assert "is empty" in str(err.value) and "['text']" in str(err.value)
    # By default `datasets` writes no shard at all, and then cannot load the folder.
    empty.save_to_disk(str(tmp_path / "no_shard"))
    datasets.DatasetDict({"train": _dataset(ROWS), "test": empty}).save_to_disk(str(tmp_path / "dict"))
    for folder in ("no_shard", "dict"):
        with pytest.raises(DataError) as err:
            load_rows(str(tmp_path / folder))
        assert "is empty" in str(err.value)


def test_load_rows_folder_of_empty_files(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text("")
    (tmp_path / "data" / "b.jsonl").write_text("\n")
    with pytest.raises(DataError) as err:
        load_rows(str(tmp_path / "data"))
    assert "is empty" in str(err.value)


def test_load_rows_malformed_file(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError) as err:
        load_rows(str(tmp_path / "bad.jsonl"))
    assert "Could not parse" in str(err.value) and "bad.jsonl" in str(err.value)


# ----------------------------------------------------------------------------------------------
# Formats


@pytest.mark.parametrize(("columns", "fmt"), [
    ({"text": "a"}, "text"),
    ({"prompt": "a", "completion": "b"}, "prompt_completion"),
    ({"prompt": "a", "completion": "b", "text": "c"}, "prompt_completion"),
    ({"messages": [{"role": "user", "content": "a"}], "text": "c"}, "messages"),
])
def test_detect_sft_format(columns, fmt):
    assert detect_sft_format(_dataset([columns]), "d") == fmt


def test_missing_columns_lists_formats_and_columns():
    with pytest.raises(DataError) as err:
        detect_sft_format(_dataset([{"question": "q", "answer": "a"}]), "my.jsonl")
    message = str(err.value)
    assert "'my.jsonl'" in message
    assert "['answer', 'question']" in message
    assert "`text`" in message and "`prompt` + `completion`" in message and "`messages`" in message
    assert "dpo" not in message


def test_preference_data_gets_the_dpo_hint():
    with pytest.raises(DataError) as err:
        detect_sft_format(_dataset([{"prompt": "p", "chosen": "a", "rejected": "b"}]), "prefs")
    assert "['chosen', 'prompt', 'rejected']" in str(err.value)
    assert "preference data" in str(err.value) and "alignflow train dpo" in str(err.value)


def test_prompt_only_data_gets_the_grpo_hint():
    with pytest.raises(DataError, match="alignflow train grpo"):
        detect_sft_format(_dataset([{"prompt": "p"}]), "prompts")


# ----------------------------------------------------------------------------------------------
# tokenize_sft


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The maximal runs of consecutive masked-in tokens."""
    runs, current = [], []
    for token, keep in zip(ids, mask):
        if keep:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return runs + [current] if current else runs


def test_prompt_completion_masks_exactly_the_completion_and_eos(tokenizer):
    out = tokenize_sft(_dataset(ROWS), tokenizer, "d", max_length=512, truncation_mode="keep_start")
    assert len(out) == len(ROWS)
    for row, ids, mask in zip(ROWS, out.input_ids, out.loss_mask):
        prompt_ids = tokenizer(row["prompt"])["input_ids"]
        completion_ids = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        assert ids == prompt_ids + completion_ids + [tokenizer.eos_token_id]
        assert mask == [0] * len(prompt_ids) + [1] * (len(completion_ids) + 1)
        assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == row["completion"] + tokenizer.eos_token


def test_prompt_completion_trains_on_everything_without_completion_only_loss(tokenizer):
    out = tokenize_sft(_dataset(ROWS), tokenizer, "d", 512, "keep_start", completion_only_loss=False)
    for row, ids, mask in zip(ROWS, out.input_ids, out.loss_mask):
        assert mask == [1] * len(ids)
        assert tokenizer.decode(ids) == row["prompt"] + row["completion"] + tokenizer.eos_token


def test_messages_mask_exactly_the_assistant_replies(tokenizer):
    rows = load_rows("demo:chat").select(range(3))
    out = tokenize_sft(rows, tokenizer, "chat", 1024, "keep_start")
    assert len(out) == 3
    for row, ids, mask in zip(rows, out.input_ids, out.loss_mask):
        assert tokenizer.decode(ids) == render_chat(tokenizer, row["messages"])
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert len(replies) >= 2  # several turns, so the test checks that user turns between are masked out
        # Each reply is learned with its end-of-turn token; the template's newline after it comes along.
        assert [tokenizer.decode(run) for run in _runs(ids, mask)] == [r + "<|im_end|>\n" for r in replies]


def test_messages_train_on_everything_without_assistant_only_loss(tokenizer):
    rows = load_rows("demo:chat").select(range(2))
    out = tokenize_sft(rows, tokenizer, "chat", 1024, "keep_start", assistant_only_loss=False)
    for row, ids, mask in zip(rows, out.input_ids, out.loss_mask):
        assert mask == [1] * len(ids)
        assert tokenizer.decode(ids) == render_chat(tokenizer, row["messages"])


def test_conversational_prompt_completion_masks_the_completion_turn(tokenizer):
    row = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Peru?"}],
           "completion": [{"role": "assistant", "content": "Lima."}]}
    out = tokenize_sft(_dataset([row]), tokenizer, "conv", 512, "keep_start")
    ids, mask = out.input_ids[0], out.loss_mask[0]
    assert [tokenizer.decode(run) for run in _runs(ids, mask)] == ["Lima.<|im_end|>\n"]
    assert tokenizer.decode(ids) == render_chat(tokenizer, row["prompt"] + row["completion"])


def test_text_trains_on_everything_and_ends_with_eos(tokenizer):
    out = tokenize_sft(_dataset([{"text": "The quick brown fox."}]), tokenizer, "t", 512, "keep_start",
                       completion_only_loss=True, assistant_only_loss=True)
    ids, mask = out.input_ids[0], out.loss_mask[0]
    assert mask == [1] * len(ids)
    assert tokenizer.decode(ids) == "The quick brown fox." + tokenizer.eos_token


def _length_rows(tokenizer) -> tuple[list[dict], list[list[int]], int]:
    """Text rows of 4..40 words, their full token ids, and a max_length that cuts the longer ones."""
    rows = [{"text": " ".join(["word"] * n)} for n in (4, 40, 6, 30, 8)]
    full = tokenize_sft(_dataset(rows), tokenizer, "t", 10_000, "keep_start").input_ids
    max_length = 20
    assert sum(len(ids) > max_length for ids in full) == 2  # the test relies on exactly two long rows
    return rows, full, max_length


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_long_rows_are_truncated_and_counted(tokenizer, caplog, mode):
    rows, full, max_length = _length_rows(tokenizer)
    with caplog.at_level(logging.WARNING, logger="trainer.data.sources"):
        out = tokenize_sft(_dataset(rows), tokenizer, "lengths", max_length, mode)
    assert out.num_truncated == 2 and out.num_dropped_long == 0 and len(out) == 5
    for ids, mask, whole in zip(out.input_ids, out.loss_mask, full):
        expected = whole if len(whole) <= max_length else (
            whole[:max_length] if mode == "keep_start" else whole[-max_length:])
        assert ids == expected and len(mask) == len(ids)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"lengths: 2 of 5 rows are longer than max_length=20 and were truncated ({mode})."]


def test_long_rows_are_dropped_and_counted(tokenizer, caplog):
    rows, full, max_length = _length_rows(tokenizer)
    with caplog.at_level(logging.WARNING, logger="trainer.data.sources"):
        out = tokenize_sft(_dataset(rows), tokenizer, "lengths", max_length, "drop")
    assert out.num_dropped_long == 2 and out.num_truncated == 0
    assert list(out.input_ids) == [ids for ids in full if len(ids) <= max_length]
    assert "dropped 2 of 5 rows longer than max_length=20" in caplog.text


def test_all_rows_too_long_with_drop_is_an_error(tokenizer):
    rows = [{"text": " ".join(["word"] * 50)}] * 3
    with pytest.raises(DataError) as err:
        tokenize_sft(_dataset(rows), tokenizer, "long.jsonl", 8, "drop")
    message = str(err.value)
    assert "'long.jsonl'" in message and "no rows left" in message and "max_length=8" in message


def test_rows_whose_completion_is_cut_off_are_dropped(tokenizer, caplog):
    rows = [{"prompt": " ".join(["word"] * 30), "completion": " yes"}, ROWS[0]]
    with caplog.at_level(logging.WARNING, logger="trainer.data.sources"):
        out = tokenize_sft(_dataset(rows), tokenizer, "cut", 12, "keep_start")
    assert out.num_truncated == 1 and out.num_dropped_no_loss == 1 and len(out) == 1
    assert "dropped 1 rows with no trainable tokens" in caplog.text


@pytest.mark.parametrize(("messages", "expected"), [
    # Arrow gives every message the union of keys; a missing `content` comes back as None.
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}], "Row 1: `messages[1]` must be a dict"),
    ([{"role": "user"}], "Row 1: `messages[0]` must be a dict"),
    ([], "Row 1: `messages` must be a non-empty list"),
])
def test_malformed_messages_row_names_the_row(tokenizer, messages, expected):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    with pytest.raises(DataError) as err:
        tokenize_sft(_dataset([good, {"messages": messages}]), tokenizer, "chat", 512, "keep_start")
    assert expected in str(err.value)


def test_messages_that_are_not_a_list_name_the_row(tokenizer):
    with pytest.raises(DataError, match=r"Row 0: `messages` must be a non-empty list .* got str"):
        tokenize_sft(_dataset([{"messages": "user: hi"}]), tokenizer, "chat", 512, "keep_start")


def test_non_string_text_names_the_row(tokenizer):
    with pytest.raises(DataError, match="Row 0: `text` must be a string, got int"):
        tokenize_sft(_dataset([{"text": 3}]), tokenizer, "t", 512, "keep_start")


def test_chat_data_needs_a_chat_template(tokenizer):
    plain = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        tokenize_sft(load_rows("demo:chat").select(range(1)), plain, "chat", 512, "keep_start")


# ----------------------------------------------------------------------------------------------
# pack_best_fit


def _check_packing(lengths: list[int], capacity: int, bins: list[list[int]]) -> None:
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every index exactly once
    assert all(b for b in bins)
    assert max(sum(lengths[i] for i in b) for b in bins) <= capacity


def test_pack_best_fit_small_case():
    lengths = [5, 3, 4, 2, 5, 1]  # 20 tokens: two full rows of 10 exist, e.g. {5,5} and {4,3,2,1}
    bins = pack_best_fit(lengths, 10)
    _check_packing(lengths, 10, bins)
    assert len(bins) == 2
    # Best fit puts 4 next to 6 (exact fit); worst fit would put it next to 5 and need a third row for 2.
    assert sorted(sorted(b) for b in pack_best_fit([6, 5, 4, 3, 2], 10)) == [[0, 2], [1, 3, 4]]
    assert pack_best_fit([], 10) == []
    assert pack_best_fit([10, 10], 10) == [[0], [1]]


@pytest.mark.parametrize(("high", "slack"), [(1024, 1.03), (256, 1.0)])
def test_pack_best_fit_random_is_near_optimal(high, slack):
    rng = random.Random(0)
    capacity = 1024
    lengths = [rng.randint(1, high) for _ in range(2000)]
    bins = pack_best_fit(lengths, capacity)
    _check_packing(lengths, capacity, bins)
    lower_bound = math.ceil(sum(lengths) / capacity)  # no packing can use fewer rows
    assert len(bins) <= math.ceil(slack * lower_bound) + 1


def test_data_fingerprint_is_the_rows_content(tmp_path):
    """Same rows loaded from another path (or re-downloaded) -> same fingerprint; one changed value -> another."""
    from trainer.data.sources import dataset_fingerprint, load_rows

    rows = [{"prompt": f"Say {w}.", "completion": f" {w}"} for w in ["red", "green", "blue"]]
    a = dataset_fingerprint(load_rows(write_jsonl(tmp_path / "a.jsonl", rows), "train"))
    b = dataset_fingerprint(load_rows(write_jsonl(tmp_path / "b.jsonl", rows), "train"))
    rows[1]["completion"] = " GREEN"
    c = dataset_fingerprint(load_rows(write_jsonl(tmp_path / "c.jsonl", rows), "train"))
    assert a == b != c and a.startswith("sha256-")


def test_data_fingerprint_does_not_depend_on_how_the_table_is_laid_out(monkeypatch):
    """The same rows chunked differently, index-mapped (shuffled then put back, selected) or sliced give one
    fingerprint; a window size smaller than the data makes every window boundary count."""
    import datasets

    from trainer.data import sources

    monkeypatch.setattr(sources, "_FINGERPRINT_WINDOW", 7)
    rows = [{"prompt": f"Say {i}.", "n": i, "score": i / 3, "ok": i % 3 == 0, "note": None if i % 4 else "x",
             "messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo"}]}
            for i in range(40)]
    whole = datasets.Dataset.from_list(rows)
    reference = sources.dataset_fingerprint(whole)
    chunked = datasets.concatenate_datasets([datasets.Dataset.from_list(rows[:13]),
                                             datasets.Dataset.from_list(rows[13:])])
    shuffled = whole.shuffle(seed=1)
    order = shuffled["n"]
    put_back = shuffled.select(sorted(range(len(order)), key=order.__getitem__))
    assert sources.dataset_fingerprint(chunked) == reference
    assert sources.dataset_fingerprint(put_back) == reference
    assert sources.dataset_fingerprint(whole.select(range(5, 30))) == sources.dataset_fingerprint(
        datasets.Dataset.from_list(rows[5:30]))
    assert sources.dataset_fingerprint(shuffled) != reference  # the order counts
    changed = [dict(r) for r in rows]
    changed[33]["messages"] = [{"role": "user", "content": "hi 33"}, {"role": "assistant", "content": "yo!"}]
    assert sources.dataset_fingerprint(datasets.Dataset.from_list(changed)) != reference


def test_lay_out_rows_pads_one_per_row_or_packs_with_restarting_positions():
    from trainer.data.formatting import lay_out_rows

    seqs = [[5, 6, 7], [8], [9, 10]]
    padded = lay_out_rows(seqs, pad_id=0)
    assert padded.input_ids.tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert padded.sequence.tolist() == [[0, 0, 0], [1, -1, -1], [2, 2, -1]]
    packed = lay_out_rows(seqs, pad_id=0, pack_to=4)  # rows of at most 4 tokens
    assert packed.input_ids.shape[0] == 2 and packed.input_ids.shape[1] <= 4
    for s, ids in enumerate(seqs):  # each sequence whole, where `row` and `start` say, positions from 0
        r, c = int(packed.row[s]), int(packed.start[s])
        assert packed.input_ids[r, c:c + len(ids)].tolist() == ids
        assert packed.position_ids[r, c:c + len(ids)].tolist() == list(range(len(ids)))
        assert (packed.sequence[r, c:c + len(ids)] == s).all()
    assert int((packed.sequence >= 0).sum()) == 6
    spread = packed.spread([[1, 2, 3], [4], [5, 6]])
    assert all(spread[packed.row[s], packed.start[s]].item() == v for s, v in enumerate((1, 4, 5)))
    assert int(spread[packed.sequence < 0].abs().sum()) == 0
