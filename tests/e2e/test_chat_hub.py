"""`alignflow chat` and `push_to_hub` with real parts: a checkpoint in a SeaweedFS bucket, the full
`alignflow train` command line pushing to a stand-in of the Hub's HTTP API (HF_ENDPOINT)."""

import os
from pathlib import Path

import pytest

from pipelines import cli
from tests.helpers import CHAT_DATA, HubStandIn, needs_vllm, tiny_sft, train_cli
from trainer.engine import checkpoint as ckpt
from trainer.engine import hub
from trainer.io import storage

QUESTION = "What is the capital of Peru?"


@pytest.fixture
def stand_in():
    server = HubStandIn()
    yield server
    server.close()


def test_train_push_to_hub_uploads_the_final_folder_with_its_card(tiny_model, tmp_path, stand_in):
    """The repo is created private under the asked owner, the card passes the YAML check, and the final
    model's files arrive byte for byte, with the token, and without the step checkpoint beside them."""
    out = tmp_path / "sft"
    train_cli("sft", "--model", tiny_model, "--dataset", str(CHAT_DATA), "--output_dir", str(out),
              "--max_steps", "4", "--save_steps", "2", "--per_device_batch_size", "4", "--max_length", "128",
              "--num_sample_completions", "0", "--disable_progress_bar", "true", "--push_to_hub", "true",
              "--hub_model_id", "someone/tiny-sft", "--hub_private_repo", "true",
              timeout=300, env={"HF_ENDPOINT": stand_in.url, "HF_TOKEN": "hf_test_token", "HF_HUB_OFFLINE": "0",
                                "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HOME": str(tmp_path / "hf_home")})
    # Nothing else was asked of the Hub (a GET of its agent-harness list, for the user agent, may come and get a 404).
    assert [u for u in stand_in.unknown if not u.startswith("GET /api/agent-harnesses")] == []
    assert [(c["organization"], c["name"], c.get("visibility")) for c in stand_in.created] == \
        [("someone", "tiny-sft", "private")]
    assert set(stand_in.auth) == {"Bearer hf_test_token"}
    assert (out / "checkpoint-2").is_dir()  # a step checkpoint was written, and stays home
    local = {f.relative_to(out).as_posix(): f.read_bytes() for f in out.rglob("*")
             if f.is_file() and not f.relative_to(out).as_posix().startswith("checkpoint-")}
    pushed = stand_in.repos["someone/tiny-sft"]
    assert sorted(pushed) == sorted(local)
    assert all(pushed[name] == local[name] for name in local)
    assert stand_in.validated == [local["README.md"].decode()]
    assert b"library_name: transformers" in pushed["README.md"] and b"# someone/tiny-sft" in pushed["README.md"]


def test_chat_and_push_from_s3(tiny_model, s3_env, tmp_path, stand_in, capsys, monkeypatch):
    """A final model in a bucket: chat answers from the s3:// prefix as from a local copy, and a push
    sends the files its marker lists (not the step checkpoint in the same prefix)."""
    import huggingface_hub.constants

    out = f"s3://{s3_env.bucket}/runs/chat-{tmp_path.name}"
    tiny_sft(tiny_model, out, save_steps=5)
    local = storage.fetch_to_local(out, tmp_path / "copy")
    replies = []
    for model in (out, local):
        assert cli.main(["chat", model, "--prompt", QUESTION, "--temperature", "1", "--seed", "3",
                         "--max_new_tokens", "12"]) == 0
        replies.append(capsys.readouterr().out)
    assert replies[0].strip() and replies[0] == replies[1]

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", stand_in.url)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    hub.push_to_hub(out, "someone/from-s3", token="hf_test_token")
    listed = [f["path"] for f in ckpt.read_json(storage.join(out, ckpt.COMPLETE_MARKER))["files"]]
    pushed = stand_in.repos["someone/from-s3"]
    assert sorted(pushed) == sorted([*listed, ckpt.COMPLETE_MARKER])
    assert "README.md" in pushed and not any(p.startswith("checkpoint-") for p in pushed)
    assert pushed["model.safetensors"] == Path(local, "model.safetensors").read_bytes()


def test_chat_from_the_registry_champion(sft_checkpoint, tmp_path, capsys):
    """`models:/NAME@champion` in an embedded (sqlite) MLflow registry answers as the checkpoint promoted there."""
    from trainer.stages.promote import promote

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    promote("chat-policy", sft_checkpoint, {"reward": 1.0}, tracking_uri=uri)
    replies = []
    for model in ("models:/chat-policy@champion", sft_checkpoint):
        assert cli.main(["chat", model, "--tracking_uri", uri, "--prompt", QUESTION, "--temperature", "0",
                         "--max_new_tokens", "12"]) == 0
        replies.append(capsys.readouterr().out)
    assert replies[0].strip() and replies[0] == replies[1]


@needs_vllm
def test_vllm_engine_chats_like_hf(sft_checkpoint, capsys, monkeypatch):
    """`--engine vllm` (in-process vLLM, in a child process here) gives the greedy reply of the `hf` engine, with
    the KV cache chat sizes itself on the CPU (VLLM_CPU_KVCACHE_SPACE unset)."""
    import subprocess
    import sys

    from tests.helpers import logged_kv_tokens, sized_kv_tokens

    args = [sft_checkpoint, "--prompt", QUESTION, "--temperature", "0", "--max_new_tokens", "16", "--max_model_len", "256"]
    assert cli.main(["chat", *args]) == 0
    hf_reply = capsys.readouterr().out
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "VLLM_LOGGING_LEVEL": "INFO"}  # INFO: its size
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", "chat", *args, "--engine", "vllm"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert hf_reply.strip() and done.stdout == hf_reply  # stdout holds the reply only (vLLM logs to stderr)
    assert logged_kv_tokens(done.stderr) == sized_kv_tokens(sft_checkpoint, max_model_len=256, sequences=1,
                                                            dtype="float32")  # vLLM's default: GiBs
