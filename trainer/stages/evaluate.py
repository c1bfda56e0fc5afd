"""Evaluation on held-out prompts: the numbers the promotion gate reads.

    generate  one completion per prompt with the model (hf engine; greedy by default)
    score     rule / Python / reward-model reward functions (TRL signature) -> reward, rewards/<fn>/mean;
              exact_answer against an `answer` column -> accuracy
    KL        to `reference_model` on the model's own completions (teacher-forced log-probs)
    baseline  the same prompts and sampling with `baseline_model` (e.g. the registry's champion)
    judge     `reward_model` scores both sets -> rm_score, win_rate
    write     metrics.json (flat {name: value}, what `alignflow promote --metrics` reads),
              samples.jsonl, and an MLflow child run with the metrics and a samples table

Metric definitions (names follow TRL's GRPO logs where they overlap):

- ``reward``: mean over prompts of Σ_f w_f·r_f (`trainer.algorithms.advantages.combine_rewards`, as GRPO trains on);
  functions returning None are skipped per prompt. ``rewards/<fn>/mean``: mean of one function.
- ``accuracy``: mean of the built-in `exact_answer` (GSM8K ``#### N`` vs `answer`), whenever the data
  has an `answer` column, whether or not it is among `reward_funcs`.
- ``win_rate``: mean over prompts of 1 if RM(model's completion) > RM(baseline's), 0 if lower and
  0.5 on a tie (identical completion texts tie without asking the judge, so ties are exact).
- ``kl``: Σ_tokens (log π(y_t) − log π_ref(y_t)) / #tokens over the model's completions y ~ π: a
  Monte-Carlo estimate of the per-token KL(π‖π_ref) (the k1 estimator; unbiased, may be < 0 on a
  small sample). Both log-probs are those of softmax(logits / T) at the sampling `temperature` T, the
  distribution the completions were drawn from, so this estimates KL(π_T‖π_ref,T), as the RL stages'
  KL is (the plain softmax when greedy, T = 0).
- ``completions/mean_length`` (tokens, eos included), ``completions/clipped_ratio`` (hit the limit).

Checks that need no model (config, data columns, model paths, reward specs) run before any
generation. Models run one after another (policy with reference, then baseline, then judge),
so at most two are in memory at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from trainer.algorithms.advantages import combine_rewards
from trainer.algorithms.logprobs import logit_temperature
from trainer.config.options import TrainConfig, option
from trainer.data.chat_templates import is_conversational
from trainer.data.sources import load_rows
from trainer.engine.completions import batched_logps, build_batch, completions_table, prompt_token_ids
from trainer.engine.models import load_causal_lm, load_tokenizer, model_and_tokenizer, resolve_model_path
from trainer.errors import ConfigError, DataError
from trainer.io import storage
from trainer.io.progress import Reporter
from trainer.rewards.functions import load_reward_function, reward_names, score_completions
from trainer.rewards.scorer import RewardModelScorer
from trainer.rollout import Completion, SamplingConfig, make_engine
from trainer.tracking.tracker import Tracker

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"
SAMPLES_FILE = "samples.jsonl"
ACCURACY_FUNC = "exact_answer"

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


# ----------------------------------------------------------------------------------------------
# Building blocks


def _local_model(spec: str, tracking_uri: str | None, workdir: str) -> str:
    """A local model folder for a path, s3:// prefix, hub id or models:/ registry URI."""
    if spec.startswith("models:/"):
        from trainer.stages.promote import download_model

        return download_model(spec, workdir, tracking_uri)
    return resolve_model_path(spec)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def generate(model, tokenizer, prompts: list, config: EvalConfig,
             desc: str = "generating") -> tuple[list[list[int]], list[Completion]]:
    """One completion per prompt, `batch_size` prompts per call, with progress (trainer/io/progress.py: a bar
    on a terminal, a line every 30 s or 25 % elsewhere). -> (prompt token ids, completions)."""
    encoded = [prompt_token_ids(p, tokenizer, config.max_prompt_length) for p in prompts]
    engine = make_engine("hf", model=model, tokenizer=tokenizer, model_path="", seed=config.seed,
                         max_model_len=config.max_prompt_length + config.max_completion_length)
    eos = tokenizer.eos_token_id
    sampling = SamplingConfig(max_new_tokens=config.max_completion_length, temperature=config.temperature,
                              top_p=config.top_p, stop_token_ids=[eos] if eos is not None else [])
    completions: list[Completion] = []
    with engine, Reporter(len(encoded), desc, unit="prompts", logger=log) as bar:
        for start in range(0, len(encoded), config.batch_size):
            completions += [group[0] for group in engine.generate(encoded[start:start + config.batch_size], sampling)]
            bar.update(len(encoded[start:start + config.batch_size]))
    return encoded, completions


def decode(tokenizer, completions: list[Completion]) -> list[str]:
    return [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]


def shape_like_prompts(texts: list[str], prompts: list) -> list:
    """What reward functions receive: chat prompts get [{"role": "assistant", "content": ...}] (as in TRL)."""
    return [[{"role": "assistant", "content": t}] if is_conversational(p) else t for p, t in zip(prompts, texts)]


@torch.no_grad()
def mean_kl(model, ref_model, prompt_ids: list[list[int]], completions: list[Completion], pad_id: int,
            batch_size: int, temperature: float = 0.0) -> float:
    """Σ (log π − log π_ref) over all completion tokens / their number, both at the sampling `temperature`
    (0 = greedy: the plain softmax; see the module doc)."""
    T = logit_temperature(temperature)
    device = next(model.parameters()).device
    total, tokens = 0.0, 0
    for start in range(0, len(prompt_ids), batch_size):
        sl = slice(start, start + batch_size)
        batch = build_batch(prompt_ids[sl], [[c] for c in completions[sl]], pad_id).to(device)
        diff = (batched_logps(model, batch, batch_size, temperature=T)
                - batched_logps(ref_model, batch, batch_size, temperature=T))  # [B, P+C]
        mask = batch.completion_mask.bool()
        total += float(diff[mask].sum())
        tokens += int(mask.sum())
    return total / tokens if tokens else math.nan


def win_rates(texts: list, baseline_texts: list, scores: list[float], baseline_scores: list[float]) -> list[float]:
    """Per prompt: 1 win, 0 loss, 0.5 tie (identical completions always tie)."""
    out = []
    for text, base, s, b in zip(texts, baseline_texts, scores, baseline_scores, strict=True):
        out.append(0.5 if text == base or s == b else float(s > b))
    return out


def _nanmean(values) -> float:
    x = torch.as_tensor(values, dtype=torch.float64)
    return float(torch.nanmean(x)) if x.numel() else math.nan


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


# ----------------------------------------------------------------------------------------------
# The stage


def run_evaluate(config: EvalConfig) -> dict[str, float]:
    """Evaluate `config.model`; returns the metrics (also written to `output_dir`/metrics.json)."""
    workdir = tempfile.mkdtemp(prefix="alignflow-eval-")  # a registry baseline is downloaded here
    try:
        return _evaluate(config, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _evaluate(config: EvalConfig, workdir: str) -> dict[str, float]:
    started = time.perf_counter()

    # 1. Everything that can be checked without a model: data, paths, reward functions.
    rows = load_rows(config.dataset, config.dataset_split)
    if "prompt" not in rows.column_names:
        raise DataError(f"Dataset {config.dataset!r} has columns {sorted(rows.column_names)}; evaluation needs a "
                        "`prompt` column (text or chat messages) plus any columns the reward functions read.")
    if config.max_samples is not None and config.max_samples < len(rows):
        rows = rows.select(range(config.max_samples))
    model_path, tokenizer = model_and_tokenizer(config)
    ref_path = resolve_model_path(config.reference_model) if config.reference_model else None
    if ref_path and load_tokenizer(ref_path, config.trust_remote_code).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"`reference_model` {config.reference_model!r} has a different tokenizer from "
                          f"{config.model!r}; KL needs both to read the same token ids.")
    baseline_path = (_local_model(config.baseline_model, config.tracking_uri, workdir)
                     if config.baseline_model else None)
    judge_path = resolve_model_path(config.reward_model) if config.reward_model else None
    if ACCURACY_FUNC in config.reward_funcs and "answer" not in rows.column_names:
        raise DataError(f"Reward function `{ACCURACY_FUNC}` reads an `answer` column, and dataset {config.dataset!r} "
                        f"has only {sorted(rows.column_names)}.")
    funcs = [load_reward_function(spec, device=str(_device()), label=config.reward_label,
                                  label_score=config.reward_label_score) for spec in config.reward_funcs]
    names = reward_names(funcs)
    weights = torch.tensor(config.reward_weights or [1.0] * len(funcs))
    has_answer = "answer" in rows.column_names
    prompts = rows["prompt"]
    extra_columns = [c for c in rows.column_names if c != "prompt"]
    columns = {c: rows[c] for c in extra_columns}
    log.info("Evaluating %s on %d prompts of %s; rewards %s%s%s%s.", config.model, len(rows), config.dataset, names,
             ", accuracy" if has_answer else "", f", win rate vs {config.baseline_model}" if baseline_path else "",
             f", KL to {config.reference_model}" if ref_path else "")

    with Tracker(config, "eval") as tracker:
        # 2. The model's completions, and its KL to the reference while it is loaded.
        device = _device()
        model = load_causal_lm(model_path, config.dtype, config.trust_remote_code).to(device).eval()
        prompt_ids, completions = generate(model, tokenizer, prompts, config)
        texts = decode(tokenizer, completions)
        shaped = shape_like_prompts(texts, prompts)
        metrics: dict[str, float] = {"num_samples": float(len(rows))}
        if ref_path:
            ref_model = load_causal_lm(ref_path, config.dtype, config.trust_remote_code).to(device).eval()
            metrics["kl"] = mean_kl(model, ref_model, prompt_ids, completions, tokenizer.pad_token_id,
                                    config.batch_size, config.temperature)
            del ref_model
        del model
        log.info("Generated %d completions (%.1fs).", len(completions), time.perf_counter() - started)

        # 3. Rewards.
        columns["completion_ids"] = [list(c.token_ids) for c in completions]  # passed as in TRL; not a data column
        per_func = score_completions(funcs, prompts, shaped, columns) if funcs else torch.empty(len(rows), 0)  # [N, F]
        combined = combine_rewards(per_func, weights) if funcs else None  # [N]
        if combined is not None:
            metrics["reward"] = _nanmean(combined)
            metrics.update({f"rewards/{n}/mean": _nanmean(per_func[:, j]) for j, n in enumerate(names)})
        correct = None
        if has_answer:
            correct = (per_func[:, names.index(ACCURACY_FUNC)] if ACCURACY_FUNC in names else
                       score_completions([load_reward_function(ACCURACY_FUNC)], prompts, shaped, columns)[:, 0])  # [N]
            metrics["accuracy"] = _nanmean(correct)

        # 4. The baseline's completions, on the same prompts with the same sampling.
        baseline_shaped = baseline_texts = None
        if baseline_path:
            base_tokenizer = load_tokenizer(baseline_path, config.trust_remote_code)
            base_model = load_causal_lm(baseline_path, config.dtype, config.trust_remote_code).to(device).eval()
            _, base_completions = generate(base_model, base_tokenizer, prompts, config, desc="generating (baseline)")
            del base_model
            baseline_texts = decode(base_tokenizer, base_completions)
            baseline_shaped = shape_like_prompts(baseline_texts, prompts)

        # 5. The judge.
        rm_scores = baseline_scores = wins = None
        if judge_path:
            judge = RewardModelScorer(judge_path, batch_size=config.batch_size, dtype=config.dtype,
                                      trust_remote_code=config.trust_remote_code, label=config.reward_label,
                                      label_score=config.reward_label_score)
            rm_scores = judge(prompts, shaped)
            metrics["rm_score"] = _nanmean(rm_scores)
            if baseline_shaped is not None:
                baseline_scores = judge(prompts, baseline_shaped)
                wins = win_rates(texts, baseline_texts, rm_scores, baseline_scores)
                metrics["baseline/rm_score"] = _nanmean(baseline_scores)
                metrics["win_rate"] = _nanmean(wins)
            del judge
        lengths = torch.tensor([float(len(c.token_ids)) for c in completions])
        metrics["completions/mean_length"] = float(lengths.mean())
        metrics["completions/clipped_ratio"] = sum(c.finish_reason == "length" for c in completions) / len(completions)

        # 6. Outputs.
        samples = []
        for i, prompt in enumerate(prompts):
            record: dict[str, Any] = {"prompt": prompt, "completion": texts[i]}
            if funcs:
                record["rewards"] = {n: _finite_or_none(float(per_func[i, j])) for j, n in enumerate(names)}
                record["reward"] = _finite_or_none(float(combined[i]))
            if correct is not None:
                record["accuracy"] = _finite_or_none(float(correct[i]))
            if rm_scores is not None:
                record["rm_score"] = rm_scores[i]
            if baseline_texts is not None:
                record["baseline_completion"] = baseline_texts[i]
            if wins is not None:
                record["baseline_rm_score"] = baseline_scores[i]
                record["win"] = wins[i]
            record.update({c: columns[c][i] for c in extra_columns if c not in record})
            samples.append(record)
        write_outputs(config.output_dir, metrics, samples)
        tracker.log_metrics(metrics, step=0)
        tracker.log_dict(metrics, METRICS_FILE)
        tracker.log_table(samples_table(samples), "samples.json")
    log.info("Evaluation done in %.1fs: %s", time.perf_counter() - started,
             ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    return metrics


def write_outputs(output_dir: str, metrics: dict[str, float], samples: list[dict[str, Any]]) -> None:
    storage.write_text(storage.join(output_dir, METRICS_FILE), json.dumps(metrics, indent=2, sort_keys=True))
    storage.write_text(storage.join(output_dir, SAMPLES_FILE),
                       "".join(json.dumps(s, default=str) + "\n" for s in samples))


def samples_table(samples: list[dict[str, Any]]) -> dict[str, list]:
    """samples.jsonl as MLflow table columns: nested rewards become `rewards/<fn>` columns, chat becomes text."""
    return completions_table(samples)
