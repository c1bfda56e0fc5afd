"""A multi-node stage (components/trainjob.py): the TrainJob / PyTorchJob it renders for a 2-node
GRPO stage with the vLLM sidecar, the script its pods run (parsed by accelerate's own launcher
parser), strict Kubernetes validation of its pod templates, the `nodes` checks, and submit/follow/
wait against fake Kubernetes APIs."""

import json
import os
import shlex
import stat
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from components import inputs, kubejob, runtime, trainjob
from components.images import TRAINER_IMAGE
from components.runtime import checkpoint_uri as runtime_checkpoint_uri  # the tests patch runtime's
from components.settings import HUB_SECRET_ENV, SECRET_ENV
from pipelines import run as pipeline_run
from tests.helpers import ROOT
from trainer.errors import ConfigError

KUBE_VERSIONS = ["1.30.0", "1.33.0"]
GRPO = {
    "nodes": 2,
    "gpus_per_node": 4,
    "rollout_engine": "vllm-server",
    "vllm_gpu_memory_utilization": 0.2,
    "num_generations": 4,
    "reward_funcs": ["exact_answer", "s3://bucket/run/reward-model/model"],
}
INPUTS = {
    "model": "s3://bucket/run/sft/model",
    "dataset": "s3://bucket/data/math.jsonl",
    "output_dir": "s3://bucket/pipe/run-1/checkpoints/grpo",
}


def two_node_grpo(**overrides):
    config, multi, values = inputs.resolve_stage("grpo", {**GRPO, **overrides}, {}, **INPUTS)
    return trainjob.render("grpo", config, values, multi, name="alignflow-grpo-0123abcd"), multi


def script_of(manifest) -> str:
    return trainjob.pod_templates(manifest)[0]["spec"]["containers"][0]["command"][2]


def test_two_node_grpo_trainjob_shape(monkeypatch):
    secret = "s3cr3t-value-that-must-not-leak"
    for keys in [*SECRET_ENV.values(), *HUB_SECRET_ENV.values()]:
        for env in keys.values():
            monkeypatch.setenv(env, secret)
    job, _ = two_node_grpo()
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and job["kind"] == "TrainJob"
    assert job["spec"]["runtimeRef"] == {"name": "torch-distributed"}
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 4
    assert trainer["image"] == TRAINER_IMAGE
    # 4 training GPUs + 1 for the vLLM servers of the node's ranks
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "5"
    assert trainer["resourcesPerNode"]["requests"]["nvidia.com/gpu"] == "5"
    script = trainer["command"][2]
    assert trainer["command"][:2] == ["bash", "-c"]
    assert "exec accelerate launch --config_file trainer/configs/accelerate/deepspeed_zero2.yaml" in script
    assert "--num_machines 2 --num_processes 8 --gpu_ids 0,1,2,3" in script
    assert "--deepspeed_multinode_launcher standard" in script
    assert "-m trainer.cli train grpo --config /tmp/alignflow-stage.json" in script
    assert (ROOT / "trainer/configs/accelerate/deepspeed_zero2.yaml").exists()
    env = {e["name"]: e for e in trainer["env"]}
    stage = json.loads(env["ALIGNFLOW_STAGE_CONFIG"]["value"])
    assert stage["vllm_server_devices"] == "4" and stage["rollout_engine"] == "vllm-server"
    assert (
        stage["output_dir"] == INPUTS["output_dir"] and "nodes" not in stage and "gpus_per_node" not in stage
    )
    for secret_name, keys in {**SECRET_ENV, **HUB_SECRET_ENV}.items():  # the Hub token too: these are training pods
        for key, var in keys.items():
            assert env[var]["valueFrom"]["secretKeyRef"] == {
                "name": secret_name,
                "key": key,
                "optional": True,
            }
    assert secret not in json.dumps(job)
    assert trainjob.pod_templates(job)[0]["spec"]["imagePullSecrets"] == [{"name": "alignflow-registry"}]
    (patch,) = job["spec"]["runtimePatches"]
    assert patch["manager"] == trainjob.PATCH_MANAGER
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"
    pod = node["template"]["spec"]["template"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["spec"]["volumes"]
    assert pod["spec"]["containers"] == [
        {"name": "node", "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
         "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
    ]
    assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["metadata"] == {"labels": {"alignflow.io/mlflow-client": "true"},
                               "annotations": {"sidecar.istio.io/inject": "false"}}


def test_two_node_grpo_pytorchjob_shape():
    job, _ = two_node_grpo(job_kind="PyTorchJob", deepspeed="zero3")
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {role: r["replicas"] for role, r in replicas.items()} == {"Master": 1, "Worker": 1}
    for replica in replicas.values():
        assert replica["restartPolicy"] == "Never"
        (container,) = replica["template"]["spec"]["containers"]
        assert container["name"] == "pytorch" and container["image"] == TRAINER_IMAGE
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "5"
        assert "deepspeed_zero3.yaml" in container["command"][2]
        assert replica["template"]["spec"]["imagePullSecrets"] == [{"name": "alignflow-registry"}]


def test_without_vllm_server_no_rollout_gpu_and_ddp_without_deepspeed():
    job, _ = two_node_grpo(rollout_engine="hf", deepspeed="none")
    trainer = job["spec"]["trainer"]
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "4"
    assert "vllm_server_devices" not in json.loads(trainer["env"][0]["value"])
    assert "--multi_gpu" in trainer["command"][2] and "--config_file" not in trainer["command"][2]


@pytest.mark.parametrize("kind", ["TrainJob", "PyTorchJob"])
def test_job_pods_are_locked_down(kind):
    """Every pod of the job: the trainer image's non-root uid, RuntimeDefault seccomp, no privilege
    escalation or capabilities, the label MLflow's NetworkPolicy admits, and `service_account`. A
    PyTorchJob's pods get no ServiceAccount token; a TrainJob's runtime patch has no field for that
    (tests/unit/components/test_job_crds.py), so its pods rely on the account's own setting."""
    job, _ = two_node_grpo(job_kind=kind, service_account="rel-alignflow")
    dockerfile = (ROOT / "images" / "trainer" / "Dockerfile").read_text()
    image_uid = [line.split()[1].split(":")[0] for line in dockerfile.splitlines() if line.startswith("USER ")][-1]
    for template in trainjob.pod_templates(job):
        spec = template["spec"]
        assert spec.get("automountServiceAccountToken") is (False if kind == "PyTorchJob" else None)
        assert spec["serviceAccountName"] == "rel-alignflow"
        assert spec["securityContext"] == {"runAsNonRoot": True, "runAsUser": int(image_uid),
                                           "runAsGroup": int(image_uid), "seccompProfile": {"type": "RuntimeDefault"}}
        (container,) = spec["containers"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert template["metadata"]["labels"]["alignflow.io/mlflow-client"] == "true"


TRAINJOB_SIDECAR = {"rollout_gpus": 2, "training_runtime": "alignflow-rollout-2gpu"}


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize(("kind", "keys"), [("TrainJob", {}), ("PyTorchJob", {}), ("PyTorchJob", {"rollout_gpus": 1}),
                                            ("TrainJob", TRAINJOB_SIDECAR)],
                         ids=["TrainJob", "PyTorchJob", "PyTorchJob-rollout-sidecar", "TrainJob-rollout-sidecar"])
def test_pod_templates_validate_strictly(kind, keys, version, request):
    """The pods as the operator builds them validate as core Pods (a TrainJob's: the runtime's pod template with the
    patch merged; with the sidecar, the chart's alignflow-rollout-2gpu runtime)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    job, _ = two_node_grpo(job_kind=kind, node_selector={"pool": "h100"}, **keys)
    runtime = request.getfixturevalue("rollout_runtimes")[keys["training_runtime"]] if "training_runtime" in keys \
        else None
    templates = trainjob.pod_templates(job, runtime)
    if runtime:
        assert [c["name"] for c in templates[0]["spec"]["initContainers"]] == ["rollout-server"]
    assert len(templates) == (1 if kind == "TrainJob" else 2)
    for template in templates:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "rank-0", **template["metadata"]},
            "spec": template["spec"],
        }
        kubernetes_validate.validate(pod, version, strict=True)
    broken = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "x"},
        "spec": {**templates[0]["spec"], "volumes": [{"name": "dshm", "emptyDir": {"medium": 1}}]},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


@pytest.mark.parametrize(
    ("kind", "env", "rank"),
    [
        (
            "TrainJob",
            {"PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"},
            1,
        ),
        (
            "PyTorchJob",
            {"RANK": "1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2"},
            1,
        ),
    ],
)
def test_pod_script_prepares_the_config_and_launches_accelerate(tmp_path, kind, env, rank):
    """Run the pod's script with a stand-in `accelerate` that records its arguments, then parse them
    with accelerate's own `launch` parser: flags, quoting and the operator's environment all count."""
    from accelerate.commands.launch import launch_command_parser

    job, _ = two_node_grpo(job_kind=kind)
    script = script_of(job).replace("/tmp/alignflow-stage.json", str(tmp_path / "stage.json"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "accelerate"
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"json.dump(sys.argv[1:], open({str(tmp_path / 'argv.json')!r}, 'w'))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    stage_env = next(
        e["value"]
        for e in trainjob.pod_templates(job)[0]["spec"]["containers"][0]["env"]
        if e["name"] == trainjob.CONFIG_ENV
    )
    local = {
        **json.loads(stage_env),
        "model": str(tmp_path),
        "dataset": "demo",
        "reward_funcs": ["exact_answer"],
    }  # local: nothing to fetch
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MASTER_", "RANK"))}
    run_env.update(
        env,
        PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), run_env["PATH"]]),
        PYTHONPATH=str(ROOT),
        ALIGNFLOW_STAGE_CONFIG=json.dumps(local),
    )
    subprocess.run(["bash", "-c", script], env=run_env, cwd=ROOT, check=True, timeout=120)

    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[0] == "launch"
    args = launch_command_parser().parse_args(argv[1:])
    assert (args.num_machines, args.num_processes, args.machine_rank) == (2, 8, rank)
    master = env.get("PET_MASTER_ADDR", env.get("MASTER_ADDR"))
    assert (args.main_process_ip, args.main_process_port) == (
        master,
        int(env.get("PET_MASTER_PORT", env.get("MASTER_PORT"))),
    )
    assert args.module and args.training_script == "trainer.cli"
    assert args.training_script_args == ["train", "grpo", "--config", str(tmp_path / "stage.json")]
    assert args.config_file == "trainer/configs/accelerate/deepspeed_zero2.yaml"
    assert args.deepspeed_multinode_launcher == "standard" and args.gpu_ids == "0,1,2,3"
    assert json.loads((tmp_path / "stage.json").read_text()) == local


def test_prepare_config_copies_object_store_inputs(tmp_path, monkeypatch):
    fetched = []

    def fake_fetch(uri):
        fetched.append(uri)
        return f"/cache/{uri.rsplit('/', 1)[-1]}"

    monkeypatch.setattr(trainjob.storage, "fetch_to_local", fake_fetch)
    monkeypatch.setenv(trainjob.CONFIG_ENV, json.dumps({**GRPO, **INPUTS}))
    values = json.loads(Path(trainjob.prepare_config(str(tmp_path / "c.json"))).read_text())
    assert values["model"] == "/cache/model" and values["dataset"] == "/cache/math.jsonl"
    assert values["reward_funcs"] == ["exact_answer", "/cache/model"]
    assert values["output_dir"] == INPUTS["output_dir"]  # the output stays in the bucket
    assert sorted(fetched) == sorted([INPUTS["model"], INPUTS["dataset"], GRPO["reward_funcs"][1]])


# ----------------------------------------------------------------------------------------------
# nodes and the other multi-node keys


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"nodes": 0}, "`nodes` must be a whole number >= 1, got 0"),
        ({"nodes": "2"}, "`nodes` must be a whole number >= 1, got '2'"),
        ({"nodes": True}, "`nodes` must be a whole number >= 1, got True"),
        ({"nodes": 1.5}, "`nodes` must be a whole number >= 1, got 1.5"),
        ({"nodes": 2, "job_kind": "MPIJob"}, "`job_kind` must be one of TrainJob, PyTorchJob"),
        ({"nodes": 2, "rollout_engine": "vllm"}, "rollout_engine=vllm runs vLLM inside the training process"),
        ({"nodes": 2, "rollout_engine": "vllm-server", "vllm_gpu_memory_utilization": 1.5},
         "give a number in (0, 1], got 1.5"),
        (
            {"nodes": 2, "rollout_engine": "vllm-server", "vllm_server_devices": "7"},
            "`vllm_server_devices` is set by",
        ),
    ],
)
def test_pipeline_validation_names_the_stage_and_field(config, message):
    pipeline_config = pipeline_run.load_pipeline_config(
        "pipelines/configs/demo.yaml", {"base_model": "unused", "grpo": {"num_generations": 4, **config}}
    )
    with pytest.raises(ConfigError) as err:
        pipeline_run.validate(pipeline_config, promotion=False)
    assert "In the `grpo` section of the pipeline config" in str(err.value) and message in str(err.value)


def test_every_stage_runs_on_several_nodes_and_gpus():
    for stage in ("sft", "reward", "dpo", "grpo"):
        multi, _ = trainjob.split_config({"nodes": 2, "gpus_per_node": 4})
        multi.check(stage)  # no stage is refused any more
    config = pipeline_run.load_pipeline_config("pipelines/configs/demo.yaml", {"sft": {"num_processes": 2}})
    with pytest.raises(ConfigError, match=r"In the `sft` section.*set `gpus_per_node`"):
        pipeline_run.validate(config, promotion=False)
    vllm = pipeline_run.load_pipeline_config("pipelines/configs/demo.yaml",
                                             {"grpo": {"gpus_per_node": 2, "rollout_engine": "vllm"}})
    with pytest.raises(ConfigError, match=r"In the `grpo` section.*one process only"):
        pipeline_run.validate(vllm, promotion=False)


def test_gpus_per_node_becomes_the_ranks_of_one_pod():
    multi, _ = trainjob.split_config({"gpus_per_node": 2, "deepspeed": "none", "mixed_precision": "no"})
    assert multi.rank_options() == {"num_processes": 2, "deepspeed": None, "bf16": False, "fp16": False}
    multi, _ = trainjob.split_config({"gpus_per_node": 8})
    assert multi.rank_options() == {"num_processes": 8, "deepspeed": "zero2", "bf16": True, "fp16": False}
    assert trainjob.split_config({})[0].rank_options() == {}


def test_kfp_floats_are_whole_numbers_and_nodes_1_is_the_single_node_path(tiny_model):
    multi, rest = trainjob.split_config({"nodes": 2.0, "gpus_per_node": 8.0, "learning_rate": 1e-4})
    assert (multi.nodes, multi.gpus_per_node, rest) == (2, 8, {"learning_rate": 1e-4})
    config = pipeline_run.load_pipeline_config(
        "pipelines/configs/demo.yaml",
        {"base_model": tiny_model, "grpo": {"nodes": 1, "gpus_per_node": 2, "num_generations": 4}},
    )
    pipeline_run.validate(config, promotion=False, local=True)  # nodes: 1 is accepted and never reaches the stage
    # On a cluster the training pods (cluster.train.gpus, 1 in the demo config) must have those 2 GPUs.
    with pytest.raises(ConfigError, match=r"`gpus_per_node` is 2 but the training tasks' pods have 1 GPU"):
        pipeline_run.validate(config, promotion=False)


def test_local_run_refuses_several_nodes(tmp_path, tiny_model):
    config = pipeline_run.load_pipeline_config(
        "pipelines/configs/demo.yaml", {"base_model": tiny_model, "grpo": {"nodes": 2, "num_generations": 4}}
    )
    with pytest.raises(ConfigError, match="a local run trains on this machine"):
        pipeline_run.run_local(config, str(tmp_path))


# ----------------------------------------------------------------------------------------------
# Artifacts


def test_kfp_paths_map_back_to_object_store_uris():
    assert trainjob.remote_uri("/s3/bucket/run/sft/model") == "s3://bucket/run/sft/model"
    assert trainjob.remote_uri("/minio/mlpipeline/v2/artifacts/x") == "s3://mlpipeline/v2/artifacts/x"
    assert (
        trainjob.remote_uri("s3://b/k") == "s3://b/k"
        and trainjob.remote_uri("exact_answer") == "exact_answer"
    )
    values = trainjob.remote_inputs(
        {"model": "/s3/b/m", "dataset": "/s3/b/d", "reward_funcs": ["x", "/s3/b/rm"]}
    )
    assert values == {"model": "s3://b/m", "dataset": "s3://b/d", "reward_funcs": ["x", "s3://b/rm"]}
    with pytest.raises(ConfigError, match="`model` is the local path '/home/me/model'"):
        trainjob.remote_inputs({"model": "/home/me/model", "dataset": "s3://b/d"})


def test_download_takes_the_complete_final_model_without_step_checkpoints(tmp_path):
    staging = tmp_path / "model.staging"
    (staging / "checkpoint-10").mkdir(parents=True)
    (staging / "checkpoint-10" / "optimizer.pt").write_text("big")
    (staging / "model.safetensors").write_text("weights")
    (staging / "merged").mkdir()
    (staging / "merged" / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="no alignflow.complete"):
        trainjob.download_complete(str(staging), str(tmp_path / "out"))
    (staging / "alignflow.complete").write_text("{}")
    trainjob.download_complete(str(staging), str(tmp_path / "out"))
    got = sorted(
        p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file()
    )
    assert got == ["alignflow.complete", "merged/config.json", "model.safetensors"]


# ----------------------------------------------------------------------------------------------
# submit_and_wait against fake Kubernetes APIs


class FakeCustom:
    """CustomObjectsApi: the job's status walks through `statuses` (the last one repeats)."""

    def __init__(self, statuses):
        self.statuses, self.created, self.deleted, self.gets = list(statuses), [], [], 0

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        self.created.append((group, version, namespace, plural, body))

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.gets += 1
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        if isinstance(status, BaseException):
            raise status
        return {**self.created[0][4], "status": status}

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, **kwargs):
        self.deleted.append((plural, name))


class FakeLog:
    def __init__(self, chunks):
        self.chunks = chunks

    def stream(self, amt=None, decode_content=False):
        yield from self.chunks


class FakeCore:
    """CoreV1Api: one rank-0 pod that runs, then succeeds; its log arrives in chunks."""

    def __init__(self, pod_name, chunks, phases=("Running", "Succeeded")):
        self.pod_name, self.chunks, self.phases = pod_name, chunks, list(phases)
        self.selectors, self.log_calls = [], []

    def list_namespaced_pod(self, namespace, label_selector):
        self.selectors.append(label_selector)
        phase = self.phases.pop(0) if len(self.phases) > 1 else self.phases[0]
        pod = SimpleNamespace(
            metadata=SimpleNamespace(
                name=self.pod_name, labels={}, annotations={kubejob.COMPLETION_INDEX: "0"}
            ),
            status=SimpleNamespace(phase=phase),
        )
        worker = SimpleNamespace(
            metadata=SimpleNamespace(name="worker", labels={kubejob.COMPLETION_INDEX: "1"}, annotations={}),
            status=SimpleNamespace(phase="Running"),
        )
        return SimpleNamespace(items=[worker, pod])

    def read_namespaced_pod_log(self, name, namespace, **kwargs):
        self.log_calls.append((name, kwargs))
        return FakeLog(self.chunks)


def condition(kind_type, reason="", message=""):
    return {
        "conditions": [
            {"type": "Created", "status": "True"},
            {"type": kind_type, "status": "True", "reason": reason, "message": message},
        ]
    }


def test_submit_streams_rank0_logs_waits_and_deletes_on_success():
    job, _ = two_node_grpo()
    custom = FakeCustom([{}, condition("Running"), condition("Complete", "JobSetCompleted", "done")])
    core = FakeCore(
        "alignflow-grpo-0123abcd-node-0-0-x", [b"step 1 reward=0.1\nstep 2 ", b"reward=0.3\n", b"Saved"]
    )
    lines = []
    kubejob.submit_and_wait(job, "team-a", custom=custom, core=core, poll_s=0.01, emit=lines.append)
    assert custom.created[0][:4] == ("trainer.kubeflow.org", "v1alpha1", "team-a", "trainjobs")
    assert custom.created[0][4] is job
    assert ["step 1 reward=0.1", "step 2 reward=0.3", "Saved"] == [
        ln for ln in lines if not ln.startswith("[")
    ]
    assert core.log_calls[0][0] == "alignflow-grpo-0123abcd-node-0-0-x"  # rank 0, not the worker
    assert core.log_calls[0][1]["container"] == "node"
    assert "jobset.sigs.k8s.io/jobset-name=alignflow-grpo-0123abcd" in core.selectors[0]
    assert custom.gets >= 3 and custom.deleted == [("trainjobs", "alignflow-grpo-0123abcd")]


def test_failure_raises_with_the_jobs_reason_and_keeps_the_job():
    job, _ = two_node_grpo(job_kind="PyTorchJob")
    custom = FakeCustom(
        [
            condition("Running"),
            condition(
                "Failed",
                "PyTorchJobFailed",
                "PyTorchJob alignflow-grpo-0123abcd is failed because 1 Master replica(s) failed.",
            ),
        ]
    )
    core = FakeCore("alignflow-grpo-0123abcd-master-0", [b"Traceback ...\nCUDA out of memory\n"], ("Failed",))
    lines = []
    with pytest.raises(RuntimeError) as err:
        kubejob.submit_and_wait(job, "ns", custom=custom, core=core, poll_s=0.01, emit=lines.append)
    assert "PyTorchJob ns/alignflow-grpo-0123abcd failed: PyTorchJobFailed: PyTorchJob" in str(err.value)
    assert "1 Master replica(s) failed" in str(err.value)
    assert "CUDA out of memory" in lines and custom.deleted == []
    assert "training.kubeflow.org/replica-type=master" in core.selectors[0]
    assert core.log_calls[0][1]["container"] == "pytorch"


def test_interrupt_deletes_the_job():
    job, _ = two_node_grpo()
    custom = FakeCustom([condition("Running"), KeyboardInterrupt()])
    core = FakeCore("p", [b"starting\n"], ("Pending",))
    with pytest.raises(KeyboardInterrupt):
        kubejob.submit_and_wait(job, "ns", custom=custom, core=core, poll_s=0.01, emit=lambda line: None)
    assert custom.deleted == [("trainjobs", "alignflow-grpo-0123abcd")]
    assert core.log_calls == []  # a pending pod has no log to read


def test_lost_job_and_missing_crd_are_reported():
    from kubernetes.client.exceptions import ApiException

    job, _ = two_node_grpo()
    custom = FakeCustom([ApiException(status=404, reason="Not Found")])
    with pytest.raises(RuntimeError, match="cannot be read"):
        kubejob.submit_and_wait(
            job,
            "ns",
            custom=custom,
            core=FakeCore("p", [], ("Pending",)),
            poll_s=0.01,
            emit=lambda line: None,
        )
    assert custom.deleted  # nothing is left running unattended

    class NoCrd(FakeCustom):
        def create_namespaced_custom_object(self, *args):
            raise ApiException(status=404, reason="Not Found")

    with pytest.raises(RuntimeError, match="trainjobs.trainer.kubeflow.org CRD installed"):
        kubejob.submit_and_wait(job, "ns", custom=NoCrd([{}]), core=FakeCore("p", []), poll_s=0.01)


def test_job_outcome():
    job = {"kind": "TrainJob"}
    assert kubejob.job_outcome(job) == (None, "")
    assert kubejob.job_outcome({**job, "status": condition("Complete", "", "")})[0] == "succeeded"
    assert kubejob.job_outcome(
        {**job, "status": {"conditions": [{"type": "Complete", "status": "False"}]}}
    ) == (None, "")
    assert kubejob.job_outcome(
        {**job, "status": condition("Failed", "BackoffLimitExceeded", "pod x failed")}
    ) == ("failed", "BackoffLimitExceeded: pod x failed")
    assert kubejob.job_outcome({"kind": "PyTorchJob", "status": condition("Succeeded", "Done")}) == (
        "succeeded",
        "Done",
    )
    assert kubejob.job_outcome({"kind": "PyTorchJob", "status": condition("Complete")}) == (None, "")


class FakeStore:
    """KFP's `/s3/<bucket>/...` task paths mapped to an in-memory object store (fsspec's `memory://`), so the
    launcher's own path -> URI mapping and checkpoint prefix run unchanged, and the trainer's `auto` finds what a
    job's pods left there."""

    def __init__(self, monkeypatch):
        import fsspec

        self.fs = fsspec.filesystem("memory")
        self.fs.store.clear()
        self.fs.pseudo_dirs.clear()
        self.fs.pseudo_dirs.append("")
        monkeypatch.setattr(
            trainjob, "remote_uri", lambda p: "memory://" + p[len("/s3/"):] if p.startswith("/s3/") else p
        )

    def write(self, uri: str, text: str) -> None:
        with self.fs.open(uri, "w") as fh:
            fh.write(text)


def train_two_nodes(runtime, monkeypatch, tmp_path, attempt: str):
    """One attempt of a cluster task training GRPO on two nodes. KFP gives each attempt its own output URI
    (`.../<task>/<attempt>/model`, seen in the pod as the /s3/ path) and a local folder the task writes it to."""
    kfp_path = f"/s3/bucket/pipe/run-1/grpo-task/{attempt}/model"
    out = SimpleNamespace(path=str(tmp_path / attempt / "model"), uri="memory://" + kfp_path[len("/s3/"):])
    metrics = SimpleNamespace(logged={}, path=str(tmp_path / attempt / "metrics"))
    metrics.log_metric = lambda k, v: metrics.logged.__setitem__(k, v)
    # The launcher keys checkpoints by the output's task path: give it the one KFP would, not the local stand-in.
    monkeypatch.setattr(runtime, "checkpoint_uri", lambda path, real=runtime_checkpoint_uri: real(kfp_path))
    runtime.train_stage(
        "grpo",
        {"nodes": 2.0, "num_generations": 4},
        model_in="/s3/bucket/pipe/run-1/sft-task/a/model",
        dataset="/s3/bucket/data/math.jsonl",
        model_out=out,
        metrics_out=metrics,
        report_out=SimpleNamespace(path=str(tmp_path / attempt / "report.html")),
        knobs={"max_steps": 7, "learning_rate": 0.0, "num_generations": 8},
    )
    return out, metrics


def finish_job(store, stage: dict) -> None:
    """What a job's rank 0 leaves when it finishes: the final model, marked complete, in `output_dir`."""
    store.write(f"{stage['output_dir']}/alignflow.json", json.dumps({"metrics": {"reward": 0.5}}))
    store.write(f"{stage['output_dir']}/alignflow.complete", "{}")


def test_launcher_sends_a_multi_node_stage_to_the_job(tmp_path, monkeypatch):
    """train_stage with nodes: 2 renders a job for the artifacts' URIs, waits, downloads the model it trained."""
    from components.settings import RUN_ID_ENV

    store, submitted = FakeStore(monkeypatch), []

    def fake_wait(manifest, **kwargs):
        submitted.append(json.loads(manifest["spec"]["trainer"]["env"][0]["value"]))
        finish_job(store, submitted[-1])

    monkeypatch.setenv(RUN_ID_ENV, "run-1")
    monkeypatch.setattr(trainjob, "submit_and_wait", fake_wait)
    monkeypatch.setattr(runtime, "parent_run_id", lambda: "parent123")  # found by the run-id tag
    out, metrics = train_two_nodes(runtime, monkeypatch, tmp_path, "attempt-1")
    (stage,) = submitted
    assert stage["model"] == "memory://bucket/pipe/run-1/sft-task/a/model"
    assert stage["dataset"] == "memory://bucket/data/math.jsonl"
    assert stage["output_dir"] == "memory://bucket/pipe/run-1/checkpoints/grpo-task"  # the run's and task's
    assert stage["mlflow_parent_run_id"] == "parent123" and stage["resume_from_checkpoint"] == "auto"
    assert stage["max_steps"] == 7 and stage["num_generations"] == 4  # the knob fills in; the stage's key wins
    assert metrics.logged == {"reward": 0.5} and Path(out.path, "alignflow.complete").exists()
    assert not store.fs.exists(stage["output_dir"])  # removed once downloaded


def test_a_retried_multi_node_task_resumes_from_the_checkpoints_of_the_failed_attempt(tmp_path, monkeypatch):
    """Attempt 1's job writes checkpoint-3 and fails (a node was preempted). KFP retries the task with a new output
    URI; attempt 2's job gets the same `output_dir`, where the trainer's `auto` finds checkpoint-3. An attempt that
    starts after the job finished but before the task did (its download failed) submits no job at all."""
    from components.settings import RUN_ID_ENV
    from trainer.engine import checkpoint as ckpt

    store, submitted = FakeStore(monkeypatch), []

    def preempted_then_finished(manifest, **kwargs):
        stage = json.loads(manifest["spec"]["trainer"]["env"][0]["value"])
        submitted.append(stage)
        if len(submitted) == 1:
            store.write(f"{stage['output_dir']}/checkpoint-3/training_state/state.json", "{}")
            store.write(f"{stage['output_dir']}/checkpoint-3/alignflow.complete", "{}")
            raise RuntimeError("TrainJob alignflow-grpo-1 failed: node-1 was preempted")
        found = ckpt.find_resume(stage["resume_from_checkpoint"], stage["output_dir"])
        assert found is not None and found[0].endswith("/checkpoint-3"), found  # what the job's ranks resume from
        finish_job(store, stage)

    monkeypatch.setenv(RUN_ID_ENV, "run-1")
    monkeypatch.setattr(trainjob, "submit_and_wait", preempted_then_finished)
    monkeypatch.setattr(runtime, "parent_run_id", lambda: "")
    with pytest.raises(RuntimeError, match="preempted"):
        train_two_nodes(runtime, monkeypatch, tmp_path, "attempt-1")
    download = trainjob.download_complete
    monkeypatch.setattr(trainjob, "download_complete", lambda *a: (_ for _ in ()).throw(OSError("store hiccup")))
    with pytest.raises(OSError, match="store hiccup"):
        train_two_nodes(runtime, monkeypatch, tmp_path, "attempt-2")
    monkeypatch.setattr(trainjob, "download_complete", download)
    out, metrics = train_two_nodes(runtime, monkeypatch, tmp_path, "attempt-3")

    assert len(submitted) == 2 and submitted[0]["output_dir"] == submitted[1]["output_dir"]
    assert "attempt" not in submitted[0]["output_dir"]
    assert metrics.logged == {"reward": 0.5} and Path(out.path, "alignflow.complete").exists()
    assert not store.fs.exists(submitted[0]["output_dir"])


def test_follower_thread_stops():
    """No follower thread outlives submit_and_wait's join (daemon threads would hide a leak)."""
    before = threading.active_count()
    job, _ = two_node_grpo()
    kubejob.submit_and_wait(
        job,
        "ns",
        custom=FakeCustom([condition("Complete")]),
        core=FakeCore("p", [b"x\n"], ("Succeeded",)),
        poll_s=0.01,
        emit=lambda line: None,
    )
    assert threading.active_count() == before


def test_chart_role_allows_what_submit_and_wait_calls():
    """The chart's Role grants every call above, to the ServiceAccounts KFP runs pipeline steps as."""
    pytest.importorskip("helm_python")
    from tests.helpers import by_kind, render_chart

    docs = render_chart({})
    (role,) = by_kind(docs, "Role")
    verbs = {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    for kind in kubejob.KINDS.values():
        assert {"create", "get", "delete"} <= verbs[(kind.group, kind.plural)]
    assert "list" in verbs[("", "pods")] and "get" in verbs[("", "pods/log")]
    (binding,) = by_kind(docs, "RoleBinding")
    assert {"pipeline-runner", "default-editor"} <= {s["name"] for s in binding["subjects"]}


def test_launcher_path_does_not_import_kfp_kubernetes():
    """Components import trainjob at run time, inside KFP's executor, whose trimmed `kfp.dsl`
    cannot load `kfp.kubernetes` (it needs `kfp.dsl.PipelineTask`)."""
    import subprocess
    import sys

    code = "import sys, components.runtime, components.trainjob; print('kfp.kubernetes' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------------------------
# Section keys on one node and one GPU: each used, or refused by check-inputs


def test_deepspeed_on_one_gpu_reaches_the_stage_when_given():
    assert trainjob.split_config({})[0].rank_options() == {}  # the zero2 default is for several ranks
    multi, _ = trainjob.split_config({"deepspeed": "zero3_offload"})
    assert multi.rank_options() == {"deepspeed": "zero3_offload"}  # one rank under DeepSpeed, as the CLI does


def test_zero3_offload_runs_on_several_nodes_from_its_accelerate_file():
    multi, _ = trainjob.split_config({"nodes": 2, "gpus_per_node": 4, "deepspeed": "zero3_offload"})
    script = trainjob.node_script("sft", multi)
    assert "--config_file trainer/configs/accelerate/deepspeed_zero3_offload.yaml" in script
    accelerate = yaml.safe_load((ROOT / "trainer/configs/accelerate/deepspeed_zero3_offload.yaml").read_text())
    assert accelerate["deepspeed_config"]["deepspeed_config_file"] == "trainer/configs/deepspeed_zero3_offload.json"


def test_a_sections_bf16_sets_the_ranks_precision_and_a_contradiction_is_refused():
    multi, _ = trainjob.split_config({"gpus_per_node": 2, "bf16": False})
    assert multi.rank_options()["bf16"] is False and multi.precision() == "no"
    multi, _ = trainjob.split_config({"nodes": 2, "fp16": True})
    assert "--mixed_precision fp16" in trainjob.node_script("sft", multi)
    assert trainjob.split_config({"gpus_per_node": 2})[0].precision() == "bf16"  # neither given: bf16 on several ranks
    multi, _ = trainjob.split_config({"gpus_per_node": 2, "bf16": False, "mixed_precision": "bf16"})
    with pytest.raises(ConfigError, match="contradicts the section's bf16: false"):
        multi.check("sft")


@pytest.mark.parametrize("key, value, where", [
    ("node_selector", {"pool": "a100"}, "cluster.train.node_selector"),
    ("tolerations", [], "cluster.train.tolerations"),
    ("cpu_per_node", "16", "cluster.train.cpu"),
    ("memory_per_node", "64Gi", "cluster.train.memory"),
    ("shm_size", "16Gi", "cluster.train.shm_size"),
    ("job_kind", "PyTorchJob", "remove it"),
    ("service_account", "rel-alignflow", "remove it"),
])
def test_pod_keys_on_one_node_are_refused_naming_the_cluster_setting(key, value, where):
    multi, _ = trainjob.split_config({key: value})
    with pytest.raises(ConfigError, match=f"`{key}` sets the pods of a multi-node job.*{where}"):
        multi.check("grpo")
    trainjob.split_config({key: value, "nodes": 2})[0].check("grpo")  # where they belong


def test_one_node_ranks_must_match_the_pods_gpus():
    multi, _ = trainjob.split_config({"gpus_per_node": 4})
    multi.check_pod(4)
    with pytest.raises(ConfigError, match="`gpus_per_node` is 4 but the training tasks' pods have 2 GPU"):
        multi.check_pod(2)
    with pytest.raises(ConfigError, match="`gpus_per_node` is 1 but the training tasks' pods have 8 GPU"):
        trainjob.split_config({})[0].check_pod(8)
    trainjob.split_config({})[0].check_pod(0)  # a CPU pool: one CPU rank


def test_rollout_gpus_run_the_server_as_a_native_sidecar_of_each_pytorchjob_pod():
    """rollout_gpus: each pod gets `alignflow rollout-server` as an init container with restartPolicy Always
    (started, and ready, before the trainer; stopped after it) on its own GPUs, and its ranks use it on 127.0.0.1."""
    from trainer.rollout.server import make_parser

    job, multi = two_node_grpo(job_kind="PyTorchJob", rollout_gpus=2, max_prompt_length=96,
                               max_completion_length=160)
    for template in trainjob.pod_templates(job):
        (trainer,) = template["spec"]["containers"]
        (sidecar,) = template["spec"]["initContainers"]
        assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "4"  # the ranks' GPUs only
        stage = json.loads(next(e["value"] for e in trainer["env"] if e["name"] == trainjob.CONFIG_ENV))
        assert (stage["vllm_server_host"], stage["vllm_server_port"]) == ("127.0.0.1", trainjob.ROLLOUT_PORT)
        assert "vllm_server_devices" not in stage
        assert sidecar["name"] == "rollout-server" and sidecar["restartPolicy"] == "Always"
        assert sidecar["image"] == trainer["image"] and sidecar["env"] == trainer["env"]
        assert sidecar["resources"] == multi.resources(2)
        for probe in ("startupProbe", "readinessProbe"):
            assert sidecar[probe]["httpGet"] == {"path": "/ready", "port": trainjob.ROLLOUT_PORT}
        assert sidecar["startupProbe"]["periodSeconds"] * sidecar["startupProbe"]["failureThreshold"] >= 600
        assert sidecar["securityContext"] == trainer["securityContext"]
        command = sidecar["command"]
        assert command[:4] == ["python", "-m", "components.trainjob", "serve-rollout"]
        args = make_parser().parse_args(["--model", "m", *command[4:]])  # the server's own parser takes them
        assert (args.host, args.port, args.max_model_len, args.dtype, args.data_parallel_size,
                args.gpu_memory_utilization) == ("127.0.0.1", trainjob.ROLLOUT_PORT, 256, "bfloat16", 2, 0.2)


def run_sidecar(sidecar: dict, names: tuple[str, ...], tmp_path, monkeypatch) -> list[str]:
    """Run the sidecar's command with its env `names` set, the model copy and the exec captured: the server's argv
    (after the interpreter), once the model was fetched to `tmp_path`."""
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    for name in names:
        monkeypatch.setenv(name, env[name])
    fetched, execs = [], []
    monkeypatch.setattr(trainjob.storage, "fetch_to_local", lambda uri: fetched.append(uri) or str(tmp_path))
    monkeypatch.setattr(trainjob.os, "execv", lambda path, argv: execs.append(argv))
    trainjob.main(sidecar["command"][3:])
    assert fetched == [INPUTS["model"]]
    ((python, *argv),) = execs
    assert python == sys.executable
    return argv


def test_the_sidecar_copies_the_model_then_becomes_the_server(tmp_path, monkeypatch):
    job, _ = two_node_grpo(job_kind="PyTorchJob", rollout_gpus=1)
    (sidecar,) = trainjob.pod_templates(job)[0]["spec"]["initContainers"]
    argv = run_sidecar(sidecar, (trainjob.CONFIG_ENV,), tmp_path, monkeypatch)
    assert argv == ["-m", "trainer.cli", "rollout-server", "--model", str(tmp_path), *sidecar["command"][4:]]


def test_rollout_gpus_run_the_server_as_the_sidecar_of_the_trainjobs_runtime(rollout_runtimes):
    """A TrainJob with rollout_gpus names the chart's runtime whose pods have the sidecar with those GPUs; its patch
    gives the sidecar the stage config and the server's options (ALIGNFLOW_ROLLOUT_ARGS), and the pod the operator
    builds (runtime + patch + trainer) has the same sidecar as a PyTorchJob's pod."""
    from trainer.rollout.server import make_parser

    options = {"max_prompt_length": 96, "max_completion_length": 160}
    job, multi = two_node_grpo(**TRAINJOB_SIDECAR, **options)
    assert job["spec"]["runtimeRef"] == {"name": "alignflow-rollout-2gpu"}
    assert job["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "4"  # the ranks' GPUs only
    (patch,) = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    (sidecar_patch,) = patch["template"]["spec"]["template"]["spec"]["initContainers"]
    assert set(sidecar_patch) == {"name", "env", "volumeMounts", "securityContext"}  # all a patch may set
    (template,) = trainjob.pod_templates(job, rollout_runtimes["alignflow-rollout-2gpu"])
    (trainer,) = template["spec"]["containers"]
    (sidecar,) = template["spec"]["initContainers"]
    stage = json.loads(next(e["value"] for e in trainer["env"] if e["name"] == trainjob.CONFIG_ENV))
    assert (stage["vllm_server_host"], stage["vllm_server_port"]) == ("127.0.0.1", trainjob.ROLLOUT_PORT)
    assert "vllm_server_devices" not in stage
    assert sidecar["name"] == "rollout-server" and sidecar["restartPolicy"] == "Always"
    assert sidecar["command"] == ["python", "-m", "components.trainjob", "serve-rollout"]
    assert sidecar["resources"] == multi.resources(2)  # the chart's defaults equal a PyTorchJob sidecar's
    for probe in ("startupProbe", "readinessProbe"):
        assert sidecar[probe]["httpGet"] == {"path": "/ready", "port": trainjob.ROLLOUT_PORT}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/health", "port": trainjob.ROLLOUT_PORT}
    assert sidecar["ports"] == [{"name": "rollout", "containerPort": trainjob.ROLLOUT_PORT}]
    assert sidecar["startupProbe"]["periodSeconds"] * sidecar["startupProbe"]["failureThreshold"] >= 600
    assert sidecar["securityContext"] == trainer["securityContext"]
    assert sidecar["volumeMounts"] == trainer["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert template["spec"]["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}]
    assert template["spec"]["automountServiceAccountToken"] is False  # the runtime's, which a patch cannot set
    env = {e["name"]: e for e in sidecar["env"]}
    assert [e for e in sidecar["env"] if e["name"] != trainjob.ROLLOUT_ARGS_ENV] == trainer["env"]
    args = make_parser().parse_args(["--model", "m", *shlex.split(env[trainjob.ROLLOUT_ARGS_ENV]["value"])])
    assert (args.host, args.port, args.max_model_len, args.dtype, args.data_parallel_size,
            args.gpu_memory_utilization) == ("127.0.0.1", trainjob.ROLLOUT_PORT, 256, "bfloat16", 2, 0.2)
    # The same server a PyTorchJob's sidecar starts.
    pytorchjob, _ = two_node_grpo(job_kind="PyTorchJob", rollout_gpus=2, **options)
    (pytorch_sidecar,) = trainjob.pod_templates(pytorchjob)[0]["spec"]["initContainers"]
    assert shlex.split(env[trainjob.ROLLOUT_ARGS_ENV]["value"]) == pytorch_sidecar["command"][4:]
    for key in ("restartPolicy", "resources", "ports", "startupProbe", "readinessProbe", "livenessProbe",
                "securityContext", "volumeMounts"):
        assert sidecar[key] == pytorch_sidecar[key], key


def test_pod_templates_need_the_runtime_of_a_patched_sidecar(rollout_runtimes):
    job, _ = two_node_grpo(**TRAINJOB_SIDECAR)
    with pytest.raises(ValueError, match="pass the runtime .alignflow-rollout-2gpu."):
        trainjob.pod_templates(job)
    with pytest.raises(ValueError, match="runs on alignflow-rollout-2gpu, not on alignflow-rollout-1gpu"):
        trainjob.pod_templates(job, rollout_runtimes["alignflow-rollout-1gpu"])


def test_the_trainjob_sidecar_reads_its_options_from_the_env_then_becomes_the_server(tmp_path, monkeypatch,
                                                                                     rollout_runtimes):
    """The runtime's sidecar runs `serve-rollout` with no arguments: the options come from ALIGNFLOW_ROLLOUT_ARGS."""
    job, _ = two_node_grpo(**TRAINJOB_SIDECAR)
    (sidecar,) = trainjob.pod_templates(job, rollout_runtimes["alignflow-rollout-2gpu"])[0]["spec"]["initContainers"]
    argv = run_sidecar(sidecar, (trainjob.CONFIG_ENV, trainjob.ROLLOUT_ARGS_ENV), tmp_path, monkeypatch)
    options = next(e["value"] for e in sidecar["env"] if e["name"] == trainjob.ROLLOUT_ARGS_ENV)
    assert argv == ["-m", "trainer.cli", "rollout-server", "--model", str(tmp_path), *shlex.split(options)]
    monkeypatch.delenv(trainjob.ROLLOUT_ARGS_ENV)
    with pytest.raises(SystemExit, match="no server options: give them as arguments or in ALIGNFLOW_ROLLOUT_ARGS"):
        trainjob.main(["serve-rollout"])


@pytest.mark.parametrize(("keys", "message"), [
    ({"job_kind": "TrainJob"}, r"`rollout_gpus: 1` on a TrainJob needs a runtime whose pods have the rollout-server "
                               r"sidecar .* but training_runtime is torch-distributed: set training_runtime "
                               r"alignflow-rollout-1gpu \(the chart's, with rolloutRuntimes.enabled and 1 in "
                               r"rolloutRuntimes.gpus\), or job_kind PyTorchJob"),
    ({"job_kind": "TrainJob", "training_runtime": "my-runtime"}, "but training_runtime is my-runtime: set "
                                                                 "training_runtime alignflow-rollout-1gpu"),
    ({"job_kind": "TrainJob", "training_runtime": "alignflow-rollout-2gpu"},
     r"`training_runtime: alignflow-rollout-2gpu` gives the rollout-server sidecar 2 GPU\(s\) .* but rollout_gpus "
     r"is 1: set training_runtime alignflow-rollout-1gpu \(with 1 in the chart's rolloutRuntimes.gpus\), or "
     r"rollout_gpus 2"),
    ({"job_kind": "TrainJob", "training_runtime": "alignflow-rollout-1gpu", "rollout_gpus": None},
     "`training_runtime: alignflow-rollout-1gpu` starts a rollout-server sidecar in every pod, which serves only "
     "with `rollout_gpus`.*: set rollout_gpus 1 and rollout_engine vllm-server, or training_runtime torch-distributed"),
    ({"job_kind": "TrainJob", "training_runtime": "alignflow-rollout-1gpu", "rollout_engine": "hf"},
     "the section's rollout_engine is hf: set rollout_engine vllm-server"),
    ({"rollout_engine": "hf"}, "the section's rollout_engine is hf: set rollout_engine vllm-server"),
    ({"vllm_server_host": "10.0.0.7"}, "starts each node's own server.*remove `vllm_server_host`"),
    ({"nodes": 1, "gpus_per_node": 2, "job_kind": None}, "`rollout_gpus` sets the pods of a multi-node job.*cluster.train.gpus"),
])
def test_rollout_gpus_refusals_say_what_to_change(keys, message):
    section = {"num_generations": 4, "nodes": 2, "job_kind": "PyTorchJob", "rollout_engine": "vllm-server",
               "rollout_gpus": 1, **keys}
    pipeline_config = pipeline_run.load_pipeline_config("pipelines/configs/demo.yaml", {
        "base_model": "unused", "grpo": {k: v for k, v in section.items() if v is not None}})
    with pytest.raises(ConfigError, match=message):
        pipeline_run.validate(pipeline_config, promotion=False)
