"""The trainer scores completions under the distribution they were sampled from: softmax(logits / T).

TRL's GRPO divides the logits by `temperature` for the policy, old-policy and reference log-probs and the
entropy; its PPOTrainer divides policy and reference logits by `temperature + 1e-7`, not the values. The
expected numbers here come from one plain forward pass per completion (`tests.helpers.forward_logprobs`)
and from the hf engine's own sampling log-probs, never from the code under test.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import forward_logprobs, perturb
from trainer.algorithms.logprobs import logit_temperature
from trainer.engine.completions import build_batch, token_logps
from trainer.engine.models import load_causal_lm
from trainer.rollout import SamplingConfig
from trainer.rollout.hf import HFEngine
from trainer.stages.evaluate import mean_kl
from trainer.stages.rl.ppo import PolicyWithValue, make_value_head, policy_forward

T = 0.5
G = 4


@pytest.fixture(scope="module")
def policy(tiny_model):
    from transformers import AutoTokenizer

    model = load_causal_lm(tiny_model, "float32")
    perturb(model, seed=0)  # a random-init tiny model only repeats its last token
    return model.eval(), AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def sampled(policy):
    """G completions at T = 0.5 for two prompts of different lengths, from the hf engine."""
    model, tokenizer = policy
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 13)]
    completions = HFEngine(model, tokenizer).generate(prompts, SamplingConfig(max_new_tokens=10, temperature=T, n=G,
                                                                              seed=7))
    return prompts, completions, build_batch(prompts, completions, pad_id=0)


def _at_completions(logps: torch.Tensor, batch) -> list[torch.Tensor]:
    """Each row's values at its completion tokens, [L_i]."""
    return [row[mask.bool()] for row, mask in zip(logps, batch.completion_mask)]


def test_logit_temperature_is_the_sampling_temperature_and_one_when_greedy():
    assert logit_temperature(0.5) == 0.5 and logit_temperature(1.3) == 1.3
    assert logit_temperature(0.0) == 1.0


@pytest.mark.parametrize("group_size", [0, G])
def test_token_logps_are_the_tempered_log_softmax_at_the_sampled_ids(policy, sampled, group_size):
    """At T = 0.5: log_softmax(logits / T) at each sampled id (one plain forward per completion), and the
    hf engine's sampling log-probs, so that exp(trainer − engine), the first-iteration ratio, is 1."""
    model, _ = policy
    prompts, completions, batch = sampled
    with torch.no_grad():
        logps, ent = token_logps(model, batch, slice(0, len(batch.input_ids)), with_entropy=True,
                                 group_size=group_size, temperature=T)
        plain, _ = token_logps(model, batch, slice(0, len(batch.input_ids)), group_size=group_size)
    rows = [(p, c) for p, group in zip(prompts, completions) for c in group]
    got = _at_completions(logps, batch)
    assert sum(len(c.token_ids) for _, c in rows) > 20
    for (prompt, c), mine in zip(rows, got, strict=True):
        expected = forward_logprobs(model, prompt, c.token_ids, temperature=T)
        torch.testing.assert_close(mine, expected, atol=1e-4, rtol=0)
        engine = torch.tensor(c.logprobs)
        torch.testing.assert_close(mine, engine, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.exp(mine - engine), torch.ones_like(engine), atol=1e-4, rtol=0)
    # The untempered log-probs are another distribution: the check above could fail.
    gap = max(float((p - torch.tensor(c.logprobs)).abs().max()) for (_, c), p in zip(rows, _at_completions(plain, batch)))
    assert gap > 0.1, gap

    # Entropy of softmax(logits / T), averaged over the completion tokens.
    entropies = []
    for prompt, c in rows:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1].float() / T
        logp = F.log_softmax(logits, dim=-1)
        entropies.append(-(logp.exp() * logp).sum(-1))
    assert ent == pytest.approx(float(torch.cat(entropies).mean()), abs=1e-4)


def test_ppo_policy_log_probs_are_tempered_and_its_values_are_not(policy, sampled):
    """PPO's policy forward (log-probs and value head in one pass) at T: the tempered log-probs of the
    completion columns, and the same values as at T = 1 (TRL tempers the policy and reference, not V)."""
    model, _ = policy
    _, completions, batch = sampled
    head = make_value_head(model, torch.float32)
    with torch.no_grad():
        head.weight.normal_(generator=torch.Generator().manual_seed(3))  # non-zero values to compare
        module = PolicyWithValue(model, head)
        rows = slice(0, len(batch.input_ids))
        logps, values = policy_forward(module, batch, rows, temperature=T)
        _, plain_values = policy_forward(module, batch, rows)
        expected, _ = token_logps(model, batch, rows, temperature=T)
    P = batch.prompt_width
    torch.testing.assert_close(logps, expected[:, P:], atol=1e-5, rtol=0)
    mask = batch.completion_mask[:, P:].bool()
    engine = batch.rollout_logps[:, P:]
    torch.testing.assert_close(logps[mask], engine[mask], atol=1e-4, rtol=0)
    torch.testing.assert_close(values, plain_values)
    assert values[mask].abs().max() > 0


def test_evaluation_kl_is_taken_at_the_sampling_temperature(policy, sampled, tiny_model):
    """`mean_kl` at T: Σ (log π_T − log π_ref,T) / #tokens, with both from plain forwards at T."""
    model, _ = policy
    prompts, completions, _ = sampled
    ref = load_causal_lm(tiny_model, "float32")
    perturb(ref, seed=5)
    ref.eval()
    flat_prompts = [p for p, group in zip(prompts, completions) for _ in group]
    flat = [c for group in completions for c in group]
    diffs = [forward_logprobs(model, p, c.token_ids, temperature=T) - forward_logprobs(ref, p, c.token_ids, temperature=T)
             for p, c in zip(flat_prompts, flat)]
    expected = float(torch.cat(diffs).mean())
    got = mean_kl(model, ref, flat_prompts, flat, pad_id=0, batch_size=3, temperature=T)
    assert got == pytest.approx(expected, abs=1e-4)
    plain = mean_kl(model, ref, flat_prompts, flat, pad_id=0, batch_size=3)
    assert abs(plain - expected) > 1e-2, (plain, expected)
