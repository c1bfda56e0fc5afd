"""The evaluation stage's options (`trainer/stages/evaluate.py`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.config.options import TrainConfig, option
from trainer.errors import ConfigError

_TRAIN_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _as_in_train_config(name: str) -> Any:
    """The same default and help as TrainConfig's field `name` (one definition of each knob)."""
    f = _TRAIN_FIELDS[name]
    if f.default_factory is not dataclasses.MISSING:
        return field(default_factory=f.default_factory, metadata=f.metadata)
    return field(default=f.default, metadata=f.metadata)


@dataclass
class EvalConfig:
    """Evaluate a model on held-out prompts: rewards, accuracy, reward-model score, win rate, KL."""

    model: str = option("", "Model to evaluate: a checkpoint folder, an s3:// prefix or a hub id.")
    dataset: str = option("", "Held-out prompts: a file/folder/s3:// prefix/hub id (as for training) with a `prompt` "
                              "column (text or chat messages) and any columns the reward functions read, e.g. `answer`.")
    dataset_split: str = option("test", "Split to use when the dataset has several (hub ids, saved DatasetDicts).")
    max_samples: int | None = option(None, "Evaluate the first this many prompts only (default: all).")
    reward_funcs: list[str] = option([], "Reward functions: built-ins (exact_answer, accuracy_reward, answer_format, "
                                         "regex:<pattern>, length:<N>, soft_overlong_punishment:<max>:<cache>), "
                                         "import paths `pkg.module:fn` with TRL's signature, or reward-model "
                                         "checkpoints. `reward` is their weighted sum (none: no `reward` metric).")
    reward_weights: list[float] = option([], "One weight per reward function (default: all 1.0).")
    reward_label: str | None = option(None, "For reward models (in `reward_funcs`, or the `reward_model` judge) that "
                                            "are classifiers with several labels: the label whose score counts, a "
                                            "name from the model's config.id2label (e.g. POSITIVE).")
    reward_label_score: Literal["logit", "probability"] = option(
        "logit", "What `reward_label` scores: its logit, or its softmax probability over the model's labels.")
    reward_model: str | None = option(None, "Reward-model checkpoint used as the judge: gives `rm_score`, and `win_rate` "
                                            "when `baseline_model` is set.")
    baseline_model: str | None = option(None, "Model to compare against (the current champion): a folder, an s3:// "
                                              "prefix, or models:/NAME@champion from the MLflow registry. It answers "
                                              "the same prompts with the same sampling; needs `reward_model`.")
    reference_model: str | None = option(None, "Starting model (e.g. the SFT checkpoint) for `kl`, the mean per-token "
                                               "log π(y) − log π_ref(y) on the evaluated model's completions. It must "
                                               "share the model's tokenizer.")
    max_prompt_length: int = option(512, "Prompts longer than this many tokens keep their END (left truncation).")
    max_completion_length: int = option(256, "Most tokens generated per completion.")
    temperature: float = option(0.0, "Sampling temperature; 0 = greedy (deterministic).")
    top_p: float = option(1.0, "Nucleus sampling probability mass (temperature > 0 only).")
    batch_size: int = option(8, "Prompts per generate call, and sequences per forward pass when scoring.")
    seed: int = option(42, "Seed of the sampling stream (the model and the baseline get the same one).")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = option(
        "float32", "Parameter dtype of every model loaded (policy, baseline, reference, judge).")
    trust_remote_code: bool = _as_in_train_config("trust_remote_code")
    output_dir: str = option("outputs/eval", "Where metrics.json and samples.jsonl go: a local folder or s3:// prefix.")
    mlflow_tracking_uri: str | None = _as_in_train_config("mlflow_tracking_uri")
    mlflow_experiment: str = _as_in_train_config("mlflow_experiment")
    mlflow_run_name: str | None = _as_in_train_config("mlflow_run_name")
    mlflow_parent_run_id: str | None = _as_in_train_config("mlflow_parent_run_id")
    mlflow_tags: list[str] = _as_in_train_config("mlflow_tags")

    stage = "eval"
    command = "alignflow eval"  # class attribute, not a field
    # Environment fallbacks exactly as the training stages resolve them (Tracker reads these).
    tracking_uri = TrainConfig.tracking_uri
    parent_run_id = TrainConfig.parent_run_id

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("`model` is required: pass --model PATH (a checkpoint folder, an s3:// prefix or a hub id).")
        if not self.dataset:
            raise ConfigError("`dataset` is required: pass --dataset PATH (held-out prompts with a `prompt` column).")
        for name in ("batch_size", "max_prompt_length", "max_completion_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"`max_samples` must be >= 1 (or unset for all prompts), got {self.max_samples}.")
        if self.temperature < 0:
            raise ConfigError(f"`temperature` must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"`top_p` must be in (0, 1], got {self.top_p}.")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(f"`reward_weights` has {len(self.reward_weights)} entries for "
                              f"{len(self.reward_funcs)} `reward_funcs`; give one weight per function.")
        if self.baseline_model and not self.reward_model:
            raise ConfigError("`baseline_model` needs a judge for the win rate: set `reward_model` to a reward-model "
                              "checkpoint.")
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ConfigError(f"`dtype` must be float32, bfloat16, float16 or auto, got {self.dtype!r}.")
        for tag in self.mlflow_tags:
            if "=" not in tag:
                raise ConfigError(f"`mlflow_tags` entries look like KEY=VALUE; got {tag!r}.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
