"""The trainer's side of `alignflow rollout-server` (server.py): an HTTP client, and the server as a child process.

`VLLMServerEngine` is the `vllm-server` rollout engine. It talks to one server that the whole job
shares: one given by URL (TRL's `vllm_server_host`/`vllm_server_port` or `vllm_server_base_url`), or
one that `start_server` starts as a child of the job's first rank. Imports no vllm: only the server does.

- generate: one `/v1/completions` request per prompt, with token-id prompts and a seed per prompt
  (`base.sample_seed`), so a prompt's samples depend on (seed, prompt key) and the weights only, not
  on what else the server batches with it: N ranks sample what one process samples.
- sync_weights: the tensors are sent as the iterator yields them (so a caller that gathers a ZeRO-3
  model module by module never holds the whole model), over one of three channels, chosen once:
  1. `shared_memory`: a server on this node that sees this process's /dev/shm (`/weights/probe` finds
     the file written there) gets safetensors chunks of about `chunk_bytes` as files written there
     (`/weights/file`: the bytes cross no socket), then `/weights/commit` loads them all at once;
  2. `group`: otherwise, when the server offers a weight group (/ready) and `group_port` is set (TRL's
     `vllm_group_port`), this process joins a torch.distributed group with the server's workers
     (weight_group.py: gloo on the CPU, NCCL on GPUs, untested) and broadcasts each tensor while the
     workers' reload receives it (`/weights/group/init` once, `/weights/group/update` per push);
  3. `http`: otherwise (one logged line says why), chunks travel in request bodies (`/weights/chunk`),
     then `/weights/commit`.
- Every failure to reach the server is a `RolloutServerError`: one line with the URL, what failed,
  and what to do. A server that dies mid-run ends the job with it (no reconnect); the job resumes
  from its last checkpoint (`resume_from_checkpoint auto`), and its first act is to push its weights.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from trainer.engine.launch import free_port
from trainer.errors import RolloutServerError
from trainer.rollout.base import (
    Completion,
    EngineContext,
    SamplingConfig,
    check_prompts,
    fill_to_n,
    sample_seed,
    samples_per_request,
    truncate_at_stop,
)
from trainer.rollout.server import SERVED_NAME, SHARED_PREFIX, SHARED_ROOT, first_line
from trainer.rollout.vllm_engine import sampling_fields
from trainer.rollout.weight_group import DEFAULT_PORT, WeightGroup, open_store

log = logging.getLogger(__name__)

# Runs before the server's own interpreter (via exec, same pid): on Linux, ask for SIGTERM when
# the thread that started us dies, even by SIGKILL, so a crashed trainer leaves no server behind.
# (No preexec_fn: it is unsafe in a process with threads.) argv: trainer pid, then python's args.
_LAUNCHER = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit("the process that started the rollout server is gone")
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""
CHUNK_BYTES = 256 * 2**20
CHANNELS = ("shared_memory", "group", "http")  # how sync_weights sends (module docstring), in order of preference


def _answered_with_error(answer) -> bool:
    """Whether the server has already answered the request that runs beside a group operation, with an error. That
    error says why the group broke; this side's own only says that it did."""
    return answer.done() and answer.exception() is not None


def _wait_for_port(host: str, port: int, deadline: float, answer) -> None:
    """Until something listens at host:port (the server's worker 0 starting the group's store), or `deadline`:
    torch's own store client would retry for up to twice its timeout. Stops early if the server has answered
    (with an error: it started no store)."""
    last: OSError | None = None
    while time.monotonic() < deadline and not _answered_with_error(answer):
        try:
            with socket.create_connection((host, port), timeout=max(min(deadline - time.monotonic(), 2.0), 0.1)):
                return
        except OSError as e:
            last = e
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens at {host}:{port}" + (f" ({last})" if last else ""))


def server_url(host: str | None, port: int | None, base_url: str | None) -> str | None:
    """The URL of a running server from TRL's options; None when none is given (the job starts its own)."""
    if base_url:
        return base_url.rstrip("/")
    if host or port:
        return f"http://{host or '127.0.0.1'}:{port or 8000}"
    return None


def on_each_node(url: str | None) -> bool:
    """Whether every node has its own server at `url`: none given (each node's first rank starts one), or a
    loopback address (a sidecar in every pod, components/trainjob.py). Each node's first rank then pushes."""
    return url is None or urllib.parse.urlsplit(url).hostname in ("127.0.0.1", "localhost", "::1")


# ----------------------------------------------------------------------------------------------
# The server as a child process


class ServerProcess:
    """`python -m trainer.rollout.server` in its own process group; stopped with its group on close()."""

    def __init__(self, model_path: str, *, max_model_len: int, dtype: str = "float32", seed: int = 0,
                 gpu_memory_utilization: float = 0.3, devices: str | None = None, port: int | None = None,
                 max_num_seqs: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = Path(tempfile.mkdtemp(prefix="alignflow-rollout-server-"))
        self.log_path = self.workdir / "server.log"
        command = [sys.executable, "-c", _LAUNCHER, str(os.getpid()), "-m", "trainer.rollout.server",
                   "--model", str(model_path), "--host", "127.0.0.1", "--port", str(self.port),
                   "--max_model_len", str(max_model_len), "--dtype", dtype, "--seed", str(seed),
                   "--gpu_memory_utilization", str(gpu_memory_utilization), "--drain_timeout", "0",
                   *(["--max_num_seqs", str(max_num_seqs)] if max_num_seqs else [])]
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set for in-process engines; the server decides
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        root = str(Path(__file__).resolve().parents[2])  # trainer/ importable without an installed package
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        with open(self.log_path, "wb") as log:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        atexit.register(self.close)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """Stop the server and every process it started (its process group); idempotent."""
        atexit.unregister(self.close)
        proc, self.proc = self.proc, None
        if proc is None:
            return
        died_by_itself = proc.poll() is not None
        stop_process_group(proc)
        if not died_by_itself:  # else keep the log that the error message points at
            shutil.rmtree(self.workdir, ignore_errors=True)


def stop_process_group(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM the server's process group, wait, then SIGKILL whatever is left of it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    deadline = time.monotonic() + timeout  # the engine-core process shares the group
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        if not live_group_members(proc.pid):  # only zombies left, e.g. under a PID 1 that never reaps
            break
        time.sleep(0.1)
    proc.wait()


def live_group_members(pgid: int) -> list[int]:
    """Pids in process group `pgid` that are not zombies (Linux /proc; elsewhere assume some are)."""
    proc_root = Path("/proc")
    if not (proc_root / "self" / "stat").exists():
        return [pgid]
    live = []
    for stat in proc_root.glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            live.append(int(stat.parent.name))
    return live


# ----------------------------------------------------------------------------------------------
# The client


class VLLMServerEngine(EngineContext):
    """The rollout engine of a job whose generation runs in `alignflow rollout-server` at `url`.

    `server`: the child process serving `url` when this engine started it (closed with the engine).
    `group_port`: the server-side port of the weight group (TRL's `vllm_group_port`; 0 or None: no group).
    `channel`: one of CHANNELS to force it (tests, benchmarks; an error if it is not available); None chooses.
    `timeout_s` (vllm_server_timeout) bounds the wait for the server and the forming of the weight group."""

    def __init__(self, url: str, *, max_model_len: int, timeout_s: float = 240, request_timeout_s: float = 3600,
                 server: ServerProcess | None = None, chunk_bytes: int = CHUNK_BYTES,
                 group_port: int | None = DEFAULT_PORT, channel: str | None = None):
        if channel not in (None, *CHANNELS):
            raise ValueError(f"channel {channel!r}: choose one of {', '.join(CHANNELS)}, or None")
        self.url, self.max_model_len, self.server = url.rstrip("/"), max_model_len, server
        self.request_timeout_s, self.chunk_bytes = request_timeout_s, chunk_bytes
        self.timeout_s, self.group_port = timeout_s, group_port
        self._closed = False
        self.last_push: dict = {}
        self.shared_dir: Path | None = None  # this process's push folder in /dev/shm, when the server sees it
        self.group: WeightGroup | None = None  # formed at the first push over the group channel
        start = time.perf_counter()
        try:
            self.info = self._wait_ready(timeout_s)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - start
        try:
            self.channel = self._choose_channel(channel)
        except BaseException:
            self.close()
            raise
        if self.info["max_model_len"] < max_model_len:
            self.close()
            raise RolloutServerError(
                f"the rollout server at {self.url} serves max_model_len={self.info['max_model_len']}, but prompts and "
                f"completions take up to {max_model_len} tokens: restart it with --max_model_len {max_model_len}, or "
                "lower max_prompt_length / max_completion_length")

    # -- life cycle ----------------------------------------------------------------------------

    def _wait_ready(self, timeout_s: float) -> dict:
        deadline, last = time.monotonic() + timeout_s, "no answer"
        while True:
            if self.server is not None and self.server.exit_code() is not None:
                raise RolloutServerError(f"the rollout server exited with code {self.server.exit_code()} during "
                                         f"start-up; log {self.server.log_path}:\n{self.server.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=5) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:  # 503: up, but in the middle of a weight update
                last = f"HTTP {e.code}"
            except (OSError, ValueError) as e:
                last = str(getattr(e, "reason", e))
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        where = (f"; log {self.server.log_path}:\n{self.server.log_tail()}" if self.server is not None else
                 ": start one with `alignflow rollout-server --model MODEL --port PORT`, check vllm_server_host / "
                 "vllm_server_port (or vllm_server_base_url), or raise vllm_server_timeout")
        raise RolloutServerError(f"no rollout server answered {self.url}/ready within {timeout_s:g} s "
                                 f"(vllm_server_timeout; last: {last}){where}")

    def _choose_channel(self, forced: str | None) -> str:
        """The channel of every push (module docstring): shared memory when the server sees this process's /dev/shm,
        else the weight group when the server offers one, else HTTP, with one logged line saying why."""
        if forced in (None, "shared_memory"):
            self.shared_dir = self._shared_memory()
            if self.shared_dir is not None:
                return "shared_memory"
            if forced:
                raise RolloutServerError(f"the rollout server at {self.url} does not see this process's /dev/shm")
        if forced in (None, "group"):
            why = self._no_group()
            if why is None:
                return "group"
            if forced:
                raise RolloutServerError(f"no weight group with the rollout server at {self.url}: {why}")
            log.info("Weights go to the rollout server at %s over HTTP: %s.", self.url, why)
        return "http"

    def _no_group(self) -> str | None:
        """Why this engine cannot push over a weight group, or None when it can."""
        offer = self.info.get("weight_group")
        if not self.group_port:
            return "vllm_group_port is 0"
        if offer is None:
            return "the server offers no weight group (data_parallel_size > 1, or an alignflow before weight groups)"
        if offer["backend"] == "nccl" and not torch.cuda.is_available():
            return "the server's workers are on GPUs (NCCL) and this process sees no CUDA device"
        return None

    def _shared_memory(self) -> Path | None:
        """A push folder in /dev/shm when the server can read what this process writes there (same node, same
        /dev/shm), else None (chunks go over HTTP): a file with a random token, which the server must read back."""
        if urllib.parse.urlsplit(self.url).hostname not in ("127.0.0.1", "localhost", "::1"):
            return None
        try:
            folder = Path(tempfile.mkdtemp(prefix=SHARED_PREFIX, dir=SHARED_ROOT))
        except OSError:  # no /dev/shm here
            return None
        token = uuid.uuid4().hex
        (folder / "probe").write_text(token)
        try:
            shared = self._post("/weights/probe", {"path": str(folder / "probe"), "token": token}).get("shared")
        except RolloutServerError:  # a server without the route
            shared = False
        (folder / "probe").unlink()
        if not shared:
            shutil.rmtree(folder, ignore_errors=True)
            return None
        return folder

    @property
    def pid(self) -> int | None:
        """The server's pid when this engine started it."""
        return self.server.pid if self.server is not None else None

    def close(self) -> None:
        self._closed = True
        self._leave_group()
        if self.shared_dir is not None:
            shutil.rmtree(self.shared_dir, ignore_errors=True)
        if self.server is not None:
            self.server.close()

    def sleep(self) -> None:
        """Nothing: the server owns its devices, freeing them would not help the trainer."""

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        check_prompts(prompts, sampling.max_new_tokens, self.max_model_len)
        fields = sampling_fields(sampling)

        def one(i: int) -> list[Completion]:
            seed = sample_seed(sampling, i) if sampling.seed is not None else None
            body = dict(model=SERVED_NAME, prompt=list(prompts[i]), n=samples_per_request(sampling), seed=seed,
                        return_token_ids=True, **fields)
            choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])
            return fill_to_n([truncate_at_stop(c["token_ids"], c["logprobs"]["token_logprobs"],
                                               sampling.stop_token_ids) for c in choices], sampling.n)

        # One request per prompt (each with its own seed); the server batches them with every rank's.
        with ThreadPoolExecutor(max_workers=min(len(prompts), 64) or 1) as pool:
            return list(pool.map(one, range(len(prompts))))

    # -- weights -------------------------------------------------------------------------------

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Send the whole state dict (HF names) over `self.channel`; `last_push` records bytes, chunks (over the
        group: tensors), seconds, the server's load seconds and the channel."""
        if self.channel == "group":
            return self._push_over_group(named_tensors, version)
        dtype = getattr(torch, self.info["dtype"])
        start, sent, chunks = time.perf_counter(), 0, 0
        chunk: dict[str, torch.Tensor] = {}
        size = 0
        for name, tensor in named_tensors:
            # A copy in the server's dtype: tied weights share storage (safetensors refuses that), and a
            # ZeRO-3 caller frees the gathered parameter once the iterator moves on.
            chunk[name] = tensor.detach().to("cpu", dtype, copy=True).contiguous()
            size += chunk[name].numel() * chunk[name].element_size()
            if size >= self.chunk_bytes:
                sent, chunks, chunk, size = sent + self._send_chunk(chunk, chunks), chunks + 1, {}, 0
        if chunk:
            sent, chunks = sent + self._send_chunk(chunk, chunks), chunks + 1
        result = self._post("/weights/commit", {} if version is None else {"version": version})
        self.last_push = {"bytes": sent, "chunks": chunks, "seconds": time.perf_counter() - start,
                          "server_load_seconds": result.get("seconds", 0.0),
                          "channel": self.channel}

    def _send_chunk(self, chunk: dict[str, torch.Tensor], index: int) -> int:
        """One chunk: a file in the shared push folder that the server moves in, or a safetensors blob over HTTP."""
        from safetensors.torch import save, save_file

        if self.channel == "http":
            blob = save(chunk)
            self._post("/weights/chunk", blob)
            return len(blob)
        path = self.shared_dir / f"{index:05d}.safetensors"
        save_file(chunk, str(path))
        size = path.stat().st_size
        try:
            self._post("/weights/file", {"path": str(path)})
        finally:
            path.unlink(missing_ok=True)  # moved by the server, or left behind by a failure
        return size

    def _push_over_group(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None) -> None:
        """One update over the weight group: POST /weights/group/update in a thread (it answers once the workers'
        reload is done), broadcast each tensor as the iterator yields it, end the stream, read the answer."""
        dtype = getattr(torch, self.info["dtype"])
        start, sent, count = time.perf_counter(), 0, 0
        if self.group is None:
            self.group = self._join_group()
        pool = ThreadPoolExecutor(max_workers=1)
        answer = pool.submit(self._post, "/weights/group/update", {} if version is None else {"version": version})
        try:
            for name, tensor in named_tensors:
                if answer.done():  # the server gave up (its error is raised below)
                    break
                sent, count = sent + self.group.send(name, tensor.detach().to(dtype)), count + 1
            else:
                self.group.end()
        except Exception as err:  # the group is broken: the next push forms a new one
            pool.shutdown(wait=False)  # the server's side fails within the group's timeout
            self._leave_group()
            if _answered_with_error(answer):
                raise answer.exception() from err
            raise RolloutServerError(f"the weight push over the group with the rollout server at {self.url} failed "
                                     f"({first_line(err)}); the next push forms a new group"
                                     f"{self._log_hint()}") from err
        try:
            result = answer.result()
        except RolloutServerError:
            self._leave_group()
            raise
        finally:
            pool.shutdown()
        self.last_push = {"bytes": sent, "chunks": count, "seconds": time.perf_counter() - start,
                          "server_load_seconds": result.get("seconds", 0.0), "channel": "group"}

    def _join_group(self) -> WeightGroup:
        """Form the weight group: the server's workers (asked by POST /weights/group/init, in a thread: it answers
        once this process has joined) and this process, the last rank, within `timeout_s`."""
        offer, host, port = self.info["weight_group"], urllib.parse.urlsplit(self.url).hostname, self.group_port
        deadline = time.monotonic() + self.timeout_s
        pool = ThreadPoolExecutor(max_workers=1)
        group_id = uuid.uuid4().hex
        answer = pool.submit(self._post, "/weights/group/init",
                             {"port": port, "group_id": group_id, "timeout": self.timeout_s})
        try:
            _wait_for_port(host, port, deadline, answer)
            store = open_store(host, port, serve=False, timeout_s=max(deadline - time.monotonic(), 1.0))
            device = torch.device("cuda", torch.cuda.current_device()) if offer["backend"] == "nccl" else None
            group = WeightGroup(store, group_id=group_id, rank=offer["workers"], world_size=offer["workers"] + 1,
                                timeout_s=max(deadline - time.monotonic(), 1.0), backend=offer["backend"], peer=host,
                                device=device)
        except Exception as err:
            pool.shutdown(wait=False)  # the server gives up on its side within the same timeout
            if _answered_with_error(answer):
                raise answer.exception() from err
            raise RolloutServerError(
                f"could not form the weight group with the rollout server at {host}:{port} within {self.timeout_s:g} s "
                f"(vllm_server_timeout; {first_line(err)}): open TCP port {port} of {host} (and the "
                "ports gloo/NCCL pick) to this trainer, set vllm_group_port to a port that is open, or set it to 0 "
                f"to send weights over HTTP{self._log_hint()}") from err
        try:
            answer.result()
        except BaseException:
            group.close()
            raise
        finally:
            pool.shutdown()
        log.info("Weights go to the rollout server at %s over a %s weight group (store %s:%d, %d ranks), formed in "
                 "%.1f s.", self.url, offer["backend"], host, port, offer["workers"] + 1,
                 self.timeout_s - (deadline - time.monotonic()))
        return group

    def _leave_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()

    # -- HTTP ----------------------------------------------------------------------------------

    def _post(self, route: str, body: dict | bytes) -> dict:
        if self._closed:
            raise RolloutServerError("the vllm-server rollout engine is closed")
        binary = isinstance(body, bytes)
        request = urllib.request.Request(
            self.url + route, data=body if binary else json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/octet-stream" if binary else "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise RolloutServerError(f"the rollout server at {self.url} answered POST {route} with {e.code}: "
                                     f"{detail}{self._log_hint()}") from e
        except OSError as e:
            raise RolloutServerError(
                f"the rollout server at {self.url} stopped answering (POST {route}: {getattr(e, 'reason', e)}); it "
                "must run for the whole job: restart it and resume with resume_from_checkpoint auto"
                f"{self._log_hint()}") from e
        return json.loads(payload) if payload else {}

    def _log_hint(self) -> str:
        if self.server is None:
            return ""
        code = self.server.exit_code()
        state = f"exited with code {code}" if code is not None else "running"
        return f" (server {state}; log {self.server.log_path})"
