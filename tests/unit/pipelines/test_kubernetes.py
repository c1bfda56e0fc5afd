"""`pipelines.kubernetes.apply`: kfp's resource setters still refuse a task without a container, naming
themselves, while they run without walking the stack (`_setters_name_themselves_cheaply`)."""

import inspect

import pytest
from kfp import compiler, dsl
from kfp.dsl import pipeline_task

from pipelines.kubernetes import LIGHT, apply


def test_a_setter_on_a_task_without_a_container_names_itself_and_inspect_is_given_back():
    def importer_only():
        task = dsl.importer(artifact_uri="s3://bucket/model", artifact_class=dsl.Model, reimport=False)
        apply(task, LIGHT)

    with pytest.raises(ValueError, match=r"^set_cpu_request can only be used on single-step components"):
        dsl.pipeline(name="importer-only")(importer_only)  # (kfp builds the graph here)
    assert pipeline_task.inspect is inspect


def test_the_setters_set_what_they_are_given(tmp_path):
    @dsl.component(base_image="python:3.11")
    def noop():
        pass

    @dsl.pipeline(name="one-task")
    def one_task():
        apply(noop(), LIGHT)

    compiler.Compiler().compile(one_task, package_path=str(tmp_path / "p.yaml"))
    resources = (tmp_path / "p.yaml").read_text()
    assert f"resourceMemoryLimit: {LIGHT.memory}" in resources and f"resourceCpuRequest: '{LIGHT.cpu}'" in resources
    assert pipeline_task.inspect is inspect
