"""DPO stage: preferences are learned, every reference source gives the right log-probs, and
runs are exact under precomputation, gradient accumulation and resume."""

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import trainer.stages.dpo as dpo
from tests.helpers import dpo_config, history, write_jsonl
from trainer.config.options import parse_config
from trainer.data.sources import load_rows
from trainer.engine import checkpoint as ckpt
from trainer.engine.loop import step_batches
from trainer.engine.models import apply_lora, load_causal_lm, load_tokenizer
from trainer.stages.dpo import DPOConfig, Reference, collate, load_split, run_dpo, sequence_logps

TRL_METRICS = ("loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
               "rewards/margins", "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected")


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def test_dpo_learns_to_prefer_chosen_on_held_out_pairs(tiny_model, tmp_path):
    out = tmp_path / "dpo"
    run_dpo(dpo_config(tiny_model, out, max_steps=120, logging_steps=10, eval_split_ratio=0.1))
    records = history(out)
    for key in TRL_METRICS:
        assert key in records[0], key
    train, final = records[-2], records[-1]
    assert train["rewards/accuracies"] > 0.8 and train["rewards/margins"] > records[0]["rewards/margins"] > 0, train
    # Held out (60 pairs): the misses are sums and reversed words that the training split never shows,
    # which a 2-layer random-init model cannot get; 0.77-0.88 depending on the tiny model's shape.
    assert final["eval_rewards/accuracies"] > 0.7 and final["eval_rewards/margins"] > 0.5, final
    for key in TRL_METRICS[3:]:
        assert f"eval_{key}" in final, key
    manifest = json.loads((out / ckpt.MANIFEST).read_text())
    assert manifest["stage"] == "dpo" and manifest["step"] == 120
    assert manifest["datasets"]["eval"]["pairs"] == 60
    assert ckpt.is_complete(str(out))
    load_causal_lm(str(out))


def test_default_reference_is_the_starting_policy(tiny_model, tmp_path):
    """At step 1 (metrics are taken before the update) a frozen copy scores exactly like the policy."""
    out = tmp_path / "copy"
    run_dpo(dpo_config(tiny_model, out, max_steps=2))
    first = history(out)[0]
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0
    assert first["loss"] == pytest.approx(0.6931472, abs=1e-6)  # -log σ(0)


def test_explicit_ref_model_scores_the_reference(tiny_model, tmp_path):
    from trainer.cli.init_tiny import init_tiny

    other = str(init_tiny(tmp_path / "other", seed=1))
    out = tmp_path / "explicit"
    config = dpo_config(tiny_model, out, ref_model=other, max_steps=1, per_device_batch_size=8, beta=0.5)
    run_dpo(config)
    # Recompute step 1's rewards/chosen by hand: β · mean(log πθ(y_w) − log πref(y_w)).
    tokenizer = load_tokenizer(tiny_model)
    data = load_split(load_rows("demo:preferences"), "demo", tokenizer, config)
    (indices,) = step_batches(len(data), 8, 1, config.seed, 1)
    batch = collate(data, indices, tokenizer.pad_token_id)
    with torch.no_grad():
        policy = sequence_logps(load_causal_lm(tiny_model), batch).logps[:8]
        ref = sequence_logps(load_causal_lm(other), batch).logps[:8]
    expected = float((0.5 * (policy - ref)).mean())
    assert abs(expected) > 0.1  # the two models disagree, so this checks which one was used
    assert history(out)[0]["rewards/chosen"] == pytest.approx(expected, rel=1e-5)


def test_lora_reference_is_the_base_model_and_lora_trains(tiny_model, tmp_path, count_model_loads):
    tokenizer = load_tokenizer(tiny_model)
    config = dpo_config(tiny_model, tmp_path)
    data = load_split(load_rows("demo:preferences").select(range(8)), "demo", tokenizer, config)
    batch = collate(data, list(range(8)), tokenizer.pad_token_id)
    policy = apply_lora(load_causal_lm(tiny_model), 8, 16, 0.0, ["all-linear"])
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # a trained adapter: the policy now differs from its base
        base = sequence_logps(load_causal_lm(tiny_model), batch).logps
        adapted = sequence_logps(policy, batch).logps
    ref = Reference(policy, adapters=policy).compute(batch)
    assert not torch.allclose(adapted, base, atol=1e-3)
    torch.testing.assert_close(ref, base, atol=1e-5, rtol=1e-5)

    count_model_loads.clear()
    out = tmp_path / "lora"
    run_dpo(dpo_config(tiny_model, out, lora_r=8, lora_alpha=16, learning_rate=1e-2, max_steps=30, logging_steps=5))
    assert len(count_model_loads) == 1, "LoRA must not load a second model for the reference"
    records = history(out)
    # Rank-8 updates of a random 2-layer model learn slowly, but they do learn the preference.
    assert all(r["rewards/margins"] > 0 for r in records), records
    assert sum(r["rewards/accuracies"] for r in records[-3:]) / 3 > 0.6, records
    assert (out / "adapter_model.safetensors").exists()


def test_precomputed_reference_gives_the_same_training(tiny_model, tmp_path, count_model_loads):
    live, cached = tmp_path / "live", tmp_path / "cached"
    run_dpo(dpo_config(tiny_model, live, max_steps=5))
    assert len(count_model_loads) == 2  # policy + frozen copy
    count_model_loads.clear()
    run_dpo(dpo_config(tiny_model, cached, max_steps=5, precompute_ref_log_probs=True, precompute_ref_batch_size=7))
    assert len(count_model_loads) == 1  # the policy scores itself before its first step
    a, b = history(live), history(cached)
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], abs=1e-6)
    assert a[-1]["rewards/margins"] == pytest.approx(b[-1]["rewards/margins"], abs=1e-4)
    start = weights(Path(tiny_model))
    wa, wb = weights(live), weights(cached)
    for name in wa:
        assert not torch.equal(wa[name], start[name]), f"{name} did not train"
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("precompute", [False, True])
def test_resume_from_step_checkpoint_matches_straight_run(tiny_model, tmp_path, precompute, count_model_loads):
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    common = dict(max_steps=6, precompute_ref_log_probs=precompute)
    run_dpo(dpo_config(tiny_model, straight, **common))
    run_dpo(dpo_config(tiny_model, first, save_steps=3, **common))
    count_model_loads.clear()
    run_dpo(dpo_config(tiny_model, resumed, resume_from_checkpoint=str(first / "checkpoint-3"), **common))
    # With precomputation the reference scores come from the checkpoint: no reference model is loaded.
    assert len(count_model_loads) == (1 if precompute else 2)
    a, b = weights(straight), weights(resumed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)
    assert [r["step"] for r in history(resumed)] == list(range(1, 7))


def test_padding_free_batches_score_like_padded_ones(tiny_model, tmp_path):
    tokenizer = load_tokenizer(tiny_model)
    # Row 3 with an empty prompt: the first reply token has nothing to be predicted from.
    rows = load_rows("demo:preferences").select(range(12)).map(lambda row, i: {"prompt": "" if i == 3 else row["prompt"]},
                                                                 with_indices=True)
    data = load_split(rows, "demo", tokenizer, dpo_config(tiny_model, tmp_path))
    assert data.prompt_ids[3] == []
    model = load_causal_lm(tiny_model)
    padded = collate(data, list(range(12)), tokenizer.pad_token_id)
    packed = collate(data, list(range(12)), tokenizer.pad_token_id, pack_to=128)
    assert packed.input_ids.size(0) < 24 and packed.attention_mask is None
    assert packed.num_tokens == padded.num_tokens
    with torch.no_grad():
        a, b = sequence_logps(model, padded), sequence_logps(model, packed)
    assert torch.equal(a.lengths, b.lengths)
    assert a.lengths[3] == len(data.chosen_ids[3]) - 1
    torch.testing.assert_close(a.logps, b.logps, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(a.logit_sums, b.logit_sums, atol=1e-4, rtol=1e-5)
    run_dpo(dpo_config(tiny_model, tmp_path / "pf", max_steps=3, precompute_ref_log_probs=True))
    run_dpo(dpo_config(tiny_model, tmp_path / "pad", max_steps=3, padding_free=False))
    for ra, rb in zip(history(tmp_path / "pf"), history(tmp_path / "pad"), strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-5) and ra["num_tokens"] == rb["num_tokens"]


@pytest.mark.parametrize("bf16", [False, True])
def test_padding_free_falls_back_when_attention_mixes_packed_sequences(tiny_model, tmp_path, monkeypatch, caplog,
                                                                       bf16):
    """A model that ignores restarting position ids would let packed sequences attend to each other; caught under
    bf16 autocast too, where the check allows for rounding."""
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    packs = []
    real_collate = dpo.collate
    monkeypatch.setattr(dpo, "collate", lambda *a, **k: packs.append(a[3:] or k) or real_collate(*a, **k))
    with caplog.at_level(logging.WARNING, logger="trainer.stages.dpo"):
        run_dpo(dpo_config(tiny_model, tmp_path / "mixed", max_steps=2, bf16=bf16))
    assert "padding_free is off" in caplog.text
    assert packs[-1] in ((0,), {}), "training batches must be padded after the check fails"
    first = history(tmp_path / "mixed")[0]
    # Under autocast the policy's training forward (dense attention) and the reference's (sdpa) round apart.
    tolerance = 1e-3 if bf16 else 1e-6
    assert first["rewards/chosen"] == pytest.approx(0.0, abs=tolerance)
    assert first["loss"] == pytest.approx(0.6931472, abs=tolerance)


def test_padding_free_is_checked_outside_bf16_autocast(tiny_model, tmp_path, monkeypatch, caplog):
    """Under bf16 autocast the packed and the padded layout round differently (SmolLM2 on HH pairs: 1e-3 to 3e-3
    nats per token; 0.68 when packed sequences attend to each other), which turned packing off in every bf16 run.
    The check runs the float32 master weights without autocast, and training stays packed."""
    autocast_in_check, packs = [], []
    real_check, real_collate = dpo.packing_is_exact, dpo.collate

    def check(*args, **kwargs):
        hook = torch.nn.modules.module.register_module_forward_hook(
            lambda *_: autocast_in_check.append(torch.is_autocast_enabled("cpu")))
        try:
            return real_check(*args, **kwargs)
        finally:
            hook.remove()

    monkeypatch.setattr(dpo, "packing_is_exact", check)
    monkeypatch.setattr(dpo, "collate", lambda *a, **k: packs.append(a[3:] or k) or real_collate(*a, **k))
    with caplog.at_level(logging.WARNING, logger="trainer.stages.dpo"):
        run_dpo(dpo_config(tiny_model, tmp_path / "bf16", max_steps=2, bf16=True))
    assert autocast_in_check and not any(autocast_in_check)
    assert "padding_free is off" not in caplog.text
    assert packs[-1] == (128,), "training batches stay packed"


def test_gradient_accumulation_equals_one_large_batch(tiny_model, tmp_path):
    run_dpo(dpo_config(tiny_model, tmp_path / "a", max_steps=2, per_device_batch_size=8))
    run_dpo(dpo_config(tiny_model, tmp_path / "b", max_steps=2, per_device_batch_size=4,
                       gradient_accumulation_steps=2))
    # Adam's update hardly depends on the gradient's scale, so compare the pre-clip gradient norm too.
    for ra, rb in zip(history(tmp_path / "a"), history(tmp_path / "b"), strict=True):
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-4, rtol=1e-4)  # Adam amplifies summation-order noise


@pytest.mark.parametrize("loss_type,extra", [("sigmoid", {}), ("ipo", {}), ("hinge", {}),
                                             ("robust", {"label_smoothing": 0.1}), ("apo_zero", {}),
                                             ("simpo", {"beta": 2.0})])
def test_every_loss_type_trains(tiny_model, tmp_path, loss_type, extra, count_model_loads):
    out = tmp_path / loss_type
    run_dpo(dpo_config(tiny_model, out, loss_type=loss_type, max_steps=8, learning_rate=1e-2, **extra))
    records = history(out)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert records[-1]["rewards/margins"] > records[0]["rewards/margins"], [r["rewards/margins"] for r in records]
    # simpo is reference-free: only the policy is loaded.
    assert len(count_model_loads) == (1 if loss_type == "simpo" else 2)


def test_identical_pairs_are_dropped_with_a_warning(tiny_model, tmp_path, caplog):
    rows = [{"prompt": "What is 2 plus 2?", "chosen": " 4.", "rejected": " 5."}] * 5
    rows += [{"prompt": "Say yes.", "chosen": " Yes.", "rejected": " Yes."}] * 3
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "dropped"
    with caplog.at_level(logging.WARNING, logger="trainer.data.preferences"):
        run_dpo(dpo_config(tiny_model, out, dataset=str(path), max_steps=1))
    assert "dropped 3 of 8 pairs whose chosen equals their rejected" in caplog.text
    assert json.loads((out / ckpt.MANIFEST).read_text())["datasets"]["train"]["pairs"] == 5


def test_chat_pairs_train(tiny_model, tmp_path):
    path = tmp_path / "chat.jsonl"
    row = {"prompt": [{"role": "user", "content": "Capital of Peru?"}],
           "chosen": [{"role": "assistant", "content": "Lima."}],
           "rejected": [{"role": "assistant", "content": "Paris."}]}
    write_jsonl(path, [row])
    out = tmp_path / "chat"
    run_dpo(dpo_config(tiny_model, out, dataset=str(path), max_steps=5, per_device_batch_size=1))
    tokenizer = load_tokenizer(tiny_model)
    data = load_split(load_rows(str(path)), "chat", tokenizer, dpo_config(tiny_model, out))
    assert tokenizer.decode(data.prompt_ids[0]).endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(data.chosen_ids[0]) == "Lima.<|im_end|>\n"  # no extra eos after the template's
    assert history(out)[-1]["rewards/margins"] > 0


def test_cli_runs_demo_config(tiny_model, tmp_path):
    from trainer.cli.main import main

    out = tmp_path / "cli"
    argv = ["train", "dpo", "--config", "trainer/configs/dpo_demo.yaml", "--model", tiny_model,
            "--output_dir", str(out), "--max_steps", "4", "--save_steps", "2"]
    assert main(argv) == 0
    assert ckpt.is_complete(str(out)) and ckpt.is_complete(str(out / "checkpoint-2"))
    config = parse_config(DPOConfig, argv[2:])
    assert config.learning_rate == 3e-3 and config.max_steps == 4 and config.dataset == "demo:preferences"
