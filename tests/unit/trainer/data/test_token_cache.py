"""Tokenized SFT data in Arrow: the same examples and batches as the serial in-memory path, and a cache that is
reused, keyed by everything that changes the tokens, and rebuilt when partial or corrupt."""

from __future__ import annotations

import json
import logging

import datasets
import pytest
import torch

from tests.helpers import SerialSFT
from trainer.data import token_cache
from trainer.data.formatting import pack_best_fit, tokenize_sft
from trainer.data.sources import load_rows
from trainer.errors import DataError
from trainer.stages.sft import collate


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNFLOW_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenized"


def _units(data, packed: bool, max_length: int) -> list[list[int]]:
    return pack_best_fit(data.lengths.tolist(), max_length) if packed else [[i] for i in range(len(data))]


# demo:sft is prompt/completion text (10-17 tokens a row), demo:chat is `messages` (57-71 tokens): the short
# max_lengths truncate about half the rows (keep_start: some lose their whole completion and are dropped) or drop them.
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize(("spec", "max_length", "mode"), [("demo", 128, "keep_start"), ("demo", 13, "keep_start"),
                                                          ("demo:chat", 64, "keep_end"), ("demo:chat", 64, "drop")])
def test_arrow_batches_equal_the_serial_path(tokenizer, cache, spec, max_length, mode, packed):
    rows = load_rows(spec)
    serial = SerialSFT(rows, tokenizer, spec, max_length, mode)
    arrow = tokenize_sft(rows, tokenizer, spec, max_length, mode)
    assert len(arrow) == len(serial) > 0
    if max_length < 100:
        assert arrow.num_truncated + arrow.num_dropped_long > 0
    assert arrow.lengths.tolist() == serial.lengths.tolist()
    assert list(arrow.input_ids) == serial.input_ids and list(arrow.loss_mask) == serial.loss_mask
    units = _units(arrow, packed, max_length)
    assert units == _units(serial, packed, max_length)
    pad = tokenizer.pad_token_id
    for start in range(0, len(units), 16):  # every batch of an epoch, in order
        members = units[start:start + 16]
        new, old = collate(arrow, members, pad, packed), collate(serial, members, pad, packed)
        for field in ("input_ids", "target_mask", "attention_mask", "position_ids"):
            a, b = getattr(new, field), getattr(old, field)
            assert (a is None and b is None) or torch.equal(a, b), field


def test_second_call_reads_the_cache(tokenizer, cache, caplog):
    rows = load_rows("demo").select(range(50))
    first = tokenize_sft(rows, tokenizer, "d", 128, "keep_start")
    entries = list(cache.iterdir())
    assert len(entries) == 1 and (entries[0] / token_cache.META_FILE).exists()
    with caplog.at_level(logging.INFO, logger="trainer.data.token_cache"):
        again = tokenize_sft(rows.map(lambda r: r), tokenizer, "d", 128, "keep_start")  # same rows, new object
    assert f"tokenized data from cache {entries[0]}" in caplog.text
    assert list(again.input_ids) == list(first.input_ids)
    assert len(list(cache.iterdir())) == 1  # no temporary folder left behind


@pytest.mark.parametrize("change", ["max_length", "truncation_mode", "completion_only_loss", "rows", "template"])
def test_anything_that_changes_the_tokens_gets_its_own_entry(tokenizer, cache, change):
    rows = load_rows("demo").select(range(20))
    args = dict(max_length=128, truncation_mode="keep_start", completion_only_loss=True)
    tokenize_sft(rows, tokenizer, "d", **args)
    tok = tokenizer
    if change == "rows":
        rows = rows.select(range(19))
    elif change == "template":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
        tok.chat_template = tok.chat_template + " "
    else:
        args[change] = {"max_length": 16, "truncation_mode": "keep_end", "completion_only_loss": False}[change]
    tokenize_sft(rows, tok, "d", **args)
    assert len(list(cache.iterdir())) == 2


@pytest.mark.parametrize("damage", ["flipped byte", "truncated file", "no meta", "bad meta"])
def test_a_corrupt_or_partial_entry_is_rebuilt(tokenizer, cache, caplog, damage):
    rows = load_rows("demo").select(range(30))
    first = tokenize_sft(rows, tokenizer, "d", 128, "keep_start")
    expected = list(first.input_ids), list(first.loss_mask)  # read before the damage: `first` maps the file
    (entry,) = cache.iterdir()
    data, meta = entry / token_cache.DATA_FILE, entry / token_cache.META_FILE
    if damage == "flipped byte":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "truncated file":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif damage == "no meta":
        meta.unlink()
    else:
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "rows": 31}))
    with caplog.at_level(logging.INFO, logger="trainer.data.token_cache"):
        again = tokenize_sft(rows, tokenizer, "d", 128, "keep_start")
    assert "incomplete or corrupt" in caplog.text and "from cache" not in caplog.text
    assert (list(again.input_ids), list(again.loss_mask)) == expected
    assert token_cache.load_entry(entry) is not None  # the rebuilt entry verifies


def test_a_failed_tokenization_leaves_no_entry(tokenizer, cache):
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rows = datasets.Dataset.from_list([{"messages": good}, {"messages": [{"role": None, "content": "x"}]}])
    with pytest.raises(DataError, match="Row 1"):
        tokenize_sft(rows, tokenizer, "chat", 128, "keep_start")
    assert not any(cache.iterdir())


def test_tokens_are_memory_mapped_not_in_memory(tokenizer, cache):
    data = tokenize_sft(load_rows("demo"), tokenizer, "d", 128, "keep_start")
    assert data.table.cache_files and data.table.cache_files[0]["filename"].startswith(str(cache))


RACE = """
import hashlib, json, logging, os, sys, time
logging.basicConfig(level=logging.INFO)
from transformers import AutoTokenizer
from trainer.data.formatting import tokenize_sft
from trainer.data.sources import load_rows
tokenizer, rows = AutoTokenizer.from_pretrained(sys.argv[1]), load_rows("demo:chat")
# Both processes map at the same moment: each says it is ready (imports take seconds, and longer under load),
# then waits for the other.
ready = sys.argv[2]
open(os.path.join(ready, str(os.getpid())), "w").close()
deadline = time.time() + 120
while len(os.listdir(ready)) < 2 and time.time() < deadline:
    time.sleep(0.005)
data = tokenize_sft(rows, tokenizer, "chat", 64, "keep_end")
print(hashlib.sha256(json.dumps(list(data.input_ids)).encode()).hexdigest())
"""


def test_processes_that_build_one_entry_at_once_agree(tiny_model, cache, tmp_path):
    """Nodes sharing ALIGNFLOW_CACHE may build the same entry at once: the first rename wins, the other process
    keeps its own copy's tokens (identical), and one complete entry remains."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", RACE, tiny_model, str(ready)], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    digests = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(digests) == 1
    assert sum("Tokenized 300 rows" in err for _, err in outs) == 2  # both built it: the race did happen
    (entry,) = cache.iterdir()  # no temporary folder left behind
    assert token_cache.load_entry(entry) is not None


def test_tokenizer_fingerprint_ignores_the_last_calls_truncation_and_padding(tokenizer):
    """transformers leaves the fast tokenizer's truncation and padding set after a call that used them (the reward
    model's pairs truncate); a process that truncated must still find the entry that one which did not wrote."""
    before = token_cache.tokenizer_fingerprint(tokenizer)
    tokenizer(["a b c d e f g h", "a"], truncation=True, max_length=3, padding=True)
    assert tokenizer.backend_tokenizer.truncation is not None and tokenizer.backend_tokenizer.padding is not None
    assert token_cache.tokenizer_fingerprint(tokenizer) == before
    tokenizer(["a b c"])  # (and a later plain call clears them)
    assert tokenizer.backend_tokenizer.truncation is None


def test_worker_processes_write_the_same_one_file_entry(tokenizer, tmp_path, monkeypatch):
    """`dataset_num_proc` 2 (the map in two worker processes, the tokenizer and the stage's closure sent to them)
    gives an entry of one file with the same rows, tokens and per-row outcomes as one process: SFT, DPO pairs and
    RL prompts."""
    from types import SimpleNamespace

    from trainer.data.preferences import tokenize_dpo_pairs
    from trainer.stages.rl.shared import load_prompts

    def build(num_proc: int):
        root = tmp_path / f"cache-{num_proc}"
        monkeypatch.setenv("ALIGNFLOW_CACHE", str(root))
        sft = tokenize_sft(load_rows("demo:chat"), tokenizer, "demo:chat", 64, "drop", num_proc=num_proc)
        pairs = tokenize_dpo_pairs(load_rows("demo:preferences"), tokenizer, "prefs", 48, 24, "keep_start", num_proc)
        config = SimpleNamespace(max_prompt_length=8, truncation_mode="keep_end", dataset_num_proc=num_proc)
        prompts = load_prompts("demo:math", "train", tokenizer, config)
        entries = sorted(p.name for p in (root / "tokenized").iterdir())
        files = {e: sorted(p.name for p in (root / "tokenized" / e).iterdir()) for e in entries}
        return sft, pairs, prompts, files

    sft1, pairs1, prompts1, files1 = build(1)
    sft2, pairs2, prompts2, files2 = build(2)
    assert files2 == files1 and all(f == [token_cache.DATA_FILE, token_cache.META_FILE] for f in files2.values())
    assert sft2.table.to_dict() == sft1.table.to_dict() and sft1.num_dropped_long > 0
    assert [pairs2.pair(i) for i in range(len(pairs2))] == [pairs1.pair(i) for i in range(len(pairs1))]
    assert list(prompts2.token_ids) == list(prompts1.token_ids)


def test_the_number_of_tokenizing_processes():
    assert token_cache.map_processes(token_cache.PARALLEL_FROM_ROWS - 1) == 1
    assert token_cache.map_processes(token_cache.PARALLEL_FROM_ROWS) == len(__import__("os").sched_getaffinity(0))
    assert token_cache.map_processes(10, asked=3) == 3
