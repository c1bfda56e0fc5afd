"""The vllm-server engine's own server: `alignflow rollout-server` as a child of the process that makes the engine.

It serves rollouts, receives weights, and leaves no process behind when the `with` block raises,
when it dies at start, and when its trainer is killed. Each test starts its own server (~20-45 s on this CPU). A server
started by hand, shared by a job's ranks, is tested in test_rollout_server_shared.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import alive, logged_kv_tokens, model_greedy, perturb, sized_kv_tokens
from trainer.engine.launch import free_port
from trainer.rollout import SamplingConfig, make_engine
from trainer.rollout.server_client import VLLMServerEngine

# find_spec, not import: the test process itself never needs vllm, only the server does.
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (pip install 'alignflow[cpu]')", allow_module_level=True)
psutil = pytest.importorskip("psutil")  # a vllm dependency


MAX_NEW = 16


@pytest.fixture
def kv_cache_env(monkeypatch):
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; unset, vLLM-CPU reserves a share of all RAM


@pytest.fixture
def policy(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
            AutoTokenizer.from_pretrained(tiny_model))


def start(tiny_model, policy, **options):
    model, tokenizer = policy
    return make_engine("vllm-server", model=model, tokenizer=tokenizer, model_path=tiny_model, max_model_len=512,
                       server_timeout_s=240, dtype="float32", **options)


def server_processes(engine) -> list[psutil.Process]:
    """The server and everything it started (API server, engine core, helpers)."""
    leader = psutil.Process(engine.pid)
    return [leader, *leader.children(recursive=True)]


def process_group(pgid: int) -> list[psutil.Process]:
    members = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                members.append(p)
        except ProcessLookupError:
            pass
    return members


def assert_all_gone(processes: list[psutil.Process], pgid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(processes[0].pid, 0)  # the server itself: stopped and reaped
    assert not [p for p in processes if alive(p)], "server processes survived close()"
    assert not [p for p in process_group(pgid) if alive(p)], f"process group {pgid} is not empty"


def test_sidecar_serves_rollouts_takes_weights_and_is_stopped_when_the_caller_raises(tiny_model, policy,
                                                                                    monkeypatch):
    """One server start for the whole life cycle: sampling, greedy = the policy's, weight syncs (through /dev/shm,
    then over HTTP) that change what it serves, then an exception inside the `with` block, which must still stop
    every process of the server. (A `with` block that ends normally stops it through the same close(): the job-started server of
    test_rollout_server_shared.py::
    test_without_an_address_two_ranks_start_one_server_which_stops_on_sigterm_and_at_the_end.)
    With VLLM_CPU_KVCACHE_SPACE unset, the engine's `max_sequences` reaches the server as --max_num_seqs, which sizes
    its KV cache (not its 4 GiB default)."""
    model, _ = policy
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 160)]
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with pytest.raises(RuntimeError, match="injected"):
        with start(tiny_model, policy, max_sequences=12) as engine:
            processes = server_processes(engine)
            pgid = os.getpgid(engine.pid)
            assert pgid == engine.pid and pgid != os.getpgid(0)  # its own process group
            command = processes[0].cmdline()
            assert command[command.index("--max_num_seqs") + 1] == "12"
            assert logged_kv_tokens(engine.server.log_path.read_text()) == sized_kv_tokens(
                tiny_model, max_model_len=512, sequences=12, dtype="float32")

            sampled = engine.generate(prompts, SamplingConfig(max_new_tokens=MAX_NEW, n=4, stop_token_ids=[2]))
            assert [len(s) for s in sampled] == [4, 4, 4]
            for samples in sampled:
                assert len({tuple(c.token_ids) for c in samples}) > 1
                for c in samples:
                    assert 1 <= len(c.token_ids) <= MAX_NEW and len(c.logprobs) == len(c.token_ids)
                    assert c.finish_reason == ("stop" if c.token_ids[-1] == 2 else "length")

            greedy = SamplingConfig(max_new_tokens=MAX_NEW, temperature=0)
            before = [s[0].token_ids for s in engine.generate(prompts, greedy)]
            assert before == [model_greedy(model, p, MAX_NEW) for p in prompts]
            perturb(model, seed=4)
            engine.sync_weights(model.state_dict().items())
            assert engine.last_push["channel"] == "shared_memory"  # the child server sees this node's /dev/shm
            after = [s[0].token_ids for s in engine.generate(prompts, greedy)]
            assert after != before
            assert after == [model_greedy(model, p, MAX_NEW) for p in prompts]
            # The same over HTTP, as a server on another node gets them.
            engine.channel = "http"
            perturb(model, seed=5)
            engine.sync_weights(model.state_dict().items())
            assert engine.last_push["channel"] == "http"
            over_http = [s[0].token_ids for s in engine.generate(prompts, greedy)]
            assert over_http != after and over_http == [model_greedy(model, p, MAX_NEW) for p in prompts]
            raise RuntimeError("injected failure inside the with block")
    assert engine.pid is None
    assert_all_gone(processes, pgid)
    engine.close()  # idempotent


def test_sidecar_takes_weights_over_a_gloo_weight_group_and_a_restarted_trainer_forms_a_new_one(tiny_model, policy,
                                                                                              kv_cache_env):
    """The process-group channel (weight_group.py), forced: the probe would pick /dev/shm on this node. The first push
    forms the group (the server's worker hosts its store at the group port) and the server's greedy output then
    follows the pushed weights; a second engine on the same server, as a restarted or resumed trainer, forms a new
    group there and its push is what the server serves next. The first engine's group is gone: its next push fails
    with one line, and forming a group again (a new engine) works."""
    model, _ = policy
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist() for n in (7, 30)]
    greedy = SamplingConfig(max_new_tokens=MAX_NEW, temperature=0)
    port = free_port()
    with start(tiny_model, policy, group_port=port, weight_channel="group") as engine:
        assert engine.info["weight_group"] == {"backend": "gloo", "workers": 1}
        before = [s[0].token_ids for s in engine.generate(prompts, greedy)]
        perturb(model, seed=6)
        engine.sync_weights(model.state_dict().items(), version=7)
        push = engine.last_push
        assert push["channel"] == "group" and push["chunks"] == len(model.state_dict())
        assert push["bytes"] == sum(t.numel() * 4 for t in model.state_dict().values())
        after = [s[0].token_ids for s in engine.generate(prompts, greedy)]
        assert after != before and after == [model_greedy(model, p, MAX_NEW) for p in prompts]

        restarted = VLLMServerEngine(engine.url, max_model_len=512, timeout_s=60, group_port=port, channel="group")
        perturb(model, seed=7)
        restarted.sync_weights(model.state_dict().items())
        assert restarted.last_push["channel"] == "group" and restarted.info["weight_version"] == 7
        again = [s[0].token_ids for s in engine.generate(prompts, greedy)]
        assert again != after and again == [model_greedy(model, p, MAX_NEW) for p in prompts]
        restarted.close()
        assert engine.group is not None
        with pytest.raises(RuntimeError, match="over the group"):
            engine.sync_weights(model.state_dict().items())  # its group was replaced by the restarted trainer's
        assert engine.group is None  # dropped: its next push forms a new group
        perturb(model, seed=8)
        engine.sync_weights(model.state_dict().items())
        assert [s[0].token_ids for s in engine.generate(prompts, greedy)] == [model_greedy(model, p, MAX_NEW)
                                                                           for p in prompts]


def test_sidecar_that_dies_at_start_reports_its_log(tmp_path, policy, kv_cache_env):
    model, tokenizer = policy
    (tmp_path / "config.json").write_text("{}")  # not a model: the server exits during start-up
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RuntimeError, match="exited with code") as info:
        make_engine("vllm-server", model=model, tokenizer=tokenizer, model_path=str(tmp_path), max_model_len=512,
                    server_timeout_s=240, dtype="float32")
    message = str(info.value)
    assert "model_type" in message  # vLLM's own complaint, from the log tail
    log = Path(re.search(r"log (\S+server\.log):", message).group(1))
    assert log.exists()  # kept for the user when the server died by itself
    shutil.rmtree(log.parent)
    leftovers = [p for p in psutil.Process().children(recursive=True) if p.pid not in children_before and alive(p)]
    assert not leftovers


def test_sidecar_dies_with_a_killed_trainer(tiny_model, kv_cache_env):
    """SIGKILL skips close() and atexit; the server's parent-death signal must still stop it."""
    script = ("import sys, time\n"
              "from trainer.rollout import make_engine\n"
              "engine = make_engine('vllm-server', model=None, tokenizer=None, model_path=sys.argv[1], "
              "max_model_len=512)\n"
              "print(engine.pid, engine.server.workdir, flush=True)\n"
              "time.sleep(600)\n")
    trainer = subprocess.Popen([sys.executable, "-c", script, tiny_model], stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).resolve().parents[2])
    try:
        pid, workdir = trainer.stdout.readline().split()
        processes = [psutil.Process(int(pid)), *psutil.Process(int(pid)).children(recursive=True)]
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in [*processes, *process_group(int(pid))]):
        time.sleep(0.5)
    survivors = [p for p in [*processes, *process_group(int(pid))] if alive(p)]
    for p in survivors:  # do not leave them behind when the test fails
        p.kill()
    shutil.rmtree(workdir, ignore_errors=True)
    assert not survivors, "the server outlived the killed trainer"
