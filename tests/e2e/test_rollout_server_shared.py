"""One `alignflow rollout-server` for a whole multi-rank GRPO job (TRL's `vllm_mode: server`), with real
vLLM-CPU and real processes.

- A server started by hand (a subprocess of this module, shared by its tests) and `alignflow train grpo
  --num_processes 2 --use_vllm true --vllm_mode server --vllm_server_host H --vllm_server_port P`: the
  final weights equal a 1-process run's against the same server, and the server then generates what
  the trained checkpoint generates under plain transformers.
- Without host and port, a 2-rank job starts exactly one server, and no process of it is left when the job
  is stopped by SIGTERM (exit 75, a checkpoint) nor when the resumed job ends.
- A server that dies mid-run ends the job with one line (exit 2) and leaves its step checkpoints complete.
- SIGTERM drains the server: a request in flight completes, then it exits 0 and leaves no process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    ROOT,
    alive,
    descendants,
    max_difference,
    model_greedy,
    needs_vllm,
    prompts_file,
    train_cli,
    weights,
)
from trainer.engine import checkpoint as ckpt
from trainer.engine.launch import free_port
from trainer.engine.preemption import PREEMPTED_EXIT_CODE
from trainer.rollout import SamplingConfig
from trainer.rollout.server_client import VLLMServerEngine, live_group_members

pytestmark = needs_vllm
psutil = pytest.importorskip("psutil")  # a vllm dependency

MAX_MODEL_LEN = 512  # room for the drain test's long request; the toy task needs 32 + 12
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_WAIT_POLICY": "PASSIVE"}


class HandStartedServer:
    """`alignflow rollout-server` as a user starts it, in its own process group."""

    def __init__(self, model: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT)}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainer.cli", "rollout-server", "--model", model, "--host", "127.0.0.1",
                 "--port", str(self.port), "--max_model_len", str(MAX_MODEL_LEN), "--dtype", "float32",
                 "--drain_timeout", "60"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited ({self.proc.returncode}):\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise AssertionError(f"rollout server not ready after 240 s:\n{log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    started = HandStartedServer(tiny_model, tmp_path_factory.mktemp("rollout-server") / "server.log")
    yield started
    started.stop()


def grpo_args(model: str, data: str, out: Path, per_device: int, *extra: str) -> list[str]:
    """The toy task (tests/helpers.py): 2 prompts x G=4 per cycle in all, whatever the number of ranks."""
    return ["--model", model, "--dataset", data, "--output_dir", str(out), "--reward_funcs",
            "tests.helpers:target_frequency", "--num_generations", "4", "--per_device_batch_size", str(per_device),
            "--max_completion_length", "12", "--max_prompt_length", "32", "--learning_rate", "2e-2",
            "--max_steps", "3", "--log_completions_steps", "0", "--disable_progress_bar", "true", *extra]


def use_server(server: HandStartedServer) -> tuple[str, ...]:
    return ("--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1",
            "--vllm_server_port", str(server.port))


@pytest.fixture(scope="module")
def one_process(server, tiny_model, tmp_path_factory) -> Path:
    """The toy task in one process against the hand-started server: the reference for the 2-rank runs."""
    folder = tmp_path_factory.mktemp("one-process")
    data = prompts_file(folder / "prompts.jsonl")
    t = time.perf_counter()
    train_cli("grpo", *grpo_args(tiny_model, data, folder / "out", 8, *use_server(server)), env=ENV)
    print(f"1 process: {time.perf_counter() - t:.1f} s")
    assert max_difference(weights(tiny_model), weights(folder / "out")) > 1e-3  # it did train
    return folder


def test_two_ranks_against_one_server_train_what_one_process_trains(server, one_process, tiny_model, tmp_path):
    """Same prompts, seeds and server as the 1-process run; each run starts by pushing its own weights. Under
    ZeRO-3, where rank 0 gathers the sharded weights for each push. Full weights pushed from 2 DDP ranks:
    test_ppo_two_ranks_against_one_server_train_what_one_process_trains (the same engine code and push); GRPO's
    rollout slicing on 2 DDP ranks against the server: the LoRA test."""
    mode, ranks = "zero3", ("--deepspeed", "zero3")
    t = time.perf_counter()
    done = train_cli("grpo", *grpo_args(tiny_model, str(one_process / "prompts.jsonl"), tmp_path / "two", 4,
                                        "--num_processes", "2", *ranks, *use_server(server)), env=ENV)
    seconds = time.perf_counter() - t
    assert "pushing this run's weights" in done.stderr + done.stdout
    difference = max_difference(weights(one_process / "out"), weights(tmp_path / "two"))
    print(f"2 ranks ({mode}): {seconds:.1f} s, max |weight difference| to 1 process {difference:.2e}")
    assert difference < 1e-4

    # The server holds the last weights rank 0 pushed: greedy, it answers what the checkpoint answers
    # under plain transformers (the hf engine's generate).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "two", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "two")
    prompts = [tokenizer(f"Write something about item {i}.")["input_ids"] for i in range(4)]
    client = VLLMServerEngine(server.url, max_model_len=44, timeout_s=10)
    served = [s[0].token_ids for s in client.generate(prompts, SamplingConfig(max_new_tokens=12, temperature=0))]
    assert served == [model_greedy(trained, p, 12) for p in prompts]
    untrained = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert served != [model_greedy(untrained, p, 12) for p in prompts]  # the pushes changed what it serves


def test_lora_two_ranks_against_one_server_train_what_one_process_trains(server, tiny_model, tmp_path):
    """LoRA: the server gets merged weights; 2 ranks = 1 process, and the server then serves the merged model."""
    data = prompts_file(tmp_path / "prompts.jsonl")
    lora = ("--lora_r", "8", "--lora_alpha", "16", "--learning_rate", "5e-2")
    train_cli("grpo", *grpo_args(tiny_model, data, tmp_path / "one", 8, *lora, *use_server(server)), env=ENV)
    train_cli("grpo", *grpo_args(tiny_model, data, tmp_path / "two", 4, "--num_processes", "2", *lora,
                                 *use_server(server)), env=ENV)
    difference = max_difference(weights(tmp_path / "one"), weights(tmp_path / "two"))  # the adapters
    print(f"LoRA 2 ranks (ddp): max |adapter difference| to 1 process {difference:.2e}")
    assert difference < 1e-4

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, tmp_path / "two").merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [tokenizer(f"Write something about item {i}.")["input_ids"] for i in range(4)]
    client = VLLMServerEngine(server.url, max_model_len=44, timeout_s=10)
    served = [s[0].token_ids for s in client.generate(prompts, SamplingConfig(max_new_tokens=12, temperature=0))]
    assert served == [model_greedy(merged, p, 12) for p in prompts]


def test_ppo_two_ranks_against_one_server_train_what_one_process_trains(server, tiny_model, tmp_path):
    """PPO through the same engine code: 2 ranks of 8 rollouts against the server = 1 process of 16 (DDP)."""
    from tests.references import ppo_args

    data = prompts_file(tmp_path / "prompts.jsonl", n=32)
    train_cli("ppo", *ppo_args(tiny_model, "value_head", data, "", 16), "--output_dir", str(tmp_path / "one"),
              *use_server(server), env=ENV)
    train_cli("ppo", "--num_processes", "2", *ppo_args(tiny_model, "value_head", data, "", 8), "--output_dir",
              str(tmp_path / "two"), *use_server(server), env=ENV)
    difference = max_difference(weights(tmp_path / "one"), weights(tmp_path / "two"))
    print(f"PPO 2 ranks (ddp): max |weight difference| to 1 process {difference:.2e}")
    assert difference < 1e-4
    assert max_difference(weights(tiny_model), weights(tmp_path / "one")) > 1e-4  # it did train


def run_watching_servers(command: list[str], stop_at_step: int | None = None
                         ) -> tuple[int, str, dict[int, psutil.Process], list[str]]:
    """Run a job to its end, watching its process tree every 0.5 s: its exit code, output, the pids of every rollout
    server seen in it, and the trees seen while one ran. With `stop_at_step`, SIGTERM the job (the launcher, as the
    kubelet would) once it logs that step."""
    env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    job = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    servers: dict[int, psutil.Process] = {}
    trees: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            tree = []
            for pid in descendants(job.pid):
                try:
                    process = psutil.Process(pid)
                    line = " ".join(process.cmdline())
                except psutil.Error:
                    continue
                server = "trainer.rollout.server" in line
                tree.append(f"{pid} {line if server else line[:140]}")  # a server's whole command
                if server:
                    servers.setdefault(pid, process)
            if any("trainer.rollout.server" in line for line in tree):
                trees.append("\n".join(tree))
            stop.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    timer = threading.Timer(600, job.kill)
    timer.start()
    lines = []
    try:
        for line in job.stdout:
            lines.append(line)
            if stop_at_step and (logged := re.search(r" step (\d+)/\d+ ", line)) and int(logged.group(1)) >= stop_at_step:
                job.send_signal(signal.SIGTERM)
                stop_at_step = None
        job.wait()
    finally:
        timer.cancel()
        stop.set()
        watcher.join()
        if job.poll() is None:
            job.kill()
    return job.returncode, "".join(lines), servers, trees


def test_without_an_address_two_ranks_start_one_server_which_stops_on_sigterm_and_at_the_end(one_process, tiny_model,
                                                                                            tmp_path):
    """Two ranks, no server address: the job starts one server. SIGTERM to the job after step 1 (periodic saves
    off): both ranks save step 1's checkpoint, the job exits 75, and no process of the server is left. `auto` then
    resumes the run with a new server, which stops when the run ends, and the run ends with the weights of the
    uninterrupted 1-process run against a hand-started server (the same seeded rollouts). The server is told the
    most sequences the node's ranks generate at once (its --max_num_seqs, which sizes a CPU KV cache)."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "trainer.cli", "train", "grpo",
               *grpo_args(tiny_model, str(one_process / "prompts.jsonl"), out, 4, "--num_processes", "2",
                          "--rollout_engine", "vllm-server", "--save_steps", "0", "--logging_steps", "1")]

    code, output, servers, trees = run_watching_servers(command, stop_at_step=1)
    assert code == PREEMPTED_EXIT_CODE, output[-4000:]
    print("process tree while the job ran:\n" + (trees[len(trees) // 2] if trees else "(none seen)"))
    assert len(servers) == 1, (servers, trees[-1:] if trees else None)
    assert "serves the 2 ranks on" in output and "1 server(s) in the job" in output
    assert re.search(r"--max_num_seqs 8\b", trees[-1])  # both ranks' calls at once: 2 x 1 prompt x G 4
    saved = [step for step, _ in ckpt.list_checkpoints(str(out), verify=True)]
    assert len(saved) == 1 and saved[0] < 3, (saved, output[-4000:])
    assert not [p for p in servers.values() if alive(p)], "the rollout server outlived a job stopped by SIGTERM"

    code, output, resumed_servers, _ = run_watching_servers([*command, "--resume_from_checkpoint", "auto"])
    assert code == 0, output[-4000:]
    assert len(resumed_servers) == 1 and not resumed_servers.keys() & servers.keys()
    assert not [p for p in resumed_servers.values() if alive(p)], "the rollout server outlived its job"
    assert json.loads((out / ckpt.MANIFEST).read_text())["resumed_from"] == str(out / f"checkpoint-{saved[0]}")
    difference = max_difference(weights(one_process / "out"), weights(out))
    print(f"stopped after step {saved[0]} and resumed: max |weight difference| to 1 process {difference:.2e}")
    assert difference < 1e-4


def test_a_server_that_dies_mid_run_is_one_line_and_the_checkpoints_stay(tiny_model, one_process, tmp_path):
    """A hand-started server SIGKILLed after the job's step 2: the next rollout fails with one line naming the server
    and what to do (exit 2, no traceback), and the step checkpoints written so far are complete, so `auto` can
    resume once a server runs again (every run starts by pushing its own weights: the tests above)."""
    doomed = HandStartedServer(tiny_model, tmp_path / "server.log")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "trainer.cli", "train", "grpo",
               *grpo_args(tiny_model, str(one_process / "prompts.jsonl"), out, 8, *use_server(doomed),
                          "--max_steps", "6", "--save_steps", "1", "--logging_steps", "1")]
    env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    try:
        job = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in job.stdout:
            lines.append(line)
            if re.search(r" step 2/\d+ ", line):
                doomed.stop()  # SIGKILL to its process group
        code = job.wait(timeout=300)
    finally:
        doomed.stop()
    output = "".join(lines)
    errors = [line for line in output.splitlines() if ": error: " in line]
    assert code == 2 and "Traceback" not in output, output[-4000:]
    assert len(errors) == 1 and f"rollout server at {doomed.url} stopped answering" in errors[0], errors
    assert "resume_from_checkpoint auto" in errors[0]
    saved = [step for step, _ in ckpt.list_checkpoints(str(out), verify=True)]
    assert saved and max(saved) >= 2 and not ckpt.is_complete(str(out)), (saved, output[-4000:])


def test_sigterm_drains_requests_in_flight_then_stops(server):
    """Last in this module: it stops the shared server."""
    result: dict = {}

    def long_request() -> None:
        body = dict(model="policy", prompt=[5, 6, 7], n=8, max_tokens=480, temperature=1.0, ignore_eos=True,
                    return_token_ids=True, seed=3)
        request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                result["lengths"] = [len(c["token_ids"]) for c in json.loads(response.read())["choices"]]
        except OSError as err:
            result["error"] = repr(err)

    members = live_group_members(server.proc.pid)
    assert len(members) >= 1
    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until the engine runs it
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
            running = [line for line in response.read().decode().splitlines()
                       if line.startswith("vllm:num_requests_running")]
        if running and float(running[0].split()[-1]) > 0:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the request never ran")
    os.kill(server.proc.pid, signal.SIGTERM)
    thread.join(timeout=120)
    assert result == {"lengths": [480] * 8}, result  # finished, not aborted
    assert server.proc.wait(timeout=90) == 0
    deadline = time.monotonic() + 15  # its helpers (engine core, resource tracker) exit right after it
    while live_group_members(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live_group_members(server.proc.pid), "processes of the server outlived it"
    log = server.log.read_text(errors="replace")
    assert "draining in-flight requests" in log
