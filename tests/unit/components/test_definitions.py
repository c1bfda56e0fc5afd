"""The components' command: what a task's process is when KFP runs it."""

import os

from kfp import local

from components import definitions


@definitions.component
def parent_pid() -> int:
    import os

    return os.getppid()


def test_a_task_process_is_python_itself_so_that_a_signal_to_the_task_reaches_the_stage(tmp_path):
    """KFP starts a task as `sh -ec '...; python3 -m kfp.dsl.executor_main ...'`; a SIGTERM to that shell would
    not reach the training Python (no checkpoint, no exit 75 on preemption). `definitions.component` makes the
    shell exec Python: a task run by kfp.local's subprocess runner has this process, the runner, as its parent."""
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path), raise_on_error=True)
    assert parent_pid().output == os.getpid()
    for task in (definitions.sft, definitions.grpo, definitions.promote, definitions.check_inputs):
        command = task.component_spec.implementation.container.command
        assert command[:2] == ["sh", "-ec"] and "exec python3 -m kfp.dsl.executor_main" in command[2]
