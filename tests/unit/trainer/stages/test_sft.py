"""SFT batches without training: packed rows attend only within their example; a padding-free micro-batch is its
examples packed into rows of at most max_length, or into one row."""

import itertools

import torch

from trainer.data.formatting import tokenize_sft
from trainer.data.sources import load_rows
from trainer.engine.attention import use_alignflow_attention
from trainer.engine.models import load_causal_lm, load_tokenizer
from trainer.stages.sft import SFTConfig, collate, micro_batch, token_loss


def test_packed_rows_do_not_attend_across_examples(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model)
    data = tokenize_sft(load_rows("demo").select(range(6)), tokenizer, "demo", 128, "keep_start")
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        unpacked, _ = token_loss(model, collate(data, [[i] for i in range(6)], pad, packed=False))
        packed, _ = token_loss(model, collate(data, [[0, 1, 2], [3, 4, 5]], pad, packed=True))
    torch.testing.assert_close(packed, unpacked, atol=1e-4, rtol=1e-5)


def test_a_padding_free_micro_batch_packs_its_examples_into_rows_of_max_length(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    data = tokenize_sft(load_rows("demo").select(range(8)), tokenizer, "demo", 128, "keep_start")
    model = load_causal_lm(tiny_model)
    pad = tokenizer.pad_token_id
    lengths = [len(data.row(i)["input_ids"]) for i in range(8)]
    max_length = 2 * max(lengths)  # room for any two examples, not for all of them
    config = SFTConfig(model=tiny_model, dataset="demo", padding_free=True, max_length=max_length)
    free = micro_batch(data, [[i] for i in range(8)], pad, config)
    padded = micro_batch(data, [[i] for i in range(8)], pad, SFTConfig(model=tiny_model, dataset="demo"))
    assert free.attention_mask is None and 1 < len(free.input_ids) <= 4 and free.input_ids.shape[1] <= max_length
    with torch.no_grad():  # every example exactly once, attending only to itself
        torch.testing.assert_close(token_loss(model, free)[0], token_loss(model, padded)[0], atol=1e-4, rtol=1e-5)
    assert free.num_tokens == padded.num_tokens == sum(lengths)
    assert int(free.target_mask.sum()) == int(padded.target_mask.sum())
    # On the CPU the stage puts them all in one row with their bounds; the attention runs each apart, or (plain
    # sdpa, which ignores the bounds) under the block-diagonal mask of the restarting position ids.
    one = micro_batch(data, [[i] for i in range(8)], pad, config, one_row=True)
    assert one.input_ids.shape == (1, sum(lengths)) and one.bounds.tolist() == [0, *itertools.accumulate(lengths)]
    for attention in ("sdpa", "alignflow"):
        if attention == "alignflow":
            use_alignflow_attention(model)
        with torch.no_grad():
            torch.testing.assert_close(token_loss(model, one)[0], token_loss(model, padded)[0], atol=1e-4, rtol=1e-5)


def test_a_packed_batch_counts_only_its_real_tokens(tiny_model):
    """Padding after a packed row continues the position ids as an example of its own; it is not a token."""
    tokenizer = load_tokenizer(tiny_model)
    data = tokenize_sft(load_rows("demo").select(range(3)), tokenizer, "demo", 128, "keep_start")
    batch = collate(data, [[0, 1], [2]], tokenizer.pad_token_id, packed=True)
    assert batch.input_ids.numel() > batch.num_tokens == sum(len(data.row(i)["input_ids"]) for i in range(3))
