"""`pipeline run --local --containers` before any container starts: what reaches the tasks' environment,
where inputs and the embedded MLflow store go, the one-line errors without Docker, and the component
image switch (tests/e2e/test_containers.py runs the DAG in real containers)."""

import stat
import subprocess
import sys

import pytest

from pipelines import containers
from trainer.errors import ConfigError

IMAGE = containers.Image("reg.example/trainer:1-cpu", "sha256:" + "ab" * 32)


def test_environment_passes_endpoints_and_credentials_but_no_host_paths(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:8333")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    monkeypatch.setenv("ALIGNFLOW_PIPELINE_RUN_ID", "run-1")
    monkeypatch.setenv("ALIGNFLOW_CACHE", "/root/.cache/alignflow")
    monkeypatch.setenv("HF_HOME", "/root/.cache/huggingface")
    monkeypatch.setenv("HOME", "/root")
    monkeypatch.setenv("PYTHONPATH", "/work/checkout")
    env = containers.environment(IMAGE)
    assert env["AWS_ACCESS_KEY_ID"] == "key" and env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"
    assert env["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:8333" and env["ALIGNFLOW_PIPELINE_RUN_ID"] == "run-1"
    assert env["ALIGNFLOW_IMAGE"] == IMAGE.name and env["ALIGNFLOW_IMAGE_DIGEST"] == IMAGE.digest
    for host_only in ("ALIGNFLOW_CACHE", "HF_HOME", "HOME", "PYTHONPATH"):
        assert host_only not in env


def test_runner_uses_the_host_network():
    runner = containers.runner(IMAGE)
    assert runner.container_run_args["network_mode"] == "host"
    assert runner.container_run_args["environment"]["ALIGNFLOW_IMAGE_DIGEST"] == IMAGE.digest


def test_local_inputs_are_copied_under_the_pipeline_root_readable_by_the_image_user(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "model.safetensors").chmod(0o600)  # as save_pretrained writes it
    data = tmp_path / "sft.jsonl"
    data.write_text('{"text": "a"}\n')
    root = tmp_path / "root"
    args = {"base_model_uri": str(model), "sft_data_uri": str(data), "prompts_uri": "s3://bucket/prompts.jsonl",
            "algorithm": "grpo"}
    staged = containers.stage_inputs(args, root)
    assert staged["base_model_uri"] == str(root / "inputs/base_model_uri/model")
    assert staged["sft_data_uri"] == str(root / "inputs/sft_data_uri/sft.jsonl")
    assert staged["prompts_uri"] == "s3://bucket/prompts.jsonl" and staged["algorithm"] == "grpo"
    copied = root / "inputs/base_model_uri/model/model.safetensors"
    assert copied.read_bytes() == b"weights" and copied.stat().st_mode & stat.S_IROTH
    assert containers.stage_inputs(staged, root) == staged  # already under the root: left alone


def test_tracking_uri(tmp_path):
    assert containers.tracking_uri("http://mlflow:5000", tmp_path) == "http://mlflow:5000"
    embedded = containers.tracking_uri("", tmp_path)
    assert embedded == f"sqlite:///{tmp_path}/mlflow/mlflow.db"
    assert stat.S_IMODE((tmp_path / "mlflow").stat().st_mode) == 0o1777
    assert containers.tracking_uri(embedded, tmp_path) == embedded
    with pytest.raises(ConfigError, match="local store the task containers cannot reach"):
        containers.tracking_uri("sqlite:////elsewhere/mlflow.db", tmp_path)


def test_no_daemon_is_one_line_naming_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    with pytest.raises(ConfigError, match=r"--containers needs a running Docker daemon.*dockerd"):
        containers.check_docker("any:1")


def test_cli_without_a_daemon_exits_2_before_any_task(tmp_path):
    config = tmp_path / "p.yaml"
    config.write_text("base_model: /nonexistent\n")
    env = {"PATH": "/usr/bin:/bin", "DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock"}
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "pipeline", "run", "--local", "--containers",
                          "--config", str(config), "--output", str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "Docker daemon" in out.stderr
    assert not (tmp_path / "out/logs").exists()


def test_image_option_needs_containers(tmp_path):
    config = tmp_path / "p.yaml"
    config.write_text("base_model: /nonexistent\n")
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "pipeline", "run", "--local", "--image", "x:1",
                          "--config", str(config), "--output", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "add --containers" in out.stderr


def test_component_image_switch_is_restored():
    from components import definitions as stages
    from components.images import TRAINER_IMAGE

    with stages.image("reg.example/trainer:1-cpu"):
        assert stages.sft.component_spec.implementation.container.image == "reg.example/trainer:1-cpu"
        assert stages.promote.component_spec.implementation.container.image == "reg.example/trainer:1-cpu"
    assert stages.sft.component_spec.implementation.container.image == TRAINER_IMAGE
