"""Reward functions with TRL's signature: `f(prompts, completions, **dataset_columns) -> list[float | None]`.

Three kinds, loaded by `load_reward_function(spec)`:
- built-in rules: `exact_answer` (GSM8K-style final answers), `accuracy_reward`, `answer_format`,
  `regex:<pattern>`, `length:<N>`, `soft_overlong_punishment:<max>:<cache>` (DAPO's length budget);
- any user function given as an import path `pkg.module:function`;
- `RewardModelScorer`, a reward-model checkpoint (the output of `alignflow train reward`, or any
  sequence-classification model) given as a folder, an s3:// prefix or a hub id (read through the
  local Hugging Face cache, so `HF_HUB_OFFLINE=1` works for models already there). It builds each
  text exactly as the RM stage did in training (`trainer.data.preferences.reward_texts`: prompt +
  completion, eos rule included; chat rendered with the RM's own chat template), so a checkpoint
  scores GRPO completions the way it learned to score preference pairs. A classifier with several
  labels (e.g. a sentiment model) scores with one named label (`reward_label`): its logit, or its
  softmax probability.

`score_completions` runs them all on a batch and names the function and sample when one misbehaves.
"""

from __future__ import annotations

import importlib
import traceback
from pathlib import Path

import torch

from trainer.errors import ConfigError, RewardError
from trainer.io import storage
from trainer.rewards.rules import BUILTIN_REWARDS, PARAMETRISED_REWARDS, completion_text
from trainer.rewards.scorer import RewardModelScorer

# ----------------------------------------------------------------------------------------------
# Rule rewards and loading reward functions by name
#
# Every reward function has TRL's signature: f(prompts, completions, **dataset_columns) ->
# list[float | None], one entry per completion. Conversational completions arrive as
# [{"role": "assistant", "content": ...}]; `completion_text` gives the text either way.


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
        from trainer.rewards.specs import check_reward_spec  # (imports this module)

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


