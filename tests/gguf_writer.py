"""Test helper: write a Hugging Face Llama folder as a GGUF file, the way llama.cpp does.

This follows llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel`` with the ``gpt2`` BPE vocab)
closely enough for transformers' GGUF loader, so tests can make a GGUF file offline:

- tensor names from ``gguf.get_tensor_name_map`` (``model.layers.0.self_attn.q_proj.weight`` ->
  ``blk.0.attn_q.weight``); a tied ``lm_head`` is not written (transformers infers
  ``tie_word_embeddings`` from the missing ``output.weight``);
- q and k rows permuted from HF's rotate-half layout to llama.cpp's interleaved one (``permute``
  below; transformers' ``LlamaTensorProcessor._reverse_permute_weights`` undoes it);
- hyperparameters under ``llama.*`` keys (``rope.dimension_count`` becomes ``head_dim``);
- the vocabulary as ``tokenizer.ggml.tokens`` + ``token_type`` (added special tokens CONTROL),
  and merges, special token ids and the chat template through ``gguf.SpecialVocab``, which reads
  them from tokenizer.json / tokenizer_config.json / chat_template.jinja as llama.cpp does.

Matrices are written as F32, or quantized with ``gguf.quants`` when ``qtype`` says so; 1-D tensors
(norms) always stay F32, as in llama.cpp.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's q/k row permutation (``LlamaModel.permute``): per head, rows [r0..r(d/2-1),
    i0..i(d/2-1)] (rotate-half pairs) become [r0, i0, r1, i1, ...] (adjacent pairs)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def write_llama_gguf(model_dir: str | Path, path: str | Path, qtype: str = "F32",
                     name: str = "alignflow tiny llama", pad_token: bool = True) -> Path:
    """Write the Llama model + tokenizer in ``model_dir`` to the GGUF file ``path``.

    ``qtype`` is a ``gguf.GGMLQuantizationType`` name for the 2-D tensors (``F32``, ``Q8_0``, ...).
    ``pad_token=False`` leaves out ``tokenizer.ggml.padding_token_id``, as many GGUF files do.
    """
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, path = Path(model_dir), Path(path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = model.config
    if cfg.model_type != "llama":
        raise ValueError(f"only llama models are supported, not {cfg.model_type}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    quant = gguf.GGMLQuantizationType[qtype]

    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    # --- hyperparameters (LlamaModel.set_gguf_parameters) ---
    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if quant == gguf.GGMLQuantizationType.F32
                         else gguf.LlamaFileType[f"MOSTLY_{qtype}"])

    # --- vocabulary (TextModel.get_vocab_base + _set_vocab_gpt2) ---
    reverse_vocab = {i: tok for tok, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, token_types = [], []
    for i in range(cfg.vocab_size):
        if i not in reverse_vocab:
            tokens.append(f"[PAD{i}]")
            token_types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse_vocab[i])
            token_types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse_vocab[i])
            token_types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")  # the GPT-2 split regex, which the tiny tokenizer uses
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    special_vocab = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens))
    if not pad_token:
        special_vocab.special_token_ids.pop("pad", None)
    special_vocab.add_to_gguf(writer, quiet=True)

    # --- tensors (LlamaModel.modify_tensors) ---
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if hf_name.endswith("q_proj.weight"):
            data = permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            data = permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = name_map.get_name(base)
        if gguf_name is None:
            raise ValueError(f"no GGUF name for tensor {hf_name}")
        data = np.ascontiguousarray(data, dtype=np.float32)
        if data.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(f"{gguf_name}.{suffix}", gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(f"{gguf_name}.{suffix}", data)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
