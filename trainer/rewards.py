"""Reward functions with TRL's signature: `f(prompts, completions, **dataset_columns) -> list[float | None]`.

Three kinds, loaded by `load_reward_function(spec)`:
- built-in rules: `exact_answer` (GSM8K-style final answers), `accuracy_reward`, `answer_format`,
  `regex:<pattern>`, `length:<N>`, `soft_overlong_punishment:<max>:<cache>` (DAPO's length budget);
- any user function given as an import path `pkg.module:function`;
- `RewardModelScorer`, a reward-model checkpoint (the output of `alignflow train reward`, or any
  sequence-classification model) given as a folder, an s3:// prefix or a hub id (read through the
  local Hugging Face cache, so `HF_HUB_OFFLINE=1` works for models already there). It builds each
  text exactly as the RM stage did in training (`trainer.preferences.reward_texts`: prompt +
  completion, eos rule included; chat rendered with the RM's own chat template), so a checkpoint
  scores GRPO completions the way it learned to score preference pairs. A classifier with several
  labels (e.g. a sentiment model) scores with one named label (`reward_label`): its logit, or its
  softmax probability.

`score_completions` runs them all on a batch and names the function and sample when one misbehaves.
"""

from __future__ import annotations

import importlib
import json
import re
import traceback
from pathlib import Path
from typing import Any

import torch

from trainer import storage
from trainer.checkpoint import MANIFEST
from trainer.config import ConfigError
from trainer.data import is_conversational, render_chat
from trainer.models import ModelError, load_reward_model, load_tokenizer, resolve_model_path
from trainer.preferences import reward_texts
from trainer.reward import pad_right

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
    """

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

# ----------------------------------------------------------------------------------------------
# Rule rewards and loading reward functions by name
#
# Every reward function has TRL's signature: f(prompts, completions, **dataset_columns) ->
# list[float | None], one entry per completion. Conversational completions arrive as
# [{"role": "assistant", "content": ...}]; `completion_text` gives the text either way.


def completion_text(completion) -> str:
    if isinstance(completion, list):
        return "".join(m.get("content") or "" for m in completion if isinstance(m, dict))
    return str(completion)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_final_answer(text: str) -> str | None:
    """The final answer of a GSM8K-style text: the number after the last ``####``, else the last number."""
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    found = _NUMBER.findall(tail)
    if not found:
        return None
    return found[0 if "####" in text else -1].replace(",", "").rstrip(".")


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return a.strip() == b.strip()


def exact_answer(prompts, completions, answer=None, **_) -> list[float | None]:
    """1.0 when the completion's final answer equals the `answer` column's (GSM8K ``#### N``), else 0.0.

    Rows without an answer get None (no score from this function)."""
    if answer is None:
        raise ValueError("exact_answer needs an `answer` column in the dataset (GSM8K-style `#### N` or a number).")
    return _answer_scores(completions, answer, extract_final_answer, _same_number)


def _answer_scores(completions, gold, extract, same) -> list[float | None]:
    """1.0 / 0.0 for whether `same(extract(completion), extract(gold))`; None where the gold has no answer."""
    out: list[float | None] = []
    for completion, ref in zip(completions, gold):
        expected = extract(str(ref)) if ref is not None else None
        if expected is None:
            out.append(None)
            continue
        got = extract(completion_text(completion))
        out.append(1.0 if got is not None and same(got, expected) else 0.0)
    return out


_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def boxed_or_final_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (one level of nested braces); else the text itself when it
    is one token (``\\frac{1}{3}``, ``42``); else `extract_final_answer`."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip().strip("$").strip()
    bare = text.strip().strip("$").strip()
    return bare if bare and not any(c.isspace() for c in bare) else extract_final_answer(text)


def accuracy_reward(prompts, completions, solution=None, answer=None, **_) -> list[float | None]:
    """TRL's `accuracy_reward`, without math_verify: 1.0 when the completion's last ``\\boxed{}`` (or
    final number) equals the `solution` column's (or, without one, the `answer` column's) — the same
    number, or the same text once spaces are removed — else 0.0; None where the gold has no answer.
    Symbolic equivalence (``\\frac{2}{6}`` = ``\\frac{1}{3}``) is not checked."""
    gold = solution if solution is not None else answer
    if gold is None:
        raise ValueError("accuracy_reward needs a `solution` (TRL's name) or `answer` column in the dataset.")
    return _answer_scores(completions, gold, boxed_or_final_answer,
                          lambda got, expected: _same_number(got, expected)
                          or got.replace(" ", "") == expected.replace(" ", ""))


def answer_format(prompts, completions, **_) -> list[float]:
    """1.0 when the completion ends with a GSM8K-style final answer line ``#### <number>``."""
    pattern = re.compile(r"####\s*-?[\d,]+(?:\.\d+)?\s*$")
    return [1.0 if pattern.search(completion_text(c).strip()) else 0.0 for c in completions]


def make_regex_reward(pattern: str):
    """``regex:<pattern>``: 1.0 when the pattern matches anywhere in the completion."""
    compiled = re.compile(pattern, re.DOTALL)

    def regex_reward(prompts, completions, **_) -> list[float]:
        return [1.0 if compiled.search(completion_text(c)) else 0.0 for c in completions]

    regex_reward.__name__ = "regex"
    return regex_reward


def make_length_reward(target: str):
    """``length:<N>``: 1 − |len − N| / N over the completion's characters, floored at 0 (1.0 at exactly N)."""
    n = int(target)
    if n <= 0:
        raise ValueError(f"length:<N> needs N > 0, got {target!r}.")

    def length_reward(prompts, completions, **_) -> list[float]:
        return [max(0.0, 1.0 - abs(len(completion_text(c)) - n) / n) for c in completions]

    length_reward.__name__ = "length"
    return length_reward


def make_soft_overlong_punishment(spec: str):
    """``soft_overlong_punishment:<max>:<cache>``: DAPO's soft overlong punishment over completion tokens,
    under TRL's name (`trl.rewards.get_soft_overlong_punishment`): 0 up to max − cache tokens, then
    falling linearly to −1 at max tokens, −1 beyond. Reads `completion_ids`, which the RL stages and
    `alignflow eval` pass to every reward function (as TRL does)."""
    limit, _, cache = spec.partition(":")
    try:
        limit, cache = int(limit), int(cache)
    except ValueError:
        limit = cache = 0
    if not 0 < cache <= limit:
        raise ConfigError(f"soft_overlong_punishment:<max>:<cache> needs whole numbers 0 < cache <= max, got "
                          f"{spec!r} (e.g. soft_overlong_punishment:256:64 with max_completion_length 256).")
    start = limit - cache

    def soft_overlong_punishment(prompts, completions, completion_ids=None, **_) -> list[float]:
        if completion_ids is None:
            raise ValueError("soft_overlong_punishment needs `completion_ids` (token ids of each completion).")
        return [0.0 if len(ids) <= start else max(-1.0, (start - len(ids)) / cache) for ids in completion_ids]

    return soft_overlong_punishment


BUILTIN_REWARDS = {"exact_answer": exact_answer, "answer_format": answer_format, "accuracy_reward": accuracy_reward}
PARAMETRISED_REWARDS = {"regex": make_regex_reward, "length": make_length_reward,
                        "soft_overlong_punishment": make_soft_overlong_punishment}


def load_reward_function(spec: str, device: str = "cpu", label: str | None = None, label_score: str = "logit"):
    """A reward function from a built-in name (``exact_answer``, ``accuracy_reward``, ``answer_format``,
    ``regex:<pattern>``, ``length:<N>``, ``soft_overlong_punishment:<max>:<cache>``), an import path ``pkg.module:function``, or a reward model: a checkpoint folder, an
    s3:// URI or a hub id (``org/name``, from the local Hugging Face cache or downloaded when online).
    `label` and `label_score` choose what a classifier with several labels scores (`RewardModelScorer`)."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    name, sep, arg = spec.partition(":")
    if sep and name in PARAMETRISED_REWARDS:
        return PARAMETRISED_REWARDS[name](arg)
    if sep and not spec.startswith("s3:") and "/" not in name:
        from trainer.reward_specs import check_reward_spec  # (imports this module)

        check_reward_spec(spec)  # ALIGNFLOW_ALLOWED_REWARD_MODULES, before the module's code runs
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ConfigError(f"Reward function {spec!r}: cannot import module {module_name!r} ({err}).") from err
        except Exception as err:  # the module's own code failed while it was imported
            where = traceback.extract_tb(err.__traceback__)[-1]
            raise ConfigError(f"Reward function {spec!r}: importing module {module_name!r} raised "
                              f"{type(err).__name__}: {err} ({where.filename}, line {where.lineno}). Fix the module; "
                              "it must import without errors.") from err
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ConfigError(f"Reward function {spec!r}: {module_name!r} has no callable {attr!r}.")
        return fn
    if storage.is_remote(spec) or Path(spec).is_dir() or hub_model_available(spec):
        return RewardModelScorer(spec, device=device, label=label, label_score=label_score)
    known = ", ".join([*BUILTIN_REWARDS, "regex:<pattern>", "length:<N>",
                       "soft_overlong_punishment:<max>:<cache>"])
    raise ConfigError(f"Unknown reward function {spec!r}: it is neither a function (a built-in: {known}; or an import "
                     "path `pkg.module:function`), nor a file (a reward-model folder or s3:// URI), nor a hub model in "
                     "the local Hugging Face cache or downloadable from the hub.")


def hub_model_available(spec: str) -> bool:
    """Whether `spec` names a hub model (``org/name``) whose config is in the local Hugging Face cache
    (HF_HUB_CACHE / HF_HOME) or, unless HF_HUB_OFFLINE is set, downloadable; the same places that
    `from_pretrained` reads a hub id from when `model` is one."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        return False
    try:
        hf_hub_download(spec, "config.json")
    except (OSError, ValueError, HfHubHTTPError):  # not cached, offline, unknown repo, not a valid repo id
        return False
    return True


def reward_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def reward_names(funcs) -> list[str]:
    """Metric names of the reward functions (`rewards/<name>/mean`): a name that repeats (two `regex:`
    rewards, two reward models) gets `_2`, `_3`, ... so that no function's metrics overwrite another's."""
    names, seen = [], {}
    for fn in funcs:
        name = reward_name(fn)
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return names


def score_completions(funcs, prompts: list, completions: list, columns: dict[str, list]):
    """Run every reward function on the batch: a float tensor [N, F] with NaN where a function gave None.

    A function that raises, returns the wrong number of scores, or returns NaN, ±inf or non-numbers
    fails with an error naming the function and the first bad sample. None is "no score from this
    function" (TRL's convention, e.g. a maths reward on a coding prompt), but a batch in which no
    function scored any completion is an error naming the functions: its reward would be NaN."""
    import math
    import numbers

    import torch

    out = torch.full((len(completions), len(funcs)), float("nan"))
    for j, fn in enumerate(funcs):
        name = reward_name(fn)
        try:
            scores = fn(prompts=prompts, completions=completions, **columns)
        except Exception as err:
            hint = (" Reward functions take TRL's signature: end the parameters with **kwargs (they receive every "
                    "dataset column and completion_ids)." if isinstance(err, TypeError) and "keyword" in str(err) else "")
            raise RewardError(f"Reward function `{name}` raised {type(err).__name__}: {err} "
                              f"(first sample: prompt={_short(prompts[0])}, completion={_short(completions[0])}).{hint}"
                              ) from err
        if not isinstance(scores, list | tuple) or len(scores) != len(completions):
            got = len(scores) if isinstance(scores, list | tuple) else type(scores).__name__
            raise RewardError(f"Reward function `{name}` returned {got} scores for {len(completions)} completions; "
                              "it must return one float (or None) per completion.")
        for i, score in enumerate(scores):
            if score is None:
                continue
            if not isinstance(score, numbers.Real) or not math.isfinite(score):
                raise RewardError(f"Reward function `{name}` returned {score!r} for sample {i} "
                                  f"(prompt={_short(prompts[i])}, completion={_short(completions[i])}); "
                                  "return a finite float, or None for 'no score'.")
            out[i, j] = float(score)
    if funcs and completions and bool(out.isnan().all()):
        names = ", ".join(f"`{reward_name(fn)}`" for fn in funcs)
        raise RewardError(f"Reward function{'s' if len(funcs) > 1 else ''} {names} returned None for all "
                          f"{len(completions)} completions (first: prompt={_short(prompts[0])}): no completion has "
                          "a reward to learn from. Check that the dataset has the columns the function reads (e.g. "
                          "`answer` for exact_answer), or return 0.0 rather than None for a wrong answer.")
    return out


def _short(x, n: int = 80) -> str:
    text = completion_text(x) if isinstance(x, list) else str(x)
    return repr(text if len(text) <= n else text[:n] + "…")


class RewardError(ValueError):
    """A reward function misbehaved; the message names it and the first bad sample."""
