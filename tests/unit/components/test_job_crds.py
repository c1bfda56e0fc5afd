"""Multi-node jobs (components/trainjob.py) against the CRD schemas the Kubeflow projects publish.

Every TrainJob (Kubeflow Trainer v2.3.0, runtime patch included) and PyTorchJob (Training Operator
v1.9.4) the renderer makes, for every stage, on 2 and 3 nodes, with and without the vLLM server GPU, and
with the rollout server as a sidecar, validates against the vendored CRD's OpenAPI schema
(tests/data/crds/README.md) with jsonschema, unknown fields refused as the API server's strict field
validation refuses them (by default it drops them silently, which is worse: the manifest then does less
than it says). So do the chart's ClusterTrainingRuntimes with the sidecar (`helm template`), against the
ClusterTrainingRuntime CRD. The pod the operator will build is validated as a core Pod in
tests/unit/components/test_trainjob.py.
"""

import copy
import hashlib
import re

import pytest
import yaml

from components import inputs, trainjob
from tests.helpers import CRDS, crd_validator, schema_errors

STAGES = ("sft", "reward", "dpo", "grpo", "ppo")
INPUTS = {"model": "s3://bucket/run/sft/model", "dataset": "s3://bucket/data/train.jsonl",
          "output_dir": "s3://bucket/run/stage/model.staging"}
CRD_FILES = {"TrainJob": "trainer.kubeflow.org_trainjobs.yaml", "PyTorchJob": "kubeflow.org_pytorchjobs.yaml"}
RUNTIME_CRD = "trainer.kubeflow.org_clustertrainingruntimes.yaml"


@pytest.fixture(scope="module")
def validators():
    return {kind: crd_validator(name) for kind, name in CRD_FILES.items()}


def render(stage: str, kind: str, nodes: int, **keys):
    section = {"nodes": nodes, "gpus_per_node": 2, "job_kind": kind, **keys}
    config, multi, values = inputs.resolve_stage(stage, section, {}, **INPUTS)
    return trainjob.render(stage, config, values, multi, name=trainjob.job_name(stage))


def variants():
    for stage in STAGES:
        engines = ("hf", "vllm-server") if stage in ("grpo", "ppo") else (None,)
        for engine in engines:
            for nodes in (2, 3):  # (one node trains in the pipeline's task: no job, and resolve_stage refuses job keys)
                for kind in CRD_FILES:
                    keys = {"rollout_engine": engine, "vllm_gpu_memory_utilization": 0.3} if engine else {}
                    yield pytest.param(stage, kind, nodes, keys, id=f"{stage}-{engine or 'train'}-{nodes}node-{kind}")
        if engine:  # the rollout server as a sidecar container (a TrainJob's from its runtime)
            yield pytest.param(stage, "PyTorchJob", 2, {**keys, "rollout_gpus": 2},
                               id=f"{stage}-{engine}-sidecar-2node-PyTorchJob")
            yield pytest.param(stage, "TrainJob", 2, {**keys, "rollout_gpus": 2,
                                                      "training_runtime": trainjob.rollout_runtime(2)},
                               id=f"{stage}-{engine}-sidecar-2node-TrainJob")


@pytest.mark.parametrize(("stage", "kind", "nodes", "keys"), variants())
def test_rendered_jobs_validate_against_the_published_crds(validators, stage, kind, nodes, keys):
    job = render(stage, kind, nodes, node_selector={"pool": "h100"}, service_account="rel-alignflow", **keys)
    assert schema_errors(validators[kind], job) == []
    if kind == "TrainJob":
        # The CRD's CEL rules on the name (not evaluated by jsonschema): an RFC 1035 label of <= 63 characters.
        name = job["metadata"]["name"]
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name
    else:
        replicas = job["spec"]["pytorchReplicaSpecs"]
        assert set(replicas) == {"Master", "Worker"} and replicas["Worker"]["replicas"] == nodes - 1


def _container_names(pod_spec, field):
    return {c["name"] for c in pod_spec.get(field, [])}


@pytest.mark.parametrize("sidecar", [False, True], ids=["torch-distributed", "alignflow-rollout-2gpu"])
def test_the_runtime_patch_targets_the_runtimes_node_job_and_containers(sidecar, request):
    """The patch names a replicated job, containers and init containers that its runtime has: Kubeflow's
    `torch-distributed`, or the chart's alignflow-rollout-2gpu (a patch for a name the runtime lacks is refused by
    the Trainer's webhook). The chart's runtime keeps torch-distributed's job, container and torch policy."""
    upstream = yaml.safe_load((CRDS / "torch_distributed.yaml").read_text())
    assert upstream["metadata"]["name"] == trainjob.MultiNode().training_runtime
    keys = {"rollout_engine": "vllm-server", "rollout_gpus": 2, "training_runtime": "alignflow-rollout-2gpu"}
    runtime = request.getfixturevalue("rollout_runtimes")[keys["training_runtime"]] if sidecar else upstream
    assert runtime["spec"]["mlPolicy"] == upstream["spec"]["mlPolicy"]
    jobs = {j["name"]: j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    upstream_jobs = {j["name"]: j for j in upstream["spec"]["template"]["spec"]["replicatedJobs"]}
    assert jobs.keys() == upstream_jobs.keys()
    job = render("grpo", "TrainJob", 2, **(keys if sidecar else {}))
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    (patch,) = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert jobs[patch["name"]]["template"]["metadata"] == upstream_jobs[patch["name"]]["template"]["metadata"]
    have = jobs[patch["name"]]["template"]["spec"]["template"]["spec"]
    patched = patch["template"]["spec"]["template"]["spec"]
    for field in ("containers", "initContainers"):
        assert _container_names(patched, field) <= _container_names(have, field), field
    assert _container_names(patched, "initContainers") == ({trainjob.SIDECAR} if sidecar else set())


def test_the_charts_rollout_runtimes_validate_against_the_published_crd(rollout_runtimes):
    """`helm template` of the chart's runtimes against Trainer v2.3.0's ClusterTrainingRuntime CRD; so does the
    upstream torch-distributed runtime (the validator takes a real one), and a broken runtime fails, naming the path."""
    validator = crd_validator(RUNTIME_CRD)
    assert sorted(rollout_runtimes) == ["alignflow-rollout-1gpu", "alignflow-rollout-2gpu"]
    for runtime in rollout_runtimes.values():
        assert schema_errors(validator, runtime) == []
    assert schema_errors(validator, yaml.safe_load((CRDS / "torch_distributed.yaml").read_text())) == []
    broken = copy.deepcopy(rollout_runtimes["alignflow-rollout-1gpu"])
    pod = broken["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["initContainers"][0]["startupProbe"]["failureThreshold"] = "120"
    pod["initContainers"][0]["restartPolicyy"] = "Always"
    errors = "\n".join(schema_errors(validator, broken))
    assert "startupProbe.failureThreshold" in errors and "'restartPolicyy' was unexpected" in errors, errors


def _patch_spec(job):
    return job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize(("kind", "breaks", "where"), [
    # What the renderer put in every TrainJob's runtime patch until this test: the patch has no such field.
    ("TrainJob", lambda j: _patch_spec(j).update(automountServiceAccountToken=False), "automountServiceAccountToken"),
    ("TrainJob", lambda j: _patch_spec(j)["containers"][0].update(image="x"), "'image' was unexpected"),
    ("TrainJob", lambda j: j["spec"]["trainer"].update(numNodes="2"), "spec.trainer.numNodes"),
    ("TrainJob", lambda j: j["spec"].update(podTemplateOverrides=[]), "podTemplateOverrides"),  # Trainer < 2.2
    ("TrainJob", lambda j: j["spec"]["runtimeRef"].pop("name"), "'name' is a required property"),
    ("TrainJob", lambda j: j.update(apiVersion="kubeflow.org/v2alpha1"), "apiVersion"),
    ("PyTorchJob", lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas="1"), "replicas"),
    ("PyTorchJob", lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
        "resources"]["limits"].update(memory="lots"), "limits.memory"),
    ("PyTorchJob", lambda j: j["spec"]["runPolicy"].update(backoffLimit="0"), "runPolicy.backoffLimit"),
    ("PyTorchJob", lambda j: j["spec"].update(elasticPolicy={"maxRestart": 1, "rdzvBackends": "c10d"}),
     "elasticPolicy"),
])
def test_a_broken_manifest_fails(validators, kind, breaks, where):
    job = render("grpo", kind, 2, rollout_engine="vllm-server", vllm_gpu_memory_utilization=0.3)
    assert schema_errors(validators[kind], job) == []
    broken = copy.deepcopy(job)
    breaks(broken)
    errors = schema_errors(validators[kind], broken)
    assert errors and where in "\n".join(errors), errors


def test_the_vendored_files_are_the_upstream_blobs_the_readme_names():
    """Each file of tests/data/crds/README.md's table hashes to the git blob id recorded there (`git hash-object`)."""
    rows = re.findall(r"^\| `([^`]+)` \|.*\| ([0-9a-f]{40}) \|$", (CRDS / "README.md").read_text(), re.M)
    assert {name for name, _ in rows} == {p.name for p in CRDS.glob("*.yaml")}
    for name, blob in rows:
        data = (CRDS / name).read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, name
