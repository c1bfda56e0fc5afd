"""Tokenized datasets as memory-mapped Arrow files, built once per (data, tokenizer, options).

A stage tokenizes with `datasets.Dataset.map(batched=True)` into an Arrow file (`cache_file_name`), so the
tokens live on disk and are memory-mapped, not held as Python lists: a process's memory no longer grows with
the row count. The file is kept under `<ALIGNFLOW_CACHE or ~/.cache/alignflow>/tokenized/<kind>-<key>/`,
where the key hashes everything that changes the tokens:

- the rows' content (`trainer.data.sources.dataset_fingerprint`, not datasets' own fingerprint, which changes with
  the file's path and time);
- the tokenizer's content (its serialized fast tokenizer or vocabulary, special tokens and chat template), not
  its path, so two copies of one tokenizer share an entry;
- every option of the tokenization (max_length, truncation mode, loss masks, ...), and `VERSION`, raised
  whenever the tokenizing code changes its output.

A second run (or a retried pipeline task) with the same key maps the same file and logs
"tokenized data from cache <path>". An entry is written into a temporary folder and renamed into place only
when complete, with a `meta.json` giving its row count and the file's sha256, both checked on every load: a
partial or corrupt entry is rebuilt, never trusted. Under several processes the caller lets one process per
node build the entry first (`accelerator.local_main_process_first()`); the others then load the same file.
From 50,000 rows that process splits the map over every CPU it may use (`dataset_num_proc` sets the count); the
workers' shards are joined into the entry's one file, so the entry is the same whatever the count.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets

from trainer.io.storage import cache_dir

log = logging.getLogger(__name__)

VERSION = 2  # raise when a change to the tokenizing code changes the tokens it writes
DATA_FILE, META_FILE = "data.arrow", "meta.json"
SHARD_FILE = "shards.arrow"  # with several workers, datasets writes shards_<rank>_of_<n>.arrow, joined into DATA_FILE
PARALLEL_FROM_ROWS = 50_000  # rows from which a tokenizing map runs in several processes by default


def tokenized_cache_root() -> Path:
    return cache_dir() / "tokenized"


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides a tokenizer's output: its model, normalizer and special tokens (the serialized
    fast tokenizer, or the vocabulary of a slow one) and its chat template."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        if backend.truncation is not None or backend.padding is not None:
            # Left set by the last call that truncated or padded (transformers sets both per call): not part of the
            # tokenizer, and would give one tokenizer another key after it truncated a text (reward pairs do).
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(backend.to_str())
            backend.no_truncation()
            backend.no_padding()
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    special = {k: str(v) for k, v in tokenizer.special_tokens_map.items()}
    digest.update(json.dumps([special, tokenizer.chat_template or "", tokenizer.eos_token_id,
                              tokenizer.bos_token_id, getattr(tokenizer, "add_bos_token", None),
                              getattr(tokenizer, "add_eos_token", None)], sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def cache_key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps({"version": VERSION, **parts}, sort_keys=True).encode()).hexdigest()[:20]


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def load_entry(folder: Path) -> datasets.Dataset | None:
    """The entry's dataset, memory-mapped; None (after removing it) when it is missing, partial or corrupt."""
    if not folder.exists():
        return None
    try:
        meta = json.loads((folder / META_FILE).read_text())
        if _file_sha256(folder / DATA_FILE) != meta["sha256"]:
            raise ValueError("the Arrow file's sha256 differs from the one recorded when it was written")
        ds = datasets.Dataset.from_file(str(folder / DATA_FILE))
        if len(ds) != meta["rows"] or ds.column_names != meta["columns"]:
            raise ValueError(f"{len(ds)} rows and columns {ds.column_names}, expected {meta['rows']} and "
                             f"{meta['columns']}")
    except Exception as err:  # unreadable JSON or Arrow, missing files or keys: all mean "rebuild"
        log.warning("Tokenized data cache %s is incomplete or corrupt (%s: %s); rebuilding it.", folder,
                    type(err).__name__, err)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return ds


def map_processes(num_rows: int, asked: int | None = None) -> int:
    """Processes for one tokenizing map: `asked` (`dataset_num_proc`), else one below `PARALLEL_FROM_ROWS` rows
    (starting workers costs more than it saves) and every CPU this process may use above (one process per node
    tokenizes while the node's other ranks wait)."""
    if asked is not None:
        return max(1, asked)
    return 1 if num_rows < PARALLEL_FROM_ROWS else max(1, len(os.sched_getaffinity(0)))


def _join_shards(folder: Path) -> datasets.Dataset:
    """The workers' shard files in `folder` (in order) copied batch by batch into `folder/DATA_FILE`, in the Arrow
    stream format datasets writes, and removed; the joined file, memory-mapped. The shards are read, not mapped, so
    the copy does not leave their pages resident in this process."""
    import pyarrow as pa

    shards = sorted(folder.glob("shards_*_of_*.arrow"))
    writer = None
    with pa.OSFile(str(folder / DATA_FILE), "wb") as sink:
        for shard in shards:
            with pa.OSFile(str(shard), "rb") as source:
                reader = pa.ipc.open_stream(source)
                writer = writer or pa.ipc.new_stream(sink, reader.schema)
                for batch in reader:
                    writer.write_batch(batch)
        if writer is not None:
            writer.close()
    for shard in shards:
        shard.unlink()
    return datasets.Dataset.from_file(str(folder / DATA_FILE))


def cached_map(rows: datasets.Dataset, kind: str, key_parts: dict[str, Any], function: Callable,
               features: datasets.Features, desc: str, num_proc: int | None = None) -> datasets.Dataset:
    """`rows.map(function, batched=True, with_indices=True)` into the cache entry for `key_parts`, or the entry
    a previous run wrote. `function` must return one output row per input row (columns of `features`).
    `num_proc` (None: `map_processes`) splits the map over worker processes; the entry is one file either way,
    with the same rows in the same order, so it is not part of the key."""
    key = cache_key({"kind": kind, **key_parts})
    root = tokenized_cache_root()
    final = root / f"{kind}-{key}"
    if (ds := load_entry(final)) is not None:
        log.info("tokenized data from cache %s", final)
        return ds
    tmp = root / f".{kind}-{key}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        workers = min(map_processes(len(rows), num_proc), max(1, len(rows)))
        built = rows.map(function, batched=True, batch_size=1000, with_indices=True, remove_columns=rows.column_names,
                         features=features, cache_file_name=str(tmp / (SHARD_FILE if workers > 1 else DATA_FILE)),
                         load_from_cache_file=False, new_fingerprint=key, desc=desc, num_proc=workers if workers > 1 else None)
        if workers > 1:  # one shard file per worker: written out as the one file an entry holds, then removed
            del built
            built = _join_shards(tmp)
        meta = {"rows": len(built), "columns": built.column_names, "sha256": _file_sha256(tmp / DATA_FILE),
                "key": {"kind": kind, "version": VERSION, **key_parts}}
        del built  # release the memory map before the folder moves
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1, default=str))
        try:
            os.rename(tmp, final)
        except OSError:  # another process (another node on a shared cache) finished the same entry first
            if load_entry(final) is None:
                os.rename(tmp, final)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
    log.info("Tokenized %d rows into %s.", len(rows), final)
    ds = load_entry(final)
    if ds is None:
        raise RuntimeError(f"The tokenized data just written to {final} cannot be read back.")
    return ds
