"""Shared-prompt attention (trainer/engine/attention.py): the same log-probs and gradients as plain attention, at less cost."""

from types import SimpleNamespace

import pytest
import torch

from trainer.engine.attention import (
    DENSE_PROBS_BUDGET,
    PACKED_BOUNDS_KWARG,
    SHARED_ATTENTION,
    dense_attention,
    per_sequence_attention,
    register_shared_attention,
    share_prompts,
    shared_prompt_attention,
    use_alignflow_attention,
)
from trainer.engine.completions import build_batch, token_logps
from trainer.engine.models import load_causal_lm
from trainer.rollout.base import Completion


@pytest.mark.parametrize("attention", ["sdpa", "eager", SHARED_ATTENTION])
def test_shared_prompt_rows_give_the_same_logps_and_gradients(tiny_model, attention):
    """Running each group's prompt once (block attention mask, dense or in blocks) changes nothing but the cost."""
    model = load_causal_lm(tiny_model, "float32")
    model.set_attn_implementation(register_shared_attention() if attention == SHARED_ATTENTION else attention)
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(5, model.config.vocab_size, (n,), generator=gen).tolist()

    lengths = [(9, 3, 9, 0), (5, 9, 1, 9)]  # ragged completions, one empty
    completions = [[Completion(ids(n), [0.0] * n, "length") for n in group] for group in lengths]
    batch = build_batch([ids(23), ids(11)], completions, pad_id=0)  # prompts of different lengths
    results = []
    for group_size in (0, 4):
        model.zero_grad()
        logps, ent = token_logps(model, batch, slice(0, 8), with_entropy=True, group_size=group_size)
        (logps * torch.linspace(-1, 1, logps.shape[1])).sum().backward()
        results.append((logps.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, plain_ent, plain_grads), (shared, shared_ent, shared_grads) = results
    assert torch.equal(shared != 0, batch.completion_mask.bool())
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)
    assert shared_ent == pytest.approx(plain_ent, abs=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # Rows whose prompts differ inside a group are not shared.
    assert share_prompts(batch.input_ids, batch.attention_mask, batch.completion_mask, batch.prompt_width, 8,
                         torch.float32) is None


def test_block_attention_reads_only_the_prompt_and_own_blocks():
    """`shared_prompt_attention` equals dense sdpa under the shared-prompt mask, and never reads the
    mask between completion blocks (so it really computes block by block), with GQA heads."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv

    gen = torch.Generator().manual_seed(0)
    P, G, C, H, Hkv, D = 5, 3, 4, 4, 2, 8
    ids = torch.arange(2 * G * (P + C)).view(2 * G, P + C) % 7
    ids[:, :P] = ids[::G, :P].repeat_interleave(G, 0)
    attention_mask = torch.ones_like(ids)
    attention_mask[G:, 0] = 0  # the second group's prompt is one token shorter (left padding)
    attention_mask[1, -1] = 0  # a completion ending early
    shared = share_prompts(ids, attention_mask, attention_mask.clone(), P, G, torch.float32)
    T = P + G * C
    q = torch.randn(2, H, T, D, generator=gen)
    k, v = torch.randn(2, Hkv, T, D, generator=gen), torch.randn(2, Hkv, T, D, generator=gen)
    module = torch.nn.Module()
    module.num_key_value_groups = H // Hkv
    out, _ = shared_prompt_attention(module, q, k, v, shared.attention_mask, scaling=D ** -0.5, **shared.model_kwargs)
    dense = F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=shared.attention_mask,
                                           scale=D ** -0.5).transpose(1, 2)
    torch.testing.assert_close(out, dense, atol=1e-6, rtol=1e-5)
    leaky = shared.attention_mask.clone()
    block = torch.arange(G * C) // C
    leaky[:, :, P:, P:] = torch.where(block[:, None] == block[None, :], leaky[:, :, P:, P:],
                                      torch.zeros(()))  # open every entry between different completions
    again, _ = shared_prompt_attention(module, q, k, v, leaky, scaling=D ** -0.5, **shared.model_kwargs)
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    plain, _ = shared_prompt_attention(module, q, k, v, leaky, scaling=D ** -0.5)  # no layout: dense sdpa
    assert not torch.allclose(plain, out, atol=1e-3)


@pytest.mark.parametrize("P, G, C, blocks", [(5, 3, 4, False), (4, 4, 8, True)])
def test_half_precision_block_attention_on_cpu(P, G, C, blocks):
    """In bfloat16 on CPU `shared_prompt_attention` runs as matmuls (dense under the mask for short
    rows, else in blocks): output and gradients equal float64 attention within bf16 rounding, and
    float32 inputs under autocast take the same bf16 path."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv

    gen = torch.Generator().manual_seed(0)
    H, Hkv, D = 6, 2, 16
    ids = torch.arange(2 * G * (P + C)).view(2 * G, P + C) % 7
    ids[:, :P] = ids[::G, :P].repeat_interleave(G, 0)
    attention_mask = torch.ones_like(ids)
    attention_mask[G:, 0] = 0  # left padding in the second group's prompt
    attention_mask[1, -2:] = 0  # a completion ending early
    shared = share_prompts(ids, attention_mask, attention_mask.clone(), P, G, torch.float32)
    T = P + G * C
    q = torch.randn(2, H, T, D, generator=gen)
    k, v = torch.randn(2, Hkv, T, D, generator=gen), torch.randn(2, Hkv, T, D, generator=gen)
    weights = torch.randn(2, T, H, D, generator=gen)
    module = torch.nn.Module()
    module.num_key_value_groups = H // Hkv

    def attend(mask, *inputs):
        out, _ = shared_prompt_attention(module, *inputs, mask, scaling=D ** -0.5, **shared.model_kwargs)
        grads = torch.autograd.grad((out.float() * weights).sum(), inputs)
        return out, grads

    half = [x.bfloat16().requires_grad_() for x in (q, k, v)]
    out, grads = attend(shared.attention_mask, *half)
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(exact[0], repeat_kv(exact[1], 3), repeat_kv(exact[2], 3),
                                         attn_mask=shared.attention_mask.double(), scale=D ** -0.5).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref * weights.double()).sum(), exact)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=0)
    for grad, expected in zip(grads, ref_grads):
        assert grad.dtype == torch.bfloat16
        assert (grad.double() - expected).abs().max() <= 3e-2 * expected.abs().max()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_out, _ = attend(shared.attention_mask, *(x.clone().requires_grad_() for x in (q, k, v)))
    assert torch.equal(autocast_out, out)
    if blocks:  # mask entries between different completions are never read
        leaky = shared.attention_mask.clone()
        block = torch.arange(G * C) // C
        leaky[:, :, P:, P:] = torch.where(block[:, None] == block[None, :], leaky[:, :, P:, P:], torch.zeros(()))
        assert torch.equal(attend(leaky, *half)[0], out)


@pytest.mark.parametrize("mask_kind", ["padding", "causal", "bidirectional"])
def test_dense_attention_in_bfloat16_matches_float64_attention(mask_kind):
    """`dense_attention` (GQA heads, a boolean padding mask, or none: causal or not as the module says) gives
    float64 attention's output and gradients within bf16 rounding, in bf16."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv

    gen = torch.Generator().manual_seed(0)
    B, H, Hkv, T, D = 2, 6, 2, 17, 16
    q, weights = torch.randn(B, H, T, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
    k, v = torch.randn(B, Hkv, T, D, generator=gen), torch.randn(B, Hkv, T, D, generator=gen)
    mask = None
    if mask_kind == "padding":  # causal, the second row left-padded by 3
        mask = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
        mask[1, :, :, :3] = False
        mask[1, :, :3, :3] = torch.eye(3, dtype=torch.bool)
    module = torch.nn.Module()
    module.is_causal = mask_kind != "bidirectional"
    half = [x.bfloat16().requires_grad_() for x in (q, k, v)]
    out = dense_attention(module, *half, mask, 0.0, D ** -0.5)
    grads = torch.autograd.grad((out.float() * weights).sum(), half)
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(exact[0], repeat_kv(exact[1], 3), repeat_kv(exact[2], 3), attn_mask=mask,
                                         is_causal=mask_kind == "causal", scale=D ** -0.5).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref * weights.double()).sum(), exact)
    assert out.dtype == torch.bfloat16 and out.shape == (B, T, H, D)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=0)
    for grad, expected in zip(grads, ref_grads):
        assert (grad.double() - expected).abs().max() <= 3e-2 * expected.abs().max()
    module.config = SimpleNamespace(num_hidden_layers=DENSE_PROBS_BUDGET // (B * H * T * T * 2) + 1)
    assert dense_attention(module, *half, mask, 0.0, D ** -0.5) is None  # too many probabilities to keep: sdpa


def test_training_forwards_on_cpu_in_bfloat16_run_dense_attention(tiny_model):
    """With `use_alignflow_attention`, a bf16-autocast training forward takes the matmul path (same
    numbers as sdpa within bf16 rounding, not the same kernel); without gradients it is sdpa itself."""
    model = load_causal_lm(tiny_model, "float32")
    ids = torch.randint(5, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :4] = 0

    def hidden(grad: bool) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
            return model.model(input_ids=ids, attention_mask=attention_mask).last_hidden_state.float().detach()

    sdpa = hidden(True), hidden(False)
    use_alignflow_attention(model)
    assert model.config._attn_implementation == SHARED_ATTENTION
    trained, scored = hidden(True), hidden(False)
    keep = attention_mask.bool()
    assert torch.equal(scored, sdpa[1])
    assert not torch.equal(trained[keep], sdpa[0][keep])
    torch.testing.assert_close(trained[keep], sdpa[0][keep], atol=5e-2 * float(sdpa[0].abs().max()), rtol=0)


@pytest.mark.parametrize("longest", [None, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_sequence_attention_is_the_block_diagonal_attention_of_the_row(dtype, longest):
    """One row of packed sequences run as a padded batch (sdpa in float32; dense matmuls in bf16 with gradients):
    the output and gradients of causal attention under the row's block-diagonal mask, with GQA heads; the longest
    length read from the bounds or given (as a compiled model gets it, `PACKED_LONGEST_KWARG`)."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv

    gen = torch.Generator().manual_seed(0)
    lengths, H, Hkv, D = [5, 1, 9, 3], 6, 2, 8
    N = sum(lengths)
    q, weights = torch.randn(1, H, N, D, generator=gen), torch.randn(1, N, H, D, generator=gen)
    k, v = torch.randn(1, Hkv, N, D, generator=gen), torch.randn(1, Hkv, N, D, generator=gen)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    block = (seq[:, None] == seq[None, :]) & torch.ones(N, N, dtype=torch.bool).tril()
    bounds = torch.tensor([0, 5, 6, 15, 18])
    module = torch.nn.Module()
    ours = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out = per_sequence_attention(module, *ours, bounds, 0.0, D ** -0.5, longest)
    grads = torch.autograd.grad((out.float() * weights).sum(), ours)
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(exact[0], repeat_kv(exact[1], 3), repeat_kv(exact[2], 3),
                                         attn_mask=block[None, None], scale=D ** -0.5).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref * weights.double()).sum(), exact)
    assert out.shape == (1, N, H, D) and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=tolerance, rtol=0)
    for grad, expected in zip(grads, ref_grads):
        assert (grad.double() - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("autocast", [False, True])
def test_a_packed_row_with_bounds_gives_each_example_its_own_hidden_states(tiny_model, autocast, monkeypatch):
    """A model with `use_alignflow_attention`, given one packed row, restarting position ids and the bounds kwarg,
    runs `per_sequence_attention` in every layer and gives each example the hidden states it gets in a row of its
    own (float32; bf16 autocast with gradients)."""
    from trainer.engine import attention

    calls = []
    monkeypatch.setattr(attention, "per_sequence_attention",
                        lambda *args: calls.append(args[4].tolist()) or per_sequence_attention(*args))
    model = load_causal_lm(tiny_model, "float32")
    use_alignflow_attention(model)
    gen = torch.Generator().manual_seed(0)
    examples = [torch.randint(5, model.config.vocab_size, (n,), generator=gen) for n in (7, 3, 12)]
    bounds = torch.tensor([0, 7, 10, 22])
    row = torch.cat(examples)[None]
    positions = torch.cat([torch.arange(len(e)) for e in examples])[None]

    def hidden(ids, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model.model(input_ids=ids, use_cache=False, **kwargs).last_hidden_state.float().detach()[0]

    packed = hidden(row, position_ids=positions, **{PACKED_BOUNDS_KWARG: bounds})
    assert calls == [bounds.tolist()] * model.config.num_hidden_layers
    alone = torch.cat([hidden(e[None]) for e in examples])
    scale = float(alone.abs().max())
    torch.testing.assert_close(packed, alone, atol=(5e-2 if autocast else 1e-5) * scale, rtol=0)
    leaky = hidden(row)  # no restarting positions, no bounds: the examples attend to each other
    assert (leaky[7:] - alone[7:]).abs().max() > 0.1 * scale
