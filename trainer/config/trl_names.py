"""TRL's option names, for configs written for `trl sft|dpo|grpo|reward --config`.

A TRL option is, for alignflow, one of:

- an *alias*: the same knob under another name (`model_name_or_path` is `model`). Aliases live in
  the stage dataclasses' field metadata (`option(..., aliases=(...))`); `trainer.config.options` resolves them.
- a *translation*: a knob alignflow spells differently (`use_peft`, `use_vllm` + `vllm_mode`,
  `warmup_steps`, `eval_strategy`); `translate` turns it into alignflow fields.
- *known but unsupported* (`KNOWN`): accepted and ignored when its value asks for what alignflow
  does anyway (`optim: adamw_torch`, `save_strategy: steps`), rejected with the reason otherwise
  (`use_liger_kernel: true`).
- any other TRL or `transformers.TrainingArguments` name: rejected as having no alignflow equivalent.

docs/trl.md is the user-facing version of these tables; keep the two in step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from trainer.errors import ConfigError


@dataclass(frozen=True)
class Known:
    """A TRL option with no alignflow field: values `accept` allows are ignored, others rejected."""

    reason: str
    accept: Callable[[Any], bool]
    accepted: str = ""  # the accepted values, in words (docs/trl.md)


def _off(value: Any) -> bool:
    return value in (None, False, "", "none", "no", [], {})


def unset(reason: str) -> Known:
    """Rejected unless unset/off (its TRL default): alignflow does not do what it turns on."""
    return Known(reason, _off, "unset / false / none")


def only(values: tuple, reason: str) -> Known:
    """Accepted (and ignored) unset or with the given values, which name what alignflow does anyway."""
    return Known(reason, lambda v: v is None or v in values, "unset / " + " / ".join(
        f"`{str(v).lower() if isinstance(v, bool) else v}`" for v in values))


def any_value(reason: str) -> Known:
    """Ignored whatever its value: it only tunes something alignflow does not have (no effect on results)."""
    return Known(reason, lambda v: True, "any")


HUB = "alignflow pushes once, the final model after the final save, to the main branch (`push_to_hub`)"
NO_WORKERS = "alignflow tokenizes the data once, up front, in the training process; there are no loader workers"
EVAL_DATA = "held-out data come from `eval_dataset` or an `eval_split_ratio` hold-out"

KNOWN: dict[str, Known] = {
    # --- Hub, trackers, logging ---------------------------------------------------------------
    # push_to_hub, hub_model_id and hub_private_repo are fields (trainer/engine/hub.py).
    "hub_strategy": only(("end",), HUB),
    "hub_always_push": unset(HUB),
    "hub_revision": unset(HUB),
    "hub_token": unset("give the token in HF_TOKEN (or `hf auth login`): tokens stay out of configs, manifests and "
                       "MLflow params"),
    "log_completions_hub_repo": unset("completions tables go to MLflow (`log_completions_steps`)"),
    "logging_strategy": only(("steps",), "metrics are logged every `logging_steps` steps"),
    "logging_first_step": any_value("the first step is always logged"),
    "logging_dir": any_value("metrics go to `metrics.jsonl` in each checkpoint and to MLflow"),
    "logging_nan_inf_filter": any_value("non-finite losses are skipped and counted (`max_nonfinite_steps`)"),
    "log_level": any_value("set ALIGNFLOW_LOG_LEVEL instead"),
    "log_level_replica": any_value("only rank 0 logs"),
    "log_on_each_node": any_value("only rank 0 logs"),
    "project": any_value("a trackio setting; the MLflow experiment is `mlflow_experiment`"),
    "skip_memory_metrics": any_value("MLflow system metrics record memory"),
    "include_num_input_tokens_seen": any_value("`num_tokens` is always logged"),
    "log_completions": only((True,), "GRPO/PPO log a completions table every `log_completions_steps` steps "
                                     "(set it to 0 to turn the table off)"),
    "log_unique_prompts": unset("not supported"),
    "log_multimodal": any_value("alignflow trains text models only"),
    # --- saving and evaluation ------------------------------------------------------------------
    "save_strategy": only(("steps", "no"), "checkpoints are saved every `save_steps` steps and/or `save_minutes` minutes "
                                      "(0 = only the final model); there is no per-epoch saving"),
    "save_only_model": unset("every checkpoint carries optimizer, scheduler and RNG state so that "
                             "`resume_from_checkpoint auto` continues exactly"),
    "save_safetensors": only((True,), "checkpoints are always safetensors"),
    "save_on_each_node": unset("rank 0 saves, to `output_dir` (shared storage or s3://)"),
    "overwrite_output_dir": any_value("a new run in a folder with checkpoints starts afresh unless "
                                      "`resume_from_checkpoint` is set"),
    "load_best_model_at_end": unset("not supported: the final model is the last step's; pick among checkpoints "
                                    "with `alignflow eval` and `alignflow promote`"),
    "metric_for_best_model": unset("not supported (see `load_best_model_at_end`)"),
    "greater_is_better": any_value("only used with `metric_for_best_model`, which is not supported"),
    "eval_accumulation_steps": any_value("evaluation metrics are reduced on the fly"),
    "eval_on_start": unset("not supported: evaluation runs every `eval_steps` and at the end"),
    "eval_delay": unset("not supported: evaluation runs every `eval_steps` and at the end"),
    "prediction_loss_only": any_value("evaluation computes the stage's own metrics"),
    "eval_packing": any_value("evaluation sums loss and accuracy over tokens: the same packed or not"),
    # --- optimiser and precision ----------------------------------------------------------------
    "optim": only(("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw"),
                  "the optimizer is always torch's AdamW (under DeepSpeed, as configured by `deepspeed`)"),
    "optim_args": unset("the optimizer is always torch's AdamW, tuned with `adam_beta1`, `adam_beta2` and "
                        "`weight_decay`"),
    "adam_epsilon": only((1e-8,), "AdamW runs with torch's default eps of 1e-8"),
    "lr_scheduler_kwargs": unset("schedules take no extra arguments; choose `lr_scheduler`"),
    "tf32": unset("TF32 stays at torch's default; use `bf16` for fast GPU matmuls"),
    "bf16_full_eval": unset("evaluation runs in the training precision (`bf16`/`fp16`)"),
    "fp16_full_eval": unset("evaluation runs in the training precision (`bf16`/`fp16`)"),
    "half_precision_backend": any_value("mixed precision is torch autocast through accelerate"),
    "gradient_checkpointing_kwargs": Known("gradient checkpointing is always non-reentrant",
                                           lambda v: _off(v) or v == {"use_reentrant": False},
                                           "unset / `{use_reentrant: false}`"),
    "torch_compile_backend": only(("inductor",), "`torch_compile` compiles with inductor"),
    "torch_compile_mode": unset("`torch_compile` compiles in the default mode"),
    "use_liger_kernel": unset("Liger kernels are not supported"),
    "liger_kernel_config": unset("Liger kernels are not supported"),
    "activation_offloading": unset("not supported: use `gradient_checkpointing` or DeepSpeed `zero3_offload`"),
    "cast_lm_head_to_fp32": unset("not supported: train in float32 `dtype` with `bf16` autocast instead"),
    "neftune_noise_alpha": unset("NEFTune is not supported"),
    "label_smoothing_factor": unset("not supported for language-model losses"),
    "auto_find_batch_size": unset("not supported: set `per_device_batch_size`"),
    "torch_empty_cache_steps": any_value("memory management only"),
    "average_tokens_across_devices": only((True,), "losses are normalised by tokens across ranks"),
    # --- data -----------------------------------------------------------------------------------
    "dataset_text_field": only(("text",), "SFT reads text from a `text` column; rename the column to `text`"),
    "dataset_kwargs": unset("not supported: alignflow reads `text`, `prompt`/`completion` and `messages` data "
                            "as they are"),
    "dataset_streaming": unset("streaming is not supported: datasets are loaded (and fingerprinted) in full"),
    "streaming": unset("streaming is not supported: datasets are loaded (and fingerprinted) in full"),
    "dataloader_num_workers": any_value(NO_WORKERS),
    "dataloader_pin_memory": any_value(NO_WORKERS),
    "dataloader_persistent_workers": any_value(NO_WORKERS),
    "dataloader_prefetch_factor": any_value(NO_WORKERS),
    "dataloader_drop_last": unset("not supported: the last, smaller batch of an epoch is trained on"),
    "remove_unused_columns": any_value("each stage reads the columns it needs; GRPO passes every column to rewards"),
    "group_by_length": unset("not supported: use `packing` or `padding_free` (SFT, DPO, reward)"),
    "packing_strategy": only(("bfd",), "packing is always best-fit decreasing without cross-example attention"),
    "pad_to_multiple_of": unset("not supported"),
    "eos_token": unset("set the eos token in the tokenizer files of `model`"),
    "pad_token": unset("set the pad token in the tokenizer files of `model` (eos is used when it has none)"),
    "shuffle_dataset": only((True,), "training data are always shuffled (reproducibly, from `seed`)"),
    "data_seed": unset("data order follows `seed`"),
    "ignore_data_skip": unset("resuming always skips the data already seen, to continue exactly"),
    # --- model loading --------------------------------------------------------------------------
    "model_revision": only(("main",), "pin a revision by downloading it to a folder (or s3://) and passing that"),
    "model_init_kwargs": unset("not supported: use `dtype` and `trust_remote_code`"),
    "attn_implementation": only(("sdpa",), "models load with PyTorch SDPA attention (dense matmuls for bf16 training on the CPU)"),
    "load_in_8bit": unset("quantised training (bitsandbytes) is not supported"),
    "load_in_4bit": unset("quantised training (bitsandbytes) is not supported"),
    "bnb_4bit_quant_type": any_value("quantised training is not supported (see `load_in_4bit`)"),
    "use_bnb_nested_quant": unset("quantised training (bitsandbytes) is not supported"),
    "bnb_4bit_quant_storage": unset("quantised training (bitsandbytes) is not supported"),
    "lora_task_type": only(("CAUSAL_LM", "SEQ_CLS"), "the stage picks the LoRA task type"),
    "lora_modules_to_save": unset("not supported"),
    "lora_target_parameters": unset("not supported: use `lora_target_modules`"),
    "use_rslora": unset("rank-stabilised LoRA is not supported"),
    "use_dora": unset("DoRA is not supported"),
    "router_aux_loss_coef": only((0.001,), "alignflow adds no mixture-of-experts router loss (TRL's default "
                                                   "value is accepted: it changes nothing for dense models)"),
    "ignore_bias_buffers": any_value("a DDP workaround alignflow does not need"),
    # --- distribution ---------------------------------------------------------------------------
    "fsdp": unset("FSDP is not supported: use `deepspeed zero3`"),
    "fsdp_config": unset("FSDP is not supported: use `deepspeed zero3`"),
    "accelerate_config": unset("set `num_processes` and `deepspeed` (zero2, zero3, zero3_offload or a JSON file)"),
    "ddp_backend": any_value("nccl on GPUs, gloo on CPUs"),
    "ddp_bucket_cap_mb": any_value("set by the runner"),
    "ddp_broadcast_buffers": any_value("set by the runner"),
    "full_determinism": unset("not supported: runs are reproducible from `seed` up to non-deterministic kernels"),
    "do_train": any_value("`alignflow train` always trains"),
    "do_eval": any_value(EVAL_DATA),
    "ds3_gather_for_generation": only((True,), "ZeRO-3 weights are always gathered for generation"),
    # --- DPO ------------------------------------------------------------------------------------
    "rpo_alpha": unset("RPO's extra NLL term is not supported"),
    "use_weighting": unset("WPO weighting is not supported"),
    "ld_alpha": unset("LD-DPO is not supported"),
    "loss_weights": unset("one `loss_type` at a time: combinations of losses are not supported"),
    "f_divergence_type": only(("reverse_kl",), "DPO uses the reverse KL"),
    "f_alpha_divergence_coef": any_value("only used with `f_divergence_type`, which is not supported"),
    "discopop_tau": any_value("the discopop loss is not supported"),
    "sync_ref_model": unset("TR-DPO's reference syncing is not supported"),
    "ref_model_mixup_alpha": any_value("only used with `sync_ref_model`, which is not supported"),
    "ref_model_sync_steps": any_value("only used with `sync_ref_model`, which is not supported"),
    "reference_free": unset("use loss_type simpo for reference-free preference training"),
    # --- GRPO -----------------------------------------------------------------------------------
    "reward_model_name_or_path": unset("add the reward-model checkpoint to `reward_funcs`"),
    "num_generations_eval": unset("evaluation samples `num_generations` completions per prompt"),
    "generation_batch_size": unset("a generation cycle covers per_device_batch_size x gradient_accumulation_steps "
                                   "completions; set those"),
    "steps_per_generation": unset("set `gradient_accumulation_steps` (completions per cycle) and `num_iterations`"),
    "min_p": unset("min-p sampling is not supported: use `top_p` / `top_k`"),
    "repetition_penalty": only((1.0,), "repetition penalties are not supported (they bias the sampling "
                                       "distribution the loss assumes)"),
    "generation_kwargs": unset("not supported: use `temperature`, `top_p`, `top_k`"),
    "chat_template_kwargs": unset("not supported"),
    "cache_implementation": any_value("generation cache settings only"),
    "use_transformers_paged": unset("not supported: the hf engine uses plain `generate`"),
    "use_transformers_continuous_batching": unset("not supported: the hf engine uses plain `generate`"),
    "transformers_continuous_batching_config": unset("not supported"),
    "vllm_model_impl": only(("vllm",), "vLLM's own model implementation is used"),
    "vllm_structured_outputs_regex": unset("structured outputs are not supported"),
    "vllm_max_model_length": any_value("set by alignflow from the stage's prompt and completion lengths"),
    "vllm_tensor_parallel_size": only((1,), "tensor parallelism of vLLM is not supported"),
    "importance_sampling_level": only(("token",), "importance ratios are per token (GSPO's sequence level is "
                                                  "not supported)"),
    "multi_objective_aggregation": only(("sum_then_normalize",), "rewards are weighted and summed, then "
                                                                 "normalised"),
    "delta": unset("two-sided clipping is not supported"),
    "off_policy_mask_threshold": unset("not supported"),
    "top_entropy_quantile": only((1.0,), "entropy masking is not supported"),
    "entropy_coef": only((0, 0.0), "entropy bonuses are not supported"),
    "use_adaptive_entropy": unset("entropy bonuses are not supported"),
    "max_tool_calling_iterations": unset("tool calling is not supported"),
    "num_completions_to_print": any_value("the completions table goes to MLflow (`num_completions_to_log` rows)"),
}
KNOWN |= {
    "loss_type": only(("nll",), "SFT trains on the negative log-likelihood (DFT is not supported)"),  # SFT's only
    "disable_dropout": only((False,), "this stage keeps the model's dropout"),  # DPO and reward have the field
    "use_cache": any_value("a generation cache setting; training never uses the cache"),
    "local_rank": any_value("set by the launcher"),
    "debug": unset("not supported"),
    "train_sampling_strategy": only(("random",), "training data are shuffled (from `seed`)"),
    **{name: unset("only MLflow is supported") for name in ("trackio_space_id", "trackio_bucket_id",
                                                              "trackio_static_space_id")},
}
for _name in ("sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
              "vespo_lambda_neg", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"):
    KNOWN[_name] = any_value("only used by a loss or entropy option alignflow does not support")

# Names TRL's configs have beyond `transformers.TrainingArguments` (SFTConfig, DPOConfig, GRPOConfig,
# RewardConfig, ModelConfig, ScriptArguments, DatasetMixtureConfig and the GRPO script's arguments),
# and a few from recent TRL releases. Names only; what each one does is in TRL's own docs.
TRL_ONLY_NAMES = frozenset("""
model_name_or_path model_revision dtype torch_dtype attn_implementation use_peft lora_r lora_alpha lora_dropout
lora_target_modules lora_target_parameters lora_modules_to_save lora_task_type use_rslora use_dora load_in_8bit
load_in_4bit bnb_4bit_quant_type use_bnb_nested_quant bnb_4bit_quant_storage dataset_name dataset_config
dataset_train_split dataset_test_split dataset_streaming ignore_bias_buffers datasets streaming test_split_size
model_init_kwargs trust_remote_code chat_template_path dataset_text_field dataset_kwargs dataset_num_proc eos_token
pad_token max_length max_seq_length truncation_mode shuffle_dataset packing packing_strategy padding_free
pad_to_multiple_of eval_packing completion_only_loss assistant_only_loss loss_type activation_offloading
router_aux_loss_coef disable_dropout precompute_ref_log_probs precompute_ref_batch_size loss_weights ld_alpha
f_divergence_type f_alpha_divergence_coef label_smoothing beta use_weighting discopop_tau sync_ref_model
ref_model_mixup_alpha ref_model_sync_steps max_prompt_length max_completion_length rpo_alpha reference_free
center_rewards_coefficient cast_lm_head_to_fp32 num_generations num_generations_eval ds3_gather_for_generation
generation_batch_size steps_per_generation temperature top_p top_k min_p generation_kwargs chat_template_kwargs
repetition_penalty cache_implementation use_vllm vllm_mode vllm_model_impl vllm_enable_sleep_mode
vllm_structured_outputs_regex vllm_server_base_url vllm_server_host vllm_server_port vllm_server_timeout
vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length vllm_tensor_parallel_size num_iterations epsilon
delta epsilon_high importance_sampling_level reward_weights multi_objective_aggregation scale_rewards
mask_truncated_completions top_entropy_quantile entropy_coef use_adaptive_entropy max_tool_calling_iterations
vllm_importance_sampling_correction vllm_importance_sampling_mode vllm_importance_sampling_clip_max
vllm_importance_sampling_clip_min vllm_importance_sampling_cap off_policy_mask_threshold use_bias_correction_kl
log_completions log_multimodal num_completions_to_print log_unique_prompts log_completions_hub_repo
use_transformers_paged use_transformers_continuous_batching transformers_continuous_batching_config
reward_funcs reward_model_name_or_path accelerate_config num_processes
""".split())


@cache
def trl_names() -> frozenset[str]:
    """Every option name a TRL config may hold: TRL's own and those of `transformers.TrainingArguments`."""
    from transformers import TrainingArguments

    return TRL_ONLY_NAMES | {f.name for f in dataclasses.fields(TrainingArguments) if not f.name.startswith("_")}


# Options alignflow spells differently, turned into alignflow fields by `translate`.
TRANSLATED = frozenset({"use_peft", "use_vllm", "vllm_mode", "warmup_steps", "eval_strategy", "evaluation_strategy",
                        "padding_free"})
TRL_TEST_SPLIT = "test"  # TRL's ScriptArguments default for `dataset_test_split`
PADDING_FREE = ("`padding_free: true` asks for batches without padding; this stage pads its batches (padding-free "
                "batches are SFT's, DPO's and the reward model's): remove it")

TRL_LORA_R = 16  # TRL's ModelConfig default rank, used when `use_peft: true` comes without `lora_r`


def translate(trl: dict[str, Any], fields: set[str], given: set[str],
              note: Callable[[str], None]) -> dict[str, Any]:
    """alignflow field values for TRL's `use_peft`, `use_vllm`/`vllm_mode`, `warmup_steps`, `eval_strategy` and
    `padding_free` (on stages without the field, which refuse it).

    `fields` are the stage's field names, `given` the fields the user set themselves."""
    out: dict[str, Any] = {}
    if "use_peft" in trl:
        if trl["use_peft"] and "lora_r" not in given:
            out["lora_r"] = TRL_LORA_R
        elif not trl["use_peft"]:
            out["lora_r"] = 0
            if "lora_r" in given:
                note("use_peft is false, so lora_r is ignored (full fine-tuning), as in TRL")
    if "use_vllm" in trl or "vllm_mode" in trl:
        if "rollout_engine" not in fields:
            raise ConfigError("`use_vllm`/`vllm_mode` set generation for GRPO and PPO; this stage generates nothing: "
                              "remove them.")
        mode = trl.get("vllm_mode") or "colocate"
        if mode not in ("colocate", "server"):
            raise ConfigError(f"`vllm_mode` is {mode!r}: use `colocate` or `server`.")
        if "use_vllm" in trl:
            out["rollout_engine"] = ("vllm" if mode == "colocate" else "vllm-server") if trl["use_vllm"] else "hf"
            note(f"use_vllm {str(bool(trl['use_vllm'])).lower()}"
                 f"{f' with vllm_mode {mode}' if trl['use_vllm'] else ''} is rollout_engine {out['rollout_engine']}")
    out.update(_warmup(trl, given))
    if trl.get("padding_free"):
        raise ConfigError(PADDING_FREE + ".")
    for key in ("eval_strategy", "evaluation_strategy"):
        strategy = trl.get(key)
        if strategy in (None, "no"):
            continue
        if strategy != "steps":
            raise ConfigError(f"`{key}: {strategy}` is not supported: evaluation runs every `eval_steps` steps and at "
                              "the end; set eval_steps.")
        if not given & {"eval_dataset", "eval_split_ratio", "dataset_test_split"} and "dataset_test_split" in fields:
            out["dataset_test_split"] = TRL_TEST_SPLIT
            note(f"{key} steps evaluates on the `{TRL_TEST_SPLIT}` split of the dataset (TRL's dataset_test_split)")
    return out


def evaluation_off(trl: dict[str, Any]) -> bool:
    """TRL's `eval_strategy: no` (given): TRL then reads no `dataset_test_split`."""
    return any(key in trl and trl[key] in ("no", None) for key in ("eval_strategy", "evaluation_strategy"))


def _warmup(trl: dict[str, Any], given: set[str]) -> dict[str, Any]:
    steps = trl.get("warmup_steps")
    if not steps:
        return {}
    if "warmup_ratio" in given:
        raise ConfigError("Set either `warmup_steps` or `warmup_ratio`, not both.")
    if isinstance(steps, float) and 0 < steps < 1:
        return {"warmup_ratio": steps}  # transformers reads a float below 1 as a ratio too
    raise ConfigError(f"`warmup_steps: {steps}` is not supported: warmup is a fraction of the run; set warmup_ratio "
                      "(warmup_steps / max_steps).")


# Values TRL uses for "off" where alignflow uses another: field -> {TRL value: alignflow value}.
VALUES = {"top_k": {0: -1}}
