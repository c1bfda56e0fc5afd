"""glibc malloc tuning (`trainer.engine.loop.keep_freed_memory`): freed blocks stay mapped, so a training
loop stops faulting its pages back in. Measured in fresh subprocesses (one tuned, one not): it
takes a few seconds and depends on the process's heap, so it sits outside the fast unit tier."""

import os
import subprocess
import sys


def test_keep_freed_memory_stops_page_faults_on_reallocation():
    """With glibc tuned, a loop that allocates and frees the same blocks (like training steps)
    settles on mapped pages: no page faults after a few rounds, and the heap stays bounded."""
    probe = ("import os, resource, torch; from trainer.engine.loop import keep_freed_memory; on = keep_freed_memory()\n"
             "def rss_mb(): return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') >> 20\n"
             "r, rss = [], []\n"
             "for _ in range(12):\n"
             "    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
             "    x = torch.ones(16 << 20); y = torch.ones(3 << 20); del x; z = torch.ones(5 << 20); del y, z\n"
             "    r.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0); rss.append(rss_mb())\n"
             "print(on, sum(r[-6:]), rss[-1] - rss[5], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)")
    results = {}
    for setting in ("1", "0"):
        env = {**os.environ, "ALIGNFLOW_MALLOC_TUNING": setting}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        on, faults, growth_mb, peak_mb = out.stdout.split()
        results[setting] = (on == "True", int(faults), int(growth_mb), int(peak_mb))
    assert results["1"][0] and not results["0"][0], results
    assert results["0"][1] > 6 * 16_000, results  # 64 MB = 16k pages faulted in again every round by default
    assert results["1"][1] < 1_000, results
    # Bounded: no growth over the last 6 rounds, and the peak at most a few copies of the 96 MB
    # working set above the default's (freed blocks can sit fragmented instead of being unmapped).
    assert results["1"][2] < 10, results
    assert results["1"][3] < results["0"][3] + 400, results
