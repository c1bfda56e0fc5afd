"""Completions as training rows: the rollout batch and its per-token log-probs.

GRPO (and PPO) train on the completions a rollout engine generated; `trainer.stages.evaluate` scores
the same rows. `build_batch` lays a cycle's completions out as [left-padded prompt |
right-padded completion] rows, grouped so that rows g*G .. g*G+G-1 share prompt g, and
`token_logps` gathers the trainer's log-probs of the completion tokens, running each group's
prompt once when it can (`trainer.engine.attention.share_prompts`). They are log-probs under
softmax(logits / T) at the sampling temperature T, the distribution the engine drew from (as in
TRL; T = 0, greedy, scores under the plain softmax: `trainer.algorithms.logprobs.logit_temperature`).

`sample_rows` and `completions_table` turn logged completions into rows a person reads: the
prompt as text (chat as "role: content" lines), one column per reward function, the advantage.
They feed the MLflow completions tables and the samples of the KFP report (components/report.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from trainer.algorithms.logprobs import log_probs_and_stats, target_logits, to_padded
from trainer.data.chat_templates import is_conversational, render_chat
from trainer.engine.attention import SHARED_ATTENTION, share_prompts


def chat_text(value: Any) -> str:
    """A prompt or completion as plain text: chat messages become "role: content" lines, text stays text."""
    if is_conversational(value):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in value)
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _number(value: float) -> float | None:
    """A finite float, or None (MLflow tables and JSON have no NaN)."""
    value = float(value)
    return value if math.isfinite(value) else None


def sample_rows(step: int, prompts: list, completions: list[str], names: list[str], per_func: torch.Tensor,
                reward: torch.Tensor, advantage: torch.Tensor | None = None, reward_column: str = "reward",
                limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` completions as rows: step, prompt (as given: text or chat), completion,
    `rewards/<name>` per reward function (None where it did not score), the weighted `reward_column`
    and the `advantage` (per completion: [N]; for per-token advantages pass their masked mean)."""
    k = len(completions) if limit is None else min(limit, len(completions))
    rows = []
    for i in range(k):
        row: dict[str, Any] = {"step": step, "prompt": prompts[i], "completion": completions[i]}
        row.update({f"rewards/{n}": _number(per_func[i, j]) for j, n in enumerate(names)})
        row[reward_column] = _number(reward[i])
        if advantage is not None:
            row["advantage"] = _number(advantage[i])
        rows.append(row)
    return rows


def flat_sample(record: dict[str, Any]) -> dict[str, Any]:
    """An evaluation sample (`rewards` as {name: value}) with one `rewards/<name>` key per function."""
    row = {k: v for k, v in record.items() if k != "rewards"}
    for name, value in (record.get("rewards") or {}).items():
        row[f"rewards/{name}"] = value
    return row


def completions_table(rows: list[dict[str, Any]]) -> dict[str, list]:
    """Rows as MLflow table columns: prompts and completions as text, other non-scalar values as JSON."""
    flat = [{k: chat_text(v) if k in ("prompt", "completion") or not isinstance(v, str | int | float | bool | None)
             else v for k, v in flat_sample(row).items()} for row in rows]
    keys = list(dict.fromkeys(k for row in flat for k in row))
    return {k: [row.get(k) for row in flat] for k in keys}


def prompt_token_ids(prompt, tokenizer, max_prompt_length: int | None = None) -> list[int]:
    """Tokenize a text or chat prompt; with `max_prompt_length`, keep its last that many tokens (left truncation)."""
    if is_conversational(prompt):
        text = render_chat(tokenizer, prompt, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    return ids[-max_prompt_length:] if max_prompt_length else ids


@dataclass
class RolloutBatch:
    """One cycle's completions, grouped: rows g*G .. g*G+G-1 share prompt g."""

    input_ids: torch.Tensor  # [N, P+C] prompt left-padded, completion right-padded
    attention_mask: torch.Tensor  # [N, P+C]
    completion_mask: torch.Tensor  # [N, P+C] 1 on completion tokens up to and including eos
    rollout_logps: torch.Tensor  # [N, P+C] engine log-probs at completion tokens (0 elsewhere)
    completion_lengths: torch.Tensor  # [N]
    truncated: torch.Tensor  # [N] bool, hit max_completion_length without eos
    prompt_width: int  # P: columns [0, P) hold the prompt

    def to(self, device) -> RolloutBatch:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return RolloutBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()})


def build_batch(prompt_ids: list[list[int]], completions, pad_id: int) -> RolloutBatch:
    rows = [(p, c) for p, group in zip(prompt_ids, completions) for c in group]
    p_width = max(len(p) for p, _ in rows)
    c_width = max(max(len(c.token_ids) for _, c in rows), 1)
    n = len(rows)
    input_ids = torch.full((n, p_width + c_width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    completion_mask = torch.zeros_like(input_ids)
    rollout_logps = torch.zeros(input_ids.shape)
    lengths = torch.zeros(n, dtype=torch.long)
    truncated = torch.zeros(n, dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        start = p_width - len(p)
        input_ids[i, start:p_width] = torch.tensor(p)
        attention[i, start:p_width] = 1
        k = len(c.token_ids)
        if k:
            input_ids[i, p_width:p_width + k] = torch.tensor(c.token_ids)
            attention[i, p_width:p_width + k] = 1
            completion_mask[i, p_width:p_width + k] = 1
            rollout_logps[i, p_width:p_width + k] = torch.tensor(c.logprobs, dtype=torch.float)
        lengths[i] = k
        truncated[i] = c.finish_reason == "length"
    return RolloutBatch(input_ids, attention, completion_mask, rollout_logps, lengths, truncated, p_width)


def token_logps(model, batch: RolloutBatch, rows: slice, with_entropy: bool = False, group_size: int = 0,
                temperature: float = 1.0):
    """Per-token log-probs log softmax(logits / temperature) of the completion tokens of
    `batch.input_ids[rows]` as [n, T] (zeros elsewhere), and the mean entropy of that distribution.
    `temperature`: what `logit_temperature` makes of the sampling temperature.

    With `group_size` G, groups of G rows that share a prompt run it once (`share_prompts`).
    `model` as accelerate prepared it: a DDP / DeepSpeed wrapper is called through its own
    forward, which is where it hooks the gradient all-reduce (trainer/engine/distributed.py).
    """
    input_ids, attention_mask = batch.input_ids[rows], batch.attention_mask[rows]
    completion_mask = batch.completion_mask[rows]
    P, C = batch.prompt_width, input_ids.shape[1] - batch.prompt_width
    shared = None
    if group_size and _can_share_prompts(model, row_length=P + group_size * C):
        shared = share_prompts(input_ids, attention_mask, completion_mask, P, group_size, _model_dtype(model))
    if shared is not None:
        out = target_logits(model, shared.input_ids, shared.target_mask, shared.attention_mask, shared.position_ids,
                        shared.sources, shared.model_kwargs)
        out_rows, out_cols = shared.unshare(out.rows, out.cols)
    else:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding
        out = target_logits(model, input_ids, completion_mask, attention_mask, position_ids)
        out_rows, out_cols = out.rows, out.cols
    target_logps, row = log_probs_and_stats(out.logits, out.targets, ("entropy",) if with_entropy else (), temperature)
    ent = float(row["entropy"].mean()) if with_entropy and out.targets.numel() else None
    return to_padded(target_logps, out_rows, out_cols, input_ids.shape), ent


# Longest shared-prompt row: its [T, T] attention mask and the attention over it grow with T^2.
MAX_SHARED_ROW = 4096


def _attention(model) -> str:
    from trainer.engine.distributed import unwrap

    return getattr(unwrap(model).config, "_attn_implementation", None) or "sdpa"


def _can_share_prompts(model, row_length: int) -> bool:
    """Shared-prompt rows need an attention that takes an arbitrary 4D mask (eager, sdpa, ours)."""
    return _attention(model) in ("sdpa", "eager", SHARED_ATTENTION) and row_length <= MAX_SHARED_ROW


def _model_dtype(model) -> torch.dtype:
    return next(p for p in model.parameters() if p.is_floating_point()).dtype


@torch.no_grad()
def batched_logps(model, batch: RolloutBatch, size: int, group_size: int = 0, temperature: float = 1.0) -> torch.Tensor:
    parts = [token_logps(model, batch, slice(i, i + size), group_size=group_size, temperature=temperature)[0]
             for i in range(0, len(batch.input_ids), size)]
    return torch.cat(parts)
