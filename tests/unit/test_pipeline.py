"""The pipeline compiles with its Kubernetes settings, and bad configs fail before any task runs."""

import pytest
import yaml

from pipelines import run as pipeline_run
from pipelines.post_training import PIPELINES
from trainer.config import ConfigError

DEMO = "pipelines/configs/demo.yaml"


def compiled(tmp_path, config=None) -> str:
    out = tmp_path / "pipeline.yaml"
    pipeline_run.compile_pipeline(str(out), config)
    return out.read_text()


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


def test_cluster_section_changes_resources(tmp_path):
    config = pipeline_run.load_pipeline_config(DEMO, {"cluster": {"train": {"gpus": 4, "accelerator": "nvidia.com/gpu",
                                                                             "node_selector": {"pool": "h100"}}}})
    text = compiled(tmp_path, config)
    assert "resourceCount: '4'" in text and "pool" in text


def test_demo_config_validates(tmp_path, tiny_model):
    config = pipeline_run.load_pipeline_config(DEMO, {"base_model": tiny_model})
    pipeline_run.validate(config, promotion=False)
    args = config.arguments()
    assert args["sft_data_uri"].endswith("math_sft.jsonl") and args["grpo_config"]["num_generations"] == 4


@pytest.mark.parametrize(("override", "message"), [
    ({"sft": {"lerning_rate": 1e-3}}, "In the `sft` section of the pipeline config: Unknown sft option `lerning_rate`"),
    ({"grpo": {"num_generations": 1}}, "`num_generations` must be >= 2"),
    ({"datasets": {"sft": "/no/such/file.jsonl", "preferences": "demo:preferences", "prompts": "demo:math",
                   "eval": "demo:math_eval"}}, "`datasets.sft` = '/no/such/file.jsonl' does not exist"),
    ({"algorithm": "ppo"}, "`algorithm` must be grpo or dpo"),
])
def test_bad_configs_fail_before_any_task(tiny_model, override, message):
    config = pipeline_run.load_pipeline_config(DEMO, {"base_model": tiny_model, **override})
    with pytest.raises(ConfigError) as err:
        pipeline_run.validate(config, promotion=False)
    assert message in str(err.value)


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
    assert pipeline_run.check_cron("0 0 3 * * *") == "0 0 3 * * *"
    with pytest.raises(ConfigError, match="six fields"):
        pipeline_run.check_cron("0 3 * * *")


def test_console_script_lists_every_group_and_dispatches(capsys):
    from pipelines import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for group in ("train", "model", "eval", "promote", "pipeline"):
        assert f"    {group}" in out, f"`{group}` missing from alignflow --help:\n{out}"
    assert cli.main(["train"]) == 2  # handed to trainer.cli: its usage line
    assert "usage: alignflow train {dpo,grpo,reward,sft}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["pipeline", "--help"])
    assert exc.value.code == 0 and "submit" in capsys.readouterr().out


def test_trainer_cli_has_no_pipeline_group(capsys):
    from trainer import cli

    with pytest.raises(SystemExit):
        cli.main(["pipeline", "compile"])
    assert "invalid choice: 'pipeline'" in capsys.readouterr().err
