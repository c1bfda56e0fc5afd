"""PPO with in-process vLLM rollouts learns the toy task of tests/helpers.py."""


from tests.helpers import needs_vllm, ppo_config, rewards_of
from trainer.engine import checkpoint as ckpt
from trainer.stages.rl.ppo import run_ppo

pytestmark = needs_vllm


def test_inprocess_vllm_engine_ppo_learns_toy_task(tiny_model, tmp_path, monkeypatch):
    """Mean reward closes at least half of the gap to 1.0 within 200 optimizer steps (100 PPO steps),
    the weights pushed to the engine after every PPO step."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    run_ppo(ppo_config(tiny_model, tmp_path, rollout_engine="vllm", max_steps=200, learning_rate=2e-2,
                       init_kl_coef=0.002, seed=2))
    rewards = rewards_of(tmp_path / "out")
    start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert end - start >= 0.5 * (1.0 - start), f"start {start:.3f} end {end:.3f}: {rewards}"
    assert ckpt.read_history(str(tmp_path / "out"))[-1]["timing/sync"] > 0
