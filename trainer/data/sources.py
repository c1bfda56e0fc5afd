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
from importlib import resources
from pathlib import Path
from typing import Any

import datasets

from trainer.config.mixtures import parse_mixture
from trainer.errors import DataError
from trainer.io.storage import fetch_to_local, is_remote

DATA_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


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
    else:
        check_local_path(spec)  # a hub id, then
        try:
            ds = datasets.load_dataset(spec, name, split=split)
        except Exception as err:
            raise DataError(f"Dataset {spec!r} is neither a local file/folder nor a loadable hub dataset "
                            f"({type(err).__name__}: {err}). Check the path, or pass a jsonl/parquet file.") from err
    if len(ds) == 0:
        raise DataError(f"Dataset {spec!r} is empty: it has columns {ds.column_names} but no rows.")
    return ds


def check_local_path(spec: str) -> None:
    """Fail on a dataset `spec` that can only be a local path (not demo data, a remote URI or a hub id) and
    does not exist."""
    if spec == "demo" or spec.startswith("demo:") or is_remote(spec) or Path(spec).exists():
        return
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or _builder_for(Path(spec)):
        raise DataError(f"Dataset path {spec!r} does not exist.")


def check_local_paths(config) -> None:
    """`check_local_path` on every data path of `config` (`dataset`, `eval_dataset`, the `dataset_mixture`
    entries). `alignflow train` runs this before starting ranks, each of which would otherwise fail on its
    own, seconds later and in its own log."""
    specs = [config.dataset, getattr(config, "eval_dataset", None)]
    if getattr(config, "dataset_mixture", None):
        specs += [part.path for part in parse_mixture(config.dataset_mixture)]
    for spec in filter(None, specs):
        check_local_path(spec)


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


# ----------------------------------------------------------------------------------------------
# Packing


FINGERPRINT_PREFIX = "sha256-"


def dataset_fingerprint(ds: datasets.Dataset) -> str:
    """A hash of the rows themselves (column names and values, in order), ``sha256-`` + 16 hex digits.

    The same rows give the same fingerprint wherever and whenever they were loaded from (datasets' own
    `_fingerprint` changes with the cache file's path and time, e.g. on every download from s3://), so
    `resume_from_checkpoint auto` and the tokenized-data cache can tell the same data from new data. The rows are
    hashed as Arrow data, not Python objects: each window of rows is copied into fresh arrays (so that how the
    table happens to be chunked, sliced or index-mapped does not count) and hashed in Arrow's IPC format; about
    0.05 s per 100k short rows (a JSON round trip of every row took 1 s). Computed once per dataset object."""
    import pyarrow as pa

    key = (id(ds), getattr(ds, "_fingerprint", None))  # datasets' own: fixed for one object
    if key in _FINGERPRINTS:
        return _FINGERPRINTS[key]
    digest = hashlib.sha256(json.dumps(list(ds.column_names)).encode())
    arrow = ds.with_format("arrow")
    for start in range(0, len(ds), _FINGERPRINT_WINDOW):
        window = arrow[start:start + _FINGERPRINT_WINDOW]  # index mapping applied; may share the file's buffers
        window = window.take(pa.array(range(window.num_rows))).combine_chunks().replace_schema_metadata(None)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, window.schema) as writer:
            writer.write_table(window)
        digest.update(sink.getvalue())
    fingerprint = FINGERPRINT_PREFIX + digest.hexdigest()[:16]
    if len(_FINGERPRINTS) >= 8:
        _FINGERPRINTS.pop(next(iter(_FINGERPRINTS)))
    _FINGERPRINTS[key] = fingerprint
    return fingerprint


_FINGERPRINT_WINDOW = 2000  # rows per hashed window: small enough for long documents, large enough to be fast
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


