"""The post-training DAG: data -> SFT -> (reward model, in parallel) -> GRPO or DPO -> evaluate ->
promote under `dsl.If(gate passed)`.

    start_run ─┬─ sft ───────────────┬─ If(algorithm == grpo): grpo ─┐
               └─ reward_model ──────┤                              ├─ evaluate ─ If(gate): promote
                                     └─ Else:                  dpo ─┘
    (start_run opens the MLflow parent run; finish_run closes it as the exit handler)

The reward model trains from the base model, so it runs beside SFT. `skip_sft` hands the base
model on as the policy (already instruction-tuned); `skip_reward_model` leaves GRPO with rule
rewards only and evaluation without a judge. Per-stage options travel as one dict per stage.
The pipeline only composes: Kubernetes settings come from `pipelines.kubernetes`.
"""


from kfp import dsl

from components import stages
from pipelines.kubernetes import LIGHT, TRAINING, Resources, apply

PIPELINE_NAME = "alignflow-post-training"


def _evaluate_and_promote(train, light, retries: int, name: str):
    """A sub-pipeline evaluating a trained policy and promoting it when it passes the gate."""

    @dsl.pipeline(name=name)
    def evaluate_and_promote(policy: dsl.Input[dsl.Model], reference: dsl.Input[dsl.Model],
                             eval_data: dsl.Input[dsl.Dataset], judge: dsl.Input[dsl.Model], eval_config: dict,
                             model_name: str, gate_metric: str, min_improvement: float, mlflow_parent_run_id: str,
                             pipeline_run: str):
        evaluation = apply(stages.evaluate(
            policy=policy, reference=reference, dataset=eval_data, reward_model=judge, config=eval_config,
            model_name=model_name, gate_metric=gate_metric, min_improvement=min_improvement,
            mlflow_parent_run_id=mlflow_parent_run_id), train, retries).set_display_name("evaluate")
        with dsl.If(evaluation.outputs["Output"] == True, name="gate-passed"):  # noqa: E712 (KFP condition)
            apply(stages.promote(
                policy=policy, results=evaluation.outputs["results"], model_name=model_name, gate_metric=gate_metric,
                min_improvement=min_improvement, mlflow_parent_run_id=mlflow_parent_run_id,
                pipeline_run=pipeline_run), light, retries, cache=False).set_display_name("promote")

    return evaluate_and_promote


def make_pipeline(train: Resources = TRAINING, light: Resources = LIGHT, retries: int = 2):
    """The post-training pipeline with the given task resources and retry count (compile-time settings)."""
    after_grpo = _evaluate_and_promote(train, light, retries, "evaluate-and-promote-grpo")
    after_dpo = _evaluate_and_promote(train, light, retries, "evaluate-and-promote-dpo")

    @dsl.pipeline(name=PIPELINE_NAME, description="SFT, reward model, GRPO or DPO, evaluation and gated promotion "
                                                  "in the MLflow model registry.")
    def post_training(
        base_model_uri: str,
        sft_data_uri: str,
        preference_data_uri: str,
        prompts_uri: str,
        eval_prompts_uri: str,
        algorithm: str = "grpo",
        skip_sft: bool = False,
        skip_reward_model: bool = False,
        sft_config: dict = {},  # noqa: B006 (KFP reads defaults from the signature)
        reward_config: dict = {},  # noqa: B006
        dpo_config: dict = {},  # noqa: B006
        grpo_config: dict = {},  # noqa: B006
        eval_config: dict = {},  # noqa: B006
        model_name: str = "alignflow-policy",
        gate_metric: str = "reward",
        min_improvement: float = 0.0,
    ):
        run_name = dsl.PIPELINE_JOB_NAME_PLACEHOLDER
        finish = apply(stages.finish_run(pipeline_run=run_name), light, retries, cache=False).set_display_name("finish-run")
        with dsl.ExitHandler(finish, name="post-training"):
            params = {"algorithm": algorithm, "skip_sft": skip_sft, "skip_reward_model": skip_reward_model,
                      "model_name": model_name, "gate_metric": gate_metric}
            start = apply(stages.start_run(pipeline_name=PIPELINE_NAME, pipeline_run=run_name, params=params),
                          light, retries, cache=False).set_display_name("start-run")
            parent = start.output
            base = dsl.importer(artifact_uri=base_model_uri, artifact_class=dsl.Model, reimport=False)
            base.set_display_name("base-model")
            sft_data = dsl.importer(artifact_uri=sft_data_uri, artifact_class=dsl.Dataset, reimport=False)
            pref_data = dsl.importer(artifact_uri=preference_data_uri, artifact_class=dsl.Dataset, reimport=False)
            prompts = dsl.importer(artifact_uri=prompts_uri, artifact_class=dsl.Dataset, reimport=False)
            eval_data = dsl.importer(artifact_uri=eval_prompts_uri, artifact_class=dsl.Dataset, reimport=False)

            policy = apply(stages.sft(base_model=base.output, dataset=sft_data.output, config=sft_config,
                                      skip=skip_sft, mlflow_parent_run_id=parent), train, retries).set_display_name("sft")
            judge = apply(stages.reward_model(base_model=base.output, dataset=pref_data.output, config=reward_config,
                                              skip=skip_reward_model, mlflow_parent_run_id=parent),
                          train, retries).set_display_name("reward-model")
            common = dict(reference=policy.outputs["model"], eval_data=eval_data.output, judge=judge.outputs["model"],
                          eval_config=eval_config, model_name=model_name, gate_metric=gate_metric,
                          min_improvement=min_improvement, mlflow_parent_run_id=parent, pipeline_run=run_name)
            with dsl.If(algorithm == "grpo", name="grpo"):
                trained = apply(stages.grpo(policy=policy.outputs["model"], dataset=prompts.output,
                                            reward_model=judge.outputs["model"], config=grpo_config,
                                            mlflow_parent_run_id=parent), train, retries).set_display_name("grpo")
                after_grpo(policy=trained.outputs["model"], **common)
            with dsl.Else(name="dpo"):
                trained = apply(stages.dpo(policy=policy.outputs["model"], dataset=pref_data.output, config=dpo_config,
                                           mlflow_parent_run_id=parent), train, retries).set_display_name("dpo")
                after_dpo(policy=trained.outputs["model"], **common)

    return post_training


post_training = make_pipeline()
PIPELINES = {"post_training": post_training}
