"""Shared-prompt attention: G completions of one prompt scored in one row, the prompt run once.

GRPO scores G completions per prompt. Laid out as usual, [prompt | completion] per row, the
prompt's forward and backward run G times. `share_prompts` lays a group out as one row
[prompt | completion 1 | ... | completion G] with a 4D mask that lets every completion see the
prompt and its own earlier tokens only, and position ids that restart after the prompt in every
block, so each completion's log-probs are those of its usual row up to float rounding.

`shared_prompt_attention` (registered with transformers as `SHARED_ATTENTION`) then computes
attention over such a row block by block instead of over the dense [T, T] mask.

The same implementation serves every stage's training forward on the CPU in half precision
(`use_alignflow_attention`): there torch's fused SDPA kernel is slow in bfloat16, above all in its
backward, so ordinary rows run as dense matmuls (`dense_attention`) while their probabilities fit
`DENSE_PROBS_BUDGET`. Everywhere else (GPUs, float32, no gradients, long rows) it is plain sdpa.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SharedPrompts:
    """Groups of completions that share one prompt, laid out so the prompt is run once per group.

    Row r holds group r as [prompt | completion 1 | ... | completion G]: the (left-padded) prompt,
    then each completion in its own block of the completions' width. A 4D additive mask lets
    every completion see the prompt and its own earlier tokens only, and position ids restart
    after the prompt in every block, so each completion's log-probs are those of the usual
    [prompt, completion] row up to float rounding: the prompt's share of the compute and its
    backward happen once per group instead of G times.
    """

    input_ids: torch.Tensor  # [B/G, P + G*C]
    attention_mask: torch.Tensor  # [B/G, 1, P + G*C, P + G*C] additive (0 = attend)
    position_ids: torch.Tensor  # [B/G, P + G*C]
    target_mask: torch.Tensor  # [B/G, P + G*C] the completion tokens
    sources: torch.Tensor  # [B/G, P + G*C] column whose hidden state predicts each token
    prompt_width: int
    group_size: int

    @property
    def model_kwargs(self) -> dict:
        """Passed to the model's forward: `shared_prompt_attention` reads the layout from them."""
        return {SHARED_LAYOUT_KWARG: (self.prompt_width, self.group_size)}

    def unshare(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Map per-target (rows, cols) of this layout back to the usual [B, P + C] rows: (rows, cols)."""
        offset = cols - self.prompt_width
        width = (self.input_ids.shape[1] - self.prompt_width) // self.group_size
        return rows * self.group_size + offset // width, self.prompt_width + offset % width


def share_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
                  prompt_width: int, group_size: int, dtype: torch.dtype) -> SharedPrompts | None:
    """The `SharedPrompts` layout of B rows [left-padded prompt | right-padded completion] in which
    rows g*G .. g*G+G-1 share a prompt; None when they do not (or B is not a multiple of G)."""
    n, width = input_ids.shape
    G, P, C = group_size, prompt_width, width - prompt_width
    if G < 2 or n % G or not 0 < P < width:
        return None
    prompts = input_ids[:, :P].view(n // G, G, P)
    prompt_att = attention_mask[:, :P].view(n // G, G, P)
    if not (torch.equal(prompts, prompts[:, :1].expand_as(prompts))
            and torch.equal(prompt_att, prompt_att[:, :1].expand_as(prompt_att))):
        return None
    prompt_att = prompt_att[:, 0]  # [B/G, P]
    ids = torch.cat([prompts[:, 0], input_ids[:, P:].reshape(n // G, G * C)], dim=1)
    key_ok = torch.cat([prompt_att, attention_mask[:, P:].reshape(n // G, G * C)], dim=1).bool()
    targets = torch.cat([torch.zeros_like(prompt_att), completion_mask[:, P:].reshape(n // G, G * C)], dim=1)
    device = input_ids.device
    block = torch.cat([torch.full((P,), -1, device=device), torch.arange(G, device=device).repeat_interleave(C)])
    offset = torch.cat([torch.zeros(P, dtype=torch.long, device=device), torch.arange(C, device=device).repeat(G)])
    prompt_len = prompt_att.sum(1, keepdim=True)  # [B/G, 1]
    positions = torch.cat([(prompt_att.cumsum(1) - 1).clamp(min=0), prompt_len + offset[P:]], dim=1)
    col = torch.arange(P + G * C, device=device)
    sources = torch.where((block >= 0) & (offset == 0), P - 1, col - 1).expand(n // G, -1)
    # query q may see key k: k <= q, k in the prompt or in q's own block, k not padding (and itself).
    visible = (col[None, :] <= col[:, None]) & ((block[None, :] < 0) | (block[None, :] == block[:, None]))
    allowed = (visible[None] & key_ok[:, None, :]) | torch.eye(P + G * C, dtype=torch.bool, device=device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return SharedPrompts(ids, mask[:, None], positions, targets, sources, P, G)


# The attention implementation (transformers' AttentionInterface) that runs shared-prompt rows
# block by block instead of over the dense [T, T] mask, and the forward kwarg that carries the layout.
SHARED_ATTENTION = "alignflow_shared_prompt"
SHARED_LAYOUT_KWARG = "shared_prompt_layout"
# The forward kwarg that marks a single row of packed sequences: their cumulative lengths [S + 1] (transformers'
# name for it, which its flash-attention kernels read too). `shared_prompt_attention` then runs each sequence as
# a row of a padded batch (`per_sequence_attention`).
PACKED_BOUNDS_KWARG = "cu_seq_lens_q"
PACKED_LONGEST_KWARG = "max_length_q"  # and the longest sequence's length, a Python int (transformers' name too)


def packed_row_kwargs(bounds: torch.Tensor) -> dict:
    """The forward kwargs of one row of packed sequences whose cumulative lengths are `bounds` [S + 1]: the bounds,
    and the longest sequence's length as a Python int (so that a compiled layer needs no graph break to read it)."""
    return {PACKED_BOUNDS_KWARG: bounds, PACKED_LONGEST_KWARG: int(bounds.diff().max())}


def shared_prompt_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs):
    """Attention over a `SharedPrompts` row in blocks: the prompt attends to itself, and each
    completion block to the prompt and to itself, so the attention costs P^2 + G*C*(P + C)
    instead of (P + G*C)^2; the blocks of the 4D mask outside these are never read (the mask
    hides them anyway). With `PACKED_BOUNDS_KWARG` instead (one row of packed sequences), each sequence runs as
    a row of a padded batch (`per_sequence_attention`). Without either (generation, other stages) it is plain sdpa.

    On CPU in bfloat16/float16 it runs as explicit matmuls (`_matmul_attention`): there torch's
    fused SDPA kernel takes 2-3x longer at these sizes, mostly in its backward. Rows without the layout
    take `dense_attention` there while gradients are recorded (training forwards), else plain sdpa.

    query [B, H, T, D], key/value [B, H_kv, T, D] -> ([B, T, H, D], None) as transformers expects.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = kwargs.pop(SHARED_LAYOUT_KWARG, None)
    bounds = kwargs.pop(PACKED_BOUNDS_KWARG, None)
    longest = kwargs.pop(PACKED_LONGEST_KWARG, None)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if bounds is not None and layout is None and query.shape[0] == 1 and query.shape[2] == key.shape[2]:
        return per_sequence_attention(module, query, key, value, bounds, dropout, scaling, longest), None
    dtype = _cpu_half_dtype(query)
    if layout is None and dtype is not None and torch.is_grad_enabled() and query.shape[2] == key.shape[2] \
            and (attention_mask is None or attention_mask.dim() == 4):
        out = dense_attention(module, query.to(dtype), key.to(dtype), value.to(dtype), attention_mask, dropout,
                              scaling, kwargs.get("is_causal"))
        if out is not None:
            return out, None
    if layout is None or attention_mask is None or attention_mask.dim() != 4 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    P, G = layout
    if dtype is not None:
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        out = _matmul_attention(query, key, value, _additive(attention_mask, dtype), dropout, scaling, P, G)
    else:
        out = _sdpa_blocks(query, key, value, attention_mask, dropout, scaling, P, G)
    return out.transpose(1, 2).contiguous(), None


def _cpu_half_dtype(query: torch.Tensor) -> torch.dtype | None:
    """bfloat16/float16 when attention on CPU computes in it (inputs or autocast); else None.

    Under autocast, rotary embeddings leave query and key in float32 (autocast then casts SDPA's
    inputs), so the inputs' dtype alone does not tell.
    """
    if query.device.type != "cpu":
        return None
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean (True = attend) or additive mask as an additive mask of `dtype`."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


def _completion_masks(mask: torch.Tensor, P: int, G: int, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The completions' blocks of a shared-prompt mask [B, T, T]: to the prompt [B, G, C, P] and
    each completion to itself [B, G, C, C]; the entries between completions are never read."""
    rows = mask[:, P:]  # [B, G*C, T]: the completions' queries
    to_prompt = rows[:, :, :P].unflatten(1, (G, C))
    to_own = rows[:, :, P:].unflatten(1, (G, C)).unflatten(3, (G, C)).diagonal(dim1=1, dim2=3)  # [B, C, C, G]
    return to_prompt, to_own.permute(0, 3, 1, 2)


def _sdpa_blocks(query, key, value, mask, dropout: float, scaling: float, P: int, G: int) -> torch.Tensor:
    """`shared_prompt_attention` with torch's SDPA per block: [B, H, T, D]."""
    from transformers.integrations.sdpa_attention import repeat_kv

    B, H, T, D = query.shape
    C = (T - P) // G
    groups = H // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    mask = mask.to(query.dtype) if mask.is_floating_point() else mask
    prompt = F.scaled_dot_product_attention(query[:, :, :P], key[:, :, :P], value[:, :, :P], attn_mask=mask[:, :, :P, :P],
                                            dropout_p=dropout, scale=scaling)  # [B, H, P, D]

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [B, H, G*C, D] -> [B*G, H, C, D]
        return x.unflatten(2, (G, C)).transpose(1, 2).reshape(B * G, H, C, D)

    def with_prompt(x: torch.Tensor) -> torch.Tensor:  # keys/values: [B*G, H, P + C, D]
        shared = x[:, :, :P].unsqueeze(1).expand(B, G, H, P, D).reshape(B * G, H, P, D)
        return torch.cat([shared, blocks(x[:, :, P:])], dim=2)

    block_mask = torch.cat(_completion_masks(mask[:, 0], P, G, C), dim=-1).reshape(B * G, 1, C, P + C)
    completions = F.scaled_dot_product_attention(blocks(query[:, :, P:]), with_prompt(key), with_prompt(value),
                                                 attn_mask=block_mask, dropout_p=dropout, scale=scaling)
    completions = completions.reshape(B, G, H, C, D).transpose(1, 2).reshape(B, H, G * C, D)
    return torch.cat([prompt, completions], dim=2)


def _matmul_attention(query, key, value, mask, dropout: float, scaling: float, P: int, G: int) -> torch.Tensor:
    """`shared_prompt_attention` as batched matmuls, softmax in the inputs' dtype: [B, H, T, D].

    The g = H / H_kv query heads that share a key/value head are stacked as rows of one matmul,
    so keys and values are never repeated. Short rows run densely under the mask (fewer, larger
    matmuls win while the dense scores are under 3x the blocks'); longer ones in blocks.
    """
    B, H, T, D = query.shape
    Hkv = key.shape[1]
    g, C = H // Hkv, (T - P) // G

    def probs(scores: torch.Tensor) -> torch.Tensor:
        p = scores.softmax(-1)
        return F.dropout(p, dropout) if dropout > 0 else p

    q = query * scaling
    if T * T <= 3 * (P * P + G * C * (P + C)):
        scores = (q.reshape(B, Hkv, g * T, D) @ key.mT).view(B, Hkv, g, T, T) + mask[:, :, None]
        return (probs(scores).view(B, Hkv, g * T, T) @ value).view(B, H, T, D)
    m = mask[:, 0]  # [B, T, T]
    kp, vp = key[:, :, :P], value[:, :, :P]
    scores = (q[:, :, :P].reshape(B, Hkv, g * P, D) @ kp.mT).view(B, Hkv, g, P, P) + m[:, None, None, :P, :P]
    prompt = (probs(scores).view(B, Hkv, g * P, P) @ vp).view(B, H, P, D)
    qc = q[:, :, P:].reshape(B, Hkv, g, G, C, D)
    kc, vc = key[:, :, P:].unflatten(2, (G, C)), value[:, :, P:].unflatten(2, (G, C))  # [B, Hkv, G, C, D]
    prompt_mask, own_mask = _completion_masks(m, P, G, C)
    to_prompt = (qc.reshape(B, Hkv, g * G * C, D) @ kp.mT).view(B, Hkv, g, G, C, P) + prompt_mask[:, None, None]
    to_own = (qc.transpose(2, 3).reshape(B, Hkv, G, g * C, D) @ kc.mT).view(B, Hkv, G, g, C, C).transpose(2, 3) \
        + own_mask[:, None, None]
    p = probs(torch.cat([to_prompt, to_own], dim=-1))  # [B, Hkv, g, G, C, P + C]
    from_prompt = (p[..., :P].reshape(B, Hkv, g * G * C, P) @ vp).view(B, Hkv, g, G, C, D)
    from_own = (p[..., P:].transpose(2, 3).reshape(B, Hkv, G, g * C, C) @ vc).view(B, Hkv, G, g, C, D)
    completions = (from_prompt + from_own.transpose(2, 3)).reshape(B, H, G * C, D)
    return torch.cat([prompt, completions], dim=2)


# Training forwards keep the probabilities of `dense_attention` for the backward: at most this many bytes for all of
# a model's layers together (beyond it, sdpa's kernel, which keeps none). Measured on this CPU in bfloat16, forward
# and backward of one layer: [4, 9 heads, 256, 256] 25 ms against sdpa's 38; MiniLM's [16, 12, 128, 128] 21 against
# 70; [4, 9, 1024, 1024] 380 against 408, where the kept probabilities would take 75 MB per layer.
DENSE_PROBS_BUDGET = 512 * 2**20


def dense_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float, scaling: float,
                    is_causal: bool | None = None) -> torch.Tensor | None:
    """Attention over ordinary rows as `_matmul_attention`'s dense matmuls: query [B, H, T, D], key/value
    [B, H_kv, T, D], `attention_mask` boolean (True = attend) or additive [B, 1, T, T], or None (causal when the
    module is, as transformers' sdpa decides) -> [B, T, H, D]. None when the probabilities that autograd keeps
    for the backward would exceed `DENSE_PROBS_BUDGET` over the model's layers."""
    B, H, T, D = query.shape
    layers = getattr(getattr(module, "config", None), "num_hidden_layers", 1) or 1
    if B * H * T * T * query.element_size() * layers > DENSE_PROBS_BUDGET:
        return None
    if attention_mask is not None:
        mask = _additive(attention_mask, query.dtype)
    else:
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        allowed = torch.ones(T, T, dtype=torch.bool, device=query.device)
        mask = _additive(allowed.tril() if causal else allowed, query.dtype)[None, None]
    return _matmul_attention(query, key, value, mask, dropout, scaling, P=T, G=1).transpose(1, 2).contiguous()


def per_sequence_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           bounds: torch.Tensor, dropout: float, scaling: float,
                           longest: int | None = None) -> torch.Tensor:
    """Attention within each of the S sequences packed into one row, run as a padded batch of S rows (causal
    unless `module.is_causal` is False, as in BERT-style encoders):
    query [1, H, N, D], key/value [1, H_kv, N, D], `bounds` [S + 1] the sequences' cumulative lengths, `longest`
    the longest one's length when the caller knows it (read from `bounds` otherwise, a graph break when compiled)
    -> [1, N, H, D]. The same attention as the row's block-diagonal mask gives, at the cost of S rows of the
    longest sequence's width instead of one of all N: in one packed row the linears skip the padding, and the
    attention costs what a padded batch's does. Dense matmuls on the CPU in half precision with gradients
    (`dense_attention`), else sdpa."""
    N = query.shape[2]
    lengths = bounds.diff()
    S, T = len(lengths), int(longest) if longest is not None else int(lengths.max())
    col = torch.arange(T, device=query.device)
    real = col[None] < lengths[:, None]  # [S, T]
    index = (bounds[:-1, None] + col[None]).clamp(max=N - 1).flatten()  # row position of each padded slot
    tokens = torch.arange(N, device=query.device)
    sequence = torch.searchsorted(bounds[1:], tokens, right=True)  # [N]: the sequence of each row position
    back = sequence * T + tokens - bounds[sequence]  # [N]: its padded slot
    dtype = _cpu_half_dtype(query)

    def padded(x: torch.Tensor) -> torch.Tensor:  # [1, h, N, D] -> [S, h, T, D]
        x = x[0] if dtype is None else x[0].to(dtype)
        return x.index_select(1, index).unflatten(1, (S, T)).transpose(0, 1)

    q, k, v = padded(query), padded(key), padded(value)
    allowed = torch.ones(T, T, dtype=torch.bool, device=query.device)
    allowed = ((allowed.tril() if getattr(module, "is_causal", True) else allowed)[None] & real[:, None, :])[:, None]
    grad = dtype is not None and torch.is_grad_enabled()
    out = dense_attention(module, q, k, v, allowed, dropout, scaling) if grad else None
    if out is None:
        from transformers.integrations.sdpa_attention import repeat_kv

        groups = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=allowed,
                                             dropout_p=dropout, scale=scaling).transpose(1, 2)  # [S, T, H, D]
    return out.reshape(S * T, *out.shape[2:]).index_select(0, back)[None]


def attention_at(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, at: torch.Tensor,
                 bounds: torch.Tensor, dropout: float, scaling: float) -> torch.Tensor:
    """Bidirectional attention of the queries at row positions `at` [S] over the keys of their own sequence in one
    packed row (`bounds` [S' + 1], its sequences' cumulative lengths): query [1, H, S, D], key/value [1, H, N, D]
    -> [1, S, H, D]. What `per_sequence_attention` gives an encoder (`is_causal` False) at those positions, for S
    queries instead of N. In the CPU's half precision when autocast or the inputs ask for it, as there."""
    def sequence(positions: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(bounds[1:], positions.contiguous(), right=True)

    allowed = sequence(at)[:, None] == sequence(torch.arange(key.shape[2], device=key.device))[None]  # [S, N]
    if (dtype := _cpu_half_dtype(query)) is not None:
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed[None, None], dropout_p=dropout,
                                          scale=scaling).transpose(1, 2)


def register_shared_attention() -> str:
    """Make `SHARED_ATTENTION` a transformers attention implementation (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SHARED_ATTENTION, shared_prompt_attention)
    AttentionMaskInterface.register(SHARED_ATTENTION, sdpa_mask)
    return SHARED_ATTENTION


def use_alignflow_attention(model) -> None:
    """Run `model`'s attention through `shared_prompt_attention` (registered as `SHARED_ATTENTION`) when it
    runs sdpa: shared-prompt rows in blocks, training forwards on the CPU in half precision as
    `dense_attention`, and everything else as the same sdpa as before. Other implementations (eager,
    flash, a remote model's own) are left as they are."""
    from trainer.engine.distributed import unwrap

    if model is not None and (getattr(unwrap(model).config, "_attn_implementation", None) or "sdpa") == "sdpa":
        model.set_attn_implementation(register_shared_attention())
