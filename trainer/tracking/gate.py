"""Which way a metric improves, for the promotion gate (`trainer.stages.promote`). Without torch or MLflow, so
that the pipeline's check-inputs task checks `gate_metric` and `gate_mode` before any training starts."""

from __future__ import annotations

import fnmatch

from trainer.errors import RegistryError

# Metrics alignflow logs whose better direction is known (fnmatch patterns): evaluation (trainer/stages/evaluate.py)
# and the stages' own (docs/trl.md names). A name in neither list needs `gate_mode: max|min`.
LOWER_IS_BETTER = ("loss", "eval_loss", "*/loss", "kl", "eval_kl", "objective/kl", "ppo/loss/*")
HIGHER_IS_BETTER = ("reward", "eval_reward", "rewards/*/mean", "eval_rewards/*/mean", "accuracy", "eval_accuracy",
                    "mean_token_accuracy", "eval_mean_token_accuracy", "win_rate", "rm_score", "rewards/accuracies",
                    "rewards/margins", "eval_rewards/accuracies", "eval_rewards/margins", "margin", "eval_margin",
                    "objective/scores", "objective/rlhf_reward")
GATE_MODES = ("auto", "max", "min")


def gate_direction(metric: str, mode: str = "auto") -> bool:
    """Whether a higher `metric` is better: `max` / `min` say so; `auto` knows the metrics alignflow logs
    (LOWER_IS_BETTER, HIGHER_IS_BETTER) and raises `RegistryError` for any other."""
    if mode not in GATE_MODES:
        raise RegistryError(f"`gate_mode` is {mode!r}: use auto (the known direction of alignflow's metrics), max "
                            "(higher is better) or min (lower is better).")
    if mode != "auto":
        return mode == "max"
    if any(fnmatch.fnmatchcase(metric, p) for p in HIGHER_IS_BETTER):
        return True
    if any(fnmatch.fnmatchcase(metric, p) for p in LOWER_IS_BETTER):
        return False
    raise RegistryError(f"`gate_metric` {metric!r} has no known direction (alignflow knows loss and kl: lower is "
                        "better; reward, rewards/<name>/mean, accuracy, win_rate, rm_score: higher): set `gate_mode` "
                        "to max (higher is better) or min (lower is better).")
