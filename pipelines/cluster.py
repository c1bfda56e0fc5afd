"""Submit and schedule the post-training pipeline on a Kubeflow Pipelines cluster, as a user of a
multi-user deployment: in a profile namespace, with a bearer token, and optionally waiting for the run.

Credentials use the kfp client's own mechanisms: `--token-file` is read (and re-read on every
refresh) by `kfp.client.ServiceAccountTokenVolumeCredentials` — a projected service-account token
such as /var/run/secrets/kubeflow/pipelines/token, or any file holding a token; a token already at
hand (`kubectl create token`, an OIDC id token) goes in the ALIGNFLOW_KFP_TOKEN environment variable
and reaches `kfp.Client(existing_token=...)`. Neither is ever a command-line value (shell history, ps).
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from pipelines.run import PipelineConfig, build_pipeline, compile_pipeline
from trainer.errors import ConfigError

TOKEN_ENV = "ALIGNFLOW_KFP_TOKEN"
DONE_STATES = ("SUCCEEDED", "FAILED", "SKIPPED", "CANCELED")  # KFP v2beta1 run states that end a run


class ClusterError(RuntimeError):
    """The KFP API refused or could not be reached; the message says what to check."""


@dataclass
class Cluster:
    """Where and as whom to talk to the KFP API."""

    host: str
    namespace: str | None = None
    token_file: str | None = None
    ui_host: str | None = None

    def client(self):
        import kfp
        from kfp.client import ServiceAccountTokenVolumeCredentials

        if self.token_file and not Path(self.token_file).is_file():
            raise ConfigError(f"--token-file {self.token_file!r} does not exist (a service-account token file, "
                              "e.g. /var/run/secrets/kubeflow/pipelines/token).")
        credentials = ServiceAccountTokenVolumeCredentials(self.token_file) if self.token_file else None
        token = None if self.token_file else os.environ.get(TOKEN_ENV) or None
        extra = {"namespace": self.namespace} if self.namespace else {}
        with warnings.catch_warnings():  # "This client only works with Kubeflow Pipeline v2.0.0-beta.2 and later"
            warnings.simplefilter("ignore", FutureWarning)
            return kfp.Client(host=self.host, existing_token=token, credentials=credentials, **extra)

    def run_link(self, run_id: str) -> str:
        ui = self.ui_host or os.environ.get("KF_PIPELINES_UI_ENDPOINT") or self.host
        return f"{ui.rstrip('/')}/#/runs/details/{run_id}"

    def explain(self, err: Exception) -> ClusterError:
        """A one-line error for what the KFP client raised."""
        status = getattr(err, "status", None)
        if status in (401, 403):
            return ClusterError(
                f"The KFP API at {self.host} refused the request ({status} {getattr(err, 'reason', '')}): give a "
                f"token with --token-file FILE or the {TOKEN_ENV} variable, and check --namespace "
                f"({self.namespace or 'none given'}) is a profile you may use.")
        if status is not None:
            body = str(getattr(err, "body", "") or "").strip().replace("\n", " ")
            return ClusterError(f"The KFP API at {self.host} answered {status} {getattr(err, 'reason', '')}: "
                                f"{body[:300]}")
        return ClusterError(f"Cannot reach the KFP API at {self.host} ({type(err).__name__}: {err}).")


def _api_call(cluster: Cluster, call):
    from kfp_server_api.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return call()
    except (ApiException, HTTPError, OSError) as err:
        raise cluster.explain(err) from None


def submit(cluster: Cluster, config: PipelineConfig, experiment: str = "alignflow",
           run_name: str | None = None, cache: bool = True) -> str:
    """Start one run of the pipeline; returns its id. `cache=False` runs every task again.

    The cache is switched off at compile time: the client's `enable_caching=False` only reaches the
    tasks of the root DAG, and ours sit inside the exit handler."""
    client = _api_call(cluster, cluster.client)
    run = _api_call(cluster, lambda: client.create_run_from_pipeline_func(
        build_pipeline(config, cache=cache), arguments=config.arguments(), experiment_name=experiment,
        run_name=run_name, namespace=cluster.namespace))
    return run.run_id


def wait(cluster: Cluster, run_id: str, poll_seconds: float = 30.0, client=None):
    """Poll the run until it ends; returns the final run object (its `state`, and `error` when it failed)."""
    client = client or _api_call(cluster, cluster.client)
    while True:
        run = _api_call(cluster, lambda: client.get_run(run_id))
        if (run.state or "").upper() in DONE_STATES:
            return run
        time.sleep(poll_seconds)


def check_cron(cron: str) -> str:
    if len(cron.split()) != 6:
        raise ConfigError(f"KFP cron expressions have six fields (seconds first), e.g. '0 0 3 * * *' for 03:00 daily; "
                          f"got {cron!r} with {len(cron.split())}.")
    return cron


def schedule(cluster: Cluster, cron: str, config: PipelineConfig, experiment: str = "alignflow",
             job_name: str = "alignflow-retraining", package: str | None = None, cache: bool = True) -> str:
    """Create a recurring run (scheduled retraining); returns its id. With the cache on (the default),
    each run retrains only the stages whose data changed (the input fingerprints, docs/pipelines.md)."""
    import tempfile

    check_cron(cron)
    client = _api_call(cluster, cluster.client)
    package = package or compile_pipeline(str(Path(tempfile.mkdtemp()) / "post_training.yaml"), config, cache)
    exp = _api_call(cluster, lambda: client.create_experiment(name=experiment, namespace=cluster.namespace))
    job = _api_call(cluster, lambda: client.create_recurring_run(
        experiment_id=exp.experiment_id, job_name=job_name, cron_expression=cron, pipeline_package_path=package,
        params=config.arguments(), enabled=True))
    return job.recurring_run_id
