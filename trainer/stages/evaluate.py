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

import json
import logging
import math
import shutil
import tempfile
import time
from typing import Any

import torch

from trainer.algorithms.advantages import combine_rewards
from trainer.algorithms.logprobs import logit_temperature
from trainer.config.eval_config import EvalConfig
from trainer.data.chat_templates import is_conversational
from trainer.data.sources import load_rows
from trainer.engine.completions import batched_logps, build_batch, completions_table, prompt_token_ids
from trainer.engine.models import load_causal_lm, load_tokenizer, model_and_tokenizer, resolve_model_path
from trainer.engine.precision import slow_half_precision
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
        if warning := slow_half_precision(device, model.dtype, "`--dtype float32`"):
            log.warning(warning)
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
