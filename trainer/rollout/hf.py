"""`hf` rollouts: transformers `generate` on the training model itself.

The reference engine the vLLM engines are tested against, and the fallback where vLLM is not
installed. It needs no weight sync (it *is* the policy) but is slower than vLLM on real models
(3x on SmolLM2-135M on CPU): no paged KV cache, a batch runs until its longest member stops,
and `output_scores` keeps one [batch, vocab] tensor per step (`batch_size` bounds that).

A seeded call (`SamplingConfig.seed`) samples every row from its own generator (`RowSampler`,
the Gumbel-max trick), so a prompt's completions depend only on the call's seed, the prompt's
key and the model: not on the prompts batched with it, nor on the rank that generates it.

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

from trainer.engine.models import eval_mode
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


class HFEngine(EngineContext):
    """Rollouts with `model.generate` (left-padded batches of prompts repeated `n` times)."""

    def __init__(self, model, tokenizer, *, seed: int = 0, max_model_len: int | None = None,
                 batch_size: int | None = None, synced_gpus: bool = False):
        self.model = model
        # ZeRO-3 ranks gather each layer's parameters together: all must run every decoding step,
        # so a rank whose sequences finished keeps stepping until every rank's have (transformers).
        self.synced_gpus = synced_gpus
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
        seeds = ([sample_seed(sampling, i) + j for i in range(len(prompts)) for j in range(k)]
                 if sampling.seed is not None and not sampling.greedy else None)
        size = self.batch_size or len(rows)
        flat: list[Completion] = []
        # Eager even under `torch_compile`: every decode step grows the cache, which would recompile the layers.
        with eval_mode(self.model), self._rng.use(sampling.seed), _clean_generation_defaults(self.model), \
                torch.compiler.set_stance("force_eager"):
            for start in range(0, len(rows), size):
                flat += self._generate_rows(rows[start:start + size], sampling,
                                            seeds[start:start + size] if seeds else None)
        return [fill_to_n(flat[i * k:(i + 1) * k], sampling.n) for i in range(len(prompts))]

    def _generate_rows(self, rows: list[list[int]], sampling: SamplingConfig,
                       seeds: list[int] | None = None) -> list[Completion]:
        device = _device_of(self.model)
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: every row's next token is at column `width`
            input_ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, width - len(r):] = 1
        sampler = RowSampler(seeds, sampling, device) if seeds else None
        config = self._generation_config(sampling)
        if sampler is not None:  # greedy on the scores the sampler perturbed = a sample per row
            config.do_sample, config.output_scores = False, False
            config.temperature = config.top_p = config.top_k = None
        out = self.model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config,
            logits_processor=[sampler] if sampler else None, synced_gpus=self.synced_gpus,
        )
        new_tokens = out.sequences[:, width:]  # [B, T]
        # Processed scores: T x [B, V] (-inf where masked); one step at a time, since a stacked
        # [B, T, V] copy of a 50k-150k vocabulary would double generate's peak memory.
        scores = sampler.warped if sampler is not None else out.scores
        logprobs = torch.stack([F.log_softmax(step.float(), dim=-1).gather(-1, new_tokens[:, t, None])[:, 0]
                                for t, step in enumerate(scores)], dim=1)  # [B, T]
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

    def close(self) -> None:
        pass


class RowSampler:
    """A logits processor that samples each row from its own seeded generator.

    It applies temperature, top-k and top-p (in transformers' order) to the logits, keeps those
    processed scores (the log-probs are theirs), and adds Gumbel noise -log(E), E ~ Exp(1),
    drawn from the row's generator: the argmax of logits + Gumbel noise is distributed as
    softmax(logits), so `generate` decoding greedily over the result samples every row.
    """

    def __init__(self, seeds: list[int], sampling: SamplingConfig, device: torch.device):
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.temperature, self.top_k, self.top_p = sampling.temperature, sampling.top_k, sampling.top_p
        self.warped: list[torch.Tensor] = []  # per decoding step, [B, V]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float() / self.temperature  # [B, V]
        if 0 < self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = scores.sort(dim=-1, descending=True)
            before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # mass of the tokens ranked above
            drop = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, order, before >= self.top_p)
            scores = scores.masked_fill(drop, float("-inf"))
        self.warped.append(scores)
        exp = torch.stack([torch.empty(scores.shape[-1], device=scores.device).exponential_(generator=g)
                           for g in self.generators])  # [B, V]
        return scores - exp.log()


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


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
