"""Any GGUF file of a registered family -> a Hugging Face folder (llama.cpp's format, read exactly).

A GGUF file is a header, key-value metadata (the model's shape, its tokenizer, its chat template)
and tensors, each stored in a type of its own: plain floats (F32, F16, BF16), or blocks of codes
with their scales. The types read here:

    type   a block of             each weight                         stored bits a weight
    Q8_0   32 weights             d * q, q in -127..127                 8.5
    Q4_0   32                     d * (q - 8), q in 0..15               4.5
    Q4_1   32                     d * q + m, q in 0..15                 5
    Q5_0   32                     d * (q - 16), q in 0..31              5.5
    Q5_1   32                     d * q + m, q in 0..31                 6
    Q4_K   256 (8 groups of 32)   d*sc_j * q - dmin*m_j, q in 0..15     4.5 (6-bit sc_j, m_j)
    Q5_K   256 (8 groups of 32)   d*sc_j * q - dmin*m_j, q in 0..31     5.5
    Q6_K   256 (16 groups of 16)  d*sc_j * (q - 32), q in 0..63         6.5625 (8-bit sc_j)

`convert_gguf` checks the whole file first (its type, its family, every tensor's name, type,
shape against the metadata's and bytes against the file's size), then decodes every tensor to
float32 with the `gguf` package's own `dequantize` (so each weight is the reference's, bit for
bit), undoes llama.cpp's reordering of a Llama's q/k rows, rebuilds the tokenizer from the
vocabulary and merges the file stores, and writes the folder in one rename: a bad file leaves
nothing behind. Phase 5 then reads a float32 layer whose every block of 32 lies on 4- or 8-bit
codes from those codes (lossless.py): Q8_0, Q4_1, Q4_0, Q5_0 (on 8 bits) and Q6_K (on 8 bits, a
scale per 16 columns) always, Q4_K where each group's minimum is its code 0; Q5_1 and Q5_K (5-bit
codes and a minimum) stay float32. vLLM reads a GGUF file in place
(`vllm/model_executor/model_loader/gguf_loader.py`) and multiplies from its blocks on a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np

# GGUF's architecture name -> (transformers' class, model_type, whether llama.cpp permuted q/k)
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama", True),
                      "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
                      "qwen3": ("Qwen3ForCausalLM", "qwen3", False)}
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_tensor_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for a name that
    is not a tensor of a registered family."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


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
    GGUFReader builds a numpy view for every element of every array: 3 s for the default model's
    vocabulary and merges (49,152 and 48,900 strings), where one pass with `struct` takes 0.15 s
    (a Zen 4 EPYC). The layout: a header, the key-value pairs, each tensor's name, dimensions,
    type and offset, then the tensors' data from the next multiple of `general.alignment` (32).
    A file cut short, a tensor of a type this reader does not know or whose rows are not whole
    blocks raise ValueError naming the file and the tensor."""

    SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
               11: "<q", 12: "<d"}
    STRING, ARRAY = 8, 9

    def __init__(self, path: str | os.PathLike):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        self.map = np.memmap(path, dtype=np.uint8, mode="r")
        self.buf, self.pos = self.map.data, 4
        if bytes(self.buf[:4]) != b"GGUF":
            raise ValueError(f"model: {path} is not a GGUF file")
        try:
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
        except (struct.error, UnicodeDecodeError, KeyError) as e:
            raise ValueError(f"model: {path} is truncated or corrupt inside its header ({e!r}, at byte "
                             f"{self.pos} of {len(self.map)})") from None
        align = self.fields.get("general.alignment", 32)
        start = -(-self.pos // align) * align
        self.tensors = []
        for name, shape, kind, offset in infos:
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError:
                raise ValueError(f"model: {path}: tensor {name!r} has type {kind}, which is not a GGML "
                                 f"type this gguf package knows") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            if not shape or shape[0] % block:
                raise ValueError(f"model: {path}: tensor {name!r} of type {qtype.name} has rows of "
                                 f"{shape[0] if shape else 0} values, not a whole number of its "
                                 f"{block}-value blocks")
            row_bytes = shape[0] // block * type_size
            rows = int(np.prod(shape[1:], dtype=np.int64))
            begin, end = start + offset, start + offset + rows * row_bytes
            if end > len(self.map):
                raise ValueError(f"model: {path} is truncated: tensor {name!r} needs bytes {begin} to "
                                 f"{end}, the file has {len(self.map)}. Download it again")
            self.tensors.append(GGUFTensor(name, shape, qtype, self.map[begin:end].reshape(rows, row_bytes)))

    def _take(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._take("<Q")
        if self.pos + n > len(self.map):
            raise struct.error(f"a string of {n} bytes runs past the end")
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
            size = struct.calcsize(self.SCALARS[kind])
            if self.pos + n * size > len(self.map):
                raise struct.error(f"an array of {n} numbers runs past the end")
            values = np.frombuffer(self.buf, np.dtype(self.SCALARS[kind]), n, self.pos)
            self.pos += values.nbytes
            return values.tolist()
        return [self._value(kind) for _ in range(n)]


def gguf_config(reader: GGUFFile) -> dict:
    """config.json of a GGUF file's model, from its metadata (ValueError naming the file for a
    family that is not registered, or a RoPE this engine does not compute)."""
    path, fields = reader.path, reader.fields
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"model: {path} holds a {arch!r} model; GGUF architectures read: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"model: {path}: tensor 'rope_freqs.weight' (per-frequency RoPE factors, as "
                         f"Llama 3.1's scaling is stored in GGUF) is not supported; load the model's "
                         f"Hugging Face folder instead")
    key = lambda name, default=None: fields.get(f"{arch}.{name}", default)
    n_heads, hidden = key("attention.head_count"), key("embedding_length")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None or not n_heads or not hidden:
        raise ValueError(f"model: {path} lacks token_embd.weight or its {arch}.attention.head_count / "
                         f"{arch}.embedding_length metadata")
    bos, eos = fields.get("tokenizer.ggml.bos_token_id"), fields.get("tokenizer.ggml.eos_token_id")
    hf_arch, model_type, _ = GGUF_ARCHITECTURES[arch]
    config = {
        "architectures": [hf_arch], "model_type": model_type,
        "vocab_size": int(embed.shape[1]), "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": key("attention.head_count_kv", n_heads),
        "head_dim": key("attention.key_length", key("rope.dimension_count", hidden // n_heads)),
        "max_position_embeddings": key("context_length", 2048),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "attention_bias": any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32",
    }
    if key("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    elif key("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"model: {path}: RoPE scaling {key('rope.scaling.type')!r} is not supported")
    return config


def check_tensors(reader: GGUFFile, config: dict) -> dict[str, str]:
    """Every tensor of the file against the model its metadata describes: its name, its type
    (one of `TYPES`) and its shape; every parameter present. Returns {GGUF name: HF name}."""
    import torch

    from tinyvllm.config import ModelConfig
    from tinyvllm.model import LlamaForCausalLM

    path = reader.path
    with torch.device("meta"):
        params = {n: tuple(p.shape) for n, p in LlamaForCausalLM(ModelConfig.from_dict(config)).named_parameters()}
    names = {}
    for t in reader.tensors:
        hf = hf_tensor_name(t.name)
        if hf not in params:
            raise ValueError(f"model: {path}: tensor {t.name!r} is not a tensor of a "
                             f"{config['architectures'][0]} model")
        if t.tensor_type.name not in TYPES:
            raise ValueError(f"model: {path}: tensor {t.name!r} is stored as {t.tensor_type.name}; the "
                             f"types read are {', '.join(TYPES)}")
        shape = tuple(int(d) for d in reversed(t.shape))   # GGUF lists dims innermost first
        if shape != params[hf]:
            raise ValueError(f"model: {path}: tensor {t.name!r} has shape {shape}, but the file's metadata "
                             f"describes a model whose {hf} is {params[hf]}")
        names[t.name] = hf
    missing = sorted(set(params) - set(names.values()))
    if missing:
        raise ValueError(f"model: {path} lacks tensor(s) {', '.join(missing[:5])}"
                         f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}")
    return names


def tensor_types(reader: GGUFFile) -> dict[str, int]:
    """How many tensors of each type the file holds, most first: {"Q4_K": 96, ...}."""
    return dict(Counter(t.tensor_type.name for t in reader.tensors).most_common())


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                 tokenizer: str | os.PathLike | None = None) -> Path:
    """Write a Hugging Face folder for a GGUF file of a registered family: checked whole first,
    written in one rename. `tokenizer`: a folder whose tokenizer.json (and tokenizer_config.json)
    are used instead of the file's vocabulary."""
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    reader = GGUFFile(gguf_path)
    config = gguf_config(reader)
    names = check_tensors(reader, config)
    tok_files = _tokenizer_from(Path(tokenizer)) if tokenizer else _tokenizer_files(reader)
    permuted = GGUF_ARCHITECTURES[reader.fields["general.architecture"]][2]
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if permuted and ".attn_q." in t.name:
            w = unpermute_qk(w, config["num_attention_heads"])
        elif permuted and ".attn_k." in t.name:
            w = unpermute_qk(w, config["num_key_value_heads"])
        tensors[names[t.name]] = np.ascontiguousarray(w)

    bos, eos = config["bos_token_id"], config["eos_token_id"]
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
        for name, text in tok_files.items():
            (tmp / name).write_text(text)
        (tmp / ".tinyvllm-converted").write_text(f"converted from {Path(gguf_path).name}\n"
                                                 f"{json.dumps(tensor_types(reader))}\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)  # atomic: a half-written folder is never mistaken for a model
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


def _tokenizer_from(folder: Path) -> dict[str, str]:
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer: no tokenizer.json in {folder}")
    return {name: (folder / name).read_text() for name in ("tokenizer.json", "tokenizer_config.json",
                                                           "chat_template.jinja") if (folder / name).is_file()}


# llama.cpp's pre-tokenizer names (`tokenizer.ggml.pre`) for byte-level BPE vocabularies -> the
# split their Hugging Face tokenizer.json makes before the byte-level step: None for GPT-2's own,
# "digits" for SmolLM2's digits one by one then GPT-2's, else the regex of Llama 3's / Qwen2's
_CONTRACTIONS_AND_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_SPLITS = {
    None: None, "default": None, "gpt-2": None, "smollm": "digits",
    "llama-bpe": _CONTRACTIONS_AND_WORDS + r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": _CONTRACTIONS_AND_WORDS + r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _tokenizer_files(reader: GGUFFile) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json contents for a GGUF's 'gpt2' (byte-level BPE)
    vocabulary."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    field, path = reader.fields.get, reader.path
    model_kind, pre = field("tokenizer.ggml.model"), field("tokenizer.ggml.pre")
    if model_kind != "gpt2" or pre not in _SPLITS:
        what = f"pre-tokenizer {pre!r}" if model_kind == "gpt2" else f"tokenizer {model_kind!r}"
        raise ValueError(f"model: {path}: the GGUF {what} is not rebuilt here (byte-level BPE, 'gpt2', with "
                         f"the pre-tokenizers {', '.join(str(p) for p in _SPLITS if p)}); pass "
                         f"tokenizer=<a folder with the model's tokenizer.json>")
    tokens = field("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                               byte_fallback=False))
    split = _SPLITS[pre]
    if split is None or split == "digits":
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        tok.pre_tokenizer = byte_level if split is None else pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = field("tokenizer.ggml.token_type") or []
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])  # 3: CONTROL (special tokens)

    name = lambda key: tokens[field(key)] if field(key) is not None else None
    arch = field("general.architecture")
    cfg = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", False)),
        "chat_template": field("tokenizer.chat_template"),
        "model_max_length": field(f"{arch}.context_length"),
    }
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(cfg, indent=2, ensure_ascii=False)}
