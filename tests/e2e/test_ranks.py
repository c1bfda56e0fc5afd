"""Two CPU ranks (gloo) give the weights one rank gives at the same global batch.

Issue 17's proof of the multi-GPU path without a GPU: `alignflow train STAGE --num_processes 2`
starts real ranks with accelerate's launcher (torchrun's agent), with plain DDP or DeepSpeed ZeRO-2 / ZeRO-3, for
full fine-tuning and for LoRA. One rank trains with per_device_batch_size B, two with B/2 each;
after 6 steps the weights must agree within 1e-4 (float32 reductions in another order differ at
~1e-6), and must have moved far more than that.

Placement, sharding and the global-batch contract belong to the runner (trainer/engine/runner.py,
trainer/engine/distributed.py), not to a stage, so every parallel mode, full and LoRA, is compared on one
stage (SFT), and each other stage runs the one mode that reaches its own code (see CASES). A two-rank
run killed with SIGKILL after a step checkpoint resumes (`resume_from_checkpoint auto`) to the weights
of the uninterrupted two-rank SFT run of the comparison, under ZeRO-3 from its per-rank shards in
SeaweedFS; under DDP, a run stopped by SIGTERM to its launcher (both ranks stop after the same step with a
checkpoint, exit 75) resumes to them from a local folder. PPO under ZeRO (issue 14) is compared the
same way, with its value function: the value head, and the critic network (PPO on plain DDP with the critic
network: tests/e2e/test_ppo_ranks.py, against the same one-process runs). The `zero3_offload` preset
(optimizer state and step on the CPU) is compared once, for SFT, and so is `torch_compile` (compiled decoder layers
on two ranks under DDP and ZeRO-2, against the one eager rank).

Every uninterrupted run is a session reference (tests/references.py), trained once.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import (
    DEMO_DATA,
    ROOT,
    history,
    kill_after_checkpoint,
    max_difference,
    same_run,
    stop_after_step,
    train_cli,
    weights,
)
from tests.references import ppo_args
from tests.stage.test_reward_model import tiny_bert  # noqa: F401 (a fixture)
from trainer.engine import checkpoint as ckpt
from trainer.engine.distributed import RANK_REPORT_ENV
from trainer.engine.preemption import PREEMPTED_EXIT_CODE

STEPS = 6
COMMON = ("--max_steps", str(STEPS), "--logging_steps", "1", "--disable_progress_bar", "true", "--seed", "3",
          "--learning_rate", "1e-3", "--save_steps", "0")
LORA = ("--lora_r", "4", "--lora_alpha", "8")
MODES = {"ddp": (), "zero2": ("--deepspeed", "zero2"), "zero3": ("--deepspeed", "zero3"),
         "zero3_offload": ("--deepspeed", "zero3_offload")}  # ZeRO-3, optimizer state and step on the CPU
ZERO_STAGE = {"ddp": None, "zero2": 2, "zero3": 3, "zero3_offload": 3}


def stage_args(stage: str, toy_prompts) -> tuple[str, ...]:
    """Arguments of a short run of `stage` whose global batch is 4 examples (8 completions for GRPO)."""
    if stage == "sft":
        return "--dataset", str(DEMO_DATA / "sft.jsonl"), "--num_sample_completions", "0", "--eval_split_ratio", "0.05"
    if stage in ("reward", "dpo"):
        return "--dataset", str(DEMO_DATA / "preferences.jsonl"), "--eval_split_ratio", "0.05"
    return ("--dataset", toy_prompts(16), "--reward_funcs", "tests.helpers:target_frequency",
            "--num_generations", "4", "--max_completion_length", "8", "--max_prompt_length", "32",
            "--learning_rate", "1e-2", "--log_completions_steps", "0")


BATCH = {"sft": 4, "reward": 4, "dpo": 4, "grpo": 8}


def run_args(stage: str, model: str, toy_prompts, lora: bool, mode: str | None = None) -> tuple[str, ...]:
    """One rank with the whole global batch (`mode` None), or two ranks in `mode` with half of it each."""
    ranks = ("--per_device_batch_size", str(BATCH[stage])) if mode is None else (
        "--per_device_batch_size", str(BATCH[stage] // 2), "--num_processes", "2", *MODES[mode])
    return ("--model", model, *COMMON, *stage_args(stage, toy_prompts), *ranks, *(LORA if lora else ()))


CASES = [
    # SFT carries the runner's contract: every parallel mode, full fine-tuning and LoRA.
    *[pytest.param("sft", mode, lora, id=f"sft-{mode}-{'lora' if lora else 'full'}")
      for mode in ("ddp", "zero2", "zero3") for lora in (False, True)],
    # Offload moves the optimizer and its step to the CPU (DeepSpeedCPUAdam): the same for every stage, one is enough.
    pytest.param("sft", "zero3_offload", False, id="sft-zero3_offload-full"),
    # The reward model adds a freshly initialised score head: ZeRO-2 reduce-scatters its gradients and
    # partitions its optimizer state with the backbone's (then all-gathers the updated weights), where DDP
    # only all-reduces it; a head registered or initialised differently on a rank shows up here.
    pytest.param("reward", "zero2", False, id="reward-zero2-full"),
    # DPO's reference model under ZeRO-3 (sharded, gathered per forward). Its precomputed reference:
    # test_precomputed_reference_log_probs_are_computed_in_shares.
    pytest.param("dpo", "zero3", False, id="dpo-zero3-full"),
    # GRPO's own part is the rollout: each rank generates and scores its slice of the prompts, and the
    # rewards are gathered for the group advantages; none of it depends on how the weights are placed.
    # (Generation in step on ZeRO-3, `synced_gpus` in shared.start_engine, is PPO's too: compared in
    # test_ppo_two_ranks_under_zero_match_one.)
    pytest.param("grpo", "ddp", False, id="grpo-ddp-full"),
]


@pytest.mark.parametrize(("stage", "mode", "lora"), CASES)
def test_two_ranks_match_one(stage, mode, lora, tiny_model, toy_prompts, reference_run):
    reference = reference_run(stage, *run_args(stage, tiny_model, toy_prompts, lora))
    out = reference_run(stage, *run_args(stage, tiny_model, toy_prompts, lora, mode))  # (the kill tests' reference too)
    manifest = json.loads((out / ckpt.MANIFEST).read_text())
    assert manifest["world_size"] == 2
    assert manifest["zero_stage"] == ZERO_STAGE[mode]
    two, one = weights(out), weights(reference)
    assert max_difference(two, one) < 1e-4
    # The comparison means something only if training moved the weights well beyond that.
    if not lora:  # (the reward model's head is new: compare the backbone it shares with the starting model)
        initial = weights(tiny_model)
        shared = sorted(set(one) & set(initial))
        assert len(shared) >= len(initial) - 1
        assert max_difference({k: one[k] for k in shared}, {k: initial[k] for k in shared}) > 1e-3
    else:
        assert max(float(t.abs().max()) for k, t in one.items() if "lora_B" in k) > 1e-3
    # Ranks logged the same numbers one rank logs (loss, token counts) within float noise.
    last, ref_last = ([r for r in history(folder) if "num_tokens" in r][-1] for folder in (out, reference))
    assert last["step"] == ref_last["step"] == STEPS
    assert last["num_tokens"] == ref_last["num_tokens"]
    assert last["loss"] == pytest.approx(ref_last["loss"], abs=1e-4)
    evals = [{k: v for k, v in r.items() if k.startswith("eval_")} for r in (history(out)[-1], history(reference)[-1])]
    if stage != "grpo":  # the final evaluation of the held-out split, scored in shares by the ranks
        assert evals[0] and evals[0] == pytest.approx(evals[1], abs=1e-4)


@pytest.mark.parametrize("stage", ["sft", "reward", "reward-encoder"])
def test_padding_free_two_ranks_under_zero3_match_one(stage, tiny_model, toy_prompts, reference_run, request):
    """Padding-free SFT and reward models on the CPU: each rank's micro-batch is one packed row whose bounds reach
    the attention through DeepSpeed's engine and the stage's wrapper (TargetLM, PackedRewards); two ranks train
    what one trains, and both runs' manifests say the runs were padding-free (no fallback to padded batches).
    The encoder (BERT-style) runs its top layer at the first tokens only, calling the layer's parts itself
    (`reward_model.encode_first_tokens`), where ZeRO-3 gathers each part's shards in its own hooks."""
    free = ("--padding_free", "true")
    encoder = stage == "reward-encoder"
    stage, tiny_model = ("reward", request.getfixturevalue("tiny_bert")) if encoder else (stage, tiny_model)
    reference = reference_run(stage, *run_args(stage, tiny_model, toy_prompts, False), *free)
    out = reference_run(stage, *run_args(stage, tiny_model, toy_prompts, False, "zero3"), *free)
    manifests = [json.loads((folder / ckpt.MANIFEST).read_text()) for folder in (out, reference)]
    assert manifests[0]["zero_stage"] == 3
    assert all(m["config"]["padding_free"] is True for m in manifests)
    found, trained, initial = weights(out), weights(reference), weights(tiny_model)
    # (max_difference also asks for the same tensor names: transformers' ZeRO-3 loader would have BERT's LayerNorms
    # saved under their legacy names, gamma and beta, but for checkpoint._forget_unused_conversions.)
    if encoder:
        # The score head's bias and the attention's key biases get no gradient in exact arithmetic (the loss sees
        # reward differences; a key bias shifts all of a query's scores alike), so AdamW moves them by ~lr a step in
        # whatever direction the rounding points: they are not comparable across reduction orders.
        zero_gradient = [k for k in trained if k == "classifier.bias" or k.endswith("attention.self.key.bias")]
        found, trained = ({k: v for k, v in w.items() if k not in zero_gradient} for w in (found, trained))
        assert len(zero_gradient) == 3 and len(trained) > 30
    assert max_difference(found, trained) < 1e-4
    compared = [k for k in initial if k in trained]  # (a reward model's score head is new)
    assert max_difference({k: trained[k] for k in compared}, {k: initial[k] for k in compared}) > 1e-3


def test_compiled_two_ranks_match_one_eager_rank(tiny_model, toy_prompts, reference_run, tmp_path):
    """`torch_compile` on two ranks, under DDP and then under ZeRO-2 (each with its gradient hooks around compiled
    decoder layers), trains the weights one eager rank trains; each rank traced its layers with dynamo (its log),
    and the manifest records the compiled run. One test runs both layouts, one after the other: the second finds the
    first's graphs in inductor's cache instead of compiling them again, side by side with the first."""
    reference = reference_run("sft", *run_args("sft", tiny_model, toy_prompts, False))
    assert max_difference(weights(reference), weights(tiny_model)) > 1e-3
    for mode in ("ddp", "zero2"):
        done = train_cli("sft", *run_args("sft", tiny_model, toy_prompts, False, mode), "--torch_compile", "true",
                         "--output_dir", str(tmp_path / mode), env={"TORCH_LOGS": "dynamo"})
        for rank in (0, 1):
            assert re.search(rf"\[rank{rank}\]:.*torchdynamo done tracing forward", done.stdout + done.stderr), \
                f"{mode}: rank {rank} did not trace with dynamo"
        manifest = json.loads((tmp_path / mode / ckpt.MANIFEST).read_text())
        assert (manifest["world_size"], manifest["zero_stage"], manifest["config"]["torch_compile"]) == \
            (2, ZERO_STAGE[mode], True), mode
        assert max_difference(weights(tmp_path / mode), weights(reference)) < 1e-4, mode


@pytest.mark.parametrize(("critic", "mode"), [("value_head", "zero3"), ("reward_model", "zero3")])
def test_ppo_two_ranks_under_zero_match_one(critic, mode, tiny_model, toy_prompts, reward_checkpoint, reference_run,
                                            tmp_path):
    """PPO on two ranks under DeepSpeed ZeRO, 8 rollouts each, ends with the policy and value function
    (value_head.safetensors, or the critic network in critic/) one process trains on the same 16.

    ZeRO-3 is the mode that reaches PPO's own code: the value head or critic network is partitioned with
    the policy, gathered for the rollout's values and saved next to the model. ZeRO-2 only shards the
    optimizer state (the runner's, compared for SFT), and `zero3_offload` only moves the one optimizer
    that policy and critic share to the CPU (the preset is compared for SFT)."""
    reference = reference_run("ppo", *ppo_args(tiny_model, critic, toy_prompts(32), reward_checkpoint, 16))
    out, reports = tmp_path / "out", tmp_path / "ranks"
    train_cli("ppo", *ppo_args(tiny_model, critic, toy_prompts(32), reward_checkpoint, 8), "--output_dir", str(out),
              "--num_processes", "2", *MODES[mode], env={RANK_REPORT_ENV: str(reports)})
    manifest = json.loads((out / ckpt.MANIFEST).read_text())
    assert (manifest["world_size"], manifest["zero_stage"]) == (2, ZERO_STAGE[mode])
    ranks = [json.loads((reports / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"], "policy and value function differ between ranks"

    trained = {"model": (weights(out), weights(reference), weights(tiny_model))}
    if critic == "reward_model":  # the critic network, saved as a reward-model folder
        trained["critic/"] = (weights(out / "critic"), weights(reference / "critic"), weights(reward_checkpoint))
    else:
        two, one = (load_file(folder / "value_head.safetensors") for folder in (out, reference))
        trained["value head"] = (two, one, {k: torch.zeros_like(t) for k, t in one.items()})  # starts at zero
    for name, (two, one, start) in trained.items():
        assert max_difference(two, one) < 1e-4, name
        assert max_difference(one, start) > 1e-3, f"{name}: training barely moved it; the comparison means nothing"

    last, ref_last = ([r for r in history(folder) if "num_tokens" in r][-1] for folder in (out, reference))
    assert last["step"] == ref_last["step"] == 4
    assert last["num_tokens"] == ref_last["num_tokens"]
    for key in ("loss", "ppo/loss/value", "objective/scores"):
        assert last[key] == pytest.approx(ref_last[key], abs=1e-4), key


@pytest.mark.parametrize("mode", ["zero3"])  # (DDP: test_two_rank_run_stopped_by_sigterm_to_its_launcher_resumes_exactly)
def test_two_rank_run_killed_mid_run_resumes_to_the_same_weights(mode, request, tiny_model, toy_prompts, reference_run,
                                                                 tmp_path):
    """The uninterrupted run is test_two_ranks_match_one's two-rank SFT run; this one saves every 2 steps and
    is killed as soon as checkpoint-2 is complete, 4 steps, the final evaluation and the save before its end.
    Under ZeRO-3 its output is in SeaweedFS: each rank uploads its own optimizer shard into the step checkpoint
    before rank 0 marks it complete, and `auto` finds and resumes from that s3:// checkpoint."""
    from trainer.io import storage

    args = run_args("sft", tiny_model, toy_prompts, False, mode)
    straight, killed, env = reference_run("sft", *args), str(tmp_path / "killed"), {}
    if mode == "zero3":
        s3_env = request.getfixturevalue("s3_env")
        killed, env = f"s3://{s3_env.bucket}/ranks-{tmp_path.name}/killed", s3_env.env()
    args = (*args, "--save_steps", "2")
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    full_env.pop("MLFLOW_TRACKING_URI", None)
    kill_after_checkpoint([sys.executable, "-m", "trainer.cli", "train", "sft", *args, "--output_dir", killed],
                          f"{killed}/checkpoint-2", 600, full_env)
    assert not ckpt.is_complete(killed), "the killed run must not have finished"
    if mode == "zero3":
        shards = storage.filesystem(killed).find(f"{killed}/checkpoint-2/deepspeed")
        assert sum("optim_states" in p for p in shards) == 2, shards  # one optimizer shard per rank
    resumed = train_cli("sft", *args, "--output_dir", killed, "--resume_from_checkpoint", "auto", env=env)
    assert "Resuming from" in resumed.stderr + resumed.stdout
    local = storage.fetch_to_local(killed, tmp_path / "resumed") if mode == "zero3" else Path(killed)
    assert max_difference(weights(local), weights(straight)) < 1e-6
    assert [r["step"] for r in history(local) if "loss" in r][-1] == STEPS


def test_two_rank_run_stopped_by_sigterm_to_its_launcher_resumes_exactly(tiny_model, toy_prompts, reference_run,
                                                                        tmp_path):
    """SIGTERM to `alignflow train sft --num_processes 2` (the launcher) as soon as it logs step 2, periodic saves
    off: torchrun's agent passes the signal to both ranks, which agree (one all-reduce a step) to stop after the
    same step, save it and exit; the launcher exits 75. `auto` resumes both ranks to the uninterrupted two-rank
    run of test_two_ranks_match_one: the same weights and metrics."""
    args = run_args("sft", tiny_model, toy_prompts, False, "ddp")
    straight, out = reference_run("sft", *args), tmp_path / "stopped"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    stopped = stop_after_step([sys.executable, "-m", "trainer.cli", "train", "sft", *args, "--output_dir", str(out)],
                              2, env)
    assert stopped.code == PREEMPTED_EXIT_CODE, stopped.stderr[-6000:]
    saved = [step for step, _ in ckpt.list_checkpoints(str(out), verify=True)]
    assert len(saved) == 1 and 2 <= saved[0] < STEPS, (saved, stopped.stderr[-6000:])
    stops = re.findall(r"sft rank (\d): stopped by .+? after step (\d+)/", stopped.stderr)
    assert sorted(stops) == [("0", str(saved[0])), ("1", str(saved[0]))], stops  # both ranks, the same step

    train_cli("sft", *args, "--output_dir", str(out), "--resume_from_checkpoint", "auto")
    assert json.loads((out / ckpt.MANIFEST).read_text())["resumed_from"] == str(out / f"checkpoint-{saved[0]}")
    assert same_run(out, straight) <= 1e-6


def test_gpu_check_dry_run_writes_its_summary(tmp_path):
    """scripts/gpu_check.sh --dry-run: the GPU check's sequence on the CPU, one JSON summary, no GPU claimed. SFT
    only, on both layouts (every stage's training is tested elsewhere; that the script's command line for each
    stage is a valid config: tests/unit/test_scripts.py)."""
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--steps", "2", "--stages", "sft", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["cuda"] is False and summary["tests"] is None
    rows = {(r["stage"], r["layout"]): r for r in summary["stages"]}
    assert set(rows) == {("sft", "1 CPU rank"), ("sft", "2 ranks, ZeRO-3")}
    assert all(r["exit_code"] == 0 and r["steps"] == 2 and r["device"] == "cpu" for r in rows.values())
    assert {r["world_size"] for r in rows.values()} == {1, 2} and rows["sft", "2 ranks, ZeRO-3"]["zero_stage"] == 3


def test_precomputed_reference_log_probs_are_computed_in_shares(tiny_model, toy_prompts, reference_run, tmp_path):
    """DPO's reference log-probs precomputed by two ranks (each scores its share, then they are gathered)
    train to the weights one rank gets, and the checkpointed scores are the same numbers. Under ZeRO-3, where
    the reference scoring its share is a sharded DeepSpeed inference engine: the sharing itself is the same
    code under DDP."""
    mode = "zero3"
    args = ("--model", tiny_model, *COMMON[:-2], "--save_steps", "5", "--precompute_ref_log_probs", "true",
            *stage_args("dpo", toy_prompts))
    one, two = reference_run("dpo", *args, "--per_device_batch_size", "4"), tmp_path / "two"
    train_cli("dpo", *args, "--output_dir", str(two), "--per_device_batch_size", "2", "--num_processes", "2",
              *MODES[mode])
    assert max_difference(weights(two), weights(one)) < 1e-4
    scores = [json.loads((out / "checkpoint-5" / ckpt.STATE_DIR / "state.json").read_text())["extra"]["ref_logps"]
              for out in (one, two)]
    assert scores[0].keys() == scores[1].keys() == {"train", "eval"}
    for split in scores[0]:
        assert len(scores[0][split]) == len(scores[1][split])
        assert max(abs(a - b) for x, y in zip(scores[0][split], scores[1][split]) for a, b in zip(x, y)) < 1e-4
