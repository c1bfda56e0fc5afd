"""Every option does what it says, or is rejected: the run-time options TRL users bring (`use_cpu`, `ddp_timeout`,
`ddp_find_unused_parameters`, `per_device_eval_batch_size`, `dataset_test_split`), the ones rejected because
alignflow cannot honour them (`padding_free` on padded stages, `vllm_enable_sleep_mode` without in-process vLLM), and
the test that finds the next silent option (`test_no_option_is_silent`). Unit tier: no model loads, nothing trains."""

from __future__ import annotations

import dataclasses
import typing

import datasets
import pytest
import torch

from trainer.config import trl_names
from trainer.config.options import TrainConfig, config_from_dict, parse_config
from trainer.data.sources import load_train_eval
from trainer.engine import distributed, launch
from trainer.engine.loop import build_optimizer, build_scheduler, total_steps
from trainer.errors import ConfigError, DataError
from trainer.stages import stage_parts
from trainer.stages.rl.shared import eval_prompts_per_batch

STAGES = ("sft", "reward", "dpo", "grpo", "ppo")
RL = ("grpo", "ppo")


@pytest.fixture(scope="module")
def splits(tmp_path_factory) -> str:
    """A saved DatasetDict with `train` and `test` splits holding every stage's columns."""
    def rows(n, tag):
        return [{"text": f"{tag} {i}", "prompt": f"{tag} prompt {i}", "completion": f" {i}", "chosen": f" good {i}",
                 "rejected": f" bad {i}", "answer": str(i)} for i in range(n)]
    folder = tmp_path_factory.mktemp("splits") / "data"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows(12, "train")),
                          "test": datasets.Dataset.from_list(rows(5, "test")),
                          "other": datasets.Dataset.from_list(rows(7, "other"))}).save_to_disk(str(folder))
    return str(folder)


def _config(stage: str, **values):
    cls, _ = stage_parts(stage)
    return config_from_dict(cls, {"model": "m", "output_dir": "/tmp/alignflow-options-out", **values})


# -- the options themselves ---------------------------------------------------------------------------------------


def test_use_cpu_keeps_a_gpu_machine_on_the_cpu():
    assert distributed.accelerator_kwargs(_config("sft", dataset="demo"), cuda=True, deepspeed=False).get("cpu") is None
    kwargs = distributed.accelerator_kwargs(_config("sft", dataset="demo", use_cpu=True), cuda=True, deepspeed=False)
    assert kwargs["cpu"] is True  # accelerate's cpu flag: device cpu, MULTI_CPU ranks over gloo under torchrun


def test_fp16_on_the_cpu_is_a_note_not_an_error(caplog):
    """accelerate takes `fp16` on the CPU and computes in float32 (no autocast, no scaler): say so, and train."""
    if torch.cuda.is_available():
        pytest.skip("fp16 works on a GPU")
    with caplog.at_level("WARNING", logger="trainer.engine.distributed"):
        accelerator = distributed.make_accelerator(_config("sft", dataset="demo", fp16=True))
    assert accelerator.mixed_precision == "fp16" and accelerator.scaler is None
    notes = [r.getMessage() for r in caplog.records if "`fp16`" in r.getMessage()]
    assert len(notes) == 1 and "no effect on the CPU" in notes[0] and "`bf16`" in notes[0], notes
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainer.engine.distributed"):
        distributed.make_accelerator(_config("sft", dataset="demo"))
    assert not [r for r in caplog.records if "`fp16`" in r.getMessage()]


@pytest.mark.parametrize(("rows", "batch", "accumulation", "noted"), [(1, 8, 1, True), (6, 4, 2, True), (8, 4, 2, False)])
def test_fewer_examples_than_one_step_takes_is_a_note(rows, batch, accumulation, noted, caplog):
    config = _config("sft", dataset="demo", per_device_batch_size=batch, gradient_accumulation_steps=accumulation,
                     max_steps=2)
    with caplog.at_level("WARNING", logger="trainer.engine.loop"):
        assert total_steps(config, rows) == 2
    notes = [r.getMessage() for r in caplog.records if "fewer than one optimizer step takes" in r.getMessage()]
    assert len(notes) == noted, notes
    if noted:
        assert f"= {batch * accumulation})" in notes[0] and f"`epoch` grows by {batch * accumulation / rows:.3g}" in notes[0]


def test_ddp_timeout_and_find_unused_parameters_reach_the_process_group_and_ddp():
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    config = _config("sft", dataset="demo", ddp_timeout=77, ddp_find_unused_parameters=True)
    for cuda, deepspeed in ((True, False), (False, False)):
        handlers = distributed.accelerator_kwargs(config, cuda, deepspeed)["kwargs_handlers"]
        group = next(h for h in handlers if isinstance(h, InitProcessGroupKwargs))
        assert group.timeout.total_seconds() == 77
        assert any(isinstance(h, DistributedDataParallelKwargs) and h.find_unused_parameters for h in handlers)
    # Without GPUs, DeepSpeed's ranks still get gloo (and the timeout); the default is TRL's 30 minutes.
    plain = distributed.accelerator_kwargs(_config("sft", dataset="demo"), cuda=False, deepspeed=True)
    (group,) = plain["kwargs_handlers"]
    assert (group.backend, group.timeout.total_seconds()) == ("gloo", 1800)


@pytest.mark.parametrize("values, words", [
    ({"use_cpu": True, "deepspeed": "zero2"}, "`use_cpu` turns DeepSpeed off"),
    ({"ddp_find_unused_parameters": True, "deepspeed": "zero3"}, "DDP option"),
    ({"ddp_timeout": 0}, "`ddp_timeout` must be"),
    ({"per_device_eval_batch_size": -1}, "`per_device_eval_batch_size` must be"),
    ({"dataset_test_split": "test", "eval_split_ratio": 0.1}, "keep one source of held-out data"),
    ({"dataset_test_split": "train"}, "the split trained on"),
])
def test_device_and_eval_options_that_cannot_work_together_are_refused(values, words):
    with pytest.raises(ConfigError, match=words):
        _config("sft", dataset="demo", **values)


def test_use_cpu_with_vllm_is_refused():
    with pytest.raises(ConfigError, match="rollout_engine hf with use_cpu"):
        _config("grpo", dataset="demo:math", use_cpu=True, rollout_engine="vllm")


def test_per_device_eval_batch_size_sets_the_evaluation_batches():
    assert _config("sft", dataset="demo", per_device_batch_size=4).eval_batch_size == 4
    assert _config("sft", dataset="demo", per_device_batch_size=4, per_device_eval_batch_size=16).eval_batch_size == 16
    # GRPO/PPO count completions, as TRL does, in whole groups of num_generations.
    grpo = _config("grpo", dataset="demo:math", per_device_batch_size=8, num_generations=4)
    assert eval_prompts_per_batch(grpo) == 2
    assert eval_prompts_per_batch(dataclasses.replace(grpo, per_device_eval_batch_size=16)) == 4


def test_dataset_test_split_is_the_eval_set_when_the_dataset_has_it(splits, tmp_path):
    train, held_out = load_train_eval(_config("sft", dataset=splits, dataset_test_split="test"))
    assert (len(train), len(held_out), held_out[0]["text"]) == (12, 5, "test 0")
    with pytest.raises(DataError, match="'nope'"):
        load_train_eval(_config("sft", dataset=splits, dataset_test_split="nope"))
    with pytest.raises(DataError, match="a single file.*has no splits"):
        load_train_eval(_config("sft", dataset="demo", dataset_test_split="test"))


def test_trl_eval_strategy_decides_whether_dataset_test_split_is_read(splits, tmp_path, capsys):
    path = tmp_path / "trl.yaml"
    path.write_text(f"model_name_or_path: m\ndataset_name: {splits}\neval_strategy: steps\n")
    assert parse_config(stage_parts("sft")[0], ["--config", str(path)]).dataset_test_split == "test"  # TRL's default
    path.write_text(f"model_name_or_path: m\ndataset_name: {splits}\neval_strategy: 'no'\ndataset_test_split: other\n")
    assert parse_config(stage_parts("sft")[0], ["--config", str(path)]).dataset_test_split is None
    assert "dataset_test_split ignored: eval_strategy is no" in capsys.readouterr().err


@pytest.mark.parametrize("stage, values, words", [
    ("grpo", {"padding_free": True}, "this stage pads its batches"),
    ("grpo", {"vllm_enable_sleep_mode": True}, "set rollout_engine vllm"),  # the hf engine has nothing to free
])
def test_options_alignflow_cannot_honour_are_rejected_in_one_line(stage, values, words, tmp_path):
    dataset = "demo:math" if stage in RL else "demo"
    with pytest.raises(ConfigError, match=words) as err:
        _config(stage, dataset=dataset, **values)
    assert "\n" not in str(err.value)
    # SFT's, DPO's and the reward model's own `padding_free`: accepted, with or without packing; so is sleep mode off.
    assert _config("sft", dataset="demo", packing=True, padding_free=True).packing
    assert _config("sft", dataset="demo", padding_free=True).padding_free
    assert _config("reward", dataset="demo", padding_free=True).padding_free
    _config("grpo", dataset="demo:math", vllm_enable_sleep_mode=False)


# -- the test that finds the next silent option -------------------------------------------------------------------

# A non-default value for fields the generic rule below cannot make up (free text, or constrained values).
VALUES = {
    "model": "other-model", "dataset": "demo", "dataset_split": "other", "dataset_test_split": "test",
    "eval_dataset": "demo", "output_dir": "/tmp/alignflow-options-elsewhere", "max_length": 2048,
    "dataset_mixture": '[{"path": "demo"}]', "dataset_config": "x", "chat_template_path": "CHAT_TEMPLATE",
    "deepspeed": "zero3", "resume_from_checkpoint": "auto", "mlflow_tracking_uri": "sqlite:///elsewhere.db",
    "report_to": ["none"], "mlflow_tags": ["k=v"], "lora_target_modules": ["q_proj"], "hub_model_id": "me/model",
    "per_device_batch_size": 4, "gradient_accumulation_steps": 2, "num_generations": 4, "reward_funcs": ["answer_format"],
    "reward_weights": [2.0], "ref_model": "ref", "critic_model": "critic", "vllm_server_devices": "1",
    "max_prompt_length": 64, "max_completion_length": 32, "eval_split_ratio": 0.25, "warmup_ratio": 0.5,
    "per_device_eval_batch_size": 3,
}
# Fields whose effect needs a model, a forward pass or a run, so this test cannot see it; each names why and
# where its effect is tested. A field missing from here that changes nothing below fails the test.
_LOSS = "changes the loss or the update (a tensor): tests/unit/trainer/algorithms/test_losses.py and the stage's unit tests"
_ROLLOUT = "changes sampling or the rollout engine: tests/unit/trainer/rollout/test_rollout.py, tests/stage/test_grpo.py"
_DATA = "changes how rows are tokenized, masked or packed: tests/unit/trainer/data/test_data.py, tests/unit/trainer/stages/test_sft.py and test_dpo.py"
_RUN = "checkpoints, logging or tracking during a run: tests/stage (resume, saving) and tests/unit/trainer/tracking/test_tracking.py"
_MODEL = "loads or builds the model: tests/stage and tests/unit/trainer/engine/test_models.py"
_SERVER = ("which rollout server the job uses and how long it waits for it: tests/e2e/test_rollout_server.py and "
           "tests/unit/trainer/rollout/test_server_client.py")
ALLOWED = {
    "model": _MODEL, "trust_remote_code": _MODEL, "dtype": _MODEL, "gradient_checkpointing": _MODEL,
    "torch_compile": ("how the layers run, not what they compute (float rounding apart): tests/stage/test_sft.py::"
                      "test_torch_compile_trains_the_weights_of_eager_layers and tests/stage/test_torch_compile.py"),
    "lora_r": _MODEL, "lora_alpha": _MODEL, "lora_dropout": _MODEL, "lora_target_modules": _MODEL,
    "disable_dropout": _MODEL, "critic": _MODEL, "critic_model": _MODEL, "ref_model": _MODEL,
    "dataset_num_proc": ("how many processes tokenize (the same tokens): tests/unit/trainer/data/test_token_cache.py::"
                         "test_worker_processes_write_the_same_one_file_entry"),
    "chat_template_path": _DATA, "max_length": _DATA, "truncation_mode": _DATA, "completion_only_loss": _DATA,
    "assistant_only_loss": _DATA, "packing": _DATA, "padding_free": _DATA, "max_prompt_length": _DATA,
    "dataset_config": _DATA + " (a hub or dataset-card configuration; test_trl_names.py)",
    "bf16": "autocast precision: the accelerator's mixed_precision (tests/stage/test_grpo.py) and the launch command",
    "fp16": "autocast precision in float16 with loss scaling: GPU only (tests/gpu)",
    "max_grad_norm": _LOSS, "max_nonfinite_steps": _LOSS, "seed": "data order and sampling: tests/unit/trainer/data/test_data.py",
    "save_steps": _RUN, "save_minutes": _RUN, "save_total_limit": _RUN, "logging_steps": _RUN, "eval_steps": _RUN,
    "resume_from_checkpoint": _RUN, "resume_allow_changes": _RUN, "disable_progress_bar": _RUN,
    "stop_budget_seconds": "how long a stop on SIGTERM may take: seen only when a signal comes "
                           "(tests/e2e/test_faults.py::test_a_stop_that_misses_its_budget_says_so_and_leaves_the_previous_checkpoint)",
    "lora_merge_on_save": _RUN, "mlflow_experiment": _RUN, "mlflow_run_name": _RUN, "mlflow_parent_run_id": _RUN,
    "mlflow_tags": _RUN, "mlflow_log_checkpoint": _RUN, "output_dir": _RUN,
    "push_to_hub": "checked before training and pushed after it: tests/unit/trainer/engine/test_hub.py",
    "hub_model_id": "tests/unit/trainer/engine/test_hub.py", "hub_private_repo": "tests/unit/trainer/engine/test_hub.py",
    "num_sample_completions": _RUN, "sample_max_new_tokens": _RUN, "log_completions_steps": _RUN,
    "num_completions_to_log": _RUN,
    "center_rewards_coefficient": _LOSS, "beta": _LOSS, "loss_type": _LOSS, "label_smoothing": _LOSS,
    "simpo_gamma": _LOSS, "precompute_ref_log_probs": _LOSS, "precompute_ref_batch_size": _RUN,
    "reward_funcs": _LOSS, "reward_weights": _LOSS, "reward_label": _LOSS, "reward_label_score": _LOSS,
    "num_generations": _ROLLOUT, "max_completion_length": _ROLLOUT, "temperature": _ROLLOUT, "top_p": _ROLLOUT,
    "top_k": _ROLLOUT, "epsilon": _LOSS, "epsilon_high": _LOSS, "use_bias_correction_kl": _LOSS,
    "num_iterations": _LOSS, "advantage_estimator": _LOSS,
    "scale_rewards": _LOSS, "mask_truncated_completions": _LOSS, "rollout_engine": _ROLLOUT,
    "vllm_gpu_memory_utilization": _ROLLOUT, "vllm_server_devices": _ROLLOUT, "importance_sampling_correction": _LOSS,
    "importance_sampling_cap": _LOSS, "importance_sampling_mode": _LOSS, "importance_sampling_min": _LOSS,
    "share_prompt": _ROLLOUT, "vllm_server_host": _SERVER,
    "vllm_server_port": _SERVER, "vllm_server_base_url": _SERVER, "vllm_server_timeout": _SERVER,
    "vllm_enable_sleep_mode": ("frees vLLM's GPU memory during the update (GPUs only; refused on the CPU): "
                               "tests/unit/trainer/rollout/test_rollout.py::test_a_sleeping_vllm_engine_wakes_for_"
                               "the_push_and_the_rollout, tests/stage/test_grpo.py::test_sleep_mode_is_refused_on_"
                               "the_cpu_before_the_model_loads, tests/gpu/test_grpo_gpu.py"),
    "vllm_group_port": ("how weights reach the rollout server: tests/unit/trainer/rollout/test_server_client.py and "
                        "tests/e2e/test_rollout_server.py::"
                        "test_sidecar_takes_weights_over_a_gloo_weight_group_and_a_restarted_trainer_forms_a_new_one"),
    "batch_size": _LOSS, "mini_batch_size": _LOSS, "ppo_epochs": _LOSS, "gamma": _LOSS, "lam": _LOSS,
    "cliprange": _LOSS, "cliprange_value": _LOSS, "vf_coef": _LOSS, "whiten_rewards": _LOSS, "init_kl_coef": _LOSS,
    "adap_kl_ctrl": _LOSS, "target_kl": _LOSS, "horizon": _LOSS, "missing_eos_penalty": _LOSS,
}
# Fields of TrainConfig a stage refuses with any other value than the default (the refusal says why).
REFUSED = {"ppo.gradient_accumulation_steps"}  # PPO accumulates mini_batch_size / per_device_batch_size
# TRL names accepted with any value: each must say here why it cannot change what is trained or saved.
IGNORED_TRL_NAMES = {
    **dict.fromkeys(("dataloader_num_workers", "dataloader_persistent_workers", "dataloader_pin_memory",
                     "dataloader_prefetch_factor"), "no loader workers: data are tokenized up front"),
    **dict.fromkeys(("ddp_backend", "ddp_broadcast_buffers", "ddp_bucket_cap_mb", "local_rank", "ignore_bias_buffers",
                     "half_precision_backend", "torch_empty_cache_steps"),
                    "process plumbing the runner sets: no effect on the update"),
    **dict.fromkeys(("log_level", "log_level_replica", "log_on_each_node", "logging_dir", "logging_first_step",
                     "logging_nan_inf_filter", "include_num_input_tokens_seen", "skip_memory_metrics", "project",
                     "log_multimodal", "num_completions_to_print"), "logging only"),
    **dict.fromkeys(("do_train", "do_eval", "eval_accumulation_steps", "eval_packing", "prediction_loss_only",
                     "greater_is_better", "overwrite_output_dir", "remove_unused_columns"),
                    "what alignflow always does (training, evaluation on held-out data, a fresh run)"),
    **dict.fromkeys(("bnb_4bit_quant_type", "cache_implementation", "use_cache", "discopop_tau",
                     "f_alpha_divergence_coef", "ref_model_mixup_alpha", "ref_model_sync_steps", "entropy_coef_delta",
                     "entropy_coef_max", "entropy_coef_min", "entropy_target", "sapo_temperature_neg",
                     "sapo_temperature_pos", "vespo_k_neg", "vespo_k_pos", "vespo_lambda_neg", "vespo_lambda_pos"),
                    "a parameter of a feature that is itself rejected unless off (quantisation, other losses)"),
    "vllm_max_model_length": "the rollout server's size: no effect on the update",
}


def _other_value(cls, name: str, default):
    """A valid value other than `default` for field `name` (VALUES, else one made up from its type)."""
    if name in VALUES:
        return VALUES[name]
    kind = typing.get_type_hints(cls)[name]
    choices = [c for arg in (kind, *typing.get_args(kind)) if typing.get_origin(arg) is typing.Literal
               for c in typing.get_args(arg)]
    if choices:
        return next(c for c in choices if c != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1 if default >= 0 else 1
    if isinstance(default, float):
        return default / 2 if default else 0.3
    raise AssertionError(f"{cls.__name__}.{name}: add a non-default value to VALUES")


def _observe(stage: str, config, monkeypatch) -> dict:
    """What a run would use, computed without a model: devices and process group, the launch command, the
    training and held-out rows, the number of steps, the optimizer and the learning-rate schedule, the
    evaluation batches and tracking. A field that changes none of these is silent (or on ALLOWED)."""
    monkeypatch.setattr(launch, "free_port", lambda: 1)
    seen: dict = {"accelerator": repr(distributed.accelerator_kwargs(config, cuda=True,
                                                                      deepspeed=bool(config.deepspeed))),
                  "launch": launch.launch_command(stage, [], config) if launch.needs_launch(config) else None,
                  "eval_batch": eval_prompts_per_batch(config) if stage in RL else config.eval_batch_size,
                  "tracking": config.tracking_uri}
    try:
        train, held_out = load_train_eval(config)
        seen["data"] = (train["text"], held_out["text"] if held_out is not None else None)
    except (DataError, ValueError) as err:  # a model-less placeholder path: the error is what the run would meet
        seen["data"] = str(err)
        train = range(12)
    steps = total_steps(config, len(train))
    layer = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(layer, config)
    scheduler = build_scheduler(optimizer, config, 10)  # a schedule long enough to tell the shapes apart
    rates = []
    for _ in range(10):
        optimizer.step()
        scheduler.step()
        rates.append(round(scheduler.get_last_lr()[0], 12))
    seen["optimizer"] = ({k: v for k, v in optimizer.param_groups[0].items() if k != "params"}, steps, rates)
    return seen


def test_no_option_is_silent(splits, monkeypatch, tmp_path):
    """Every field of every stage, set to another value, changes something a run uses (`_observe`), or is on
    ALLOWED with the reason and the test that covers it. Every TRL name accepted with any value is on
    IGNORED_TRL_NAMES; every other known TRL name rejects some value."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///default.db")
    silent = []
    for stage in STAGES:
        cls, _ = stage_parts(stage)
        base = {"model": "m", "dataset": splits, "output_dir": str(tmp_path / "out"), "max_steps": -1}
        if stage in RL:
            base |= {"per_device_batch_size": 4, "num_generations": 2} if stage == "grpo" else {}
        reference = _observe(stage, config_from_dict(cls, base), monkeypatch)
        for f in dataclasses.fields(cls):
            if f.name in ALLOWED or f.name in base and f.name != "dataset":
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            value = _other_value(cls, f.name, default)
            extra = {"dataset": "demo", "dataset_split": "train"} if f.name == "dataset_mixture" else {}
            values = {**base, **extra, f.name: value}
            if f.name == "dataset_mixture":
                values.pop("dataset")
            try:
                config = config_from_dict(cls, values)
            except ConfigError as err:
                if f"{stage}.{f.name}" in REFUSED:
                    continue
                raise AssertionError(f"{stage}.{f.name}={value!r} is refused ({err}); give a valid one in VALUES") from None
            if _observe(stage, config, monkeypatch) == reference:
                silent.append(f"{stage}.{f.name}")
    assert not silent, (f"options that change nothing a run uses: {silent}. Make each do what it says, reject it in "
                        "TrainConfig.validate, or add it to ALLOWED with the reason and the test that covers it.")

    any_value = {name for name, known in trl_names.KNOWN.items() if known.accepted == "any"}
    assert any_value == set(IGNORED_TRL_NAMES), (
        f"TRL names accepted with any value but not reasoned here: {sorted(any_value - set(IGNORED_TRL_NAMES))}; "
        f"listed but no longer ignored: {sorted(set(IGNORED_TRL_NAMES) - any_value)}")
    for name, known in trl_names.KNOWN.items():
        if name in any_value:
            continue
        bad = next(v for v in (True, "something-else", 7, {"a": 1}, ["x"]) if not known.accept(v))
        cls = next(stage_parts(s)[0] for s in STAGES if name not in {f.name for f in dataclasses.fields(stage_parts(s)[0])})
        with pytest.raises(ConfigError, match=f"`{name}"):
            config_from_dict(cls, {"model": "m", "dataset": "demo", name: bad})


def test_the_allow_lists_name_real_options():
    fields = {f.name for s in STAGES for f in dataclasses.fields(stage_parts(s)[0])}
    assert set(ALLOWED) <= fields, sorted(set(ALLOWED) - fields)
    assert {f.name for f in dataclasses.fields(TrainConfig)} <= fields
