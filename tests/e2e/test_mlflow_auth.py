"""The chart's MLflow server, started here with the chart's own startup script and generated admin
Secret: an anonymous client cannot move `@champion`, a READ-only user cannot either, the admin can,
and a request with a Host header outside `--allowed-hosts` is refused.

Real parts: `helm template` output (helm-python-sdk), `mlflow server --app-name basic-auth` on
127.0.0.1 with sqlite stores, and the MlflowClient the pipeline uses. Only the bind address
(0.0.0.0 in the pod) and the stores (a PVC and S3 in the pod) are local.

The admin's requests are few on purpose: each one the server has not cached costs a slow password
hash (seconds on a busy machine).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import by_kind, render_chart
from tests.servers import MLFLOW_START_TIMEOUT_S, _health_ok, _log_tail, _stop, free_ports

pytest.importorskip("helm_python")
# MLflow's basic-auth app needs mlflow[auth] (Flask-WTF), as images/mlflow/requirements.txt installs.
# Looked up, not imported: Flask's context proxies in sys.modules break the module scan vLLM runs when an
# engine starts in this process (`hasattr` on them raises RuntimeError: "Working outside of application context").
if importlib.util.find_spec("flask_wtf") is None:
    pytest.skip("pip install 'mlflow[auth]' (Flask-WTF) to start the basic-auth app", allow_module_level=True)

MODEL = "alignflow-policy"


def _chart_server(root: Path):
    """(the rendered startup script, its environment, the tracking URI, the admin password)."""
    (port,) = free_ports(1)
    docs = render_chart({"mlflow": {"port": port, "workers": 1, "artifacts": {"destination": str(root / "artifacts")}}})
    deployment = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "rel-alignflow-mlflow")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    script = container["args"][0]
    assert "--host 0.0.0.0" in script
    script = script.replace("--host 0.0.0.0", "--host 127.0.0.1")  # not every interface of a shared machine
    secret = next(d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == "rel-alignflow-mlflow-auth")
    creds = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_"))}
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})  # the chart's literal settings
    env.update(creds, HOME=str(root), OMP_WAIT_POLICY="PASSIVE",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]]),
               BACKEND_STORE_URI=f"sqlite:///{root / 'mlflow.db'}",
               AUTH_DATABASE_URI=f"sqlite:///{root / 'basic_auth.db'}")
    return container["command"], script, env, f"http://127.0.0.1:{port}", creds


@pytest.fixture(scope="module")
def chart_mlflow(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-auth")
    command, script, env, uri, creds = _chart_server(root)
    log = root / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*command, script], cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + MLFLOW_START_TIMEOUT_S
        while not _health_ok(uri):
            if proc.poll() is not None:
                raise RuntimeError(f"the chart's MLflow script exited with {proc.returncode}:\n{_log_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no /health within {MLFLOW_START_TIMEOUT_S} s:\n{_log_tail(log)}")
            time.sleep(0.5)
        yield uri, creds
    finally:
        _stop(proc, signal.SIGTERM)


def _client(uri: str, monkeypatch, user: str | None, password: str | None):
    from mlflow import MlflowClient

    for var, value in (("MLFLOW_TRACKING_USERNAME", user), ("MLFLOW_TRACKING_PASSWORD", password)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _status(uri: str, path: str, host: str, user: str, password: str) -> int:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    request = urllib.request.Request(uri + path, headers={"Host": host, "Authorization": f"Basic {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_only_the_admin_moves_the_champion(chart_mlflow, monkeypatch):
    from mlflow.exceptions import MlflowException

    uri, creds = chart_mlflow
    admin_user, admin_password = creds["MLFLOW_TRACKING_USERNAME"], creds["MLFLOW_TRACKING_PASSWORD"]
    admin = _client(uri, monkeypatch, admin_user, admin_password)
    admin.create_registered_model(MODEL)
    version = admin.create_model_version(MODEL, source="s3://alignflow/pipelines/run-1/grpo/model")
    admin.set_registered_model_alias(MODEL, "champion", version.version)
    # The basic-auth app's REST call, not `mlflow.server.get_app_client`: importing mlflow.server loads Flask,
    # whose context proxies break every in-process vLLM engine started later in this pytest process.
    token = base64.b64encode(f"{admin_user}:{admin_password}".encode()).decode()
    request = urllib.request.Request(uri + "/api/2.0/mlflow/users/create", method="POST",
                                     data=json.dumps({"username": "reader", "password": "reader-password-123"}).encode(),
                                     headers={"Authorization": f"Basic {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200

    anonymous = _client(uri, monkeypatch, None, None)
    with pytest.raises(MlflowException) as refused:
        anonymous.set_registered_model_alias(MODEL, "champion", version.version)
    assert "401" in str(refused.value) or "Unauthorized" in str(refused.value)
    wrong = _client(uri, monkeypatch, admin_user, "not-the-password")
    with pytest.raises(MlflowException, match="401|Unauthorized"):
        wrong.delete_registered_model_alias(MODEL, "champion")
    reader = _client(uri, monkeypatch, "reader", "reader-password-123")
    assert reader.get_registered_model(MODEL).aliases == {"champion": version.version}  # READ by default
    with pytest.raises(MlflowException, match="403|PERMISSION_DENIED|Permission denied"):
        reader.delete_registered_model_alias(MODEL, "champion")

    admin = _client(uri, monkeypatch, admin_user, admin_password)
    assert admin.get_registered_model(MODEL).aliases == {"champion": version.version}
    admin.delete_registered_model_alias(MODEL, "champion")
    assert admin.get_registered_model(MODEL).aliases == {}


def test_host_headers_outside_the_service_names_are_refused(chart_mlflow):
    assert "flask" not in sys.modules, "Flask in this process breaks in-process vLLM engines of later tests"
    uri, creds = chart_mlflow
    port = uri.rsplit(":", 1)[1]
    path = "/api/2.0/mlflow/registered-models/search"
    user, password = creds["MLFLOW_TRACKING_USERNAME"], creds["MLFLOW_TRACKING_PASSWORD"]
    assert _status(uri, path, f"rel-alignflow-mlflow.ml.svc:{port}", user, password) == 200
    assert _status(uri, path, f"localhost:{port}", user, password) == 200
    assert _status(uri, path, f"attacker.example.com:{port}", user, password) == 403
    assert _status(uri, path, f"rel-alignflow-mlflow.other-ns:{port}", user, password) == 403
