"""Preference pairs for the reward-model and DPO stages.

Accepted like TRL: ``chosen`` + ``rejected`` with an optional ``prompt`` (and for the reward
model an optional ``margin``); each of them plain text or a list of chat messages. Without a
``prompt`` column the prompt is the longest shared start of the pair (the Anthropic HH layout:
both texts repeat the conversation and differ in the last reply).

`preference_texts` turns one row into three strings (prompt, chosen reply, rejected reply), with
chat messages rendered by the tokenizer's chat template, so the stages only tokenize text.
Both stages tokenize into one `TokenizedPairs`, each with its own policy: `tokenize_dpo_pairs`
(prompt and replies apart) and `tokenize_reward_pairs` (prompt + reply as one text).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import datasets
import torch

from trainer.data.chat_templates import check_messages, is_conversational, render_chat
from trainer.data.formatting import report_lengths
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


# ----------------------------------------------------------------------------------------------
# Tokenization: one dataclass, each stage's own policy


@dataclass
class TokenizedPairs:
    """Token ids of every kept pair, as the DPO and reward-model stages train on them.

    Pair i's chosen sequence is `prompt_ids[i] + chosen_ids[i]`, its rejected one
    `prompt_ids[i] + rejected_ids[i]`. DPO tokenizes the prompt on its own (its log-probs count
    the replies only; text replies end in eos); the reward model tokenizes prompt + reply as one
    text, so its `prompt_ids` are empty. `margins` is the optional `margin` column (RM only).
    """

    prompt_ids: list[list[int]] = field(default_factory=list)
    chosen_ids: list[list[int]] = field(default_factory=list)
    rejected_ids: list[list[int]] = field(default_factory=list)
    margins: list[float] | None = None

    def __len__(self) -> int:
        return len(self.chosen_ids)

    def pair_length(self, i: int) -> int:
        return 2 * len(self.prompt_ids[i]) + len(self.chosen_ids[i]) + len(self.rejected_ids[i])


def tokenize_dpo_pairs(pairs: list[PreferenceText], tokenizer, name: str, chat: bool, max_length: int,
                       max_prompt_length: int, truncation_mode: str, total_rows: int) -> TokenizedPairs:
    """DPO's policy: prompt and replies tokenized separately, then the length policy.

    The prompt keeps its last `max_prompt_length` tokens (the end of a conversation is what the
    reply answers). Each completion then gets `max_length - len(prompt)` tokens, cut per
    `truncation_mode` (keep_start, keep_end, or drop the pair). Text completions end in eos, as
    in TRL; rendered chat replies already end in the template's end-of-turn tokens.
    """
    eos = tokenizer.eos_token_id
    out = TokenizedPairs()
    prompts_cut = truncated = dropped_long = identical = 0
    for pair in pairs:
        prompt = tokenizer(pair.prompt, add_special_tokens=not chat)["input_ids"]
        if len(prompt) > max_prompt_length:
            prompt = prompt[-max_prompt_length:]
            prompts_cut += 1
        budget = max_length - len(prompt)
        completions = []
        for text in (pair.chosen, pair.rejected):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if not chat and eos is not None and (not ids or ids[-1] != eos):
                ids = ids + [eos]
            completions.append(ids)
        too_long = any(len(ids) > budget for ids in completions)
        if too_long and truncation_mode == "drop":
            dropped_long += 1
            continue
        if too_long:
            truncated += 1
            cut = slice(-budget, None) if truncation_mode == "keep_end" else slice(None, budget)
            completions = [ids[cut] for ids in completions]
            if completions[0] == completions[1]:  # truncation cut away the only difference: margin 0, no gradient
                identical += 1
                continue
        out.prompt_ids.append(prompt)
        out.chosen_ids.append(completions[0])
        out.rejected_ids.append(completions[1])
    if prompts_cut:
        log.warning("%s: %d of %d prompts are longer than max_prompt_length=%d and lost their start.",
                    name, prompts_cut, total_rows, max_prompt_length)
    fix = (f"raise `max_length` or lower `max_prompt_length` (a reply gets max_length minus its prompt's tokens, here "
           f"at least {max_length - max_prompt_length})")
    if truncation_mode == "keep_end":
        fix += ", or set `truncation_mode keep_start` (keep_end keeps the replies' common end)"
    _drop_identical(name, identical, total_rows, len(out), max_length, truncation_mode, fix)
    report_lengths(name, total_rows, max_length, truncation_mode, truncated, dropped_long, 0, len(out))
    return out


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


def tokenize_reward_pairs(pairs: list[PreferenceText], margins: list[float] | None, tokenizer, name: str,
                          max_length: int, truncation_mode: str) -> TokenizedPairs:
    """The reward model's policy: prompt + reply tokenized as one text (`reward_texts`; `prompt_ids`
    stay empty), the length policy, and pairs whose two texts became identical dropped."""
    prompts = [p.prompt for p in pairs]
    drop = truncation_mode == "drop"
    chosen, chosen_long = tokenize_texts(tokenizer, reward_texts(tokenizer, prompts, [p.chosen for p in pairs]),
                                         max_length, drop)
    rejected, rejected_long = tokenize_texts(
        tokenizer, reward_texts(tokenizer, prompts, [p.rejected for p in pairs]), max_length, drop)
    out = TokenizedPairs(margins=[] if margins is not None else None)
    long = identical = 0
    for i, (c, r) in enumerate(zip(chosen, rejected)):
        long += chosen_long[i] or rejected_long[i]
        if c is None or r is None:
            continue
        if c == r:  # truncation cut away the only difference
            identical += 1
            continue
        out.prompt_ids.append([])
        out.chosen_ids.append(c)
        out.rejected_ids.append(r)
        if margins is not None:
            out.margins.append(margins[i])
    _drop_identical(name, identical, len(pairs), len(out), max_length, truncation_mode,
                    "raise `max_length`, or set `truncation_mode keep_end` (prompt and reply are one text here, and "
                    "replies differ at its end)" if truncation_mode != "keep_end" else "raise `max_length`")
    report_lengths(name, len(pairs), max_length, truncation_mode, 0 if drop else long, long if drop else 0, 0,
                   len(out))
    return out


def pad_right(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask, [N, T] each."""
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, ids in enumerate(seqs):
        input_ids[r, :len(ids)] = torch.tensor(ids)
        attention[r, :len(ids)] = 1
    return input_ids, attention
