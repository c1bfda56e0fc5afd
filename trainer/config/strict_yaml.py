"""YAML that refuses what PyYAML lets through silently: a key given twice."""

from __future__ import annotations

from typing import Any

import yaml

from trainer.errors import ConfigError


class DuplicateKeyError(yaml.YAMLError):
    """A mapping in a YAML document names a key twice (PyYAML would keep the last value silently)."""

    def __init__(self, key: Any, first: int, again: int) -> None:
        super().__init__(f"`{key}` is set twice, on line {first} and again on line {again}; keep one")
        self.key, self.first, self.again = key, first, again


class StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses duplicate keys (a config with `learning_rate` twice trained with the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKeyError(key, seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key: construct_mapping reports it
                pass
        return super().construct_mapping(node, deep=deep)


def strict_yaml(text) -> Any:
    """`yaml.safe_load` that raises `DuplicateKeyError` for a key given twice in one mapping."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)


def load_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path) as fh:
            data = strict_yaml(fh) or {}
    except FileNotFoundError:
        raise ConfigError(f"Config file {path!r} does not exist.") from None
    except DuplicateKeyError as err:
        raise ConfigError(f"Config file {path!r}: {err}.") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"Config file {path!r} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path!r} must hold a mapping of option: value, got {type(data).__name__}.")
    return data
