"""The rollout interface and the `hf` engine, the reference the vLLM engines are tested against."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, forward_logprobs, model_greedy, perturb
from trainer.rollout import Completion, HFEngine, RolloutEngine, SamplingConfig, make_engine
from trainer.rollout.base import fill_to_n, truncate_at_stop

MAX_NEW = 16


@pytest.fixture(scope="module")
def policy(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    perturb(model, seed=0)
    model.train()  # the engine must switch to eval for generation and back
    return model, AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def prompts(policy) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    vocab = policy[0].config.vocab_size
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (3, 9, 20)]


# -- the interface ------------------------------------------------------------------------------


def test_sampling_config_rejects_values_that_engines_would_misread():
    for bad in (dict(top_k=0), dict(n=0), dict(temperature=-1.0), dict(top_p=0.0), dict(max_new_tokens=0)):
        with pytest.raises(ValueError):
            SamplingConfig(**{"max_new_tokens": 4, **bad})
    assert SamplingConfig(max_new_tokens=4, temperature=0).greedy


def test_truncate_at_stop_keeps_the_first_stop_token_and_drops_the_rest():
    c = truncate_at_stop([5, 7, 2, 9, 2], [-0.5, -1.0, -2.0, -3.0, -4.0], [2, 11])
    assert c == Completion([5, 7, 2], [-0.5, -1.0, -2.0], "stop")
    assert truncate_at_stop([5, 7], [-0.5, -1.0], [2]).finish_reason == "length"
    assert truncate_at_stop([5, 7], [-0.5, -1.0], []).token_ids == [5, 7]
    with pytest.raises(ValueError):
        Completion([1, 2], [0.0], "length")


def test_fill_to_n_copies_the_greedy_sample():
    copies = fill_to_n([Completion([1], [-0.1], "length")], 3)
    assert len(copies) == 3 and all(c.token_ids == [1] for c in copies)
    copies[0].token_ids.append(5)
    assert copies[1].token_ids == [1]  # independent lists


def test_make_engine_builds_hf_and_rejects_unknown_kinds(policy):
    model, tokenizer = policy
    engine = make_engine("hf", model=model, tokenizer=tokenizer, model_path="unused", max_model_len=64)
    assert isinstance(engine, HFEngine) and isinstance(engine, RolloutEngine)
    with pytest.raises(ValueError, match="prompt 0"):
        engine.generate([[1] * 60], SamplingConfig(max_new_tokens=8))
    with pytest.raises(ValueError, match="unknown rollout engine"):
        make_engine("sglang", model=model, tokenizer=tokenizer, model_path="unused", max_model_len=64)


def test_only_vllm_engine_and_the_server_import_vllm_and_only_lazily():
    """STYLE rule 5: vllm appears in the in-process engine and the rollout server only, and importing the
    package (or the server's client) does not load it."""
    root = ROOT / "trainer"
    importers = {str(p.relative_to(root)) for p in root.rglob("*.py")
                 if re.search(r"^\s*(import vllm|from vllm[ .])", p.read_text(), re.M)}
    assert importers <= {"rollout/vllm_engine.py", "rollout/server.py"}
    code = ("import sys, trainer.rollout, trainer.rollout.vllm_engine, trainer.rollout.vllm_ext, "
            "trainer.rollout.server, trainer.rollout.server_client; "
            "assert 'vllm' not in sys.modules, 'vllm imported at module level'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root.parent)


# -- HFEngine ---------------------------------------------------------------------------------


def test_hf_returns_n_completions_per_prompt_with_one_logprob_per_token(policy, prompts):
    model, tokenizer = policy
    out = HFEngine(model, tokenizer).generate(prompts, SamplingConfig(max_new_tokens=MAX_NEW, n=4))
    assert [len(samples) for samples in out] == [4, 4, 4]
    for samples in out:
        for c in samples:
            assert 1 <= len(c.token_ids) <= MAX_NEW and len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0 for lp in c.logprobs) and c.finish_reason == "length"
        assert len({tuple(c.token_ids) for c in samples}) > 1  # n independent samples, not copies
    assert model.training  # train mode restored


def test_hf_greedy_equals_model_generate(policy, prompts):
    model, tokenizer = policy
    out = HFEngine(model, tokenizer).generate(prompts, SamplingConfig(max_new_tokens=MAX_NEW, temperature=0, n=2))
    for prompt, samples in zip(prompts, out):
        expected = model_greedy(model, prompt, MAX_NEW)
        assert len(set(expected)) > 2  # a real sequence, not one repeated token
        assert [c.token_ids for c in samples] == [expected, expected]


def test_hf_truncates_after_the_first_stop_token(policy, prompts):
    model, tokenizer = policy
    engine = HFEngine(model, tokenizer)
    greedy = SamplingConfig(max_new_tokens=MAX_NEW, temperature=0)
    full = engine.generate(prompts, greedy)[0][0].token_ids
    stop = full[3]
    cut = full.index(stop) + 1
    out = engine.generate(prompts, SamplingConfig(max_new_tokens=MAX_NEW, temperature=0, stop_token_ids=[stop]))
    assert out[0][0].token_ids == full[:cut] and out[0][0].finish_reason == "stop"
    assert len(out[0][0].logprobs) == cut
    for samples in out[1:]:  # the others stop at their own first `stop`, or run to the limit
        c = samples[0]
        assert stop not in c.token_ids[:-1]
        assert c.finish_reason == ("stop" if c.token_ids[-1] == stop else "length")
    # Sampled completions, batched with padding: nothing after a stop token either.
    frequent = max(set(full), key=full.count)
    for samples in engine.generate(prompts, SamplingConfig(max_new_tokens=MAX_NEW, n=4, stop_token_ids=[frequent])):
        for c in samples:
            assert frequent not in c.token_ids[:-1]


def test_hf_logprobs_equal_the_forward_log_softmax_at_temperature_1(policy, prompts):
    model, tokenizer = policy
    out = HFEngine(model, tokenizer).generate(prompts, SamplingConfig(max_new_tokens=MAX_NEW, n=2, seed=3))
    for prompt, samples in zip(prompts, out):
        for c in samples:
            expected = forward_logprobs(model, prompt, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_hf_logprobs_are_the_sampling_distribution_after_temperature_and_top_k(policy, prompts):
    model, tokenizer = policy
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=0.7, top_k=5, n=2, seed=4)
    for prompt, samples in zip(prompts, HFEngine(model, tokenizer).generate(prompts, sampling)):
        for c in samples:
            expected = forward_logprobs(model, prompt, c.token_ids, temperature=0.7, top_k=5)
            assert torch.isfinite(expected).all()  # every sampled token is in its step's top 5
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_hf_ignores_the_checkpoints_generation_defaults(policy, prompts):
    """A generation_config.json with sampling knobs must not change what SamplingConfig asks for."""
    model, tokenizer = policy
    saved = model.generation_config
    model.generation_config = type(saved)(**{**saved.to_dict(), "repetition_penalty": 3.0, "top_k": 2,
                                              "suppress_tokens": list(range(4, 300))})
    try:
        out = HFEngine(model, tokenizer).generate(prompts[:1], SamplingConfig(max_new_tokens=MAX_NEW, seed=5))
        c = out[0][0]
        torch.testing.assert_close(torch.tensor(c.logprobs), forward_logprobs(model, prompts[0], c.token_ids),
                                   atol=1e-4, rtol=0)
        assert model.generation_config.repetition_penalty == 3.0  # the model's own config is left alone
    finally:
        model.generation_config = saved


def test_hf_seeds_reproduce_and_leave_the_global_rng_alone(policy, prompts):
    model, tokenizer = policy
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, n=2)
    torch.manual_seed(99)
    state = torch.get_rng_state()
    a, b = HFEngine(model, tokenizer, seed=7), HFEngine(model, tokenizer, seed=7)
    first = a.generate(prompts, sampling)
    assert b.generate(prompts, sampling) == first  # same engine seed, same stream
    assert a.generate(prompts, sampling) != first  # the stream moves on between calls
    seeded = SamplingConfig(max_new_tokens=MAX_NEW, n=2, seed=11)
    assert a.generate(prompts, seeded) == b.generate(prompts, seeded)
    assert torch.equal(torch.get_rng_state(), state)  # the trainer's RNG is untouched


def test_hf_engine_is_a_context_manager_with_noop_lifecycle(policy, prompts):
    model, tokenizer = policy
    with HFEngine(model, tokenizer) as engine:
        engine.sync_weights(model.state_dict().items())
        engine.sleep()
        assert len(engine.generate(prompts[:1], SamplingConfig(max_new_tokens=2))[0]) == 1
    engine.close()  # idempotent


def test_a_sleeping_vllm_engine_wakes_for_the_push_and_the_rollout(monkeypatch):
    """With sleep mode, `sleep()` after a rollout frees vLLM's weights and KV cache (level 2); the push wakes the
    weights' memory only and loads them, the next rollout the rest; a rollout with no push since is refused. Without
    sleep mode, sleep() does nothing. A stand-in for vLLM's `LLM` (sleep mode needs a GPU)."""
    pytest.importorskip("vllm")
    from trainer.rollout import vllm_engine

    class FakeLLM:
        def __init__(self):
            self.calls = []

        def sleep(self, level):
            self.calls.append(("sleep", level))

        def wake_up(self, tags=None):
            self.calls.append(("wake_up", tags))

        def collective_rpc(self, method, kwargs):
            self.calls.append((method, [name for name, _ in kwargs["weights_iterator"]]))

        def reset_prefix_cache(self):
            self.calls.append(("reset_prefix_cache",))
            return True

        def generate(self, prompts, params, use_tqdm):
            self.calls.append(("generate", len(prompts)))
            return []

    monkeypatch.setattr(vllm_engine, "check_complete", lambda names, expected: list(names))

    def engine(sleep_mode: bool):
        e = vllm_engine.VLLMEngine.__new__(vllm_engine.VLLMEngine)
        e.llm, e.max_model_len, e._cuda, e._weight_names = FakeLLM(), 64, True, {"w"}
        e.llm.llm_engine = type("E", (), {"model_config": type("C", (), {"dtype": torch.bfloat16})})()
        e._rng = vllm_engine.PrivateRNG(0, torch.device("cpu"))
        e._sleep_mode, e._asleep, e._weights_back = sleep_mode, False, False
        return e

    sleepy, sampling = engine(True), SamplingConfig(max_new_tokens=2, seed=None)
    sleepy.generate([[1, 2]], sampling)
    sleepy.sleep()
    sleepy.sleep()  # already asleep: nothing more
    with pytest.raises(RuntimeError, match="no weights were pushed since"):
        sleepy.generate([[1, 2]], sampling)
    sleepy.sync_weights([("w", torch.ones(2))])
    sleepy.generate([[1, 2]], sampling)
    assert sleepy.llm.calls == [("generate", 1), ("sleep", 2), ("wake_up", ["weights"]), ("reload_weights", ["w"]),
                                ("wake_up", None), ("reset_prefix_cache",), ("generate", 1)]
    awake = engine(False)
    awake.sleep()
    awake.sync_weights([("w", torch.ones(2))])
    assert awake.llm.calls == [("reload_weights", ["w"]), ("reset_prefix_cache",)]


def test_vllm_engines_know_which_weights_a_sync_needs(tiny_model, policy):
    from trainer.rollout.vllm_engine import check_complete, checkpoint_weight_names

    model, _ = policy
    names = checkpoint_weight_names(tiny_model)
    assert names and names <= set(model.state_dict())  # the tied lm_head is not stored
    check_complete(model.state_dict(), names)
    with pytest.raises(ValueError, match="2 missing"):
        check_complete([n for n in model.state_dict() if "layers.0.mlp.up_proj" not in n and n != "model.norm.weight"],
                        names)


def test_vllm_reload_drops_only_the_benign_rotary_warning():
    """vLLM warns "RotaryEmbedding: Failed to load weights" on every weight push; only that line goes."""
    import logging

    from trainer.rollout.vllm_engine import _BenignReloadWarning, quiet_benign_reload_warning

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        quiet_benign_reload_warning()
        quiet_benign_reload_warning()  # idempotent
        for layer in ("RotaryEmbedding", "QKVParallelLinear"):
            logger.warning("%s: Failed to load weights", layer)
    finally:
        logger.removeHandler(handler)
    assert seen == ["QKVParallelLinear: Failed to load weights"]
    assert sum(isinstance(f, _BenignReloadWarning) for f in logger.filters) == 1


def test_vllm_request_seeds_never_repeat_across_steps_prompts_and_samples():
    from trainer.rollout.vllm_engine import request_seed

    per_sample = set()
    for step_seed in range(5):  # e.g. seed = config.seed + step
        sampling = SamplingConfig(max_new_tokens=4, n=8, seed=step_seed)
        for prompt in range(16):
            first = request_seed(sampling, prompt, per_request_seeds=True)
            per_sample.update(first + j for j in range(sampling.n))  # vLLM's child seeds
    assert len(per_sample) == 5 * 16 * 8
    assert request_seed(SamplingConfig(max_new_tokens=4), 3, per_request_seeds=True) is None
    assert request_seed(SamplingConfig(max_new_tokens=4, seed=1), 3, per_request_seeds=False) is None  # CPU


def test_the_cpu_kv_cache_holds_the_largest_call_at_full_length(tmp_path, monkeypatch):
    """Keys and values of every layer's KV heads, for each sequence in whole 32-token blocks; at least the floor;
    None where the config does not give the attention's shape, and where VLLM_CPU_KVCACHE_SPACE sets the size."""
    from transformers import LlamaConfig

    from trainer.rollout.vllm_engine import MIN_CPU_KV_CACHE, cpu_kv_cache_bytes

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)

    def saved(name: str, **fields) -> str:
        LlamaConfig(**fields).save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    smollm2 = saved("gqa", num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    # SmolLM2-135M: 30 layers x (K + V) x 3 KV heads x 64 dims x 2 bytes = 23,040 bytes a token; 600 -> 608 tokens.
    assert cpu_kv_cache_bytes(smollm2, max_model_len=600, sequences=64, dtype="bfloat16") == 64 * 608 * 23_040
    assert cpu_kv_cache_bytes(smollm2, max_model_len=600, sequences=64, dtype="float32") == 2 * 64 * 608 * 23_040
    assert cpu_kv_cache_bytes(smollm2, max_model_len=576, sequences=16, dtype="bfloat16") == MIN_CPU_KV_CACHE
    wide = saved("head_dim", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, head_dim=128)
    assert cpu_kv_cache_bytes(wide, max_model_len=4096, sequences=256, dtype="bfloat16") == 256 * 4096 * 2 * 2 * 4 * 128 * 2
    assert cpu_kv_cache_bytes(smollm2, max_model_len=600, sequences=64, dtype="auto") is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert cpu_kv_cache_bytes(smollm2, max_model_len=600, sequences=64, dtype="bfloat16") is None


def test_the_rollout_server_sizes_its_cpu_kv_cache_to_max_num_seqs(tmp_path, monkeypatch):
    """`alignflow rollout-server --max_num_seqs N`: vLLM's --max-num-seqs, and on the CPU a KV cache of N sequences at
    max_model_len (the model's when unset; `--dtype auto` counted as float32); without N, or with
    VLLM_CPU_KVCACHE_SPACE set, no size of its own (the server then keeps its 4 GiB default or the variable's)."""
    from transformers import LlamaConfig

    from trainer.rollout.server import cpu_kv_cache_size, make_parser, vllm_arguments

    LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                max_position_embeddings=2048).save_pretrained(tmp_path)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)

    def size(*flags: str) -> int | None:
        return cpu_kv_cache_size(make_parser().parse_args(["--model", str(tmp_path), *flags]))

    per_token = 23_040  # SmolLM2's shape in bf16: 30 layers x (K + V) x 3 KV heads x 64 dims x 2 bytes
    assert size("--max_num_seqs", "32", "--max_model_len", "600", "--dtype", "bfloat16") == 32 * 608 * per_token
    assert size("--max_num_seqs", "32", "--dtype", "bfloat16") == 32 * 2048 * per_token
    assert size("--max_num_seqs", "32") == 2 * 32 * 2048 * per_token  # auto: as float32
    assert size() is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert size("--max_num_seqs", "32") is None
    args = make_parser().parse_args(["--model", str(tmp_path), "--max_num_seqs", "32"])
    argv = vllm_arguments(args, cuda=False, kv_cache_bytes=12345)
    assert argv[argv.index("--max-num-seqs") + 1] == "32" and argv[argv.index("--kv-cache-memory-bytes") + 1] == "12345"
    assert "--max-num-seqs" not in vllm_arguments(make_parser().parse_args(["--model", str(tmp_path)]), cuda=False)
