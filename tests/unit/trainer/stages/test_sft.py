"""SFT batches without training: packed rows attend only within their example; a padding-free micro-batch is one
row of its examples."""

import torch

from trainer.data.formatting import tokenize_sft
from trainer.data.sources import load_rows
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


def test_a_padding_free_micro_batch_is_one_row_of_its_examples_without_padding(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    data = tokenize_sft(load_rows("demo").select(range(4)), tokenizer, "demo", 128, "keep_start")
    pad = tokenizer.pad_token_id
    config = SFTConfig(model=tiny_model, dataset="demo", padding_free=True)
    free = micro_batch(data, [[0], [1], [2], [3]], pad, config)
    padded = micro_batch(data, [[0], [1], [2], [3]], pad, SFTConfig(model=tiny_model, dataset="demo"))
    lengths = [len(data.row(i)["input_ids"]) for i in range(4)]
    assert free.input_ids.shape == (1, sum(lengths)) and free.attention_mask is None
    assert free.position_ids[0].tolist() == [p for n in lengths for p in range(n)]
    assert padded.input_ids.shape == (4, max(lengths)) and len(set(lengths)) > 1  # (so padding-free saves some)
    assert free.num_tokens == padded.num_tokens and int(free.target_mask.sum()) == int(padded.target_mask.sum())
