"""GRPO with in-process vLLM rollouts learns the toy task of tests/helpers.py.

With rollouts from a vLLM server (`alignflow rollout-server`), training is proven against the one-process
run instead: tests/e2e/test_rollout_server_shared.py (2 ranks train what 1 process trains, and the server
then serves the trained checkpoint's greedy output)."""

import pytest

from tests.helpers import grpo_config, needs_vllm, rewards_of
from trainer.engine import checkpoint as ckpt
from trainer.stages.rl.grpo import run_grpo

pytestmark = needs_vllm


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_inprocess_vllm_engine_learns_toy_task(tiny_model, tmp_path, monkeypatch, bf16):
    """Mean reward closes at least half of the gap to 1.0 within 60 steps, weights pushed every step;
    also with bf16 mixed precision, where vLLM samples in bfloat16 from the float32 weights."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    run_grpo(grpo_config(tiny_model, tmp_path, rollout_engine="vllm", max_steps=60, learning_rate=2e-2, bf16=bf16))
    rewards = rewards_of(tmp_path / "out")
    start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert end - start >= 0.5 * (1.0 - start), f"start {start:.3f} end {end:.3f}: {rewards}"
    history = ckpt.read_history(str(tmp_path / "out"))
    # The engine's sampling log-probs feed the importance-sampling correction.
    assert "sampling/importance_sampling_ratio/mean" in history[-1]
    assert history[-1]["timing/sync"] > 0
    # Trainer and engine agree to float32 rounding in float32; in bf16 they differ by bf16 rounding.
    gap = max(r["sampling/sampling_logp_difference/max"] for r in history if "sampling/sampling_logp_difference/max" in r)
    assert (1e-3 < gap < 1.0) if bf16 else gap < 1e-3, gap

