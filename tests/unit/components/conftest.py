import pytest


@pytest.fixture(scope="session")
def rollout_runtimes() -> dict[str, dict]:
    """The chart's ClusterTrainingRuntimes with the rollout-server sidecar (1 and 2 GPUs), by name, as `helm template`
    renders them (skipped where helm-python-sdk is missing)."""
    pytest.importorskip("helm_python")
    from tests.helpers import by_kind, render_chart

    docs = render_chart({"rolloutRuntimes": {"enabled": True, "gpus": [1, 2]}})
    return {d["metadata"]["name"]: d for d in by_kind(docs, "ClusterTrainingRuntime")}
