"""The stage runner: what every training stage does around its own loop, on one process or many.

A stage (`trainer/stages/sft.py`, `reward_model.py`, `dpo.py`, `rl/grpo.py`, `rl/ppo.py`) owns its data, its loss and its
loop; the runner owns the rest, so that no stage quietly ignores an option the others honour:

- **Devices and processes** (`trainer.engine.distributed.make_accelerator`): CUDA when present, else
  CPU; bf16/fp16 autocast with float32 master weights; DDP or DeepSpeed ZeRO-2/3 when started
  by `alignflow train --num_processes N [--deepspeed ...]` or `accelerate launch`.
- **Data across ranks** (`rank_batches`): each optimizer step's global batch is the one a single
  process would draw (`trainer.engine.loop.step_batches` at `per_device_batch_size x world size`),
  cut into one contiguous slice per rank. The stage divides its summed loss by the step's
  *global* count of targets (tokens or pairs, `sum_over_ranks`) times the world size, because
  DDP and DeepSpeed average the ranks' gradients: N ranks then take exactly the update of one.
  A rank whose slice of a short last batch is empty runs one example at weight 0, so that every
  rank reaches every collective.
- **Resume, checkpoints, tracking**: training state restored from a step checkpoint, rank 0 writes
  checkpoints (under ZeRO-3 with the parameters gathered, an ordinary Hugging Face folder),
  DeepSpeed ranks write their optimizer shards, every `save_steps` steps or `save_minutes`
  minutes; rank 0's MLflow run; a manifest that records world size, device, precision and ZeRO stage.
- **Preemption** (`trainer.engine.preemption`): inside `failing()` a SIGTERM or SIGINT stops every rank at the
  same step boundary (`maybe_save`) with a step checkpoint, and the process exits with code 75.

With one process every collective is an identity, so a single-process run computes what it did
before the runner existed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.engine import attention, distributed, hub, identity, precision
from trainer.engine import checkpoint as ckpt
from trainer.engine.loop import MetricWindow, build_optimizer, build_scheduler, set_seed, step_batches
from trainer.engine.models import compile_blocks, eval_mode
from trainer.engine.preemption import PREEMPTED_EXIT_CODE, Preempted, StopSignal
from trainer.errors import ConfigError, TrainingError
from trainer.io import storage
from trainer.io.progress import Progress
from trainer.io.storage import is_remote

log = logging.getLogger(__name__)


@dataclass
class RankBatch:
    """This rank's part of one micro-batch of an optimizer step."""

    indices: list[int]  # example (or packed-row) indices
    weight: float  # 1.0, or 0.0 for the stand-in example of a rank whose slice is empty


def to_device(batch, device):
    """A copy of a batch dataclass with its tensors on `device` (the batch itself when already there)."""
    moved = {f.name: value.to(device) for f in dataclasses.fields(batch)
             if isinstance(value := getattr(batch, f.name), torch.Tensor) and value.device != device}
    return dataclasses.replace(batch, **moved) if moved else batch


@contextlib.contextmanager
def layout_check(model) -> Iterator[None]:
    """The forwards of a one-off check that a stage runs before training (`score_both_layouts`, SFT's
    `padding_free_is_exact`): eval mode, no gradients (not inference_mode: ZeRO-3 would gather parameters into
    inference tensors), and eager under `torch_compile`, where each layout would compile graphs of its own
    (seconds each) that no training step runs."""
    with eval_mode(model), torch.no_grad(), torch.compiler.set_stance("force_eager"):
        yield


def score_both_layouts(model, score, collate, data, pad_id: int, pack_to: int, device) -> tuple:
    """(padded, packed): `score(model, batch)` of the shortest few pairs of `data` (`TokenizedPairs`), collated
    padded and packed into rows of `pack_to`. A stage compares the two before it trusts `padding_free`: a model
    whose attention ignores restarting position ids lets packed sequences attend to each other. The shortest
    pairs pack several sequences per row and cost little to score twice."""
    indices = sorted(range(len(data)), key=data.pair_length)[:4]
    with layout_check(model):
        return tuple(score(model, to_device(collate(data, indices, pad_id, width), device)) for width in (0, pack_to))


def layouts_agree(model, padded: torch.Tensor, packed: torch.Tensor, tokens: int, what: str) -> bool:
    """Whether log-probs scored packed (`packed`) match those scored padded: the mean absolute difference per
    target token within 1e-3 nats for float32 weights, 3e-2 for half-precision ones (the two layouts round
    differently). SmolLM2-135M on HH pairs: < 1e-6 nats in float32, 1e-3 to 3e-3 in bfloat16, 0.68 when packed
    sequences attend to each other. Logs a warning, naming `what` runs instead, when they differ."""
    per_token = float((padded - packed).abs().sum()) / max(int(tokens), 1)
    tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 3e-2
    if per_token > tolerance:
        log.warning("padding_free is off: %s scores packed sequences differently from padded ones (%.3g nats per "
                    "token), so its attention does not separate them. %s", type(model).__name__, per_token, what)
    return per_token <= tolerance


class StageRunner:
    """One stage's run: accelerator, training state, MLflow run, checkpoints and progress.

    Lifecycle: `StageRunner(stage, config)` -> `resume_checkpoint(model_path, rows)` -> the stage loads its model
    -> `prepare(model, ...)` -> the loop (`rank_batches`, `micro_batch`, `backward`,
    `optimizer_step`, then `end_step`, or `log_step` and `maybe_save`) -> `final_evaluation` ->
    `finish()`, all inside `with runner.failing():`, which marks the MLflow run FAILED on an exception and
    turns SIGTERM / SIGINT into a checkpoint and exit code 75 at the next `maybe_save`.
    The stage sets `tokenizer` (saved with every checkpoint).
    """

    def __init__(self, stage: str, config: Any) -> None:
        self.stage, self.config = stage, config
        self.accelerator = distributed.make_accelerator(config)
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self.samples: list[dict[str, Any]] = []  # the completions logged last (log_completions)
        self.is_main, self.device = self.accelerator.is_main_process, self.accelerator.device
        self.runtime = distributed.describe(self.accelerator)
        if getattr(config, "torch_compile", False) and self.runtime["zero_stage"] == 3:
            raise ConfigError("`torch_compile` does not run under DeepSpeed ZeRO-3 (its hooks gather each layer's "
                              "parameters as it runs); set `torch_compile false` or use ZeRO-2.")
        if self.is_main:
            storage.check_writable(config.output_dir)  # before any data or model is loaded
            hub.check_push(config)  # push_to_hub without a token fails now, not after training
        set_seed(config.seed)
        self.started = time.perf_counter()
        self.state = ckpt.TrainState()
        self.last_metrics: dict[str, float] = {}
        self.datasets: dict[str, dict] = {}
        self.window = MetricWindow()
        self.resume: str | None = None  # the local copy of the checkpoint resumed from
        self.resumed_from: str | None = None  # its URI
        self.resume_changes: list[dict[str, Any]] = []  # identity changes allowed by resume_allow_changes
        self.identity: dict[str, Any] = {}
        self.tokenizer: Any = None  # set by prepare(); saved with every checkpoint
        self.report = distributed.RankReport(self.accelerator)  # what this rank trained on (RL stages fill it)
        self.heads: dict[str, torch.nn.Module] = {}
        self._saved_at = time.monotonic()
        self._saved_step = 0  # the newest step whose checkpoint exists (resumed from or written)
        self.stop = StopSignal(config.stop_budget_seconds, stage if self.world == 1 else f"{stage} rank {self.rank}")
        self._nonfinite = 0
        log.info("%s: %s, %d process%s (%s), mixed precision %s%s.", stage, self.runtime["device"], self.world,
                 "es" if self.world > 1 else "", self.runtime["distributed_type"], self.runtime["mixed_precision"],
                 f", DeepSpeed ZeRO-{self.runtime['zero_stage']}" if self.runtime["zero_stage"] is not None else "")

    # --- setup ---------------------------------------------------------------------------------

    def resume_checkpoint(self, model_path: str | None, rows) -> str | None:
        """This run's identity (`trainer.engine.identity`: stage, base model at `model_path`, the training `rows`'
        fingerprint, seed, LoRA, options) and the checkpoint to resume from (`resume_from_checkpoint`),
        fetched to a local folder; None to start afresh. Called before any model loads: a checkpoint of
        another run is refused here in one line (`CheckpointError`) unless `resume_allow_changes`, and with
        `auto` a finished model of this same run in `output_dir` raises `checkpoint.RunFinished`."""
        from trainer.data.sources import dataset_fingerprint

        config, values = self.config, dataclasses.asdict(self.config)
        self.identity = identity.run_identity(self.stage, values, self.world, model_path, dataset_fingerprint(rows))
        if config.resume_from_checkpoint == "auto" and (final := ckpt.finished_model(config.output_dir)):
            changes = self._changes(final, f"the finished model in {config.output_dir}")
            if not changes and not identity.length_changes(final, values):
                raise ckpt.RunFinished(
                    f"{config.output_dir} already holds this run's finished model (step {final.get('step')}, saved "
                    f"{final.get('created', '?')}); nothing to train. To train again, use a new `output_dir`, or "
                    "leave out `resume_from_checkpoint` to start over and replace it.")
        found = ckpt.find_resume(config.resume_from_checkpoint, config.output_dir, fetch=True)
        if found:  # a verified local copy of a step checkpoint
            self.resumed_from, self.resume = found
            where = (f"the checkpoint {self.resumed_from}" if config.resume_from_checkpoint == "auto"
                     else "that checkpoint")
            manifest = json.loads(Path(self.resume, ckpt.MANIFEST).read_text())
            self.resume_changes = [
                *manifest.get("resume_changes", []),
                *({"step": manifest.get("step"), "from": self.resumed_from, "field": c.field, "old": c.old,
                   "new": c.new} for c in self._changes(manifest, where))]
            for change in identity.length_changes(manifest, values):
                log.warning("RESUMING WITH A NEW LENGTH: %s (the checkpoint was saved at step %s).", change,
                            manifest.get("step"))
        return self.resume

    def _changes(self, manifest: dict[str, Any], where: str) -> list[identity.Change]:
        """How this run's identity differs from the one `manifest` records. Another stage is refused; other
        differences are refused unless `resume_allow_changes`, which continues with a warning."""
        config = self.config
        changes = identity.differences(identity.manifest_identity(manifest), self.identity)
        listed = "; ".join(str(c) for c in changes)
        anew = ("use a new `output_dir`" if config.resume_from_checkpoint == "auto"
                else "leave out `resume_from_checkpoint`")
        if changes and changes[0].field == "stage":
            raise ckpt.CheckpointError(
                f"resume_from_checkpoint={config.resume_from_checkpoint}: {where} is from the {changes[0].old} stage, "
                f"not {self.stage}: a run cannot continue in another stage. To start a {self.stage} run from its "
                f"model, give it as `--model` and {anew}.")
        if changes and not config.resume_allow_changes:
            raise ckpt.CheckpointError(
                f"resume_from_checkpoint={config.resume_from_checkpoint}: {where} is from a different run ({listed}). "
                f"For a new run {anew}; to continue this one with these changes on purpose add "
                "`--resume_allow_changes true` (alignflow.json then records them).")
        if changes:
            log.warning("RESUMING A CHANGED RUN from %s: %s.", where, listed)
        return changes

    def prepare(self, model: torch.nn.Module, tokenizer, total_steps: int, datasets: dict[str, dict],
                wrap=None, heads: dict[str, torch.nn.Module] | None = None):
        """Optimizer, schedule and the prepared model (DDP / DeepSpeed / autocast); restore the
        training state when resuming; open the MLflow run. Returns the model to run forwards through.

        `wrap` (e.g. `trainer.algorithms.logprobs.TargetLM`) is a module class (or a function) around `model`
        whose forward the stage calls; `self.module` stays the plain model, for saving and generation.
        `heads` (name -> module, e.g. PPO's value head) train with the model (`wrap` must hold them,
        so that DDP / DeepSpeed see their gradients) and are saved with every checkpoint as
        `<name>.safetensors`; the stage restores them from `resume` before calling this.
        """
        config = self.config
        distributed.seed_rank(config.seed, self.rank)
        self.module, self.tokenizer, self.total_steps, self.datasets = model, tokenizer, total_steps, datasets
        self.heads, self._wrap = heads or {}, wrap
        trained = torch.nn.ModuleList([model, *self.heads.values()]) if self.heads else model
        optimizer = build_optimizer(trained, config)
        self.scheduler = build_scheduler(optimizer, config, total_steps)
        distributed.fill_deepspeed_config(self.accelerator, config.per_device_batch_size,
                                          config.gradient_accumulation_steps, config.max_grad_norm)
        if self.is_main:
            self._check_precision(model)
        attention.use_alignflow_attention(model)  # faster training forwards on the CPU in half precision
        if getattr(config, "torch_compile", False):
            log.info("torch_compile: %d blocks compile on their first forwards.", compile_blocks(model))
        self.model, self.optimizer = self.accelerator.prepare(wrap(model) if wrap else model, optimizer)
        if self.resume:
            self.state = ckpt.load_training_state(self.resume, self._checkpoint_optimizer, self.scheduler)
            distributed.load_engine_state(self.accelerator, self.model, self.resume)
            distributed.restore_rank_rng(self.accelerator, self.state.extra.get("rank_rng"))
            self.window.load(distributed.this_rank(self.accelerator, self.state.extra.get("metric_window")))
            self._saved_step = self.state.global_step
        self.progress = Progress(total_steps, self.state.global_step, self.stage,
                                 config.disable_progress_bar or not self.is_main)
        self.tracker  # noqa: B018 (opens the MLflow run now that setup can no longer fail)
        return self.model

    def _check_precision(self, model: torch.nn.Module) -> None:
        """Warn when the precision the forwards and backwards compute in (autocast's, else the weights') is one
        this CPU has no fast matmul kernels for (`trainer.engine.precision`)."""
        autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.runtime["mixed_precision"])
        weights = next(model.parameters()).dtype
        fixes = ([f"`--{self.runtime['mixed_precision']} false`"] if autocast else []) + \
            (["`--dtype float32`"] if weights != torch.float32 else [])
        if warning := precision.slow_half_precision(self.device, autocast or weights, " and ".join(fixes)):
            log.warning(warning)

    def model_without_autocast(self) -> torch.nn.Module:
        """What `self.model` runs, in the weights' own precision: float32 master weights stay float32 under
        bf16/fp16 mixed precision, whose autocast accelerate puts in the prepared model's forward. For checks
        that must not mistake half-precision rounding for a fault. Under ZeRO-3 `self.model` itself, whose
        engine alone gathers the sharded parameters."""
        if self.runtime["zero_stage"] == 3:
            return self.model
        return self._wrap(self.module) if self._wrap else self.module

    @functools.cached_property
    def tracker(self):
        """Rank 0's MLflow run (continued when resuming); other ranks get one with MLflow off."""
        tracker = distributed.rank_tracker(self.accelerator, self.config, self.stage, self.state.mlflow_run_id)
        if self.resume:
            tracker.history[:] = ckpt.read_history(self.resume)
        self.state.mlflow_run_id = tracker.run_id
        tracker.log_params({f"runtime/{k}": v for k, v in self.runtime.items()})
        tracker.log_datasets(self.datasets)  # run inputs: path, fingerprint (digest), rows
        return tracker

    @property
    def _checkpoint_optimizer(self):
        return distributed.checkpoint_optimizer(self.accelerator, self.optimizer)

    # --- data ----------------------------------------------------------------------------------

    @property
    def one_row(self) -> bool:
        """Whether a padding-free micro-batch packs into one row, each sequence's attention run apart through
        the row's bounds (`attention.per_sequence_attention`): on the CPU. Elsewhere rows of at most
        `max_length`, as transformers builds their block-diagonal mask over the whole row (and flash attention
        would read the bounds its own way)."""
        return self.device.type == "cpu"

    def rank_batches(self, num_examples: int, step: int) -> list[RankBatch]:
        """This rank's slice of each micro-batch of optimizer step `step` (1-based); see the module docstring."""
        size = self.config.per_device_batch_size
        out = []
        for batch in step_batches(num_examples, size * self.world, self.config.gradient_accumulation_steps,
                                  self.config.seed, step):
            mine = batch[self.rank * size:(self.rank + 1) * size]
            out.append(RankBatch(mine, 1.0) if mine else RankBatch(batch[:1], 0.0))
        return out

    def rank_slice(self, num_items: int, batch_size: int = 0) -> list[range]:
        """Batches of `batch_size` (default `per_device_batch_size`) over this rank's contiguous share of
        `num_items` items (evaluation, precomputing); every rank gets as many batches (maybe empty ones)."""
        size = batch_size or self.config.per_device_batch_size
        share = -(-num_items // self.world)
        start, stop = min(self.rank * share, num_items), min((self.rank + 1) * share, num_items)
        return [range(i, min(i + size, stop)) if i < stop else range(0) for i in range(start, start + share, size)]

    def sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Key-by-key sums over all ranks (every rank must call it at the same point)."""
        if self.world == 1 or not values:
            return dict(values)
        keys = list(values)  # same insertion order on every rank: the stages build these dicts alike
        total = self.accelerator.reduce(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64,
                                                     device=self.device), "sum")
        return dict(zip(keys, total.tolist()))

    def extreme_over_ranks(self, value: float, largest: bool) -> float:
        if self.world == 1:
            return value
        gathered = self.accelerator.gather(torch.tensor([value], dtype=torch.float64, device=self.device))
        return float(gathered.max() if largest else gathered.min())

    # --- the update ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """One micro-batch of gradient accumulation, under autocast: gradients cross ranks on the last only."""
        with distributed.micro_batch(self.accelerator, self.model, last), self.accelerator.autocast():
            yield

    def backward(self, loss: torch.Tensor) -> None:
        distributed.backward(self.accelerator, loss)

    def optimizer_step(self) -> float:
        """Clip, step optimizer and schedule, zero the gradients; returns the gradient norm before clipping.

        A step whose norm is not finite is skipped; `max_nonfinite_steps` of them in a row stop the run."""
        norm = distributed.clip_and_step(self.accelerator, self.model, self.optimizer, self.scheduler,
                                         self.config.max_grad_norm)
        self._nonfinite = 0 if math.isfinite(norm) else self._nonfinite + 1
        if self._nonfinite:
            log.warning("Step %d: the gradient norm is %s (a NaN or infinite loss or gradient); the update is "
                        "skipped (%d of at most %d in a row).", self.state.global_step + 1, norm, self._nonfinite,
                        self.config.max_nonfinite_steps)
        if self._nonfinite and (self._nonfinite >= self.config.max_nonfinite_steps
                                or self.runtime["zero_stage"] is not None):
            raise TrainingError(
                f"{self.stage}: the gradient norm was not finite for {self._nonfinite} step(s) in a row, up to step "
                f"{self.state.global_step + 1}: the loss or gradients overflow or are NaN. Lower `learning_rate`, set "
                f"`max_grad_norm`, check the data, or use bf16 instead of fp16."
                + (" (Under DeepSpeed the engine has already applied the step.)"
                   if self.runtime["zero_stage"] is not None else ""))
        return norm

    @property
    def learning_rate(self) -> float:
        return self.scheduler.get_last_lr()[0]

    # --- logging and saving --------------------------------------------------------------------

    def log_step(self, step: int, metrics: dict[str, float], evaluate=None, span: int = 1,
                 rank_means: bool = False) -> dict[str, float] | None:
        """Add the metrics of the `span` optimizer steps that ended at `step` to the window; every
        `logging_steps` steps (and at the last) log the window's means with the learning rate and
        token count, plus `evaluate()` every `eval_steps`. `rank_means`: the metrics are this rank's
        own and are averaged over ranks when logged (otherwise they are already global)."""
        config = self.config
        self.window.add(metrics)
        logged = None
        if step % config.logging_steps < span or step >= self.total_steps:
            window = self.window.pop()
            logged = {**(distributed.mean_over_ranks(window) if rank_means else window),
                      "learning_rate": self.learning_rate, "num_tokens": float(self.state.num_tokens)}
            if evaluate is not None and config.eval_steps and step % config.eval_steps < span and step < self.total_steps:
                logged.update(evaluate())
            self.tracker.log_metrics(logged, step)
            self.last_metrics = logged
        self.progress.update(step, logged)
        return logged

    def end_step(self, metrics: dict[str, float], num_examples: int, evaluate=None) -> None:
        """After an optimizer step over batches of examples (SFT, reward model, DPO): the epoch
        reached, logging (and evaluation), saving."""
        step, config = self.state.global_step, self.config
        per_step = config.per_device_batch_size * config.gradient_accumulation_steps * self.world
        self.log_step(step, {**metrics, "epoch": step * per_step / num_examples}, evaluate)
        self.maybe_save(step)

    def final_evaluation(self, evaluate) -> None:
        """Evaluate once more after the last step (when there is held-out data); logged and kept for the manifest."""
        if evaluate is not None:
            metrics = evaluate()
            self.tracker.log_metrics(metrics, self.state.global_step)
            self.last_metrics.update(metrics)

    def maybe_save(self, step: int, span: int = 1) -> None:
        """At the end of every optimizer step (`span` of them for RL stages): a resumable step checkpoint every
        `save_steps` steps or `save_minutes` minutes (never at the last step); after SIGTERM / SIGINT, the stop."""
        config = self.config
        due = bool(config.save_steps) and step % config.save_steps < span
        late = bool(config.save_minutes) and time.monotonic() - self._saved_at >= 60 * config.save_minutes
        stop = self.stop.requested
        if self.world > 1:
            # Rank 0's clock decides a save by time, and a signal to any rank stops them all, so that every
            # rank takes part in the same saves and stops after the same step (one all-reduce a step).
            votes = self.sum_over_ranks({"late": float(late and self.is_main), "stop": float(stop)})
            late, stop = votes["late"] > 0, votes["stop"] > 0
            if stop and not self.stop.requested:
                self.stop.agreed("another rank's stop signal")
        if stop:
            self._stop(step)
        if (due or late) and step < self.total_steps:
            self.save("step")

    def _stop(self, step: int) -> None:
        """Save this step's checkpoint (unless it is the one resumed from or just written), then end with
        `Preempted` (exit code 75): a retry with `resume_from_checkpoint auto` continues from here."""
        started, where = time.monotonic(), ckpt.step_dir(self.config.output_dir, step)
        if step > self._saved_step:
            self.save("step")
            done = f"saved {where} in {time.monotonic() - started:.2f} s"
        else:
            done = f"{where} was saved already"
        self.stop.saved = done
        message = (f"{self.stop.who}: stopped by {self.stop.name} after step {step}/{self.total_steps}; {done}, "
                   f"{self.stop.elapsed():.2f} s after the signal. Exit code {PREEMPTED_EXIT_CODE}: run it again with "
                   "`resume_from_checkpoint auto` to continue.")
        log.warning("%s", message)  # (every rank: each says where it stopped)
        raise Preempted(message)

    def manifest(self) -> dict[str, Any]:
        manifest = ckpt.build_manifest(self.stage, self.config, self.config.model, self.datasets, self.last_metrics,
                                       self.state.global_step)
        manifest["identity"] = self.identity
        if self.resumed_from:
            manifest.update(resumed_from=self.resumed_from, resume_changes=self.resume_changes)
        # The MLflow run and the last logged completions: the KFP task's report links and shows them.
        tracker = self.__dict__.get("tracker")
        extra = {"mlflow_run_id": (tracker and tracker.run_id) or self.state.mlflow_run_id, "samples": self.samples}
        return {**manifest, **self.runtime, **{k: v for k, v in extra.items() if v}}

    def log_completions(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Log sample completions (`trainer.engine.completions.sample_rows`) as an MLflow table; the last
        ones logged also go into the model's manifest (`samples`) for the pipeline's report."""
        from trainer.engine.completions import completions_table

        if rows:
            self.tracker.log_table(completions_table(rows), artifact_file)
            self.samples = rows

    def save(self, kind: str) -> None:
        """A resumable step checkpoint (`kind="step"`) or the final model (`"final"`). Every rank
        calls it: DeepSpeed ranks write their shards, ZeRO-3 gathers the parameters; rank 0 writes the folder."""
        config, step = self.config, self.state.global_step
        if kind == "step":
            distributed.save_engine_state(self.accelerator, self.model, ckpt.step_dir(config.output_dir, step))
            if (rank_rng := distributed.rank_rng_states(self.accelerator)) is not None:
                self.state.extra["rank_rng"] = rank_rng
            self.state.extra["metric_window"] = distributed.every_rank(self.accelerator, self.window.state())
        with distributed.full_params(self.accelerator, self.model):
            if self.is_main:
                common = dict(model=self.module, tokenizer=self.tokenizer, history=self.tracker.history,
                              manifest=self.manifest(), merge_lora=config.lora_merge_on_save, heads=self.heads)
                if kind == "step":
                    ckpt.save_step_checkpoint(config.output_dir, step, config.save_total_limit, state=self.state,
                                              optimizer=self._checkpoint_optimizer, scheduler=self.scheduler,
                                              commit=self.stop.commit, **common)
                else:
                    ckpt.save_checkpoint(config.output_dir, card=hub.model_card(common["manifest"], type(config)),
                                         commit=self.stop.commit, **common)
        self.accelerator.wait_for_everyone()
        self._saved_at = time.monotonic()
        if kind == "step":
            self._saved_step = step

    def finish(self) -> str:
        """Save the final model, record the manifest (and the checkpoint when asked) in MLflow, close the run."""
        self.progress.close()
        self.last_metrics["train_runtime"] = time.perf_counter() - self.started
        self.save("final")
        if self.config.push_to_hub and self.is_main:
            hub.push_to_hub(self.config.output_dir, hub.repo_name(self.config), self.config.hub_private_repo)
        tracker = self.tracker
        tracker.log_dict(self.manifest(), ckpt.MANIFEST)
        if self.config.mlflow_log_checkpoint and self.is_main and not is_remote(self.config.output_dir):
            tracker.log_checkpoint(self.config.output_dir)
        tracker.finish()
        log.info("%s done in %.1fs; model saved to %s", self.stage, time.perf_counter() - self.started,
                 self.config.output_dir)
        return self.config.output_dir

    @contextlib.contextmanager
    def failing(self) -> Iterator[None]:
        """Mark the MLflow run FAILED, or KILLED when a signal stopped it (and close the progress bar), when the
        body raises; while inside, SIGTERM and SIGINT stop the run at the next `maybe_save` (`trainer.engine.preemption`)."""
        with self.stop:
            try:
                yield
            except BaseException as err:
                if hasattr(self, "progress"):
                    self.progress.close()
                if "tracker" in self.__dict__:
                    self.tracker.finish("KILLED" if isinstance(err, Preempted) else "FAILED")
                raise

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Whole parameters on every rank (ZeRO-3), e.g. to generate samples with `self.module`."""
        with distributed.full_params(self.accelerator, self.model):
            yield
