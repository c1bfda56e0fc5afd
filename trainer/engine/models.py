"""Loading models and tokenizers for training: local folders, s3:// prefixes or hub ids; dtype;
LoRA through peft; gradient checkpointing; a pad token when the tokenizer has none."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.engine.checkpoint import COMPLETE_MARKER, MANIFEST
from trainer.errors import ModelError
from trainer.io.storage import fetch_to_local, is_remote

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def resolve_model_path(spec: str) -> str:
    """A local folder for `spec` (s3:// prefixes are downloaded), or the hub id unchanged.

    A folder written by alignflow counts only when its completion marker is there: a stage
    that died while saving leaves a folder that must not be mistaken for a model.
    """
    if is_remote(spec):
        spec = fetch_to_local(spec)
    path = Path(spec)
    if path.is_dir():
        if (path / MANIFEST).exists() and not (path / COMPLETE_MARKER).exists():
            raise ModelError(f"{spec!r} is an incomplete alignflow checkpoint (no {COMPLETE_MARKER}); the stage "
                             "that wrote it did not finish. Resume that stage or pick another checkpoint.")
        if not (path / "config.json").exists() and not (path / "adapter_config.json").exists():
            raise ModelError(f"{spec!r} has no config.json: it is not a Hugging Face model folder.")
        return str(path)
    if path.is_file():
        raise ModelError(f"Model path {spec!r} is a file, not a model folder: give the folder that holds its "
                         "config.json (for a .gguf file, convert it first with `alignflow model import-gguf`).")
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ModelError(f"Model path {spec!r} does not exist. Build a test model with "
                         "`alignflow model init-tiny --out DIR`.")
    return spec  # a hub id; from_pretrained reports if it cannot be fetched


# Files one of which every saved tokenizer has (fast: tokenizer.json; slow: its vocabulary; any: tokenizer_config.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ModelError(f"Model folder {path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the "
                         "tokenizer next to the weights (`tokenizer.save_pretrained(folder)`), or copy its files there.")
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"The tokenizer of {path!r} has neither a pad nor an eos token; add one to its "
                             "tokenizer_config.json.")
        warnings.warn(f"The tokenizer of {path!r} has no pad token; using its eos token "
                      f"{tokenizer.eos_token!r} for padding.", stacklevel=2)
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def model_and_tokenizer(config) -> tuple[str, Any]:
    """A stage's starting point: the local path of `config.model` (fetched or resolved) and its tokenizer."""
    path = resolve_model_path(config.model)
    tokenizer = load_tokenizer(path, config.trust_remote_code)
    if getattr(config, "chat_template_path", None):
        from trainer.data.chat_templates import set_chat_template

        set_chat_template(tokenizer, config.chat_template_path)
    return path, tokenizer


def _is_adapter(path: str) -> bool:
    return Path(path, "adapter_config.json").exists()


def load_causal_lm(path: str, dtype: str = "float32", trust_remote_code: bool = False,
                   gradient_checkpointing: bool = False, trainable_adapter: bool = False):
    """Load a causal LM; a PEFT adapter folder is loaded on top of its base model."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": DTYPES[dtype], "trust_remote_code": trust_remote_code}
    if _is_adapter(path):
        from peft import PeftConfig, PeftModel

        base_path = resolve_model_path(PeftConfig.from_pretrained(path).base_model_name_or_path)
        base = AutoModelForCausalLM.from_pretrained(base_path, **kwargs)
        model = PeftModel.from_pretrained(base, path, is_trainable=trainable_adapter)
        if not trainable_adapter:
            model = model.merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def apply_lora(model, r: int, alpha: int, dropout: float, target_modules: list[str],
               task_type: str = "CAUSAL_LM", modules_to_save: list[str] | None = None):
    """Wrap `model` with fresh LoRA adapters (peft)."""
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = "all-linear" if target_modules == ["all-linear"] else target_modules
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        task_type=task_type, modules_to_save=modules_to_save)
    try:
        model = get_peft_model(model, config)
    except ValueError as err:
        raise ModelError(f"LoRA could not be applied ({err}). Check `lora_target_modules` against the "
                         "model's module names.") from err
    if getattr(model, "is_gradient_checkpointing", False):
        model.enable_input_require_grads()
    return model


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile, in place, each block of every list of same-class blocks in `model` (a transformer's decoder
    layers; accelerate's regional compilation): one compiled graph serves all layers, the state dict keeps its
    names. Dynamic shapes, as batch widths change from step to step. Returns how many blocks.

    Python floats are taken as constants (a layer's are settings such as its attention scale, which sdpa takes
    as a number): dynamo otherwise traces each layer twice, first with them as symbols, then again once that
    fails (a tiny float32 GRPO run on 2 cores, cold cache: 84 s before, 69 s after)."""
    from accelerate.utils.other import is_repeated_blocks

    torch._dynamo.config.specialize_float = True

    compiled: list[str] = []
    for name, module in model.named_modules():
        if is_repeated_blocks(module) and not any(name.startswith(f"{c}.") for c in compiled):
            for block in module:
                block.compile(dynamic=True)
            compiled.append(name)
    return sum(len(model.get_submodule(name)) for name in compiled)


def count_parameters(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


def load_reward_model(path: str, pad_token_id: int, dtype: str = "float32", trust_remote_code: bool = False,
                      gradient_checkpointing: bool = False, trainable_adapter: bool = False, num_labels: int = 1):
    """A model with a scalar head (`AutoModelForSequenceClassification`, num_labels=1): a causal LM or
    an encoder (a fresh head) or a reward checkpoint; a PEFT adapter folder is loaded on top of its base.
    `num_labels` > 1 loads a classifier with that many labels as it is (its head must have as many rows;
    with 1, a checkpoint with a wider head fails with a size mismatch).

    Causal LMs score a sequence at its last non-pad token, found through `config.pad_token_id`,
    so it is set to the tokenizer's pad id here (checkpoints saved afterwards carry it).
    """
    from transformers import AutoModelForSequenceClassification

    kwargs = {"dtype": DTYPES[dtype], "trust_remote_code": trust_remote_code, "num_labels": num_labels}
    if _is_adapter(path):
        from peft import PeftConfig, PeftModel

        base_path = resolve_model_path(PeftConfig.from_pretrained(path).base_model_name_or_path)
        base = AutoModelForSequenceClassification.from_pretrained(base_path, **kwargs)
        base.config.get_text_config().pad_token_id = pad_token_id
        model = PeftModel.from_pretrained(base, path, is_trainable=trainable_adapter)
        if not trainable_adapter:
            model = model.merge_and_unload()
    else:
        model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
        model.config.get_text_config().pad_token_id = pad_token_id
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


@contextlib.contextmanager
def eval_mode(model) -> Iterator[None]:
    """`model` in eval mode (no dropout) inside the block; given back in the mode it came in, also on an error."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def disable_dropout(model) -> None:
    """Set every dropout probability of `model` to 0 (TRL does so for DPO's policy and reference and
    for reward models, so that two forwards of the same input agree)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
