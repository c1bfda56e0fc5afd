"""Loading, validating and tokenizing datasets.

Sources: jsonl/json/parquet/csv files (optionally .gz), `datasets.save_to_disk` folders,
folders of data files, ``s3://`` URIs (fetched with fsspec), hub ids when reachable, and the
built-in demo data (``demo`` or ``demo:<name>``).

Formats follow TRL: ``text``; ``prompt`` + ``completion`` (strings, or lists of chat messages);
``messages`` (a list of ``{"role", "content"}`` rendered with the tokenizer's chat template).
Every check runs before any model is loaded, and each error names the dataset, the offending
column or row, and the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import datasets

from trainer.storage import fetch_to_local, is_remote

log = logging.getLogger(__name__)

DATA_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
SFT_FORMATS = "`text`; `prompt` + `completion`; or `messages` (a list of {role, content} dicts)"


class DataError(ValueError):
    """The data cannot be used; the message names the dataset, column or row and the fix."""


# ----------------------------------------------------------------------------------------------
# Loading


def demo_path(name: str = "sft") -> Path:
    path = Path(str(resources.files("trainer") / "demo_data" / f"{name}.jsonl"))
    if not path.exists():
        available = sorted(p.stem for p in path.parent.glob("*.jsonl"))
        raise DataError(f"No built-in demo dataset `demo:{name}`; available: {', '.join(available)}.")
    return path


def _builder_for(path: Path) -> str | None:
    suffixes = [s for s in path.suffixes if s not in (".gz", ".bz2", ".xz", ".zst")]
    return DATA_EXTENSIONS.get(suffixes[-1]) if suffixes else None


def load_rows(spec: str, split: str = "train", name: str | None = None) -> datasets.Dataset:
    """Load a dataset from any supported source as one `datasets.Dataset`; `name` is the configuration
    (subset) of a hub dataset or of a folder with a dataset card (`dataset_config`)."""
    if spec == "demo" or spec.startswith("demo:"):
        spec = str(demo_path(spec.partition(":")[2] or "sft"))
    if is_remote(spec):
        spec = fetch_to_local(spec)
    path = Path(spec)
    if name and path.is_file():
        raise DataError(f"`dataset_config` {name!r} names a configuration of a hub dataset or of a folder with a "
                        f"dataset card; {spec!r} is a single file: unset dataset_config.")
    if name and path.is_dir():
        ds = _load_with_builder(str(path), name, split)
    elif path.is_file():
        builder = _builder_for(path)
        if builder is None:
            raise DataError(f"Cannot read {spec!r}: unsupported file type. Use .jsonl, .json, .parquet or .csv "
                            "(optionally .gz), or a `datasets.save_to_disk` folder.")
        if builder in ("json", "csv"):
            check_utf8(path, spec)  # Arrow loads bad bytes silently and fails at the first row read
        try:
            with _builders_quiet():
                ds = datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as err:  # the builders raise many different types for malformed files
            if _has_no_rows(path, builder):  # they also fail (cryptically) on files with no rows
                raise DataError(f"Dataset {spec!r} is empty: the file holds no rows.") from err
            where = _first_bad_json(path) if builder == "json" else None
            detail = where or " ".join(str(err).split())[:300]
            raise DataError(f"Could not parse {spec!r} as {builder}: {detail}") from err
    elif path.is_dir():
        ds = _load_dir(path, split)
    elif spec.startswith((".", "/", "~")) or spec.count("/") > 1 or _builder_for(path):
        raise DataError(f"Dataset path {spec!r} does not exist.")
    else:
        try:
            ds = datasets.load_dataset(spec, name, split=split)
        except Exception as err:
            raise DataError(f"Dataset {spec!r} is neither a local file/folder nor a loadable hub dataset "
                            f"({type(err).__name__}: {err}). Check the path, or pass a jsonl/parquet file.") from err
    if len(ds) == 0:
        raise DataError(f"Dataset {spec!r} is empty: it has columns {ds.column_names} but no rows.")
    return ds


@contextlib.contextmanager
def _builders_quiet():
    """Silence the builders' own error log while they parse: a failure is reported once, by `load_rows`,
    with the line it happened on (the json builder logs the parser's message, then raises)."""
    builders = logging.getLogger("datasets.packaged_modules")
    level = builders.level
    builders.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        builders.setLevel(level)


def check_utf8(path: Path, spec: str) -> None:
    """Raise a DataError naming the line of the first bytes of a text data file that are not UTF-8."""
    import codecs

    import fsspec

    decoder, lines = codecs.getincrementaldecoder("utf-8")(), 0
    with fsspec.open(str(path), "rb", compression="infer") as fh:
        while True:
            chunk = fh.read(1 << 24)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                line = lines + chunk.count(b"\n", 0, err.start) + 1
                raise DataError(f"Dataset {spec!r}: line {line} is not UTF-8 text ({err.reason}: "
                                f"{err.object[err.start:err.end]!r}). Re-encode the file as UTF-8, e.g. "
                                "`iconv -f latin1 -t utf-8 IN > OUT`.") from None
            if not chunk:
                return
            lines += chunk.count(b"\n")


def _first_bad_json(path: Path) -> str | None:
    """Where a JSON / JSON-lines file goes wrong: the line, the parser's reason and the line's start."""
    import fsspec

    with fsspec.open(str(path), "rt", compression="infer", encoding="utf-8") as fh:
        text = fh.read()
    if text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            return f"line {err.lineno}, column {err.colno}: {err.msg}. Fix that line, or write one JSON object per line."
        return None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            return (f"line {number} is not valid JSON ({err.msg} at column {err.colno}: {line[:60]!r}). "
                    "Each line must be one JSON object, e.g. {\"text\": \"...\"}.")
        if not isinstance(row, dict):
            return f"line {number} is a JSON {type(row).__name__}, not an object; each line must be one JSON object."
    return None


def _has_no_rows(path: Path, builder: str) -> bool:
    """Whether a file that failed to load simply has no rows (empty, `[]`, or a CSV header only)."""
    try:
        if builder == "parquet":
            import pyarrow.parquet as pq

            return pq.read_metadata(path).num_rows == 0
        import fsspec

        with fsspec.open(str(path), "rt", compression="infer") as fh:
            head = fh.read(4096).strip()
    except Exception:
        return False
    return "\n" not in head if builder == "csv" else head in ("", "[]")


def _load_dir(path: Path, split: str) -> datasets.Dataset:
    if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as err:
            # `save_to_disk` writes a split with no rows as no data files, and cannot read that back.
            if any(not json.loads(p.read_text()).get("_data_files") for p in path.glob("**/state.json")):
                raise DataError(f"Saved dataset {str(path)!r} is empty: a split has no rows.") from err
            raise DataError(f"Could not load the saved dataset {str(path)!r}: {type(err).__name__}: {err}") from err
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"Saved dataset {str(path)!r} has splits {list(loaded)}, not {split!r}; "
                                "set `dataset_split`.")
            return loaded[split]
        return loaded
    files = sorted(p for p in path.rglob("*") if p.is_file() and _builder_for(p))
    builders = {_builder_for(p) for p in files}
    if not files:
        raise DataError(f"Folder {str(path)!r} holds no .jsonl/.json/.parquet/.csv files and is not a "
                        "`datasets.save_to_disk` folder.")
    if len(builders) > 1:
        raise DataError(f"Folder {str(path)!r} mixes file types {sorted(builders)}; keep one type per dataset.")
    builder = builders.pop()
    for file in files if builder in ("json", "csv") else []:
        check_utf8(file, str(file))
    try:
        with _builders_quiet():
            return datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train")
    except Exception as err:
        if all(_has_no_rows(p, builder) for p in files):
            raise DataError(f"Dataset {str(path)!r} is empty: its files hold no rows.") from err
        raise DataError(f"Could not parse the files in {str(path)!r} as {builder}: {err}") from err


def split_eval(ds: datasets.Dataset, ratio: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    held_out = math.ceil(ratio * len(ds))  # as `train_test_split` counts it
    if len(ds) - held_out < 1:
        raise DataError(f"`eval_split_ratio` {ratio:g} of {len(ds)} rows holds out {held_out} and leaves none to train "
                        "on: lower it, or give the held-out data as `eval_dataset`.")
    parts = ds.train_test_split(test_size=ratio, seed=seed)
    return parts["train"], parts["test"]


# ----------------------------------------------------------------------------------------------
# Formats


def is_conversational(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def detect_sft_format(ds: datasets.Dataset, name: str) -> str:
    cols = set(ds.column_names)
    if "messages" in cols:
        return "messages"
    if {"prompt", "completion"} <= cols:
        return "prompt_completion"
    if "text" in cols:
        return "text"
    hint = ""
    if {"chosen", "rejected"} <= cols:
        hint = " This looks like preference data: use `alignflow train dpo` or `alignflow train reward`."
    elif "prompt" in cols:
        hint = " It has `prompt` but no `completion`: prompt-only data is for `alignflow train grpo`."
    raise DataError(f"Dataset {name!r} has columns {sorted(cols)}; SFT accepts {SFT_FORMATS}.{hint}")


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("The tokenizer has no chat template, so chat `messages` cannot be rendered. Use a model "
                        "with a chat template (e.g. from `alignflow model init-tiny`) or text data.")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles of TRL's chat format


def template_knows(tokenizer, role: str) -> bool:
    """Whether `tokenizer`'s chat template renders `role` as a role: one of TRL's chat roles, or a role the
    template names as a string (Llama 3's `ipython`). A template that prints any role it is given would
    render a misspelt one as a turn of its own, which the model never saw in training."""
    template = getattr(tokenizer, "chat_template", None)
    return role in CHAT_ROLES or (template is not None
                                  and re.search(rf"""['"]{re.escape(role)}['"]""", str(template)) is not None)


def check_messages(messages: Any, row: int, column: str, tokenizer=None) -> None:
    """A list of {role, content} turns; with `tokenizer`, every role is one its chat template knows."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"Row {row}: `{column}` must be a non-empty list of {{role, content}} dicts, "
                        f"got {type(messages).__name__}.")
    for turn, msg in enumerate(messages):
        # Arrow fills a key missing from one message with None, so check values, not just keys.
        missing_content = isinstance(msg, dict) and msg.get("content") is None and not msg.get("tool_calls")
        if not isinstance(msg, dict) or msg.get("role") is None or missing_content:
            raise DataError(f"Row {row}: `{column}[{turn}]` must be a dict with `role` and `content`, got {msg!r}.")
        if tokenizer is not None and not template_knows(tokenizer, msg["role"]):
            raise DataError(f"Row {row}: `{column}[{turn}]` has role {msg['role']!r}, which the model's chat template "
                            f"does not know; use one of {', '.join(CHAT_ROLES)} (TRL's chat format).")


def _assistant_spans(tokenizer, messages: list[dict], row: int) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation and return the character spans of the assistant turns.

    Each span runs from the end of the generation prompt before an assistant turn to the end
    of that turn's rendering, so it covers the reply and its end-of-turn token(s). This needs
    only the template's prefix property (rendering a conversation extends rendering its start),
    not special `{% generation %}` markers, so it works with most chat templates.
    """
    text = render_chat(tokenizer, messages)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        start = render_chat(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        end = render_chat(tokenizer, messages[: i + 1])
        if not (text.startswith(end) and end.startswith(start)):
            raise DataError(f"Row {row}: the chat template does not render conversations prefix by prefix, so "
                            "assistant turns cannot be located. Set `assistant_only_loss false` to train on "
                            "all tokens.")
        spans.append((len(start), len(end)))
    return text, spans


# The `status` column of tokenized SFT rows. NO_TARGET: nothing to train on whatever the length (a `messages` row
# without an assistant turn under assistant_only_loss, an empty completion); NO_LOSS: truncation cut it all away.
KEPT, DROPPED_LONG, DROPPED_NO_LOSS, DROPPED_NO_TARGET = 0, 1, 2, 3

SFT_FEATURES = datasets.Features({
    "input_ids": datasets.Sequence(datasets.Value("int32")),
    "loss_mask": datasets.Sequence(datasets.Value("int8")),
    "length": datasets.Value("int32"),
    "truncated": datasets.Value("bool"),
    "status": datasets.Value("int8"),
})


class _TokenColumn(Sequence):
    """One column of the kept examples, read row by row from the memory-mapped Arrow table."""

    def __init__(self, data: TokenizedSFT, column: str) -> None:
        self.data, self.column = data, column

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> list[int]:
        return self.data.row(i)[self.column]


class TokenizedSFT:
    """Token ids and the loss mask (1 = train on this token) of every kept example.

    The tokens stay in an Arrow table (memory-mapped from the tokenized-data cache): one row per input row,
    with a `status` saying whether it was kept. `rows` maps kept example i to its table row; `lengths` holds
    the kept examples' token counts (what packing needs), and `row(i)` reads one example."""

    def __init__(self, table: datasets.Dataset) -> None:
        import numpy as np

        self.table = table
        columns = table.data  # a datasets Table over the Arrow file
        status = columns.column("status").to_numpy()
        self.rows = np.flatnonzero(status == KEPT)  # [N kept] table row of each kept example
        self.lengths = columns.column("length").to_numpy()[self.rows]
        self.num_truncated = int(columns.column("truncated").to_numpy(zero_copy_only=False).sum())
        self.num_dropped_long = int((status == DROPPED_LONG).sum())
        self.num_dropped_no_loss = int((status == DROPPED_NO_LOSS).sum())
        self.num_dropped_no_target = int((status == DROPPED_NO_TARGET).sum())
        self.input_ids = _TokenColumn(self, "input_ids")
        self.loss_mask = _TokenColumn(self, "loss_mask")

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, i: int) -> dict[str, list[int]]:
        """Example i's `input_ids` and `loss_mask` as lists of ints."""
        part = self.table.data.fast_slice(int(self.rows[i]), 1)
        return {"input_ids": part.column("input_ids")[0].as_py(), "loss_mask": part.column("loss_mask")[0].as_py()}


def _encode(tokenizer, text: str, add_special_tokens: bool, offsets: bool = False):
    return tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=offsets,
                     return_attention_mask=False)


def tokenize_sft_row(tokenizer, row: dict, fmt: str, index: int, completion_only_loss: bool,
                     assistant_only_loss: bool) -> tuple[list[int], list[int]]:
    eos = tokenizer.eos_token_id
    if fmt == "text":
        text = row["text"]
        if not isinstance(text, str):
            raise DataError(f"Row {index}: `text` must be a string, got {type(text).__name__}.")
        ids = _encode(tokenizer, text, True)["input_ids"]
        ids = ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids
        return ids, [1] * len(ids)
    if fmt == "prompt_completion":
        prompt, completion = row["prompt"], row["completion"]
        if is_conversational(prompt):
            check_messages(prompt, index, "prompt", tokenizer)
            check_messages(completion, index, "completion", tokenizer)
            prompt_text = render_chat(tokenizer, prompt, add_generation_prompt=True)
            full = render_chat(tokenizer, prompt + completion)
            if not full.startswith(prompt_text):
                raise DataError(f"Row {index}: the chat template's rendering of prompt + completion does not start "
                                "with the rendered prompt.")
            prompt_ids = _encode(tokenizer, prompt_text, False)["input_ids"]
            completion_ids = _encode(tokenizer, full[len(prompt_text):], False)["input_ids"]
        else:
            for col, val in (("prompt", prompt), ("completion", completion)):
                if not isinstance(val, str):
                    raise DataError(f"Row {index}: `{col}` must be a string or a list of chat messages, "
                                    f"got {type(val).__name__}.")
            prompt_ids = _encode(tokenizer, prompt, True)["input_ids"]
            completion_ids = _encode(tokenizer, completion, False)["input_ids"]
            if eos is not None and (not completion_ids or completion_ids[-1] != eos):
                completion_ids = completion_ids + [eos]
        mask = [0 if completion_only_loss else 1] * len(prompt_ids) + [1] * len(completion_ids)
        return prompt_ids + completion_ids, mask
    # messages
    messages = row["messages"]
    check_messages(messages, index, "messages", tokenizer)
    if not assistant_only_loss:
        ids = _encode(tokenizer, render_chat(tokenizer, messages), False)["input_ids"]
        return ids, [1] * len(ids)
    text, spans = _assistant_spans(tokenizer, messages, index)
    enc = _encode(tokenizer, text, False, offsets=True)
    mask = [int(any(s <= start < e for s, e in spans)) for start, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask


def truncate(ids: list[int], mask: list[int], max_length: int, mode: str):
    """Apply `truncation_mode` to one example; returns None when it should be dropped."""
    if len(ids) <= max_length:
        return ids, mask
    if mode == "drop":
        return None
    if mode == "keep_end":
        return ids[-max_length:], mask[-max_length:]
    return ids[:max_length], mask[:max_length]


def tokenize_sft(ds: datasets.Dataset, tokenizer, name: str, max_length: int, truncation_mode: str,
                 completion_only_loss: bool = True, assistant_only_loss: bool = True) -> TokenizedSFT:
    """Tokenize SFT data into the tokenized-data cache (`trainer.token_cache`), apply the length policy and
    mark the examples with nothing to learn; a second call with the same rows, tokenizer and options maps the
    Arrow file the first one wrote."""
    from trainer.token_cache import cached_map, tokenizer_fingerprint

    fmt = detect_sft_format(ds, name)

    def tokenize_batch(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {key: [] for key in SFT_FEATURES}
        for k, index in enumerate(indices):
            row = {column: values[k] for column, values in batch.items()}
            ids, mask = tokenize_sft_row(tokenizer, row, fmt, index, completion_only_loss, assistant_only_loss)
            kept = truncate(ids, mask, max_length, truncation_mode)
            if not sum(mask[1:]):  # nothing to learn even before truncation (the first token is never predicted)
                status, kept = DROPPED_NO_TARGET, ([], [])
            elif kept is None:
                status, kept = DROPPED_LONG, ([], [])
            else:  # the first token is never predicted, so it cannot carry the loss
                status = KEPT if sum(kept[1][1:]) else DROPPED_NO_LOSS
            for key, value in (("input_ids", kept[0]), ("loss_mask", kept[1]), ("length", len(kept[0])),
                               ("truncated", len(ids) > max_length and truncation_mode != "drop"),
                               ("status", status)):
                out[key].append(value)
        return out

    options = {"format": fmt, "max_length": max_length, "truncation_mode": truncation_mode,
               "completion_only_loss": completion_only_loss, "assistant_only_loss": assistant_only_loss}
    table = cached_map(ds, "sft", {"data": dataset_fingerprint(ds), "tokenizer": tokenizer_fingerprint(tokenizer),
                                   **options}, tokenize_batch, SFT_FEATURES, f"Tokenizing {name}")
    out = TokenizedSFT(table)
    report_lengths(name, len(ds), max_length, truncation_mode, out.num_truncated, out.num_dropped_long,
                   out.num_dropped_no_loss, len(out), dropped_no_target=out.num_dropped_no_target, fmt=fmt)
    return out


def report_lengths(name: str, total: int, max_length: int, mode: str, truncated: int, dropped_long: int,
                   dropped_no_loss: int, kept: int, dropped_no_target: int = 0, fmt: str = "") -> None:
    if truncated:
        log.warning("%s: %d of %d rows are longer than max_length=%d and were truncated (%s).",
                    name, truncated, total, max_length, mode)
    if dropped_long:
        log.warning("%s: dropped %d of %d rows longer than max_length=%d (truncation_mode=drop).",
                    name, dropped_long, total, max_length)
    if dropped_no_loss:
        log.warning("%s: dropped %d rows with no trainable tokens left (%s).", name, dropped_no_loss,
                    f"prompt at least max_length={max_length} tokens long" if mode == "keep_start" else
                    "an empty completion")
    no_target = ("no assistant turn to train on (`assistant_only_loss` trains on assistant replies only): add the "
                 "assistant replies, or set `assistant_only_loss false` to train on whole conversations"
                 if fmt == "messages" else "an empty completion: check the `completion` column")
    if dropped_no_target and kept == 0 and not (dropped_long or dropped_no_loss):
        raise DataError(f"Dataset {name!r}: every row has {no_target}.")
    if dropped_no_target:
        log.warning("%s: dropped %d of %d rows with %s.", name, dropped_no_target, total, no_target.split(":")[0])
    if kept == 0:
        raise DataError(f"Dataset {name!r}: no rows left after applying max_length={max_length} "
                        f"(truncation_mode={mode}); {_no_rows_fix(mode, dropped_long, dropped_no_loss)}")


def _no_rows_fix(mode: str, dropped_long: int, dropped_no_loss: int) -> str:
    """What to change when every row was dropped, by the reason they were (the fixes differ)."""
    if dropped_long:  # truncation_mode=drop dropped every row for its length
        return "raise `max_length`, or set `truncation_mode keep_end` (or keep_start) to cut long rows, not drop them."
    if dropped_no_loss and mode == "keep_start":  # the prompt filled max_length: no completion token was kept
        return ("every prompt fills max_length, so no completion token is left to train on: raise `max_length`, "
                "set `truncation_mode keep_end` (cuts the prompt's start, keeps the completion), or set "
                "`completion_only_loss false`.")
    return "every row has an empty completion (nothing to train on): check the `completion` / assistant column."


# ----------------------------------------------------------------------------------------------
# Packing


def pack_best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing of example indices into rows of at most `capacity` tokens.

    Longest examples are placed first, each into the fullest row it still fits in. Rows stay
    in a sorted list of (free space, row id) so each placement is a bisect.
    """
    import bisect

    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (free tokens, bin id)
    for i in order:
        n = lengths[i]
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            space, b = free.pop(pos)
        else:
            b, space = len(bins), capacity
            bins.append([])
        bins[b].append(i)
        bisect.insort(free, (space - n, b))
    return bins


FINGERPRINT_PREFIX = "sha256-"


def dataset_fingerprint(ds: datasets.Dataset) -> str:
    """A hash of the rows themselves (column names and values, in order), ``sha256-`` + 16 hex digits.

    The same rows give the same fingerprint wherever and whenever they were loaded from (datasets' own
    `_fingerprint` changes with the cache file's path and time, e.g. on every download from s3://), so
    `resume_from_checkpoint auto` can tell the same run's data from new data. About 1 s per 100k short rows;
    computed once per dataset object (the run identity needs it before the manifest does)."""
    key = (id(ds), getattr(ds, "_fingerprint", None))  # datasets' own: fixed for one object
    if key in _FINGERPRINTS:
        return _FINGERPRINTS[key]
    digest = hashlib.sha256(json.dumps(list(ds.column_names)).encode())
    for batch in ds.iter(batch_size=1000):
        digest.update(json.dumps(batch, sort_keys=True, default=str, ensure_ascii=False).encode())
    fingerprint = FINGERPRINT_PREFIX + digest.hexdigest()[:16]
    if len(_FINGERPRINTS) >= 8:
        _FINGERPRINTS.pop(next(iter(_FINGERPRINTS)))
    _FINGERPRINTS[key] = fingerprint
    return fingerprint


_FINGERPRINTS: dict[tuple[int, str | None], str] = {}


def load_train_eval(config) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """A stage's training rows and its held-out rows (`eval_dataset`, the `dataset_test_split` split of `dataset`, or
    an `eval_split_ratio` hold-out; None without any)."""
    rows = train_rows(config)
    if config.dataset_test_split:
        return rows, test_split_rows(config)
    if config.eval_dataset:
        name = config.dataset_config if config.eval_dataset == config.dataset else None
        return rows, load_rows(config.eval_dataset, config.dataset_split, name)
    if config.eval_split_ratio:
        return split_eval(rows, config.eval_split_ratio, config.seed)
    return rows, None


def describe_datasets(config, rows: datasets.Dataset, eval_rows: datasets.Dataset | None,
                      train_counts: dict[str, int], eval_counts: dict[str, int] | None = None) -> dict[str, dict]:
    """The manifest's `datasets`: path, fingerprint and sizes of the training (and eval) data."""
    info = {"train": {"path": dataset_label(config), "fingerprint": dataset_fingerprint(rows), "rows": len(rows),
                      **train_counts}}
    if eval_rows is not None:
        where = config.eval_dataset or (f"{config.dataset} [{config.dataset_test_split}]" if config.dataset_test_split
                                        else "split")
        info["eval"] = {"path": where, "fingerprint": dataset_fingerprint(eval_rows),
                        "rows": len(eval_rows), **(eval_counts or {})}
    return info


# ----------------------------------------------------------------------------------------------
# TRL's dataset options: `dataset_config`, `dataset_mixture` (TRL's `datasets:` list), `chat_template_path`


def _load_with_builder(path: str, name: str | None, split: str, data_dir: str | None = None,
                       data_files: Any = None) -> datasets.Dataset:
    """`datasets.load_dataset` with a configuration name or data files (a folder with a dataset card, a builder
    such as `json` with `data_files`, or a hub id)."""
    try:
        return datasets.load_dataset(path, name, data_dir=data_dir, data_files=data_files, split=split)
    except Exception as err:  # datasets raises many types (missing config, split, file)
        raise DataError(f"Could not load dataset {path!r}" + (f" (configuration {name!r})" if name else "")
                        + f" split {split!r}: {type(err).__name__}: {err}") from err


def train_rows(config) -> datasets.Dataset:
    """A stage's training rows: `dataset` (with `dataset_config`) or the `dataset_mixture`."""
    if config.dataset_mixture:
        return load_mixture(config.dataset_mixture)
    return load_rows(config.dataset, config.dataset_split, config.dataset_config)


def test_split_rows(config) -> datasets.Dataset:
    """The `dataset_test_split` split of `dataset` (TRL's eval split). Only sources with splits have one: a
    single file or a folder of data files would give the training rows again under any split name."""
    spec, split = config.dataset, config.dataset_test_split
    local = str(demo_path(spec.partition(":")[2] or "sft")) if spec == "demo" or spec.startswith("demo:") else spec
    if is_remote(local):
        local = fetch_to_local(local)
    path = Path(local)
    saved = path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists())
    if path.is_file() or (path.is_dir() and not saved and not (path / "README.md").exists()):
        raise DataError(f"`dataset_test_split` {split!r}: dataset {spec!r} is {'a single file' if path.is_file() else 'a folder of data files'} "
                        "and has no splits. Give held-out data as `eval_dataset` (or `eval_split_ratio`), or drop "
                        "dataset_test_split (TRL's `eval_strategy: no`).")
    if path.is_dir() and not saved:
        return _load_with_builder(str(path), config.dataset_config, split)
    try:
        return load_rows(spec, split, config.dataset_config)
    except DataError as err:
        raise DataError(f"`dataset_test_split` {split!r}: {err}".replace("set `dataset_split`",
                                                                          "set `dataset_test_split`")) from None


def dataset_label(config) -> str:
    """How the training data are named in logs, errors and the manifest."""
    if config.dataset_mixture:
        return "mixture of " + " + ".join(part.path for part in parse_mixture(config.dataset_mixture))
    return config.dataset + (f" ({config.dataset_config})" if config.dataset_config else "")


@dataclass
class MixturePart:
    """One entry of `dataset_mixture`: the keys of TRL's `DatasetConfig` (arguments of `datasets.load_dataset`)."""

    path: str
    name: str | None = None
    data_dir: str | None = None
    data_files: str | list[str] | dict[str, str] | None = None
    split: str = "train"
    columns: list[str] | None = None
    fraction: float | None = None


MIXTURE_KEYS = tuple(MixturePart.__dataclass_fields__)


def parse_mixture(text: str) -> list[MixturePart]:
    """The entries of a `dataset_mixture` (YAML or JSON text of a list, or of a mapping with `datasets:`)."""
    import yaml

    from trainer.config import ConfigError, DuplicateKeyError, strict_yaml

    try:
        entries = strict_yaml(text)
    except DuplicateKeyError as err:
        raise ConfigError(f"`dataset_mixture`: {err}.") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"`dataset_mixture` is not valid YAML/JSON: {err}") from None
    if isinstance(entries, dict) and "datasets" in entries:
        entries = entries["datasets"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError("`dataset_mixture` must be a non-empty list of {path, name, split, columns, fraction, ...} "
                          f"mappings (TRL's `datasets:`); got {entries!r}.")
    parts = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not entry["path"]:
            raise ConfigError(f"`dataset_mixture[{i}]` needs a `path` (a file, folder, s3:// prefix, hub id or "
                              f"builder such as `json`); got {entry!r}.")
        unknown = sorted(set(entry) - set(MIXTURE_KEYS))
        if unknown:
            raise ConfigError(f"`dataset_mixture[{i}]` has unknown keys {unknown}; the keys are "
                              f"{', '.join(MIXTURE_KEYS)}.")
        part = MixturePart(**entry)
        fraction = part.fraction
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, int | float)
                                     or not 0 < fraction <= 1):
            raise ConfigError(f"`dataset_mixture[{i}].fraction` must be a number in (0, 1] (the part's share of the "
                              f"mixture, e.g. 0.25), got {fraction!r}.")
        if part.columns is not None and (not isinstance(part.columns, list) or not part.columns
                                         or not all(isinstance(c, str) for c in part.columns)):
            raise ConfigError(f"`dataset_mixture[{i}].columns` must be a list of column names, got {part.columns!r}.")
        parts.append(part)
    if len({p.fraction is None for p in parts}) > 1:
        raise ConfigError("`dataset_mixture`: set `fraction` on every entry or on none.")
    return parts


def load_mixture(text: str) -> datasets.Dataset:
    """The rows of every `dataset_mixture` entry, concatenated in order (no shuffling here: training shuffles).

    With fractions f_i (normalised to shares s_i), the mixture has N = min_i(len_i / s_i) rows, the largest size at
    which no dataset repeats, and takes the first round(s_i * N) rows of each."""
    parts = parse_mixture(text)
    loaded = []
    for i, part in enumerate(parts):
        if part.data_dir or part.data_files:
            ds = _load_with_builder(part.path, part.name, part.split, part.data_dir, part.data_files)
        else:
            ds = load_rows(part.path, part.split, part.name)
        if part.columns:
            missing = sorted(set(part.columns) - set(ds.column_names))
            if missing:
                raise DataError(f"`dataset_mixture[{i}]` ({part.path!r}) has no columns {missing}; it has "
                                f"{sorted(ds.column_names)}.")
            ds = ds.select_columns(part.columns)
        if len(ds) == 0:
            raise DataError(f"`dataset_mixture[{i}]` ({part.path!r}) has no rows.")
        loaded.append(ds)
    if parts[0].fraction is not None:
        total = sum(p.fraction for p in parts)
        shares = [p.fraction / total for p in parts]
        size = min(len(ds) / share for ds, share in zip(loaded, shares, strict=True))
        loaded = [ds.select(range(min(len(ds), round(share * size)))) for ds, share in zip(loaded, shares, strict=True)]
    first = loaded[0]
    for i, ds in enumerate(loaded[1:], 1):
        if set(ds.column_names) != set(first.column_names):
            raise DataError(f"`dataset_mixture[{i}]` ({parts[i].path!r}) has columns {sorted(ds.column_names)} but "
                            f"`dataset_mixture[0]` has {sorted(first.column_names)}; pick the same ones with "
                            "`columns`.")
    try:
        return datasets.concatenate_datasets([first] + [ds.cast(first.features) for ds in loaded[1:]])
    except (ValueError, TypeError) as err:
        raise DataError(f"The `dataset_mixture` entries have the same columns but different types: {err}") from err


def check_chat_template_path(path: str) -> None:
    """Fail before any work when a local `chat_template_path` does not exist (hub ids and s3:// are fetched later)."""
    from trainer.config import ConfigError

    looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1 or Path(path).suffix in (".jinja", ".j2")
    if not is_remote(path) and looks_local and not Path(path).expanduser().exists():
        raise ConfigError(f"`chat_template_path` {path!r} does not exist: give a Jinja template file or a tokenizer "
                          "folder with a chat template.")


def read_chat_template(path: str) -> str:
    """The chat template in a Jinja file, or that of a tokenizer folder (or hub id), checked to parse."""
    import jinja2

    local = fetch_to_local(path) if is_remote(path) else str(Path(path).expanduser())
    if Path(local).is_file():
        template = Path(local).read_text()
    else:
        from transformers import AutoTokenizer

        try:
            template = AutoTokenizer.from_pretrained(local).chat_template
        except Exception as err:
            raise DataError(f"`chat_template_path` {path!r} is neither a Jinja file nor a loadable tokenizer: "
                            f"{type(err).__name__}: {err}") from err
    if not isinstance(template, str) or not template.strip():
        raise DataError(f"`chat_template_path` {path!r} holds no chat template.")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as err:
        raise DataError(f"`chat_template_path` {path!r} is not a valid Jinja template: line {err.lineno}: "
                        f"{err.message}") from err
    return template


def set_chat_template(tokenizer, path: str) -> None:
    """Give the tokenizer the chat template at `path` (saved with every checkpoint, like its own)."""
    had = bool(getattr(tokenizer, "chat_template", None))
    tokenizer.chat_template = read_chat_template(path)
    log.info("Chat template from %s%s.", path, " (replacing the tokenizer's own)" if had else "")
