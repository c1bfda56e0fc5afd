"""SFT rows to tokens: TRL's three formats (`text`, `prompt` + `completion`, `messages`), the loss mask,
truncation and best-fit packing."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import datasets

from trainer.data.chat_templates import check_messages, is_conversational, render_chat
from trainer.data.sources import dataset_fingerprint
from trainer.errors import DataError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SFT_FORMATS = "`text`; `prompt` + `completion`; or `messages` (a list of {role, content} dicts)"


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


class FieldView(Sequence):
    """One field of every kept row of a tokenized table, read one row at a time: `view[i] == read(i)[field]`."""

    def __init__(self, owner, read: Callable[[int], Any], field: str | int) -> None:
        self.owner, self.read, self.field = owner, read, field

    def __len__(self) -> int:
        return len(self.owner)

    def __getitem__(self, i: int):
        return self.read(i)[self.field]


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
        self.input_ids = FieldView(self, self.row, "input_ids")
        self.loss_mask = FieldView(self, self.row, "loss_mask")

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
                 completion_only_loss: bool = True, assistant_only_loss: bool = True,
                 num_proc: int | None = None) -> TokenizedSFT:
    """Tokenize SFT data into the tokenized-data cache (`trainer.data.token_cache`), apply the length policy and
    mark the examples with nothing to learn; a second call with the same rows, tokenizer and options maps the
    Arrow file the first one wrote."""
    from trainer.data.token_cache import cached_map, tokenizer_fingerprint

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
                                   **options}, tokenize_batch, SFT_FEATURES, f"Tokenizing {name}", num_proc)
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


@dataclass
class RowLayout:
    """Sequences laid out in rows: one per row, padded to the longest, or packed (`lay_out_rows`)."""

    input_ids: torch.Tensor  # [R, T] torch.long, `pad_id` after each row's sequences
    sequence: torch.Tensor  # [R, T] the index of the sequence at each position, -1 on padding
    position_ids: torch.Tensor  # [R, T] restarting at 0 per sequence; each row's padding continues as a sequence of its own
    row: torch.Tensor  # [S] the row of each sequence
    start: torch.Tensor  # [S] the column of its first token
    order: list[int]  # the sequences in the order their tokens fill the rows

    def spread(self, values: list[list[int]]) -> torch.Tensor:
        """[R, T] of per-token `values` (one list per sequence, as long as it), laid out as the tokens; 0 on padding."""
        import torch

        out = torch.zeros_like(self.sequence)
        out[self.sequence >= 0] = torch.tensor([v for s in self.order for v in values[s]], dtype=out.dtype)
        return out


# The reward model's single packed row (padding-free batches on the CPU) is padded to a multiple of this many tokens.
# A row as long as its micro-batch's tokens takes a new width nearly every step, and the CPU's matmul library
# (oneDNN) keeps what it builds for each new shape: MiniLM, 8 pairs a step, bf16, peak RSS 1172 -> 1444 MB over
# 20 steps, still growing; rows of a multiple of 64: 1177 -> 1293 MB, level from step 15; padded rows (all 128
# wide) 1199 -> 1210 MB. SFT keeps exact widths: its padded batches vary in width as much (SmolLM2, 24 steps:
# padded +501 MB, one row +608 MB, one row of a multiple of 64 +418 MB), and 64 tokens are ~5% of its rows.
ROW_MULTIPLE = 64


def lay_out_rows(seqs: list[list[int]], pad_id: int, pack_to: int = 0, multiple: int = 1) -> RowLayout:
    """Each sequence in a row of its own, right-padded to the longest; with `pack_to` > 0, packed into rows of at
    most `pack_to` tokens (`pack_best_fit`), position ids restarting per sequence so that none attends to another.
    Padding continues as its own "sequence" so it never joins a real one's attention block. The rows' width is
    rounded up to a `multiple`."""
    import torch

    rows = pack_best_fit([len(s) for s in seqs], pack_to) if pack_to else [[s] for s in range(len(seqs))]
    width = -(-max(sum(len(seqs[s]) for s in members) for members in rows) // multiple) * multiple
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    sequence = torch.full(shape, -1, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    row = torch.zeros(len(seqs), dtype=torch.long)
    start = torch.zeros(len(seqs), dtype=torch.long)
    for r, members in enumerate(rows):
        col = 0
        for s in members:
            end = col + len(seqs[s])
            input_ids[r, col:end] = torch.tensor(seqs[s])
            sequence[r, col:end] = s
            position_ids[r, col:end] = torch.arange(end - col)
            row[s], start[s] = r, col
            col = end
        position_ids[r, col:] = torch.arange(width - col)
    return RowLayout(input_ids, sequence, position_ids, row, start, [s for members in rows for s in members])
