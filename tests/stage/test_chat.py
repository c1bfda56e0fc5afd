"""`alignflow chat`: replies from a trained checkpoint through its chat template, reproducible with a seed."""

import io

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelines import cli
from tests.helpers import slow_bf16_kernels, tiny_sft
from trainer.cli import chat

QUESTION = "What is the capital of Peru?"


def run_chat(capsys, *args: str) -> str:
    """The reply `alignflow chat` prints, and nothing the test printed before it (training, imports)."""
    capsys.readouterr()
    assert cli.main(["chat", *args]) == 0
    return capsys.readouterr().out.rstrip("\n")


def direct_greedy(folder: str, ids: list[int], max_new_tokens: int) -> str:
    """Plain transformers `generate` (greedy, stopping at eos) on exactly these prompt ids."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).strip()


def test_prompt_replies_through_the_chat_template(sft_checkpoint, capsys):
    """The greedy reply is transformers' own greedy continuation of the templated prompt, and not
    that of the bare text: the template was applied."""
    reply = run_chat(capsys, sft_checkpoint, "--prompt", QUESTION, "--temperature", "0", "--max_new_tokens", "16")
    tokenizer = AutoTokenizer.from_pretrained(sft_checkpoint)
    templated = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                              return_dict=True)["input_ids"]
    assert reply, "no reply"
    assert reply == direct_greedy(sft_checkpoint, templated, 16)
    assert reply != direct_greedy(sft_checkpoint, tokenizer(QUESTION)["input_ids"], 16)


def test_sampled_reply_is_reproducible_with_a_seed(sft_checkpoint, capsys):
    args = (sft_checkpoint, "--prompt", QUESTION, "--temperature", "1.0", "--top_p", "0.95", "--max_new_tokens", "16")
    first = run_chat(capsys, *args, "--seed", "3")
    assert first and first == run_chat(capsys, *args, "--seed", "3")
    assert first != run_chat(capsys, *args, "--seed", "4")


def test_repl_keeps_history_and_resets(sft_checkpoint):
    """Piped input: one turn per line. The second turn is answered after the first (its prompt holds
    the history); after /reset the first question gets the first answer again; /exit ends the session."""
    lines = [QUESTION, "And of France?", "/reset", QUESTION, "/exit", "never asked"]
    out = io.StringIO()
    argv = [sft_checkpoint, "--temperature", "0", "--max_new_tokens", "12"]
    assert chat.main(argv, stdin=io.StringIO("\n".join(lines) + "\n"), stdout=out) == 0
    first, second, cleared, again = out.getvalue().splitlines()
    assert cleared == "(conversation cleared)"
    assert again == first
    tokenizer = AutoTokenizer.from_pretrained(sft_checkpoint)
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first},
               {"role": "user", "content": "And of France?"}]
    ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert second == direct_greedy(sft_checkpoint, ids, 12)


def test_bfloat16_where_the_cpu_has_slow_bf16_kernels_warns_on_stderr_and_replies(sft_checkpoint, capsys,
                                                                                   monkeypatch):
    """`--dtype bfloat16` on a CPU whose bfloat16 matmuls are slow (faked: the probe measures the hardware) says so
    on stderr, naming `--dtype float32`; stdout carries the reply alone."""
    slow_bf16_kernels(monkeypatch)
    capsys.readouterr()
    assert cli.main(["chat", sft_checkpoint, "--prompt", QUESTION, "--temperature", "0", "--max_new_tokens", "4",
                     "--dtype", "bfloat16"]) == 0
    out, err = capsys.readouterr()
    assert "alignflow chat: bfloat16 is slow on this CPU" in err and "(`--dtype float32`)" in err
    assert out.strip() and "slow" not in out


def test_lora_adapter_folder_chats_on_its_base(tiny_model, tmp_path, capsys):
    adapter = tiny_sft(tiny_model, tmp_path / "lora", lora_r=8, learning_rate=1e-2)
    reply = run_chat(capsys, adapter, "--prompt", QUESTION, "--temperature", "0", "--max_new_tokens", "8")
    from trainer.engine.models import load_causal_lm

    merged = tmp_path / "merged"
    load_causal_lm(adapter).save_pretrained(merged)
    AutoTokenizer.from_pretrained(adapter).save_pretrained(merged)
    ids = AutoTokenizer.from_pretrained(adapter).apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert reply and reply == direct_greedy(str(merged), ids, 8)


def test_repl_on_a_terminal(sft_checkpoint, capsys):
    """On a TTY (a pseudo-terminal here): a banner, `you>` prompts, `model>` replies, /reset, /exit."""
    import os
    import select
    import subprocess
    import sys
    import time

    from tests.helpers import ROOT

    expected = run_chat(capsys, sft_checkpoint, "--prompt", QUESTION, "--temperature", "0", "--max_new_tokens", "8")
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "chat", sft_checkpoint, "--temperature", "0",
                             "--max_new_tokens", "8"], stdin=slave, stdout=slave, stderr=subprocess.DEVNULL,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    os.close(slave)
    os.write(master, f"{QUESTION}\n/reset\n/exit\n".encode())  # the terminal holds them until read
    out, deadline = b"", time.monotonic() + 120
    try:
        while select.select([master], [], [], max(0.0, deadline - time.monotonic()))[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        if proc.poll() is None:  # it hung: fail below, leave nothing running
            proc.kill()
        proc.wait()
        os.close(master)
    text = out.decode(errors="replace").replace("\r\n", "\n")
    assert proc.returncode == 0, text
    assert "Chatting through the chat template." in text
    assert f"model> {expected}\n" in text and "(conversation cleared)" in text and text.count("you> ") == 3
