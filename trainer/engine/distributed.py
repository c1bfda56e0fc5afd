"""Several training processes (`accelerate launch`, `torchrun`): the few things a stage's loop must do differently.

A stage calls these helpers at fixed points of its loop; with one process every helper is a
no-op or an identity, so a single-process run computes exactly what it did without them.
Gradients are averaged over ranks by whatever `accelerate` prepared: DistributedDataParallel
(one process per GPU, or per CPU over gloo) or a DeepSpeed ZeRO engine
(trainer/configs/deepspeed_zero{2,3}.json).

Rules the helpers encode:

- **Calls through the wrapper.** A gradient must come from a forward through the object
  `accelerator.prepare` returned: DDP arms its all-reduce in `DDP.forward`, DeepSpeed ZeRO-3
  gathers parameters in hooks rooted at `DeepSpeedEngine.forward`. `trainer.algorithms.logprobs.target_logits`
  calls the inner decoder and LM head directly (to skip the head at prompt positions), which
  would silently skip both, so wrapped models go through `wrapped_target_logits` instead.
- **Equal work on every rank.** Every collective (gradient all-reduce, gathers of metrics) must
  be reached by all ranks the same number of times, so every rank gets the same number of
  prompts per cycle (`rank_prompts`) and runs the same number of micro-batches.
- **Rank 0 writes.** Logging to MLflow, the progress bar and checkpoints are rank 0's; the
  others wait at a barrier. DeepSpeed's sharded optimizer state is the exception: each rank
  writes its own shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from trainer.engine.loop import step_batches
from trainer.tracking.tracker import Tracker

log = logging.getLogger(__name__)

# Set to a folder to have every rank write rank_<N>.json there at the end of a run: a digest of
# its parameters and the prompts it trained on per cycle (tests check ranks agree and groups stay whole).
RANK_REPORT_ENV = "ALIGNFLOW_RANK_REPORT_DIR"
DEEPSPEED_STATE_DIR = "deepspeed"  # inside a step checkpoint: each rank's ZeRO shard


def make_accelerator(config):
    """The `Accelerator` of one training run: precision from the config (`bf16` / `fp16`) or from
    `accelerate launch --mixed_precision`; processes and DeepSpeed from the launcher's environment.

    Without CUDA, plain data parallelism needs `cpu=True` (accelerate then treats torchrun's
    processes as MULTI_CPU ranks over gloo), and DeepSpeed needs a gloo process group instead:
    without it accelerate reports one process on every rank, and each would train on the whole
    batch and exit 0, silently wrong. `cpu=True` would turn DeepSpeed off.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from trainer.errors import ConfigError

    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if getattr(config, "deepspeed", None) and not deepspeed:
        raise ConfigError("`deepspeed` needs the processes started by a launcher: run `alignflow train ...` (it "
                          "starts them) or `accelerate launch --use_deepspeed ...`, not the stage function directly.")
    if launched > 1 and getattr(config, "num_processes", 1) not in (1, launched):
        raise ConfigError(f"`num_processes` is {config.num_processes} but the launcher started {launched} processes; "
                          "drop `num_processes` or make it match.")
    precision = config.mixed_precision
    if precision == "no":
        precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if (AcceleratorState._shared_state and launched == 1
            and AcceleratorState().mixed_precision != precision):
        # accelerate keeps one state per process; a process that runs several stages (tests,
        # notebooks) starts each one's afresh.
        AcceleratorState._reset_state()
    if deepspeed and not torch.cuda.is_available():
        skip_shared_memory_op()
    accelerator = Accelerator(mixed_precision=precision, **accelerator_kwargs(config, torch.cuda.is_available(),
                                                                               deepspeed))
    if precision == "fp16" and accelerator.device.type == "cpu":  # accelerate autocasts to float16 on GPUs only
        log.warning("`fp16` has no effect on the CPU: accelerate runs it in float32 without loss scaling. Drop "
                    "`fp16`, or use `bf16` (autocast to bfloat16, which the CPU supports).")
    if launched != accelerator.num_processes:
        raise RuntimeError(f"{launched} processes were launched (WORLD_SIZE) but accelerate sees "
                           f"{accelerator.num_processes} ({accelerator.distributed_type}); every rank would train "
                           "on the whole batch. Launch with `alignflow train --num_processes N` or `accelerate launch`.")
    if not accelerator.is_main_process:
        logging.getLogger("trainer").setLevel(logging.WARNING)  # one rank narrates
    return accelerator


def skip_shared_memory_op() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory all-reduce op when it starts its process group.

    On the CPU, DeepSpeed's communication backend builds that op (a minute of C++ compilation on a fresh
    machine, then a load in every rank) for `inference_all_reduce`, which only DeepSpeed-Inference calls;
    training's collectives go through torch.distributed (gloo). Marking the op incompatible in DeepSpeed's
    own table of compatible ops makes the backend skip it, as it does on a platform without the op.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def accelerator_kwargs(config, cuda: bool, deepspeed: bool) -> dict[str, Any]:
    """The `Accelerator` arguments besides precision, on a machine with (`cuda`) or without GPUs.

    - `use_cpu`, or no GPU without DeepSpeed: accelerate's `cpu=True` (torchrun's ranks then run as MULTI_CPU
      ranks over gloo);
    - no GPU with DeepSpeed: a gloo process group instead (see `make_accelerator`);
    - the process group waits `ddp_timeout` seconds at a collective (torch's `init_process_group(timeout=)`);
    - DDP looks for parameters without gradients when `ddp_find_unused_parameters` (DDP's own argument).
    """
    from datetime import timedelta

    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    group = {"timeout": timedelta(seconds=getattr(config, "ddp_timeout", 1800))}
    kwargs: dict[str, Any] = {}
    if getattr(config, "use_cpu", False) or (not cuda and not deepspeed):
        kwargs["cpu"] = True
    elif not cuda:
        group["backend"] = "gloo"
    handlers = [InitProcessGroupKwargs(**group)]
    if getattr(config, "ddp_find_unused_parameters", False):
        handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
    kwargs["kwargs_handlers"] = handlers
    return kwargs


def describe(accelerator) -> dict[str, Any]:
    """What the run really uses (printed at start, written to alignflow.json and MLflow params)."""
    stage = zero_stage(accelerator)
    device = accelerator.device
    return {"world_size": accelerator.num_processes, "device": "cpu" if device.type == "cpu" else str(device),
            "mixed_precision": accelerator.mixed_precision, "zero_stage": stage if stage >= 0 else None,
            "distributed_type": str(accelerator.distributed_type).rsplit(".", 1)[-1]}


def zero_stage(accelerator) -> int:
    """The DeepSpeed ZeRO stage, or -1 when DeepSpeed is not in use."""
    plugin = accelerator.state.deepspeed_plugin
    return int(plugin.zero_stage) if plugin is not None else -1


def fill_deepspeed_config(accelerator, micro_batch_size: int, accumulation_steps: int, max_grad_norm: float) -> None:
    """Fill the DeepSpeed config's "auto" batch, accumulation and clipping values from the stage config.

    accelerate fills the batch size from a prepared DataLoader, which RL stages do not have. The
    batch values only feed DeepSpeed's bookkeeping (the stage marks accumulation boundaries
    itself); a clipping threshold in the JSON file that disagrees with `max_grad_norm` would
    change the update, so it is an error rather than a silent override.
    """
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    clip = max_grad_norm if max_grad_norm > 0 else 0.0  # DeepSpeed: 0 = no clipping
    if ds.get("gradient_clipping", "auto") not in ("auto", clip):
        from trainer.errors import ConfigError

        raise ConfigError(f"The DeepSpeed config sets gradient_clipping={ds['gradient_clipping']} but max_grad_norm is "
                          f"{max_grad_norm}; set it to \"auto\" in the JSON file (the stage fills it in).")
    wanted = {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": accumulation_steps,
              "gradient_clipping": clip}
    for key, value in wanted.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = value


# ----------------------------------------------------------------------------------------------
# Data: prompts per rank


def rank_prompts(num_prompts: int, per_rank: int, rank: int, world: int, seed: int, cycle: int) -> list[int]:
    """Prompt indices rank `rank` generates for in cycle `cycle` (0-based).

    The cycle's global batch of `per_rank * world` prompts (the resumable order of
    `trainer.engine.loop.step_batches`) is cut into contiguous slices, one per rank: disjoint, so all G
    completions of a prompt, i.e. its whole group, are generated, scored and normalised on one
    rank. With one process this is exactly `step_batches(num_prompts, per_rank, 1, seed, cycle + 1)`.
    """
    size = per_rank * world
    (picked,) = step_batches(num_prompts, size, 1, seed, cycle + 1)
    if world > 1 and len(picked) < size:
        # The last batch of an epoch is short when `size` does not divide the prompts. Ranks need
        # equal shares (else their collectives would not pair up): top it up with the next batch,
        # the first of the next epoch. One process keeps the short batch, as it always has.
        (following,) = step_batches(num_prompts, size, 1, seed, cycle + 2)
        taken = set(picked)
        picked = picked + [i for i in following if i not in taken][:size - len(picked)]
    return picked[rank * per_rank:(rank + 1) * per_rank]


# ----------------------------------------------------------------------------------------------
# Forward, backward, optimizer step


@contextlib.contextmanager
def micro_batch(accelerator, model, last: bool) -> Iterator[None]:
    """One micro-batch of gradient accumulation: gradients are reduced across ranks on the last one only.

    DDP skips its all-reduce under `no_sync`; DeepSpeed reads `sync_gradients` as its accumulation
    boundary and steps its engine inside the last `backward`.
    """
    accelerator.sync_gradients = last
    try:
        with contextlib.nullcontext() if last else accelerator.no_sync(model):
            yield
    finally:
        accelerator.sync_gradients = True


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP or DeepSpeed wrapper (both keep it as `.module`). accelerate's `unwrap_model`
    does the same but imports DeepSpeed to recognise its engine, and MLflow with it: ~1.5 s in every
    process that never uses either."""
    from torch.nn.parallel import DistributedDataParallel

    wrappers = (DistributedDataParallel,)
    if "deepspeed" in sys.modules:  # only then can the model be in a DeepSpeed engine
        from deepspeed import DeepSpeedEngine

        wrappers += (DeepSpeedEngine,)
    while isinstance(model, wrappers):
        model = model.module
    return model


def backward(accelerator, loss: torch.Tensor) -> None:
    """`loss.backward()` the way the prepared model needs it. The loss is already scaled for
    accumulation (the stage divides by micro-batches or by the cycle's tokens), so DeepSpeed must
    not divide it again by its `gradient_accumulation_steps`."""
    if accelerator.state.deepspeed_plugin is not None:
        accelerator.backward(loss, scale_wrt_gas=False)
    else:
        accelerator.backward(loss)


def clip_and_step(accelerator, model, optimizer, scheduler, max_grad_norm: float) -> float:
    """Clip the gradients, step optimizer and schedule, zero the gradients, through accelerate;
    returns the gradient norm before clipping.

    Under DeepSpeed the engine has already clipped (its `gradient_clipping`) and stepped in the
    last `backward`; the optimizer's `step` and `zero_grad` are then no-ops and the norm is the
    engine's (a non-finite step cannot be skipped there; the runner stops the run instead).
    """
    params = [p for p in unwrap(model).parameters() if p.requires_grad]
    norm = accelerator.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    norm = float(norm) if norm is not None else float("nan")
    # A non-finite norm (NaN / inf loss or gradients) skips the update: the weights stay finite.
    # Every rank sees the same norm (gradients are reduced first), so all skip together.
    if math.isfinite(norm):
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


@contextlib.contextmanager
def full_params(accelerator, model) -> Iterator[None]:
    """Whole parameters on every rank for the duration (ZeRO-3 shards them): for `state_dict()`,
    saving and weight pushes. Every rank must enter it together. A no-op otherwise."""
    if zero_stage(accelerator) == 3:
        import deepspeed

        if hasattr(model, "empty_partition_cache"):
            # Prefetched all-gathers may still be in flight after no-grad (evaluation) forwards
            # or an earlier gather; DeepSpeed would refuse to re-shard those parameters on exit.
            model.empty_partition_cache()
        params = list(unwrap(model).parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
    else:
        yield


PEFT_PREFIX = "base_model.model."  # a PeftModel's names: this, then the HF model's own


def full_weights(accelerator, model, module) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole state dict of `module`, the HF causal LM (or PeftModel) that `model` wraps (the object
    `accelerator.prepare` returned), in HF names,
    module by module, for a weight push: under ZeRO-3 each module's parameters are gathered, yielded
    (as copies, since the gather is undone once the iterator moves on) and released before the next
    module's, so no rank ever holds the whole model. Every rank must iterate it to the end together.

    LoRA: a LoRA layer yields its merged weight, base + B A * scaling (PEFT's merge formula), computed
    into a new tensor, so the trained base weight is never changed (merge-then-unmerge in place would
    add rounding to it at every push); the adapter's own tensors are not yielded.
    """
    zero3 = zero_stage(accelerator) == 3
    if zero3 and hasattr(model, "empty_partition_cache"):
        model.empty_partition_cache()  # see full_params
    peft = hasattr(module, "peft_config")
    inside_lora: list[str] = []
    for name, sub in module.named_modules():
        if any(name.startswith(p) for p in inside_lora):
            continue
        hf_name = name.removeprefix(PEFT_PREFIX) if peft else name
        prefix = f"{hf_name}." if hf_name else ""
        if peft and hasattr(sub, "get_delta_weight") and hasattr(sub, "get_base_layer"):
            inside_lora.append(name + ".")
            base = sub.get_base_layer()
            with _gathered(list(sub.parameters()), zero3), torch.no_grad():
                weight = base.weight.detach().clone()
                if not getattr(sub, "merged", False):
                    for adapter in sub.active_adapters:
                        if adapter in sub.lora_A:
                            weight += sub.get_delta_weight(adapter).to(weight.dtype)
                yield prefix + "weight", weight
                if getattr(base, "bias", None) is not None:
                    yield prefix + "bias", base.bias.detach().clone()
            continue
        params = list(sub.named_parameters(recurse=False))
        buffers = [(n, b) for n, b in sub.named_buffers(recurse=False) if n not in sub._non_persistent_buffers_set]
        if not params and not buffers:
            continue
        with _gathered([p for _, p in params], zero3):
            for n, tensor in [*params, *buffers]:
                yield prefix + n, tensor.detach().clone() if zero3 else tensor.detach()


@contextlib.contextmanager
def _gathered(params: list, zero3: bool) -> Iterator[None]:
    if not zero3 or not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


def prepare_reference(accelerator, ref_model):
    """The frozen reference model on this rank's device; under ZeRO-3 (where `from_pretrained` loaded
    it sharded) an inference-only DeepSpeed engine, as TRL does."""
    if ref_model is None:
        return None
    if zero_stage(accelerator) != 3:
        return ref_model.to(accelerator.device)
    import deepspeed

    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1,
              "bf16": {"enabled": ref_model.dtype == torch.bfloat16},
              "fp16": {"enabled": ref_model.dtype == torch.float16}}
    engine, *_ = deepspeed.initialize(model=ref_model, config=config)
    engine.eval()  # DeepSpeedEngine.eval returns None
    return engine


# ----------------------------------------------------------------------------------------------
# Metrics, logging


def mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Every rank's metrics averaged key by key (a key some ranks lack is averaged over those that have it).
    Every rank must call it at the same step. One process: `metrics` unchanged."""
    from accelerate.utils import gather_object

    per_rank = gather_object([metrics])
    if len(per_rank) == 1:
        return dict(per_rank[0])
    keys = list(dict.fromkeys(k for m in per_rank for k in m))
    return {k: sum(m[k] for m in per_rank if k in m) / sum(k in m for m in per_rank) for k in keys}


def rank_tracker(accelerator, config, stage: str, run_id: str | None) -> Tracker:
    """Rank 0's MLflow tracker; the other ranks get one with MLflow off (their metrics reach rank 0's)."""
    if accelerator.is_main_process:
        return Tracker(config, stage, run_id=run_id)
    return Tracker(SimpleNamespace(tracking_uri=None, mlflow_log_checkpoint=False), stage)


# ----------------------------------------------------------------------------------------------
# Per-rank state in checkpoints


def seed_rank(seed: int, rank: int) -> None:
    """Give ranks other than 0 their own random stream (dropout), after the model was built identically on all."""
    if rank:
        from trainer.engine.loop import set_seed

        set_seed(seed + rank)


def rank_rng_states(accelerator) -> list[dict] | None:
    """Every rank's RNG state as JSON (for a step checkpoint's `TrainState.extra`); None with one
    process, whose RNG state the checkpoint keeps already. Every rank must call it."""
    if accelerator.num_processes == 1:
        return None
    from accelerate.utils import gather_object

    from trainer.engine.checkpoint import rng_state

    return gather_object([rng_state()])


def every_rank(accelerator, value: Any) -> list:
    """`value` from every rank, in rank order (JSON-able values; every rank must call it)."""
    if accelerator.num_processes == 1:
        return [value]
    from accelerate.utils import gather_object

    return gather_object([value])


def this_rank(accelerator, values: list | None) -> Any:
    """This rank's entry of an `every_rank` list from a checkpoint; None when absent or saved by another world size."""
    if not values or len(values) != accelerator.num_processes:
        return None
    return values[accelerator.process_index]


def restore_rank_rng(accelerator, states: list[dict] | None) -> None:
    """Undo `rank_rng_states` on this rank (the checkpoint restored rank 0's state on every rank)."""
    if not states or accelerator.num_processes == 1:
        return
    if len(states) != accelerator.num_processes:
        log.warning("The checkpoint holds RNG states of %d ranks, this run has %d; ranks keep rank 0's.",
                    len(states), accelerator.num_processes)
        return
    if not isinstance(states[accelerator.process_index], dict):
        log.warning("The checkpoint's per-rank RNG states are in an older, pickled format; they are not loaded.")
        return
    from trainer.engine.checkpoint import set_rng_state

    set_rng_state(states[accelerator.process_index])


class _ShardedOptimizer:
    """What `trainer.engine.checkpoint` sees as the optimizer under DeepSpeed: nothing to save or load there,
    since ZeRO shards the optimizer state across ranks (`save_engine_state` keeps the shards)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def checkpoint_optimizer(accelerator, optimizer):
    return _ShardedOptimizer() if accelerator.state.deepspeed_plugin is not None else optimizer


def save_engine_state(accelerator, model, checkpoint_dir: str) -> None:
    """DeepSpeed: every rank writes its ZeRO shard of model and optimizer state into the step
    checkpoint; to an object store through a local folder of its own, which it uploads. Call on
    all ranks before rank 0 completes the checkpoint (the marker comes last)."""
    if accelerator.state.deepspeed_plugin is None:
        return
    from trainer.engine import checkpoint
    from trainer.io import storage

    def write(folder: Path) -> None:  # a full disk is one line (DiskFullError), as for the folder rank 0 writes
        try:
            model.save_checkpoint(str(folder / DEEPSPEED_STATE_DIR), tag="state", save_latest=False)
        except Exception as err:
            # The shard's size is DeepSpeed's to know: the error names the free space only.
            if (full := checkpoint.disk_full(err, folder, checkpoint_dir, None)) is None:
                raise
            raise full from err

    if not storage.is_remote(checkpoint_dir):
        return write(Path(checkpoint_dir))
    import shutil
    import tempfile

    local = Path(tempfile.mkdtemp(prefix=f"alignflow-zero-rank{accelerator.process_index}-"))
    try:
        write(local)
        # The ranks write different files (rank 0 also the model states), so uploads never collide.
        storage.upload_dir(local / DEEPSPEED_STATE_DIR, storage.join(checkpoint_dir, DEEPSPEED_STATE_DIR))
    finally:
        shutil.rmtree(local, ignore_errors=True)


def load_engine_state(accelerator, model, checkpoint_dir: str) -> None:
    if accelerator.state.deepspeed_plugin is None:
        return
    path = Path(checkpoint_dir) / DEEPSPEED_STATE_DIR
    if not path.is_dir():
        raise ValueError(f"{checkpoint_dir!r} has no {DEEPSPEED_STATE_DIR}/ folder: it was not written by a DeepSpeed "
                         "run, whose optimizer state is sharded. Start from it with `model` instead.")
    model.load_checkpoint(str(path), tag="state", load_optimizer_states=True, load_lr_scheduler_states=False)


# ----------------------------------------------------------------------------------------------
# Debug report


class RankReport:
    """What this rank trained on and ended with, written to $ALIGNFLOW_RANK_REPORT_DIR/rank_<N>.json
    when that variable is set (tests compare ranks); does nothing otherwise."""

    def __init__(self, accelerator) -> None:
        self.folder = os.environ.get(RANK_REPORT_ENV)
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.cycles: list[dict[str, Any]] = []

    def add_cycle(self, cycle: int, prompts: list[int], group_sizes: list[int]) -> None:
        if self.folder:
            self.cycles.append({"cycle": cycle, "prompts": list(prompts), "group_sizes": list(group_sizes)})

    def write(self, model) -> None:
        if not self.folder:
            return
        digest = hashlib.sha256()
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().numpy().tobytes())
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        report = {"rank": self.rank, "world_size": self.world, "params_sha256": digest.hexdigest(),
                  "cycles": self.cycles}
        (Path(self.folder) / f"rank_{self.rank}.json").write_text(json.dumps(report))
