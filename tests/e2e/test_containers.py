"""The images as a cluster runs them: `docker run` of the CPU trainer image trains SFT as uid 10001 and the
host loads the result; `alignflow pipeline run --local --containers` runs every task of the demo DAG in a
container of that image, on SeaweedFS and an MLflow server that is itself a container of the mlflow image,
and the winner becomes @champion with the image digest in its alignflow.json, model card and MLflow runs.

What ran where is read from Docker (its event log and the files' owners), not from the tasks' own word.
Needs a Docker daemon and the images (`bash images/build.sh --no-push --cpu`): without them every test
skips and says which is missing. `.ci/run` provides both (scripts/ci_containers.sh), building them while the rest
of the suite runs with ALIGNFLOW_CONTAINER_TESTS_LATER=1, which skips this module there; it runs in a pytest of its
own as soon as the images are built, while the suite goes on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from components.images import MLFLOW_IMAGE, TRAINER_CPU_IMAGE
from tests.servers import free_ports

if os.environ.get("ALIGNFLOW_CONTAINER_TESTS_LATER") == "1":
    pytest.skip("the images are being built beside the suite: .ci/run runs these tests once they are built",
                allow_module_level=True)

DOCKER = shutil.which("docker") or "docker"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
OFFLINE_ARGS = [arg for key, value in OFFLINE.items() for arg in ("-e", f"{key}={value}")]  # for `docker run`
PIPELINE = {
    "datasets": {"sft": "demo:math_sft", "preferences": "demo:preferences", "prompts": "demo:math",
                 "eval": "demo:math_eval"},
    "sft": {"max_steps": 8, "per_device_batch_size": 8, "learning_rate": 3e-3, "max_length": 128},
    "reward": {"max_steps": 4, "per_device_batch_size": 8, "learning_rate": 1e-3, "max_length": 128},
    "grpo": {"reward_funcs": ["exact_answer", "answer_format"], "reward_weights": [1.0, 0.2], "num_generations": 4,
             "max_completion_length": 16, "max_prompt_length": 64, "learning_rate": 1e-4, "max_steps": 3},
    "evaluate": {"reward_funcs": ["exact_answer", "answer_format"], "max_completion_length": 16,
                 "max_prompt_length": 64, "max_samples": 12},
}


def docker(*args: str, timeout: float = 120) -> str:
    out = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"docker {' '.join(args)}: {out.stderr[-2000:]}"
    return out.stdout


def image_id(image: str) -> str:
    return docker("image", "inspect", "--format", "{{.Id}}", image).strip()


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    """{name: local image id} of the CPU trainer and mlflow images; skips without a daemon or an image."""
    try:
        import docker as docker_py

        client = docker_py.from_env(timeout=10)
        client.ping()
    except Exception as err:
        pytest.skip(f"no Docker daemon answers ({type(err).__name__}): the container tests need one "
                    "(.ci/run starts dockerd: scripts/ci_containers.sh)")
    found = {}
    for image in (TRAINER_CPU_IMAGE, MLFLOW_IMAGE):
        try:
            found[image] = client.images.get(image).id
        except docker_py.errors.ImageNotFound:
            pytest.skip(f"Docker has no image {image}: build it with `bash images/build.sh --no-push --cpu`")
    client.close()
    if shutil.which(DOCKER) is None:
        pytest.skip("the docker command line is not installed")
    return found


def readable_copy(src: str, dst: Path) -> Path:
    """A copy the image's uid can read (save_pretrained writes 0600 files)."""
    shutil.copytree(src, dst)
    for path in [dst, *dst.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dst


def test_docker_run_trains_sft_as_uid_10001_and_the_host_loads_it(images, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = readable_copy(tiny_model, tmp_path / "model")
    out = tmp_path / "out"
    out.mkdir(mode=0o1777)
    out.chmod(0o1777)
    started = time.perf_counter()
    # The flags of `alignflow train sft` on the host, unchanged; no network at all in the container.
    docker("run", "--rm", "--network", "none", *OFFLINE_ARGS, "-v", f"{model}:/model:ro", "-v", f"{out}:/out",
           TRAINER_CPU_IMAGE, "alignflow", "train", "sft", "--config", "trainer/configs/sft_demo.yaml",
           "--model", "/model", "--output_dir", "/out/sft", "--max_steps", "3", "--save_steps", "0", timeout=600)
    print(f"docker run sft: {time.perf_counter() - started:.1f} s")
    saved = out / "sft"
    assert docker("image", "inspect", "--format", "{{.Config.User}}", TRAINER_CPU_IMAGE).strip() == "10001:10001"
    assert {p.stat().st_uid for p in saved.iterdir()} == {10001}, "written by another uid than the image's"
    manifest = json.loads((saved / "alignflow.json").read_text())
    assert manifest["stage"] == "sft" and manifest["step"] == 3
    assert manifest["git_sha"] == docker("image", "inspect", "--format",
                                         '{{index .Config.Labels "org.opencontainers.image.revision"}}',
                                         TRAINER_CPU_IMAGE).strip()
    loaded = AutoModelForCausalLM.from_pretrained(saved)
    tokenizer = AutoTokenizer.from_pretrained(saved)
    ids = tokenizer("2 + 2 =", return_tensors="pt").input_ids
    assert loaded(ids).logits.shape[-1] == loaded.config.vocab_size


@pytest.fixture(scope="module")
def mlflow_container(images, s3_server) -> str:
    """An MLflow server run from the mlflow image (host network, sqlite inside, artifacts in the bucket)."""
    import urllib.request

    port = free_ports(1)[0]
    env = [arg for key, value in s3_server.env().items() for arg in ("-e", f"{key}={value}")]
    name = f"alignflow-test-mlflow-{os.getpid()}"
    docker("run", "-d", "--rm", "--name", name, "--network", "host", *env, MLFLOW_IMAGE, "server", "--host",
           "127.0.0.1", "--port", str(port), "--backend-store-uri", "sqlite:////home/mlflow/mlflow.db",
           "--artifacts-destination", f"s3://{s3_server.bucket}/mlflow-containers", "--workers", "1")
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("the MLflow container did not answer /health in 120 s:\n"
                                + subprocess.run([DOCKER, "logs", name], capture_output=True, text=True).stderr[-3000:])
                time.sleep(1)
        yield uri
    finally:
        subprocess.run([DOCKER, "rm", "-f", name], capture_output=True)


def container_starts(since: float, until: float) -> list[dict]:
    """Docker's own record of the containers started in [since, until]."""
    out = docker("events", "--since", f"{since:.3f}", "--until", f"{until:.3f}", "--filter", "type=container",
                 "--filter", "event=start", "--format", "{{json .}}")
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_pipeline_runs_every_task_in_a_container_of_the_image(images, mlflow_container, s3_server, tiny_model,
                                                              tmp_path):
    from mlflow import MlflowClient

    model_name = f"containers-{os.getpid()}"
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump({**PIPELINE, "base_model": tiny_model, "model_name": model_name}))
    env = {**os.environ, **s3_server.env(), **OFFLINE, "MLFLOW_TRACKING_URI": mlflow_container,
           "OMP_WAIT_POLICY": "PASSIVE"}
    out = tmp_path / "out"
    root = f"s3://{s3_server.bucket}/containers/{os.getpid()}"
    since = time.time() - 1
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pipelines.cli", "pipeline", "run", "--local", "--containers",
                          "--config", str(config), "--output", str(out), "--pipeline-root", root],
                         env=env, capture_output=True, text=True, timeout=1200)
    print(f"pipeline --containers: {time.perf_counter() - started:.1f} s")
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    console = re.sub(r"\x1b\[[0-9;]*m", "", run.stdout + run.stderr)
    tasks = re.findall(r"\] ([\w-]+): started", console)
    # the subprocess runner's console: a line per task start and end and the summary, Docker's chatter in the logs
    assert len(console.splitlines()) <= 40 and "Found image" not in console, console
    assert {"check-inputs", "start-run", "sft", "reward-model", "grpo", "evaluate", "promote",
            "finish-run"} <= set(tasks), console

    # Docker's word: one container per task, every one of them from the trainer image.
    starts = container_starts(since, time.time() + 1)
    assert len(starts) == len(tasks), (tasks, starts)
    assert {event["from"] for event in starts} == {TRAINER_CPU_IMAGE}
    digest = images[TRAINER_CPU_IMAGE]
    assert image_id(TRAINER_CPU_IMAGE) == digest  # the tag still names the image the tasks ran

    # @champion moved to this run's model, whose lineage names the image.
    client = MlflowClient(mlflow_container)
    champion = client.get_registered_model(model_name).aliases.get("champion")
    assert champion is not None and f"@champion:     {model_name} version {champion}" in console
    version = client.get_model_version(model_name, champion)
    assert version.tags.get("alignflow.image_digest") == digest
    policy = next(Path(out, "pipeline-root").glob("*/grpo/model"))
    manifest = json.loads((policy / "alignflow.json").read_text())
    assert manifest["image_digest"] == digest and manifest["image"] == TRAINER_CPU_IMAGE
    assert digest in (policy / "README.md").read_text()
    stage_runs = client.search_runs([r.experiment_id for r in client.search_experiments()],
                                    filter_string="tags.`alignflow.stage` = 'grpo'")
    assert any(r.data.tags.get("alignflow.image_digest") == digest for r in stage_runs)


def test_image_runs_under_another_uid(images):
    """OpenShift-style: an arbitrary uid (not in /etc/passwd) still has a writable HOME for caches and outputs."""
    out = docker("run", "--rm", "--network", "none", "--user", "12345:0", *OFFLINE_ARGS, TRAINER_CPU_IMAGE,
                 "sh", "-c", "alignflow model init-tiny --out $HOME/tiny >/dev/null && id -u && ls $HOME/tiny/config.json",
                 timeout=300)
    assert out.split() == ["12345", "/home/alignflow/tiny/config.json"]
