"""The exit handler that skips the shutdown collections: it runs once, late, and changes no outcome."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_the_handler_runs_once_after_later_handlers_and_freezes_what_is_alive(tmp_path):
    seen = tmp_path / "seen"
    out = run(f"""
        import atexit, gc, sys
        from trainer.engine import shutdown

        calls = []
        real = shutdown._collect_then_freeze
        shutdown._collect_then_freeze = lambda: (calls.append(gc.get_freeze_count()), real())
        # Registered before the handler, so it runs after it: what the handler left.
        atexit.register(lambda: open({str(seen)!r}, "w").write(f"{{calls!r}}|{{gc.get_freeze_count()}}"))
        shutdown.collect_then_freeze_at_exit()
        shutdown.collect_then_freeze_at_exit()  # a second call registers nothing more
        atexit.register(lambda: calls.append("later handler"))  # registered after it: runs before it
        sys.exit(3)
    """)
    assert out.returncode == 3, out.stderr  # the exit code is the program's
    calls, frozen = seen.read_text().split("|")
    assert calls == "['later handler', 0]"  # the handler once, after the later handler, nothing frozen before it
    assert int(frozen) > 1000  # the survivors moved to the permanent generation


def test_garbage_cycles_are_still_finalised_and_a_failure_still_fails(tmp_path):
    flushed = tmp_path / "flushed.txt"
    out = run(f"""
        import gc
        from trainer.engine import shutdown

        shutdown.collect_then_freeze_at_exit()
        gc.disable()  # only the exit handler's collection can find the cycle

        class Cycle:
            def __init__(self):
                self.me, self.file = self, open({str(flushed)!r}, "w")
                self.file.write("written, flushed when the cycle is finalised")

            def __del__(self):
                self.file.close()

        Cycle()
        raise RuntimeError("the run failed")
    """)
    assert out.returncode == 1 and "RuntimeError: the run failed" in out.stderr
    assert flushed.read_text() == "written, flushed when the cycle is finalised"
