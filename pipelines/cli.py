"""The `alignflow` console script: the `pipeline` commands, and every other group from `trainer.cli`.

    alignflow pipeline compile [--out FILE.yaml] [--config FILE.yaml]
    alignflow pipeline run --local --config FILE.yaml [--output DIR] [--pipeline-root DIR|s3://...]
    alignflow pipeline submit --host URL --config FILE.yaml [--namespace NS] [--wait] ...
    alignflow pipeline schedule --host URL --config FILE.yaml --cron "0 0 3 * * *" [--namespace NS] ...
    alignflow {train,model,eval,promote} ...   (trainer.cli)

This entry point sits above both layers (pipelines -> components -> trainer), so the training
library never imports KFP. KFP itself is imported only when a `pipeline` command runs.
"""

from __future__ import annotations

import argparse
import sys

from trainer import cli as trainer_cli

PIPELINE_HELP = "Compile, run locally, submit or schedule the post-training pipeline."


def pipeline(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="alignflow pipeline", description=PIPELINE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    config_help = "Pipeline config YAML (base model, datasets, per-stage options, gate, cluster resources)."
    comp = sub.add_parser("compile", help="Write the pipeline YAML to upload in the KFP UI.")
    comp.add_argument("--out", default="post_training.yaml", help="Output file (default post_training.yaml).")
    comp.add_argument("--config", help=config_help + " Only its `cluster` section matters here.")
    run = sub.add_parser("run", help="Run the whole DAG (kfp.local, no cluster needed).")
    run.add_argument("--local", action="store_true", required=True, help="Run on this machine (required).")
    run.add_argument("--config", required=True, help=config_help)
    run.add_argument("--output", default="pipeline-output", help="Local folder for the run (default pipeline-output).")
    run.add_argument("--base-model", help="Override the config's `base_model` (a model folder).")
    run.add_argument("--pipeline-root", help="Where task outputs go: a local folder (default OUTPUT/pipeline-root) or "
                                             "s3://bucket/prefix (outputs mirrored there).")
    for name, text in (("submit", "Submit one run to a KFP cluster."),
                       ("schedule", "Create a recurring run (scheduled retraining) on a KFP cluster.")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--host", required=True, help="KFP API endpoint, e.g. http://localhost:8080.")
        p.add_argument("--config", required=True, help=config_help)
        p.add_argument("--experiment", default="alignflow", help="KFP experiment (default alignflow).")
        if name == "schedule":
            p.add_argument("--cron", required=True, help="Six-field KFP cron, e.g. '0 0 3 * * *' (03:00 daily).")
            p.add_argument("--job-name", default="alignflow-retraining", help="Recurring run name.")
    args = parser.parse_args(argv)

    from pipelines import run as pipeline_run
    from trainer.config import ConfigError

    try:
        overrides = {"base_model": args.base_model} if getattr(args, "base_model", None) else None
        config = pipeline_run.load_pipeline_config(args.config, overrides) if args.config else None
        if args.command == "compile":
            print(f"Wrote {pipeline_run.compile_pipeline(args.out, config)}")
        elif args.command == "run":
            out = pipeline_run.run_local(config, args.output, args.pipeline_root)
            print(f"Pipeline run finished in {out['seconds']:.0f}s.\n"
                  f"  task outputs:  {out['pipeline_root']}\n"
                  f"  MLflow:        {out['tracking_uri']}\n"
                  f"  browse it:     mlflow ui --backend-store-uri {out['tracking_uri']}")
        elif args.command == "submit":
            pipeline_run.validate(config, promotion=False)
            print(f"Submitted run {pipeline_run.submit(args.host, config, args.experiment)}")
        else:
            pipeline_run.check_cron(args.cron)
            rid = pipeline_run.schedule(args.host, args.cron, config, args.experiment, args.job_name)
            print(f"Created recurring run {rid} ({args.cron})")
    except ConfigError as err:
        print(f"alignflow pipeline {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser, groups = trainer_cli.make_parser()
    groups.add_parser("pipeline", help=PIPELINE_HELP, add_help=False)
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if args.group == "pipeline":
        trainer_cli.setup_logging()
        return pipeline(rest)
    return trainer_cli.run_group(args, rest)


if __name__ == "__main__":
    sys.exit(main())
