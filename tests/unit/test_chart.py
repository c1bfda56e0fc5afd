"""charts/alignflow renders, lints and validates against the Kubernetes 1.30 and 1.33 schemas
(strict) for several value sets (its ClusterTrainingRuntimes against Kubeflow Trainer's CRD); the
upload Job ships the compiled pipeline; the schedule comes from values. Offline: helm-python-sdk
bundles Helm's Go SDK, kubernetes-validate its schemas."""

import base64
import json
import re
import runpy
import sys
import types
from pathlib import Path

import pytest
import yaml

from tests.helpers import CHART, by_kind, crd_validator, render_chart, schema_errors

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

KUBE_VERSIONS = ["1.30.0", "1.33.0"]
SECRETS = {"create": True, "s3": {"accessKeyId": "key", "secretAccessKey": "secret"},
           "mlflow": {"username": "admin", "password": "pw"}}
VALUE_SETS = {
    "defaults": {},
    "sqlite-seaweedfs-auth-schedule": {
        "secrets": SECRETS, "seaweedfs": {"enabled": True}, "mlflow": {"auth": {"enabled": True}},
        "kfp": {"recurringRun": {"enabled": True, "cron": "0 30 2 * * 1", "params": {"model_name": "m"}}}},
    "postgresql-external-s3": {
        "mlflow": {"backend": {"type": "postgresql"}}, "networkPolicy": {"enabled": False},
        "secrets": {**SECRETS, "s3": {**SECRETS["s3"], "endpointUrl": "https://s3.example.com"}},
        "nodeSelector": {"pool": "cpu"}, "tolerations": [{"key": "x", "operator": "Exists"}]},
    "nothing-but-rbac": {"mlflow": {"enabled": False}, "kfp": {"upload": {"enabled": False}}},
    "rollout-runtimes": {"rolloutRuntimes": {"enabled": True, "gpus": [1, 4], "accelerator": "amd.com/gpu"},
                         "runAsUser": 2000},
    "narrowed-network-existing-admin": {
        "mlflow": {"auth": {"existingSecret": "alignflow-mlflow"}, "extraAllowedHosts": ["mlflow.example.com"]},
        "networkPolicy": {
            "allowKfpComponents": False, "allowNamespaces": ["team-a", "team-b"],
            "extraIngressFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}],
            "egress": {"objectStore": {"cidrs": ["52.216.0.0/15"], "namespaces": ["kubeflow"], "ports": [443, 9000]},
                       "modelHub": {"cidrs": ["18.160.0.0/15"]}, "kubeApi": {"cidrs": ["10.0.0.1/32"]},
                       "extraTo": [{"to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}], "ports": [{"port": 3128}]}]}}},
}


def pod_specs(docs):
    return [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "Job")]


def test_lint_is_clean():
    for strict in (False, True):
        report = helm.lint(str(CHART), strict=strict, kube_version="v1.30.0")
        assert not report["errors"], report
        assert not [m for m in report["messages"] if m["severity"] >= 2], report


CUSTOM_RESOURCES = {"ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes.yaml"}


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_manifest_validates_strictly(name, version):
    """Core objects against Kubernetes' schemas, Kubeflow's against the CRDs in tests/data/crds."""
    docs = render_chart(VALUE_SETS[name])
    assert docs
    for doc in docs:
        if doc["kind"] in CUSTOM_RESOURCES:
            assert schema_errors(crd_validator(CUSTOM_RESOURCES[doc["kind"]]), doc) == [], doc["metadata"]["name"]
        else:
            kubernetes_validate.validate(doc, version, strict=True)


def test_rollout_runtimes_are_one_per_gpu_count_from_values():
    """Off by default (cluster-scoped, and needs Kubeflow Trainer's CRDs); on: one ClusterTrainingRuntime per GPU
    count, named as components/trainjob.py's rollout_runtime names it, with the GPUs, CPUs and memory of the values,
    the port and probes the launcher expects, the pods' uid, and no API token. A count below 1 fails the render."""
    from components import trainjob

    assert not by_kind(render_chart({}), "ClusterTrainingRuntime")
    runtimes = by_kind(render_chart(VALUE_SETS["rollout-runtimes"]), "ClusterTrainingRuntime")
    assert [r["metadata"]["name"] for r in runtimes] == [trainjob.rollout_runtime(1), trainjob.rollout_runtime(4)]
    for gpus, runtime in zip((1, 4), runtimes):
        assert trainjob.runtime_gpus(runtime["metadata"]["name"]) == gpus
        (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
        pod = job["template"]["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsUser"] == 2000
        (sidecar,) = pod["initContainers"]
        assert sidecar["name"] == trainjob.SIDECAR and sidecar["restartPolicy"] == "Always"
        assert sidecar["resources"] == {
            "requests": {"cpu": str(8 * gpus), "memory": f"{32 * gpus}Gi", "amd.com/gpu": str(gpus)},
            "limits": {"memory": f"{32 * gpus}Gi", "amd.com/gpu": str(gpus)}}
        assert sidecar["ports"] == [{"name": "rollout", "containerPort": trainjob.ROLLOUT_PORT}]
        assert {sidecar[p]["httpGet"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {
            trainjob.ROLLOUT_PORT}
        assert sidecar["image"] == "ghcr.io/alignflow/trainer:0.1.0"
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError, match="rolloutRuntimes.gpus: 0"):
        chart.render({"rolloutRuntimes": {"enabled": True, "gpus": [0]}}, name="rel", namespace="ml", is_install=True)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_pods_are_locked_down_and_request_resources(name):
    for spec in pod_specs(render_chart(VALUE_SETS[name])):
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert container["resources"]["requests"]


def test_components_are_selectable():
    default = render_chart({})
    assert [d["metadata"]["name"] for d in by_kind(default, "Deployment")] == ["rel-alignflow-mlflow"]
    assert [d["metadata"]["name"] for d in by_kind(default, "Secret")] == ["rel-alignflow-mlflow-auth"]
    full = render_chart(VALUE_SETS["sqlite-seaweedfs-auth-schedule"])
    assert {d["metadata"]["name"] for d in by_kind(full, "Deployment")} == {
        "rel-alignflow-mlflow", "rel-alignflow-seaweedfs"}
    assert {d["metadata"]["name"] for d in by_kind(full, "Secret")} == {
        "alignflow-s3", "alignflow-mlflow", "rel-alignflow-mlflow-auth"}
    s3 = next(d for d in by_kind(full, "Secret") if d["metadata"]["name"] == "alignflow-s3")
    assert s3["stringData"]["AWS_ENDPOINT_URL"] == "http://rel-alignflow-seaweedfs:8333"
    assert {d["metadata"]["name"] for d in by_kind(full, "NetworkPolicy")} == {
        "rel-alignflow-mlflow", "rel-alignflow-seaweedfs", "rel-alignflow-egress", "rel-alignflow-egress-steps"}
    assert not by_kind(render_chart(VALUE_SETS["postgresql-external-s3"]), "NetworkPolicy")


def test_hf_token_secret_only_when_a_token_is_given():
    """secrets.hf.token makes the alignflow-hf Secret the pipeline's training steps read HF_TOKEN from; without a
    token there is none (the steps' reference is optional), and the token appears in that Secret only."""
    values = VALUE_SETS["sqlite-seaweedfs-auth-schedule"]
    assert "alignflow-hf" not in {d["metadata"]["name"] for d in by_kind(render_chart(values), "Secret")}
    token = "hf_t0ken-that-must-not-leak"
    docs = render_chart({**values, "secrets": {**values["secrets"], "hf": {"token": token}}})
    (hf,) = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == "alignflow-hf"]
    assert hf["stringData"] == {"HF_TOKEN": token}
    kubernetes_validate.validate(hf, "1.30.0", strict=True)
    assert [d["metadata"]["name"] for d in docs if token in json.dumps(d)] == ["alignflow-hf"]


def test_registry_secret_is_a_docker_config_only_when_a_registry_is_given():
    values = VALUE_SETS["sqlite-seaweedfs-auth-schedule"]
    assert "alignflow-registry" not in {d["metadata"]["name"] for d in by_kind(render_chart(values), "Secret")}
    registry = {"server": "registry.example.com", "username": "robot", "password": "pa55"}
    docs = render_chart({**values, "secrets": {**values["secrets"], "registry": registry}})
    (secret,) = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == "alignflow-registry"]
    assert secret["type"] == "kubernetes.io/dockerconfigjson"
    kubernetes_validate.validate(secret, "1.30.0", strict=True)
    config = json.loads(base64.b64decode(secret["data"][".dockerconfigjson"]))
    assert config == {"auths": {"registry.example.com": {"username": "robot", "password": "pa55",
                                                          "auth": base64.b64encode(b"robot:pa55").decode()}}}


def mlflow_container(docs):
    deployment = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-mlflow"))
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_mlflow_backend_and_auth():
    sqlite = mlflow_container(render_chart({}))
    env = {e["name"]: e for e in sqlite["env"]}
    assert env["BACKEND_STORE_URI"]["value"] == "sqlite:////data/mlflow.db"
    assert "--app-name basic-auth" in sqlite["args"][0]
    assert "--app-name basic-auth" not in mlflow_container(render_chart({"mlflow": {"auth": {"enabled": False}}}))["args"][0]
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "alignflow-s3"

    pg = mlflow_container(render_chart(VALUE_SETS["postgresql-external-s3"]))
    ref = {e["name"]: e for e in pg["env"]}["BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "alignflow-mlflow-db", "key": "uri"}
    assert not by_kind(render_chart(VALUE_SETS["postgresql-external-s3"]), "PersistentVolumeClaim")

    auth = mlflow_container(render_chart(VALUE_SETS["sqlite-seaweedfs-auth-schedule"]))
    assert "--app-name basic-auth" in auth["args"][0]
    assert "MLFLOW_AUTH_CONFIG_PATH" in auth["args"][0]

    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError, match="sqlite or postgresql"):
        chart.render({"mlflow": {"backend": {"type": "mysql"}}}, name="rel", namespace="ml")


def upload_config(docs) -> dict:
    return next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "rel-alignflow-upload")["data"]


def test_upload_job_carries_the_compiled_pipeline():
    docs = render_chart({})
    shipped = (CHART / "files" / "post_training.yaml").read_text()
    assert upload_config(docs)["post_training.yaml"].strip() == shipped.strip()
    job = by_kind(docs, "Job")[0]
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/alignflow/tools:0.1.0"
    assert "post_training.yaml" in " ".join(job["spec"]["template"]["spec"]["containers"][0]["command"])


def test_shipped_pipeline_equals_a_fresh_compile(tmp_path, monkeypatch):
    for var in ("ALIGNFLOW_IMAGE_REGISTRY", "ALIGNFLOW_IMAGE_TAG", "ALIGNFLOW_TRAINER_IMAGE", "ALIGNFLOW_TOOLS_IMAGE"):
        monkeypatch.delenv(var, raising=False)
    from pipelines.run import compile_pipeline

    fresh = Path(compile_pipeline(str(tmp_path / "p.yaml"))).read_text()
    shipped = (CHART / "files" / "post_training.yaml").read_text()
    assert fresh == shipped, "regenerate: alignflow pipeline compile --out charts/alignflow/files/post_training.yaml"


def test_recurring_run_comes_from_values():
    settings = json.loads(upload_config(render_chart(VALUE_SETS["sqlite-seaweedfs-auth-schedule"]))["settings.json"])
    rr = settings["recurring_run"]
    assert rr["enabled"] is True and rr["cron"] == "0 30 2 * * 1" and rr["params"] == {"model_name": "m"}
    assert json.loads(upload_config(render_chart({}))["settings.json"])["recurring_run"]["enabled"] is False


def test_upload_script_against_a_fake_kfp(tmp_path, monkeypatch):
    """files/upload_pipeline.py adds a version to an existing pipeline and replaces the schedule."""
    calls = []

    class Obj(types.SimpleNamespace):
        pass

    class FakeClient:
        def __init__(self, host, namespace=None):
            calls.append(("client", host))

        def get_pipeline_id(self, name):
            return "p1"

        def upload_pipeline_version(self, path, pipeline_version_name, pipeline_id):
            calls.append(("version", pipeline_version_name, Path(path).read_text()))
            return Obj(pipeline_version_id="v2")

        def create_experiment(self, name, namespace=None):
            return Obj(experiment_id="e1")

        def list_recurring_runs(self, experiment_id, page_size):
            return Obj(recurring_runs=[Obj(display_name="alignflow-nightly", recurring_run_id="old"),
                                       Obj(display_name="other", recurring_run_id="keep")])

        def delete_recurring_run(self, run_id):
            calls.append(("delete", run_id))

        def create_recurring_run(self, **kwargs):
            calls.append(("schedule", kwargs))

    data = upload_config(render_chart(VALUE_SETS["sqlite-seaweedfs-auth-schedule"]))
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setitem(sys.modules, "kfp", types.SimpleNamespace(Client=FakeClient))
    monkeypatch.setattr(sys, "argv", ["x", str(tmp_path / "settings.json"), str(tmp_path / "post_training.yaml")])
    runpy.run_path(str(tmp_path / "upload_pipeline.py"), run_name="__main__")
    assert calls[0] == ("client", "http://ml-pipeline.kubeflow.svc.cluster.local:8888")
    assert calls[1][1] == "0.1.0-r1" and "alignflow-post-training" in calls[1][2]
    assert ("delete", "old") in calls and ("delete", "keep") not in calls
    schedule = calls[-1][1]
    assert schedule["cron_expression"] == "0 30 2 * * 1" and schedule["version_id"] == "v2"
    assert schedule["params"] == {"model_name": "m"} and schedule["pipeline_id"] == "p1"


def test_image_defaults_match_components_images(monkeypatch):
    for var in ("ALIGNFLOW_IMAGE_REGISTRY", "ALIGNFLOW_IMAGE_TAG"):
        monkeypatch.delenv(var, raising=False)
    import importlib

    import components.images as images

    images = importlib.reload(images)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["registry"] == images.REGISTRY and values["image"]["tag"] == images.TAG


def test_every_value_is_documented():
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][A-Za-z0-9]*):\s*(\S.*)?$", line)
        if not m or m.group(2) in ("requests", "limits") or not m.group(3):
            continue  # block mappings are documented by their children
        if not lines[i - 1].lstrip().startswith("#"):
            undocumented.append(m.group(2))
    assert not undocumented, undocumented


# ----------------------------------------------------------------------------------------------
# Security (issue 15): MLflow auth, allowed hosts, NetworkPolicies, tokens


def secret_value(docs, name: str, key: str) -> str:
    secret = next(d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == name)
    if key in secret.get("stringData", {}):
        return secret["stringData"][key]
    return base64.b64decode(secret["data"][key]).decode()


def test_auth_is_on_by_default_with_a_generated_admin_password():
    docs = render_chart({})
    env = {e["name"]: e for e in mlflow_container(docs)["env"]}
    ref = env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "rel-alignflow-mlflow-auth", "key": "MLFLOW_TRACKING_PASSWORD"}
    password = secret_value(docs, "rel-alignflow-mlflow-auth", "MLFLOW_TRACKING_PASSWORD")
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)
    flask_key = secret_value(docs, "rel-alignflow-mlflow-auth", "MLFLOW_FLASK_SERVER_SECRET_KEY")
    assert re.fullmatch(r"[A-Za-z0-9]{32}", flask_key) and flask_key != password
    assert env["MLFLOW_FLASK_SERVER_SECRET_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "rel-alignflow-mlflow-auth"
    assert secret_value(docs, "rel-alignflow-mlflow-auth", "MLFLOW_TRACKING_USERNAME") == "admin"
    # Random per install (no cluster to read it back from here; on upgrade `lookup` returns the old one).
    assert secret_value(render_chart({}), "rel-alignflow-mlflow-auth", "MLFLOW_TRACKING_PASSWORD") != password
    # The password reaches MLflow as MLFLOW_AUTH_ADMIN_PASSWORD, never written into the ini file.
    script = mlflow_container(docs)["args"][0]
    assert 'MLFLOW_AUTH_ADMIN_PASSWORD="${MLFLOW_TRACKING_PASSWORD}"' in script and "admin_password" not in script


def test_the_pipeline_secret_gets_the_same_admin_credentials():
    docs = render_chart({"secrets": {**SECRETS, "mlflow": {}}})
    admin = secret_value(docs, "rel-alignflow-mlflow-auth", "MLFLOW_TRACKING_PASSWORD")
    assert secret_value(docs, "alignflow-mlflow", "MLFLOW_TRACKING_PASSWORD") == admin
    assert secret_value(docs, "alignflow-mlflow", "MLFLOW_TRACKING_USERNAME") == "admin"
    given = render_chart({"mlflow": {"auth": {"adminPassword": "twelve-chars-or-more"}}})
    assert secret_value(given, "rel-alignflow-mlflow-auth", "MLFLOW_TRACKING_PASSWORD") == "twelve-chars-or-more"


def test_an_existing_admin_secret_replaces_the_generated_one():
    docs = render_chart({"mlflow": {"auth": {"existingSecret": "alignflow-mlflow"}}})
    (own,) = by_kind(docs, "Secret")
    assert set(own["data"]) == {"MLFLOW_FLASK_SERVER_SECRET_KEY"}  # no admin of its own
    env = {e["name"]: e for e in mlflow_container(docs)["env"]}
    assert env["MLFLOW_TRACKING_USERNAME"]["valueFrom"]["secretKeyRef"]["name"] == "alignflow-mlflow"
    assert env["MLFLOW_FLASK_SERVER_SECRET_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "rel-alignflow-mlflow-auth"


def test_a_short_admin_password_is_refused_at_render():
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError, match="mlflow.auth.adminPassword"):
        chart.render({"mlflow": {"auth": {"adminPassword": "short"}}}, name="rel", namespace="ml")


def allowed_hosts(docs) -> list[str]:
    return re.search(r'--allowed-hosts "([^"]+)"', mlflow_container(docs)["args"][0]).group(1).split(",")


def test_allowed_hosts_are_the_service_names():
    hosts = allowed_hosts(render_chart({"mlflow": {"extraAllowedHosts": ["mlflow.example.com"]}}))
    assert "*" not in hosts and "'*'" not in hosts
    for name in ("rel-alignflow-mlflow", "rel-alignflow-mlflow.ml", "rel-alignflow-mlflow.ml.svc",
                 "rel-alignflow-mlflow.ml.svc.cluster.local"):
        assert name in hosts and f"{name}:5000" in hosts
    assert {"localhost:*", "127.0.0.1:*", "mlflow.example.com"} <= set(hosts)
    assert all(h.endswith(":*") or "*" not in h for h in hosts)
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError, match="extraAllowedHosts"):
        chart.render({"mlflow": {"extraAllowedHosts": ["*"]}}, name="rel", namespace="ml")


def policy(docs, name: str) -> dict:
    return next(d for d in by_kind(docs, "NetworkPolicy") if d["metadata"]["name"] == name)["spec"]


def test_only_labelled_pods_reach_mlflow():
    from components.settings import MLFLOW_CLIENT_LABEL

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["networkPolicy"]["clientLabel"] == MLFLOW_CLIENT_LABEL[0] and MLFLOW_CLIENT_LABEL[1] == "true"
    label, kfp = {MLFLOW_CLIENT_LABEL[0]: "true"}, {"pipelines.kubeflow.org/v2_component": "true"}
    (rule,) = policy(render_chart({}), "rel-alignflow-mlflow")["ingress"]
    assert rule["ports"] == [{"port": 5000, "protocol": "TCP"}]
    for peer in rule["from"]:  # never a whole namespace, never every pod
        assert peer["podSelector"]["matchLabels"] in (label, kfp), peer
    assert {"podSelector": {"matchLabels": label}} in rule["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kubeflow"}},
            "podSelector": {"matchLabels": label}} in rule["from"]

    extra = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    docs = render_chart({"networkPolicy": {"allowKfpComponents": False, "allowNamespaces": [],
                                           "extraIngressFrom": [extra]}})
    (rule,) = policy(docs, "rel-alignflow-mlflow")["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": label}}, extra]


def test_egress_of_labelled_pods_is_limited():
    docs = render_chart({"seaweedfs": {"enabled": True}})
    pods = policy(docs, "rel-alignflow-egress")
    assert pods["podSelector"] == {"matchLabels": {"alignflow.io/mlflow-client": "true"}}
    assert pods["policyTypes"] == ["Egress"]
    rules = pods["egress"]
    assert rules[0] == {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
    for rule in rules[1:]:
        assert rule.get("to"), rule  # no rule that opens every destination
    ports = {p["port"] for rule in rules for p in rule.get("ports", [])}
    assert {5000, 8333, 443} <= ports and 6443 not in ports  # the kube API is for pipeline steps only
    outside = [rule for rule in rules if any("ipBlock" in peer for peer in rule.get("to", []))]
    assert outside == [{"ports": [{"port": 443, "protocol": "TCP"}], "to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}]
    steps = policy(docs, "rel-alignflow-egress-steps")
    assert steps["podSelector"]["matchLabels"] == {"alignflow.io/mlflow-client": "true",
                                                   "pipelines.kubeflow.org/v2_component": "true"}
    assert {"port": 6443, "protocol": "TCP"} in steps["egress"][1]["ports"]

    # A narrowed object store shuts the model hub out unless it is configured.
    narrow = {"networkPolicy": {"egress": {"objectStore": {"cidrs": ["52.216.0.0/15"]}}}}
    cidrs = [p["ipBlock"]["cidr"] for r in policy(render_chart(narrow), "rel-alignflow-egress")["egress"]
             for p in r.get("to", []) if "ipBlock" in p]
    assert cidrs == ["52.216.0.0/15"]
    narrow["networkPolicy"]["egress"]["modelHub"] = {"cidrs": ["18.160.0.0/15"]}
    cidrs = [p["ipBlock"]["cidr"] for r in policy(render_chart(narrow), "rel-alignflow-egress")["egress"]
             for p in r.get("to", []) if "ipBlock" in p]
    assert sorted(cidrs) == ["18.160.0.0/15", "52.216.0.0/15"]
    minio = {"networkPolicy": {"egress": {"objectStore": {"cidrs": [], "namespaces": ["kubeflow"], "ports": [9000]}}}}
    (store,) = [r for r in policy(render_chart(minio), "rel-alignflow-egress")["egress"] if r.get("ports") == [
        {"port": 9000, "protocol": "TCP"}]]
    assert store["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kubeflow"}}}]
    assert not [d for d in by_kind(render_chart({"networkPolicy": {"egress": {"enabled": False}}}), "NetworkPolicy")
                if "egress" in d["metadata"]["name"]]
    bare = render_chart({"networkPolicy": {"egress": {"kfpNamespaces": [], "kubeApi": {"cidrs": []}}}})
    assert "rel-alignflow-egress-steps" not in {d["metadata"]["name"] for d in by_kind(bare, "NetworkPolicy")}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_no_pod_of_the_chart_gets_an_api_token(name):
    docs = render_chart(VALUE_SETS[name])
    for account in by_kind(docs, "ServiceAccount"):
        assert account["automountServiceAccountToken"] is False
    for spec in pod_specs(docs):
        assert spec["automountServiceAccountToken"] is False


def test_every_pipeline_task_carries_the_mlflow_label_and_runs_as_non_root(tmp_path, monkeypatch):
    from components.settings import MLFLOW_CLIENT_LABEL, RUN_AS_USER
    from pipelines.run import compile_pipeline

    _, platform = yaml.safe_load_all(Path(compile_pipeline(str(tmp_path / "p.yaml"))).read_text())
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert len(executors) >= 8
    for name, executor in executors.items():
        assert executor["podMetadata"]["labels"][MLFLOW_CLIENT_LABEL[0]] == MLFLOW_CLIENT_LABEL[1], name
        sc = executor["securityContext"]
        assert sc["runAsNonRoot"] is True and int(sc["runAsUser"]) == RUN_AS_USER == int(sc["runAsGroup"]), name
