"""The blockwise target log-softmax against whole-tensor torch ops."""

import pytest
import torch
import torch.nn.functional as F

from trainer.algorithms import logprobs
from trainer.algorithms.logprobs import log_probs_and_stats, selective_log_softmax


def whole_tensor(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """What the stages computed before the blockwise version: float32 copy, log-sum-exp, gather."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    logps = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)
    with torch.no_grad():
        logp = F.log_softmax(logits.float() / temperature, dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
    return logps, ent


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_gradients_match_whole_tensor_ops_in_blocks(monkeypatch, dtype, temperature):
    monkeypatch.setattr(logprobs, "_block_rows", lambda logits: 3)  # 10 rows: blocks of 3, 3, 3 and 1
    torch.manual_seed(0)
    start = (torch.randn(10, 257) * 4).to(dtype)
    targets = torch.randint(0, 257, (10,))
    weights = torch.randn(10)
    ours, theirs = start.clone().requires_grad_(), start.clone().requires_grad_()
    logps, row = log_probs_and_stats(ours, targets, ("entropy",), temperature)
    ent = row["entropy"]
    (logps * weights).sum().backward()
    ref_logps, ref_ent = whole_tensor(theirs, targets, temperature)
    (ref_logps * weights).sum().backward()
    assert logps.dtype == torch.float32 and not ent.requires_grad
    assert torch.equal(logps, ref_logps)
    assert torch.equal(ours.grad, theirs.grad)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours.detach(), start), "the logits are not changed in place"
    assert torch.equal(selective_log_softmax(start, targets, temperature), ref_logps.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_and_mean_match_whole_tensor_ops_ties_included(monkeypatch, dtype):
    """SFT's token accuracy and DPO's logits/* come from the blocks: the same values as the whole-tensor ops."""
    monkeypatch.setattr(logprobs, "_block_rows", lambda logits: 3)
    torch.manual_seed(1)
    logits = torch.randint(-3, 4, (10, 64)).to(dtype)  # few distinct values: every row's maximum is tied
    logits[0] = torch.randn(64).to(dtype)
    targets = logits.argmax(-1).roll(1)
    targets[1] = logits[1].eq(logits[1].max()).nonzero()[-1, 0]  # a maximum that is not the first one
    logps, row = log_probs_and_stats(logits.requires_grad_(), targets, ("argmax", "mean", "entropy"))
    assert torch.equal(row["argmax"], logits.detach().argmax(-1))
    assert row["argmax"][1] != targets[1], "a tie before the target is a miss, as with torch.argmax"
    assert torch.equal(row["mean"], logits.detach().float().mean(-1))
    assert torch.equal(logps, whole_tensor(logits.detach(), targets, 1.0)[0])
    assert not any(value.requires_grad for value in row.values())
    with pytest.raises(ValueError, match="unknown row statistics \\['top1'\\]"):
        log_probs_and_stats(logits, targets, ("top1",))


def test_without_gradients_and_without_targets():
    logits, targets = torch.randn(4, 33), torch.randint(0, 33, (4,))
    with torch.inference_mode():
        logps = selective_log_softmax(logits, targets)
    torch.testing.assert_close(logps, F.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1))
    empty = torch.zeros(0, 33, requires_grad=True)
    logps, row = log_probs_and_stats(empty, torch.zeros(0, dtype=torch.long), ("entropy",))
    ent = row["entropy"]
    assert logps.shape == ent.shape == (0,)
    logps.sum().backward()
    assert empty.grad.shape == (0, 33)
