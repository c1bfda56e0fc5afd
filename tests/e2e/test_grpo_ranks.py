"""GRPO on two CPU processes under `accelerate launch`: every group stays whole on one rank, both ranks
end with the same weights, rank 0 alone writes checkpoints and metrics, the toy reward of
tests/helpers.py rises, and a run resumed from a step checkpoint ends where the straight run ends.

`accelerate launch --cpu --num_processes 2` starts ONE process unless mpirun is configured, so
the tests launch with `--multi_gpu` (torchrun underneath); without CUDA, trainer/engine/distributed.py
makes accelerate treat the ranks as MULTI_CPU over gloo. Only the `hf` rollout engine runs here:
in-process vLLM supports one process so far, and a vLLM sidecar per rank is too heavy for CI.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers import LAUNCH_G, LAUNCH_PER_RANK_COMPLETIONS, LAUNCH_STEPS, launch_grpo, prompts_file
from trainer.engine import checkpoint as ckpt
from trainer.engine.distributed import rank_prompts
from trainer.engine.loop import step_batches
from trainer.errors import ConfigError
from trainer.stages.rl.grpo import GRPOConfig
from trainer.stages.rl.shared import check_ranks

ROOT = Path(__file__).resolve().parents[2]
# What launch_grpo runs: 2 prompts per rank per cycle, 4 per cycle in all.
G, PER_RANK_COMPLETIONS, STEPS = LAUNCH_G, LAUNCH_PER_RANK_COMPLETIONS, LAUNCH_STEPS


@pytest.fixture(scope="module")
def straight_run(tiny_model, tmp_path_factory):
    """One 20-step two-process run with a step checkpoint at 10; (dataset, output dir, rank reports)."""
    root = tmp_path_factory.mktemp("grpo-2proc")
    dataset = prompts_file(root / "prompts.jsonl", n=16)
    launch_grpo(tiny_model, dataset, root / "out", root / "ranks", "--save_steps", "10")
    reports = [json.loads((root / "ranks" / f"rank_{r}.json").read_text()) for r in (0, 1)]
    return dataset, root / "out", reports


def test_every_group_is_whole_on_one_rank(straight_run):
    _, _, reports = straight_run
    assert [r["world_size"] for r in reports] == [2, 2]
    cycles = [{c["cycle"]: c for c in r["cycles"]} for r in reports]
    assert sorted(cycles[0]) == sorted(cycles[1]) == list(range(STEPS))
    for cycle in range(STEPS):
        mine, theirs = cycles[0][cycle], cycles[1][cycle]
        for record in (mine, theirs):
            # This rank generated and scored all G completions of each of its prompts.
            assert len(record["prompts"]) == PER_RANK_COMPLETIONS // G
            assert record["group_sizes"] == [G] * len(record["prompts"])
        # No prompt (so no group) is split between ranks; together they cover the cycle's batch.
        assert not set(mine["prompts"]) & set(theirs["prompts"]), cycle
        (expected,) = step_batches(16, 2 * PER_RANK_COMPLETIONS // G, 1, 42, cycle + 1)
        assert mine["prompts"] + theirs["prompts"] == expected


def test_ranks_end_with_identical_weights_and_rank0_writes(straight_run, tiny_model):
    _, out, reports = straight_run
    assert reports[0]["params_sha256"] == reports[1]["params_sha256"]
    assert ckpt.is_complete(str(out)) and ckpt.is_complete(str(out / "checkpoint-10"))
    trained, start = load_file(out / "model.safetensors"), load_file(Path(tiny_model) / "model.safetensors")
    assert any(not torch.equal(trained[k], start[k]) for k in trained)
    history = ckpt.read_history(str(out))
    assert [r["step"] for r in history] == list(range(1, STEPS + 1)), "one writer: one record per step"
    # Token counts add up over both ranks; every rank's RNG state is in the step checkpoint.
    assert history[-1]["num_tokens"] > history[0]["num_tokens"] * (STEPS - 1)
    state = json.loads((out / "checkpoint-10" / ckpt.STATE_DIR / "state.json").read_text())
    assert len(state["extra"]["rank_rng"]) == 2


def test_reward_rises_over_twenty_steps(straight_run):
    _, out, _ = straight_run
    rewards = [r["reward"] for r in ckpt.read_history(str(out))]
    start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert end >= start + 0.2, f"start {start:.3f} end {end:.3f}: {rewards}"


def test_resumed_two_process_run_matches_straight_run(straight_run, tiny_model, tmp_path):
    dataset, out, reports = straight_run
    resumed = tmp_path / "resumed"
    launch_grpo(tiny_model, dataset, resumed, tmp_path / "ranks", "--resume_from_checkpoint",
                str(out / "checkpoint-10"))
    a, b = load_file(out / "model.safetensors"), load_file(resumed / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    again = json.loads((tmp_path / "ranks" / "rank_1.json").read_text())
    assert [c["prompts"] for c in again["cycles"]] == [c["prompts"] for c in reports[1]["cycles"][10:]]


# ----------------------------------------------------------------------------------------------
# Cheap checks of the pieces (no launch)


def test_rank_prompts_are_disjoint_equal_and_unchanged_for_one_process():
    for cycle in range(12):
        assert rank_prompts(10, 3, 0, 1, 7, cycle) == step_batches(10, 3, 1, 7, cycle + 1)[0]
        # 10 prompts, 2 ranks x 3: every second batch of an epoch is short (4) and gets topped up.
        shares = [rank_prompts(10, 3, r, 2, 7, cycle) for r in (0, 1)]
        assert [len(s) for s in shares] == [3, 3]
        assert not set(shares[0]) & set(shares[1])


def test_several_ranks_reject_what_they_cannot_run(tiny_model, tmp_path):
    config = GRPOConfig(model=tiny_model, dataset="demo", per_device_batch_size=16, num_generations=8)
    check_ranks(config, world=1, num_prompts=1)
    with pytest.raises(ConfigError, match="need at least 8 prompts"):
        check_ranks(config, world=4, num_prompts=6)
    vllm = GRPOConfig(model=tiny_model, dataset="demo", rollout_engine="vllm")
    with pytest.raises(ConfigError, match="vllm-server"):
        check_ranks(vllm, world=2, num_prompts=100)


def test_shipped_deepspeed_and_accelerate_configs_load():
    from accelerate.commands.config.config_args import load_config_from_file

    configs = ROOT / "trainer" / "configs"
    for stage in (2, 3):
        ds = json.loads((configs / f"deepspeed_zero{stage}.json").read_text())
        assert ds["zero_optimization"]["stage"] == stage
        # The stage fills these; a fixed value could disagree with its config.
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
            assert ds[key] == "auto", key
        path = configs / "accelerate" / f"deepspeed_zero{stage}.yaml"
        first_line = path.read_text().splitlines()[0]
        assert first_line.startswith(f"# accelerate launch --config_file trainer/configs/accelerate/{path.name} ")
        accelerate_config = load_config_from_file(str(path))
        assert accelerate_config.distributed_type == "DEEPSPEED"
        # accelerate refuses mixed_precision in the file next to a DeepSpeed JSON (it is a launch flag).
        assert "mixed_precision" not in yaml.safe_load(path.read_text())
        assert (ROOT / accelerate_config.deepspeed_config["deepspeed_config_file"]).is_file()
