#!/usr/bin/env bash
# Build (and push) the alignflow images with ONE tag, read from components/images.py — the same
# place the compiled pipeline and the chart take their image references from.
#
#   images/build.sh            # build and push trainer, tools and mlflow
#   images/build.sh --no-push  # build only
#
# ALIGNFLOW_IMAGE_REGISTRY / ALIGNFLOW_IMAGE_TAG override the registry and tag (components/images.py
# reads the same variables). DOCKER=podman uses another builder. Run from anywhere.
set -euo pipefail

cd "$(dirname "$0")/.."
PUSH=1
if [[ "${1:-}" == "--no-push" ]]; then PUSH=0; fi
DOCKER="${DOCKER:-docker}"
PYTHON="${PYTHON:-python}"

# One line: trainer image, tools image, registry, tag.
read -r TRAINER_IMAGE TOOLS_IMAGE REGISTRY TAG < <("$PYTHON" -c \
  'from components.images import TRAINER_IMAGE, TOOLS_IMAGE, REGISTRY, TAG; print(TRAINER_IMAGE, TOOLS_IMAGE, REGISTRY, TAG)')
MLFLOW_IMAGE="${REGISTRY}/mlflow:${TAG}"
GIT_SHA="$(git rev-parse HEAD 2>/dev/null || echo unknown)"

build() {  # build IMAGE DOCKERFILE
  echo "Building $1 from $2 (git $GIT_SHA)"
  "$DOCKER" build --file "$2" --build-arg "ALIGNFLOW_GIT_SHA=$GIT_SHA" --tag "$1" .
  if [[ "$PUSH" == 1 ]]; then "$DOCKER" push "$1"; fi
}

build "$TRAINER_IMAGE" images/trainer/Dockerfile
build "$TOOLS_IMAGE" images/tools/Dockerfile
build "$MLFLOW_IMAGE" images/mlflow/Dockerfile
