"""Load a Hugging Face checkpoint (one or many *.safetensors) into `LlamaForCausalLM`.

Every tensor is checked: a name the model does not have, a parameter the files do not provide,
a shape that differs, or a file that is truncated or corrupt raises an error that names the file
and the tensor. Nothing is loaded half-way without saying so.

A safetensors file is an 8-byte little-endian header length, a JSON header that gives each
tensor's dtype, shape and `data_offsets` [begin, end) into the data after it, then the data.
`check_safetensors_file` reads only the header and compares those offsets with the file's size,
so a truncated download names the tensors it lost before anything is loaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from tinyvllm.config import ModelConfig
from tinyvllm.layers import RMSNorm
from tinyvllm.model import LlamaForCausalLM
from tinyvllm.quantized_checkpoint import QUANT_TENSORS, read_quantized

# Buffers some checkpoints carry that we compute ourselves.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Where each weight starts, in bytes: a cache line, as PyTorch's own allocations do. A tensor read
# from a safetensors file starts where the file puts it (8-byte aligned). A vector kernel handles
# an unaligned start on its own path (MKL's AVX-512 product: its last bits then differ from the
# same weight's aligned copy, as phase 7's fused projections are) and reads lines split in two
# (the default model's 211 products at one row 2-7% slower on an AVX-512 EPYC).
ALIGN = 64


def safetensors_files(folder: str | os.PathLike) -> list[Path]:
    """The checkpoint's files: the ones model.safetensors.index.json names, or every *.safetensors."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"model: {index.name} names {f.name}, which is missing from {folder}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors files in {folder}")
    return files


def check_safetensors_file(path: str | os.PathLike) -> None:
    """Raise ValueError, naming the file (and the tensors whose bytes are missing), if the file
    is too short for its own header."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"model: {path} is {size} bytes, too short for a safetensors header "
                             f"(truncated or corrupt?)")
        header_len = int.from_bytes(prefix, "little")
        if 8 + header_len > size:
            raise ValueError(f"model: {path} is truncated inside its header (or is not a safetensors "
                             f"file): the header should be {header_len} bytes, but only {size - 8} "
                             f"follow its 8-byte length field")
        try:
            header = json.loads(f.read(header_len))
            offsets = {name: tuple(int(o) for o in info["data_offsets"])
                       for name, info in header.items() if name != "__metadata__"}
            cut = sorted((begin, end, name) for name, (begin, end) in offsets.items()
                         if end > size - 8 - header_len)  # (begin, end, name) of each cut tensor
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"model: {path} has a header that is not valid safetensors JSON: {e} "
                             f"(corrupt?)") from None
    if not cut:
        return
    begin, end, first = cut[0]
    have = max(0, size - 8 - header_len - begin)
    rest = [name for _, _, name in cut[1:]]
    more = (f"; {len(rest)} more tensor(s) after it are missing: {', '.join(rest[:5])}"
            f"{f' and {len(rest) - 5} more' if len(rest) > 5 else ''}") if rest else ""
    raise ValueError(f"model: {path} is truncated: {size} bytes, but its header needs "
                     f"{8 + header_len + max(e for _, e, _ in cut)}. Tensor {first!r} has {have} of its "
                     f"{end - begin} bytes{more}. Download or convert it again")


def load_weights(model: LlamaForCausalLM, folder: str | os.PathLike) -> None:
    """Give each parameter of `model` its tensor of the checkpoint, checking names and shapes.
    The tensors become the parameters (no copy: `model` may be built on the meta device). An
    AWQ/GPTQ checkpoint's layers are read as their float weight, exactly, and their codes are kept
    in `model.checkpoint_codes` ({layer name: `Int4Codes`}) for a phase that multiplies from them."""
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    expected = set(params)
    seen: set[str] = set()
    quant = model.config.quantization
    quantized: dict[str, dict[str, torch.Tensor]] = {}   # layer -> its qweight, qzeros, scales, g_idx
    for path in safetensors_files(folder):
        check_safetensors_file(path)
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise ValueError(f"model: cannot read {path.name}: {e} (truncated or corrupt?)") from None
        with handle as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue  # some tied checkpoints still ship the copy
                layer, _, leaf = name.rpartition(".")
                if quant and leaf in QUANT_TENSORS and f"{layer}.weight" in params:
                    quantized.setdefault(layer, {})[leaf] = f.get_tensor(name)
                    continue
                if quant and leaf == "bias" and name not in params and not f.get_tensor(name).any():
                    continue   # AutoGPTQ writes a bias of zeros for every layer, biased or not
                if name not in params:
                    raise ValueError(f"model: {path.name} has tensor {name!r}, which this "
                                     f"{model.config.architecture} model does not have")
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"model: cannot read tensor {name!r} from {path.name}: {e} "
                                     f"(truncated or corrupt?)") from None
                param = params[name]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"model: tensor {name!r} in {path.name} has shape "
                                     f"{tuple(tensor.shape)}, expected {tuple(param.shape)}")
                if tensor.data_ptr() % ALIGN:   # a view into the file's bytes at its offset
                    tensor = tensor.clone()
                module, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(module), leaf, torch.nn.Parameter(tensor, param.requires_grad))
                seen.add(name)
    codes = {}
    for layer, tensors in quantized.items():
        param = params[f"{layer}.weight"]
        w, codes[layer] = read_quantized(quant, tensors, tuple(param.shape), f"{layer} in {folder}")
        model.get_submodule(layer).weight = torch.nn.Parameter(w, param.requires_grad)
        seen.add(f"{layer}.weight")
    if codes:
        model.checkpoint_codes = {k: c for k, c in codes.items() if c is not None}
    missing = sorted(expected - seen)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"model: the checkpoint in {folder} lacks tensor(s) "
                         f"{', '.join(missing[:5])}{more}")
    if model.config.tie_word_embeddings:  # one tensor for both, as the checkpoint has
        model.lm_head.weight = model.model.embed_tokens.weight
    if model.config.norm_weight_offset:
        # Gemma's norms weigh by (1 + w): stored as 1 + w (in float32, as its reference adds),
        # every RMSNorm, and every phase's faster one, serves the family unchanged
        for norm in model.modules():
            if isinstance(norm, RMSNorm):
                norm.weight = torch.nn.Parameter(norm.weight.float() + model.config.norm_weight_offset,
                                                 norm.weight.requires_grad)


def load_model(folder: str | os.PathLike, dtype: torch.dtype, device: torch.device,
               max_positions: int | None = None) -> LlamaForCausalLM:
    """Build the model from config.json, load its weights, and move it to `device` and `dtype`."""
    config = ModelConfig.from_pretrained(folder)
    # On the meta device: shapes without memory, so no random init is made and thrown away; the
    # checkpoint's tensors then become the parameters (not Module.to_empty and a copy: its
    # empty_like of a meta tensor first imports sympy, 0.4-0.9 s once per process)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions)
    load_weights(model, folder)
    return model.to(device=device, dtype=dtype).eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as stored (a tied tensor counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen and t.device.type != "meta":
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


# Buffers that hold weights in a quantized layer are named like these (weight, qweight,
# weight_scale, scales, zero points, phase 5's lossless codes); other buffers (RoPE tables) are
# not read whole in a decode step.
_WEIGHT_BUFFER_WORDS = ("weight", "scale", "zero", "codes")


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads (the bench's roofline): every parameter (and
    weight-holding buffer) once, except an embedding table that is not also the LM head, of which
    a step reads only B rows, and a float weight that a step of a few rows reads from its codes
    (phase 5's `LosslessLinear`; from its `max_rows` on it reads the float weight, so above that
    the bound is too high)."""
    nn = torch.nn
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    lookups |= {id(m.weight) for m in model.modules() if hasattr(m, "codes")}
    matmuls = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and not hasattr(m, "codes")}
    seen: set[int] = set()
    total = 0
    tensors = list(model.parameters()) + [
        b for name, b in model.named_buffers() if any(w in name.rsplit(".", 1)[-1] for w in _WEIGHT_BUFFER_WORDS)]
    for t in tensors:
        if id(t) in seen or (id(t) in lookups and id(t) not in matmuls):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def model_facts(model: torch.nn.Module) -> dict:
    """What a benchmark report says of an engine's model, as plain data (an engine whose model is
    in another process answers it from there): the bytes a decode step reads, the parameters
    (a tied weight once), and the kernels its quantized layers choose at one row and at many."""
    kernels = sorted({m.choose_kernel(n) for m in model.modules() if hasattr(m, "choose_kernel") for n in (1, 64)})
    return {"weight_bytes_per_step": weight_bytes_per_step(model),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "product_kernels": kernels or None}
