"""The post-training DAG: check inputs -> SFT and reward model (in parallel) -> one branch per
algorithm (GRPO, DPO or PPO) -> evaluate -> promote under `dsl.If(gate passed)`.

    check-inputs ─ start-run ─┬─ sft ──────────┬─ If(algorithm == grpo): grpo ─ evaluate ─ If(gate): promote
                              │                ├─ If(algorithm == dpo):  dpo  ─ evaluate ─ If(gate): promote
                              └─ reward-model ─┴─ If(algorithm == ppo):  ppo  ─ evaluate ─ If(gate): promote
    (check-inputs fails in seconds on a bad parameter; start-run opens the MLflow parent run;
     finish-run closes it as the exit handler)

The reward model trains from the base model, so it runs beside SFT. `skip_sft` hands the base
model on as the policy (already instruction-tuned); `skip_reward_model` leaves GRPO and PPO with
rule rewards only and evaluation without a judge (otherwise the trained reward model joins their
reward functions). Per-stage options travel as one dict per stage, over the typed common knobs
(max_steps, learning_rate, num_generations). Adding an algorithm is one entry in
`components.inputs.ALGORITHMS` and one `dsl.If` branch below.

Caching: a training task's inputs are its model and data artifacts, its config dict and knobs,
and the fingerprint of its data (from check-inputs); nothing made fresh by every run. Tasks find
the MLflow parent run and their checkpoint prefix from the run id in their environment
(components/settings.py), which KFP leaves out of the cache key. The pipeline only composes:
Kubernetes settings come from `pipelines.kubernetes`.
"""

from kfp import dsl

from components import definitions as stages
from pipelines.kubernetes import LIGHT, TRAINING, Resources, apply

PIPELINE_NAME = "alignflow-post-training"


def make_pipeline(train: Resources = TRAINING, light: Resources = LIGHT, retries: int = 2, backoff: str = "60s",
                  cache: bool = True, pod: bool = True):
    """The post-training pipeline with the given task resources, retry policy and caching (compile-time
    settings; `cache=False` runs every task every time). `pod=False` (kfp.local) drops the check of the stage
    sections against the training pod's GPUs, which a local run does not have."""

    def task(t, resources: Resources, name: str, cacheable: bool = True):
        return apply(t, resources, retries, cache=cache and cacheable, backoff=backoff).set_display_name(name)

    def evaluate_and_promote_pipeline(name: str):
        @dsl.pipeline(name=name)
        def evaluate_and_promote(policy: dsl.Input[dsl.Model], reference: dsl.Input[dsl.Model],
                                 eval_data: dsl.Input[dsl.Dataset], judge: dsl.Input[dsl.Model], eval_config: dict,
                                 model_name: str, gate_metric: str, gate_mode: str, min_improvement: float,
                                 pipeline_run: str):
            # Not cached: the gate compares with the registry's current champion, which is no input.
            evaluation = task(stages.evaluate(
                policy=policy, reference=reference, dataset=eval_data, reward_model=judge, config=eval_config,
                model_name=model_name, gate_metric=gate_metric, gate_mode=gate_mode, min_improvement=min_improvement),
                train, "evaluate", cacheable=False)
            with dsl.If(evaluation.outputs["Output"] == True, name="gate-passed"):  # noqa: E712 (KFP condition)
                task(stages.promote(policy=policy, results=evaluation.outputs["results"], model_name=model_name,
                                    gate_metric=gate_metric, gate_mode=gate_mode, min_improvement=min_improvement,
                                    pipeline_run=pipeline_run), light, "promote", cacheable=False)

        return evaluate_and_promote

    after_grpo = evaluate_and_promote_pipeline("evaluate-and-promote-grpo")
    after_dpo = evaluate_and_promote_pipeline("evaluate-and-promote-dpo")
    after_ppo = evaluate_and_promote_pipeline("evaluate-and-promote-ppo")

    @dsl.pipeline(name=PIPELINE_NAME, description="SFT, reward model, GRPO, DPO or PPO, evaluation and gated "
                                                  "promotion in the MLflow model registry.")
    def post_training(
        base_model_uri: str,
        sft_data_uri: str,
        preference_data_uri: str,
        prompts_uri: str,
        eval_prompts_uri: str,
        algorithm: str = "grpo",
        skip_sft: bool = False,
        skip_reward_model: bool = False,
        max_steps: int = 0,
        learning_rate: float = 0.0,
        num_generations: int = 0,
        sft_config: dict = {},  # noqa: B006 (KFP reads defaults from the signature)
        reward_config: dict = {},  # noqa: B006
        dpo_config: dict = {},  # noqa: B006
        grpo_config: dict = {},  # noqa: B006
        ppo_config: dict = {},  # noqa: B006
        eval_config: dict = {},  # noqa: B006
        model_name: str = "alignflow-policy",
        gate_metric: str = "reward",
        gate_mode: str = "auto",
        min_improvement: float = 0.0,
    ):
        """SFT, reward model, GRPO, DPO or PPO, evaluation and gated promotion in the MLflow model registry.

        Args:
            base_model_uri: The model to post-train: an s3:// prefix holding a Hugging Face model folder
                (safetensors, config, tokenizer).
            sft_data_uri: SFT data (s3:// jsonl/parquet file or saved dataset) with `text`, `prompt` + `completion`,
                or chat `messages` columns.
            preference_data_uri: Preference pairs for the reward model and DPO: `prompt`, `chosen`, `rejected`.
            prompts_uri: Prompts for GRPO and PPO: a `prompt` column, plus any columns the reward functions read
                (e.g. `answer`).
            eval_prompts_uri: Held-out prompts for the evaluation that decides promotion.
            algorithm: The policy-optimisation stage after SFT: `grpo`, `dpo` or `ppo` (lower case). Any other
                value fails the first task.
            skip_sft: Use the base model as the policy without SFT (it is already instruction-tuned).
            skip_reward_model: Train no reward model: GRPO and PPO use their rule rewards only, and evaluation has
                no judge.
            max_steps: Optimizer steps of every training stage; 0 keeps each stage's own value. A `max_steps`
                key in a stage's config overrides it.
            learning_rate: Peak learning rate of every training stage; 0 keeps each stage's own value. A
                `learning_rate` key in a stage's config overrides it.
            num_generations: Completions per prompt in GRPO (>= 2); 0 keeps the GRPO config's value.
            sft_config: SFT options as a JSON object, named as in `alignflow train sft --help`
                (e.g. {"per_device_batch_size": 16, "lora_r": 16}).
            reward_config: Reward-model options, named as in `alignflow train reward --help`.
            dpo_config: DPO options, named as in `alignflow train dpo --help` (e.g. {"beta": 0.1}).
            grpo_config: GRPO options, named as in `alignflow train grpo --help` (e.g. {"reward_funcs":
                ["exact_answer"], "max_completion_length": 256}); `nodes` > 1 trains on several nodes. The trained
                reward model joins `reward_funcs` (its weight: `reward_model_weight`, default 1).
            ppo_config: PPO options, named as in `alignflow train ppo --help` (e.g. {"reward_funcs":
                ["exact_answer"], "batch_size": 64, "adap_kl_ctrl": true}); the reward model and the multi-node
                keys as for GRPO.
            eval_config: Evaluation options, named as in `alignflow eval --help` (e.g. {"reward_funcs":
                ["exact_answer"], "max_samples": 200}).
            model_name: The MLflow registered model to promote into (its `@champion` alias moves when the gate passes).
            gate_metric: The evaluation metric the candidate must beat the current champion on (e.g. reward,
                accuracy).
            gate_mode: Which way `gate_metric` improves: auto (known for alignflow's metrics: loss and kl lower,
                reward, accuracy, win_rate higher; any other metric fails check-inputs), max or min.
            min_improvement: How much the candidate must beat the champion by on `gate_metric` (0 = strictly better).
        """
        run_name = dsl.PIPELINE_JOB_NAME_PLACEHOLDER
        finish = task(stages.finish_run(pipeline_run=run_name), light, "finish-run", cacheable=False)
        with dsl.ExitHandler(finish, name="post-training"):
            # Runs every time (cache off): it looks at the data behind the URIs, and fails fast on a bad value.
            check = task(stages.check_inputs(
                algorithm=algorithm, sft_config=sft_config, reward_config=reward_config, dpo_config=dpo_config,
                grpo_config=grpo_config, ppo_config=ppo_config, eval_config=eval_config, max_steps=max_steps,
                learning_rate=learning_rate, num_generations=num_generations, model_name=model_name,
                gate_metric=gate_metric, gate_mode=gate_mode, pod_gpus=train.gpus if pod else -1,
                base_model_uri=base_model_uri,
                sft_data_uri=sft_data_uri, preference_data_uri=preference_data_uri, prompts_uri=prompts_uri,
                eval_prompts_uri=eval_prompts_uri), light, "check-inputs", cacheable=False)
            fingerprint = check.outputs
            params = {"algorithm": algorithm, "skip_sft": skip_sft, "skip_reward_model": skip_reward_model,
                      "model_name": model_name, "gate_metric": gate_metric, "gate_mode": gate_mode}
            start = task(stages.start_run(pipeline_name=PIPELINE_NAME, pipeline_run=run_name, params=params),
                         light, "start-run", cacheable=False).after(check)
            # reimport=False: one artifact per URI, so its name (part of the cache key) is stable across runs.
            base, sft_data, pref_data, prompts, eval_data = (
                dsl.importer(artifact_uri=uri, artifact_class=cls, reimport=False).set_display_name(name).after(check)
                for uri, cls, name in ((base_model_uri, dsl.Model, "base-model"), (sft_data_uri, dsl.Dataset, "sft-data"),
                                       (preference_data_uri, dsl.Dataset, "preference-data"),
                                       (prompts_uri, dsl.Dataset, "prompts"),
                                       (eval_prompts_uri, dsl.Dataset, "eval-prompts")))
            knobs = dict(max_steps=max_steps, learning_rate=learning_rate)

            # .after(start): the parent run exists before a stage looks for it (no data flows from start-run).
            policy = task(stages.sft(base_model=base.output, dataset=sft_data.output, config=sft_config, skip=skip_sft,
                                     inputs_fingerprint=fingerprint["sft"], **knobs), train, "sft").after(start)
            judge = task(stages.reward_model(base_model=base.output, dataset=pref_data.output, config=reward_config,
                                             skip=skip_reward_model, inputs_fingerprint=fingerprint["reward"],
                                             **knobs), train, "reward-model").after(start)
            evaluation = dict(reference=policy.outputs["model"], eval_data=eval_data.output,
                              judge=judge.outputs["model"], eval_config=eval_config, model_name=model_name,
                              gate_metric=gate_metric, gate_mode=gate_mode, min_improvement=min_improvement,
                              pipeline_run=run_name)
            # One branch per algorithm in components.inputs.ALGORITHMS.
            with dsl.If(algorithm == "grpo", name="grpo"):
                trained = task(stages.grpo(policy=policy.outputs["model"], dataset=prompts.output,
                                           reward_model=judge.outputs["model"], config=grpo_config,
                                           num_generations=num_generations, inputs_fingerprint=fingerprint["grpo"],
                                           **knobs), train, "grpo")
                after_grpo(policy=trained.outputs["model"], **evaluation)
            with dsl.If(algorithm == "dpo", name="dpo"):
                trained = task(stages.dpo(policy=policy.outputs["model"], dataset=pref_data.output, config=dpo_config,
                                          inputs_fingerprint=fingerprint["dpo"], **knobs), train, "dpo")
                after_dpo(policy=trained.outputs["model"], **evaluation)
            with dsl.If(algorithm == "ppo", name="ppo"):
                trained = task(stages.ppo(policy=policy.outputs["model"], dataset=prompts.output,
                                          reward_model=judge.outputs["model"], config=ppo_config,
                                          inputs_fingerprint=fingerprint["ppo"], **knobs), train, "ppo")
                after_ppo(policy=trained.outputs["model"], **evaluation)

    return post_training


post_training = make_pipeline()
PIPELINES = {"post_training": post_training}
