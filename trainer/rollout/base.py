"""The rollout interface: what GRPO/PPO ask of a generation engine, and the types crossing it.

Every engine returns, for each prompt, `n` completions as token ids plus the log-probability the
engine itself assigned to each sampled token. Those log-probs are the *behaviour policy* of
truncated importance sampling (trainer/algorithms/policy.py `rollout_is_weights`): they are taken from the
distribution the token was actually drawn from, i.e. after temperature scaling and top-k / top-p
filtering (renormalised). At temperature 0 (greedy) they are the plain log-softmax of the logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length"]


@dataclass
class SamplingConfig:
    """How to sample completions. Engines treat every field the same way."""

    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    n: int = 1  # completions per prompt (GRPO's num_generations)
    # An int makes this call reproducible on its own (same call, same seed, same completions; per
    # engine, engines differ), also across a resume: pass e.g. config.seed + step. Every prompt and
    # sample of the call gets its own seed, and seeds s and s+1 share none. None continues the
    # engine's own stream (seeded by make_engine(seed=...)): reproducible for `hf` and in-process
    # `vllm`, not for `vllm-server` unseeded (concurrent requests batch in arrival order). The
    # server seeds every request, also on the CPU (where it turns chunked prefill off; server.py).
    seed: int | None = None
    # With a seed: a stable key per prompt of the call (e.g. its index in the dataset). A prompt's
    # samples then depend only on (seed, key) and the model, not on the prompts batched with it
    # or the rank that draws it, so N ranks sample what one process would (hf, vllm-server, GPU vLLM). None:
    # the prompt's position in the call.
    prompt_keys: list[int] | None = None
    # Generation stops after the first of these ids (which is kept in the completion). Nothing
    # else stops it: the model's own eos only counts when it is listed here.
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]  # [L] completion only; ends with the stop token when finish_reason == "stop"
    logprobs: list[float]  # [L] log-prob of each token under the distribution it was sampled from
    finish_reason: FinishReason  # "stop": ended on a stop token; "length": hit max_new_tokens

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} logprobs")


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation engine for on-policy RL. Engines are context managers; close() is idempotent."""

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """Sample `sampling.n` completions for each prompt (token ids, no padding). -> [num_prompts][n]"""
        ...

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights: the whole state_dict() of the un-wrapped HF causal LM, HF names.

        Not a subset: vLLM fuses q/k/v and gate/up, so partial updates corrupt those layers.
        PEFT models: merge the adapter first and pass the merged base model's state dict.
        """
        ...

    def sleep(self) -> None:
        """Free the engine's device memory for the update, after a rollout (a no-op where it has nothing to free).
        The engine wakes by itself: the next sync_weights() and generate() bring back what they need."""
        ...

    def close(self) -> None:
        """Release the engine (idempotent)."""
        ...


def truncate_at_stop(token_ids: Sequence[int], logprobs: Sequence[float], stop_token_ids: Iterable[int],
                     ) -> Completion:
    """Cut a raw generation after its first stop token (kept); "length" when there is none."""
    stops = set(stop_token_ids)
    for i, token in enumerate(token_ids):
        if token in stops:
            return Completion(list(token_ids[: i + 1]), [float(x) for x in logprobs[: i + 1]], "stop")
    return Completion(list(token_ids), [float(x) for x in logprobs], "length")


def sample_seed(sampling: SamplingConfig, prompt_index: int) -> int:
    """The seed of prompt `prompt_index`'s first sample in a seeded call; sample j uses it + j.

    The call's seed is spread by 2**20 so that calls with seeds s and s+1 (e.g. one per training
    step) never share a per-sample seed while a call has fewer than 2**20 samples.
    """
    key = sampling.prompt_keys[prompt_index] if sampling.prompt_keys is not None else prompt_index
    return (sampling.seed * 2**20 + key * sampling.n) % 2**62  # int64, room for + n


def samples_per_request(sampling: SamplingConfig) -> int:
    """Greedy samples of one prompt are identical: engines compute one and copy it (vLLM rejects n > 1)."""
    return 1 if sampling.greedy else sampling.n


def fill_to_n(samples: list[Completion], n: int) -> list[Completion]:
    """The n completions of one prompt from `samples_per_request` samples (independent copies)."""
    if len(samples) == n:
        return samples
    return [Completion(list(c.token_ids), list(c.logprobs), c.finish_reason) for c in samples * n][:n]


def check_prompts(prompts: list[list[int]], max_new_tokens: int, max_model_len: int | None = None) -> None:
    """Fail early, with the offending prompt's index, instead of deep inside an engine."""
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        if max_model_len is not None and len(prompt) + max_new_tokens > max_model_len:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} it "
                             f"exceeds max_model_len={max_model_len}: raise max_model_len or truncate prompts")


class EngineContext:
    """Context-manager behaviour shared by the engines: `with engine: ...` closes it on exit."""

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class PrivateRNG:
    """A torch RNG state (CPU + one CUDA device) kept aside from the global one, swapped in while generating.

    Rollouts then neither consume nor reset the trainer's global RNG, and a run with the same
    seed replays the same rollouts.
    """

    def __init__(self, seed: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        with torch.random.fork_rng(devices=[device] if self.cuda else []):
            torch.manual_seed(seed)
            self.state = self._get()

    def _get(self):
        return torch.get_rng_state(), (torch.cuda.get_rng_state(self.device) if self.cuda else None)

    def _set(self, state) -> None:
        torch.set_rng_state(state[0])
        if self.cuda:
            torch.cuda.set_rng_state(state[1], self.device)

    @contextlib.contextmanager
    def use(self, seed: int | None) -> Iterator[None]:
        """Generate from this stream (advancing it), or from `seed` alone when it is given."""
        with torch.random.fork_rng(devices=[self.device] if self.cuda else []):
            if seed is None:
                self._set(self.state)
            else:
                torch.manual_seed(seed)
            yield
            if seed is None:
                self.state = self._get()
