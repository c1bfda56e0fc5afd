"""GRPO on CUDA: the toy task of tests/helpers.py with the hf engine, with in-process vLLM
(colocated on the training GPU), and under DeepSpeed ZeRO-2 / ZeRO-3 through `accelerate launch`
with the shipped configs (one process per GPU, at most two)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import grpo_config, launch_grpo, prompts_file, rewards_of
from trainer.engine import checkpoint as ckpt
from trainer.stages.rl.grpo import run_grpo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"),
]


def _closes_half_the_gap(rewards: list[float]) -> None:
    start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert end - start >= 0.5 * (1.0 - start), f"start {start:.3f} end {end:.3f}: {rewards}"


def test_hf_engine_trains_on_the_gpu(tiny_model, tmp_path):
    torch.cuda.reset_peak_memory_stats()
    run_grpo(grpo_config(tiny_model, tmp_path, max_steps=60, learning_rate=2e-2))
    assert torch.cuda.max_memory_allocated() > 0, "the policy never reached the GPU"
    _closes_half_the_gap(rewards_of(tmp_path / "out"))


def test_colocated_vllm_engine_learns_toy_task(tiny_model, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'alignflow[gpu]'")
    run_grpo(grpo_config(tiny_model, tmp_path, rollout_engine="vllm", vllm_gpu_memory_utilization=0.3,
                         max_steps=60, learning_rate=2e-2))
    _closes_half_the_gap(rewards_of(tmp_path / "out"))
    last = ckpt.read_history(str(tmp_path / "out"))[-1]
    assert "sampling/importance_sampling_ratio/mean" in last and last["timing/sync"] > 0


def test_colocated_vllm_sleeps_during_the_update_and_still_learns(tiny_model, tmp_path):
    """`vllm_enable_sleep_mode`: vLLM frees its GPU memory after each rollout (level 2) and wakes for the weight
    push and the next rollout; the run learns the toy task as without it."""
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'alignflow[gpu]'")
    run_grpo(grpo_config(tiny_model, tmp_path, rollout_engine="vllm", vllm_gpu_memory_utilization=0.3,
                         vllm_enable_sleep_mode=True, max_steps=60, learning_rate=2e-2))
    _closes_half_the_gap(rewards_of(tmp_path / "out"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: NCCL puts each rank on its own device")
def test_rollout_server_on_its_own_gpu_takes_weights_over_an_nccl_group(tiny_model):
    """The weight group on GPUs (NCCL; never run on this project's CPU machines): a server on GPU 1, the pushing
    process on GPU 0; after a push from CUDA tensors the server's greedy output is the pushed model's."""
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'alignflow[gpu]'")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers import model_greedy, perturb
    from trainer.engine.launch import free_port
    from trainer.rollout import SamplingConfig, make_engine

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [list(range(5, 12)), list(range(40, 70))]
    greedy = SamplingConfig(max_new_tokens=8, temperature=0)
    with make_engine("vllm-server", model=model, tokenizer=tokenizer, model_path=tiny_model, max_model_len=512,
                     dtype="float32", server_devices="1", group_port=free_port(), weight_channel="group",
                     server_timeout_s=600) as engine:
        assert engine.info["weight_group"]["backend"] == "nccl"
        perturb(model, seed=6)
        engine.sync_weights((name, t.cuda()) for name, t in model.state_dict().items())
        assert engine.last_push["channel"] == "group"
        assert [s[0].token_ids for s in engine.generate(prompts, greedy)] == [model_greedy(model, p, 8) for p in prompts]


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_through_accelerate_launch(tiny_model, tmp_path, stage):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install 'alignflow[gpu]'")
    processes = min(2, torch.cuda.device_count())
    dataset = prompts_file(tmp_path / "prompts.jsonl", n=16)
    out, ranks = tmp_path / "out", tmp_path / "ranks"
    launch = ("--config_file", f"trainer/configs/accelerate/deepspeed_zero{stage}.yaml",
              "--num_processes", str(processes), "--mixed_precision", "bf16")
    launch_grpo(tiny_model, dataset, out, ranks, "--save_steps", "10", launch=launch)
    assert ckpt.is_complete(str(out)) and ckpt.is_complete(str(out / "checkpoint-10"))
    assert (out / "checkpoint-10" / "deepspeed").is_dir(), "each rank's ZeRO shard belongs in the step checkpoint"
    trained, start = load_file(out / "model.safetensors"), load_file(Path(tiny_model) / "model.safetensors")
    assert trained.keys() == start.keys()  # ZeRO-3: whole tensors, gathered before saving
    assert all(trained[k].shape == start[k].shape for k in trained)
    assert any(not torch.equal(trained[k].float(), start[k].float()) for k in trained)
    digests = {json.loads((ranks / f"rank_{r}.json").read_text())["params_sha256"] for r in range(processes)}
    assert len(digests) == 1, "ranks ended with different weights"
    rewards = rewards_of(out)
    assert sum(rewards[-5:]) / 5 >= sum(rewards[:3]) / 3 + 0.2, rewards
