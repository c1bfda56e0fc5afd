"""`import_gguf` on a GGUF file written offline from the tiny model (tests/gguf_writer.py).

The F32 round trip HF -> GGUF -> HF must be exact up to float noise: same logits, same token ids,
same chat template and special tokens. A Q8_0 file checks the dequantizing path.
"""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.gguf_writer import write_llama_gguf
from trainer.cli.gguf import fix_pre_tokenizer, import_gguf
from trainer.cli.init_tiny import build_tokenizer, init_tiny

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 plus 30? The answer is #### 42.",
    "  leading spaces,\ttabs and\nnewlines  ",
    "Bytes outside the corpus: café, naïve, 東京, 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
]
MESSAGES = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(tiny HF folder, its F32 GGUF file, the folder imported back from that file)."""
    root = tmp_path_factory.mktemp("gguf")
    tiny_dir = init_tiny(root / "tiny")
    gguf_file = write_llama_gguf(tiny_dir, root / "tiny-f32.gguf")
    imported = import_gguf(str(gguf_file), str(root / "imported"))
    return tiny_dir, gguf_file, imported


def _logits(model_dir, texts_ids):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).logits[0] for ids in texts_ids]


def _ids(tokenizer):
    return [tokenizer(text, add_special_tokens=False).input_ids for text in TEXTS]


def test_f32_import_reproduces_the_logits(tiny):
    tiny_dir, _, imported = tiny
    ids = _ids(AutoTokenizer.from_pretrained(tiny_dir))
    for before, after in zip(_logits(tiny_dir, ids), _logits(imported, ids)):
        torch.testing.assert_close(after, before, atol=1e-5, rtol=0)


def test_import_writes_a_plain_tied_checkpoint(tiny):
    tiny_dir, _, imported = tiny
    names = {p.name for p in imported.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert not any(p.name.startswith(".") for p in imported.parent.iterdir())  # staging folder removed
    config = json.loads((imported / "config.json").read_text())
    original = json.loads((tiny_dir / "config.json").read_text())
    assert "quantization_config" not in config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == original[key], key
    with safe_open(imported / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert "lm_head.weight" not in keys  # tied: stored once
    model = AutoModelForCausalLM.from_pretrained(imported)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    generation = json.loads((imported / "generation_config.json").read_text())
    assert generation["eos_token_id"] == original["eos_token_id"]
    assert generation["pad_token_id"] == original["pad_token_id"]


def test_tokenizer_round_trips(tiny):
    tiny_dir, _, imported = tiny
    before, after = AutoTokenizer.from_pretrained(tiny_dir), AutoTokenizer.from_pretrained(imported)
    assert len(after) == len(before)
    assert _ids(after) == _ids(before)
    for text, ids in zip(TEXTS, _ids(after)):
        assert after.decode(ids) == text
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template"):
        assert getattr(after, attr) == getattr(before, attr), attr
    assert after.apply_chat_template(MESSAGES, tokenize=False) == before.apply_chat_template(MESSAGES, tokenize=False)
    assert (after.apply_chat_template(MESSAGES[:1], add_generation_prompt=True, return_dict=True)["input_ids"]
            == before.apply_chat_template(MESSAGES[:1], add_generation_prompt=True, return_dict=True)["input_ids"])


def test_missing_pad_token_falls_back_to_eos(tiny, tmp_path):
    tiny_dir, _, _ = tiny
    gguf_file = write_llama_gguf(tiny_dir, tmp_path / "no-pad.gguf", pad_token=False)
    out = import_gguf(str(gguf_file), str(tmp_path / "out"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    eos_id = tokenizer.eos_token_id
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == eos_id
    assert json.loads((out / "generation_config.json").read_text())["pad_token_id"] == eos_id


def test_quantized_file_is_dequantized_and_cast(tiny, tmp_path):
    """Q8_0 keeps 8 bits per weight (one scale per 32), so the logits move a little, not a lot."""
    tiny_dir, _, _ = tiny
    gguf_file = write_llama_gguf(tiny_dir, tmp_path / "tiny-q8.gguf", qtype="Q8_0")
    out = import_gguf(str(gguf_file), str(tmp_path / "out"), dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    ids = _ids(AutoTokenizer.from_pretrained(tiny_dir))
    for before, after in zip(_logits(tiny_dir, ids), _logits(out, ids)):
        torch.testing.assert_close(after, before, atol=0.02, rtol=0)


def test_smollm_pre_tokenizer_splits_digits():
    """llama.cpp's "smollm" pre-tokenizer splits every digit off before the GPT-2 regex."""
    tokenizer = build_tokenizer()
    text = "Numbers: 10 11 12, then  13."
    assert any(sum(c.isdigit() for c in tok) > 1 for tok in tokenizer.tokenize(text))  # merged digits
    assert not fix_pre_tokenizer(tokenizer, "gpt2")
    assert fix_pre_tokenizer(tokenizer, "smollm")
    assert all(sum(c.isdigit() for c in tok) <= 1 for tok in tokenizer.tokenize(text))
    assert tokenizer.decode(tokenizer(text).input_ids) == text


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        import_gguf(str(tmp_path / "missing.gguf"), str(tmp_path / "out"))
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a gguf")
    with pytest.raises(ValueError, match="Not a GGUF file"):
        import_gguf(str(not_gguf), str(tmp_path / "out"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        import_gguf(str(not_gguf), str(tmp_path / "out"), dtype="int8")
    assert not (tmp_path / "out").exists()
