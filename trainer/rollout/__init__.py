"""Rollout engines for on-policy RL: `generate(prompts, sampling)` and `sync_weights(named_tensors)`.

- ``hf``: transformers `generate` on the training model (reference; no vLLM needed).
- ``vllm``: vLLM in the training process ("colocate"), weights pushed in place.
- ``vllm-server``: one `alignflow rollout-server` for the whole job (server.py), reached over HTTP
  (server_client.py): a running one given by URL, or one started as a child of this process.

Only `vllm_engine.py` and `server.py` import vllm, and only when a vLLM engine or server is made.
"""

from __future__ import annotations

from trainer.errors import MissingExtra
from trainer.extras import message
from trainer.rollout.base import Completion, RolloutEngine, SamplingConfig
from trainer.rollout.hf import HFEngine
from trainer.rollout.weight_group import DEFAULT_PORT

ENGINE_KINDS = ("hf", "vllm", "vllm-server")

__all__ = ["ENGINE_KINDS", "Completion", "HFEngine", "RolloutEngine", "SamplingConfig", "make_engine"]


def make_engine(kind: str, *, model, tokenizer, model_path: str, max_model_len: int, dtype: str = "float32",
                seed: int = 0, gpu_memory_utilization: float = 0.3, server_devices: str | None = None,
                server_url: str | None = None, server_timeout_s: float = 240, group_port: int | None = DEFAULT_PORT,
                weight_channel: str | None = None, synced_gpus: bool = False, sleep_mode: bool = False,
                max_sequences: int | None = None) -> RolloutEngine:
    """Build a rollout engine.

    `model` / `tokenizer` serve the ``hf`` engine; the vLLM engines load `model_path` (an HF
    folder with config, weights and tokenizer) and then receive weights through sync_weights().
    `seed` seeds the engine's own random stream (SamplingConfig.seed=None continues it).
    ``vllm-server``: `server_url` is a running `alignflow rollout-server`; None starts one as a child of
    this process (stopped by close()), on `server_devices` (its CUDA_VISIBLE_DEVICES, e.g. "1"; None
    inherits the variable). `server_timeout_s` bounds the wait for it to answer and the forming of the weight
    group at `group_port` (TRL's `vllm_group_port`; 0: none); `weight_channel` forces how weights are sent
    (server_client.CHANNELS; None chooses).
    `synced_gpus`: the hf engine's ranks step together (DeepSpeed ZeRO-3 on several ranks).
    `sleep_mode`: the ``vllm`` engine frees its GPU memory when told to sleep (VLLMEngine.sleep; GPUs only).
    `max_sequences`: the most sequences one generate() call holds (for a server started here: all the calls it serves
    at once); on the CPU it sizes the KV cache of the ``vllm`` engine and of a started server (its --max_num_seqs).
    """
    if kind == "hf":
        return HFEngine(model, tokenizer, seed=seed, max_model_len=max_model_len, synced_gpus=synced_gpus)
    if kind not in ("vllm", "vllm-server"):
        raise ValueError(f"unknown rollout engine {kind!r}; choose one of {', '.join(ENGINE_KINDS)}")
    if kind == "vllm-server":
        from trainer.rollout.server_client import ServerProcess, VLLMServerEngine

        if server_url is not None:
            return VLLMServerEngine(server_url, max_model_len=max_model_len, timeout_s=server_timeout_s,
                                    group_port=group_port, channel=weight_channel)
        from trainer.rollout import vllm_engine

        if not vllm_engine.vllm_available():
            raise MissingExtra(message("vllm", f"The {kind!r} rollout engine (the 'hf' engine needs nothing more)"))
        server = ServerProcess(model_path, max_model_len=max_model_len, dtype=dtype, seed=seed,
                               gpu_memory_utilization=gpu_memory_utilization, devices=server_devices,
                               max_num_seqs=max_sequences)
        return VLLMServerEngine(server.url, max_model_len=max_model_len, timeout_s=server_timeout_s, server=server,
                                group_port=group_port, channel=weight_channel)
    from trainer.rollout import vllm_engine

    if not vllm_engine.vllm_available():
        raise MissingExtra(message("vllm", f"The {kind!r} rollout engine (the 'hf' engine needs nothing more)"))
    return vllm_engine.VLLMEngine(model_path, max_model_len=max_model_len, dtype=dtype, seed=seed,
                                  gpu_memory_utilization=gpu_memory_utilization, sleep_mode=sleep_mode,
                                  max_sequences=max_sequences)
