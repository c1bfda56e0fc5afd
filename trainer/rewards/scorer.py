"""A reward model (ours, or a sequence classifier from the hub) as a reward function."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from trainer.data.chat_templates import is_conversational, render_chat
from trainer.data.preferences import pad_right, reward_texts
from trainer.engine.checkpoint import MANIFEST
from trainer.engine.models import load_reward_model, load_tokenizer, resolve_model_path
from trainer.errors import ModelError

DEFAULT_MAX_LENGTH = 1024


LABEL_SCORES = ("logit", "probability")


def _as_messages(value: Any, role: str) -> list[dict]:
    """Chat messages as they are; plain text as one message of `role` (a text prompt before a chat
    completion is the user's turn, as in the RM stage's data)."""
    return value if is_conversational(value) else [{"role": role, "content": value}]


def plain_chat(messages: list[dict]) -> str:
    """Messages as plain text, for reward models whose tokenizer has no chat template (e.g. BERT
    encoders): "\\n\\nRole: content" per turn, the layout of Anthropic HH's text pairs."""
    return "".join(f"\n\n{m['role'].capitalize()}: {m['content']}" for m in messages)


def _trained_max_length(folder: str) -> int | None:
    """`max_length` the checkpoint was trained with, from its alignflow manifest."""
    manifest = Path(folder, MANIFEST)
    if not manifest.exists():
        return None
    return json.loads(manifest.read_text()).get("config", {}).get("max_length")


def classifier_labels(path: str, trust_remote_code: bool = False) -> list[str]:
    """The label names of a sequence-classification checkpoint with more than one label, in index
    order; [] for a one-label reward model, a LoRA adapter, or a model that is no classifier yet (a
    causal LM or encoder whose config only carries transformers' default two labels)."""
    from transformers import AutoConfig

    if Path(path, "adapter_config.json").exists():
        return []  # alignflow's LoRA reward models have one label
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    classifier = any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))
    if not classifier or config.num_labels < 2:
        return []
    return [config.id2label[i] for i in range(config.num_labels)]


def label_index(path: str, labels: list[str], label: str | None) -> int:
    """Index of `label` among a classifier's `labels` (0 for a one-label model); a one-line error
    listing the labels when the name is missing or unknown."""
    if not labels:
        return 0
    if label in labels:
        return labels.index(label)
    problem = "does not have the label " + repr(label) if label else f"has {len(labels)} labels"
    raise ModelError(f"Reward model {path!r} {problem}; set `reward_label` to one of {labels}.")


class RewardModelScorer:
    """A reward-model checkpoint as a reward function: `scorer(prompts, completions, **kwargs) -> list[float]`.

    path: checkpoint folder, s3:// prefix or hub id; a full model or a LoRA adapter folder, with its tokenizer.
    batch_size: texts per forward pass; texts are sorted by length first, so batches carry little padding.
    max_length: longest text in tokens; longer texts are cut on the tokenizer's `truncation_side` (alignflow
        RMs save the side they were trained with). Default: the RM's training `max_length`, else 1024.
    device: where the model runs; default CUDA when available, else CPU.
    label: for a classifier with several labels, the label (a name from its `config.id2label`) whose
        score is the reward, e.g. "POSITIVE" of a sentiment model; required there, ignored by one-label
        reward models. Checked before the weights load.
    label_score: "logit" (the label's raw logit) or "probability" (its softmax probability over all
        labels); one-label models always give their logit.

    `__name__` is the checkpoint's folder name, which GRPO uses in metric names (`rewards/<name>/mean`),
    as TRL does for model reward functions.

    `autocast`: the context each forward pass runs in; the RL stages set it to their accelerator's, so that
    with `bf16` the reward model scores under the same autocast as the policy (TRL's GRPOTrainer prepares
    reward models with its accelerator to the same effect). Unset: no autocast.
    """

    autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext

    def __init__(self, path: str, batch_size: int = 16, max_length: int | None = None, device: str | None = None,
                 dtype: str = "float32", trust_remote_code: bool = False, label: str | None = None,
                 label_score: str = "logit") -> None:
        if label_score not in LABEL_SCORES:
            raise ValueError(f"`reward_label_score` must be one of {list(LABEL_SCORES)}, got {label_score!r}.")
        local = resolve_model_path(path)
        self.path = local
        self.labels = classifier_labels(local, trust_remote_code)
        self.label_index = label_index(path, self.labels, label)
        self.label_score = label_score if self.labels else "logit"
        self.tokenizer = load_tokenizer(local, trust_remote_code)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = load_reward_model(local, self.tokenizer.pad_token_id, dtype, trust_remote_code,
                                       num_labels=max(1, len(self.labels)))
        self.model.to(self.device).eval()
        self.batch_size = batch_size
        self.max_length = max_length or _trained_max_length(local) or DEFAULT_MAX_LENGTH
        self.__name__ = Path(path.rstrip("/")).name or "reward_model"

    def rewards(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The reward of each row: the chosen label's logit or probability. [N, T] -> [N] (float32)"""
        with self.autocast():
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits.float()  # [N, labels]
        if self.label_score == "probability":
            logits = logits.softmax(-1)
        return logits[:, self.label_index]

    def texts(self, prompts: list, completions: list) -> list[str]:
        """The text scored for each (prompt, completion): text pairs are joined; chat pairs are rendered
        as one conversation with the RM tokenizer's chat template, or as `plain_chat` without one."""
        heads, tails = [], []
        for prompt, completion in zip(prompts, completions, strict=True):
            if is_conversational(prompt) or is_conversational(completion):
                messages = _as_messages(prompt, "user") + _as_messages(completion, "assistant")
                has_template = getattr(self.tokenizer, "chat_template", None)
                heads.append("")
                tails.append(render_chat(self.tokenizer, messages) if has_template else plain_chat(messages))
            else:
                heads.append(prompt)
                tails.append(completion)
        return reward_texts(self.tokenizer, heads, tails)

    @torch.no_grad()
    def score_texts(self, texts: list[str]) -> list[float]:
        """One reward per text, in the order given."""
        if not texts:
            return []
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        scores = [0.0] * len(ids)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            input_ids, attention = pad_right([ids[i] for i in chunk], self.tokenizer.pad_token_id)
            rewards = self.rewards(input_ids.to(self.device), attention.to(self.device))
            for i, reward in zip(chunk, rewards.tolist()):
                scores[i] = reward
        return scores

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        """TRL's reward-function signature; extra dataset columns in `kwargs` are ignored."""
        return self.score_texts(self.texts(prompts, completions))
