"""`alignflow chat MODEL`: talk to a checkpoint, in a REPL or one prompt at a time.

    alignflow chat outputs/sft                                   # REPL: /reset, /exit
    alignflow chat s3://bucket/runs/dpo --prompt "Hi" --seed 0   # one reply, reproducible
    alignflow chat models:/alignflow-policy@champion --engine vllm

MODEL is a local folder, an s3:// prefix, a LoRA adapter folder (loaded on its base model), a
`models:/NAME@ALIAS` (or `/VERSION`) MLflow registry URI, or a hub id. The conversation is
rendered with the checkpoint's chat template; a tokenizer without one gets the turns as plain
text, one per line, and the model continues it. Generation goes through the project's rollout
engines (`trainer/rollout`): `hf` (transformers `generate`, the default) or `vllm` (in-process).
A reply ends at the tokenizer's eos or the model's generation-config eos tokens, or after
`--max_new_tokens`.

With `--seed`, turn i of a conversation samples with seed `seed + i`: the same conversation gives
the same replies (per engine), and `/reset` starts the count again.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from trainer.rollout import SamplingConfig, make_engine

HELP = "Chat with a model (a REPL, or one reply with --prompt)."
COMMANDS = "/reset clears the conversation, /exit (or Ctrl-D) leaves."


@dataclass
class ChatSession:
    """A conversation with one model: its history, how to render it, and the engine that answers."""

    tokenizer: object
    engine: object
    sampling: SamplingConfig
    max_model_len: int
    system: str | None = None
    seed: int | None = None
    history: list[dict] = field(default_factory=list)

    @property
    def templated(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The token ids the model continues: the chat template with the generation prompt, or plain text."""
        from trainer.engine.completions import prompt_token_ids

        if self.templated:
            return prompt_token_ids(messages, self.tokenizer)
        return prompt_token_ids("\n".join(m["content"] for m in messages) + "\n", self.tokenizer)

    def _fitting_prompt(self, message: str) -> list[int]:
        """The prompt for `message` after the history; the oldest turns are dropped while it does not fit."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        while True:
            ids = self.prompt_ids(head + self.history + [{"role": "user", "content": message}])
            if len(ids) + self.sampling.max_new_tokens <= self.max_model_len or not self.history:
                break
            del self.history[:2]  # one user turn and its reply
        if len(ids) + self.sampling.max_new_tokens > self.max_model_len:
            raise ValueError(f"the message is {len(ids)} tokens; with --max_new_tokens "
                             f"{self.sampling.max_new_tokens} it exceeds the model's {self.max_model_len}-token "
                             "context: shorten it or lower --max_new_tokens.")
        return ids

    def reply(self, message: str) -> str:
        """Answer `message` after the conversation so far, and remember both."""
        ids = self._fitting_prompt(message)
        turn = len(self.history) // 2
        sampling = dataclasses.replace(self.sampling, seed=None if self.seed is None else self.seed + turn)
        completion = self.engine.generate([ids], sampling)[0][0]
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True).strip()
        self.history += [{"role": "user", "content": message}, {"role": "assistant", "content": text}]
        return text

    def reset(self) -> None:
        self.history.clear()


# ----------------------------------------------------------------------------------------------
# Opening a model


def local_model(spec: str, workdir: str, tracking_uri: str | None = None) -> str:
    """A local folder (or hub id) for a path, s3:// prefix or `models:/` registry URI; a complete checkpoint."""
    from trainer.engine.models import resolve_model_path

    if spec.startswith("models:/"):  # a registered version: its checkpoint files, without the completion marker
        from trainer.stages.promote import download_model

        return download_model(spec, workdir, tracking_uri)
    return resolve_model_path(spec)


def stop_ids(tokenizer, path: str) -> list[int]:
    """The tokens that end a reply: the tokenizer's eos and the generation config's eos id(s)."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)


def context_length(model_config, tokenizer, asked: int) -> int:
    if asked:
        return asked
    known = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    return int(known or min(tokenizer.model_max_length, 4096))


def open_session(args: argparse.Namespace, workdir: str) -> ChatSession:
    """Load MODEL and its tokenizer and start the engine `args` ask for."""
    import torch
    from transformers import AutoConfig

    from trainer.engine.models import _is_adapter, load_causal_lm, load_tokenizer
    from trainer.engine.precision import slow_half_precision

    path = local_model(args.model, workdir, args.tracking_uri)
    tokenizer = load_tokenizer(path, args.trust_remote_code)
    adapter = _is_adapter(path)
    model = None
    if args.engine == "hf" or adapter:  # vLLM needs a full model folder: merge the adapter first
        model = load_causal_lm(path, args.dtype, args.trust_remote_code)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model.to(device)
        if args.engine == "hf" and (warning := slow_half_precision(device, model.dtype, "`--dtype float32`")):
            print(f"alignflow chat: {warning}", file=sys.stderr)
    if args.engine == "vllm" and adapter:
        path = str(Path(workdir, "merged"))
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    max_len = context_length(model.config if model is not None else AutoConfig.from_pretrained(path), tokenizer,
                             args.max_model_len)
    if args.engine == "vllm":  # read when vllm is imported, which make_engine does
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the replies only
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    engine = make_engine(args.engine, model=model if args.engine == "hf" else None, tokenizer=tokenizer,
                         model_path=path, max_model_len=max_len, dtype=args.dtype, seed=seed,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         max_sequences=1)  # one reply a call: on the CPU, the KV cache of one max_len sequence
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, stop_token_ids=stop_ids(tokenizer, path))
    return ChatSession(tokenizer, engine, sampling, max_len, system=args.system, seed=args.seed)


# ----------------------------------------------------------------------------------------------
# The command


def repl(session: ChatSession, stdin: TextIO, stdout: TextIO) -> None:
    """Read a line, answer it, until /exit or end of input. On a terminal, prompts and line editing."""
    tty = stdin.isatty()
    if tty:
        import readline  # noqa: F401 (line editing and history for input())

        template = "the chat template" if session.templated else "plain text (the tokenizer has no chat template)"
        print(f"Chatting through {template}. {COMMANDS}", file=stdout)
    while True:
        try:
            line = input("you> ") if tty else stdin.readline()
        except (EOFError, KeyboardInterrupt):
            break
        if not tty and not line:
            break
        line = line.strip()
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            session.reset()
            print("(conversation cleared)", file=stdout, flush=True)
        elif line.startswith("/"):
            print(f"(unknown command {line.split()[0]}; {COMMANDS})", file=stdout, flush=True)
        elif line:
            print(("model> " if tty else "") + session.reply(line), file=stdout, flush=True)


def make_parser() -> argparse.ArgumentParser:
    from trainer.cli.main import (
        FlagParser,  # --max_new_tokens or --max-new-tokens, as every alignflow command
    )

    parser = FlagParser(prog="alignflow chat", description=HELP, allow_abbrev=False,
                                     epilog=f"In the REPL: {COMMANDS} Without a terminal, each input line is one "
                                            "user turn and each reply is printed on one line.")
    parser.add_argument("model", help="A model folder, an s3:// prefix, a LoRA adapter folder, an MLflow registry "
                                      "URI models:/NAME@ALIAS or models:/NAME/VERSION, or a hub id.")
    parser.add_argument("--prompt", help="Answer this one message, print the reply and exit (no REPL).")
    parser.add_argument("--system", help="A system message opening the conversation (chat templates only).")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                        help="Generation engine: transformers `generate` (default) or in-process vLLM.")
    parser.add_argument("--max_new_tokens", type=int, default=256, help="Longest reply, in tokens (default 256).")
    parser.add_argument("--temperature", type=float, default=0.7, help="Sampling temperature; 0 = greedy "
                                                                        "(default 0.7).")
    parser.add_argument("--top_p", type=float, default=1.0, help="Nucleus sampling mass in (0, 1] (default 1.0).")
    parser.add_argument("--top_k", type=int, default=-1, help="Sample from the k likeliest tokens; -1 = off "
                                                             "(default).")
    parser.add_argument("--seed", type=int, help="Make replies reproducible: turn i samples with seed + i "
                                                 "(default: a random seed).")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="Weight dtype for generation (default float32).")
    parser.add_argument("--max_model_len", type=int, default=0,
                        help="Context length; older turns are dropped to fit (default: the model's).")
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.9,
                        help="vLLM: share of GPU memory for weights and KV cache (default 0.9).")
    parser.add_argument("--tracking_uri", help="MLflow tracking URI for models:/ URIs (default: "
                                               "MLFLOW_TRACKING_URI).")
    parser.add_argument("--trust_remote_code", action="store_true", help="Allow model code from the checkpoint.")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Bad flags fail here, in one line, before any model is loaded."""
    try:
        SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                       top_k=args.top_k)
    except ValueError as err:
        parser.error(f"--{err}")
    if args.max_model_len < 0:
        parser.error(f"--max_model_len must be >= 0 (0 = the model's), got {args.max_model_len}")


def main(argv: list[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    from trainer.errors import ModelError, RegistryError, StorageError

    parser = make_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    with tempfile.TemporaryDirectory(prefix="alignflow-chat-") as workdir:
        try:
            with contextlib.redirect_stdout(sys.stderr):  # what libraries print while loading is not a reply
                session = open_session(args, workdir)
            with session.engine:
                if args.prompt is not None:
                    print(session.reply(args.prompt), file=stdout, flush=True)
                else:
                    repl(session, stdin, stdout)
        except (ModelError, RegistryError, StorageError, OSError, ValueError, ImportError) as err:
            print(f"alignflow chat: error: {err}", file=sys.stderr)
            return 2
    return 0
