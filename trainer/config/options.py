"""Stage configs and the command line that fills them.

Each stage has one dataclass; its field ``help`` strings are the only documentation of a knob.
`TrainConfig` holds the fields every stage shares (model, data, optimisation, checkpointing,
LoRA, MLflow). Values come from, in increasing priority: field defaults, a YAML file of
overrides (``--config FILE.yaml``), and ``--<field> VALUE`` flags.

Parsing uses transformers' `HfArgumentParser` (dataclass -> argparse). YAML overrides are
turned into flags before parsing so that both sources get the same type checks and errors.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from trainer.config.strict_yaml import load_yaml
from trainer.errors import ConfigError
from trainer.io.storage import is_remote

C = TypeVar("C", bound="TrainConfig")


def option(default: Any, help: str, aliases: tuple[str, ...] = (), **kwargs: Any) -> Any:
    """A dataclass field with a default and its help string; `aliases` are TRL's names for it
    (accepted in YAML files and as flags, with a note; listed by --help)."""
    if aliases:  # HfArgumentParser adds `aliases` metadata as extra flags, so --help lists them
        kwargs["aliases"] = [f"--{a}" for a in aliases]
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


# `deepspeed` presets: JSON files in trainer/configs/.
DEEPSPEED_PRESETS = ("zero2", "zero3", "zero3_offload")


# Fields (of any stage) that name something the run reads; `output_dir` must stay apart from them all.
INPUT_FIELDS = ("model", "dataset", "eval_dataset", "chat_template_path", "ref_model", "critic_model", "reward_funcs")


def _overlap(output_dir: str, path: str) -> str | None:
    """How `output_dir` meets an input `path`: "is", "lies inside" or "contains"; None when apart. s3:// (any
    remote URI) compares as a string prefix; a local input counts only when it exists (else it is a hub id, a
    built-in name or an import path), compared with symlinks resolved."""
    remote = "://" in output_dir, "://" in path
    if remote[0] != remote[1]:
        return None
    if remote[0]:
        out, inp = output_dir.rstrip("/"), path.rstrip("/")
    else:
        inp = os.path.expanduser(path)
        if not os.path.exists(inp):
            return None
        out, inp = os.path.realpath(os.path.expanduser(output_dir)), os.path.realpath(inp)
    if out == inp:
        return "is"
    if out.startswith(inp.rstrip("/") + "/"):
        return "lies inside"
    if inp.startswith(out.rstrip("/") + "/"):
        return "contains"
    return None


def check_output_apart(output_dir: str, inputs: list[tuple[str, str]]) -> None:
    """Refuse an `output_dir` that is, lies inside or contains one of the run's inputs: saving would write
    over it (an `output_dir` equal to `model` used to replace the base model's weights)."""
    for name, path in inputs:
        how = _overlap(output_dir, path)
        if how:
            raise ConfigError(f"`output_dir` {output_dir!r} {how} the `{name}` input {path!r}: the run would write "
                              "into what it reads (checkpoints, the final model and pruning all write there). Give "
                              "`output_dir` a folder (or s3:// prefix) of its own, outside every input.")


@dataclass
class TrainConfig:
    """Fields shared by every training stage."""

    # --- model and data -------------------------------------------------------------------
    model: str = option("", "Starting model: a local folder, an s3:// prefix or a hub id.",
                        aliases=("model_name_or_path",))
    dataset: str = option("", "Training data: a jsonl/json/parquet/csv file, a `datasets.save_to_disk` folder, "
                              "a folder with a dataset card (README.md `configs:`), an s3:// prefix, a hub id, or "
                              "`demo` for the built-in demo data.", aliases=("dataset_name",))
    dataset_config: str | None = option(None, "Configuration (subset) of `dataset`, as `name` of "
                                              "`datasets.load_dataset`: for hub ids and folders with a dataset card.")
    dataset_split: str = option("train", "Split to use when the dataset has several (hub ids, saved DatasetDicts).",
                                aliases=("dataset_train_split",))
    dataset_num_proc: int | None = option(
        None, "Processes that tokenize the data (TRL's name). Unset: one below 50,000 rows, else every CPU this "
              "process may use (one process per node tokenizes; the node's other ranks wait and map its file). The "
              "tokens are the same for any count.")
    dataset_mixture: str | None = option(
        None, "Train on several datasets at once, instead of `dataset` (TRL's `datasets:` list): a YAML/JSON list of "
              "{path, name, data_dir, data_files, split, columns, fraction} mappings. Each part loads like `dataset` "
              "(or with `datasets.load_dataset(path, name, data_dir=, data_files=)` when data_dir/data_files are "
              "given); `columns` keeps those columns; `fraction` (all parts or none) sets each part's share, taking "
              "the first rows of each so that none repeats. The parts must end with the same columns.",
        aliases=("datasets",))
    eval_dataset: str | None = option(None, "Held-out data in the same format as `dataset` (optional).")
    eval_split_ratio: float = option(0.0, "When no `eval_dataset` is given, hold out this fraction of `dataset` "
                                          "for evaluation (0 = no evaluation).", aliases=("test_split_size",))
    dataset_test_split: str | None = option(
        None, "Evaluate on this split of `dataset` (TRL's name), for datasets with splits: hub ids, saved "
              "DatasetDicts, folders with a dataset card. A dataset without that split (a single file has none) is an "
              "error. TRL's `eval_strategy: no` turns it off; `eval_strategy: steps` without other held-out data "
              "sets it to TRL's default, `test`.")
    output_dir: str = option("outputs/run", "Where checkpoints and the final model go: a local folder or s3:// prefix.")
    chat_template_path: str | None = option(
        None, "Chat template to use instead of the tokenizer's (for base models without one): a Jinja file, or a "
              "tokenizer folder whose template is copied. Saved with every checkpoint.")
    max_length: int = option(1024, "Longest tokenized example (prompt + completion), in tokens.",
                             aliases=("max_seq_length",))
    truncation_mode: Literal["keep_start", "keep_end", "drop"] = option(
        "keep_start", "What to do with examples longer than `max_length`: keep their start, keep their end, "
                      "or drop them. The count is logged either way.")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = option(
        "float32", "Parameter dtype for training. bfloat16 halves memory; float32 is exact on CPU.",
        aliases=("torch_dtype",))
    gradient_checkpointing: bool = option(False, "Recompute activations in the backward pass to save memory.")
    torch_compile: bool = option(False, "Compile each of the model's repeated blocks (its decoder layers) with "
                                        "torch.compile, inductor, dynamic shapes: the elementwise work around the "
                                        "matmuls runs fused. Costs a compile on the first steps; not under "
                                        "DeepSpeed ZeRO-3.")
    bf16: bool = option(False, "Mixed precision: forward and backward in bfloat16 under autocast while parameters, "
                               "gradients and optimizer states stay in `dtype` (TRL's `bf16`). Under DeepSpeed its "
                               "bf16 mode. `accelerate launch --mixed_precision bf16` turns it on as well.")
    fp16: bool = option(False, "Mixed precision in float16 with loss scaling (TRL's `fp16`); GPUs without bf16 only.")
    trust_remote_code: bool = option(False, "Allow model code from the checkpoint folder (hub models with custom code).")

    # --- optimisation -----------------------------------------------------------------------
    max_steps: int = option(-1, "Optimizer steps to run; -1 means `num_epochs` passes over the data.")
    num_epochs: float = option(1.0, "Passes over the training data when `max_steps` is -1.",
                               aliases=("num_train_epochs",))
    per_device_batch_size: int = option(8, "Examples per forward pass on each device.",
                                        aliases=("per_device_train_batch_size",))
    gradient_accumulation_steps: int = option(1, "Forward passes per optimizer step.")
    learning_rate: float = option(2e-5, "Peak learning rate (AdamW).")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    adam_beta1: float = option(0.9, "AdamW beta1.")
    adam_beta2: float = option(0.999, "AdamW beta2.")
    max_grad_norm: float = option(1.0, "Clip the global gradient norm to this value (0 = no clipping).")
    max_nonfinite_steps: int = option(3, "Optimizer steps whose gradient norm is NaN or infinite (a non-finite loss "
                                         "or gradient) are skipped; this many in a row stop the run with an error.")
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr"] = option(
        "linear", "Learning-rate schedule after warmup (transformers' `get_scheduler` names).",
        aliases=("lr_scheduler_type",))
    warmup_ratio: float = option(0.0, "Fraction of the total steps spent warming the learning rate up from 0.")
    seed: int = option(42, "Seed for model init, data order and sampling.")

    per_device_eval_batch_size: int = option(
        0, "Examples per evaluation forward pass on each device (GRPO/PPO: completions, rounded to whole groups); "
           "0 = `per_device_batch_size`. Evaluation metrics do not depend on it, its memory does.")

    # --- devices and processes -----------------------------------------------------------------
    use_cpu: bool = option(False, "Train on the CPU even when GPUs are present (TRL's `use_cpu`: accelerate's `cpu`). "
                                  "Not with `deepspeed` or a vLLM rollout engine.")
    ddp_timeout: int = option(1800, "Seconds a rank waits for the others at a collective before the run fails "
                                    "(the process group's timeout; TRL's `ddp_timeout`).")
    ddp_find_unused_parameters: bool = option(
        False, "Let DDP look for parameters that get no gradient in a step (TRL's `ddp_find_unused_parameters`), "
               "for models whose forward skips some; slower. DDP only: DeepSpeed handles them itself.")
    num_processes: int = option(1, "Training processes (ranks) on this machine, one per GPU (or CPU ranks over gloo); "
                                   "above 1 `alignflow train` starts them through `accelerate launch` (docs/scaling.md).")
    deepspeed: str | None = option(None, "DeepSpeed ZeRO: `zero2`, `zero3`, `zero3_offload` (optimizer state in CPU "
                                         "memory) or a DeepSpeed JSON file; unset = plain data parallelism (DDP).")

    # --- checkpoints and logging --------------------------------------------------------------
    save_steps: int = option(0, "Save a resumable checkpoint every this many steps (0 = only at the end).")
    save_minutes: float = option(0.0, "Also save a resumable checkpoint every this many minutes (0 = off); "
                                      "pipelines default to 30.")
    save_total_limit: int = option(2, "Keep at most this many step checkpoints in `output_dir` (0 = keep all).")
    stop_budget_seconds: float = option(
        20.0, "On SIGTERM or SIGINT (a preempted or cancelled pod) the run finishes its step, saves a resumable "
              "checkpoint and exits with code 75, all within this many seconds of the signal; past it, it exits 75 "
              "at once and `auto` resumes from the previous checkpoint. Keep it below the pod's grace period "
              "(Kubernetes: 30 s) (docs/reliability.md).")
    logging_steps: int = option(10, "Log metrics every this many steps.")
    eval_steps: int = option(0, "Evaluate every this many steps (0 = only at the end).")
    resume_from_checkpoint: str | None = option(
        None, "A step checkpoint folder to resume from, or `auto` for the newest complete checkpoint in `output_dir`. "
              "Only the same run continues: a checkpoint whose stage, base model, training data, seed, LoRA "
              "settings or other result-changing options differ is refused (docs/reliability.md).")
    resume_allow_changes: bool = option(
        False, "Continue a checkpoint's run although its identity differs (a new seed, learning rate, base model, "
               "data ...): on purpose, with a warning; alignflow.json records each change (`resume_changes`) and "
               "`resumed_from`. Another stage's checkpoint is refused even so.")
    disable_progress_bar: bool = option(False, "Hide the progress bar (it also hides when stderr is not a terminal).",
                                        aliases=("disable_tqdm",))

    # --- LoRA ---------------------------------------------------------------------------------
    lora_r: int = option(0, "LoRA rank; 0 trains all weights.")
    lora_alpha: int = option(16, "LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: float = option(0.0, "Dropout on the LoRA input.")
    lora_target_modules: list[str] = option(["all-linear"], "Module names to adapt, or `all-linear`.")
    lora_merge_on_save: bool = option(False, "Also save a merged full model (in `merged/`) next to the adapter.")

    # --- MLflow -------------------------------------------------------------------------------
    report_to: list[str] = option(["mlflow"], "`mlflow`: log to MLflow when a tracking URI is set; `none`: no MLflow "
                                              "even when MLFLOW_TRACKING_URI is set (TRL's name and values; only "
                                              "MLflow is supported, `all` means it).")
    mlflow_tracking_uri: str | None = option(
        None, "MLflow tracking URI; defaults to the MLFLOW_TRACKING_URI environment variable (unset = no MLflow).")
    mlflow_experiment: str = option("alignflow", "MLflow experiment name.")
    mlflow_run_name: str | None = option(None, "MLflow run name (default: the stage name and a timestamp).",
                                         aliases=("run_name",))
    mlflow_parent_run_id: str | None = option(
        None, "Log as a child of this MLflow run (pipelines set it; also read from MLFLOW_PARENT_RUN_ID).")
    mlflow_tags: list[str] = option([], "Extra run tags as KEY=VALUE.")
    mlflow_log_checkpoint: bool = option(False, "Upload the final checkpoint folder as MLflow artifacts.")

    # --- Hugging Face Hub (TRL's names) ---------------------------------------------------------
    push_to_hub: bool = option(False, "After the final save, upload the final model folder (with its model card "
                                      "README.md) to the Hugging Face Hub; needs a token (HF_TOKEN or `hf auth "
                                      "login`), checked before training. HF_ENDPOINT selects another Hub.")
    hub_model_id: str | None = option(None, "Hub repo to push to, `owner/name` or `name` (the token owner's "
                                            "namespace); default: the name of `output_dir`.")
    hub_private_repo: bool = option(False, "Create the Hub repo as private (when it does not exist yet).")

    stage = "base"  # class attribute, not a field

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Cross-field checks; each error names the field and what to change."""
        if not self.model:
            raise ConfigError("`model` is required: pass --model PATH (a folder from `alignflow model init-tiny`, "
                              "an s3:// prefix or a hub id).")
        if not self.dataset and not self.dataset_mixture:
            raise ConfigError("`dataset` is required: pass --dataset PATH (jsonl/parquet/csv, a saved dataset "
                              "folder, an s3:// prefix, or `demo`), or a `dataset_mixture`.")
        self._validate_trl_fields()
        positive = ("per_device_batch_size", "gradient_accumulation_steps", "max_length", "logging_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        if self.dataset_num_proc is not None and self.dataset_num_proc < 1:
            raise ConfigError(f"`dataset_num_proc` must be >= 1 (or unset: chosen from the data's size), got "
                              f"{self.dataset_num_proc}.")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"`max_steps` must be positive or -1 (use `num_epochs`), got {self.max_steps}.")
        if self.max_steps == -1 and self.num_epochs <= 0:
            raise ConfigError(f"`num_epochs` must be > 0 when `max_steps` is -1, got {self.num_epochs}.")
        if self.learning_rate < 0:
            raise ConfigError(f"`learning_rate` must be >= 0, got {self.learning_rate}.")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"`warmup_ratio` must be in [0, 1), got {self.warmup_ratio}.")
        if not 0.0 <= self.eval_split_ratio < 1.0:
            raise ConfigError(f"`eval_split_ratio` must be in [0, 1), got {self.eval_split_ratio}.")
        if self.eval_dataset and self.eval_split_ratio:
            raise ConfigError("Set either `eval_dataset` or `eval_split_ratio`, not both.")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                raise ConfigError(f"`{f.name}` is {value}; it must be a finite number.")
            if f.type in ("bool", bool) and not isinstance(value, bool):
                # Built from Python, `packing="no"` would be truthy; the CLI and YAML hand over real booleans.
                raise ConfigError(f"`{f.name}` is {value!r} ({type(value).__name__}); give True or False.")
        for name in ("save_steps", "save_total_limit", "eval_steps", "lora_r", "max_nonfinite_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"`{name}` must be >= 0, got {getattr(self, name)}.")
        if self.bf16 and self.fp16:
            raise ConfigError("Set either `bf16` or `fp16`, not both.")
        self._validate_devices()
        if self.num_processes < 1:
            raise ConfigError(f"`num_processes` must be >= 1, got {self.num_processes}.")
        if self.save_minutes < 0:
            raise ConfigError(f"`save_minutes` must be >= 0, got {self.save_minutes}.")
        if self.stop_budget_seconds <= 0:
            raise ConfigError(f"`stop_budget_seconds` must be > 0, got {self.stop_budget_seconds}; give the seconds a "
                              "stopped run may take to save, below the pod's grace period (30 s by default).")
        if self.deepspeed and self.deepspeed not in DEEPSPEED_PRESETS and not os.path.isfile(self.deepspeed):
            raise ConfigError(f"`deepspeed` is {self.deepspeed!r}: give one of {', '.join(DEEPSPEED_PRESETS)} or the "
                              "path of a DeepSpeed JSON file.")
        if self.deepspeed and self.deepspeed not in DEEPSPEED_PRESETS:
            _check_deepspeed_file(self.deepspeed)
        if self.hub_model_id and not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", self.hub_model_id):
            raise ConfigError(f"`hub_model_id` is {self.hub_model_id!r}; give `owner/name` or `name` (letters, digits, "
                              "`-`, `_`, `.`).")
        for tag in self.mlflow_tags:
            if "=" not in tag:
                raise ConfigError(f"`mlflow_tags` entries look like KEY=VALUE; got {tag!r}.")
        if self.resume_allow_changes and not self.resume_from_checkpoint:
            raise ConfigError("`resume_allow_changes` applies to a resumed run: set `resume_from_checkpoint` (a "
                              "checkpoint folder or `auto`), or drop `resume_allow_changes`.")
        check_output_apart(self.output_dir, self.input_paths())

    def _validate_devices(self) -> None:
        if self.per_device_eval_batch_size < 0:
            raise ConfigError(f"`per_device_eval_batch_size` must be >= 0 (0 = per_device_batch_size), got "
                              f"{self.per_device_eval_batch_size}.")
        if self.ddp_timeout < 1:
            raise ConfigError(f"`ddp_timeout` must be a whole number of seconds >= 1, got {self.ddp_timeout}.")
        if self.use_cpu and self.deepspeed:
            raise ConfigError("`use_cpu` turns DeepSpeed off in accelerate: drop `deepspeed` for CPU ranks (DDP over "
                              "gloo), or drop `use_cpu` (without GPUs the ranks use the CPU anyway).")
        if self.use_cpu and getattr(self, "rollout_engine", "hf") != "hf":
            raise ConfigError(f"`use_cpu` keeps training off the GPUs, but rollout_engine {self.rollout_engine} runs "
                              "vLLM on them: use rollout_engine hf with use_cpu.")
        if self.ddp_find_unused_parameters and self.deepspeed:
            raise ConfigError("`ddp_find_unused_parameters` is a DDP option; DeepSpeed ZeRO handles parameters without "
                              "gradients itself: drop it, or drop `deepspeed` to use DDP.")
        if self.dataset_test_split is not None:
            other = next((n for n in ("eval_dataset", "eval_split_ratio", "dataset_mixture") if getattr(self, n)), None)
            if other:
                raise ConfigError(f"`dataset_test_split` is a split of `dataset` to evaluate on; it cannot go with "
                                  f"`{other}`: keep one source of held-out data.")
            if self.dataset_test_split == self.dataset_split:
                raise ConfigError(f"`dataset_test_split` is {self.dataset_test_split!r}, the split trained on "
                                  "(`dataset_split`): evaluate on another split.")

    @property
    def eval_batch_size(self) -> int:
        """Examples per evaluation forward pass on each device (`per_device_eval_batch_size`, else the training one)."""
        return self.per_device_eval_batch_size or self.per_device_batch_size

    def input_paths(self) -> list[tuple[str, str]]:
        """(field, path) of everything the run reads: models, data, chat template, reward-model folders."""
        from trainer.config.mixtures import parse_mixture

        found = []
        for name in INPUT_FIELDS:
            value = getattr(self, name, None)
            found += [(name, v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, str) and v]
        for i, part in enumerate(parse_mixture(self.dataset_mixture) if self.dataset_mixture else []):
            files = part.data_files
            files = list(files.values()) if isinstance(files, dict) else [files] if isinstance(files, str) else files
            found += [(f"dataset_mixture[{i}]", v) for v in [part.path, part.data_dir, *(files or [])]
                      if isinstance(v, str) and v]
        return found

    @property
    def tracking_uri(self) -> str | None:
        if "none" in getattr(self, "report_to", ()):
            return None
        return self.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None

    def _validate_trl_fields(self) -> None:
        from trainer.config.mixtures import parse_mixture

        if self.dataset and self.dataset_mixture:
            raise ConfigError("Set either `dataset` or `dataset_mixture` (TRL's `datasets:`), not both.")
        if self.dataset_mixture:
            parse_mixture(self.dataset_mixture)
            if self.dataset_config:
                raise ConfigError("`dataset_config` applies to `dataset`; give each `dataset_mixture` entry its own "
                                  "`name` instead.")
        if self.chat_template_path:
            check_chat_template_path(self.chat_template_path)
        bad = [t for t in self.report_to if t not in ("mlflow", "none", "all")]
        if bad:
            raise ConfigError(f"`report_to` {bad[0]!r} is not supported: alignflow reports to MLflow only; set "
                              "report_to to `mlflow` (or `none` for no tracking).")

    @property
    def mixed_precision(self) -> str:
        """accelerate's name for the precision asked for: bf16, fp16 or no."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"

    @property
    def parent_run_id(self) -> str | None:
        return self.mlflow_parent_run_id or os.environ.get("MLFLOW_PARENT_RUN_ID") or None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_chat_template_path(path: str) -> None:
    """Fail before any work when a local `chat_template_path` does not exist (hub ids and s3:// are fetched later)."""

    looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1 or Path(path).suffix in (".jinja", ".j2")
    if not is_remote(path) and looks_local and not Path(path).expanduser().exists():
        raise ConfigError(f"`chat_template_path` {path!r} does not exist: give a Jinja template file or a tokenizer "
                          "folder with a chat template.")


# ----------------------------------------------------------------------------------------------
# Parsing


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def aliases(cls: type) -> dict[str, str]:
    """TRL's names for the fields of `cls`: alias -> field name."""
    return {alias.removeprefix("--"): f.name for f in dataclasses.fields(cls) for alias in f.metadata.get("aliases", ())}


_noted: set[str] = set()


def note(message: str) -> None:
    """Say once per process how a TRL name was read (rank 0 only under a launcher)."""
    if message not in _noted and os.environ.get("RANK", "0") == "0":
        _noted.add(message)
        print(f"note: {message}", file=sys.stderr)


def _unknown_field_error(cls: type, name: str, where: str) -> ConfigError:
    from trainer.config.trl_names import trl_names

    names = field_names(cls) + list(aliases(cls))
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    command = getattr(cls, "command", f"alignflow train {cls.stage}")
    if name in trl_names() and cls.stage != "eval":
        return ConfigError(f"`{name}` ({where}) is a TRL option the {cls.stage} stage has no equivalent for; remove "
                           f"it (docs/trl.md lists TRL's names and what they map to).{hint}")
    return ConfigError(f"Unknown {cls.stage} option `{name}` ({where}).{hint} "
                       f"Run `{command} --help` to list the options.")


def _canonical(cls: type, key: str, value: Any, where: str, trl: dict[str, Any]) -> str | None:
    """The field `key` sets (its own name or the field a TRL alias names), or None for a TRL-only option,
    which is put in `trl` when it needs translating, or checked and dropped when alignflow ignores it."""
    from trainer.config import trl_names

    key = key.replace("-", "_")
    fields, alias = field_names(cls), aliases(cls)
    if key in fields:
        return key
    if key in alias:
        note(f"{key} is TRL's name for {alias[key]}")
        return alias[key]
    if cls.stage != "eval" and key in trl_names.TRANSLATED:
        trl[key] = value
        return None
    known = trl_names.KNOWN.get(key) if cls.stage != "eval" else None
    if known is None:
        raise _unknown_field_error(cls, key, where)
    if not known.accept(value):
        shown = json.dumps(value) if isinstance(value, bool) or value is None else value
        raise ConfigError(f"`{key}: {shown}` ({where}) is a TRL option alignflow does not support: {known.reason}. "
                          f"Remove it.")
    note(f"{key} ignored: {known.reason}")
    return None


def _trl_value(name: str, value: Any) -> Any:
    """A field's value, with TRL's spelling of "off" turned into alignflow's (`top_k: 0` -> -1)."""
    from trainer.config.trl_names import VALUES

    mapped = VALUES.get(name, {})
    if not isinstance(value, bool) and isinstance(value, int | float) and value in mapped:
        note(f"{name} {value} is TRL's 'off'; alignflow's is {mapped[value]}")
        return mapped[value]
    return value


def expected_type(cls: type, name: str) -> str:
    """What field `name` of `cls` takes, in words (for errors): a number, a whole number, one of ..., a list ..."""
    kind = typing.get_type_hints(cls).get(name)
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        kind = args[0]  # X | None
    if typing.get_origin(kind) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(kind)))
    if typing.get_origin(kind) is list:
        return "a list"
    return {float: "a number", int: "a whole number", bool: "true or false", str: "a single string"}.get(
        kind, "a single value")


def _value_argv(key: str, value: Any, source: str, cls: type | None = None) -> list[str]:
    """`--key value...` tokens for one override (None and empty lists give none: they are the defaults)."""
    if value is None:
        return []  # argparse cannot express None; None is every Optional field's default
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [f"--{key}", json.dumps(value)]  # a list of mappings (`dataset_mixture`) travels as JSON
    if isinstance(value, list) and cls is not None and expected_type(cls, key) != "a list":
        raise ConfigError(f"`{key}` in {source} is a list ({value!r}); it takes {expected_type(cls, key)}. Give a "
                          "single value.")
    if isinstance(value, list):
        if not value:
            return []
        return [f"--{key}", *[str(int(v)) if isinstance(v, float) and v.is_integer() else str(v) for v in value]]
    if isinstance(value, bool):
        return [f"--{key}", "true" if value else "false"]
    if isinstance(value, float) and value.is_integer():
        return [f"--{key}", str(int(value))]  # KFP's structured parameters turn ints into floats
    if isinstance(value, dict):
        raise ConfigError(f"`{key}` in {source} is a mapping; it takes a single value.")
    return [f"--{key}", str(value)]


def _yaml_to_argv(cls: type, overrides: dict[str, Any], source: str, flag_trl: dict[str, Any] | None = None,
                  flag_fields: dict[str, Any] | None = None) -> list[str]:
    """Turn YAML overrides (TRL names included) into ``--name value`` tokens so argparse type-checks them too.

    `flag_trl` are TRL-only options from the command line and `flag_fields` the fields set there (name -> value as
    given, None when it is not a single value): TRL options
    are translated together, and the flags (parsed after these tokens) win over everything here."""
    from trainer.config.trl_names import evaluation_off, translate

    trl: dict[str, Any] = {}
    resolved: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in overrides.items():
        name = _canonical(cls, str(key), value, f"in {source}", trl)
        if name is not None and name in resolved:  # a field and its TRL name, or two TRL names of one field
            raise ConfigError(f"{source} sets `{name}` twice (as `{key}` and as `{origin[name]}`); keep one.")
        if name is not None:
            resolved[name], origin[name] = _trl_value(name, value), str(key)
    trl |= flag_trl or {}
    flag_fields = flag_fields or {}
    translated = translate(trl, set(field_names(cls)), set(resolved) | set(flag_fields), note)
    # TRL's `use_peft: false` means full fine-tuning even when the file also sets `lora_r`.
    forced = {"lora_r"} if trl.get("use_peft") is False or trl.get("use_peft") == 0 else set()
    resolved |= {k: v for k, v in translated.items() if k not in resolved or k in forced}
    if evaluation_off(trl) and resolved.pop("dataset_test_split", None) is not None:
        note("dataset_test_split ignored: eval_strategy is no, so TRL reads no test split either")
    return [token for key, value in resolved.items() for token in _value_argv(key, value, source, cls)]


def _flags(cls: type, argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Command-line flags with TRL aliases renamed (`--model_name_or_path` -> `--model`) and TRL-only flags
    (`--use_peft true`) taken out, as {name: value}; anything unknown is left for argparse to report."""
    from trainer.config import trl_names

    fields, alias = set(field_names(cls)), aliases(cls)
    trl_only = (trl_names.TRANSLATED | set(trl_names.KNOWN)) if cls.stage != "eval" else set()
    out: list[str] = []
    trl: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        key, eq, inline = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        name = key.replace("-", "_")
        if name in fields and name in trl_names.VALUES and not eq and i < len(argv):
            out += [token, str(_trl_value(name, yaml.safe_load(argv[i])))]
            i += 1
            continue
        if not (name in alias or name in trl_only) or name in fields:
            out.append(token)
            continue
        values = [inline] if eq else []
        while not eq and i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        parsed = [yaml.safe_load(v) for v in values]
        value = True if not parsed else parsed[0] if len(parsed) == 1 else parsed
        field_name = _canonical(cls, name, value, "on the command line", trl)
        if field_name is not None:
            out += [f"--{field_name}", *values]
    return out, trl


def make_parser(cls: type, prog: str | None = None):
    from transformers import HfArgumentParser

    parser = HfArgumentParser(cls, prog=prog, description=(cls.__doc__ or "").strip().splitlines()[0],
                              allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML file of option overrides; flags override it.")

    def error(message: str):  # a wrong value is a ConfigError like any other, not an exit
        raise ConfigError(f"{message}. Run `{getattr(cls, 'command', f'alignflow train {cls.stage}')} --help` "
                          "for the accepted values.")

    parser.error = error
    return parser


def parse_config(cls: type[C], argv: list[str] | None = None, prog: str | None = None) -> C:
    """Build a stage config from ``--config FILE.yaml`` and ``--<field> VALUE`` flags (TRL's names too)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser(cls, prog=prog)
    argv, flag_trl = _flags(cls, argv)
    flag_fields = _flag_values(argv)
    # Find --config without letting argparse complain about anything else yet.
    pre, _ = parser.parse_known_args(argv) if "-h" not in argv and "--help" not in argv else (None, None)
    yaml_argv: list[str] = []
    if pre is not None and (pre.config or flag_trl):
        values = load_yaml(pre.config) if pre.config else {}
        yaml_argv = _yaml_to_argv(cls, values, pre.config or "the command line", flag_trl, flag_fields)
    # Flags after the YAML ones win (argparse keeps the last value).
    namespace, remaining = parser.parse_known_args(yaml_argv + argv)
    if remaining:
        if not remaining[0].startswith("-"):  # a value without a flag of its own: one too many for the flag before it
            flag = _flag_before(argv, remaining[0])
            if flag in field_names(cls):
                raise ConfigError(f"`--{flag}` takes {expected_type(cls, flag)}; it was given more than one value "
                                  f"(`{remaining[0]}` is left over). Give one value.")
        flag = next((r for r in remaining if r.startswith("--")), remaining[0])
        raise _unknown_field_error(cls, flag.lstrip("-").split("=")[0], "on the command line")
    values = {k: v for k, v in vars(namespace).items() if k != "config"}
    return cls(**values)


def _check_deepspeed_file(path: str) -> None:
    """A `deepspeed` file is read by every rank after they start: check here that it is a JSON object."""
    try:
        with open(path, encoding="utf-8") as fh:
            loaded = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"`deepspeed` file {path!r} is not readable JSON ({err}); give a DeepSpeed config file "
                          "(JSON), or a preset: " + ", ".join(DEEPSPEED_PRESETS) + ".") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"`deepspeed` file {path!r} holds a JSON {type(loaded).__name__}, not an object of DeepSpeed "
                          "settings (e.g. {\"zero_optimization\": {\"stage\": 2}}).")


def _flag_values(argv: list[str]) -> dict[str, Any]:
    """The fields set by `argv`'s flags: name -> the value given (YAML-parsed; True for a bare flag), or None
    when it is not a single value."""
    found: dict[str, Any] = {}
    for i, token in enumerate(argv):
        if not token.startswith("--"):
            continue
        key, eq, inline = token[2:].partition("=")
        values = [inline] if eq else list(itertools.takewhile(lambda t: not t.startswith("--"), argv[i + 1:]))
        try:
            found[key.replace("-", "_")] = yaml.safe_load(values[0]) if len(values) == 1 else True if not values else None
        except yaml.YAMLError:
            found[key.replace("-", "_")] = None
    return found


def _flag_before(argv: list[str], value: str) -> str | None:
    """The field of the flag that `value` follows in `argv` (the last occurrence), or None."""
    flag = found = None
    for token in argv:
        if token.startswith("--"):
            flag = token[2:].split("=")[0].replace("-", "_")
        elif token == value:
            found = flag
    return found


def config_from_dict(cls: type[C], values: dict[str, Any]) -> C:
    """Build a config from a mapping (used by pipeline components), with the same checks."""
    return parse_config(cls, _yaml_to_argv(cls, values, "the stage config"))
