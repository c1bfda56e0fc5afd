"""The pipeline compiles with its Kubernetes settings, and bad configs fail before any task runs."""

import json
import subprocess
import sys

import pytest
import yaml

from pipelines import run as pipeline_run
from pipelines.post_training import PIPELINES
from trainer.errors import ConfigError

DEMO = "pipelines/configs/demo.yaml"


def compiled(tmp_path, config=None) -> str:
    out = tmp_path / "pipeline.yaml"
    pipeline_run.compile_pipeline(str(out), config)
    return out.read_text()


@pytest.fixture(scope="module")
def default_yaml(tmp_path_factory) -> str:
    """The pipeline compiled with the default config, once for the tests that only read it (~5 s under coverage)."""
    return compiled(tmp_path_factory.mktemp("default-pipeline"))


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_pipeline_compiles(name, tmp_path):
    from kfp import compiler

    out = tmp_path / f"{name}.yaml"
    compiler.Compiler().compile(PIPELINES[name], package_path=str(out))
    docs = list(yaml.safe_load_all(out.read_text()))
    assert docs[0]["pipelineInfo"]["name"] == "alignflow-post-training"


def test_yaml_carries_gpus_secrets_retries_and_no_credentials(tmp_path, monkeypatch):
    secret = "s3cr3t-value-that-must-not-leak"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", secret)
    text = compiled(tmp_path)
    assert secret not in text
    pipeline_spec, platform_spec = yaml.safe_load_all(text)
    executors = pipeline_spec["deploymentSpec"]["executors"]
    sft = next(e for name, e in executors.items() if name.endswith("-sft"))["container"]
    assert sft["resources"]["accelerator"]["resourceCount"] == "1"
    assert sft["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"
    assert "install_kfp_package" not in text and "pip install" not in " ".join(sft.get("command", []))
    k8s = platform_spec["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    sft_k8s = next(e for name, e in k8s.items() if name.endswith("-sft"))
    secrets = {s["secretName"]: {kv["envVar"] for kv in s["keyToEnv"]} for s in sft_k8s["secretAsEnv"]}
    assert "AWS_SECRET_ACCESS_KEY" in secrets["alignflow-s3"]
    assert "MLFLOW_TRACKING_URI" in secrets["alignflow-mlflow"]
    assert sft_k8s["emptyDirMounts"][0]["mountPath"] == "/dev/shm"
    tasks = pipeline_spec["root"]["dag"]["tasks"]["exit-handler-1"]
    assert tasks  # the DAG is wrapped in the exit handler that closes the MLflow run
    assert "retryPolicy" in text and "backoffDuration: 60s" in text


def test_hf_token_reaches_only_the_tasks_that_load_or_push_models_and_every_pod_gets_the_pull_secret(tmp_path,
                                                                                                  monkeypatch):
    """HF_TOKEN reaches the training and evaluation tasks from the optional Secret alignflow-hf; the light tasks
    (check-inputs, start/finish-run, promote) get no Hub token; the token is no pipeline parameter, and a token in
    the compiling process's environment does not leak into the YAML."""
    token = "hf_t0ken-that-must-not-leak"
    monkeypatch.setenv("HF_TOKEN", token)
    text = compiled(tmp_path)
    assert token not in text
    pipeline_spec, platform_spec = yaml.safe_load_all(text)
    assert not [name for name in pipeline_spec["root"]["inputDefinitions"]["parameters"] if "token" in name.lower()]
    k8s = platform_spec["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    hub = {name.removeprefix("exec-"): [s for s in e.get("secretAsEnv", []) if s["secretName"] == "alignflow-hf"]
           for name, e in k8s.items()}
    with_token = {name for name, found in hub.items() if found}
    assert {"sft", "reward-model", "grpo", "dpo", "ppo"} <= with_token and any(n.startswith("evaluate") for n in with_token)
    assert not with_token & {"check-inputs", "start-run", "finish-run"} and not any(
        n.startswith("promote") for n in with_token)
    (secret,) = hub["sft"]
    assert secret["keyToEnv"] == [{"secretKey": "HF_TOKEN", "envVar": "HF_TOKEN"}] and secret["optional"] is True
    # Every task's pod may pull the trainer image from a private registry with the alignflow-registry Secret.
    assert all([s["secretName"] for s in e["imagePullSecret"]] == ["alignflow-registry"] for e in k8s.values())


def test_cluster_section_changes_resources(tmp_path):
    config = pipeline_run.load_pipeline_config(DEMO, {"cluster": {"train": {"gpus": 4, "accelerator": "nvidia.com/gpu",
                                                                             "node_selector": {"pool": "h100"}}}})
    text = compiled(tmp_path, config)
    assert "resourceCount: '4'" in text and "pool" in text


@pytest.mark.parametrize("algorithm", ["grpo", "dpo", "ppo"])
def test_demo_config_validates(tmp_path, tiny_model, algorithm):
    config = pipeline_run.load_pipeline_config(DEMO, {"base_model": tiny_model, "algorithm": algorithm})
    pipeline_run.validate(config, promotion=False)
    args = config.arguments()
    assert args["sft_data_uri"].endswith("math_sft.jsonl") and args["grpo_config"]["num_generations"] == 4
    assert args["algorithm"] == algorithm and args["ppo_config"]["batch_size"] == 8


@pytest.mark.parametrize(("override", "message"), [
    ({"sft": {"lerning_rate": 1e-3}}, "In the `sft` section of the pipeline config: Unknown sft option `lerning_rate`"),
    ({"grpo": {"num_generations": 1}}, "`num_generations` must be >= 2"),
    ({"datasets": {"sft": "/no/such/file.jsonl", "preferences": "demo:preferences", "prompts": "demo:math",
                   "eval": "demo:math_eval"}}, "`datasets.sft` = '/no/such/file.jsonl' does not exist"),
    ({"algorithm": "PPO"}, "`algorithm` must be one of grpo, dpo, ppo (lower case), got 'PPO'"),
    ({"max_steps": -3}, "`max_steps` must be 0 (each stage's own value) or a finite positive number, got -3"),
    ({"num_generations": 1}, "`num_generations` must be 0 (the grpo section's value) or >= 2"),
    ({"grpo": {"loss_type": "ppo"}}, "invalid choice: 'ppo' (choose from 'grpo', 'bnpo', 'dr_grpo', 'dapo')"),
    ({"algorithm": "ppo", "ppo": {"batch_size": 6, "mini_batch_size": 4, "per_device_batch_size": 4}},
     "In the `ppo` section of the pipeline config: batch_size (6) must be a multiple of mini_batch_size (4)"),
    ({"ppo": {"cliprang": 0.1}}, "In the `ppo` section of the pipeline config: Unknown ppo option `cliprang` "
                                 "(in the stage config). Did you mean `cliprange`?"),
    ({"ppo": {"reward_model_weight": "high"}}, "In the `ppo` section of the pipeline config: `reward_model_weight` "
                                               "must be a number"),
    ({"ppo": {"nodes": 0}}, "In the `ppo` section of the pipeline config: `nodes` must be a whole number >= 1"),
])
def test_bad_configs_fail_before_any_task(tiny_model, override, message):
    config = pipeline_run.load_pipeline_config(DEMO, {"base_model": tiny_model, **override})
    with pytest.raises(ConfigError) as err:
        pipeline_run.validate(config, promotion=False)
    assert message in str(err.value)


@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_the_reward_model_joins_the_rl_rewards_with_its_weight(stage):
    """`reward_model_weight` is the pipeline's key (accepted in the section, never passed to the stage); the
    reward-model task's output goes after the section's reward functions, or after the stage's default ones."""
    from components import inputs

    section = {"reward_funcs": ["exact_answer", "answer_format"], "reward_weights": [1.0, 0.2],
               "reward_model_weight": 0.5}
    inputs.check_parameters(stage, {stage: section}, {}, {}, "m")
    paths = {"model": "/policy", "dataset": "/prompts", "output_dir": "/out"}
    config, _, values = inputs.resolve_stage(stage, section, {}, reward_model="/rm", **paths)
    assert "reward_model_weight" not in values
    assert config.reward_funcs == ["exact_answer", "answer_format", "/rm"]
    assert config.reward_weights == [1.0, 0.2, 0.5]
    config, _, _ = inputs.resolve_stage(stage, {}, {}, reward_model="/rm", **paths)
    assert (config.reward_funcs, config.reward_weights) == (["exact_answer", "/rm"], [])
    assert inputs.resolve_stage(stage, {}, {}, **paths)[0].reward_funcs == ["exact_answer"]


def test_unknown_pipeline_option_suggests_the_closest():
    with pytest.raises(ConfigError, match="Unknown pipeline option `algoritm`. Did you mean `algorithm`"):
        pipeline_run.load_pipeline_config(DEMO, {"algoritm": "dpo"})


def test_unreachable_s3_endpoint_is_named(tiny_model, monkeypatch):
    from tests.servers import free_ports

    (port,) = free_ports(1)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    config = pipeline_run.load_pipeline_config(DEMO, {"base_model": "s3://bucket/model"})
    with pytest.raises(ConfigError, match=r"`base_model` = 's3://bucket/model': the object store cannot be reached"):
        pipeline_run.validate(config, promotion=False)


def test_unreachable_mlflow_fails_when_promotion_is_requested(tiny_model, dead_mlflow_uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead_mlflow_uri)
    config = pipeline_run.load_pipeline_config(DEMO, {"base_model": tiny_model})
    with pytest.raises(ConfigError, match="cannot be reached .* promoting a model"):
        pipeline_run.validate(config)


def test_cron_needs_six_fields():
    from pipelines.cluster import check_cron

    assert check_cron("0 0 3 * * *") == "0 0 3 * * *"
    with pytest.raises(ConfigError, match="six fields"):
        check_cron("0 3 * * *")


def test_console_script_lists_every_group_and_dispatches(capsys):
    from pipelines import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for group in ("train", "model", "eval", "promote", "pipeline"):
        assert f"    {group}" in out, f"`{group}` missing from alignflow --help:\n{out}"
    assert cli.main(["train"]) == 2  # handed to trainer.cli: its usage line
    from trainer.stages import STAGES

    assert f"usage: alignflow train {{{','.join(sorted(STAGES))}}}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["pipeline", "--help"])
    assert exc.value.code == 0 and "submit" in capsys.readouterr().out


def test_trainer_cli_has_no_pipeline_group(capsys):
    from trainer.cli import main as cli

    with pytest.raises(SystemExit):
        cli.main(["pipeline", "compile"])
    assert "invalid choice: 'pipeline'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# What the compiled spec promises: cache keys, parameters a UI user can read, one branch per algorithm

TRAINING_COMPONENTS = ("comp-sft", "comp-reward-model", "comp-dpo", "comp-grpo", "comp-ppo")
# Producers whose outputs are functions of the data alone (fingerprints), though they run every time.
DATA_FUNCTIONS = {("comp-check-inputs", key) for key in ("sft", "reward", "dpo", "grpo", "ppo")}


def _tasks(spec) -> list[tuple[str, str, dict]]:
    """(component holding the task, task name, task spec) for every task at every depth."""
    dags = {"root": spec["root"], **spec["components"]}
    return [(holder, name, task) for holder, comp in dags.items() if "dag" in comp
            for name, task in comp["dag"]["tasks"].items()]


def _sources(spec, holder: str, binding: dict, kind: str) -> set[tuple]:
    """Where one task input comes from, followed up through the sub-DAGs to the root: a pipeline
    parameter, a constant, or (producer component, output key)."""
    if "componentInputParameter" in binding or "componentInputArtifact" in binding:
        name = binding.get("componentInputParameter") or binding["componentInputArtifact"]
        if holder == "root":
            return {("pipeline-parameter", name)}
        found = set()
        for parent, _, task in _tasks(spec):
            if task["componentRef"]["name"] == holder:
                found |= _sources(spec, parent, task["inputs"][kind][name], kind)
        return found
    if "taskOutputParameter" in binding or "taskOutputArtifact" in binding:
        out = binding.get("taskOutputParameter") or binding["taskOutputArtifact"]
        producer = next(task["componentRef"]["name"] for h, name, task in _tasks(spec)
                        if h == holder and name == out["producerTask"])
        return {(producer, out.get("outputParameterKey") or out.get("outputArtifactKey"))}
    if "runtimeValue" in binding:
        return {("constant", json.dumps(binding["runtimeValue"]["constant"]))}
    raise AssertionError(f"unexpected input binding {binding}")


def cache_relevant(text: str) -> dict[str, dict]:
    """Per training task: what KFP's cache key is made of (backend/src/v2/cacheutils: input values and
    artifact names, output spec, image, command and args), with every input traced to its source."""
    spec = yaml.safe_load_all(text).__next__()
    executors = spec["deploymentSpec"]["executors"]
    out = {}
    for holder, name, task in _tasks(spec):
        component = task["componentRef"]["name"]
        if component not in TRAINING_COMPONENTS:
            continue
        container = executors[spec["components"][component]["executorLabel"]]["container"]
        inputs = {kind: {key: sorted(_sources(spec, holder, binding, kind)) for key, binding in
                         task.get("inputs", {}).get(kind, {}).items()} for kind in ("parameters", "artifacts")}
        out[name] = {"image": container["image"], "command": container["command"], "args": container["args"],
                     "outputs": spec["components"][component]["outputDefinitions"], "inputs": inputs,
                     "cache": task["cachingOptions"]}
    return out


def test_training_cache_keys_are_stable_and_take_nothing_made_per_run(tmp_path):
    config = pipeline_run.load_pipeline_config(DEMO)
    first = cache_relevant(compiled(tmp_path, config))
    # The second compile in a fresh process, through the command line.
    out = tmp_path / "again.yaml"
    result = subprocess.run([sys.executable, "-m", "pipelines.cli", "pipeline", "compile", "--out", str(out),
                             "--config", DEMO], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert cache_relevant(out.read_text()) == first
    assert set(first) == {"sft", "reward-model", "grpo", "dpo", "ppo"}

    spec = next(yaml.safe_load_all(out.read_text()))
    cached_producers = {task["componentRef"]["name"] for _, _, task in _tasks(spec)
                        if task.get("cachingOptions", {}).get("enableCache")}
    for name, key in first.items():
        assert key["cache"] == {"enableCache": True}, name
        for kind in ("parameters", "artifacts"):
            for input_name, sources in key["inputs"][kind].items():
                for source in map(tuple, sources):
                    per_run = not (source[0] in ("pipeline-parameter", "constant")
                                   or source[0].startswith("comp-importer") or source[0] in cached_producers
                                   or source in DATA_FUNCTIONS)
                    assert not per_run, f"{name}.{input_name} comes from {source}, which is made fresh by every run"
                    assert "{{$" not in source[1], f"{name}.{input_name} is a run-time placeholder: {source}"
    # The fingerprint reaches each training task, and the parent run does not.
    assert first["sft"]["inputs"]["parameters"]["inputs_fingerprint"] == [("comp-check-inputs", "sft")]
    # PPO: the policy from SFT, the judge from the reward-model task, the prompts' fingerprint.
    assert first["ppo"]["inputs"]["artifacts"]["policy"] == [("comp-sft", "model")]
    assert first["ppo"]["inputs"]["artifacts"]["reward_model"] == [("comp-reward-model", "model")]
    assert first["ppo"]["inputs"]["parameters"]["inputs_fingerprint"] == [("comp-check-inputs", "ppo")]
    assert not any("parent" in k for key in first.values() for k in key["inputs"]["parameters"])


def test_every_task_gets_the_run_id_from_the_pod_label_not_an_input(default_yaml):
    from components.settings import RUN_ID_ENV

    spec, platform = yaml.safe_load_all(default_yaml)
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    containers = [e for e in spec["deploymentSpec"]["executors"] if "container" in spec["deploymentSpec"]["executors"][e]]
    assert len(containers) >= 8
    for executor in containers:
        assert {"fieldPath": "metadata.labels['pipeline/runid']", "name": RUN_ID_ENV} in k8s[executor]["fieldPathAsEnv"]


def test_every_pipeline_parameter_is_described_for_the_ui(default_yaml):
    spec = next(yaml.safe_load_all(default_yaml))
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert len(parameters) == 21
    undescribed = [name for name, p in parameters.items() if len(p.get("description", "")) < 20]
    assert undescribed == []
    assert "`grpo`, `dpo` or `ppo`" in parameters["algorithm"]["description"]


def test_one_branch_per_algorithm_and_the_parameter_check_runs_first(default_yaml):
    from components.inputs import ALGORITHMS

    spec = next(yaml.safe_load_all(default_yaml))
    conditions = sorted(task["triggerPolicy"]["condition"] for _, _, task in _tasks(spec)
                        if "pipelinechannel--algorithm" in task.get("triggerPolicy", {}).get("condition", ""))
    assert conditions == sorted(f"inputs.parameter_values['pipelinechannel--algorithm'] == '{a}'" for a in ALGORITHMS)
    body = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    assert "dependentTasks" not in body["check-inputs"]
    assert all("check-inputs" in task.get("dependentTasks", []) for name, task in body.items() if name != "check-inputs")


def test_common_knobs_fill_the_stage_configs_and_stage_keys_win():
    from components.inputs import with_knobs

    knobs = {"max_steps": 7, "learning_rate": 0.0, "num_generations": 8}
    assert with_knobs("sft", {"per_device_batch_size": 4}, knobs) == {"max_steps": 7, "per_device_batch_size": 4}
    assert with_knobs("grpo", {"max_steps": 3}, knobs) == {"num_generations": 8, "max_steps": 3}
    assert with_knobs("dpo", {}, {"max_steps": 0, "learning_rate": 0.0}) == {}


def test_fingerprint_follows_the_data_not_the_uri(tmp_path):
    from trainer.io.storage import fingerprint

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "a"}\n')
    before = fingerprint(str(data))
    assert fingerprint(str(data)) == before
    (data / "train.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    assert fingerprint(str(data)) != before
    (data / "extra.jsonl").write_text("")
    assert len({before, fingerprint(str(data)), fingerprint(str(data / "train.jsonl"))}) == 3


@pytest.mark.parametrize(("path", "env", "expected"), [
    # A cluster: <root>/<pipeline>/<run id>/<task>/<salt>/<output>, the run id from the pod label.
    ("/s3/bucket/v2/artifacts/alignflow-post-training/run-123/sft/8f1e/model", {"ALIGNFLOW_PIPELINE_RUN_ID": "run-123"},
     "s3://bucket/v2/artifacts/alignflow-post-training/run-123/checkpoints/sft"),
    ("/minio/mlpipeline/v2/artifacts/p/run-9/grpo/abc/model", {"ALIGNFLOW_PIPELINE_RUN_ID": "run-9"},
     "s3://mlpipeline/v2/artifacts/p/run-9/checkpoints/grpo"),
    # kfp.local: <root>/<pipeline run>/<task>/<output>, mirrored to the bucket when there is one.
    ("/tmp/out/pipeline-root/alignflow-post-training-2026/sft/model", {"ALIGNFLOW_PIPELINE_RUN_ID": "x"},
     "/tmp/out/pipeline-root/alignflow-post-training-2026/checkpoints/sft"),
    ("/tmp/out/pipeline-root/alignflow-post-training-2026/reward-model/model",
     {"ALIGNFLOW_PIPELINE_ROOT": "s3://b/pipelines"}, "s3://b/pipelines/alignflow-post-training-2026/checkpoints/reward-model"),
])
def test_checkpoints_go_under_the_run_and_task_not_the_attempt(monkeypatch, path, env, expected):
    from components.runtime import checkpoint_uri

    monkeypatch.delenv("ALIGNFLOW_PIPELINE_ROOT", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert checkpoint_uri(path) == expected
