"""The console of a local pipeline run, on a real two-task kfp.local pipeline (subprocesses, seconds):
a line per task start and end with its key metric, each task's log in its own file, the noisy
kfp.local warnings gone, and a failed task's error on the console."""

import re
import warnings

import pytest
from kfp import dsl, local

from pipelines.console import describe_outputs, parse_outputs, task_console

component = dsl.component(base_image="ghcr.io/alignflow/trainer:0.1.0", install_kfp_package=False)


@component
def chatty(lines: int, metrics: dsl.Output[dsl.Metrics]) -> bool:
    for i in range(lines):
        print(f"chatty line {i}")
    metrics.log_metric("loss", 0.25)
    metrics.log_metric("grad_norm", 1.5)
    return True


@component
def broken():
    print("about to fail")
    raise ValueError("`knob` must be positive, got -1.")


@dsl.pipeline(name="console-test")
def good():
    chatty(lines=300).set_cpu_limit("1").set_memory_limit("1G")


@dsl.pipeline(name="console-test")
def bad():
    broken().after(chatty(lines=3))


def run(pipeline, tmp_path, capsys) -> tuple[list[str], Exception | None]:
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"),
               raise_on_error=True)
    error = None
    with task_console(tmp_path / "logs"):
        try:
            pipeline()
        except RuntimeError as err:
            error = err
    return capsys.readouterr().out.splitlines(), error


def test_a_task_gets_two_console_lines_and_its_own_log_file(tmp_path, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lines, error = run(good, tmp_path, capsys)
    assert error is None
    assert len(lines) == 3, lines  # where the logs go, start, end
    assert lines[0].endswith(f"pipeline console-test: each task's full log goes to {tmp_path / 'logs'}/<task>.log")
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d\] chatty: started", lines[1]), lines
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d\] chatty: done in \d+s, loss=0\.25, gate passed", lines[2]), lines
    log = (tmp_path / "logs" / "chatty.log").read_text()
    assert "".join(f"chatty line {i}\n" for i in range(300)) in log
    assert "Got executor_input" in log and "\x1b[" not in log  # the whole task log, colours stripped
    assert "Executing task 'chatty'" in (tmp_path / "logs" / "pipeline.log").read_text()
    noisy = [str(w.message) for w in caught if "local runner" in str(w.message) or "base image" in str(w.message)]
    assert not noisy, noisy


def test_a_failed_task_shows_its_error_and_log_on_the_console(tmp_path, capsys):
    lines, error = run(bad, tmp_path, capsys)
    assert isinstance(error, RuntimeError)
    text = "\n".join(lines)
    assert re.search(r"\] broken: FAILED after \d+s; the end of .*/logs/broken\.log:", text), text
    assert "    ValueError: `knob` must be positive, got -1." in text  # the end of the task's traceback
    assert "about to fail" in (tmp_path / "logs" / "broken.log").read_text()
    assert "chatty line" not in text  # the other task's output stays in its file
    assert len(lines) < 30, text


@pytest.mark.parametrize(("task", "message", "expected"), [
    ("sft", "Task 'sft' outputs:\n    metrics: Metrics( name='metrics',\n                      uri='/r/sft/metrics',\n"
            "                      metadata={'grad_norm': 2.8, 'loss': 6.5, 'epoch': 0.04} )\n"
            "    model: Model( name='model',\n                  uri='/r/sft/model',\n                  metadata={} )",
     "loss=6.5"),
    ("evaluate", "Task 'evaluate' outputs:\n    Output: False\n    metrics: Metrics( name='metrics',\n"
                 "                      uri='/r/e/metrics',\n                      metadata={'kl': 0.01, 'reward': 0.5,"
                 " 'accuracy': 0.25, 'win_rate': 0.75} )", "reward=0.5 accuracy=0.25 win_rate=0.75, gate failed"),
    ("promote", "Task 'promote' outputs:\n    Output: '3'\n    report: HTML( name='report',\n"
                "                  uri='/r/p/report',\n                  metadata={} )", "registered version 3"),
    ("start-run", "Task 'start-run' outputs:\n    Output: '447efe27df794052a86b05128febbad4'", ""),
])
def test_key_numbers_of_a_finished_task(task, message, expected):
    outputs = parse_outputs(message)
    assert describe_outputs(task, outputs) == expected
    if "uri=" in message:
        assert next(v for v in outputs.values() if isinstance(v, dict))["uri"].startswith("/r/")
