"""Reward-model stage inputs that fail before the model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import write_jsonl
from trainer.errors import DataError
from trainer.stages import reward_model as reward
from trainer.stages.reward_model import RewardConfig, run_reward


def rm_config(model: str, dataset: str, out: Path, **overrides) -> RewardConfig:
    values = dict(model=model, dataset=dataset, output_dir=str(out), max_steps=60, per_device_batch_size=16,
                  learning_rate=3e-3, logging_steps=10, max_length=64, disable_progress_bar=True)
    values.update(overrides)
    return RewardConfig(**values)


def test_margin_values_must_be_numbers(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", [{"chosen": "a b", "rejected": "a c", "margin": None}])
    with pytest.raises(DataError, match="row 0: `margin`"):
        run_reward(rm_config(tiny_model, data, tmp_path / "out"))


def test_sft_data_fails_before_the_model_loads_naming_the_columns(tiny_model, tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(reward, "load_reward_model", no_model)
    with pytest.raises(DataError) as err:
        run_reward(rm_config(tiny_model, "demo", tmp_path / "out"))
    assert "`chosen`" in str(err.value) and "`rejected`" in str(err.value)
    assert "SFT" in str(err.value)


def packing_pairs() -> list[dict]:
    """Pairs of different lengths, so that best fit puts several texts in a row and rows end in padding."""
    words = "apple river stone cloud green music paper light table window".split()
    return [{"prompt": f"Answer {'yes' if i % 2 else 'no'}:", "chosen": " " + " ".join(words[:2 + i]) + " yes",
             "rejected": " " + " ".join(words[:1 + i // 2]) + " no"} for i in range(6)]


def packing_data(tokenizer):
    import datasets

    from trainer.data.preferences import tokenize_reward_pairs

    return tokenize_reward_pairs(datasets.Dataset.from_list(packing_pairs()), tokenizer, "pairs", 64, "keep_end")


@pytest.mark.parametrize("one_row", [False, True])
@pytest.mark.parametrize("pad", ["pad", "eos"])
def test_packed_rows_score_like_padded_ones(tiny_model, pad, one_row):
    """`padding_free` packs the 2B texts into fewer rows with restarting position ids (or into one row with their
    bounds, as on the CPU) and reads each reward at its text's last token: the rewards of padded rows, in the same
    order (chosen, then rejected). Without the position ids the packed texts would attend to each other and the
    numbers would differ. Where pad == eos, transformers reads a padded row before its final eos (taking it for
    padding); packed rows must read the same token."""
    import torch

    from trainer.data.formatting import ROW_MULTIPLE
    from trainer.engine.attention import use_alignflow_attention
    from trainer.engine.models import load_reward_model, load_tokenizer

    tokenizer = load_tokenizer(tiny_model)
    data = packing_data(tokenizer)
    pad_id = tokenizer.pad_token_id if pad == "pad" else tokenizer.eos_token_id
    assert all(ids[-1] == tokenizer.eos_token_id != tokenizer.pad_token_id for ids in data.chosen_ids)
    torch.manual_seed(0)
    model = load_reward_model(tiny_model, pad_id).eval()
    use_alignflow_attention(model)  # what the stage runs: the bounds reach `per_sequence_attention`
    indices = list(range(len(data)))
    padded = reward.collate(data, indices, pad_id)
    packed = reward.collate(data, indices, pad_id, pack_to=64, one_row=one_row)
    if one_row:  # padded at its end to a multiple of ROW_MULTIPLE tokens, the padding a sequence of its own
        width = packed.input_ids.shape[1]
        assert packed.input_ids.shape[0] == 1 and width % ROW_MULTIPLE == 0
        assert packed.num_tokens < width < packed.num_tokens + ROW_MULTIPLE, "this batch's tokens are not a multiple"
        assert packed.bounds.tolist() == sorted({*packed.first[:, 1].tolist(), packed.num_tokens, width})
        assert (packed.input_ids[0, packed.num_tokens:] == pad_id).all()
    else:
        assert 1 < packed.input_ids.shape[0] < 2 * len(data) and packed.input_ids.shape[1] <= 64
        assert packed.bounds is None
    assert packed.attention_mask is None and packed.num_tokens == padded.num_tokens == int(padded.attention_mask.sum())
    assert packed.num_pairs == padded.num_pairs == len(data)
    with torch.no_grad():
        a, b = torch.cat(reward.pair_rewards(model, padded)), torch.cat(reward.pair_rewards(model, packed))
    assert a.std() > 1e-3, "the rewards must tell the texts apart for the comparison to mean anything"
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def tiny_bert_reward_model(tokenizer):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128, num_labels=1, pad_token_id=tokenizer.pad_token_id, initializer_range=0.1))


@pytest.mark.parametrize("pooler", [True, False])
def test_an_encoder_scores_one_packed_row_like_padded_ones(tiny_model, pooler):
    """A BERT-style encoder reads its reward at the pooled first token (`classifier` after `pooler`, or a
    RoBERTa-style `classifier` that reads position 0 itself): packed into one row, its bounds keep the texts'
    (bidirectional) attention apart and the rewards are the padded ones. Rows without bounds would let the texts
    attend to each other, which is why encoders pack into one row only."""
    import torch

    from trainer.engine.attention import use_alignflow_attention
    from trainer.engine.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_model)
    data = packing_data(tokenizer)
    model = tiny_bert_reward_model(tokenizer).eval()
    if not pooler:
        model.bert.pooler = None
        model.classifier = torch.nn.Sequential(torch.nn.Linear(32, 1))
        model.classifier.forward = lambda features: torch.nn.Sequential.forward(model.classifier, features[:, 0])
    use_alignflow_attention(model)
    pad_id, indices = tokenizer.pad_token_id, list(range(len(data)))
    padded = reward.collate(data, indices, pad_id)
    assert padded.attention_mask.min() == 0, "some padding, for the layouts to differ"
    with torch.no_grad():
        if not pooler:  # the model's own forward needs the pooler; score the padded rows through the backbone
            hidden = model.bert(input_ids=padded.input_ids, attention_mask=padded.attention_mask).last_hidden_state
            a = model.classifier(hidden).squeeze(-1)
        else:
            a = torch.cat(reward.pair_rewards(model, padded))
        one_row = torch.cat(reward.pair_rewards(model, reward.collate(data, indices, pad_id, pack_to=64, one_row=True)))
        rows = torch.cat(reward.pair_rewards(model, reward.collate(data, indices, pad_id, pack_to=64)))
    assert a.std() > 1e-3, "the rewards must tell the texts apart for the comparison to mean anything"
    torch.testing.assert_close(one_row, a, atol=1e-5, rtol=1e-4)
    assert (rows - a).abs().max() > 1e-3, "without bounds the packed texts attend to each other"


def test_an_encoders_top_layer_runs_at_the_first_tokens_only(tiny_model, monkeypatch):
    """In one packed row, an encoder's top layer runs its queries, attention output and feed-forward block at the
    2B first tokens only (`encode_first_tokens`), its keys and values over the whole row. In float32 the rewards
    and every parameter's gradient are what the whole row's top layer gives; under bf16 autocast they are as far
    from float32's as the whole row's are (the rounding differs, not the accuracy)."""
    import statistics

    import torch

    from trainer.engine.attention import use_alignflow_attention
    from trainer.engine.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_model)
    data = packing_data(tokenizer)
    model = tiny_bert_reward_model(tokenizer)  # training mode: dropout probabilities are 0.1 here
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # as the stage's `disable_dropout` leaves them, so that both passes draw nothing
    use_alignflow_attention(model)
    batch = reward.collate(data, list(range(len(data))), tokenizer.pad_token_id, pack_to=64, one_row=True)
    rows_seen = []
    model.bert.encoder.layer[-1].intermediate.dense.register_forward_hook(
        lambda module, args, out: rows_seen.append(args[0].shape[-2]))

    def rewards_and_grads(bf16: bool):
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            rewards = torch.cat(reward.pair_rewards(model, batch))
        (rewards * torch.linspace(-1, 1, len(rewards))).sum().backward()
        return rewards.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    top = {bf16: rewards_and_grads(bf16) for bf16 in (False, True)}
    monkeypatch.setattr(reward, "top_layer_runs_apart", lambda backbone: False)  # the whole row's top layer
    whole = {bf16: rewards_and_grads(bf16) for bf16 in (False, True)}
    assert rows_seen == [2 * len(data)] * 2 + [batch.input_ids.shape[1]] * 2
    (exact, exact_grads), (rewards, grads) = whole[False], top[False]
    assert exact.std() > 1e-3, "the rewards must tell the texts apart for the comparison to mean anything"
    torch.testing.assert_close(rewards, exact, atol=1e-5, rtol=1e-4)
    # Key biases get no gradient in exact arithmetic (they shift all of a query's scores alike): only rounding.
    largest = max(float(g.norm()) for g in exact_grads.values())
    compared = [name for name, g in exact_grads.items() if float(g.norm()) > 1e-4 * largest]
    assert top[False][1].keys() == exact_grads.keys() and len(compared) > 30

    def errors(found: dict) -> list[float]:  # each parameter's relative gradient error against float32's
        return [float((found[n] - exact_grads[n]).norm() / exact_grads[n].norm()) for n in compared]

    assert max(errors(grads)) < 1e-4
    top_error, whole_error = statistics.median(errors(top[True][1])), statistics.median(errors(whole[True][1]))
    assert top_error < 1.5 * whole_error + 1e-3, (top_error, whole_error)
    torch.testing.assert_close(top[True][0], exact, atol=3e-2, rtol=3e-2)


def test_padding_free_names_a_model_without_a_reward_head():
    """`packed_parts` needs a causal LM's `score` or an encoder's `classifier`; the stage falls back to padded
    batches on this error, naming the model."""
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                 intermediate_size=8))
    with pytest.raises(reward.ModelError, match="BertModel has neither"):
        reward.packed_parts(model)
