"""Bad input on every `alignflow` command: one line on stderr naming the problem, the file/row/field and
the fix, exit 2, no traceback, and (where the input can be checked first) no model loaded.

The cases run in-process through the console script's `main(argv)` (the real parsers and stages,
real files, a real SeaweedFS for the object-store cases, the kernel's /dev/full for a full disk); a few
run as real subprocesses to prove the exit code and stderr of the command itself. Every pre-flight case
asks for `max_steps 100000` and must fail within `PREFLIGHT_LIMIT_S` (wall time in-process; CPU time for
the subprocesses, whose wall time is mostly imports and grows with the machine's load). Per-case timings are printed at
the end of the module (`pytest -s`) and written as JSON where ALIGNFLOW_BAD_INPUT_TIMINGS points.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, grpo_config, write_jsonl
from tests.servers import free_ports

PREFLIGHT_LIMIT_S = 30.0
LONG = ["--max_steps", "100000"]
TIMINGS: dict[str, float] = {}
THIS = "tests.e2e.test_bad_input"


# Reward functions the GRPO cases load by import path.
def inf_reward(prompts, completions, **_):
    return [float("inf")] * len(completions)


def none_reward(prompts, completions, **_):
    return [None] * len(completions)


@dataclass
class Case:
    name: str
    argv: list[str]  # `{tiny}`, `{d}` (data folder), `{out}` (this case's folder), `{pipeline}` are filled in
    needles: tuple[str, ...]  # each must be in the error line
    env: dict[str, str] = field(default_factory=dict)
    pipeline: dict | None = None  # overrides of pipelines/configs/demo.yaml, written to `{pipeline}`
    loads_model: bool = False  # the error can only show once a model ran
    s3: bool = False  # needs the SeaweedFS server; `{bucket}` is filled in


def sft(*args: str) -> list[str]:
    return ["train", "sft", "--model", "{tiny}", "--dataset", "{d}/pc.jsonl", "--output_dir", "{out}/run", *LONG,
            *args]


def grpo(*args: str, stage: str = "grpo") -> list[str]:
    return ["train", stage, "--model", "{tiny}", "--dataset", "{d}/prompts.jsonl", "--output_dir", "{out}/run",
            *LONG, *args]


def evaluate(*args: str) -> list[str]:
    return ["eval", "--model", "{tiny}", "--dataset", "{d}/prompts.jsonl", "--output_dir", "{out}/eval", *args]


def validate(**overrides) -> dict:
    return {"argv": ["pipeline", "validate", "--config", "{pipeline}"], "pipeline": overrides}


DEAD_S3 = {"AWS_ENDPOINT_URL": "http://127.0.0.1:{dead_port}", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
           "AWS_MAX_ATTEMPTS": "1", "ALIGNFLOW_S3_RETRY_SECONDS": "0"}
ALLOW_ONLY_BUILTINS = {"ALIGNFLOW_ALLOWED_REWARD_MODULES": "trainer.rewards.functions"}
PROMPTS = {"sft": "demo:math_sft", "preferences": "demo:preferences", "prompts": "demo:math", "eval": "demo:math_eval"}

CASES = [
    # --- training data ---------------------------------------------------------------------------------------
    Case("sft dataset missing", sft("--dataset", "{d}/nope.jsonl"), ("nope.jsonl", "does not exist")),
    # On 2 ranks, before the launcher starts: not once per rank, after their start-up, in their own logs.
    Case("sft dataset missing, 2 ranks", sft("--dataset", "{d}/nope.jsonl", "--num_processes", "2"),
         ("nope.jsonl", "does not exist")),
    Case("sft eval dataset missing, 2 ranks", sft("--eval_dataset", "{d}/nope-eval.jsonl", "--deepspeed", "zero2",
                                                 "--num_processes", "2"), ("nope-eval.jsonl", "does not exist")),
    Case("sft dataset empty", sft("--dataset", "{d}/empty.jsonl"), ("empty.jsonl", "empty")),
    Case("sft wrong columns", sft("--dataset", "{d}/wrongcols.jsonl"), ("wrongcols.jsonl", "['foo']", "`text`")),
    Case("sft given preference data", sft("--dataset", "{d}/prefs.jsonl"), ("prefs.jsonl", "alignflow train dpo")),
    Case("sft given prompt-only data", sft("--dataset", "{d}/prompts.jsonl"), ("prompts.jsonl", "grpo")),
    Case("sft malformed jsonl", sft("--dataset", "{d}/malformed.jsonl"), ("malformed.jsonl", "line 2", "JSON")),
    Case("sft malformed JSON array", sft("--dataset", "{d}/array.json"), ("array.json", "line 2, column 11")),
    Case("sft non-UTF-8 jsonl", sft("--dataset", "{d}/latin1.jsonl"), ("latin1.jsonl", "line 2", "UTF-8", "iconv")),
    Case("sft non-UTF-8 csv", sft("--dataset", "{d}/latin1.csv"), ("latin1.csv", "line 3", "UTF-8")),
    Case("sft chat template file not UTF-8", sft("--chat_template_path", "{d}/binary.jinja"),
         ("`chat_template_path`", "binary.jinja", "not a UTF-8 text file")),
    Case("sft unsupported file type", sft("--dataset", "{d}/data.txt"), ("data.txt", ".jsonl")),
    Case("sft folder without data files", sft("--dataset", "{d}/emptydir"), ("emptydir", "no .jsonl")),
    Case("sft folder of mixed types", sft("--dataset", "{d}/mixed"), ("mixed", "mixes file types")),
    Case("sft text not a string", sft("--dataset", "{d}/textint.jsonl"), ("Row 0", "`text` must be a string")),
    Case("sft malformed messages", sft("--dataset", "{d}/badmessages.jsonl"), ("Row 1", "`messages[0]`", "content")),
    Case("sft prompts longer than max_length", sft("--dataset", "{d}/longprompt.jsonl", "--max_length", "8"),
         ("longprompt.jsonl", "max_length=8", "truncation_mode=keep_start)", "truncation_mode keep_end")),
    Case("sft every row dropped", sft("--dataset", "{d}/longprompt.jsonl", "--max_length", "8",
                                      "--truncation_mode", "drop"), ("longprompt.jsonl", "raise `max_length`")),
    Case("sft chat role the template does not know", sft("--dataset", "{d}/robot.jsonl"),
         ("Row 1", "`messages[1]`", "'robot'", "chat template does not know", "user, assistant")),
    Case("dpo chat role the template does not know",
         ["train", "dpo", "--model", "{tiny}", "--dataset", "{d}/robotprefs.jsonl", "--output_dir", "{out}/run", *LONG],
         ("Row 0", "`chosen[1]`", "'robot'", "chat template does not know")),
    Case("grpo chat role the template does not know", grpo("--dataset", "{d}/robotprompts.jsonl"),
         ("Row 2", "`prompt[0]`", "'robot'", "chat template does not know")),
    Case("sft messages without an assistant turn", sft("--dataset", "{d}/noassistant.jsonl"),
         ("noassistant.jsonl", "every row has no assistant turn", "`assistant_only_loss false`")),
    Case("sft deepspeed file not JSON", sft("--deepspeed", "{d}/file.txt"), ("`deepspeed`", "file.txt", "not readable JSON")),
    Case("sft deepspeed file a JSON list", sft("--deepspeed", "{d}/list.json"), ("list.json", "JSON list")),
    Case("sft eval_split_ratio leaves nothing to train on", sft("--dataset", "{d}/two.jsonl", "--eval_split_ratio", "0.9"),
         ("`eval_split_ratio` 0.9 of 2 rows", "leaves none", "eval_dataset")),
    Case("sft eval_dataset missing", sft("--eval_dataset", "{d}/nope-eval.jsonl"), ("nope-eval.jsonl",)),
    Case("sft eval_dataset and eval_split_ratio", sft("--eval_dataset", "{d}/pc.jsonl", "--eval_split_ratio", "0.5"),
         ("eval_dataset", "eval_split_ratio")),
    Case("sft dataset on s3 missing", sft("--dataset", "s3://{bucket}/nope.jsonl"), ("nope.jsonl", "does not exist"),
         s3=True),
    # --- models and checkpoints ------------------------------------------------------------------------------
    Case("sft model missing", sft("--model", "{d}/nope-model"), ("nope-model", "does not exist", "init-tiny")),
    Case("sft model is a file", sft("--model", "{d}/file.txt"), ("file.txt", "is a file", "config.json")),
    Case("sft model folder without config.json", sft("--model", "{d}/emptydir"), ("emptydir", "config.json")),
    Case("eval model folder without a tokenizer", evaluate("--model", "{d}/notokenizer"),
         ("notokenizer", "has no tokenizer", "save_pretrained")),
    Case("sft model is an unfinished checkpoint", sft("--model", "{d}/unfinished"), ("unfinished", "incomplete")),
    Case("sft resume path missing", sft("--resume_from_checkpoint", "{d}/nope-ckpt"),
         ("resume_from_checkpoint", "nope-ckpt", "does not exist")),
    Case("sft resume path not a checkpoint", sft("--resume_from_checkpoint", "{d}/emptydir"),
         ("resume_from_checkpoint", "alignflow.complete")),
    Case("sft resume from a final model", sft("--resume_from_checkpoint", "{d}/sftrun"),
         ("resume_from_checkpoint", "final model, not a step checkpoint", "sftrun/checkpoint-1", "--model")),
    Case("sft resume from a reward checkpoint", sft("--resume_from_checkpoint", "{d}/rmrun/checkpoint-1"),
         ("resume_from_checkpoint", "from the reward stage, not sft")),
    Case("dpo resume from an sft checkpoint", ["train", "dpo", "--model", "{tiny}", "--dataset", "{d}/prefs.jsonl",
                                               "--output_dir", "{out}/run", *LONG, "--resume_from_checkpoint",
                                               "{d}/sftrun/checkpoint-1"], ("from the sft stage, not dpo",)),
    Case("sft resume with a changed seed", sft("--resume_from_checkpoint", "{d}/sftrun/checkpoint-1", "--seed", "7"),
         ("different run", "seed 42 -> 7", "--resume_allow_changes")),
    Case("sft resume with LoRA added", sft("--resume_from_checkpoint", "{d}/sftrun/checkpoint-1", "--lora_r", "8"),
         ("different run", "lora_r 0 -> 8")),
    Case("sft auto on a finished run with a changed seed", sft("--output_dir", "{d}/sftrun", "--resume_from_checkpoint",
                                                               "auto", "--seed", "7"),
         ("the finished model in", "seed 42 -> 7")),
    # --- output_dir apart from the inputs --------------------------------------------------------------------
    Case("sft output_dir is the model", sft("--output_dir", "{tiny}"), ("`output_dir`", "is the `model` input", "of its own")),
    Case("sft output_dir inside the model", sft("--output_dir", "{tiny}/run"), ("lies inside the `model` input",)),
    Case("sft output_dir contains the dataset", sft("--output_dir", "{d}"), ("contains the `dataset` input", "pc.jsonl")),
    Case("sft output_dir inside the model on s3", sft("--model", "s3://bucket/base", "--output_dir", "s3://bucket/base/sft"),
         ("lies inside the `model` input", "s3://bucket/base")),
    Case("dpo output_dir is the ref_model", ["train", "dpo", "--model", "{tiny}", "--ref_model", "{d}/emptydir",
                                             "--dataset", "{d}/prefs.jsonl", "--output_dir", "{d}/emptydir", *LONG],
         ("is the `ref_model` input",)),
    Case("grpo output_dir inside a reward model", grpo("--reward_funcs", "{d}/emptydir", "--output_dir",
                                                       "{d}/emptydir/run"), ("lies inside the `reward_funcs` input",)),
    Case("ppo output_dir is the critic_model", grpo("--critic", "reward_model", "--critic_model", "{d}/emptydir",
                                                    "--output_dir", "{d}/emptydir", stage="ppo"),
         ("is the `critic_model` input",)),
    # --- options and config files ----------------------------------------------------------------------------
    Case("sft misspelt option", sft("--lerning_rate", "1e-3"), ("lerning_rate", "Did you mean `learning_rate`")),
    Case("sft option not a number", sft("--per_device_batch_size", "abc"), ("per_device_batch_size", "abc")),
    Case("sft option not a choice", sft("--truncation_mode", "middle"), ("truncation_mode", "keep_end")),
    Case("sft learning_rate nan", sft("--learning_rate", "nan"), ("learning_rate", "finite")),
    Case("sft learning_rate inf", sft("--learning_rate", "inf"), ("learning_rate", "finite")),
    Case("sft stop_budget_seconds 0", sft("--stop_budget_seconds", "0"), ("stop_budget_seconds", "grace period")),
    Case("sft max_grad_norm nan", sft("--max_grad_norm", "nan"), ("max_grad_norm", "finite")),
    Case("sft max_steps negative", sft("--max_steps", "-5"), ("max_steps", "-5")),
    Case("sft batch size zero", sft("--per_device_batch_size", "0"), ("per_device_batch_size", ">= 1")),
    Case("sft warmup_ratio above 1", sft("--warmup_ratio", "1.5"), ("warmup_ratio", "[0, 1)")),
    Case("sft deepspeed preset unknown", sft("--deepspeed", "zero9"), ("deepspeed", "zero2")),
    Case("sft mlflow_tags without =", sft("--mlflow_tags", "team"), ("mlflow_tags", "KEY=VALUE")),
    Case("sft config file missing", sft("--config", "{d}/nope.yaml"), ("nope.yaml", "does not exist")),
    Case("sft config file not YAML", sft("--config", "{d}/bad.yaml"), ("bad.yaml", "not valid YAML")),
    Case("sft config file a list", sft("--config", "{d}/list.yaml"), ("list.yaml", "mapping")),
    Case("sft config file unknown key", sft("--config", "{d}/unknown.yaml"), ("lerning_rate", "unknown.yaml")),
    Case("sft config file duplicate key", sft("--config", "{d}/dup.yaml"),
         ("dup.yaml", "`learning_rate` is set twice", "line 1", "line 3")),
    Case("sft config file list for a number", sft("--config", "{d}/listlr.yaml"),
         ("listlr.yaml", "`learning_rate`", "is a list", "takes a number")),
    Case("sft two values for a number", sft("--learning_rate", "0.001", "0.002"),
         ("`--learning_rate` takes a number", "`0.002`")),
    Case("sft mixture fraction above 1", ["train", "sft", "--model", "{tiny}", "--dataset_mixture",
                                          '[{"path": "{d}/pc.jsonl", "fraction": 1.5}]', "--output_dir", "{out}/run",
                                          *LONG], ("dataset_mixture[0].fraction", "(0, 1]", "1.5")),
    # --- where the output goes -------------------------------------------------------------------------------
    Case("sft output_dir read-only", sft("--output_dir", "/sys/fs/alignflow-bad-input"), ("output_dir", "/sys/fs")),
    Case("sft output_dir under a file", sft("--output_dir", "{d}/file.txt/run"), ("output_dir", "file.txt")),
    Case("sft output_dir on an unreachable S3", sft("--output_dir", "s3://bucket/run"),
         ("output_dir", "s3://bucket/run", "AWS_ENDPOINT_URL"), env=DEAD_S3),
    Case("sft output_dir on S3 with bad credentials", sft("--output_dir", "s3://{bucket}/run"),
         ("output_dir", "access key", "AWS_ACCESS_KEY_ID"), env={"AWS_ACCESS_KEY_ID": "wrong-key"}, s3=True),
    # --- other stages ----------------------------------------------------------------------------------------
    Case("dpo wrong columns", ["train", "dpo", "--model", "{tiny}", "--dataset", "{d}/pc.jsonl", "--output_dir",
                               "{out}/run", *LONG], ("pc.jsonl", "chosen")),
    Case("dpo every pair loses its difference to truncation",
         ["train", "dpo", "--model", "{tiny}", "--dataset", "{d}/sameprefix.jsonl", "--output_dir", "{out}/run",
          "--max_length", "8", *LONG], ("sameprefix.jsonl", "all 3 pairs", "identical chosen and rejected tokens",
                                        "raise `max_length`", "at least 4")),
    Case("dpo every pair loses its difference, keep_end",
         ["train", "dpo", "--model", "{tiny}", "--dataset", "{d}/samesuffix.jsonl", "--output_dir", "{out}/run",
          "--max_length", "8", "--truncation_mode", "keep_end", *LONG],
         ("samesuffix.jsonl", "identical chosen and rejected tokens", "truncation_mode keep_start")),
    Case("reward every pair loses its difference to truncation",
         ["train", "reward", "--model", "{tiny}", "--dataset", "{d}/sameprefix.jsonl", "--output_dir", "{out}/run",
          "--max_length", "8", "--truncation_mode", "keep_start", *LONG],
         ("sameprefix.jsonl", "all 3 pairs", "identical chosen and rejected tokens", "truncation_mode keep_end")),
    Case("reward wrong columns", ["train", "reward", "--model", "{tiny}", "--dataset", "{d}/pc.jsonl", "--output_dir",
                                  "{out}/run", *LONG], ("pc.jsonl", "chosen")),
    Case("grpo no prompt column", grpo("--dataset", "{d}/text.jsonl"), ("text.jsonl", "`prompt` column")),
    Case("grpo reward module missing", grpo("--reward_funcs", "nosuch_rewards:score"),
         ("reward_funcs", "nosuch_rewards", "installed")),
    Case("grpo reward function missing", grpo("--reward_funcs", "user_rewards:nope"),
         ("reward_funcs", "user_rewards:nope", "`nope`")),
    Case("grpo reward name misspelt", grpo("--reward_funcs", "exact_anwser"), ("exact_anwser", "exact_answer")),
    Case("grpo reward given as a file path", grpo("--reward_funcs", "{d}/user_rewards.py:good"),
         ("user_rewards.py", "PYTHONPATH", "user_rewards:good")),
    Case("grpo reward regex invalid", grpo("--reward_funcs", "regex:(unclosed"), ("regex:(unclosed", "regular")),
    Case("grpo reward length not a number", grpo("--reward_funcs", "length:abc"), ("length:abc", "N >= 1")),
    Case("grpo reward module not allowed", grpo("--reward_funcs", "user_rewards:good"),
         ("user_rewards:good", "ALIGNFLOW_ALLOWED_REWARD_MODULES", "trainer.rewards.functions"), env=ALLOW_ONLY_BUILTINS),
    Case("grpo reward_weights mismatch", grpo("--reward_weights", "1", "2"), ("reward_weights", "reward_funcs")),
    Case("grpo num_generations 1", grpo("--num_generations", "1"), ("num_generations",)),
    Case("grpo temperature negative", grpo("--temperature", "-1"), ("`temperature`", "-1")),
    Case("grpo temperature 0 learns nothing", grpo("--temperature", "0"), ("`temperature` 0", "learns nothing", "> 0")),
    Case("ppo temperature negative", grpo("--temperature", "-1", stage="ppo"), ("`temperature`", ">= 0", "-1")),
    Case("grpo reward module raises at import", grpo("--reward_funcs", "raising_rewards:good"),
         ("raising_rewards", "RuntimeError: broken at import", "line 1", "Fix the module")),
    Case("grpo eval_split_ratio", grpo("--eval_split_ratio", "0.2"), ("eval_split_ratio", "eval_dataset")),
    Case("grpo every prompt too long", grpo("--max_prompt_length", "2", "--truncation_mode", "drop"),
         ("prompts.jsonl", "max_prompt_length=2", "truncation_mode keep_end")),
    Case("grpo reward inf", grpo("--reward_funcs", f"{THIS}:inf_reward", "--max_steps", "1", "--num_generations", "2",
                                 "--per_device_batch_size", "4", "--max_completion_length", "4",
                                 "--log_completions_steps", "0"), ("inf_reward", "inf", "sample 0"),
         loads_model=True),
    Case("grpo reward all None", grpo("--reward_funcs", f"{THIS}:none_reward", "--max_steps", "1",
                                      "--num_generations", "2", "--per_device_batch_size", "4",
                                      "--max_completion_length", "4", "--log_completions_steps", "0"),
         ("none_reward", "None for all 4 completions"), loads_model=True),
    Case("grpo rollout server options without the server engine", grpo("--vllm_server_host", "127.0.0.1"),
         ("`vllm_server_host`", "rollout_engine vllm-server")),
    # Port 9 (discard): nothing listens there, so the wait ends at vllm_server_timeout.
    Case("grpo rollout server unreachable", grpo("--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host",
                                                 "127.0.0.1", "--vllm_server_port", "9", "--vllm_server_timeout", "2"),
         ("http://127.0.0.1:9/ready", "within 2 s", "vllm_server_timeout", "alignflow rollout-server"),
         loads_model=True),
    Case("ppo no prompt column", grpo("--dataset", "{d}/text.jsonl", stage="ppo"), ("text.jsonl", "`prompt` column")),
    Case("ppo reward module missing", grpo("--reward_funcs", "nosuch_rewards:score", stage="ppo"),
         ("reward_funcs", "nosuch_rewards")),
    # --- eval, promote, model --------------------------------------------------------------------------------
    Case("eval model missing", evaluate("--model", "{d}/nope-model"), ("nope-model", "does not exist")),
    Case("eval dataset missing", evaluate("--dataset", "{d}/nope.jsonl"), ("nope.jsonl", "does not exist")),
    Case("eval reward module missing", evaluate("--reward_funcs", "nosuch_rewards:score"),
         ("reward_funcs", "nosuch_rewards")),
    Case("eval baseline without a judge", evaluate("--baseline_model", "{tiny}"), ("baseline_model", "reward_model")),
    Case("eval disk full", evaluate("--max_samples", "2", "--max_completion_length", "2", "--output_dir", "{d}/full"),
         ("No space left", "metrics.json", "larger volume"), loads_model=True),
    Case("promote metrics file missing", ["promote", "--model-name", "m", "--checkpoint", "{tiny}", "--metrics",
                                          "{d}/nope.json"], ("--metrics", "nope.json", "does not exist")),
    Case("promote metrics not JSON", ["promote", "--model-name", "m", "--checkpoint", "{tiny}", "--metrics",
                                      "{d}/file.txt"], ("--metrics", "file.txt", "not valid JSON")),
    Case("promote metrics a JSON list", ["promote", "--model-name", "m", "--checkpoint", "{tiny}", "--metrics",
                                         "{d}/list.json"], ("--metrics", "list.json", "list")),
    Case("promote without a tracking URI", ["promote", "--model-name", "m", "--checkpoint", "{tiny}", "--metrics",
                                            "{d}/metrics.json"], ("MLFLOW_TRACKING_URI",),
         env={"MLFLOW_TRACKING_URI": ""}),
    Case("model init-tiny under a file", ["model", "init-tiny", "--out", "{d}/file.txt/tiny"],
         ("file.txt", "not a folder")),
    Case("model import-gguf missing", ["model", "import-gguf", "{d}/nope.gguf", "--out", "{out}/m"],
         ("nope.gguf", "does not exist")),
    Case("model import-gguf not GGUF", ["model", "import-gguf", "{d}/file.txt", "--out", "{out}/m"],
         ("file.txt", "Not a GGUF file")),
    # --- pipelines -------------------------------------------------------------------------------------------
    Case("pipeline validate config missing", ["pipeline", "validate", "--config", "{d}/nope.yaml"],
         ("nope.yaml", "does not exist")),
    Case("pipeline compile config missing", ["pipeline", "compile", "--config", "{d}/nope.yaml", "--out", "{out}/p.yaml"],
         ("nope.yaml", "does not exist")),
    Case("pipeline validate unknown option", **validate(algoritm="dpo"), needles=("algoritm", "`algorithm`")),
    Case("pipeline validate algorithm", **validate(algorithm="GRPO"), needles=("algorithm", "grpo")),
    Case("pipeline validate section is a list", **validate(sft=["max_steps"]), needles=("`sft` is a list", "sft: {")),
    Case("pipeline validate dataset missing", **validate(datasets={**PROMPTS, "prompts": "{d}/nope.jsonl"}),
         needles=("datasets.prompts", "nope.jsonl", "does not exist")),
    Case("pipeline validate base_model missing", **validate(base_model="{d}/nope-model"),
         needles=("base_model", "nope-model")),
    Case("pipeline validate knob learning_rate nan", **validate(learning_rate=float("nan")),
         needles=("learning_rate", "finite")),
    Case("pipeline validate stage max_grad_norm nan", **validate(dpo={"max_grad_norm": float("nan")}),
         needles=("`dpo` section", "max_grad_norm", "finite")),
    Case("pipeline validate grpo reward module missing", **validate(grpo={"reward_funcs": ["nosuch_rewards:score"]}),
         needles=("`grpo` section", "reward_funcs", "nosuch_rewards")),
    Case("pipeline validate reward function missing, module not run",
         **validate(grpo={"reward_funcs": ["exploding_rewards:nope"]}),
         needles=("`grpo` section", "exploding_rewards:nope", "`nope`")),
    Case("pipeline validate reward module not allowed", **validate(grpo={"reward_funcs": ["user_rewards:good"]}),
         needles=("user_rewards:good", "ALIGNFLOW_ALLOWED_REWARD_MODULES"), env=ALLOW_ONLY_BUILTINS),
    Case("pipeline validate evaluate reward bad", **validate(evaluate={"reward_funcs": ["user_rewards:nope"]}),
         needles=("`evaluate` section", "user_rewards:nope")),
    Case("pipeline validate dataset on an unreachable S3",
         **validate(datasets={**PROMPTS, "sft": "s3://bucket/sft.jsonl"}),
         needles=("datasets.sft", "cannot be reached", "AWS_ACCESS_KEY_ID"), env=DEAD_S3),
    Case("pipeline submit to a dead host", ["pipeline", "submit", "--host", "http://127.0.0.1:{dead_port}",
                                            "--config", "{pipeline}"], ("Cannot reach the KFP API", "127.0.0.1"),
         pipeline={}),
    Case("pipeline schedule cron of five fields", ["pipeline", "schedule", "--host", "http://127.0.0.1:{dead_port}",
                                                   "--config", "{pipeline}", "--cron", "0 3 * * *"],
         ("cron", "six fields"), pipeline={}),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_model) -> Path:
    """Every bad (and the few good) input files the cases name, built once."""
    d = tmp_path_factory.mktemp("bad-input")
    write_jsonl(d / "pc.jsonl", [{"prompt": f"Q{i}: ", "completion": f"A{i}"} for i in range(4)])
    write_jsonl(d / "text.jsonl", [{"text": "some text"}] * 4)
    write_jsonl(d / "two.jsonl", [{"text": "one"}, {"text": "two"}])
    write_jsonl(d / "prefs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 4)
    write_jsonl(d / "prompts.jsonl", [{"prompt": f"Say something about {i}.", "answer": "1"} for i in range(4)])
    write_jsonl(d / "wrongcols.jsonl", [{"foo": "x"}])
    write_jsonl(d / "textint.jsonl", [{"text": 3}])
    write_jsonl(d / "badmessages.jsonl", [{"messages": [{"role": "user", "content": "hi"}]},
                                          {"messages": [{"role": "user"}]}])
    same = "Well, let me think about this question for quite a while before I answer it."
    write_jsonl(d / "sameprefix.jsonl", [{"prompt": "Question?", "chosen": f"{same} Yes.", "rejected": f"{same} No."}] * 3)
    write_jsonl(d / "samesuffix.jsonl", [{"prompt": "Question?", "chosen": f"Yes. {same}", "rejected": f"No. {same}"}] * 3)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    robot = [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "Hello"}]
    write_jsonl(d / "robot.jsonl", [{"messages": chat}, {"messages": robot}])
    write_jsonl(d / "robotprefs.jsonl", [{"chosen": robot, "rejected": chat}] * 2)
    write_jsonl(d / "robotprompts.jsonl", [{"prompt": chat[:1]}] * 2 + [{"prompt": [robot[1]]}])
    write_jsonl(d / "noassistant.jsonl", [{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(3)])
    write_jsonl(d / "longprompt.jsonl", [{"prompt": "word " * 40, "completion": "yes"}] * 3)
    (d / "empty.jsonl").write_text("")
    (d / "malformed.jsonl").write_text('{"text": "fine"}\n{"text": "no closing brace"\n')
    (d / "array.json").write_text('[{"text": "a"},\n {"text": }]\n')
    (d / "latin1.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    (d / "latin1.csv").write_bytes(b"text\nfine\ncaf\xe9\n")
    (d / "binary.jinja").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    (d / "data.txt").write_text("text\n")
    (d / "file.txt").write_text("not a model\n")
    (d / "emptydir").mkdir()
    (d / "mixed").mkdir()
    write_jsonl(d / "mixed" / "a.jsonl", [{"text": "a"}])
    (d / "mixed" / "b.csv").write_text("text\nb\n")
    (d / "unfinished").mkdir()
    (d / "unfinished" / "alignflow.json").write_text("{}")
    (d / "unfinished" / "config.json").write_text("{}")
    (d / "bad.yaml").write_text("learning_rate: [1\n")
    (d / "list.yaml").write_text("- learning_rate\n")
    (d / "unknown.yaml").write_text("lerning_rate: 0.1\n")
    (d / "dup.yaml").write_text("learning_rate: 0.001\nseed: 3\nlearning_rate: 50\n")
    (d / "listlr.yaml").write_text("learning_rate: [0.001, 0.002]\n")
    (d / "list.json").write_text("[1, 2]\n")
    (d / "metrics.json").write_text('{"reward": 1.0}\n')
    (d / "user_rewards.py").write_text("def good(prompts, completions, **_):\n    return [1.0] * len(completions)\n")
    # A module whose import fails loudly: validation must find its names without running it.
    (d / "exploding_rewards.py").write_text("raise SystemExit('exploding_rewards was executed')\n\n"
                                            "def good(prompts, completions, **_):\n    return [0.0]\n")
    (d / "raising_rewards.py").write_text("raise RuntimeError('broken at import')\n\n"
                                          "def good(prompts, completions, **_):\n    return [0.0]\n")
    (d / "notokenizer").mkdir()  # the tiny model's weights and config, its tokenizer left out
    for name in ("config.json", "model.safetensors"):
        (d / "notokenizer" / name).write_bytes((Path(tiny_model) / name).read_bytes())
    (d / "full").mkdir()
    (d / "full" / "metrics.json").symlink_to("/dev/full")  # writes there fail with ENOSPC, as on a full disk
    # Two short runs whose checkpoints the resume cases point at: SFT with the options of `sft()` (so that only
    # the flag a case changes differs) and a reward model.
    from trainer.stages.reward_model import RewardConfig, run_reward
    from trainer.stages.sft import SFTConfig, run_sft

    short = dict(model=tiny_model, max_steps=2, save_steps=1, disable_progress_bar=True, report_to=["none"])
    run_sft(SFTConfig(dataset=str(d / "pc.jsonl"), output_dir=str(d / "sftrun"), **short))
    run_reward(RewardConfig(dataset=str(d / "prefs.jsonl"), output_dir=str(d / "rmrun"), **short))
    return d


@pytest.fixture(scope="module", autouse=True)
def timing_report():
    yield
    if not TIMINGS:
        return
    times = sorted(TIMINGS.values())
    lines = [f"{name:<60} {seconds:6.2f} s" for name, seconds in TIMINGS.items()]
    print("\nbad-input cases:\n" + "\n".join(lines) + f"\n{len(times)} cases, median {statistics.median(times):.2f} s, "
          f"max {times[-1]:.2f} s, total {sum(times):.1f} s")
    if out := os.environ.get("ALIGNFLOW_BAD_INPUT_TIMINGS"):
        Path(out).write_text(json.dumps(TIMINGS, indent=2))


def _fill(value: str, values: dict[str, str]) -> str:
    for key, filled in values.items():
        value = value.replace("{" + key + "}", filled)
    return value


def _pipeline_config(path: Path, tiny: str, overrides: dict, values: dict[str, str]) -> str:
    config = yaml.safe_load((ROOT / "pipelines" / "configs" / "demo.yaml").read_text())
    config.update({"base_model": tiny, **overrides})
    text = _fill(yaml.safe_dump(config), values)
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_line_with_exit_2(case, data, tiny_model, tmp_path, monkeypatch, capfd, request):
    from pipelines.cli import main

    (dead_port,) = free_ports(1)
    values = {"tiny": tiny_model, "d": str(data), "out": str(tmp_path), "dead_port": str(dead_port)}
    if case.s3:
        server = request.getfixturevalue("s3_env")
        values["bucket"] = server.bucket
    if case.pipeline is not None:
        values["pipeline"] = _pipeline_config(tmp_path / "pipeline.yaml", tiny_model, case.pipeline, values)
    if not case.loads_model:
        request.getfixturevalue("no_model_loads")
    for key, value in case.env.items():
        monkeypatch.setenv(key, _fill(value, values))
    if "s3fs" in sys.modules:  # fsspec caches filesystems made under another environment
        sys.modules["s3fs"].S3FileSystem.clear_instance_cache()
    monkeypatch.syspath_prepend(str(data))  # user_rewards, exploding_rewards
    monkeypatch.chdir(tmp_path)
    argv = [_fill(a, values) for a in case.argv]

    model_before = _snapshot(tiny_model)
    started = time.perf_counter()
    code = main(argv)
    seconds = time.perf_counter() - started
    TIMINGS[case.name] = seconds

    out, err = capfd.readouterr()
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-4000:]}"
    assert "Traceback" not in err + out, err[-4000:]
    assert len(errors) == 1, err[-4000:]
    assert errors[0].startswith("alignflow "), errors[0]
    missing = [n for n in case.needles if n not in errors[0]]
    assert not missing, f"{missing} not in: {errors[0]}"
    if not case.loads_model:
        assert seconds < PREFLIGHT_LIMIT_S, f"{case.name}: {seconds:.1f} s with max_steps 100000"
    assert _snapshot(tiny_model) == model_before, "the model folder changed"


def _snapshot(folder: str) -> dict[str, str]:
    """Every file under `folder` by relative path: its sha256."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def test_a_valid_reward_path_passes_without_running_the_module(data, tiny_model, tmp_path, monkeypatch, capfd):
    """`exploding_rewards:good` is defined; the module raises SystemExit if it is ever imported."""
    from pipelines.cli import main

    monkeypatch.syspath_prepend(str(data))
    config = _pipeline_config(tmp_path / "p.yaml", tiny_model, {"grpo": {"reward_funcs": ["exploding_rewards:good"],
                                                                         "num_generations": 4}}, {})
    assert main(["pipeline", "validate", "--config", config]) == 0, capfd.readouterr().err[-3000:]
    assert "every check passed" in capfd.readouterr().out
    assert "exploding_rewards" not in sys.modules


# --- the real commands, as subprocesses ---------------------------------------------------------------------


def _command(*args: str, env: dict | None = None, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    """`alignflow ARGS` as a subprocess; returns it and the CPU seconds it used. The bound is on CPU time:
    a subprocess spends most of its wall time importing torch and transformers, which on a shared
    2-core machine stretches from ~6 s to 30 s with the load, while its CPU time stays ~6 s."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **(env or {})}
    full_env.pop("ALIGNFLOW_DEBUG", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, f"exit {done.returncode}\n{done.stderr[-4000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    (line,) = [x for x in done.stderr.splitlines() if ": error: " in x]
    return line


def test_debug_lets_the_error_through_with_its_traceback(data, tiny_model, tmp_path, monkeypatch):
    from pipelines.cli import main
    from trainer.errors import DataError

    args = ["train", "sft", "--model", tiny_model, "--dataset", str(data / "latin1.jsonl"), "--output_dir",
            str(tmp_path / "run"), *LONG]
    with pytest.raises(DataError, match="line 2 is not UTF-8"):
        main([*args, "--debug"])
    monkeypatch.setenv("ALIGNFLOW_DEBUG", "1")
    with pytest.raises(DataError, match="line 2 is not UTF-8"):
        main(args)


def test_command_non_utf8_data(data, tiny_model, tmp_path):
    args = ["train", "sft", "--model", tiny_model, "--dataset", str(data / "latin1.jsonl"), "--output_dir",
            str(tmp_path / "run"), *LONG]
    done, seconds = _command(*args)
    line = _one_error_line(done)
    assert "latin1.jsonl" in line and "line 2" in line and "UTF-8" in line
    assert seconds < PREFLIGHT_LIMIT_S
    TIMINGS["command: sft non-UTF-8 (subprocess, CPU s)"] = seconds


def test_command_pipeline_run_with_a_bad_reward_path_fails_before_any_task(data, tiny_model, tmp_path):
    config = _pipeline_config(tmp_path / "p.yaml", tiny_model, {"grpo": {"reward_funcs": ["my_rewrds:accuracy"]}}, {})
    done, seconds = _command("pipeline", "run", "--local", "--config", config, "--output", str(tmp_path / "o"),
                             env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    line = _one_error_line(done)
    assert "`grpo` section" in line and "my_rewrds:accuracy" in line
    assert not (tmp_path / "o" / "pipeline-root").exists()  # no task ran
    assert seconds < PREFLIGHT_LIMIT_S
    TIMINGS["command: pipeline run bad reward (subprocess, CPU s)"] = seconds


def test_command_submit_to_a_dead_host(tiny_model, tmp_path):
    (port,) = free_ports(1)
    config = _pipeline_config(tmp_path / "p.yaml", tiny_model, {}, {})
    done, seconds = _command("pipeline", "submit", "--host", f"http://127.0.0.1:{port}", "--config", config)
    line = _one_error_line(done)
    assert f"127.0.0.1:{port}" in line and "Cannot reach the KFP API" in line
    TIMINGS["command: pipeline submit dead host (subprocess, CPU s)"] = seconds


def test_command_grpo_bad_reward_path(data, tiny_model, tmp_path):
    done, seconds = _command("train", "grpo", "--model", tiny_model, "--dataset", str(data / "prompts.jsonl"),
                             "--output_dir", str(tmp_path / "run"), "--reward_funcs", "nosuch_rewards:score", *LONG)
    line = _one_error_line(done)
    assert "nosuch_rewards" in line and "reward_funcs" in line
    assert seconds < PREFLIGHT_LIMIT_S
    TIMINGS["command: grpo bad reward (subprocess, CPU s)"] = seconds


def test_grpo_warns_once_with_counts_when_it_cuts_prompts(data, tiny_model, tmp_path, caplog):
    """Left truncation (keep_end, the default) is not an error: one warning with the counts."""
    from trainer.engine.models import load_tokenizer
    from trainer.stages.rl.shared import load_prompts

    config = grpo_config(tiny_model, tmp_path, max_prompt_length=3)
    with caplog.at_level("WARNING", logger="trainer.stages.rl.grpo"):
        prompts = load_prompts(str(data / "prompts.jsonl"), "train", load_tokenizer(tiny_model), config)
    warnings = [r.getMessage() for r in caplog.records if "max_prompt_length" in r.getMessage()]
    assert warnings == [f"{data / 'prompts.jsonl'}: 4 of 4 prompts are longer than max_prompt_length=3 "
                        "(their start was cut)."]
    assert all(len(ids) == 3 for ids in prompts.token_ids)
