"""`alignflow rollout-server`: one vLLM generation server for a whole training job (TRL's `trl vllm-serve`).

Every trainer rank sends it its prompts; one rank pushes the new weights after each update. It is
vLLM's own OpenAI-compatible server (vLLM's app, engine client, uvicorn launcher and SIGTERM
handling), started from Python so that routes can be added beside vLLM's:

    GET  /health            vLLM's: 200 while the engine runs (liveness)
    GET  /ready             200 with what the trainer checks (model, max_model_len, dtype, weight
                            names, weight version, `weight_group`: the backend and number of workers of
                            the weight group it can form, or null) once the engine serves; 503 during a
                            weight update
    POST /v1/completions    vLLM's: token-id prompts, per-request seeds, `return_token_ids`
    POST /weights/chunk     a safetensors blob (some of the tensors, HF names), staged on this node
    POST /weights/file      the same chunk as a file the trainer wrote in this node's /dev/shm, moved in
    POST /weights/probe     whether a file the trainer wrote in /dev/shm is visible here (same node, same
                            /dev/shm: a job-started server, or a pod's sidecar sharing its memory volume)
    POST /weights/commit    load every staged tensor into the running model, reset the prefix cache
    POST /weights/group/init    form a weight group (weight_group.py) with the trainer that posts it: the
                            workers join a torch.distributed group (gloo on CPU; NCCL on GPU, untested) whose
                            store worker 0 serves at the given port, dropping any earlier group; answers
                            once the trainer has joined
    POST /weights/group/update  receive one update over that group: the workers' reload takes each tensor
                            from the trainer's broadcasts as it iterates; answers when it is loaded

The weight routes need neither `VLLM_SERVER_DEV_MODE` nor the HTTP `/collective_rpc`: the commit
calls the engine client's own `collective_rpc` with the worker extension of vllm_ext.py. A trainer
on the same node (its probe file is visible here) hands each chunk over as a file in /dev/shm, which
the server moves into its staging folder: the bytes are written once, in shared memory, and never
cross a socket. Otherwise chunks travel over HTTP and are staged in /dev/shm (RAM) when it has room.
Either way the trainer never holds the whole model at once (it sends one module's tensors per chunk),
and the server holds one staged copy until the commit loads it. Over a weight group (a trainer on another
node, TRL's `vllm_group_port`), nothing is staged: each tensor goes from the trainer's broadcast into
vLLM's reload.

Sampling on the CPU: vLLM-CPU kills its engine when a seeded request's prompt is prefilled in
chunks ("CPU Generator does not use offset"), so on the CPU the server turns chunked prefill off;
seeded requests then draw from their own generator, whatever else is batched with them, which is
what lets N trainer ranks sample what one process samples.

SIGTERM drains: requests in flight finish (up to `--drain_timeout` seconds), then the engine and
the HTTP server stop and the process exits 0 (vLLM's `--shutdown-timeout`).

(No `from __future__ import annotations`: FastAPI reads the routes' annotations at run time.)
"""

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

# vllm_engine imports vLLM only where it runs it: importing it here loads nothing this package does not already load.
from trainer.rollout.vllm_engine import (
    CPU_BLOCK_SIZE,
    LOGPROBS_MODE,
    checkpoint_weight_names,
    cpu_kv_cache_bytes,
)

SERVED_NAME = "policy"  # the model name requests use, whatever the folder is called
WORKER_EXTENSION = "trainer.rollout.vllm_ext.WeightSyncExtension"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="alignflow rollout-server",
        description="Serve a model for GRPO/PPO rollouts: generation for every trainer rank, weight updates "
                    "from one. Point `alignflow train grpo --use_vllm true --vllm_mode server "
                    "--vllm_server_host HOST --vllm_server_port PORT` at it.")
    parser.add_argument("--model", required=True, help="HF model folder (config, weights, tokenizer) to start from.")
    parser.add_argument("--host", default="0.0.0.0", help="Address to listen on.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (TRL's default).")
    parser.add_argument("--tensor_parallel_size", type=int, default=1, help="GPUs per model replica.")
    parser.add_argument("--data_parallel_size", type=int, default=1, help="Model replicas (GPUs: tp x dp).")
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.9,
                        help="Share of each GPU's memory for weights and KV cache (GPUs only; see --max_num_seqs for "
                             "the CPU).")
    parser.add_argument("--max_model_len", type=int, default=None,
                        help="Longest prompt + completion in tokens (default: the model's).")
    parser.add_argument("--max_num_seqs", type=int, default=None,
                        help="Most sequences generated at once, over all the requests it serves (vLLM's "
                             "--max-num-seqs; default: vLLM's). On the CPU the KV cache then holds that many "
                             "sequences of max_model_len tokens; without it, 4 GiB. VLLM_CPU_KVCACHE_SPACE (GiB) "
                             "overrides both.")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of unseeded requests.")
    parser.add_argument("--drain_timeout", type=int, default=30,
                        help="On SIGTERM, seconds to let requests in flight finish before stopping.")
    return parser


def cpu_kv_cache_size(args: argparse.Namespace) -> int | None:
    """Bytes of CPU KV cache for `--max_num_seqs` sequences of max_model_len tokens (`--dtype auto` counted as
    float32, the widest); None without --max_num_seqs, or where `cpu_kv_cache_bytes` gives none (the variable set,
    or a config without the attention's shape or a length)."""
    if not args.max_num_seqs:
        return None
    return cpu_kv_cache_bytes(args.model, max_model_len=args.max_model_len, sequences=args.max_num_seqs,
                              dtype="float32" if args.dtype == "auto" else args.dtype)


def vllm_arguments(args: argparse.Namespace, cuda: bool, kv_cache_bytes: int | None = None) -> list[str]:
    """vLLM's server flags for these options (`kv_cache_bytes`: the KV cache's size, where it is set)."""
    argv = ["--model", args.model, "--served-model-name", SERVED_NAME, "--host", args.host, "--port", str(args.port),
            "--tensor-parallel-size", str(args.tensor_parallel_size),
            "--data-parallel-size", str(args.data_parallel_size),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--dtype", args.dtype,
            "--seed", str(args.seed), "--logprobs-mode", LOGPROBS_MODE,
            "--generation-config", "vllm",  # sampling defaults come from the request only
            "--worker-extension-cls", WORKER_EXTENSION, "--shutdown-timeout", str(args.drain_timeout),
            "--enforce-eager",  # weights change in place after every update: no CUDA graphs to rebuild
            "--disable-uvicorn-access-log"]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.max_num_seqs:
        argv += ["--max-num-seqs", str(args.max_num_seqs)]
    if kv_cache_bytes:
        argv += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    if not cuda:
        # Seeded requests need whole prefills on the CPU (module docstring); one step must then fit a
        # whole prompt. "uni": the model runs in the engine process (no worker process to spawn).
        argv += ["--no-enable-chunked-prefill", "--distributed-executor-backend", "uni",
                 "--block-size", str(CPU_BLOCK_SIZE), "--max-num-batched-tokens", str(max(8192, args.max_model_len or 0))]
    return argv


class WeightStage:
    """Chunks of an update staged as safetensors files until the commit loads them all in one call
    (vLLM fuses q/k/v and gate/up: a fused layer must get all of its parts in the same reload)."""

    def __init__(self, expected: frozenset[str]):
        self.expected = expected
        self.dir: Path | None = None
        self.files: list[Path] = []
        self.names: set[str] = set()
        self.bytes = 0
        self.version = 0
        self.updating = False

    def add(self, blob: bytes) -> int:
        """A chunk sent over HTTP: written into the staging folder."""
        return self._stage(len(blob), lambda path: path.write_bytes(blob))

    def add_file(self, source: Path) -> int:
        """A chunk the trainer wrote in this node's /dev/shm: moved into the staging folder (a rename when both
        are in /dev/shm), then staged like a blob."""
        return self._stage(source.stat().st_size, lambda path: shutil.move(source, path))

    def _stage(self, size: int, put: Callable[[Path], object]) -> int:
        """The next chunk file of this update, `size` bytes that `put` writes at the path it is given (the staging
        folder made on the first chunk); returns its tensor count."""
        from safetensors import safe_open

        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="alignflow-weights-", dir=_scratch_root(size)))
            self.updating = True
        path = self.dir / f"{len(self.files):05d}.safetensors"
        put(path)
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
        self.files.append(path)
        self.names.update(names)
        self.bytes += size
        return len(names)

    def missing(self, names: Iterable[str] | None = None) -> list[str]:
        """The model's weights not among `names` (default: the staged ones)."""
        return sorted(self.expected - (self.names if names is None else set(names)))

    def incomplete(self, missing: list[str]) -> str:
        """The start of the error for an update that lacks the weights `missing`."""
        return (f"a weight update needs every weight of the model; {len(missing)} of {len(self.expected)} missing "
                f"(e.g. {missing[:3]})")

    def clear(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir, self.files, self.names, self.bytes, self.updating = None, [], set(), 0, False


SHARED_ROOT = Path("/dev/shm")
SHARED_PREFIX = "alignflow-push-"  # the trainer's folder of chunk files in SHARED_ROOT


def _scratch_root(num_bytes: int) -> str | None:
    """/dev/shm (RAM) when it can hold a whole model's worth of chunks; containers often give it 64 MB."""
    try:
        if SHARED_ROOT.is_dir() and shutil.disk_usage(SHARED_ROOT).free > 64 * max(num_bytes, 1 << 20):
            return str(SHARED_ROOT)
    except OSError:
        pass
    return None


def shared_chunk(path: str) -> Path | None:
    """`path` when it names a chunk file in a trainer's push folder in /dev/shm, else None: the file routes move
    and load nothing else."""
    candidate = Path(path)
    if (not candidate.is_absolute() or candidate.parent.parent != SHARED_ROOT
            or not candidate.parent.name.startswith(SHARED_PREFIX) or ".." in candidate.parts):
        return None
    return candidate if candidate.is_file() and not candidate.is_symlink() else None


def weight_router(stage: WeightStage, info: dict):
    """The readiness and weight-update routes (module docstring)."""
    from fastapi import APIRouter, HTTPException, Request
    from fastapi.responses import JSONResponse
    from vllm.logger import init_logger

    log = init_logger("vllm.alignflow.rollout_server")  # under "vllm": vLLM configures that logger
    router = APIRouter()
    lock = asyncio.Lock()

    @router.get("/ready")
    async def ready() -> JSONResponse:
        body = {**info, "weight_version": stage.version, "updating": stage.updating}
        return JSONResponse(body, status_code=503 if stage.updating else 200)

    @router.post("/weights/chunk")
    async def chunk(request: Request) -> dict:
        blob = await request.body()
        async with lock:
            try:
                count = await asyncio.to_thread(stage.add, blob)
            except Exception as err:  # a blob that is not safetensors: the sender's fault
                raise HTTPException(400, f"not a safetensors blob: {err}") from err
        return {"tensors": count, "staged": len(stage.names)}

    @router.post("/weights/probe")
    async def probe(request: Request) -> dict:
        body = await request.json()
        found = shared_chunk(str(body.get("path", "")))
        try:
            shared = found is not None and found.read_text() == str(body.get("token"))
        except (OSError, UnicodeDecodeError):
            shared = False
        return {"shared": shared}

    @router.post("/weights/file")
    async def chunk_file(request: Request) -> dict:
        body = await request.json()
        source = shared_chunk(str(body.get("path", "")))
        if source is None:
            raise HTTPException(400, f"not a chunk file in a push folder of {SHARED_ROOT}: {body.get('path')!r}")
        async with lock:
            try:
                count = await asyncio.to_thread(stage.add_file, source)
            except Exception as err:  # not safetensors: the sender's fault
                raise HTTPException(400, f"not a safetensors file: {err}") from err
        return {"tensors": count, "staged": len(stage.names)}

    @router.post("/weights/commit")
    async def commit(request: Request) -> dict:
        body = await request.json() if await request.body() else {}
        engine = request.app.state.engine_client
        async with lock:
            missing = stage.missing()
            if missing:
                staged = len(stage.names)
                stage.clear()
                raise HTTPException(400, f"{stage.incomplete(missing)}, {staged} staged")
            started, files, size = time.perf_counter(), [str(p) for p in stage.files], stage.bytes
            try:
                loaded = await engine.collective_rpc("alignflow_load_weights_files", kwargs={"paths": files})
                await engine.reset_prefix_cache()  # cached prompt KV was computed with the old weights
            finally:
                stage.clear()
            stage.version = int(body.get("version", stage.version + 1))
            seconds = time.perf_counter() - started
            log.info("Weights updated to version %d: %d tensors, %.1f MB in %d chunks, loaded in %.2f s.",
                     stage.version, loaded[0], size / 1e6, len(files), seconds)
            return {"version": stage.version, "tensors": loaded[0], "bytes": size, "seconds": seconds}

    @router.post("/weights/group/init")
    async def group_init(request: Request) -> dict:
        body = await request.json()
        if info.get("weight_group") is None:
            raise HTTPException(400, "this server offers no weight group (data_parallel_size > 1): send weights "
                                     "over HTTP (vllm_group_port 0)")
        port, timeout_s, peer = int(body["port"]), float(body.get("timeout", 240)), request.client.host
        kwargs = {"port": port, "group_id": str(body["group_id"]), "peer": peer, "timeout_s": timeout_s}
        engine = request.app.state.engine_client
        async with lock:
            try:  # returns once the trainer has joined (or fails after timeout_s)
                size = await engine.collective_rpc("alignflow_group_init", kwargs=kwargs)
            except Exception as err:
                raise HTTPException(504, f"the weight group on port {port} with {peer} did not form: "
                                         f"{first_line(err)}") from err
        log.info("Weight group formed with %s (store on port %d, %s, %d ranks).", peer, port,
                 info["weight_group"]["backend"], size[0])
        return {"world_size": size[0], "port": port}

    @router.post("/weights/group/update")
    async def group_update(request: Request) -> dict:
        body = await request.json() if await request.body() else {}
        engine = request.app.state.engine_client
        async with lock:
            started = time.perf_counter()
            stage.updating = True
            try:  # the workers receive each tensor from the trainer's broadcasts as the reload asks for it
                received = (await engine.collective_rpc("alignflow_group_receive"))[0]
                await engine.reset_prefix_cache()
            except Exception as err:
                raise HTTPException(500, f"the weight update over the group failed (the group is dropped; "
                                         f"POST /weights/group/init again): {first_line(err)}") from err
            finally:
                stage.updating = stage.dir is not None  # chunks staged by another channel are still pending
            missing = stage.missing(received["names"])
            if missing:
                raise HTTPException(400, f"{stage.incomplete(missing)}: the model now holds a partial update; push "
                                         "them all")
            stage.version = int(body.get("version", stage.version + 1))
            seconds = time.perf_counter() - started
            log.info("Weights updated to version %d over the weight group: %d tensors, %.1f MB in %.2f s.",
                     stage.version, received["tensors"], received["bytes"] / 1e6, seconds)
            return {"version": stage.version, "tensors": received["tensors"], "bytes": received["bytes"],
                    "seconds": seconds}

    return router


def first_line(err: BaseException) -> str:
    """The first line of an error's message (torch's distributed errors append C++ stack traces), or its type."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def weight_group(vllm_args: argparse.Namespace) -> dict | None:
    """What /ready says of the weight group this server can form (weight_group.py): its backend and its number
    of workers (the trainer is one more rank); None with several replicas (data parallel), whose engines vLLM
    runs apart."""
    import torch

    if vllm_args.data_parallel_size > 1:
        return None
    return {"backend": "nccl" if torch.cuda.is_available() else "gloo",
            "workers": vllm_args.tensor_parallel_size * vllm_args.pipeline_parallel_size}


async def serve(vllm_args: argparse.Namespace, model: str) -> None:
    """vLLM's `run_server`, with the routes above added to its app."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    listen_address, sock = setup_server(vllm_args, reuse_port=False)
    async with build_async_engine_client(vllm_args) as engine:
        tasks = await engine.get_supported_tasks()
        config = engine.model_config
        app = build_app(vllm_args, tasks, config)
        info = {"model": model, "served_model_name": SERVED_NAME, "max_model_len": config.max_model_len,
                "dtype": str(config.dtype).removeprefix("torch."), "pid": os.getpid(),
                "weight_names": sorted(checkpoint_weight_names(model)), "weight_group": weight_group(vllm_args)}
        app.include_router(weight_router(WeightStage(frozenset(info["weight_names"])), info))
        await init_app_state(engine, app.state, vllm_args, tasks)
        shutdown = await serve_http(app, sock=sock, host=vllm_args.host, port=vllm_args.port,
                                    log_level=vllm_args.uvicorn_log_level, access_log=False)
    await shutdown
    sock.close()


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        print(f"alignflow rollout-server: error: --model {args.model!r} is not a model folder (no config.json); "
              "pass a Hugging Face model folder", file=sys.stderr)
        return 2
    import torch

    cuda = torch.cuda.is_available()
    kv_cache_bytes = None
    if not cuda:
        # The engine core in this process (no engine-core process to spawn), read when vLLM starts.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kv_cache_bytes = cpu_kv_cache_size(args)
        if kv_cache_bytes is None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB; unset, vLLM-CPU takes a share of all RAM
    # The worker imports trainer.rollout.vllm_ext; make that work without an installed package too.
    root = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    import uvloop
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllm_args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_arguments(args, cuda, kv_cache_bytes))
    configure_logging_from_args(vllm_args)
    validate_parsed_serve_args(vllm_args)
    uvloop.run(serve(vllm_args, args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
