#!/usr/bin/env bash
# CI's container set-up (issue 30), run by .ci/run beside the suite (ALIGNFLOW_CONTAINER_TESTS=0: not): Docker Engine and
# debootstrap from Debian's packages (as root), dockerd, then the CPU images (trainer-cpu, mlflow) built
# with images/build.sh --cpu --debootstrap. Docker keeps its layer cache in /var/lib/docker, so on the
# same machine a second run rebuilds only what changed (the source layer: seconds). Best effort: where
# Docker cannot be had (no root, no apt, no daemon) it says so and exits 0, and tests/e2e/test_containers.py
# skips with the reason. Prints each step's seconds, so CI's log shows what containers cost.
set -uo pipefail
cd "$(dirname "$0")/.."
step() { echo "ci_containers: $*"; }
started=$SECONDS

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        step "no dockerd and not root with apt-get: the container tests will skip"; exit 0
    fi
    t=$SECONDS
    timeout 300 sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io debootstrap >/dev/null' \
        || { step "docker.io/debootstrap not installed: the container tests will skip"; exit 0; }
    step "installed docker.io and debootstrap in $((SECONDS - t)) s"
fi
# Debian's docker.io client has BuildKit built in; a newer client on PATH may lack buildx (images/build.sh).
DOCKER=docker
[ -x /usr/bin/docker ] && DOCKER=/usr/bin/docker
export DOCKER
if ! "$DOCKER" info >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || { step "no Docker daemon answers and not root to start one: the container tests will skip"; exit 0; }
    # cgroupfs: this host has cgroups v1 and no systemd to delegate to.
    nohup dockerd --exec-opt native.cgroupdriver=cgroupfs >/var/log/alignflow-dockerd.log 2>&1 &
    for _ in $(seq 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 0.5; done
    "$DOCKER" info >/dev/null 2>&1 || { step "dockerd did not start (/var/log/alignflow-dockerd.log): the container tests will skip"; exit 0; }
    step "dockerd started"
fi
t=$SECONDS
# images/build.sh resolves the wheelhouse with .venv/bin/python, else python3 (CPython 3.11 with pip).
if ! timeout 1500 bash images/build.sh --no-push --cpu --debootstrap; then
    step "the CPU images did not build: the container tests will skip"; exit 0
fi
step "images built in $((SECONDS - t)) s; container set-up $((SECONDS - started)) s in all"
"$DOCKER" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'alignflow|bookworm' || true
