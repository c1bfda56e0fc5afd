"""`alignflow chat`: replies from a trained checkpoint through its chat template, reproducible with a seed."""

import io

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelines import cli
from tests.helpers import tiny_sft
from trainer import chat
from trainer.rollout import Completion

QUESTION = "What is the capital of Peru?"


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory) -> str:
    """SFT on the demo chat data for 10 steps: enough for greedy replies that depend on the prompt."""
    return tiny_sft(tiny_model, tmp_path_factory.mktemp("chat") / "sft")


def run_chat(capsys, *args: str) -> str:
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


def test_prompt_replies_through_the_chat_template(trained, capsys):
    """The greedy reply is transformers' own greedy continuation of the templated prompt, and not
    that of the bare text: the template was applied."""
    reply = run_chat(capsys, trained, "--prompt", QUESTION, "--temperature", "0", "--max_new_tokens", "16")
    tokenizer = AutoTokenizer.from_pretrained(trained)
    templated = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                              return_dict=True)["input_ids"]
    assert reply, "no reply"
    assert reply == direct_greedy(trained, templated, 16)
    assert reply != direct_greedy(trained, tokenizer(QUESTION)["input_ids"], 16)


def test_sampled_reply_is_reproducible_with_a_seed(trained, capsys):
    args = (trained, "--prompt", QUESTION, "--temperature", "1.0", "--top_p", "0.95", "--max_new_tokens", "16")
    first = run_chat(capsys, *args, "--seed", "3")
    assert first and first == run_chat(capsys, *args, "--seed", "3")
    assert first != run_chat(capsys, *args, "--seed", "4")


def test_repl_keeps_history_and_resets(trained):
    """Piped input: one turn per line. The second turn is answered after the first (its prompt holds
    the history); after /reset the first question gets the first answer again; /exit ends the session."""
    lines = [QUESTION, "And of France?", "/reset", QUESTION, "/exit", "never asked"]
    out = io.StringIO()
    argv = [trained, "--temperature", "0", "--max_new_tokens", "12"]
    assert chat.main(argv, stdin=io.StringIO("\n".join(lines) + "\n"), stdout=out) == 0
    first, second, cleared, again = out.getvalue().splitlines()
    assert cleared == "(conversation cleared)"
    assert again == first
    tokenizer = AutoTokenizer.from_pretrained(trained)
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first},
               {"role": "user", "content": "And of France?"}]
    ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert second == direct_greedy(trained, ids, 12)


def test_history_is_trimmed_to_the_context(tiny_model):
    """The oldest turns go when the conversation outgrows the context; a message alone too long is an error."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    class Echo:  # answers "ok" without a model: this test is about the prompt
        def generate(self, prompts, sampling):
            self.last = prompts[0]
            ids = tokenizer("ok", add_special_tokens=False)["input_ids"]
            return [[Completion(ids, [0.0] * len(ids), "stop")]]

    session = chat.ChatSession(tokenizer, Echo(), chat.SamplingConfig(max_new_tokens=8), max_model_len=60)
    for i in range(6):
        session.reply(f"message number {i}")
    assert len(session.engine.last) + 8 <= 60
    assert session.history[-2]["content"] == "message number 5" and len(session.history) < 12
    with pytest.raises(ValueError, match="max_new_tokens"):
        session.reply("word " * 100)


def test_tokenizer_without_template_gets_plain_text(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = None
    session = chat.ChatSession(tokenizer, None, chat.SamplingConfig(max_new_tokens=4), max_model_len=100)
    turns = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
             {"role": "user", "content": "again"}]
    assert session.prompt_ids(turns) == tokenizer("hello\nhi\nagain\n")["input_ids"]


def test_lora_adapter_folder_chats_on_its_base(tiny_model, tmp_path, capsys):
    adapter = tiny_sft(tiny_model, tmp_path / "lora", lora_r=8, learning_rate=1e-2)
    reply = run_chat(capsys, adapter, "--prompt", QUESTION, "--temperature", "0", "--max_new_tokens", "8")
    from trainer.models import load_causal_lm

    merged = tmp_path / "merged"
    load_causal_lm(adapter).save_pretrained(merged)
    AutoTokenizer.from_pretrained(adapter).save_pretrained(merged)
    ids = AutoTokenizer.from_pretrained(adapter).apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert reply and reply == direct_greedy(str(merged), ids, 8)


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top_p", "0"], "--top_p must be in (0, 1]"),
    (["--max_new_tokens", "0"], "--max_new_tokens must be >= 1"),
    (["--max-new-tokens", "0"], "--max_new_tokens must be >= 1"),  # dashes, as on every alignflow command
])
def test_bad_flags_fail_before_loading(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["chat", "no/such/model/anywhere", "--prompt", "x", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_model_is_one_line(tmp_path, capsys):
    assert cli.main(["chat", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("alignflow chat: error:") and "does not exist" in err and "\n" not in err


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit):
        cli.main(["chat", "--help"])
    out = capsys.readouterr().out
    for action in chat.make_parser()._actions:
        for flag in action.option_strings:
            assert flag in out
    assert "/reset" in out and "models:/" in out


def test_repl_on_a_terminal(trained, capsys):
    """On a TTY (a pseudo-terminal here): a banner, `you>` prompts, `model>` replies, /reset, /exit."""
    import os
    import select
    import subprocess
    import sys
    import time

    from tests.helpers import ROOT

    expected = run_chat(capsys, trained, "--prompt", QUESTION, "--temperature", "0", "--max_new_tokens", "8")
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "chat", trained, "--temperature", "0",
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
