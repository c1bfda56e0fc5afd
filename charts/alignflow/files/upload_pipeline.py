"""Upload files/post_training.yaml to Kubeflow Pipelines (a new version when the pipeline exists)
and, when asked, replace the recurring run of the same name. Runs in the tools image; its only
input is /config/settings.json, rendered from the chart's values."""

import json
import sys

import kfp


def main(settings_path: str, pipeline_path: str) -> None:
    s = json.load(open(settings_path))
    client = kfp.Client(host=s["host"], namespace=s["namespace"] or None)
    pipeline_id = client.get_pipeline_id(s["pipeline_name"])
    if pipeline_id is None:
        pipeline = client.upload_pipeline(pipeline_path, pipeline_name=s["pipeline_name"],
                                          namespace=s["namespace"] or None)
        pipeline_id = pipeline.pipeline_id
        versions = client.list_pipeline_versions(pipeline_id=pipeline_id, page_size=1).pipeline_versions
        version_id = versions[0].pipeline_version_id
    else:
        version = client.upload_pipeline_version(pipeline_path, pipeline_version_name=s["version"],
                                                 pipeline_id=pipeline_id)
        version_id = version.pipeline_version_id
    print(f"pipeline {s['pipeline_name']} ({pipeline_id}) version {version_id}")

    rr = s["recurring_run"]
    if not rr["enabled"]:
        return
    experiment = client.create_experiment(name=rr["experiment"], namespace=s["namespace"] or None)
    existing = client.list_recurring_runs(experiment_id=experiment.experiment_id, page_size=100).recurring_runs or []
    for old in existing:
        if old.display_name == rr["name"]:
            client.delete_recurring_run(old.recurring_run_id)
    client.create_recurring_run(experiment_id=experiment.experiment_id, job_name=rr["name"],
                                cron_expression=rr["cron"], max_concurrency=rr["max_concurrency"],
                                no_catchup=rr["no_catchup"], params=rr["params"], pipeline_id=pipeline_id,
                                version_id=version_id, pipeline_root=rr["pipeline_root"] or None)
    print(f"recurring run {rr['name']} at '{rr['cron']}'")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
