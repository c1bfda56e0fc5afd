"""The trainer's side of `alignflow rollout-server`, against a stand-in HTTP server (no vLLM, fast):
the errors a user meets, how weights are streamed (over HTTP, /dev/shm, or a real gloo weight group with the
stand-in's worker thread), the choice of channel, and `distributed.full_weights` (module by module, LoRA merged).

The real server is exercised in tests/e2e/test_rollout_server.py."""

from __future__ import annotations

import json
import logging
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import serve_in_thread
from trainer.engine import distributed
from trainer.engine.launch import free_port
from trainer.errors import ConfigError, RolloutServerError
from trainer.rollout import SamplingConfig
from trainer.rollout.server_client import VLLMServerEngine, server_url
from trainer.rollout.weight_group import WeightGroup, open_store

NAMES = ["model.embed_tokens.weight", "lm_head.weight"]


class StandIn(ThreadingHTTPServer):
    """Answers /ready like the real server, one fixed completion per request, and records weight chunks."""

    def __init__(self, max_model_len: int = 64, sees_shared_memory: bool = False, weight_group: dict | None = None):
        self.info = {"model": "m", "max_model_len": max_model_len, "dtype": "float32", "weight_names": NAMES,
                     "weight_group": weight_group}
        self.sees_shared_memory = sees_shared_memory  # as a server on another node (False) or this one (True)
        self.joins_group = True  # False: answers /weights/group/init but starts no store (a closed port)
        self.group: WeightGroup | None = None  # the stand-in's one worker, rank 0 (as vllm_ext.py's)
        self.store = None
        self.files: list[str] = []
        self.chunks: list[dict[str, torch.Tensor]] = []
        self.commits = 0
        self.requests: list[dict] = []
        super().__init__(("127.0.0.1", 0), Handler)
        serve_in_thread(self)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _reply(self, body: dict, code: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._reply(self.server.info)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/weights/chunk":
            from safetensors.torch import load

            self.server.chunks.append(load(body))
            return self._reply({"tensors": len(self.server.chunks[-1])})
        if self.path == "/weights/probe":
            probe = json.loads(body)
            seen = self.server.sees_shared_memory and Path(probe["path"]).read_text() == probe["token"]
            return self._reply({"shared": seen})
        if self.path == "/weights/file":
            from safetensors.torch import load_file

            path = json.loads(body)["path"]
            self.server.files.append(path)
            self.server.chunks.append(load_file(path))
            Path(path).unlink()  # the real server moves it into its staging folder
            return self._reply({"tensors": len(self.server.chunks[-1])})
        if self.path == "/weights/group/init":
            body = json.loads(body)
            if self.server.joins_group:  # as vllm_ext.WeightSyncExtension.alignflow_group_init: blocks until joined
                if self.server.store is None:  # kept for later groups, as the worker keeps it
                    self.server.store = open_store("127.0.0.1", body["port"], serve=True, timeout_s=body["timeout"])
                self.server.group = WeightGroup(self.server.store, group_id=body["group_id"], rank=0, world_size=2,
                                                timeout_s=body["timeout"], backend="gloo", peer="127.0.0.1")
            return self._reply({"world_size": 2})
        if self.path == "/weights/group/update":
            self.server.chunks.append(dict(self.server.group.receive()))
            return self._reply({"seconds": 0.01})
        if self.path == "/weights/commit":
            self.server.commits += 1
            return self._reply({"seconds": 0.01})
        request = json.loads(body)
        self.server.requests.append(request)
        choices = [{"index": j, "token_ids": [7, 8, 2], "logprobs": {"token_logprobs": [-0.5, -0.25, -1.0]}}
                   for j in range(request["n"])]
        self._reply({"choices": choices})


@pytest.fixture
def standin():
    server = StandIn()
    yield server
    server.stop()


def test_server_url_from_trl_options():
    assert server_url(None, None, None) is None
    assert server_url("10.0.0.2", None, None) == "http://10.0.0.2:8000"  # TRL's default port
    assert server_url(None, 9000, None) == "http://127.0.0.1:9000"
    assert server_url("h", 1, "http://rollout:8000/") == "http://rollout:8000"


def test_an_unreachable_server_is_one_line_naming_the_options_within_the_timeout():
    started = time.monotonic()
    with pytest.raises(RolloutServerError) as info:
        VLLMServerEngine(f"http://127.0.0.1:{free_port()}", max_model_len=64, timeout_s=1.5)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert 1.5 <= elapsed < 6, elapsed
    assert "\n" not in message
    assert "within 1.5 s" in message and "vllm_server_timeout" in message and "alignflow rollout-server" in message


def test_a_server_that_stops_mid_run_is_one_line(standin):
    engine = VLLMServerEngine(standin.url, max_model_len=64, timeout_s=5)
    assert engine.generate([[5, 6]], SamplingConfig(max_new_tokens=4))[0][0].token_ids == [7, 8, 2]
    standin.stop()
    with pytest.raises(RolloutServerError, match="stopped answering") as info:
        engine.generate([[5, 6]], SamplingConfig(max_new_tokens=4))
    assert "\n" not in str(info.value) and "resume_from_checkpoint" in str(info.value)


def test_a_server_too_short_for_the_run_is_refused(standin):
    with pytest.raises(RolloutServerError, match="--max_model_len 100"):
        VLLMServerEngine(standin.url, max_model_len=100, timeout_s=5)


def test_requests_carry_a_seed_per_prompt_that_does_not_depend_on_the_batch(standin):
    engine = VLLMServerEngine(standin.url, max_model_len=64, timeout_s=5)
    out = engine.generate([[5], [6]], SamplingConfig(max_new_tokens=4, n=3, seed=11, prompt_keys=[40, 41],
                                                     stop_token_ids=[8]))
    assert [c.token_ids for c in out[0]] == [[7, 8]] * 3 and out[0][0].finish_reason == "stop"
    seeds = sorted(r["seed"] for r in standin.requests)
    engine.generate([[6]], SamplingConfig(max_new_tokens=4, n=3, seed=11, prompt_keys=[41]))  # alone: same seed
    assert standin.requests[-1]["seed"] == seeds[1] and seeds[0] != seeds[1]


@pytest.mark.parametrize("same_node", [False, True], ids=["http", "shared-memory"])
def test_sync_weights_streams_chunks_then_commits_once(standin, same_node):
    """Over HTTP to a server that cannot see this process's /dev/shm; as files in /dev/shm to one that can (the
    probe file's token read back), the push folder removed on close."""
    standin.sees_shared_memory = same_node
    engine = VLLMServerEngine(standin.url, max_model_len=64, timeout_s=5, chunk_bytes=100)
    assert (engine.shared_dir is not None) == same_node and not standin.requests  # the probe is no completion
    shared = torch.randn(4, 8)  # tied: two names, one storage (safetensors refuses shared tensors)
    tensors = [("model.embed_tokens.weight", shared), ("lm_head.weight", shared), ("b", torch.ones(3))]
    engine.sync_weights(iter(tensors))
    assert len(standin.chunks) == 3 and standin.commits == 1  # 128 B each: one chunk per tensor
    got = {k: v for chunk in standin.chunks for k, v in chunk.items()}
    assert set(got) == {name for name, _ in tensors}
    for name, tensor in tensors:
        assert torch.equal(got[name], tensor)
    assert engine.last_push["bytes"] > 0 and engine.last_push["chunks"] == 3
    assert engine.last_push["channel"] == ("shared_memory" if same_node else "http")
    assert len(standin.files) == (3 if same_node else 0)
    assert all(Path(f).parent == engine.shared_dir for f in standin.files)
    folder = engine.shared_dir
    engine.close()
    assert folder is None or not folder.exists()


GLOO = {"backend": "gloo", "workers": 1}


def test_sync_weights_over_a_weight_group_broadcasts_each_tensor_and_a_new_engine_forms_a_new_group(standin):
    """A server that offers a weight group and does not see this process's /dev/shm (another node): the first push
    forms the group (this process is rank 1, the stand-in's worker rank 0 serves the store), each tensor is
    broadcast with its name, dtype and shape; a second engine (a restarted trainer) forms a new group."""
    standin.info["weight_group"] = GLOO
    port = free_port()
    engine = VLLMServerEngine(standin.url, max_model_len=64, timeout_s=10, group_port=port)
    assert engine.channel == "group" and engine.group is None  # formed at the first push, by the pushing rank only
    tied = torch.randn(4, 8)
    tensors = [("model.embed_tokens.weight", tied), ("lm_head.weight", tied), ("b", torch.arange(3.0)),
               ("scalar", torch.tensor(2.5)), ("half", torch.ones(2, 3, dtype=torch.float16))]
    groups = []
    for _ in range(2):  # the second push reuses the group
        engine.sync_weights(iter(tensors))
        groups.append(engine.group)
        got = standin.chunks[-1]
        assert list(got) == [name for name, _ in tensors]
        for name, tensor in tensors:
            assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor.float())  # the server's dtype
        assert engine.last_push["channel"] == "group" and engine.last_push["chunks"] == 5
        assert engine.last_push["bytes"] == 4 * (32 + 32 + 3 + 1 + 6)
    assert groups[0] is groups[1] is not None
    first = standin.group
    restarted = VLLMServerEngine(standin.url, max_model_len=64, timeout_s=10, group_port=port)
    restarted.sync_weights(iter(tensors[:1]))
    assert standin.group is not first and list(standin.chunks[-1]) == [tensors[0][0]]
    first.close()
    engine.close()
    restarted.close()
    assert engine.group is None and restarted.group is None


@pytest.mark.parametrize(("offer", "group_port", "sees_shared_memory", "channel", "why"), [
    (GLOO, 51216, True, "shared_memory", None),
    (GLOO, 51216, False, "group", None),
    (None, 51216, False, "http", "offers no weight group"),
    (GLOO, 0, False, "http", "vllm_group_port is 0"),
    ({"backend": "nccl", "workers": 2}, 51216, False, "http", "sees no CUDA device"),
], ids=["shared-memory", "group", "no-offer", "port-0", "nccl-without-cuda"])
def test_the_channel_is_shared_memory_then_the_weight_group_then_http_with_one_line_saying_why(
        standin, caplog, offer, group_port, sees_shared_memory, channel, why):
    if offer and offer["backend"] == "nccl" and torch.cuda.is_available():
        pytest.skip("this process has a CUDA device")
    standin.info["weight_group"], standin.sees_shared_memory = offer, sees_shared_memory
    with caplog.at_level(logging.INFO, logger="trainer.rollout.server_client"):
        engine = VLLMServerEngine(standin.url, max_model_len=64, timeout_s=5, group_port=group_port)
    assert engine.channel == channel
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.rollout.server_client"]
    assert len(lines) == (0 if why is None else 1)
    assert why is None or (lines[0].startswith(f"Weights go to the rollout server at {standin.url} over HTTP: ")
                           and why in lines[0])
    engine.close()


def test_a_forced_channel_that_is_not_available_is_an_error(standin):
    with pytest.raises(RolloutServerError, match="no weight group .*offers no weight group"):
        VLLMServerEngine(standin.url, max_model_len=64, timeout_s=5, channel="group")
    with pytest.raises(RolloutServerError, match="does not see this process's /dev/shm"):
        VLLMServerEngine(standin.url, max_model_len=64, timeout_s=5, channel="shared_memory")
    with pytest.raises(ValueError, match="choose one of shared_memory, group, http"):
        VLLMServerEngine(standin.url, max_model_len=64, timeout_s=5, channel="nccl")


def test_a_weight_group_that_cannot_form_is_one_line_naming_the_port_within_the_timeout(standin):
    """The server answers /weights/group/init but nothing listens at the group port (a firewall, a port taken): the
    first push fails within vllm_server_timeout, naming host:port and the options that fix it."""
    standin.info["weight_group"], standin.joins_group = GLOO, False
    port = free_port()
    engine = VLLMServerEngine(standin.url, max_model_len=64, timeout_s=1.5, group_port=port)
    started = time.monotonic()
    with pytest.raises(RolloutServerError) as info:
        engine.sync_weights(iter([("b", torch.ones(3))]))
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert 1.5 <= elapsed < 6, elapsed
    assert "\n" not in message
    assert f"127.0.0.1:{port} within 1.5 s" in message
    assert "vllm_server_timeout" in message and "vllm_group_port" in message and f"open TCP port {port}" in message
    assert engine.group is None and not standin.chunks
    engine.close()


def test_server_options_need_the_server_engine_and_one_address(tmp_path):
    from tests.helpers import grpo_config

    with pytest.raises(ConfigError, match="`vllm_server_host` addresses a rollout server.*rollout_engine vllm-server"):
        grpo_config("m", tmp_path, vllm_server_host="h")
    with pytest.raises(ConfigError, match="not both"):
        grpo_config("m", tmp_path, rollout_engine="vllm-server", vllm_server_port=9, vllm_server_base_url="http://h:9")
    with pytest.raises(ConfigError, match="vllm_server_timeout"):
        grpo_config("m", tmp_path, rollout_engine="vllm-server", vllm_server_timeout=0)
    with pytest.raises(ConfigError, match="vllm_group_port"):
        grpo_config("m", tmp_path, rollout_engine="vllm-server", vllm_group_port=70000)


# -- distributed.full_weights ---------------------------------------------------------------------


def _tiny_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


NO_DEEPSPEED = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None))


def test_full_weights_is_the_state_dict_module_by_module():
    model = _tiny_lm()
    got = dict(distributed.full_weights(NO_DEEPSPEED, model, model))
    expected = model.state_dict()
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_full_weights_of_a_lora_model_are_the_merged_weights_and_leave_the_base_untouched():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny_lm(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # B starts at 0: make the adapter change something
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = dict(distributed.full_weights(NO_DEEPSPEED, model, model))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing merged in place
    import copy

    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(got) == set(merged)
    assert max(float((got[k] - merged[k]).abs().max()) for k in merged) < 1e-6
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q], before[f"base_model.model.{q.removesuffix('.weight')}.base_layer.weight"])


def test_a_loopback_server_is_each_nodes_own_and_its_first_rank_pushes():
    from trainer.rollout.server_client import on_each_node

    assert on_each_node(None)  # each node's first rank starts one
    assert on_each_node("http://127.0.0.1:8000") and on_each_node("http://localhost:8000/")
    assert not on_each_node("http://rollout.ml.svc:8000") and not on_each_node("http://10.0.0.7:8000")
