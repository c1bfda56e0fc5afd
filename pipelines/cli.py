"""The `alignflow` console script: the `pipeline` commands, and every other group from `trainer.cli`.

    alignflow pipeline validate --config FILE.yaml
    alignflow pipeline compile [--out FILE.yaml] [--config FILE.yaml]
    alignflow pipeline run --local --config FILE.yaml [--output DIR] [--pipeline-root DIR|s3://...] [--retries N]
                                                      [--cache] [--verbose] [--containers [--image IMAGE]]
    alignflow pipeline submit --host URL --config FILE.yaml [--namespace NS] [--token-file F] [--run-name N] [--wait]
    alignflow pipeline schedule --host URL --config FILE.yaml --cron "0 0 3 * * *" [--namespace NS] [--token-file F]
    alignflow chat MODEL [--prompt TEXT] [--engine hf|vllm] [...]   (trainer.cli.chat)
    alignflow {train,model,eval,promote} ...   (trainer.cli)

This entry point sits above both layers (pipelines -> components -> trainer), so the training
library never imports KFP. KFP itself is imported only when a `pipeline` command runs.
"""

from __future__ import annotations

import argparse
import sys

from trainer.cli import main as trainer_cli
from trainer.engine import shutdown
from trainer.errors import MissingExtra
from trainer.extras import require

PIPELINE_HELP = "Compile, run locally, submit or schedule the post-training pipeline."


def pipeline(argv: list[str]) -> int:
    parser = trainer_cli.FlagParser(prog="alignflow pipeline", description=PIPELINE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    config_help = "Pipeline config YAML (base model, datasets, per-stage options, gate, cluster resources)."
    check = sub.add_parser("validate", help="Check the config, datasets, base model, reward functions and MLflow "
                                             "without running anything (what `run` and `submit` check first).")
    check.add_argument("--config", required=True, help=config_help)
    check.add_argument("--base-model", help="Override the config's `base_model` (a model folder).")
    comp = sub.add_parser("compile", help="Write the pipeline YAML to upload in the KFP UI.")
    comp.add_argument("--out", default="post_training.yaml", help="Output file (default post_training.yaml).")
    comp.add_argument("--config", help=config_help + " Only its `cluster` section matters here.")
    run = sub.add_parser("run", help="Run the whole DAG (kfp.local, no cluster needed).")
    run.add_argument("--local", action="store_true", required=True, help="Run on this machine (required).")
    run.add_argument("--config", required=True, help=config_help)
    run.add_argument("--output", default="pipeline-output", help="Local folder for the run (default pipeline-output).")
    run.add_argument("--base-model", help="Override the config's `base_model` (a model folder).")
    run.add_argument("--pipeline-root", help="Where task outputs go: a local folder (default OUTPUT/pipeline-root) or "
                                             "s3://bucket/prefix (outputs and checkpoints mirrored there).")
    run.add_argument("--retries", type=int, default=0,
                     help="Run a failed task again up to this many times; a training task resumes from its newest "
                          "checkpoint (default 0: on a laptop a failure is a bug to see at once).")
    run.add_argument("--cache", action="store_true",
                     help="Reuse the outputs of tasks whose inputs did not change (kfp.local's cache, under the "
                          "pipeline root).")
    run.add_argument("--containers", action="store_true",
                     help="Run every task in its own container of the trainer image (kfp.local.DockerRunner, host "
                          "network), as a cluster does: needs a Docker daemon and the image "
                          "(`bash images/build.sh --no-push --cpu`). S3/MLflow settings reach the tasks as environment.")
    run.add_argument("--image", help="With --containers: the image (default: the CPU trainer image, "
                                     "components/images.py TRAINER_CPU_IMAGE).")
    run.add_argument("--verbose", action="store_true",
                     help="Show every task's full log as it runs (always written to OUTPUT/logs/<task>.log).")
    for name, text in (("submit", "Submit one run to a KFP cluster."),
                       ("schedule", "Create a recurring run (scheduled retraining) on a KFP cluster.")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--host", required=True, help="KFP API endpoint, e.g. http://localhost:8080 or "
                                                     "https://kubeflow.example.com/pipeline.")
        p.add_argument("--config", required=True, help=config_help)
        p.add_argument("--experiment", default="alignflow", help="KFP experiment (default alignflow).")
        p.add_argument("--namespace", help="Kubeflow profile namespace to run in (multi-user Kubeflow), e.g. "
                                           "kubeflow-user-example-com.")
        p.add_argument("--token-file", help="File holding the bearer token, re-read on every refresh (a projected "
                                            "service-account token, e.g. /var/run/secrets/kubeflow/pipelines/token). "
                                            "Without it, a token in ALIGNFLOW_KFP_TOKEN is used if set.")
        p.add_argument("--ui-host", help="Base URL of the KFP UI for run links (default: --host).")
        p.add_argument("--no-cache", action="store_true", help="Run every task again: KFP's cache off for this "
                                                               "run (schedule: for every run).")
        if name == "submit":
            p.add_argument("--run-name", help="Name of the run in the KFP UI (default: pipeline name and time).")
            p.add_argument("--wait", action="store_true", help="Wait for the run to end; print its UI link and final "
                                                             "state, and exit 1 unless it succeeded.")
            p.add_argument("--poll-seconds", type=float, default=30.0, help="With --wait: seconds between checks.")
        else:
            p.add_argument("--cron", required=True, help="Six-field KFP cron, e.g. '0 0 3 * * *' (03:00 daily).")
            p.add_argument("--job-name", default="alignflow-retraining", help="Recurring run name.")
    args = parser.parse_args(argv)
    if getattr(args, "retries", 0) < 0:
        parser.error(f"--retries must be >= 0, got {args.retries}")
    try:  # KFP is the pipeline extra; without it, say so in one line
        require("kfp", feature="`alignflow pipeline`")
    except MissingExtra as err:
        print(f"alignflow pipeline {args.command}: error: {err}", file=sys.stderr)
        return 2

    from components.images import TRAINER_CPU_IMAGE
    from pipelines import cluster
    from pipelines import run as pipeline_run
    from trainer.errors import ConfigError

    try:
        overrides = {"base_model": args.base_model} if getattr(args, "base_model", None) else None
        config = pipeline_run.load_pipeline_config(args.config, overrides) if args.config else None
        if args.command == "validate":
            pipeline_run.validate(config)
            print(f"{args.config}: every check passed (stage options, datasets, base model, reward functions, "
                  "MLflow).")
        elif args.command == "compile":
            print(f"Wrote {pipeline_run.compile_pipeline(args.out, config)}")
        elif args.command == "run":
            if args.image and not args.containers:
                raise ConfigError("--image names the image of --containers; add --containers.")
            image = (args.image or TRAINER_CPU_IMAGE) if args.containers else None
            out = pipeline_run.run_local(config, args.output, args.pipeline_root, args.retries, args.cache,
                                         args.verbose, image=image)
            print(_local_summary(out, config.model_name))
        else:
            target = cluster.Cluster(args.host, args.namespace, args.token_file, args.ui_host)
            if args.command == "submit":
                return _submit(target, config, args)
            cluster.check_cron(args.cron)
            pipeline_run.validate(config, promotion=False)  # what `submit` checks: every scheduled run reads it
            rid = cluster.schedule(target, args.cron, config, args.experiment, args.job_name,
                                   cache=not args.no_cache)
            print(f"Created recurring run {rid} ({args.cron})")
    except cluster.ClusterError as err:  # the KFP API refused or cannot be reached: one line, exit 2
        raise ConfigError(str(err)) from err
    except pipeline_run.PipelineFailed as err:  # the failed task's log tail is already on the console
        print(f"alignflow pipeline {args.command}: error: {err}", file=sys.stderr)
        return 1
    return 0


def _local_summary(out: dict, model_name: str) -> str:
    from trainer.io.progress import format_duration
    from trainer.tracking.provenance import redact_uri

    tracking = redact_uri(out["tracking_uri"])
    champion = f"{model_name} version {out['champion']}" if out.get("champion") else f"none registered for {model_name}"
    lines = [f"Pipeline run finished in {format_duration(out['seconds'])}."]
    if out.get("gate"):
        lines.append(f"  gate:          {out['gate']}")
    lines += [f"  @champion:     {champion}",
              f"  task logs:     {out['logs']}/<task>.log (--verbose shows them live)",
              f"  task outputs:  {out['pipeline_root']}",
              f"  MLflow:        {tracking}",
              f"  browse it:     mlflow ui --backend-store-uri {tracking}"]
    return "\n".join(lines)


def _submit(target, config, args: argparse.Namespace) -> int:
    from pipelines import cluster
    from pipelines import run as pipeline_run

    pipeline_run.validate(config, promotion=False)
    run_id = cluster.submit(target, config, args.experiment, args.run_name, cache=not args.no_cache)
    print(f"Submitted run {run_id}\n  {target.run_link(run_id)}", flush=True)
    if not args.wait:
        return 0
    run = cluster.wait(target, run_id, args.poll_seconds)
    error = getattr(run, "error", None)
    print(f"Run {run_id} ended: {run.state}" + (f" ({error.message})" if getattr(error, "message", None) else ""))
    return 0 if run.state.upper() == "SUCCEEDED" else 1


def main(argv: list[str] | None = None) -> int:
    shutdown.collect_then_freeze_at_exit()
    parser, groups = trainer_cli.make_parser()
    groups.add_parser("pipeline", help=PIPELINE_HELP, add_help=False)
    groups.add_parser("chat", help="Chat with a model: a REPL, or one reply with --prompt.", add_help=False)
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if args.group == "pipeline":
        trainer_cli.setup_logging()
        command = next((a for a in rest if not a.startswith("-")), "")  # the subcommand, for the error line
        return trainer_cli.guarded(f"alignflow pipeline {command}".strip(), pipeline, rest)
    if args.group == "chat":
        from trainer.cli import chat

        trainer_cli.setup_logging()
        return trainer_cli.guarded("alignflow chat", chat.main, rest)
    return trainer_cli.run_group(args, rest)


if __name__ == "__main__":
    sys.exit(main())
