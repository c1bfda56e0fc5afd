"""The one place image references live. Components, the Helm chart values and images/build.sh
read these; override with ALIGNFLOW_TRAINER_IMAGE / ALIGNFLOW_TOOLS_IMAGE at compile time."""

import os

REGISTRY = os.environ.get("ALIGNFLOW_IMAGE_REGISTRY", "ghcr.io/alignflow")
TAG = os.environ.get("ALIGNFLOW_IMAGE_TAG", "0.1.0")
TRAINER_IMAGE = os.environ.get("ALIGNFLOW_TRAINER_IMAGE", f"{REGISTRY}/trainer:{TAG}")
# The CPU build of the trainer image (images/trainer/Dockerfile.cpu): `pipeline run --local
# --containers` and CI run every task in it.
TRAINER_CPU_IMAGE = os.environ.get("ALIGNFLOW_TRAINER_CPU_IMAGE", f"{REGISTRY}/trainer:{TAG}-cpu")
TOOLS_IMAGE = os.environ.get("ALIGNFLOW_TOOLS_IMAGE", f"{REGISTRY}/tools:{TAG}")
MLFLOW_IMAGE = os.environ.get("ALIGNFLOW_MLFLOW_IMAGE", f"{REGISTRY}/mlflow:{TAG}")
