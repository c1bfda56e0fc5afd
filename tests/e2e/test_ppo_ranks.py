"""PPO on two CPU processes (`alignflow train ppo --num_processes 2`, DDP over gloo): each rank rolls out
its own disjoint prompts, both ranks end with the same policy and critic network (started from a reward
model), rank 0 alone writes, and two ranks of 8 rollouts train what one process trains on the same 16
(advantages are whitened over all ranks' tokens; with one mini-batch per epoch the micro-batches are the same
rows). The critic network is the case DDP can get wrong (a second model inside the one module DDP wraps); the
value head on two ranks is compared under ZeRO-3 (tests/e2e/test_ranks.py), whose one-process runs are the
same session references (same arguments: tests.references.ppo_args)."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.helpers import train_cli
from tests.references import ppo_args
from trainer.engine import checkpoint as ckpt
from trainer.engine.distributed import RANK_REPORT_ENV


def test_two_ranks_train_ppo_like_one_process(tiny_model, toy_prompts, reward_checkpoint, reference_run, tmp_path):
    two, reports, critic = tmp_path / "two", tmp_path / "ranks", "reward_model"
    value = "critic/model.safetensors"
    train_cli("ppo", "--num_processes", "2", *ppo_args(tiny_model, critic, toy_prompts(32), reward_checkpoint, 8),
              "--save_steps", "2", "--output_dir", str(two),
              env={RANK_REPORT_ENV: str(reports), "HF_HOME": str(tmp_path / "hf")})
    one = reference_run("ppo", *ppo_args(tiny_model, critic, toy_prompts(32), reward_checkpoint, 16))

    ranks = [json.loads((reports / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"], "policy and value function differ between ranks"
    for mine, theirs in zip(ranks[0]["cycles"], ranks[1]["cycles"], strict=True):
        assert len(mine["prompts"]) == len(theirs["prompts"]) == 8
        assert not set(mine["prompts"]) & set(theirs["prompts"])
    assert ckpt.is_complete(str(two)) and (two / "checkpoint-2" / value).exists()
    # One record per PPO step (2 optimizer steps each), written once.
    assert [r["step"] for r in ckpt.read_history(str(two))] == [2, 4]

    start = load_file(Path(tiny_model) / "model.safetensors")
    assert any(not torch.equal(load_file(one / "model.safetensors")[k], start[k]) for k in start), "nothing trained"
    for name in ("model.safetensors", value):
        a, b = load_file(one / name), load_file(two / name)
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=0, msg=f"{name}:{k}")
