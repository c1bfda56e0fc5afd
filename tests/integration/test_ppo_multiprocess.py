"""PPO on two CPU processes (`alignflow train ppo --num_processes 2`, DDP over gloo): each rank rolls out
its own disjoint prompts, both ranks end with the same policy and value head, rank 0 alone writes.

Not checked here: equality with a one-process run of the same global batch. Each rank whitens the
advantages over its own rollouts (as TRL does) and shuffles its own mini-batches, so the two runs
differ by design (docs/ppo.md)."""

import json

import pytest

from tests.helpers import prompts_file, train_cli
from trainer import checkpoint as ckpt
from trainer.distributed import RANK_REPORT_ENV

pytestmark = pytest.mark.integration


def test_two_ranks_train_ppo_to_identical_policy_and_value_head(tiny_model, tmp_path):
    dataset = prompts_file(tmp_path / "prompts.jsonl", n=32)
    out, reports = tmp_path / "out", tmp_path / "ranks"
    train_cli("ppo", "--num_processes", "2", "--model", tiny_model, "--dataset", dataset, "--output_dir", str(out),
              "--reward_funcs", "tests.helpers:target_frequency", "--batch_size", "8", "--mini_batch_size", "4",
              "--per_device_batch_size", "4", "--ppo_epochs", "1", "--max_completion_length", "8",
              "--max_prompt_length", "32", "--max_steps", "4", "--save_steps", "2", "--learning_rate", "1e-2",
              "--disable_progress_bar", "true", env={RANK_REPORT_ENV: str(reports), "HF_HOME": str(tmp_path / "hf")})
    ranks = [json.loads((reports / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"], "policy and value head differ between ranks"
    for mine, theirs in zip(ranks[0]["cycles"], ranks[1]["cycles"], strict=True):
        assert len(mine["prompts"]) == len(theirs["prompts"]) == 8
        assert not set(mine["prompts"]) & set(theirs["prompts"])
    assert ckpt.is_complete(str(out)) and (out / "checkpoint-2" / "value_head.safetensors").exists()
    # One record per PPO step (2 optimizer steps each), written once.
    assert [r["step"] for r in ckpt.read_history(str(out))] == [2, 4]
