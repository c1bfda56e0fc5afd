"""One KFP component per stage: sft, reward_model, dpo, grpo, ppo, evaluate, promote (+ the parameter
check that runs first, and the MLflow parent run's start and finish).

Each is a lightweight Python component on the trainer image with typed artifacts in and out,
one structured `config` parameter (the stage's options, as in `alignflow train STAGE`), and an
HTML report for the KFP UI. Bodies only import `components.runtime` and make one call:
KFP copies them into the compiled YAML, and the trainer image has alignflow installed, so
`install_kfp_package=False` (clusters without internet cannot pip-install kfp at start).

No component takes the MLflow parent run or anything else made fresh by every run: a training
task's cache key is its inputs (model, data and their fingerprint, config, knobs), its image and
its command. Tasks find the parent run from the run id in their environment (components/runtime.py).
"""

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output

from components.images import TRAINER_IMAGE

_RUN_PYTHON = "\n_KFP_RUNTIME=true python3 -m kfp.dsl.executor_main"


def component(func):
    """`dsl.component` on the trainer image, with one change to the command KFP writes: its shell `exec`s Python.

    KFP runs a lightweight component as `sh -ec '<write the code to a file>; python3 -m kfp.dsl.executor_main ...'`.
    A signal sent to that shell (the kubelet's SIGTERM on preemption, a cancelled run) does not reach the Python
    child, so a training task would be killed at the end of the grace period instead of saving a checkpoint and
    exiting 75 (trainer.engine.preemption). With `exec` the task's process is Python itself."""
    made = dsl.component(func, base_image=TRAINER_IMAGE, install_kfp_package=False)
    container = made.component_spec.implementation.container
    script = container.command[2]
    if _RUN_PYTHON not in script:  # a kfp release that writes another command: see what it does with signals
        raise RuntimeError(f"kfp's lightweight component command changed; {_RUN_PYTHON.strip()!r} not in {script!r}")
    exec_python = _RUN_PYTHON.replace("python3", "exec python3")
    container.command = [*container.command[:2], script.replace(_RUN_PYTHON, exec_python), *container.command[3:]]
    return made


@component
def check_inputs(algorithm: str, sft_config: dict, reward_config: dict, dpo_config: dict, grpo_config: dict,
                 ppo_config: dict, eval_config: dict, max_steps: int, learning_rate: float, num_generations: int,
                 model_name: str, gate_metric: str, gate_mode: str, pod_gpus: int, base_model_uri: str,
                 sft_data_uri: str, preference_data_uri: str, prompts_uri: str, eval_prompts_uri: str
                 ) -> NamedTuple("InputFingerprints", [("sft", str), ("reward", str), ("dpo", str), ("grpo", str),
                                                       ("ppo", str)]):
    """Check every parameter as the stages will read it (a wrong value fails here, in seconds, naming the
    allowed values) and fingerprint each training stage's input data (components/inputs.py: TASK_INPUTS),
    so that new data at an unchanged URI misses the cache. `pod_gpus`: the GPUs of a training task's pod
    (-1 in a local run, which has no pods)."""
    from components import inputs

    stage_configs = {"sft": sft_config, "reward": reward_config, "dpo": dpo_config, "grpo": grpo_config,
                     "ppo": ppo_config}
    knobs = {"max_steps": max_steps, "learning_rate": learning_rate, "num_generations": num_generations}
    inputs.check_parameters(algorithm, stage_configs, eval_config, knobs, model_name, gate_metric, gate_mode,
                            None if pod_gpus < 0 else pod_gpus)
    prints = inputs.fingerprints({"base_model_uri": base_model_uri, "sft_data_uri": sft_data_uri,
                                  "preference_data_uri": preference_data_uri, "prompts_uri": prompts_uri,
                                  "eval_prompts_uri": eval_prompts_uri})
    return tuple(prints[stage] for stage in ("sft", "reward", "dpo", "grpo", "ppo"))


@component
def start_run(pipeline_name: str, pipeline_run: str, params: dict) -> str:
    """Open the pipeline run's MLflow parent run; returns its id ('' without tracking)."""
    from components.runtime import start_pipeline_run

    return start_pipeline_run(pipeline_name, pipeline_run, params)


@component
def finish_run(pipeline_run: str):
    """Close the MLflow parent run of this pipeline run (runs as the pipeline's exit handler)."""
    from components.runtime import finish_pipeline_run

    finish_pipeline_run(pipeline_run)


@component
def sft(base_model: Input[Model], dataset: Input[Dataset], config: dict, skip: bool, max_steps: int,
        learning_rate: float, inputs_fingerprint: str, model: Output[Model], metrics: Output[Metrics],
        report: Output[HTML]):
    """Supervised fine-tuning; with skip=True the base model is handed on (already instruction-tuned)."""
    from components import runtime

    if skip:
        runtime.skip_stage("sft", model_in=base_model.path, model_out=model, metrics_out=metrics,
                            report_out=report, why="skip_sft: the base model is used as the policy")
    else:
        runtime.train_stage("sft", config, model_in=base_model.path, dataset=dataset.path, model_out=model,
                             metrics_out=metrics, report_out=report, inputs_fingerprint=inputs_fingerprint,
                             knobs={"max_steps": max_steps, "learning_rate": learning_rate})


@component
def reward_model(base_model: Input[Model], dataset: Input[Dataset], config: dict, skip: bool, max_steps: int,
                 learning_rate: float, inputs_fingerprint: str, model: Output[Model], metrics: Output[Metrics],
                 report: Output[HTML]):
    """Reward-model training on preference pairs; with skip=True the output is marked empty (rule rewards only)."""
    from components import runtime

    if skip:
        runtime.skip_stage("reward model", model_in=None, model_out=model, metrics_out=metrics,
                            report_out=report, why="skip_reward_model: rule rewards only")
    else:
        runtime.train_stage("reward", config, model_in=base_model.path, dataset=dataset.path, model_out=model,
                             metrics_out=metrics, report_out=report, inputs_fingerprint=inputs_fingerprint,
                             knobs={"max_steps": max_steps, "learning_rate": learning_rate})


@component
def dpo(policy: Input[Model], dataset: Input[Dataset], config: dict, max_steps: int, learning_rate: float,
        inputs_fingerprint: str, model: Output[Model], metrics: Output[Metrics], report: Output[HTML]):
    """Direct preference optimisation of the policy on preference pairs."""
    from components import runtime

    runtime.train_stage("dpo", config, model_in=policy.path, dataset=dataset.path, model_out=model,
                         metrics_out=metrics, report_out=report, inputs_fingerprint=inputs_fingerprint,
                         knobs={"max_steps": max_steps, "learning_rate": learning_rate})


@component
def grpo(policy: Input[Model], dataset: Input[Dataset], reward_model: Input[Model], config: dict, max_steps: int,
         learning_rate: float, num_generations: int, inputs_fingerprint: str, model: Output[Model],
         metrics: Output[Metrics], report: Output[HTML]):
    """GRPO on prompts; a trained reward model joins the configured reward functions."""
    from components import runtime

    runtime.train_stage("grpo", config, model_in=policy.path, dataset=dataset.path, reward_model=reward_model.path,
                         model_out=model, metrics_out=metrics, report_out=report, inputs_fingerprint=inputs_fingerprint,
                         knobs={"max_steps": max_steps, "learning_rate": learning_rate,
                                "num_generations": num_generations})


@component
def ppo(policy: Input[Model], dataset: Input[Dataset], reward_model: Input[Model], config: dict, max_steps: int,
        learning_rate: float, inputs_fingerprint: str, model: Output[Model], metrics: Output[Metrics],
        report: Output[HTML]):
    """PPO on prompts (value head, GAE, KL penalty); a trained reward model joins the configured reward functions."""
    from components import runtime

    runtime.train_stage("ppo", config, model_in=policy.path, dataset=dataset.path, reward_model=reward_model.path,
                         model_out=model, metrics_out=metrics, report_out=report, inputs_fingerprint=inputs_fingerprint,
                         knobs={"max_steps": max_steps, "learning_rate": learning_rate})


@component
def evaluate(policy: Input[Model], reference: Input[Model], dataset: Input[Dataset], reward_model: Input[Model],
             config: dict, model_name: str, gate_metric: str, gate_mode: str, min_improvement: float,
             metrics: Output[Metrics], report: Output[HTML], results: Output[Dataset]) -> bool:
    """Held-out evaluation (rewards, accuracy, win rate vs @champion, KL to the start); returns whether
    the candidate passes the promotion gate."""
    from components import runtime

    return runtime.evaluate_stage(config, model_in=policy.path, reference_in=reference.path, dataset=dataset.path,
                                   reward_model=reward_model.path, model_name=model_name, gate_metric=gate_metric,
                                   gate_mode=gate_mode, min_improvement=min_improvement, metrics_out=metrics, report_out=report,
                                   results_out=results)


@component
def promote(policy: Input[Model], results: Input[Dataset], model_name: str, gate_metric: str, gate_mode: str,
            min_improvement: float, pipeline_run: str, report: Output[HTML]) -> str:
    """Register the evaluated model in MLflow and move @champion to it (old one -> @previous-champion)."""
    from components import runtime

    return runtime.promote_stage(model_in=policy.path, results=results.path, model_name=model_name,
                                  gate_metric=gate_metric, gate_mode=gate_mode, min_improvement=min_improvement,
                                  pipeline_run=pipeline_run, report_out=report)


@contextlib.contextmanager
def image(name: str) -> Iterator[None]:
    """Every component of this module on image `name` while the block builds and runs a pipeline (a local
    run in containers uses the CPU build of the trainer image); the compiled default is restored after."""
    specs = [c.component_spec.implementation.container for c in globals().values()
             if isinstance(c, dsl.python_component.PythonComponent)]
    before = [spec.image for spec in specs]
    for spec in specs:
        spec.image = name
    try:
        yield
    finally:
        for spec, old in zip(specs, before):
            spec.image = old
