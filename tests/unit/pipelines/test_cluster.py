"""`alignflow pipeline submit|schedule` as a user of multi-user Kubeflow, against a local stand-in for the
KFP v2beta1 REST API that refuses requests without the right bearer token or outside the user's namespace."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from pipelines import cli
from tests.helpers import serve_in_thread

DEMO = "pipelines/configs/demo.yaml"
TOKEN = "sa-token-abc123"
NAMESPACE = "kubeflow-user-team-a"


class KfpStandIn(ThreadingHTTPServer):
    """What the KFP API server does for the calls `submit` and `schedule` make, with multi-user checks."""

    def __init__(self, final_state: str = "SUCCEEDED"):
        super().__init__(("127.0.0.1", 0), Handler)
        self.final_state = final_state
        self.requests: list[tuple[str, str, dict, dict]] = []  # (method, path, query, body)
        self.experiments: dict[str, dict] = {}
        self.runs: dict[str, dict] = {}
        self.recurring: dict[str, dict] = {}
        self.polls = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: KfpStandIn

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}") if length else {}
        self.server.requests.append((method, url.path, query, body))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._reply(401, {"error": "Unauthenticated: bad or missing bearer token", "code": 16})
        route = (method, url.path)
        if route == ("GET", "/apis/v2beta1/experiments"):
            if query.get("namespace") != NAMESPACE:
                return self._reply(403, {"error": f"no access to namespace {query.get('namespace')}", "code": 7})
            return self._reply(200, {"experiments": list(self.server.experiments.values())})
        if route == ("POST", "/apis/v2beta1/experiments"):
            if body.get("namespace") != NAMESPACE:
                return self._reply(403, {"error": f"no access to namespace {body.get('namespace')}", "code": 7})
            experiment = {**body, "experiment_id": f"exp-{len(self.server.experiments) + 1}"}
            self.server.experiments[experiment["experiment_id"]] = experiment
            return self._reply(200, experiment)
        if route == ("POST", "/apis/v2beta1/runs"):
            if body.get("experiment_id") not in self.server.experiments:
                return self._reply(400, {"error": "unknown experiment", "code": 3})
            run = {**body, "run_id": f"run-{len(self.server.runs) + 1}", "state": "PENDING"}
            self.server.runs[run["run_id"]] = run
            return self._reply(200, run)
        if method == "GET" and url.path.startswith("/apis/v2beta1/runs/"):
            run = self.server.runs[url.path.rsplit("/", 1)[1]]
            self.server.polls += 1
            run["state"] = "RUNNING" if self.server.polls < 3 else self.server.final_state
            if run["state"] == "FAILED":
                run["error"] = {"message": "task sft failed: CUDA out of memory", "code": 13}
            return self._reply(200, run)
        if route == ("POST", "/apis/v2beta1/recurringruns"):
            if body.get("experiment_id") not in self.server.experiments:
                return self._reply(400, {"error": "unknown experiment", "code": 3})
            job = {**body, "recurring_run_id": f"rr-{len(self.server.recurring) + 1}"}
            self.server.recurring[job["recurring_run_id"]] = job
            return self._reply(200, job)
        return self._reply(404, {"error": f"no route {method} {url.path}", "code": 5})

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")


def training_caching(run: dict) -> list[bool]:
    """Whether each training task of a submitted run may be served from KFP's cache."""
    spec = run["pipeline_spec"]["pipeline_spec"]
    dags = [spec["root"], *spec["components"].values()]
    return [task.get("cachingOptions", {}).get("enableCache", False) for dag in dags if "dag" in dag
            for task in dag["dag"]["tasks"].values()
            if task["componentRef"]["name"] in ("comp-sft", "comp-reward-model", "comp-grpo", "comp-dpo")]


@pytest.fixture
def kfp_api(monkeypatch, tmp_path):
    from kfp.client import client

    # The client reads ~/.config/kfp/context.json when it exists; a developer's must not leak in.
    monkeypatch.setattr(client.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "no-context.json"))
    monkeypatch.delenv("ALIGNFLOW_KFP_TOKEN", raising=False)
    servers = []

    def start(final_state: str = "SUCCEEDED") -> KfpStandIn:
        server = KfpStandIn(final_state)
        serve_in_thread(server)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def config(tmp_path, tiny_model):
    path = tmp_path / "cluster.yaml"
    path.write_text(open(DEMO).read().replace("base_model: demo-output/tiny-model", f"base_model: {tiny_model}"))
    return str(path)


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


def test_submit_in_a_namespace_with_a_token_file_and_wait(kfp_api, config, token_file, capsys):
    api = kfp_api()
    code = cli.main(["pipeline", "submit", "--host", api.url, "--config", config, "--namespace", NAMESPACE,
                     "--token-file", token_file, "--run-name", "nightly-sft", "--wait", "--poll-seconds", "0.01"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"{api.url}/#/runs/details/run-1" in out
    assert "Run run-1 ended: SUCCEEDED" in out
    # Every call carried the token and stayed in the user's namespace.
    assert api.requests and all(path.startswith("/apis/v2beta1/") for _, path, _, _ in api.requests)
    (experiment,) = api.experiments.values()
    assert experiment["namespace"] == NAMESPACE and experiment["display_name"] == "alignflow"
    run = api.runs["run-1"]
    assert run["display_name"] == "nightly-sft" and run["experiment_id"] == experiment["experiment_id"]
    assert run["runtime_config"]["parameters"]["algorithm"] == "grpo"
    assert "alignflow-post-training" in json.dumps(run["pipeline_spec"])
    assert training_caching(run) == [True] * 4
    assert api.polls == 3


def test_an_existing_token_comes_from_the_environment(kfp_api, config, monkeypatch, capsys):
    api = kfp_api()
    monkeypatch.setenv("ALIGNFLOW_KFP_TOKEN", TOKEN)
    code = cli.main(["pipeline", "submit", "--host", api.url, "--config", config, "--namespace", NAMESPACE,
                     "--no-cache"])
    assert code == 0, capsys.readouterr().err
    assert list(api.runs) == ["run-1"] and api.polls == 0  # no --wait: no polling
    assert training_caching(api.runs["run-1"]) == [False] * 4


def test_a_failed_run_exits_1_with_its_state_and_error(kfp_api, config, token_file, capsys):
    api = kfp_api(final_state="FAILED")
    code = cli.main(["pipeline", "submit", "--host", api.url, "--config", config, "--namespace", NAMESPACE,
                     "--token-file", token_file, "--wait", "--poll-seconds", "0.01"])
    assert code == 1
    assert "Run run-1 ended: FAILED (task sft failed: CUDA out of memory)" in capsys.readouterr().out


@pytest.mark.parametrize(("token", "namespace", "message"), [
    ("wrong-token", NAMESPACE, "refused the request (401"),
    (TOKEN, "kubeflow-user-someone-else", "refused the request (403"),
])
def test_a_refused_request_is_one_line_naming_what_to_check(kfp_api, config, tmp_path, capsys, token, namespace,
                                                            message):
    api = kfp_api()
    path = tmp_path / "bad-token"
    path.write_text(token)
    code = cli.main(["pipeline", "submit", "--host", api.url, "--config", config, "--namespace", namespace,
                     "--token-file", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert message in err and "--token-file" in err and namespace in err
    assert not api.runs


def test_a_missing_token_file_is_named(kfp_api, config, tmp_path, capsys):
    api = kfp_api()
    code = cli.main(["pipeline", "submit", "--host", api.url, "--config", config, "--token-file",
                     str(tmp_path / "nope")])
    assert code == 2 and "--token-file" in capsys.readouterr().err and not api.requests


def test_schedule_in_a_namespace(kfp_api, config, token_file, capsys):
    api = kfp_api()
    code = cli.main(["pipeline", "schedule", "--host", api.url, "--config", config, "--namespace", NAMESPACE,
                     "--token-file", token_file, "--cron", "0 0 3 * * *", "--job-name", "nightly"])
    assert code == 0, capsys.readouterr().err
    (job,) = api.recurring.values()
    assert job["display_name"] == "nightly" and job["trigger"]["cron_schedule"]["cron"] == "0 0 3 * * *"
    assert api.experiments[job["experiment_id"]]["namespace"] == NAMESPACE


def test_schedule_checks_the_config_as_submit_does(kfp_api, config, token_file, capsys):
    """A recurring run reads the same config every time: a bad section is refused before anything is created."""
    api = kfp_api()
    bad = config.replace(".yaml", "-bad.yaml")
    Path(bad).write_text(Path(config).read_text().replace("gate_metric: reward", "gate_metric: perplexity"))
    code = cli.main(["pipeline", "schedule", "--host", api.url, "--config", bad, "--namespace", NAMESPACE,
                     "--token-file", token_file, "--cron", "0 0 3 * * *"])
    err = capsys.readouterr().err
    assert code == 2 and "no known direction" in err and "gate_mode" in err
    assert not api.recurring
