"""AWQ and GPTQ int4 checkpoints: a Hugging Face folder whose config.json has a `quantization_config`
(`quant_method` "awq" or "gptq", `bits` 4), each quantized layer stored as three or four tensors.

Both keep, for every group of `group_size` input columns of a layer's weight (O, I), one scale `s`
and one integer zero point `z` per output row, and each weight as a 4-bit code `q`:

    w = (q - z) * s                              q, z in 0..15, s a float16

They differ in how the codes are packed, eight to an int32:

    AWQ (AutoAWQ's GEMM layout)   qweight (I, O/8), qzeros (G, O/8): along the outputs, the int32's
                                  nibble k (bits 4k..4k+3) holding column ORDER[k] of its eight,
                                  ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; scales (G, O)
    GPTQ (AutoGPTQ, "v1")         qweight (I/8, O): along the inputs, nibble k holding input row
                                  8r + k; qzeros (G, O/8) along the outputs in order, each stored
                                  as z - 1 (read back as (stored + 1) & 15); scales (G, O); g_idx (I,):
                                  the group of each input column (with act-order, `desc_act`, the
                                  columns were quantized in another order, so a group's columns
                                  are scattered); "gptq_v2" stores z itself

`read_quantized` unpacks a layer into its codes and returns the float weight, computed as
q * s + (-z * s) in float32: both products are exact (4 bits times a float16's 11), so the sum is
exactly (q - z) * s, the formats' own dequantization, in float32 bit for bit (and in float16
after rounding). Where every group is a run of contiguous columns (AWQ; GPTQ without act-order, or
with a g_idx that keeps columns in order) it also returns the codes as `Int4Codes`, in the layout
phase 5's int4 layer reads: two codes a byte, column 2j in the low nibble, one scale and one
zero (the value of code 0, -z * s) per group, float32. Phase 5 multiplies from them; earlier
phases, and GPTQ with a scattering g_idx, multiply the float weight. vLLM repacks these tensors
for its kernels at load (`vllm/model_executor/layers/quantization/awq.py`, `gptq.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

QUANT_METHODS = ("awq", "gptq")
QUANT_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # nibble k of an AWQ int32 holds column AWQ_ORDER[k] of its eight


class Int4Codes(NamedTuple):
    """A layer's 4-bit codes: w = code * scale + zero, exactly, group by group."""
    codes: torch.Tensor       # (O, I/2) uint8, column 2j in the low nibble
    scale: torch.Tensor       # (O, I/group_size) float32
    zero: torch.Tensor        # (O, I/group_size) float32, the value of code 0
    group_size: int


def check_quantization_config(q: dict | None, where: str) -> dict | None:
    """config.json's `quantization_config` made plain ({"method", "group_size", "desc_act",
    "v1"}), or None; a ValueError naming the field for what is not read here."""
    if q is None:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method not in QUANT_METHODS:
        raise ValueError(f"{where}: quantization_config.quant_method {q.get('quant_method')!r} is not "
                         f"supported (supported: {', '.join(QUANT_METHODS)}, 4 bits)")
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}: quantization_config.bits={bits} ({method}) is not supported: only 4-bit "
                         f"checkpoints are read")
    group = q.get("group_size", q.get("q_group_size", 128))
    if not isinstance(group, int) or (group < 1 and group != -1):
        raise ValueError(f"{where}: quantization_config.group_size={group!r} must be a positive integer or -1")
    version = str(q.get("version", "gemm")).lower()
    if method == "awq" and (version != "gemm" or not q.get("zero_point", True)):
        raise ValueError(f"{where}: AWQ's {version!r} layout{'' if q.get('zero_point', True) else ' without zero points'} "
                         f"is not supported (only 'gemm', with zero points)")
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if method == "gptq" and fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}: quantization_config.checkpoint_format={fmt!r} is not supported "
                         f"('gptq' or 'gptq_v2')")
    return {"method": method, "group_size": group, "desc_act": bool(q.get("desc_act", False)),
            "v1": fmt == "gptq"}


def _nibbles(x: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 x -> its eight 4-bit values (nibble k = bits 4k..4k+3), stacked along a new `dim`."""
    return torch.stack([(x >> (4 * k)) & 15 for k in range(8)], dim=dim)


def unpack(quant: dict, t: dict[str, torch.Tensor], shape: tuple[int, int], where: str):
    """A layer's tensors -> codes q (O, I), zero points z (G, O), scales s (G, O), g_idx (I,)."""
    o, i = shape
    group = i if quant["group_size"] == -1 else quant["group_size"]
    missing = [n for n in ("qweight", "qzeros", "scales") if n not in t]
    if missing:
        raise ValueError(f"model: {where} lacks {', '.join(missing)}")
    if i % group:
        raise ValueError(f"model: {where}: group_size {group} does not divide the input size {i}")
    g = i // group
    awq = quant["method"] == "awq"
    want = {"qweight": (i, o // 8) if awq else (i // 8, o), "qzeros": (g, o // 8), "scales": (g, o)}
    for name, s in want.items():
        if tuple(t[name].shape) != s:
            raise ValueError(f"model: {where}.{name} has shape {tuple(t[name].shape)}, expected {s} for a "
                             f"{quant['method']} layer of {o} x {i} in groups of {group}")
    inverse = [AWQ_ORDER.index(c) for c in range(8)]
    if awq:
        q = _nibbles(t["qweight"], -1)[..., inverse].reshape(i, o).T
        z = _nibbles(t["qzeros"], -1)[..., inverse].reshape(g, o)
    else:
        q = _nibbles(t["qweight"], 1).reshape(i, o).T
        z = _nibbles(t["qzeros"], -1).reshape(g, o)
        z = (z + 1) & 15 if quant["v1"] else z
    g_idx = torch.arange(i) // group
    if not awq and "g_idx" in t:
        g_idx = t["g_idx"].long()
        if tuple(g_idx.shape) != (i,) or g_idx.min() < 0 or g_idx.max() >= g:
            raise ValueError(f"model: {where}.g_idx must be {i} group numbers in 0..{g - 1}")
    elif not awq and quant["desc_act"]:
        raise ValueError(f"model: {where}: the checkpoint says desc_act (act-order) but has no g_idx, "
                         f"the group of each input column; it cannot be read")
    return q.to(torch.uint8).contiguous(), z, t["scales"], g_idx, group


def read_quantized(quant: dict, t: dict[str, torch.Tensor], shape: tuple[int, int],
                   where: str) -> tuple[torch.Tensor, Int4Codes | None]:
    """A layer of an AWQ/GPTQ checkpoint -> its float32 weight (O, I), exactly (q - z) * s, and its
    `Int4Codes` where each group is a run of contiguous columns whose products are exact."""
    q, z, s, g_idx, group = unpack(quant, t, shape, where)
    s32 = s.float().T                                                  # (O, G)
    zero = -(z.T.float() * s32)                                        # (O, G): the value of code 0
    w = q.float() * s32[:, g_idx] + zero[:, g_idx]                     # (O, I)
    exact = torch.equal(w, (q.float() - z.T.float()[:, g_idx]) * s32[:, g_idx])
    if not exact:
        raise ValueError(f"model: {where}.scales are {s.dtype}, whose products with 4-bit codes are not "
                         f"exact in float32; float16 or bfloat16 scales are read")
    contiguous = torch.equal(g_idx, torch.arange(shape[1]) // group)
    codes = Int4Codes(q[:, 0::2] | (q[:, 1::2] << 4), s32.contiguous(), zero.contiguous(), group) if contiguous else None
    return w, codes
