"""bf16 rollouts of a float32 (mixed precision) model from an in-process vLLM engine of the test's own: closing an
engine tears down vLLM's process-wide state, so it cannot run beside tests/e2e/test_rollout_vllm.py's module-wide
float32 engine."""

from __future__ import annotations

import torch

from tests.helpers import needs_vllm, perturb, sized_kv_tokens
from trainer.rollout import SamplingConfig

pytestmark = needs_vllm


def test_a_bfloat16_engine_rounds_float32_weights_as_a_cast_does(tiny_model, monkeypatch):
    """The engine takes the float32 weights as they are (vLLM's loaders round them into its bf16 parameters) and
    samples exactly what it samples, tokens and log-probs, from the same weights cast to bf16 first.
    Without VLLM_CPU_KVCACHE_SPACE its KV cache is the one its largest call needs (vLLM's default takes a share of
    all RAM)."""
    from transformers import AutoModelForCausalLM

    from trainer.rollout.vllm_engine import CPU_BLOCK_SIZE, VLLMEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    perturb(model, seed=12)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 40)]
    sampling = SamplingConfig(max_new_tokens=16, n=2, temperature=1.0, seed=8)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    engine = VLLMEngine(tiny_model, max_model_len=512, seed=0, dtype="bfloat16", max_sequences=4)
    try:
        blocks = engine.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        assert blocks * CPU_BLOCK_SIZE == sized_kv_tokens(tiny_model, max_model_len=512, sequences=4, dtype="bfloat16")
        start = engine.generate(prompts, sampling)
        engine.sync_weights(model.state_dict().items())  # float32, as they are
        as_is = engine.generate(prompts, sampling)
        engine.sync_weights(initial.items())
        assert engine.generate(prompts, sampling) == start
        engine.sync_weights([(name, t.to(torch.bfloat16)) for name, t in model.state_dict().items()])
        assert engine.generate(prompts, sampling) == as_is != start
    finally:
        engine.close()
