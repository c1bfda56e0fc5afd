"""`dataset_mixture`: several datasets with weights, as one option (TRL's `dataset_mixture`)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.strict_yaml import DuplicateKeyError, strict_yaml
from trainer.errors import ConfigError


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
