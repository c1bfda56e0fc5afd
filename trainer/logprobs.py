"""Log-probabilities of target tokens: the one place every stage gathers them.

The language-model head is applied only at positions whose next token is a target (completion
tokens, assistant turns), not to prompts and padding. With vocabularies of 50k-150k tokens the
head and the softmax dominate small models' cost, so this is where SFT, DPO and GRPO save most.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TargetLogits:
    """Logits at the positions that predict a target token, flattened over the batch."""

    logits: torch.Tensor  # [N, V] where N = number of target tokens in the batch
    targets: torch.Tensor  # [N] token ids being predicted
    rows: torch.Tensor  # [N] batch row of each target
    cols: torch.Tensor  # [N] position of each target token in its row


def _causal_lm_parts(model):
    """(decoder, lm_head) of a causal LM, through a PEFT wrapper; None when the head is not a plain linear map."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = lm.config
    # Models that post-process logits (soft-capping, scaling) need the full forward.
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    decoder = getattr(lm, getattr(lm, "base_model_prefix", "model"), None)
    head = lm.get_output_embeddings()
    if decoder is None or head is None or decoder is lm:
        return None
    return decoder, head


def target_logits(model, input_ids: torch.Tensor, target_mask: torch.Tensor,
                  attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None) -> TargetLogits:
    """Logits for every token marked in `target_mask` [B, T], predicted from the token before it.

    A target at position t is predicted by the hidden state at t - 1, so position 0 can never
    be a target. Packed rows pass `position_ids` (restarting at 0 per example) and no
    attention mask; transformers then builds a block-diagonal causal mask.
    """
    mask = target_mask.bool().clone()
    mask[:, 0] = False
    rows, cols = mask.nonzero(as_tuple=True)  # [N], [N]
    parts = _causal_lm_parts(model)
    if parts is None:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        logits = out.logits[rows, cols - 1]
    else:
        decoder, head = parts
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False).last_hidden_state  # [B, T, H]
        logits = head(hidden[rows, cols - 1])  # [N, V]
    return TargetLogits(logits=logits, targets=input_ids[rows, cols], rows=rows, cols=cols)


def selective_log_softmax(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per row without materialising the full log-softmax. [N, V], [N] -> [N]"""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each row's softmax. [N, V] -> [N]"""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def sequence_sums(values: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Sum per-target values into their batch rows. [N] -> [B]"""
    return torch.zeros(num_rows, dtype=values.dtype, device=values.device).index_add(0, rows, values)


def to_padded(values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Scatter per-target values back into a [B, T] tensor (zeros elsewhere)."""
    out = torch.zeros(shape, dtype=values.dtype, device=values.device)
    return out.index_put((rows, cols), values)
