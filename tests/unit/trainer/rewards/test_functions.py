"""`score_completions`: what a reward function may return, and the errors that name it when it misbehaves."""

import math

import pytest
import torch

from trainer.errors import RewardError
from trainer.rewards.functions import score_completions
from trainer.rewards.rules import exact_answer

PROMPTS = ["What is 2+2?", "What is 3+3?"]
COMPLETIONS = ["#### 4", "#### 5"]


def constant(value):
    def fn(prompts, completions, **_):
        return [value] * len(completions)

    fn.__name__ = f"gives_{value}"
    return fn


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, "1.0"])
def test_non_finite_or_non_numeric_scores_are_refused_naming_the_function(bad):
    with pytest.raises(RewardError, match=r"Reward function `gives_.*` returned .* for sample 0.*finite float"):
        score_completions([constant(bad)], PROMPTS, COMPLETIONS, {})


def test_all_none_is_an_error_naming_the_functions():
    with pytest.raises(RewardError, match=r"`gives_None` returned None for all 2 completions"):
        score_completions([constant(None)], PROMPTS, COMPLETIONS, {})
    # exact_answer gives None to rows without an answer: a batch of only those has no reward at all.
    with pytest.raises(RewardError, match=r"`exact_answer` returned None for all 2"):
        score_completions([exact_answer], PROMPTS, COMPLETIONS, {"answer": [None, None]})
    with pytest.raises(RewardError, match=r"Reward functions `gives_None`, `exact_answer` returned None"):
        score_completions([constant(None), exact_answer], PROMPTS, COMPLETIONS, {"answer": [None, None]})


def test_none_from_one_function_is_allowed_when_another_scores():
    """TRL's multi-task convention: a function returns None where it does not apply."""
    out = score_completions([constant(None), exact_answer], PROMPTS, COMPLETIONS, {"answer": ["4", None]})
    assert torch.isnan(out[:, 0]).all()
    assert out[0, 1] == 1.0 and torch.isnan(out[1, 1])
    assert score_completions([constant(-2.5)], PROMPTS, COMPLETIONS, {}).tolist() == [[-2.5], [-2.5]]
