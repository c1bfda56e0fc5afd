"""SFT stage: the objective improves, batching is exact, checkpoints are complete or ignored."""

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import (
    CHAT_TEMPLATE,
    SerialSFT,
    history,
    max_difference,
    slow_bf16_kernels,
    weights,
    without_chat_template,
)
from trainer.config.options import parse_config
from trainer.engine import checkpoint as ckpt
from trainer.engine.models import load_causal_lm, load_tokenizer
from trainer.stages.sft import SFTConfig, run_sft


def sft_config(model: str, out: Path, **overrides) -> SFTConfig:
    values = dict(model=model, dataset="demo", output_dir=str(out), max_steps=40, per_device_batch_size=16,
                  learning_rate=3e-3, logging_steps=5, max_length=128, num_sample_completions=0,
                  disable_progress_bar=True)
    values.update(overrides)
    return SFTConfig(**values)


def test_loss_falls_and_final_checkpoint_is_complete(tiny_model, tmp_path):
    out = tmp_path / "sft"
    run_sft(sft_config(tiny_model, out, eval_split_ratio=0.1, num_sample_completions=2))
    records = history(out)
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < 0.6 * losses[0], losses
    for key in ("loss", "grad_norm", "learning_rate", "entropy", "num_tokens", "mean_token_accuracy"):
        assert key in records[0], key
    assert any("eval_loss" in r for r in records)
    manifest = json.loads((out / ckpt.MANIFEST).read_text())
    assert manifest["stage"] == "sft" and manifest["step"] == 40
    assert manifest["datasets"]["train"]["fingerprint"]
    assert manifest["config"]["learning_rate"] == 3e-3
    assert "torch" in manifest["versions"]
    assert ckpt.is_complete(str(out))
    # The saved folder is a loadable HF model with the tokenizer and chat template.
    tok = load_tokenizer(str(out))
    assert tok.chat_template
    load_causal_lm(str(out))


def test_gradient_accumulation_equals_one_large_batch(tiny_model, tmp_path):
    """bs=8 x 1 and bs=4 x 2 see the same 8 examples and normalise by the same token count."""
    run_sft(sft_config(tiny_model, tmp_path / "a", max_steps=2, per_device_batch_size=8))
    run_sft(sft_config(tiny_model, tmp_path / "b", max_steps=2, per_device_batch_size=4,
                       gradient_accumulation_steps=2))
    a = load_file(tmp_path / "a" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model.safetensors")
    start = load_file(Path(tiny_model) / "model.safetensors")
    for name in a:
        assert not torch.equal(a[name], start[name]), f"{name} did not train"
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)  # Adam amplifies summation-order noise


def test_padding_free_batches_train_the_weights_of_padded_ones(tiny_model, tmp_path, monkeypatch):
    """`padding_free` on the CPU: each micro-batch's examples packed into one row, their attention run apart
    (`per_sequence_attention`), with the padded batches' loss and weights (float rounding apart); the packed rows:
    tests/unit/trainer/stages/test_sft.py."""
    from trainer.stages import sft

    trained_on, build = [], sft.micro_batch
    monkeypatch.setattr(sft, "micro_batch", lambda *args: trained_on.append(build(*args)) or trained_on[-1])
    runs = {}
    for free in (False, True):
        out = tmp_path / f"padding-free-{free}"
        trained_on.clear()
        run_sft(sft_config(tiny_model, out, padding_free=free, max_steps=3, per_device_batch_size=4,
                           gradient_accumulation_steps=2, logging_steps=1))
        if free:  # the first: `padding_free_is_exact`'s check
            assert len(trained_on) == 7 and trained_on.pop(0).bounds is not None
        assert len(trained_on) == 6
        if free:
            assert all(len(b.input_ids) == 1 and b.bounds[-1] == b.input_ids.shape[1] == b.num_tokens
                       and len(b.bounds) == 5 for b in trained_on)
        else:
            assert {len(b.input_ids) for b in trained_on} == {4} and all(b.bounds is None for b in trained_on)
        runs[free] = (weights(out), [r["loss"] for r in history(out) if "loss" in r],
                      [r["num_tokens"] for r in history(out) if "num_tokens" in r])
    start = load_file(Path(tiny_model) / "model.safetensors")
    assert any(not torch.equal(runs[True][0][k], start[k]) for k in start)
    for k in start:
        torch.testing.assert_close(runs[True][0][k], runs[False][0][k], atol=1e-4, rtol=0, msg=k)
    assert runs[True][1] == pytest.approx(runs[False][1], rel=1e-5)
    assert runs[True][2] == runs[False][2]  # the same real tokens, none of them padding


@pytest.mark.parametrize("bf16", [False, True])
def test_padding_free_is_the_default_and_falls_back_when_attention_mixes_examples(tiny_model, tmp_path, monkeypatch,
                                                                                  caplog, bf16):
    """`padding_free` is on by default, checked outside bf16 autocast (where the two layouts round apart), and
    turned off, with a warning and in the manifest, for a model whose attention lets one row's examples attend
    to each other (here: bounds and restarting position ids both ignored)."""
    import torch.nn.functional as F
    import transformers.masking_utils as masking

    from trainer.engine import attention
    from trainer.stages import sft

    trained_on, build = [], sft.micro_batch
    monkeypatch.setattr(sft, "micro_batch", lambda *args: trained_on.append(build(*args)) or trained_on[-1])
    kept = tmp_path / "kept"
    with caplog.at_level(logging.WARNING):
        run_sft(sft_config(tiny_model, kept, max_steps=2, per_device_batch_size=4, bf16=bf16))
    assert "padding_free is off" not in caplog.text
    assert all(b.bounds is not None and len(b.input_ids) == 1 for b in trained_on[-2:]), "training stays one-row"
    assert json.loads((kept / ckpt.MANIFEST).read_text())["config"]["padding_free"] is True

    def whole_row(module, query, key, value, bounds, dropout, scaling, longest=None):  # the row's causal attention, no bounds
        groups = query.shape[1] // key.shape[1]
        return F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1),
                                              value.repeat_interleave(groups, 1), is_causal=True,
                                              scale=scaling).transpose(1, 2)

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    monkeypatch.setattr(attention, "per_sequence_attention", whole_row)
    trained_on.clear()
    mixed = tmp_path / "mixed"
    with caplog.at_level(logging.WARNING):
        run_sft(sft_config(tiny_model, mixed, max_steps=2, per_device_batch_size=4, bf16=bf16))
    assert "padding_free is off" in caplog.text
    checked, *trained_on = trained_on
    assert checked.bounds is not None
    assert trained_on and all(b.bounds is None and len(b.input_ids) == 4 for b in trained_on), "training is padded"
    assert json.loads((mixed / ckpt.MANIFEST).read_text())["config"]["padding_free"] is False


def test_bf16_where_the_cpu_has_slow_bf16_kernels_warns_once_and_trains_as_asked(tiny_model, tmp_path, monkeypatch,
                                                                                   caplog):
    """A CPU whose bfloat16 matmuls are slow (faked: the probe measures the hardware, and this suite runs on CPUs
    with and without bf16 kernels) gets one warning that names the option to turn off; the run trains in bf16 as
    asked. In float32 nothing is said."""
    slow_bf16_kernels(monkeypatch)
    with caplog.at_level(logging.WARNING):
        run_sft(sft_config(tiny_model, tmp_path / "bf16", max_steps=1, per_device_batch_size=4, bf16=True))
    assert caplog.text.count("bfloat16 is slow on this CPU") == 1 and "(`--bf16 false`)" in caplog.text
    assert json.loads((tmp_path / "bf16" / ckpt.MANIFEST).read_text())["mixed_precision"] == "bf16"
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run_sft(sft_config(tiny_model, tmp_path / "fp32", max_steps=1, per_device_batch_size=4))
    assert "is slow on this CPU" not in caplog.text


def test_torch_compile_trains_the_weights_of_eager_layers(tiny_model, tmp_path):
    """`torch_compile`: the decoder layers run as compiled graphs and train eager's weights (float rounding
    apart: inductor fuses the elementwise work)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # (a layer compiled by an earlier test in this process would be reused uncounted)
    counters.clear()
    for compiled in (False, True):
        run_sft(sft_config(tiny_model, tmp_path / f"compiled-{compiled}", torch_compile=compiled, max_steps=3,
                           per_device_batch_size=4))
    assert counters["stats"]["unique_graphs"] >= 1
    eager, compiled = weights(tmp_path / "compiled-False"), weights(tmp_path / "compiled-True")
    start = load_file(Path(tiny_model) / "model.safetensors")
    for name in start:
        assert not torch.equal(compiled[name], start[name]), f"{name} did not train"
        torch.testing.assert_close(compiled[name], eager[name], atol=1e-4, rtol=0, msg=name)
    assert [r["loss"] for r in history(tmp_path / "compiled-True")] == pytest.approx(
        [r["loss"] for r in history(tmp_path / "compiled-False")], rel=1e-4)


def test_torch_compile_with_lora_and_gradient_checkpointing_trains_eager_adapters(tiny_model, tmp_path):
    """LoRA adapters inside the compiled decoder layers, with gradient checkpointing recomputing them: the
    adapters train eager's values and the logged losses agree."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for compiled in (False, True):
        run_sft(sft_config(tiny_model, tmp_path / f"compiled-{compiled}", torch_compile=compiled, max_steps=3,
                           per_device_batch_size=4, lora_r=8, learning_rate=1e-2, gradient_checkpointing=True))
    assert counters["stats"]["unique_graphs"] >= 1
    eager, compiled = weights(tmp_path / "compiled-False"), weights(tmp_path / "compiled-True")
    trained_b = [name for name in compiled if "lora_B" in name and compiled[name].abs().max() > 0]
    assert trained_b, "no LoRA B matrix trained"  # they start at zero
    assert max_difference(compiled, eager) <= 1e-4
    assert [r["loss"] for r in history(tmp_path / "compiled-True")] == pytest.approx(
        [r["loss"] for r in history(tmp_path / "compiled-False")], rel=1e-4)


def test_packing_trains(tiny_model, tmp_path):
    out = tmp_path / "packed"
    run_sft(sft_config(tiny_model, out, packing=True, per_device_batch_size=2, max_length=256, max_steps=30))
    losses = [r["loss"] for r in history(out)]
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_arrow_data_trains_the_same_weights_as_the_serial_path(tiny_model, tmp_path, monkeypatch, caplog, packing):
    """The tokens in Arrow (first run: tokenized; second: read from the cache) train exactly the weights that the
    serial in-memory path trained (`tests.helpers.SerialSFT`); chat data with max_length 64 truncates half the rows."""
    import trainer.stages.sft

    monkeypatch.setenv("ALIGNFLOW_CACHE", str(tmp_path / "cache"))
    args = dict(dataset="demo:chat", max_length=64, truncation_mode="keep_end", packing=packing, max_steps=4,
                per_device_batch_size=4, eval_split_ratio=0.1)
    for name in ("arrow", "cached"):
        with caplog.at_level("INFO", logger="trainer.data.token_cache"):
            run_sft(sft_config(tiny_model, tmp_path / name, **args))
    assert caplog.text.count("tokenized data from cache") == 2  # the second run's train and eval data
    with monkeypatch.context() as patch:
        patch.setattr(trainer.stages.sft, "tokenize_sft", SerialSFT)
        run_sft(sft_config(tiny_model, tmp_path / "serial", **args))
    serial, start = weights(tmp_path / "serial"), weights(tiny_model)
    for name in ("arrow", "cached"):
        arrow = weights(tmp_path / name)
        assert arrow.keys() == serial.keys()
        for key in serial:
            assert torch.equal(arrow[key], serial[key]), f"{name}: {key}"
    assert any(not torch.equal(serial[k], start[k]) for k in serial)


def test_chat_data_trains_on_assistant_turns(tiny_model, tmp_path):
    out = tmp_path / "chat"
    run_sft(sft_config(tiny_model, out, dataset="demo:chat", max_length=256, max_steps=30))
    losses = [r["loss"] for r in history(out)]
    assert losses[-1] < 0.7 * losses[0], losses


def test_lora_trains_adapter_and_saves_merged_copy(tiny_model, tmp_path):
    out = tmp_path / "lora"
    run_sft(sft_config(tiny_model, out, lora_r=8, lora_alpha=16, lora_merge_on_save=True, learning_rate=1e-2,
                       max_steps=30))
    losses = [r["loss"] for r in history(out)]
    assert losses[-1] < 0.95 * losses[0], losses  # rank-8 updates of a random 2-layer model learn slowly
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    merged = load_file(out / "merged" / "model.safetensors")
    base = load_file(Path(tiny_model) / "model.safetensors")
    changed = [n for n in base if n in merged and not torch.equal(base[n], merged[n])]
    assert changed, "merging the adapter changed no weight"
    # An adapter folder loads as a model on top of its base.
    load_causal_lm(str(out))


def test_resume_skips_incomplete_checkpoints(tiny_model, tmp_path):
    out = tmp_path / "resume"
    run_sft(sft_config(tiny_model, out, max_steps=6, save_steps=3, save_total_limit=0))
    assert [s for s, _ in ckpt.list_checkpoints(str(out))] == [3]
    # A crash while saving step 5 leaves a folder without the marker: auto must skip it.
    broken = out / "checkpoint-5"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    assert ckpt.resolve_resume("auto", str(out)) == str(out / "checkpoint-3")
    with pytest.raises(ValueError, match="incomplete"):
        ckpt.resolve_resume(str(broken), str(out))
    # And the model loader refuses a folder whose writer died before finishing.
    (out / ckpt.COMPLETE_MARKER).unlink()
    from trainer.engine.models import resolve_model_path
    from trainer.errors import ModelError

    with pytest.raises(ModelError, match="incomplete"):
        resolve_model_path(str(out))


def test_resume_continues_metrics_and_steps(tiny_model, tmp_path):
    out = tmp_path / "cont"
    run_sft(sft_config(tiny_model, out, max_steps=6, save_steps=3, logging_steps=1))
    run_sft(sft_config(tiny_model, out, max_steps=9, save_steps=3, logging_steps=1, resume_from_checkpoint="auto"))
    steps = [r["step"] for r in history(out)]
    # Resumed from checkpoint-3 of the second plan (the first run's final model has no training state).
    assert steps[-1] == 9 and steps == sorted(steps)


def test_cli_runs_demo_config(tiny_model, tmp_path):
    from trainer.cli.main import main

    out = tmp_path / "cli"
    argv = ["train", "sft", "--config", "trainer/configs/sft_demo.yaml", "--model", tiny_model,
            "--output_dir", str(out), "--max_steps", "4", "--save_steps", "2", "--num_sample_completions", "0"]
    assert main(argv) == 0
    assert ckpt.is_complete(str(out))
    config = parse_config(SFTConfig, argv[2:])
    assert config.learning_rate == 3e-3 and config.max_steps == 4


def test_sft_with_a_chat_template_path_saves_it(tiny_model, tmp_path):
    """A base model without a template trains on chat data with the file's template, and keeps it."""
    from transformers import AutoTokenizer

    from trainer.stages.sft import run_sft

    jinja = tmp_path / "chat.jinja"
    jinja.write_text(CHAT_TEMPLATE)
    config = SFTConfig(model=str(without_chat_template(tiny_model, tmp_path)), dataset="demo:chat", max_steps=1,
                       per_device_batch_size=2, output_dir=str(tmp_path / "out"), chat_template_path=str(jinja),
                       num_sample_completions=0, disable_progress_bar=True)
    out = run_sft(config)
    assert AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATE
