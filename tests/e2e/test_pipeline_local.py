"""The whole post-training DAG with kfp.local: outputs mirrored to a real SeaweedFS bucket, every
stage in a real MLflow server, the winner registered as @champion (GRPO, then PPO); a failing gate
(DPO) leaves the champion alone; rollback restores the previous champion; the cache re-trains only what
new data reaches, there with `gpus_per_node: 2` starting ranks inside the SFT and DPO tasks. In the first
run, the SFT task is killed once it has a checkpoint in the bucket: kfp.local retries it, and the retry resumes
from that checkpoint. A bad parameter fails the first task."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from mlflow import MlflowClient

from tests.helpers import descendants
from trainer.io import storage

FAST = {
    "sft": {"max_steps": 8, "per_device_batch_size": 8, "learning_rate": 3e-3, "max_length": 128},
    "reward": {"max_steps": 4, "per_device_batch_size": 8, "learning_rate": 1e-3, "max_length": 128},
    "grpo": {"reward_funcs": ["exact_answer", "answer_format"], "reward_weights": [1.0, 0.2], "num_generations": 4,
             "max_completion_length": 16, "max_prompt_length": 64, "learning_rate": 1e-4, "max_steps": 3},
    "dpo": {"max_steps": 3, "per_device_batch_size": 8, "max_length": 128},
    "ppo": {"reward_funcs": ["exact_answer", "answer_format"], "reward_weights": [1.0, 0.2], "reward_model_weight": 0.5,
            "batch_size": 4, "mini_batch_size": 4, "per_device_batch_size": 4, "ppo_epochs": 1,
            "max_completion_length": 16, "max_prompt_length": 64, "learning_rate": 1e-4, "max_steps": 2},
    "evaluate": {"reward_funcs": ["exact_answer", "answer_format"], "max_completion_length": 16,
                 "max_prompt_length": 64, "max_samples": 12},
    "datasets": {"sft": "demo:math_sft", "preferences": "demo:preferences", "prompts": "demo:math",
                 "eval": "demo:math_eval"},
    "model_name": "pipeline-test",
}


CONSOLE_LINES = 40  # of a whole local run (the demo's budget is 60; docs/pipelines.md)
# The first run's SFT: killed at its first checkpoint (step 3 or a little later), the retry trains the rest.
RETRIED_STEPS = 12
SFT_RETRIED = {**FAST["sft"], "max_steps": RETRIED_STEPS, "save_steps": 3, "logging_steps": 1}


def run_pipeline(tmp_path, name: str, env: dict, kill_at_checkpoint: str | None = None,
                 **overrides) -> subprocess.CompletedProcess:
    """One `alignflow pipeline run --local --cache` of FAST with `overrides`; every run of a test shares
    its output folder, and with it kfp.local's task cache (OUTPUT/pipeline-root/.kfp_cache). With
    `kill_at_checkpoint`, that task is SIGKILLed once a step checkpoint of it is complete in the pipeline
    root, and the run gets one retry (kfp.local's cache key does not hold the retry policy)."""
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({**FAST, **overrides}))
    root = env["PIPELINE_ROOT"]
    cmd = [sys.executable, "-m", "pipelines.cli", "pipeline", "run", "--local", "--cache", "--config", str(config),
           "--output", str(tmp_path / "out"), "--pipeline-root", root, *(("--retries", "1") if kill_at_checkpoint else ())]
    if kill_at_checkpoint is None:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    out, err = tmp_path / f"{name}.stdout", tmp_path / f"{name}.stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr)
        try:
            fs, deadline = storage.filesystem(root), time.monotonic() + 600
            marker = re.compile(rf"/checkpoints/{kill_at_checkpoint}/checkpoint-\d+/alignflow.complete$")
            while not any(marker.search(p) for p in fs.find(root)):
                assert proc.poll() is None, err.read_text()[-3000:]
                assert time.monotonic() < deadline, f"no {kill_at_checkpoint} checkpoint reached the bucket"
                time.sleep(0.2)
            victims = _task_processes(proc.pid, kill_at_checkpoint)
            assert len(victims) == 1, victims
            os.kill(victims[0], signal.SIGKILL)
            proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(), err.read_text())


def tasks(result: subprocess.CompletedProcess) -> tuple[set[str], set[str]]:
    """The tasks a run executed, and those it took from the cache, from its console."""
    log = _plain(result.stdout + result.stderr)
    return set(re.findall(r"\] ([\w-]+): started", log)), set(re.findall(r"\] ([\w-]+): cached", log))


def test_pipeline_on_s3_and_mlflow_with_gate_cache_and_rollback(tiny_model, s3_env, mlflow_server, tmp_path,
                                                                monkeypatch):
    from trainer.data.sources import demo_path

    s3_server = s3_env
    root = f"s3://{s3_server.bucket}/pipelines/{os.getpid()}"
    env = {**os.environ, **s3_server.env(), "MLFLOW_TRACKING_URI": mlflow_server, "PIPELINE_ROOT": root,
           "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
    data = tmp_path / "sft.jsonl"  # SFT data at a URI of its own, which the third run finds changed
    shutil.copy(demo_path("math_sft"), data)
    datasets = {**FAST["datasets"], "sft": str(data)}

    # SIGKILL the SFT task once it has a checkpoint in SeaweedFS: kfp.local retries the task, and the retry
    # resumes from that checkpoint instead of step 0; the run's MLflow records stay whole.
    first = run_pipeline(tmp_path, "first", env, kill_at_checkpoint="sft", base_model=tiny_model, datasets=datasets,
                         sft=SFT_RETRIED)
    assert first.returncode == 0, first.stderr[-3000:]
    executed, hits = tasks(first)
    assert {"sft", "reward-model", "grpo"} <= executed and not hits
    console = _plain(first.stdout + first.stderr).splitlines()
    assert re.search(r"\] grpo: done in \d+\S*, reward=", "\n".join(console)) and "  @champion:     pipeline-test version 1" in console
    assert "executor_input" not in "\n".join(console) and "step 3/3" in (tmp_path / "out/logs/grpo.log").read_text()
    assert any(re.search(r"\] sft: FAILED after ", line) for line in console), "\n".join(console)
    assert any(re.search(r"\] sft: retrying in \d+s \(attempt 2 of 2;", line) for line in console), "\n".join(console)

    # kfp.local ran the task twice (both attempts in its log); the second resumed from the bucket, not from step 0.
    sft_log = (tmp_path / "out/logs/sft.log").read_text()
    attempt, retry = sft_log.split("Task 'sft' finished with status FAILURE", 1)
    resumed = re.search(rf"Resuming from ({re.escape(root)}/[^/]+/checkpoints/sft/checkpoint-(\d+))", retry)
    assert resumed, retry[-3000:]
    start = int(resumed.group(2))
    assert 3 <= start < RETRIED_STEPS
    logged = [int(s) for s in re.findall(rf"step (\d+)/{RETRIED_STEPS}\b", retry)]
    assert logged == list(range(start + 1, RETRIED_STEPS + 1)), logged
    assert re.findall(rf"step (\d+)/{RETRIED_STEPS}\b", attempt)[:1] == ["1"]
    # The published model carries the whole history once; the checkpoints are cleaned up after publishing.
    fs = storage.filesystem(root)
    objects = fs.find(root)
    (metrics_file,) = [o for o in objects if o.endswith("/sft/model/metrics.jsonl")]
    sft_history = [json.loads(line) for line in fs.cat(metrics_file).decode().splitlines()]
    assert [r["step"] for r in sft_history if "loss" in r] == list(range(1, RETRIED_STEPS + 1))
    assert not [o for o in objects if "/checkpoints/" in o]

    client = MlflowClient(mlflow_server)
    model = client.get_registered_model("pipeline-test")
    assert model.aliases == {"champion": "1"}
    # Every stage logged a child run with metrics under the pipeline's parent run.
    exp = client.get_experiment_by_name("alignflow")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("alignflow.stage") == "pipeline"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = {r.data.tags["alignflow.stage"]: r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert set(children) >= {"sft", "reward", "grpo", "eval", "promote"}, sorted(children)
    assert children["sft"].data.metrics["loss"] > 0 and "reward" in children["grpo"].data.metrics
    # Both SFT attempts logged into one run under the pipeline's parent run, found by the run-id tag.
    sft_runs = [r for r in runs if r.data.tags.get("alignflow.stage") == "sft"]
    assert len(sft_runs) == 1 and sft_runs[0].info.status == "FINISHED"
    assert "alignflow.pipeline_run_id" in parents[0].data.tags
    assert max(m.step for m in client.get_metric_history(sft_runs[0].info.run_id, "loss")) == RETRIED_STEPS
    # Task outputs are in the bucket.
    for suffix in ("sft/model/model.safetensors", "grpo/model/alignflow.json", "evaluate/results/metrics.json",
                   "reward-model/model/alignflow.complete"):
        assert any(o.endswith(suffix) for o in objects), f"{suffix} not in the bucket"
    # The registered version is an MLflow model with the lineage tags, logged by a promote run nested
    # under the pipeline's run, and the champion serves chat requests through mlflow.pyfunc.
    version = client.get_model_version("pipeline-test", "1")
    assert version.tags["alignflow.promotion.promoted"] == "true" and "alignflow.pipeline_run" in version.tags
    assert version.source.startswith("models:/m-") and children["promote"].info.run_id == version.run_id
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)  # pyfunc resolves models:/ through the global URI
    champion = mlflow.pyfunc.load_model("models:/pipeline-test@champion")
    (answer,) = champion.predict({"messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 8})
    assert isinstance(answer["choices"][0]["message"]["content"], str) and answer["usage"]["completion_tokens"] >= 1

    # A PPO run that always passes takes over: the version its promote task registered is the PPO model,
    # trained in that pipeline run on the rule rewards and the reward-model task's output. Its SFT and
    # reward-model tasks have the first run's inputs, so the cache serves them and nothing re-trains.
    second = run_pipeline(tmp_path, "second", env, base_model=tiny_model, datasets=datasets, algorithm="ppo",
                          min_improvement=-1e6, sft=SFT_RETRIED)
    assert second.returncode == 0, second.stderr[-3000:]
    # The console: a line per task start and end and a summary; each task's whole log in its own file.
    console = _plain(second.stdout + second.stderr).splitlines()
    assert len(console) <= CONSOLE_LINES, "\n".join(console)
    executed, hits = tasks(second)
    assert hits == {"sft", "reward-model"} and {"check-inputs", "ppo"} <= executed, (executed, hits)
    assert any(t.startswith("evaluate") for t in executed)  # it looks at the champion every time
    assert client.get_registered_model("pipeline-test").aliases == {"champion": "2", "previous-champion": "1"}
    promote_run = client.get_run(client.get_model_version("pipeline-test", "2").run_id)
    stages = {r.data.tags.get("alignflow.stage"): r for r in client.search_runs(
        [exp.experiment_id], f"tags.`mlflow.parentRunId` = '{promote_run.data.tags['mlflow.parentRunId']}'")}
    assert {"ppo", "promote"} <= set(stages) and not {"grpo", "dpo"} & set(stages), sorted(stages)
    ppo_metrics = stages["ppo"].data.metrics
    assert "objective/kl" in ppo_metrics and "ppo/val/var_explained" in ppo_metrics, sorted(ppo_metrics)
    assert {k for k in ppo_metrics if k.startswith("rewards/") and k.endswith("/mean")} == {
        "rewards/exact_answer/mean", "rewards/answer_format/mean", "rewards/model/mean"}, sorted(ppo_metrics)
    objects = storage.filesystem(root).find(root)
    assert any(o.endswith("ppo/model/alignflow.complete") for o in objects)

    # New SFT data at the same URI (a recurring run on fresh data) re-trains the stages that read it, and
    # only those: SFT and the DPO after it, not the reward model. Both train on 2 ranks inside their task
    # (`gpus_per_node: 2`: CPU ranks over gloo, DPO's under DeepSpeed ZeRO-2), at the same global batch. An
    # impossible gate: the DPO candidate is evaluated but nothing is registered and the champion stays;
    # rollback gives the crown back.
    with data.open("a") as fh:
        fh.write(json.dumps({"prompt": [{"role": "user", "content": "What is 1 plus 1? End with #### and the number."}],
                             "completion": [{"role": "assistant", "content": "1 + 1 = 2\n#### 2"}]}) + "\n")
    ranks = {"gpus_per_node": 2, "mixed_precision": "no"}
    third = run_pipeline(tmp_path, "third", env, base_model=tiny_model, datasets=datasets, algorithm="dpo",
                         min_improvement=1e6,
                         sft={**FAST["sft"], "per_device_batch_size": 4, **ranks, "deepspeed": "none"},
                         dpo={**FAST["dpo"], "per_device_batch_size": 4, **ranks, "deepspeed": "zero2"})
    assert third.returncode == 0, third.stderr[-3000:]
    executed, hits = tasks(third)
    assert hits == {"reward-model"} and {"sft", "dpo", "check-inputs"} <= executed, (executed, hits)
    logs = "".join((tmp_path / "out/logs" / f"{task}.log").read_text() for task in ("sft", "dpo"))
    assert "sft: cpu, 2 processes (MULTI_CPU)" in logs and "dpo: cpu, 2 processes (DEEPSPEED)" in logs, logs[-4000:]
    fs = storage.filesystem(root)
    for stage, zero in (("sft", None), ("dpo", 2)):
        manifests = [json.loads(fs.cat(o)) for o in fs.find(root) if o.endswith(f"/{stage}/model/alignflow.json")]
        assert [(m["world_size"], m["zero_stage"]) for m in manifests if m["world_size"] > 1] == [(2, zero)], manifests
    assert client.get_registered_model("pipeline-test").aliases == {"champion": "2", "previous-champion": "1"}
    assert len(client.search_model_versions("name='pipeline-test'")) == 2
    rollback = subprocess.run([sys.executable, "-m", "trainer.cli", "promote", "--rollback", "pipeline-test"],
                              env=env, capture_output=True, text=True, timeout=120)
    assert rollback.returncode == 0, rollback.stderr[-2000:]
    assert json.loads(rollback.stdout)["champion_after"] == "1"
    assert client.get_registered_model("pipeline-test").aliases == {"champion": "1", "previous-champion": "2"}


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # kfp.local colours task names


def _task_processes(root_pid: int, function: str) -> list[int]:
    """Descendants of `root_pid` running the component `function` (python -m kfp.dsl.executor_main)."""
    found = []
    for pid in descendants(root_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # The python process itself, not the `sh -ec` wrapper that passes the same arguments on.
        if (b"kfp.dsl.executor_main" in argv and b"--function_to_execute" in argv
                and argv[argv.index(b"--function_to_execute") + 1] == function.encode()):
            found.append(pid)
    return found


def test_a_ui_run_with_a_wrong_algorithm_fails_in_its_first_task(tiny_model, tmp_path):
    """A run started from the KFP UI skips the CLI's checks: the pipeline's first task catches the value."""
    config = tmp_path / "ui.yaml"
    config.write_text(yaml.safe_dump({**FAST, "base_model": tiny_model, "algorithm": "GRPO"}))
    script = ("import sys\n"
              "from pipelines import run\n"
              "run.validate = lambda *args, **kwargs: None  # a UI submission: no client-side check\n"
              f"run.run_local(run.load_pipeline_config({str(config)!r}), {str(tmp_path / 'out')!r})\n")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("MLFLOW_TRACKING_URI", None)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - started
    log = _plain(result.stdout + result.stderr)
    assert result.returncode != 0
    assert "`algorithm` must be one of grpo, dpo, ppo (lower case), got 'GRPO'." in log
    executed = re.findall(r"\] ([\w-]+): started", log)
    assert executed[0] == "check-inputs" and not {"sft", "reward-model", "start-run"} & set(executed), executed
    assert "Task 'check-inputs' finished with status FAILURE" in log
    assert seconds < 120, f"took {seconds:.0f}s"
