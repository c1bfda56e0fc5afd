"""The built-in rule rewards, with TRL's reward-function signature
(`fn(prompts, completions, **columns) -> list[float | None]`)."""

from __future__ import annotations

import re

from trainer.errors import ConfigError


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
