"""A two-rank PPO run with a critic network, killed with SIGKILL, resumes from its last complete checkpoint
(policy, critic network, optimizer, adaptive KL coefficient) and ends where an uninterrupted run (a session
reference, tests/references.py) ends.

The other combinations are proven where they cost least: a one-process PPO run with a value head killed
at random moments resumes exactly in the fault suite (tests/e2e/test_faults.py), and resuming restores
weights, value head or critic network and the KL coefficient for both critics in
tests/stage/test_ppo.py::test_resume_restores_weights_value_function_and_kl_coef."""

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, kill_after_checkpoint, train_cli
from trainer.engine import checkpoint as ckpt

# Optimizer steps: 6 PPO steps of 2 mini-batches. The adaptive KL coefficient moves at every PPO step;
# the kill after checkpoint-4 leaves 4 PPO steps (rollouts included) to run after it.
STEPS, KILL_AFTER = 12, 4


def ppo_args(model: str, dataset: str, *extra: str) -> tuple[str, ...]:
    return ("--model", model, "--dataset", dataset, "--reward_funcs", "tests.helpers:target_frequency",
            "--batch_size", "32", "--mini_batch_size", "16", "--per_device_batch_size", "16", "--ppo_epochs", "1",
            "--max_completion_length", "16", "--max_prompt_length", "32", "--max_steps", str(STEPS),
            "--learning_rate", "1e-2", "--adap_kl_ctrl", "true", "--target_kl", "0.5", "--horizon", "64",
            "--save_total_limit", "0", "--disable_progress_bar", "true", *extra)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("MLFLOW_TRACKING_URI", None)
    e.update({"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
    return e


def test_sigkill_then_auto_resume_matches_straight_run(tiny_model, toy_prompts, reward_checkpoint, reference_run,
                                                       tmp_path):
    """Both runs have 2 ranks (DDP over gloo; batch and mini-batch are per rank, halved to keep the global
    ones): each rank's rollouts, the KL controller, the critic network and the checkpoint resume together."""
    value = "critic/model.safetensors"
    args = ppo_args(tiny_model, toy_prompts(64), "--num_processes", "2", "--batch_size", "16", "--mini_batch_size",
                    "8", "--per_device_batch_size", "8", "--critic", "reward_model", "--critic_model", reward_checkpoint)
    straight, killed = reference_run("ppo", *args), tmp_path / "killed"

    # Save every PPO step; kill the process as soon as checkpoint-4 is complete, while it trains on.
    kill_after_checkpoint([sys.executable, "-m", "trainer.cli", "train", "ppo", *args, "--save_steps", "2",
                           "--output_dir", str(killed)], killed / f"checkpoint-{KILL_AFTER}", 300, env())
    done = [s for s, _ in ckpt.list_checkpoints(str(killed))]
    assert KILL_AFTER in done and max(done) < STEPS, f"killed too late: complete checkpoints {done}"
    assert not ckpt.is_complete(str(killed)), "the final model must not look complete after a kill"

    train_cli("ppo", *args, "--save_steps", "2", "--resume_from_checkpoint", "auto", "--output_dir", str(killed))
    assert ckpt.is_complete(str(killed))
    start = load_file(Path(tiny_model) / "model.safetensors")
    for name in ("model.safetensors", value):
        a, b = load_file(straight / name), load_file(killed / name)
        assert a.keys() == b.keys()
        for k in a:
            if name == "model.safetensors":
                assert not torch.equal(a[k], start[k])
            torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=f"{name}:{k}")
    coef = [r["objective/kl_coef"] for r in ckpt.read_history(str(killed))]
    assert coef == [r["objective/kl_coef"] for r in ckpt.read_history(str(straight))] and len(set(coef)) > 1
    assert [r["step"] for r in ckpt.read_history(str(killed))] == list(range(2, STEPS + 1, 2))
