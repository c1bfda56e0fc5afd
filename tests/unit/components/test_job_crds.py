"""Multi-node jobs (components/trainjob.py) against the CRD schemas the Kubeflow projects publish.

Every TrainJob (Kubeflow Trainer v2.3.0, runtime patch included) and PyTorchJob (Training Operator
v1.9.4) the renderer makes, for every stage, on 1 and 2 nodes, with and without the vLLM server GPU,
validates against the vendored CRD's OpenAPI schema (tests/data/crds/README.md) with jsonschema, unknown
fields refused as the API server's strict field validation refuses them (by default it drops them
silently, which is worse: the manifest then does less than it says). The pod the operator will build
is validated as a core Pod in tests/unit/components/test_trainjob.py.
"""

import copy
import re

import pytest
import yaml

from components import inputs, trainjob
from tests.helpers import CRDS, crd_validator, schema_errors

STAGES = ("sft", "reward", "dpo", "grpo", "ppo")
INPUTS = {"model": "s3://bucket/run/sft/model", "dataset": "s3://bucket/data/train.jsonl",
          "output_dir": "s3://bucket/run/stage/model.staging"}
CRD_FILES = {"TrainJob": "trainer.kubeflow.org_trainjobs.yaml", "PyTorchJob": "kubeflow.org_pytorchjobs.yaml"}


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
        if engine:  # the rollout server as a sidecar container (PyTorchJob only)
            yield pytest.param(stage, "PyTorchJob", 2, {**keys, "rollout_gpus": 2},
                               id=f"{stage}-{engine}-sidecar-2node-PyTorchJob")


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


def test_the_runtime_patch_targets_the_runtimes_node_job_and_container():
    """The patch names a replicated job and a container that Kubeflow's `torch-distributed` runtime has
    (a patch for a name the runtime lacks is refused by the Trainer's webhook)."""
    runtime = yaml.safe_load((CRDS / "torch_distributed.yaml").read_text())
    assert runtime["metadata"]["name"] == trainjob.MultiNode().training_runtime
    jobs = {j["name"]: j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    job = render("grpo", "TrainJob", 2)
    (patch,) = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    containers = {c["name"] for c in jobs[patch["name"]]["template"]["spec"]["template"]["spec"]["containers"]}
    assert {c["name"] for c in patch["template"]["spec"]["template"]["spec"]["containers"]} <= containers


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
