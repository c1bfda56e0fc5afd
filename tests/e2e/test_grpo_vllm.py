"""GRPO with in-process vLLM rollouts learns the toy task of tests/helpers.py, and stops on SIGTERM with a checkpoint.

With rollouts from a vLLM server (`alignflow rollout-server`), training is proven against the one-process
run instead: tests/e2e/test_rollout_server_shared.py (2 ranks train what 1 process trains, and the server
then serves the trained checkpoint's greedy output)."""

import os
import sys

import pytest

from tests.helpers import ROOT, grpo_config, needs_vllm, rewards_of, stop_after_step
from trainer.engine import checkpoint as ckpt
from trainer.engine.preemption import PREEMPTED_EXIT_CODE
from trainer.stages.rl.grpo import run_grpo

pytestmark = needs_vllm


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_inprocess_vllm_engine_learns_toy_task(tiny_model, tmp_path, monkeypatch, bf16):
    """Mean reward closes at least half of the gap to 1.0 within 60 steps, weights pushed every step;
    also with bf16 mixed precision, where vLLM samples in bfloat16 from the float32 weights, and with the KV
    cache the stage sizes (VLLM_CPU_KVCACHE_SPACE unset): room for a step's completions at full length."""
    from trainer.rollout import vllm_engine

    sized = []
    if bf16:
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        size = vllm_engine.cpu_kv_cache_bytes
        monkeypatch.setattr(vllm_engine, "cpu_kv_cache_bytes", lambda *a, **kw: sized.append(kw) or size(*a, **kw))
    else:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    config = grpo_config(tiny_model, tmp_path, rollout_engine="vllm", max_steps=60, learning_rate=2e-2, bf16=bf16)
    run_grpo(config)
    if bf16:
        [kw] = sized
        assert kw["sequences"] >= config.prompts_per_cycle * config.num_generations >= 2, kw
        assert kw["max_model_len"] == config.max_prompt_length + config.max_completion_length
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



def test_sigterm_stops_grpo_with_inprocess_vllm_at_a_step_with_a_checkpoint(tiny_model, toy_prompts, tmp_path):
    """vLLM starts inside the training process, after the stage has taken SIGTERM's handler: the engine must not
    take it back. SIGTERM after step 2 (periodic saves off) gives exit 75 and one complete step checkpoint."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "trainer.cli", "train", "grpo", "--model", tiny_model, "--dataset", toy_prompts(16),
               "--rollout_engine", "vllm", "--reward_funcs", "tests.helpers:target_frequency", "--num_generations", "4",
               "--per_device_batch_size", "8", "--max_completion_length", "8", "--max_prompt_length", "32",
               "--max_steps", "8", "--logging_steps", "1", "--save_steps", "0", "--log_completions_steps", "0",
               "--disable_progress_bar", "true", "--output_dir", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    stopped = stop_after_step(command, 2, env)
    assert stopped.code == PREEMPTED_EXIT_CODE, stopped.stderr[-4000:]
    saved = [step for step, _ in ckpt.list_checkpoints(str(out), verify=True)]
    assert len(saved) == 1 and 2 <= saved[0] < 8, (saved, stopped.stderr[-4000:])
    assert f"stopped by SIGTERM after step {saved[0]}/8" in stopped.stderr
    assert not ckpt.is_complete(str(out))
