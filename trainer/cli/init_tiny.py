"""`alignflow model init-tiny`: a small random-init Llama-style model, offline, in seconds.

The tokenizer is a byte-level BPE trained with `tokenizers` on a built-in corpus (the demo
data plus a few sentences), with ChatML special tokens, an eos and a pad token, and a chat
template, so every stage (SFT, RM, DPO, GRPO) can run on it without a hub.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

_EXTRA_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20. The answer is #### 42.
Reasoning: first add, then multiply, then compare. Therefore the result is correct.
You are a helpful assistant. Please answer the question. Thank you! Yes. No. Maybe?
"""


def builtin_corpus() -> list[str]:
    """Lines of text the tiny tokenizer is trained on."""
    lines = _EXTRA_CORPUS.splitlines()
    data = resources.files("trainer") / "demo_data"
    for name in ("sft.jsonl", "chat.jsonl"):
        for line in (data / name).read_text().splitlines():
            row = json.loads(line)
            if "messages" in row:
                lines += [m["content"] for m in row["messages"]]
            else:
                lines += [row["prompt"], row["completion"]]
    return lines


def build_tokenizer(vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(builtin_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|pad|>",
        unk_token="<|endoftext|>", chat_template=CHAT_TEMPLATE, model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def init_tiny(out: str | Path, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 2,
              num_kv_heads: int = 1, intermediate_size: int = 192, vocab_size: int = 1024,
              max_position_embeddings: int = 2048, seed: int = 0) -> Path:
    """Write a tiny Llama model + tokenizer to ``out`` and return the folder.

    The head dimension (hidden_size / num_heads) defaults to 32: vLLM's CPU attention kernels
    support 32, 64, 80, 96, 112, 128 and 256, not smaller ones.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    tokenizer = build_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
