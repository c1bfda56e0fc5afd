"""Preference pairs for the reward-model and DPO stages.

Accepted like TRL: ``chosen`` + ``rejected`` with an optional ``prompt`` (and for the reward
model an optional ``margin``); each of them plain text or a list of chat messages. Without a
``prompt`` column the prompt is the longest shared start of the pair (the Anthropic HH layout:
both texts repeat the conversation and differ in the last reply).

`preference_texts` turns one row into three strings (prompt, chosen reply, rejected reply), with
chat messages rendered by the tokenizer's chat template, so the stages only tokenize text.
Both stages tokenize into one `TokenizedPairs`, each with its own policy: `tokenize_dpo_pairs`
(prompt and replies apart) and `tokenize_reward_pairs` (prompt + reply as one text). Rows are
tokenized with `datasets.map` into the tokenized-data cache (`trainer.data.token_cache`, as SFT
data is), so the tokens are a memory-mapped Arrow file, built once per (rows, tokenizer, options);
a `status` column says why a row was not kept, and the warnings count it after the map.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

from trainer.data.chat_templates import check_messages, is_conversational, render_chat
from trainer.data.formatting import FieldView, report_lengths
from trainer.errors import DataError

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


def split_implicit_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
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
        check_messages(chosen, index, "chosen", tokenizer)
        check_messages(rejected, index, "rejected", tokenizer)
        if prompt is None:  # whole conversations: the prompt is the shared leading turns
            k = 0
            while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
                k += 1
            prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
        elif isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        check_messages(prompt, index, "prompt", tokenizer)
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
        return PreferenceText(*split_implicit_prompt(chosen, rejected))
    if is_conversational(prompt):
        check_messages(prompt, index, "prompt", tokenizer)
        return PreferenceText(render_chat(tokenizer, prompt, add_generation_prompt=True), chosen, rejected)
    if not isinstance(prompt, str):
        raise DataError(f"Row {index}: `prompt` must be a string or a list of chat messages, got {type(prompt).__name__}.")
    return PreferenceText(prompt, chosen, rejected)


def load_pairs(ds: datasets.Dataset, name: str, stage: str, tokenizer=None) -> tuple[list[PreferenceText], list[int]]:
    """All usable pairs of a dataset as text and the row index of each (the stages tokenize rows straight into the
    cache, `tokenize_dpo_pairs` / `tokenize_reward_pairs`; this is for scoring texts).

    Pairs whose chosen equals their rejected carry no preference: they are counted, dropped
    and reported with a warning.
    """
    check_preference_columns(ds, name, stage)
    pairs, rows = [], []
    for index, row in enumerate(ds):
        pair = preference_texts(row, index, tokenizer)
        if pair.chosen != pair.rejected:
            pairs.append(pair)
            rows.append(index)
    _report_same_texts(name, len(ds) - len(pairs), len(ds), len(pairs))
    return pairs, rows


def _report_same_texts(name: str, same: int, total: int, kept: int) -> None:
    if same:
        log.warning("%s: dropped %d of %d pairs whose chosen equals their rejected.", name, same, total)
    if not kept:
        raise DataError(f"Dataset {name!r}: every pair has chosen == rejected; nothing to learn from.")


# ----------------------------------------------------------------------------------------------
# Tokenization into the tokenized-data cache: one view, each stage's own policy

# The `status` column of tokenized pairs. SAME_TEXT: chosen == rejected as text (no preference; not tokenized);
# SAME_TOKENS: truncation cut away the only difference (margin 0, no gradient); DROPPED_LONG: truncation_mode=drop.
KEPT, SAME_TEXT, DROPPED_LONG, SAME_TOKENS = 0, 1, 2, 3

PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
PAIR_FEATURES = datasets.Features({
    **{column: datasets.Sequence(datasets.Value("int32")) for column in PAIR_COLUMNS},  # [] unless KEPT
    "prompt_cut": datasets.Value("bool"),  # DPO: the prompt was longer than max_prompt_length and lost its start
    "truncated": datasets.Value("bool"),  # a reply (DPO) or a prompt + reply text (RM) was cut to max_length
    "status": datasets.Value("int8"),
})


class Pair(NamedTuple):
    """One pair's token ids: its chosen sequence is `prompt + chosen`, its rejected one `prompt + rejected`."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


class TokenizedPairs:
    """Token ids of every kept pair, as the DPO and reward-model stages train on them (`pair(i)`).

    DPO tokenizes the prompt on its own (its log-probs count the replies only; text replies end in
    eos); the reward model tokenizes prompt + reply as one text, so its prompts are empty. `margins`
    is the optional `margin` column of the kept pairs (RM only).

    The tokens stay in an Arrow table (memory-mapped from the tokenized-data cache): one row per input row,
    with a `status` saying whether it was kept. `rows` maps kept pair i to its table row; the lengths of the
    kept pairs' parts stay in memory (what batching by length needs)."""

    def __init__(self, table: datasets.Dataset) -> None:
        self.table = table
        columns = table.data  # a datasets Table over the Arrow file
        self.status = columns.column("status").to_numpy()  # [rows] per input row
        self.rows = np.flatnonzero(self.status == KEPT)  # [N kept] table row of each kept pair
        self.num_prompts_cut = int(columns.column("prompt_cut").to_numpy(zero_copy_only=False).sum())
        self.num_truncated = int(columns.column("truncated").to_numpy(zero_copy_only=False).sum())
        self.lengths = np.stack([pc.list_value_length(columns.column(c)).to_numpy()[self.rows]
                                 for c in PAIR_COLUMNS], 1).astype(np.int64)  # [N kept, 3] prompt, chosen, rejected
        self.margins: list[float] | None = None
        self.prompt_ids, self.chosen_ids, self.rejected_ids = (FieldView(self, self.pair, c) for c in range(3))

    def count(self, status: int) -> int:
        """Input rows with this `status`."""
        return int((self.status == status).sum())

    def __len__(self) -> int:
        return len(self.rows)

    def pair(self, i: int) -> Pair:
        part = self.table.data.fast_slice(int(self.rows[i]), 1)
        return Pair(*(part.column(c)[0].as_py() for c in PAIR_COLUMNS))

    def pair_length(self, i: int) -> int:
        prompt, chosen, rejected = self.lengths[i].tolist()
        return 2 * prompt + chosen + rejected

    def longest(self) -> int:
        """Tokens in the longest of the kept pairs' sequences (prompt + chosen, prompt + rejected)."""
        return int((self.lengths[:, :1] + self.lengths[:, 1:]).max())


def _tokenize_pairs(ds: datasets.Dataset, tokenizer, name: str, kind: str, options: dict,
                    tokenize_batch: Callable, num_proc: int | None = None) -> TokenizedPairs:
    """`tokenize_batch` over the rows into the tokenized-data cache (or the entry a previous run wrote), keyed by
    the rows, the tokenizer and `options`; pairs whose texts are equal are reported (as `load_pairs` does)."""
    from trainer.data.sources import dataset_fingerprint
    from trainer.data.token_cache import cached_map, tokenizer_fingerprint

    if len(ds) == 0:  # no pair to learn from, as when every pair is identical (and nothing to map)
        _report_same_texts(name, 0, 0, 0)
    key = {"data": dataset_fingerprint(ds), "tokenizer": tokenizer_fingerprint(tokenizer), **options}
    data = TokenizedPairs(cached_map(ds, kind, key, tokenize_batch, PAIR_FEATURES, f"Tokenizing {name}", num_proc))
    same = data.count(SAME_TEXT)
    _report_same_texts(name, same, len(ds), len(ds) - same)
    return data


def _batch_texts(batch: dict[str, list], indices: list[int], tokenizer) -> list[PreferenceText | None]:
    """The rows of a `datasets.map` batch as text; None where chosen equals rejected (no preference)."""
    texts = [preference_texts({column: values[k] for column, values in batch.items()}, index, tokenizer)
             for k, index in enumerate(indices)]
    return [None if text.chosen == text.rejected else text for text in texts]


def _pair_row(out: dict[str, list], status: int, ids: tuple[list[int], list[int], list[int]] = ([], [], []),
              prompt_cut: bool = False, truncated: bool = False) -> None:
    """Append one row of PAIR_FEATURES to a batch's output; only kept pairs keep their tokens."""
    for column, value in zip(PAIR_COLUMNS, ids if status == KEPT else ([], [], [])):
        out[column].append(value)
    out["prompt_cut"].append(prompt_cut)
    out["truncated"].append(truncated)
    out["status"].append(status)


def _dpo_pair_tokens(tokenizer, pair: PreferenceText, chat: bool, max_length: int, max_prompt_length: int,
                     truncation_mode: str, out: dict[str, list]) -> None:
    """DPO's policy for one pair (appended to `out`): prompt and replies tokenized separately, then the length
    policy.

    The prompt keeps its last `max_prompt_length` tokens (the end of a conversation is what the
    reply answers). Each completion then gets `max_length - len(prompt)` tokens, cut per
    `truncation_mode` (keep_start, keep_end, or drop the pair). Text completions end in eos, as
    in TRL; rendered chat replies already end in the template's end-of-turn tokens.
    """
    eos = tokenizer.eos_token_id
    prompt = tokenizer(pair.prompt, add_special_tokens=not chat)["input_ids"]
    prompt_cut = len(prompt) > max_prompt_length
    if prompt_cut:
        prompt = prompt[-max_prompt_length:]
    budget = max_length - len(prompt)
    completions = []
    for text in (pair.chosen, pair.rejected):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not chat and eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]
        completions.append(ids)
    too_long = any(len(ids) > budget for ids in completions)
    if too_long and truncation_mode == "drop":
        _pair_row(out, DROPPED_LONG, prompt_cut=prompt_cut)
        return
    if too_long:
        cut = slice(-budget, None) if truncation_mode == "keep_end" else slice(None, budget)
        completions = [ids[cut] for ids in completions]
    status = SAME_TOKENS if too_long and completions[0] == completions[1] else KEPT
    _pair_row(out, status, (prompt, *completions), prompt_cut, too_long)


def tokenize_dpo_pairs(ds: datasets.Dataset, tokenizer, name: str, max_length: int, max_prompt_length: int,
                       truncation_mode: str, num_proc: int | None = None) -> TokenizedPairs:
    """The pairs of a dataset under DPO's policy (`_dpo_pair_tokens`), in the tokenized-data cache; a second call
    with the same rows, tokenizer and options maps the Arrow file the first one wrote. Errors name missing
    columns; pairs with nothing to learn are dropped and counted."""
    check_preference_columns(ds, name, "dpo")
    chat = len(ds) > 0 and is_conversational(ds[0]["chosen"])  # a column is all text or all chat

    def tokenize_batch(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {key: [] for key in PAIR_FEATURES}
        for pair in _batch_texts(batch, indices, tokenizer):
            if pair is None:
                _pair_row(out, SAME_TEXT)
            else:
                _dpo_pair_tokens(tokenizer, pair, chat, max_length, max_prompt_length, truncation_mode, out)
        return out

    options = {"chat": chat, "max_length": max_length, "max_prompt_length": max_prompt_length,
               "truncation_mode": truncation_mode}
    data = _tokenize_pairs(ds, tokenizer, name, "dpo", options, tokenize_batch, num_proc)
    total = len(ds)
    if data.num_prompts_cut:
        log.warning("%s: %d of %d prompts are longer than max_prompt_length=%d and lost their start.",
                    name, data.num_prompts_cut, total, max_prompt_length)
    fix = (f"raise `max_length` or lower `max_prompt_length` (a reply gets max_length minus its prompt's tokens, here "
           f"at least {max_length - max_prompt_length})")
    if truncation_mode == "keep_end":
        fix += ", or set `truncation_mode keep_start` (keep_end keeps the replies' common end)"
    _drop_identical(name, data.count(SAME_TOKENS), total, len(data), max_length, truncation_mode, fix)
    report_lengths(name, total, max_length, truncation_mode, data.num_truncated, data.count(DROPPED_LONG), 0,
                   len(data))
    return data


def _drop_identical(name: str, identical: int, total: int, kept: int, max_length: int, mode: str, fix: str) -> None:
    """Say how many pairs lost their difference to truncation (they were dropped: a pair whose chosen and rejected
    tokens are the same has margin 0 and no gradient); when no pair is left, that is the error, with `fix`."""
    if not identical:
        return
    if kept == 0:
        raise DataError(f"Dataset {name!r}: all {identical} pairs left after max_length={max_length} "
                        f"(truncation_mode={mode}) have identical chosen and rejected tokens, so there is nothing to "
                        f"learn: {fix}.")
    log.warning("%s: dropped %d of %d pairs whose chosen and rejected tokens are identical after truncation to "
                "max_length=%d (truncation_mode=%s); %s.", name, identical, total, max_length, mode, fix)


def _closes_with_eos(tokenizer) -> bool:
    """Whether reward texts must end with the eos token: a causal LM reads the reward at the last
    token, and eos gives that position a fixed meaning ("the reply ends here"). Encoders' tokenizers
    close the sequence themselves (BERT: [CLS] … [SEP]), and may have no eos at all. (Where pad == eos,
    transformers takes a final eos for padding and reads the token before it, as in TRL.)"""
    if tokenizer.eos_token is None:
        return False
    ids = tokenizer("x")["input_ids"]
    return not ids or ids[-1] not in tokenizer.all_special_ids


def reward_texts(tokenizer, prompts: list[str], replies: list[str]) -> list[str]:
    """The texts a reward model scores: prompt + reply (+ eos, see `_closes_with_eos`). A reply that
    already ends with eos (chat templates close each turn with it) gets no second one."""
    eos = tokenizer.eos_token if _closes_with_eos(tokenizer) else None
    texts = [p + r for p, r in zip(prompts, replies)]
    return [t + eos if eos and not t.rstrip().endswith(eos) else t for t in texts]


def tokenize_texts(tokenizer, texts: list[str], max_length: int,
                   drop_long: bool) -> tuple[list[list[int] | None], list[bool]]:
    """Token ids of each text with the tokenizer's special tokens, and whether it was longer than
    `max_length`. Long texts are cut on the tokenizer's `truncation_side` (special tokens kept), or
    are None with `drop_long`."""
    if not texts:  # the tokenizer fails on an empty batch
        return [], []
    ids: list[list[int] | None] = tokenizer(texts, verbose=False)["input_ids"]  # no "too long" warning: handled
    long = [len(x) > max_length for x in ids]
    where = [i for i, is_long in enumerate(long) if is_long]
    if where and not drop_long:
        cut = tokenizer([texts[i] for i in where], truncation=True, max_length=max_length)["input_ids"]
        for i, x in zip(where, cut):
            ids[i] = x
    else:
        for i in where:
            ids[i] = None
    return ids, long


def read_margins(rows, indices: list[int], name: str) -> list[float] | None:
    """The optional `margin` column (Llama 2's preference strength) for the pairs kept from `rows`."""
    if "margin" not in rows.column_names:
        return None
    column = rows["margin"]
    margins = []
    for i in indices:
        value = column[i]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise DataError(f"{name}: row {i}: `margin` must be a finite number, got {value!r}.")
        margins.append(float(value))
    return margins


def tokenize_reward_pairs(ds: datasets.Dataset, tokenizer, name: str, max_length: int,
                          truncation_mode: str, num_proc: int | None = None) -> TokenizedPairs:
    """The pairs of a dataset under the reward model's policy, in the tokenized-data cache: prompt + reply
    tokenized as one text (`reward_texts`; the prompts stay empty), long texts cut on the tokenizer's
    `truncation_side` (or dropped), and pairs whose two texts became identical dropped. `margins` holds the
    optional `margin` column of the kept pairs."""
    check_preference_columns(ds, name, "reward")
    drop = truncation_mode == "drop"

    def tokenize_batch(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {key: [] for key in PAIR_FEATURES}
        pairs = _batch_texts(batch, indices, tokenizer)
        live = [p for p in pairs if p is not None]
        prompts = [p.prompt for p in live]
        chosen, chosen_long = tokenize_texts(tokenizer, reward_texts(tokenizer, prompts, [p.chosen for p in live]),
                                             max_length, drop)
        rejected, rejected_long = tokenize_texts(
            tokenizer, reward_texts(tokenizer, prompts, [p.rejected for p in live]), max_length, drop)
        tokens = iter(zip(chosen, rejected, chosen_long, rejected_long))
        for pair in pairs:
            if pair is None:
                _pair_row(out, SAME_TEXT)
                continue
            c, r, c_long, r_long = next(tokens)
            if c is None or r is None:
                _pair_row(out, DROPPED_LONG)
            else:  # equal tokens: truncation cut away the only difference
                _pair_row(out, SAME_TOKENS if c == r else KEPT, ([], c, r), truncated=c_long or r_long)
        return out

    options = {"max_length": max_length, "truncation_mode": truncation_mode,
               "truncation_side": tokenizer.truncation_side}
    data = _tokenize_pairs(ds, tokenizer, name, "reward", options, tokenize_batch, num_proc)
    texts = data.status != SAME_TEXT  # [rows] the pairs tokenized
    margins = read_margins(ds, [int(i) for i in texts.nonzero()[0]], name)
    if margins is not None:
        data.margins = [m for m, status in zip(margins, data.status[texts]) if status == KEPT]
    total = int(texts.sum())
    _drop_identical(name, data.count(SAME_TOKENS), total, len(data), max_length, truncation_mode,
                    "raise `max_length`, or set `truncation_mode keep_end` (prompt and reply are one text here, and "
                    "replies differ at its end)" if truncation_mode != "keep_end" else "raise `max_length`")
    report_lengths(name, total, max_length, truncation_mode, data.num_truncated, data.count(DROPPED_LONG), 0,
                   len(data))
    return data


def pad_right(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask, [N, T] each."""
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, ids in enumerate(seqs):
        input_ids[r, :len(ids)] = torch.tensor(ids)
        attention[r, :len(ids)] = 1
    return input_ids, attention
