"""SFT batches without training: packed rows attend only within their example."""

import torch

from trainer.data.formatting import tokenize_sft
from trainer.data.sources import load_rows
from trainer.engine.models import load_causal_lm, load_tokenizer
from trainer.stages.sft import collate, token_loss


def test_packed_rows_do_not_attend_across_examples(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model)
    data = tokenize_sft(load_rows("demo").select(range(6)), tokenizer, "demo", 128, "keep_start")
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        unpacked, _ = token_loss(model, collate(data, [[i] for i in range(6)], pad, packed=False))
        packed, _ = token_loss(model, collate(data, [[0, 1, 2], [3, 4, 5]], pad, packed=True))
    torch.testing.assert_close(packed, unpacked, atol=1e-4, rtol=1e-5)
