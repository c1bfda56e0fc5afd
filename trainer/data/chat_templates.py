"""Conversations in TRL's chat format: checking messages and roles, rendering them with a tokenizer's
chat template, and loading a template from a file (`chat_template_path`)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from trainer.errors import DataError
from trainer.io.storage import fetch_to_local, is_remote

log = logging.getLogger(__name__)


def is_conversational(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


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


def read_chat_template(path: str) -> str:
    """The chat template in a Jinja file, or that of a tokenizer folder (or hub id), checked to parse."""
    import jinja2

    local = fetch_to_local(path) if is_remote(path) else str(Path(path).expanduser())
    if Path(local).is_file():
        try:
            template = Path(local).read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"`chat_template_path` {path!r} is not a UTF-8 text file ({err.reason} at byte {err.start}): "
                            "give a Jinja template file, or a tokenizer folder with a chat template.") from None
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
