"""Preference pairs for the reward-model and DPO stages.

Accepted like TRL: ``chosen`` + ``rejected`` with an optional ``prompt`` (and for the reward
model an optional ``margin``); each of them plain text or a list of chat messages. Without a
``prompt`` column the prompt is the longest shared start of the pair (the Anthropic HH layout:
both texts repeat the conversation and differ in the last reply).

`preference_texts` turns one row into three strings (prompt, chosen reply, rejected reply), with
chat messages rendered by the tokenizer's chat template, so the stages only tokenize text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import datasets

from trainer.data import DataError, _check_messages, is_conversational, render_chat

log = logging.getLogger(__name__)

PREFERENCE_FORMATS = "`chosen` + `rejected`, optionally with `prompt` (text or chat messages)"


def check_preference_columns(ds: datasets.Dataset, name: str, stage: str) -> None:
    cols = set(ds.column_names)
    if {"chosen", "rejected"} <= cols:
        return
    hint = ""
    if "messages" in cols or "completion" in cols or "text" in cols:
        hint = " This looks like SFT data: use `alignflow train sft`, or add `chosen` and `rejected` columns."
    raise DataError(f"Dataset {name!r} has columns {sorted(cols)}; the {stage} stage needs {PREFERENCE_FORMATS}.{hint}")


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _split_implicit_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """Longest shared start of both texts, cut back to a whitespace boundary so that no word is split."""
    n = _common_prefix(chosen, rejected)
    if n < min(len(chosen), len(rejected)):
        while n > 0 and not chosen[n - 1].isspace():
            n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


@dataclass
class PreferenceText:
    prompt: str
    chosen: str
    rejected: str


def preference_texts(row: dict, index: int, tokenizer=None) -> PreferenceText:
    """Prompt and the two replies of one row as text (chat rendered with `tokenizer`'s template)."""
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if is_conversational(chosen) or is_conversational(rejected):
        _check_messages(chosen, index, "chosen")
        _check_messages(rejected, index, "rejected")
        if prompt is None:  # whole conversations: the prompt is the shared leading turns
            k = 0
            while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
                k += 1
            prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
        elif isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        _check_messages(prompt, index, "prompt")
        prompt_text = render_chat(tokenizer, prompt, add_generation_prompt=True)
        texts = []
        for reply in (chosen, rejected):
            full = render_chat(tokenizer, prompt + reply)
            if not full.startswith(prompt_text):
                raise DataError(f"Row {index}: the chat template's rendering of prompt + reply does not start with "
                                "the rendered prompt, so the reply cannot be separated.")
            texts.append(full[len(prompt_text):])
        return PreferenceText(prompt_text, *texts)
    for col, val in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(val, str):
            raise DataError(f"Row {index}: `{col}` must be a string or a list of chat messages, got {type(val).__name__}.")
    if prompt is None:
        return PreferenceText(*_split_implicit_prompt(chosen, rejected))
    if is_conversational(prompt):
        _check_messages(prompt, index, "prompt")
        return PreferenceText(render_chat(tokenizer, prompt, add_generation_prompt=True), chosen, rejected)
    if not isinstance(prompt, str):
        raise DataError(f"Row {index}: `prompt` must be a string or a list of chat messages, got {type(prompt).__name__}.")
    return PreferenceText(prompt, chosen, rejected)


def load_pairs(ds: datasets.Dataset, name: str, stage: str, tokenizer=None) -> tuple[list[PreferenceText], list[int]]:
    """All usable pairs of a dataset and the row index of each.

    Pairs whose chosen equals their rejected carry no preference: they are counted, dropped
    and reported with a warning.
    """
    check_preference_columns(ds, name, stage)
    pairs, rows, identical = [], [], 0
    for index, row in enumerate(ds):
        pair = preference_texts(row, index, tokenizer)
        if pair.chosen == pair.rejected:
            identical += 1
            continue
        pairs.append(pair)
        rows.append(index)
    if identical:
        log.warning("%s: dropped %d of %d pairs whose chosen equals their rejected.", name, identical, len(ds))
    if not pairs:
        raise DataError(f"Dataset {name!r}: every pair has chosen == rejected; nothing to learn from.")
    return pairs, rows
