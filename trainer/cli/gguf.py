"""`alignflow model import-gguf`: a GGUF file (llama.cpp's format) -> a plain Hugging Face folder.

transformers reads GGUF itself (``from_pretrained(dir, gguf_file=name)``, needs the ``gguf``
package): it rebuilds the config and the tokenizer from the file's metadata, dequantizes every
tensor and undoes llama.cpp's q/k row permutation. What it hands back is flagged as quantized
(``config.quantization_config = {"quant_method": "gguf"}``), though its weights are ordinary
float tensors, and such a model refuses ``save_pretrained``. So we build a plain model from the
same config minus that flag, copy the weights in, re-tie the embeddings, and save that.

The folder is written in a staging directory beside ``out`` and moved in with the weights and
``config.json`` last, so a folder holding both is a finished import (scripts/get_smollm2.sh
relies on that to skip work).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from trainer.extras import require

GGUF_MAGIC = b"GGUF"
DTYPES = ("float32", "bfloat16", "float16")
# Written last, in this order: their presence marks a complete folder.
_LAST_FILES = ("model.safetensors.index.json", "model.safetensors", "config.json")


def _log(message: str) -> None:
    print(f"[import-gguf] {message}", flush=True)


def check_gguf_file(gguf_file: str | Path) -> Path:
    """The path, resolved; raise a clear error when it is missing or not a GGUF file."""
    path = Path(gguf_file).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise ValueError(f"Not a file: {path} (give the path of a .gguf file)")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"Not a GGUF file: {path} starts with {magic!r}, expected {GGUF_MAGIC!r}")
    return path


def read_gguf_strings(path: Path, keys: tuple[str, ...]) -> dict[str, str]:
    """The string-valued metadata ``keys`` that the file has (memory-mapped; arrays are not read)."""
    gguf = require("gguf", feature="Reading a GGUF file")
    GGUFReader, GGUFValueType = gguf.GGUFReader, gguf.GGUFValueType  # noqa: N806

    reader = GGUFReader(path)
    values = {}
    for key in keys:
        field = reader.get_field(key)
        if field is not None and field.types == [GGUFValueType.STRING]:
            values[key] = field.contents()
    return values


def fix_pre_tokenizer(tokenizer, pre: str | None) -> bool:
    """Make the tokenizer split text as the GGUF file's ``tokenizer.ggml.pre`` says; True if changed.

    transformers knows a set of llama.cpp pre-tokenizer names (GGUF_PRE_TOKENIZER_SPLITS) and keeps
    GPT-2's split regex for the others. "smollm" (SmolLM / SmolLM2) is one of those: llama.cpp
    (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM) splits every digit off first (`\\p{N}`, which is
    `Digits(individual_digits=True)` in `tokenizers`) and then applies the GPT-2 regex. Without
    that, whitespace before a digit tokenizes differently ("  1": "Ġ", "Ġ", "1" instead of "ĠĠ", "1").
    """
    if pre != "smollm":
        return False
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return True


def import_gguf(gguf_file: str, out: str, dtype: str = "float32") -> Path:
    """Convert ``gguf_file`` into a Hugging Face folder at ``out`` and return the folder.

    The folder holds ``model.safetensors``, ``config.json``, ``generation_config.json`` and the
    tokenizer files, chat template included. Quantized tensors are dequantized (to float32 and
    then ``dtype``): the folder is a full-precision copy of what the GGUF file stores, so
    quantization error stays in the weights. Existing files of the same name in ``out`` are
    overwritten.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    path = check_gguf_file(gguf_file)
    out = Path(out).expanduser().resolve()
    start = time.perf_counter()
    meta = read_gguf_strings(path, ("general.architecture", "general.name", "tokenizer.ggml.pre"))
    _log(f"reading {path} ({path.stat().st_size / 2**20:.1f} MiB, {meta.get('general.architecture')} "
         f"{meta.get('general.name', '')!r})")

    # 1. Let transformers parse and dequantize, in float32 whatever `dtype` says, so the copy
    #    below is exact; the cast to `dtype` comes last.
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except (ValueError, NotImplementedError) as err:
        raise ValueError(f"transformers cannot load {path.name}: {err}") from err
    state_dict = gguf_model.state_dict()
    cfg = gguf_model.config
    _log(f"loaded {cfg.model_type} ({sum(v.numel() for v in gguf_model.parameters()) / 1e6:.1f}M params, "
         f"{cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, "
         f"tied embeddings: {cfg.tie_word_embeddings}) in {time.perf_counter() - start:.1f}s")

    # 2. A plain model from the same config without the quantization flag, holding the same weights.
    config = type(cfg).from_dict({k: v for k, v in cfg.to_dict().items() if k != "quantization_config"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state_dict, strict=True)
    model.generation_config = gguf_model.generation_config
    del gguf_model, state_dict
    if config.tie_word_embeddings:
        model.tie_weights()
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise RuntimeError("could not re-tie the output embeddings to the input embeddings")
    model.to(getattr(torch, dtype))

    # 3. The tokenizer, from the same file's metadata.
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if fix_pre_tokenizer(tokenizer, meta.get("tokenizer.ggml.pre")):
        _log(f"pre-tokenizer set for {meta['tokenizer.ggml.pre']!r}: digits split one by one, then GPT-2 regex")
    if tokenizer.eos_token is None:
        _log("warning: the file names no eos token; generation will not stop on its own")
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        _log(f"no pad token in the file; using eos {tokenizer.eos_token!r}")
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        _log("warning: the file has no chat template; chat-formatted data will need one")
    if tokenizer.model_max_length > 1e20:  # transformers' "unset" value
        tokenizer.model_max_length = config.max_position_embeddings
    for cfg_ in (model.config, model.generation_config):
        if tokenizer.pad_token_id is not None and cfg_.pad_token_id is None:
            cfg_.pad_token_id = tokenizer.pad_token_id
        if tokenizer.eos_token_id is not None and cfg_.eos_token_id is None:
            cfg_.eos_token_id = tokenizer.eos_token_id

    # 4. Save in a staging folder, then move the files in, weights and config last.
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        out.mkdir(exist_ok=True)
        files = sorted(staging.iterdir(), key=lambda p: _LAST_FILES.index(p.name) if p.name in _LAST_FILES else -1)
        for file in files:
            file.replace(out / file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20
    _log(f"wrote {out} ({size:.0f} MiB {dtype} weights, chat template: {bool(tokenizer.chat_template)}, "
         f"eos {tokenizer.eos_token!r}, pad {tokenizer.pad_token!r}) in {time.perf_counter() - start:.1f}s")
    return out
