"""GRPO stage with the hf rollout engine: learns a toy task, trains every loss and estimator (RLOO included),
resumes, logs completions for the report, scores with a classifier's label. Input checks that fail before
training: tests/unit/trainer/stages/rl/test_grpo.py; shared-prompt attention: tests/unit/trainer/engine/test_attention.py."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from components import report
from tests.helpers import grpo_config, prompts_file, rewards_of
from trainer.engine import checkpoint as ckpt
from trainer.engine import distributed
from trainer.engine.completions import build_batch, token_logps
from trainer.engine.models import load_causal_lm
from trainer.errors import ConfigError, ModelError, RewardError
from trainer.rollout.base import Completion
from trainer.stages.rl.grpo import run_grpo


def reward_none_for_first(prompts, completions, **_):
    return [None] + [0.5] * (len(completions) - 1)


def wrong_length(prompts, completions, **_):
    return [1.0]


def returns_nan(prompts, completions, **_):
    return [float("nan")] * len(completions)


def no_kwargs(prompts, completions):
    return [0.0] * len(completions)


def needs_column(prompts, completions, target, **_):
    assert len(target) == len(completions)
    return [1.0 if t in c else 0.0 for c, t in zip(completions, target)]


def tokens_in_completion(prompts, completions, completion_ids, **_):
    assert len(completion_ids) == len(completions) and all(isinstance(i, int) for ids in completion_ids for i in ids)
    return [float(len(ids)) for ids in completion_ids]


def test_hf_engine_learns_toy_task(tiny_model, tmp_path):
    """The mean reward closes at least half of the gap to its maximum (1.0) within 60 steps.

    The toy reward has local optima: a policy that settles on the token "an" earns 0.5 forever
    (seed 42 does, from 0.08); seeds 1-4 reach 0.6-1.0. Seed 2 is used here."""
    config = grpo_config(tiny_model, tmp_path, max_steps=60, learning_rate=2e-2, logging_steps=1, seed=2)
    run_grpo(config)
    rewards = rewards_of(tmp_path / "out")
    start = sum(rewards[:3]) / 3
    end = sum(rewards[-5:]) / 5
    assert end - start >= 0.5 * (1.0 - start), f"start {start:.3f} end {end:.3f}: {rewards}"
    history = ckpt.read_history(str(tmp_path / "out"))
    for key in ("reward", "reward_std", "frac_reward_zero_std", "entropy", "clip_ratio/region_mean",
                "completions/mean_length", "completions/clipped_ratio", "step_time", "timing/generate",
                "timing/update", "rewards/target_frequency/mean", "loss", "grad_norm", "learning_rate"):
        assert key in history[-1], key


@pytest.mark.parametrize("bf16", [True, False])
def test_a_reward_model_scores_under_the_runs_autocast(tiny_model, reward_checkpoint, tmp_path, monkeypatch, bf16):
    """With `bf16`, a reward model in `reward_funcs` runs its forward under the run's bfloat16 autocast, as the
    policy's forwards do (and as TRL's accelerator-prepared reward models do); without it, in float32."""
    from trainer.rewards import scorer

    seen, load = [], scorer.load_reward_model

    def load_and_watch(*args, **kwargs):
        model = load(*args, **kwargs)
        model.register_forward_pre_hook(
            lambda module, inputs: seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                                               else None))
        return model

    monkeypatch.setattr(scorer, "load_reward_model", load_and_watch)
    run_grpo(grpo_config(tiny_model, tmp_path, max_steps=1, bf16=bf16, reward_weights=[1.0, 0.0],
                         reward_funcs=["tests.helpers:target_frequency", reward_checkpoint]))
    assert seen and set(seen) == {torch.bfloat16 if bf16 else None}


def test_bf16_mixed_precision_trains_float32_weights(tiny_model, tmp_path):
    """`bf16`: log-probs come from a bfloat16 autocast forward (close to float32's, not equal),
    parameters and the saved model stay float32, and the next stage in the process can go back."""
    run_grpo(grpo_config(tiny_model, tmp_path, max_steps=2, learning_rate=1e-2, bf16=True))
    saved = load_file(tmp_path / "out" / "model.safetensors")
    start = load_file(Path(tiny_model) / "model.safetensors")
    assert all(w.dtype == torch.float32 for w in saved.values())
    assert any(not torch.equal(saved[k], start[k]) for k in start)
    assert all(math.isfinite(r["loss"]) for r in ckpt.read_history(str(tmp_path / "out")) if "loss" in r)

    model = load_causal_lm(tiny_model, "float32")
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(5, model.config.vocab_size, (n,), generator=gen).tolist() for n in (7, 9, 8)]
    batch = build_batch([ids[0]], [[Completion(ids[1], [0.0] * 9, "length"), Completion(ids[2], [0.0] * 8, "length")]],
                        pad_id=0)
    accelerator = distributed.make_accelerator(SimpleNamespace(mixed_precision="bf16"))
    assert accelerator.mixed_precision == "bf16"
    with torch.no_grad(), accelerator.autocast():
        low, _ = token_logps(model, batch, slice(0, 2))
    with torch.no_grad():
        full, _ = token_logps(model, batch, slice(0, 2))
    gap = (low - full).abs().max()
    assert 1e-5 < gap < 0.1, gap
    assert distributed.make_accelerator(SimpleNamespace(mixed_precision="no")).mixed_precision == "no"


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_each_loss_type_with_kl_and_iterations_updates_weights(tiny_model, tmp_path, loss_type):
    config = grpo_config(tiny_model, tmp_path, loss_type=loss_type, beta=0.1, num_iterations=2, max_steps=2,
                         epsilon_high=0.28, gradient_accumulation_steps=2, per_device_batch_size=8)
    run_grpo(config)
    history = ckpt.read_history(str(tmp_path / "out"))
    assert "kl" in history[-1] and history[-1]["kl"] >= 0
    a = load_file(tmp_path / "out" / "model.safetensors")
    b = load_file(Path(tiny_model) / "model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_bias_corrected_kl_reaches_the_update(tiny_model, tmp_path):
    """`use_bias_correction_kl` (TRL's default, on) multiplies each token's KL by the importance ratio: once the
    policy has moved off the reference (the cycle's second optimizer step), the update differs from the plain k3
    KL's. The loss itself: tests/unit/trainer/algorithms/test_losses.py; against TRL: benchmarks/parity.py."""
    trained = {}
    for corrected in (True, False):
        out = tmp_path / f"corrected-{corrected}"
        run_grpo(grpo_config(tiny_model, tmp_path, beta=0.5, num_iterations=2, max_steps=2, output_dir=str(out),
                             use_bias_correction_kl=corrected))
        trained[corrected] = load_file(out / "model.safetensors")
        assert json.loads((out / ckpt.MANIFEST).read_text())["config"]["use_bias_correction_kl"] is corrected
    assert max(float((trained[True][k] - trained[False][k]).abs().max()) for k in trained[True]) > 1e-6


def test_lora_grpo_with_adapter_disabled_reference(tiny_model, tmp_path):
    run_grpo(grpo_config(tiny_model, tmp_path, lora_r=8, beta=0.1, max_steps=2))
    assert (tmp_path / "out" / "adapter_config.json").exists()
    assert "kl" in ckpt.read_history(str(tmp_path / "out"))[-1]


def test_chat_prompts_and_extra_columns_reach_rewards(tiny_model, tmp_path):
    """Columns and `completion_ids` (TRL's keyword) reach reward functions: the token count each one saw
    averages to the logged completion length."""
    dataset = prompts_file(tmp_path / "chat.jsonl", chat=True)
    run_grpo(grpo_config(tiny_model, tmp_path, dataset=dataset, max_steps=1,
                         reward_funcs=[f"{__name__}:needs_column", f"{__name__}:reward_none_for_first",
                                       f"{__name__}:tokens_in_completion"],
                         reward_weights=[1.0, 0.5, 0.0]))
    last = ckpt.read_history(str(tmp_path / "out"))[-1]
    assert "rewards/needs_column/mean" in last and last["rewards/reward_none_for_first/mean"] == 0.5
    assert last["rewards/tokens_in_completion/mean"] == pytest.approx(last["completions/mean_length"])


def test_share_prompt_trains_like_unshared(tiny_model, tmp_path):
    """One cycle (reference model, old log-probs, two optimizer steps): same weights either way."""
    weights = []
    for share in (True, False):
        out = tmp_path / f"share-{share}"
        run_grpo(grpo_config(tiny_model, tmp_path, share_prompt=share, beta=0.1, num_iterations=2, max_steps=2,
                             per_device_batch_size=8, gradient_accumulation_steps=2, output_dir=str(out)))
        weights.append(load_file(out / "model.safetensors"))
    start = load_file(Path(tiny_model) / "model.safetensors")
    assert any(not torch.equal(weights[0][k], start[k]) for k in start)
    for k in start:
        # Adam turns float-rounding differences of near-zero gradients into steps of up to 1% of lr.
        torch.testing.assert_close(weights[0][k], weights[1][k], atol=1e-4, rtol=0, msg=k)


def test_resume_matches_straight_run(tiny_model, tmp_path):
    straight = grpo_config(tiny_model, tmp_path, max_steps=4, output_dir=str(tmp_path / "a"))
    run_grpo(straight)
    first = grpo_config(tiny_model, tmp_path, max_steps=4, save_steps=2, output_dir=str(tmp_path / "b"))
    run_grpo(first)
    # Pretend the run died after checkpoint-2: drop the final model and resume.
    (tmp_path / "b" / ckpt.COMPLETE_MARKER).unlink()
    run_grpo(grpo_config(tiny_model, tmp_path, max_steps=4, save_steps=2, output_dir=str(tmp_path / "b"),
                         resume_from_checkpoint="auto"))
    a = load_file(tmp_path / "a" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)


@pytest.mark.parametrize(("func", "message"), [
    ("wrong_length", "returned 1 scores for 16 completions"),
    ("returns_nan", "returned nan for sample 0"),
    ("no_kwargs", r"unexpected keyword argument.*end the parameters with \*\*kwargs"),
])
def test_misbehaving_reward_function_is_named(tiny_model, tmp_path, func, message):
    with pytest.raises(RewardError, match=message) as err:
        run_grpo(grpo_config(tiny_model, tmp_path, reward_funcs=[f"{__name__}:{func}"], max_steps=1))
    assert func in str(err.value)


def test_eval_dataset_is_scored_every_eval_steps_and_at_the_end(tiny_model, tmp_path):
    """GRPO evaluates held-out prompts (TRL's eval_reward) every `eval_steps` and after the last step."""
    held_out = prompts_file(tmp_path / "held_out.jsonl", n=5)
    run_grpo(grpo_config(tiny_model, tmp_path, max_steps=4, eval_dataset=held_out, eval_steps=2, logging_steps=1))
    records = ckpt.read_history(str(tmp_path / "out"))
    evals = [r for r in records if "eval_reward" in r]
    assert [r["step"] for r in evals] == [2, 4], evals
    assert all(0.0 <= r["eval_reward"] <= 1.0 and r["eval_rewards/target_frequency/mean"] == r["eval_reward"]
               for r in evals)
    manifest = json.loads((tmp_path / "out" / ckpt.MANIFEST).read_text())
    assert manifest["metrics"]["eval_reward"] == evals[-1]["eval_reward"]
    assert manifest["datasets"]["eval"]["rows"] == 5


def test_grpo_model_carries_its_last_completions_for_the_report(tiny_model, tmp_path):
    """A real GRPO run logs completions: the model's manifest keeps the last table, and the report
    built from the folder shows them with the reward function's column and the curves."""
    from trainer.stages.rl.grpo import run_grpo

    out = run_grpo(grpo_config(tiny_model, tmp_path, max_steps=2, log_completions_steps=1, num_completions_to_log=3,
                               logging_steps=1))
    manifest = ckpt.read_json(str(Path(out, ckpt.MANIFEST)))
    samples = manifest["samples"]
    assert len(samples) == 3 and {s["step"] for s in samples} == {2}
    assert set(samples[0]) == {"step", "prompt", "completion", "rewards/target_frequency", "reward", "advantage"}
    page = report.render(report.Report("grpo", "", manifest["metrics"], ckpt.read_history(out), samples))
    assert "<th>rewards/target_frequency</th>" in page and "<title>Reward</title>" in page


def test_grpo_rewards_with_a_sentiment_label_and_rejects_a_bad_one_before_training(tiny_model, sentiment_checkpoint,
                                                                                    tmp_path):
    """A 2-label classifier trains GRPO with the probability of POSITIVE as the reward (in [0, 1]); an unknown
    label fails in the input checks: no checkpoint, no metrics."""
    run_grpo(grpo_config(tiny_model, tmp_path, reward_funcs=[sentiment_checkpoint], reward_label="POSITIVE",
                         reward_label_score="probability", max_steps=1))
    rewards = rewards_of(tmp_path / "out")
    assert len(rewards) == 1 and 0.0 < rewards[0] < 1.0
    bad = tmp_path / "bad"
    with pytest.raises(ModelError, match=r"set `reward_label` to one of \['NEGATIVE', 'POSITIVE'\]"):
        run_grpo(grpo_config(tiny_model, tmp_path, reward_funcs=[sentiment_checkpoint], reward_label="positive",
                             output_dir=str(bad)))
    assert not ckpt.read_history(str(bad)) and not ckpt.is_complete(str(bad))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's refusal")
def test_sleep_mode_is_refused_on_the_cpu_before_the_model_loads(tiny_model, tmp_path, monkeypatch):
    """`vllm_enable_sleep_mode` with in-process vLLM on the CPU: one line naming the option and why, before any model
    loads (the loader is replaced by one that fails), nothing written."""
    from trainer.stages.rl import grpo

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(grpo, "load_causal_lm", no_model)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"`vllm_enable_sleep_mode` needs a GPU: vLLM on the CPU") as err:
        run_grpo(grpo_config(tiny_model, tmp_path, rollout_engine="vllm", vllm_enable_sleep_mode=True))
    assert "\n" not in str(err.value)
    assert not ckpt.read_history(str(out)) and not ckpt.is_complete(str(out))


def test_grpo_rloo_estimator_trains(tiny_model, tmp_path):
    run_grpo(grpo_config(tiny_model, tmp_path, advantage_estimator="rloo", max_steps=2))
    assert len(rewards_of(tmp_path / "out")) == 2
    a = load_file(tmp_path / "out" / "model.safetensors")
    b = load_file(Path(tiny_model) / "model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_first_iteration_log_probs_are_the_engines_sampling_log_probs(tiny_model, tmp_path, monkeypatch):
    """At temperature 0.5, the old-policy and reference log-probs GRPO computes before its first update
    (both from the starting weights) equal the hf engine's sampling log-probs, so the first iteration's
    importance ratio is 1; with untempered logits they would differ by ~1 nat."""
    from trainer.stages.rl import grpo

    seen = []
    real_update = grpo.update
    monkeypatch.setattr(grpo, "update", lambda run, traj: seen.append(traj) or real_update(run, traj))
    run_grpo(grpo_config(tiny_model, tmp_path, temperature=0.5, beta=0.1, num_iterations=2, max_steps=2))
    traj = seen[0]
    mask = traj.batch.completion_mask.bool()
    engine = traj.batch.rollout_logps[mask]
    assert mask.sum() > 50
    for name, logps in (("old", traj.old_logps), ("reference", traj.ref_logps)):
        ratio = torch.exp(logps[mask] - engine)
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0, msg=name)
