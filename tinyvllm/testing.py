"""Helpers for tests: tiny random models written as real Hugging Face folders.

`make_tiny_llama(folder)` writes config.json, model.safetensors, tokenizer.json and
tokenizer_config.json (with a chat template) for a random model small enough that a test runs in
milliseconds, but shaped like the real thing: grouped-query attention, RoPE, several layers.
`make_tiny_family(folder, "Qwen3ForCausalLM")` has transformers write one of any registered
family (`tinyvllm.registry`).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_level_tokenizer_json(vocab_size: int) -> tuple[str, int, int]:
    """A byte-level BPE tokenizer: 3 special tokens, the 256 bytes, then merges of byte pairs up
    to `vocab_size` tokens. Returns (tokenizer.json text, eos id, vocabulary size)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    alphabet.sort()
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    # A few merges of common letters, so text becomes fewer tokens than bytes.
    merges = []
    common = "etaoinshrdlu"
    for a in common:
        for b in common + "Ġ":
            if len(vocab) >= vocab_size:
                break
            merges.append((a, b))
            vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok.to_str(), vocab["<|im_end|>"], len(vocab)


def make_tiny_llama(folder: str | os.PathLike, *, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                    vocab_size: int = 320, max_position_embeddings: int = 512,
                    tie_word_embeddings: bool = False, rope_scaling: dict | None = None,
                    seed: int = 0, std: float = 0.2) -> Path:
    """Write a random Llama model folder and return its path.

    `std` is large on purpose: random logits should be spread out, so greedy choices are clear
    and no two ways of computing attention disagree on a near-tie.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok_json, eos_id, vocab_size = _byte_level_tokenizer_json(vocab_size)
    head_dim = hidden_size // num_heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": tie_word_embeddings, "bos_token_id": 0, "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * std  # noqa: E731
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    tensors = {"model.embed_tokens.weight": rand(vocab_size, hidden_size),
               "model.norm.weight": 1 + rand(hidden_size)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(q, hidden_size),
            p + "self_attn.k_proj.weight": rand(kv, hidden_size),
            p + "self_attn.v_proj.weight": rand(kv, hidden_size),
            p + "self_attn.o_proj.weight": rand(hidden_size, q),
            p + "mlp.gate_proj.weight": rand(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": rand(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": rand(hidden_size, intermediate_size),
            p + "input_layernorm.weight": 1 + rand(hidden_size),
            p + "post_attention_layernorm.weight": 1 + rand(hidden_size),
        })
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = rand(vocab_size, hidden_size)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "tokenizer.json").write_text(tok_json)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": TINY_CHAT_TEMPLATE}, indent=2))
    return folder


# A chat template in the Qwen families' shape (ChatML; Qwen3's thinking switch): what a Qwen
# folder's tokenizer_config.json carries, written small
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
    "{% endif %}{% endif %}"
)


# A chat template that renders tools the way Qwen2.5's and Qwen3's do, written small: the tools
# as JSON in the system turn, an assistant's calls as <tool_call> blocks, a tool's result as a
# <tool_response> in a user turn. `use_chat_template(folder, TOOLS_CHAT_TEMPLATE)` gives it to a
# tiny model, so the server's tool calling runs end to end.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n<tools>\n' }}{% for tool in tools %}"
    "{{ tool | tojson }}{{ '\n' }}{% endfor %}{{ '</tools>\nCall a function with <tool_call>"
    "{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['content'] %}{{ message['content'] }}"
    "{% endif %}{% for call in message['tool_calls'] or [] %}{{ '<tool_call>\n' }}"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "{{ '\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def use_chat_template(folder: str | os.PathLike, template: str) -> Path:
    """Give a model folder another chat template (its tokenizer_config.json's)."""
    path = Path(folder) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2))
    return Path(folder)


def make_tiny_family(folder: str | os.PathLike, architecture: str, *, hidden_size: int = 64,
                     num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                     head_dim: int | None = None, intermediate_size: int = 128, vocab_size: int = 320,
                     tie_word_embeddings: bool = False, seed: int = 0, std: float = 0.2,
                     **config_fields) -> Path:
    """Write a random model of `architecture` ("Qwen3ForCausalLM", ...) as transformers itself
    writes it: its own config class (with that family's defaults), its own module and weight
    names, `save_pretrained`. Every weight is drawn again (biases and norms included: transformers
    starts biases at zero and norms at one, which would test neither), then a byte-level BPE
    tokenizer with a chat template of the family's shape. Needs transformers."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok_json, eos_id, vocab_size = _byte_level_tokenizer_json(vocab_size)
    # Gemma 3's text-only model has a config of its own (Gemma3Config is the one with vision)
    config_class = getattr(transformers, {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(
        architecture, architecture.replace("ForCausalLM", "Config")))
    if head_dim is not None:
        config_fields["head_dim"] = head_dim
    config = config_class(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=512, tie_word_embeddings=tie_word_embeddings, bos_token_id=0,
        eos_token_id=eos_id, **config_fields)
    model = getattr(transformers, architecture)(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * std
            p.copy_(1 + noise if name.endswith("norm.weight") else noise)
    model.save_pretrained(str(folder))
    qwen = architecture.startswith("Qwen")
    (folder / "tokenizer.json").write_text(tok_json)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None if qwen else "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": QWEN_CHAT_TEMPLATE if qwen else TINY_CHAT_TEMPLATE}, indent=2))
    return folder


def make_random_like(source: str | os.PathLike, folder: str | os.PathLike, *, seed: int = 0,
                     std: float = 0.02) -> Path:
    """Write `folder`: `source`'s config and tokenizer files, with random weights of its tensors'
    names and shapes (norms = 1). For timing a model's shape on a machine its weights cannot reach
    (the GPU machines here see no model hub, and ~0.5 GB does not travel): speed does not depend
    on the values, but the tokens are noise. `source` may hold no weights at all (its config.json
    and tokenizer files alone, 2 MB for the default model): then the names and shapes are those of
    the model tinyvllm builds from that config.

        python -m tinyvllm.testing random-like ~/.cache/tinyvllm/SmolLM2-135M-Instruct /tmp/smol-random
    """
    import shutil

    from safetensors import safe_open

    from tinyvllm.weights import safetensors_files

    source, folder = Path(source), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, folder / f.name)
    shapes = {}
    files = safetensors_files(source) if any(source.glob("*.safetensors")) else []
    for f in files:
        with safe_open(str(f), "pt") as st:
            shapes.update({name: st.get_slice(name).get_shape() for name in st.keys()})
    if not files:  # a config alone: the parameters of tinyvllm's model of it, built on no memory
        from tinyvllm.config import ModelConfig
        from tinyvllm.model import LlamaForCausalLM

        with torch.device("meta"):
            model = LlamaForCausalLM(ModelConfig.from_pretrained(source))
        shapes = {name: p.shape for name, p in model.named_parameters()}
    tensors = {name: torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=g) * std
               for name, shape in shapes.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def on_codes(w: torch.Tensor, bits: int) -> torch.Tensor:
    """w (O, I) rounded to 4-bit codes (asymmetric: a scale and the minimum per block of 32
    columns) or 8-bit ones (symmetric: a scale per block), the scales and minimums 16-bit floats,
    in float32: what converting a Q4_1 or a Q8_0 checkpoint to float32 gives."""
    blocks = w.float().reshape(w.shape[0], -1, 32)
    if bits == 4:
        lo = blocks.amin(-1, keepdim=True).half().float()
        scale = ((blocks.amax(-1, keepdim=True) - lo) / 15).half().float().clamp(min=2 ** -14)
        return (torch.round((blocks - lo) / scale).clamp(0, 15) * scale + lo).reshape(w.shape)
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    return (torch.round(blocks / scale) * scale).reshape(w.shape)


def make_on_codes(source: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """Write `folder`: `source` with every projection on 4-bit codes and the LM head on 8-bit ones
    (`on_codes`), as the default model's Q4_1 file with its Q8_0 output matrix, converted."""
    import shutil

    from safetensors.torch import load_file

    source, folder = Path(source), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, folder / f.name)
    tensors = load_file(str(source / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("proj.weight") or name == "lm_head.weight":
            tensors[name] = on_codes(t, 8 if name == "lm_head.weight" else 4).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


# Random blocks of the K-quants, which the gguf package dequantizes but does not write: each
# block's bytes drawn at random but its 16-bit scales, set to keep weights near std 0.2 and
# centered: (bytes a block, [(offset of a float16, its value)])
_K_BLOCKS = {"Q4_K": (144, [(0, 8e-4), (2, 6e-3)]), "Q5_K": (176, [(0, 4e-4), (2, 6.2e-3)]),
             "Q6_K": (210, [(208, 1.5e-4)]), "Q2_K": (84, [(80, 2e-3), (82, 2e-3)])}   # Q2_K: a type not read


def gguf_blocks(w: torch.Tensor, tensor_type: str, seed: int = 0):
    """w (O, I) as the bytes of a GGUF tensor of `tensor_type` (numpy uint8 (O, bytes a row)):
    quantized by the gguf package where it can (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1); for a K-quant,
    random blocks of the type (w gives only the shape; Q4_K's with a code 0 in every group of 32),
    whose reference is what `gguf.quants.dequantize` makes of them."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[tensor_type]
    if tensor_type not in _K_BLOCKS:
        return quantize(w.float().numpy(), qtype)
    size, scales = _K_BLOCKS[tensor_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // 256, size), dtype=np.uint8)
    for offset, value in scales:
        d = (rng.uniform(0.5, 1.5, blocks.shape[:2]) * value).astype(np.float16)
        blocks[..., offset:offset + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    if tensor_type == "Q4_K":   # each group of 32 with its minimum on code 0: bytes 16 + 32j hold
        blocks[..., 16:144:32] = 0   # the first code of groups 2j (low nibble) and 2j + 1 (high)
    return blocks.reshape(w.shape[0], -1)


def write_gguf(folder: str | os.PathLike, path: str | os.PathLike, tensor_type: str, seed: int = 0) -> Path:
    """Write a tiny Hugging Face folder of a registered family (`make_tiny_llama`,
    `make_tiny_family`) as a GGUF file, as llama.cpp's converter does: its metadata, its byte-level
    BPE vocabulary and chat template, a Llama's q/k rows permuted for llama.cpp's RoPE, every
    matrix in `tensor_type` (`gguf_blocks`) and the norms and biases in F32."""
    import gguf
    from safetensors.torch import load_file

    folder, path = Path(folder), Path(path)
    cfg = json.loads((folder / "config.json").read_text())
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[cfg["model_type"]]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 512))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv_: kv_[1])
    tokens = [t for t, _ in vocab]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    if tok_cfg.get("bos_token"):
        w.add_bos_token_id(tokens.index(tok_cfg["bos_token"]))
    w.add_eos_token_id(tokens.index(tok_cfg["eos_token"]))
    w.add_chat_template(tok_cfg["chat_template"])
    layer = {v: k for k, v in {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm"}.items()}
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for i, (name, t) in enumerate(sorted(load_file(str(folder / "model.safetensors")).items())):
        module, leaf = name.rsplit(".", 1)
        if module in top:
            gname = f"{top[module]}.{leaf}"
        else:
            n, rest = module.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{n}.{layer[rest]}.{leaf}"
        if arch == "llama" and rest_is(name, ("q_proj", "k_proj")):
            n_heads = heads if "q_proj" in name else kv
            t = t.reshape(n_heads, 2, -1, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)  # llama.cpp's permute
        if t.dim() == 2:
            w.add_tensor(gname, gguf_blocks(t, tensor_type, seed + i),
                         raw_dtype=gguf.GGMLQuantizationType[tensor_type])
        else:
            w.add_tensor(gname, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rest_is(name: str, modules: tuple[str, ...]) -> bool:
    return any(f".{m}." in name for m in modules)


def token_difference(got: list[list[int]], want: list[list[int]], what: str) -> str:
    """Where two runs' token lists first differ, in words, for a check's failure: `what` says which
    runs they are (the request and the token where they part, and the tokens from there)."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            k = next((j for j, (x, y) in enumerate(zip(g, w)) if x != y), min(len(g), len(w)))
            return f"{what}: request {i}'s tokens differ from token {k} on: {g[k:k + 4]} instead of {w[k:k + 4]}"
    return f"{what}: {len(got)} requests finished, {len(want)} expected"


def resident_bytes() -> int:
    """This process's resident memory now (Linux's /proc/self/statm)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# A tiny model wide enough that matrix math, not Python, sets a step's time (about 8M
# parameters): the throughput checkpoints run on it where the default model would take minutes.
WIDE_TINY_LLAMA: dict = dict(hidden_size=384, num_layers=4, num_heads=6, num_kv_heads=2,
                             intermediate_size=1024, max_position_embeddings=512)
# The shell command that writes it, for a checkpoint's `bench_command` (then --model /tmp/wide-tiny).
WIDE_TINY_LLAMA_COMMAND = ("python -c \"from tinyvllm.testing import WIDE_TINY_LLAMA, make_tiny_llama; "
                           "make_tiny_llama('/tmp/wide-tiny', **WIDE_TINY_LLAMA)\" && ")

# A Gemma 3 of the wide tiny model's size, five windowed layers (16 tokens) to one global, written
# by transformers (phase 11's throughput checkpoint): `make_windowed_tiny(folder)`.
WINDOWED_TINY_GEMMA3: dict = dict(hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2, head_dim=64,
                                  intermediate_size=1024, sliding_window=16, std=0.02)
WINDOWED_TINY_COMMAND = ("python -c \"from tinyvllm.testing import make_windowed_tiny; "
                         "make_windowed_tiny('/tmp/windowed-tiny')\" && ")


def make_windowed_tiny(folder: str | os.PathLike, sliding_window: int = 16, context: int = 1024) -> Path:
    """`WINDOWED_TINY_GEMMA3` with a window of `sliding_window` tokens (16: 64 windows in its
    context of `context` tokens; Gemma 3's small sizes have 512). Needs transformers."""
    folder = make_tiny_family(folder, "Gemma3ForCausalLM",
                              **{**WINDOWED_TINY_GEMMA3, "sliding_window": sliding_window})
    path = Path(folder) / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_position_embeddings": context}, indent=2))
    return Path(folder)


@dataclass(frozen=True)
class KindClaim:
    """A checkpoint's claim on one kind of CPU (the kind `tinyvllm.platform` acts as), where the gain
    differs there: what was measured, where, and what the test asserts; `rounds`, where this
    kind's rounds spread less than the checkpoint's were chosen for (None: the checkpoint's)."""

    claimed_gain: float
    min_gain: float
    claim_source: str
    rounds: int | None = None


@dataclass(frozen=True)
class ThroughputCheckpoint:
    """A phase's speed claim, checked by tests/test_throughput.py: the workload the phase exists
    for, and the gain in output tokens per second it claims over `baseline` there.

    Each phase declares its checkpoints in a file of their own (`THROUGHPUT_CHECKPOINTS` in
    `phases/pNN_*/throughput.py`). The test runs this phase and the baseline on the workload in one
    process, rounds interleaved, warm-up excluded, and asserts the ratio of their best rounds >=
    `min_gain`.

    Attributes:
        name: what is compared, e.g. "cached decode over recompute".
        baseline: the phase number it is compared with, or "hf" (transformers' `generate` on
            static batches of `max_num_seqs`).
        workload: a `tinyvllm.entrypoints.bench` workload name: "throughput", "latency" or "prefix".
        workload_args: keyword arguments of `tinyvllm.entrypoints.bench.workloads.make_workload`
            (num_prompts, dataset, input_len, output_len, seed, ...).
        model: "wide-tiny" (`make_tiny_llama(**WIDE_TINY_LLAMA)`, random weights, seconds),
            "windowed-tiny" (`make_windowed_tiny`: a Gemma 3 of that size with sliding windows) or
            "default" (SmolLM2-135M-Instruct, minutes).
        engine_args: engine arguments for both engines (each gets those its phase acts on).
        claimed_gain: the gain on a CPU this checkpoint stands for.
        claim_source: where `claimed_gain` comes from (a committed report or a measurement, with
            its machine).
        min_gain: what the test asserts, with a margin for a busy 2-core machine: well below the
            claim, well above 1.0 where a gain is claimed (about 0.8 for a "no loss" claim).
        gpu_min_gain: the same on a CUDA GPU (its runs recorded in `claim_source`, which a GPU's
            verdict quotes); None: not measured.
        bench_command: the command that reproduces the comparison.
        rounds: measured rounds per engine (after one warm-up each); a kind's claim may set its own.
        per_cpu_kind: claims for the kinds of CPU where the gain differs ("avx2",
            "avx512_vnni", "amx"), each a `KindClaim`; `claimed_gain`, `min_gain` and `claim_source`
            stand for every other kind (each source says which CPU it was measured on).
    """

    name: str
    baseline: int | str
    workload: str
    workload_args: dict
    model: str
    engine_args: dict
    claimed_gain: float
    claim_source: str
    min_gain: float
    bench_command: str
    gpu_min_gain: float | None = None
    rounds: int = 3
    per_cpu_kind: dict = field(default_factory=dict)

    def on_this_cpu(self) -> tuple[str, KindClaim]:
        """This CPU's kind and the claim that stands for it."""
        from tinyvllm import platform

        kind = platform.current().kind
        return kind, self.per_cpu_kind.get(kind, KindClaim(self.claimed_gain, self.min_gain, self.claim_source))

    def rounds_here(self, on_gpu: bool = False) -> int:
        """The rounds this machine measures: this CPU kind's claim's, if it sets them, else `rounds`."""
        return self.rounds if on_gpu else (self.on_this_cpu()[1].rounds or self.rounds)

    def __post_init__(self) -> None:
        if self.model not in ("wide-tiny", "windowed-tiny", "default"):
            raise ValueError(f"model must be 'wide-tiny', 'windowed-tiny' or 'default', got {self.model!r}")
        if not (isinstance(self.baseline, int) or self.baseline == "hf"):
            raise ValueError(f"baseline must be a phase number or 'hf', got {self.baseline!r}")
        for kind, c in [("", KindClaim(self.claimed_gain, self.min_gain, self.claim_source)),
                        *self.per_cpu_kind.items()]:
            if not 0 < c.min_gain <= c.claimed_gain:
                raise ValueError(f"min_gain{f' ({kind})' if kind else ''} must be in (0, claimed_gain="
                                 f"{c.claimed_gain}], got {c.min_gain}")


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "random-like":
        sys.exit("usage: python -m tinyvllm.testing random-like SOURCE_MODEL_DIR OUT_DIR")
    print(make_random_like(sys.argv[2], sys.argv[3]))


def make_windowed_like(source: str | os.PathLike, folder: str | os.PathLike, sliding_window: int = 512) -> Path:
    """A Llama folder (`source`: the default model's, say) as a Mistral with a window of
    `sliding_window` tokens: the same weights and tokenizer (linked, not copied), every layer
    windowed, as `MistralForCausalLM` is Llama's layers with a window."""
    source, folder = Path(source), Path(folder)
    cfg = json.loads((source / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ValueError(f"make_windowed_like: {source} is a {cfg.get('model_type')!r} model, not a Llama")
    folder.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name != "config.json" and not (folder / f.name).exists():
            (folder / f.name).symlink_to(f.resolve())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=sliding_window)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


# -- hosts of their own on one machine: network namespaces (tests of phases 8 and 10) -----------------
# The addresses of the conftest's `namespaces` fixture: A (node 0) and B (node 1) on one link, C (an
# outsider) on another link to A only.
NETNS_NODE0, NETNS_NODE1, NETNS_OUTSIDER, NETNS_OUTSIDER_LINK = "10.231.0.1", "10.231.0.2", "10.231.1.2", "10.231.1.1"


def ip_command(*args: str) -> subprocess.CompletedProcess:
    """`ip ARGS` (iproute2), its output captured."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


def lines_of(stream) -> queue.Queue:
    """The lines of `stream`, as they come (a thread reads them)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    return lines


def wait_for_line(lines: queue.Queue, seen: list, until, timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        seen.append(line)
        if until(line):
            return line
    raise AssertionError(f"no {what} within {timeout} s; seen:\n{''.join(seen)}")
