"""`alignflow chat` without a trained model: the prompt fits the context, plain text without a template, flags."""

import pytest
from transformers import AutoTokenizer

from pipelines import cli
from trainer.cli import chat
from trainer.rollout import Completion

QUESTION = "What is the capital of Peru?"


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
