"""`hf` rollouts: transformers `generate` on the training model itself.

The reference engine the vLLM engines are tested against, and the fallback where vLLM is not
installed. It needs no weight sync (it *is* the policy) but is slower than vLLM on real models
(3x on SmolLM2-135M on CPU): no paged KV cache, a batch runs until its longest member stops,
and `output_scores` keeps one [batch, vocab] tensor per step (`batch_size` bounds that).

Log-probs come from `generate`'s processed scores, i.e. the distribution each token was drawn
from: logits / temperature, then top-k and top-p masking, renormalised by the log-softmax. At
temperature 0 (greedy) they are the log-softmax of the raw logits. This matches vLLM's
`logprobs_mode="processed_logprobs"`, which the vLLM engines use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from trainer.rollout.base import (
    Completion,
    EngineContext,
    PrivateRNG,
    SamplingConfig,
    check_prompts,
    fill_to_n,
    samples_per_request,
    truncate_at_stop,
)


class HFEngine(EngineContext):
    """Rollouts with `model.generate` (left-padded batches of prompts repeated `n` times)."""

    def __init__(self, model, tokenizer, *, seed: int = 0, max_model_len: int | None = None,
                 batch_size: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.batch_size = batch_size  # sequences (prompts x n) per generate call; None = all at once
        pad = tokenizer.pad_token_id if tokenizer is not None else None
        self.pad_token_id = pad if pad is not None else 0
        # A private random stream (CPU + this device), so rollouts neither consume nor reset the
        # trainer's global RNG, and a run with the same seed replays the same rollouts.
        self._rng = PrivateRNG(seed, _device_of(model))

    # -- generation --------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        check_prompts(prompts, sampling.max_new_tokens, self.max_model_len)
        k = samples_per_request(sampling)
        rows = [p for p in prompts for _ in range(k)]  # prompt i -> rows i*k .. i*k+k-1
        size = self.batch_size or len(rows)
        flat: list[Completion] = []
        with _eval_mode(self.model), self._rng.use(sampling.seed), _clean_generation_defaults(self.model):
            for start in range(0, len(rows), size):
                flat += self._generate_rows(rows[start:start + size], sampling)
        return [fill_to_n(flat[i * k:(i + 1) * k], sampling.n) for i in range(len(prompts))]

    def _generate_rows(self, rows: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        device = _device_of(self.model)
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: every row's next token is at column `width`
            input_ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, width - len(r):] = 1
        out = self.model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
            generation_config=self._generation_config(sampling),
        )
        new_tokens = out.sequences[:, width:]  # [B, T]
        # out.scores: T x [B, V] processed logits (-inf where masked); one step at a time, since a
        # stacked [B, T, V] copy of a 50k-150k vocabulary would double generate's peak memory.
        logprobs = torch.stack([F.log_softmax(step.float(), dim=-1).gather(-1, new_tokens[:, t, None])[:, 0]
                                for t, step in enumerate(out.scores)], dim=1)  # [B, T]
        return [truncate_at_stop(t, lp, sampling.stop_token_ids)
                for t, lp in zip(new_tokens.tolist(), logprobs.tolist())]

    def _generation_config(self, sampling: SamplingConfig) -> GenerationConfig:
        stop = list(sampling.stop_token_ids)
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens, min_new_tokens=0, num_beams=1, num_return_sequences=1,
            # No stop list: run to max_new_tokens (the model's own eos only counts when listed).
            eos_token_id=stop or None, pad_token_id=self.pad_token_id,
            do_sample=not sampling.greedy, use_cache=True,
            output_scores=True, return_dict_in_generate=True,
            repetition_penalty=1.0, no_repeat_ngram_size=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
        )
        if not sampling.greedy:
            # top_k=0, not None: None would be filled with transformers' global default of 50.
            config.temperature = sampling.temperature
            config.top_p = sampling.top_p
            config.top_k = 0 if sampling.top_k == -1 else sampling.top_k
        return config

    # -- the rest of the interface -------------------------------------------------------------

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to do: this engine generates with the training model itself."""

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


@contextlib.contextmanager
def _eval_mode(model) -> Iterator[None]:
    """Generate without dropout; give the model back in the mode it came in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _clean_generation_defaults(model) -> Iterator[None]:
    """Hide the checkpoint's generation_config.json while generating.

    `generate` fills every field our config leaves unset from the model's generation_config
    (repetition_penalty, suppress_tokens, min_p …), which would silently change the sampling
    distribution away from `SamplingConfig`. Only transformers' global defaults remain.
    """
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = target.generation_config
    target.generation_config = GenerationConfig()
    try:
        yield
    finally:
        target.generation_config = saved
