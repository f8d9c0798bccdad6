"""Phase 4's Triton kernels over the quantized KV cache: a quantizing write, a dequantizing read.

Phase 4's kernels store and load the cache through two `tl.constexpr` arguments, `STORE_KV` and
`LOAD_KV` (a `@triton.jit` function is a compile-time constant: the call is inlined, and a
kernel is compiled per function passed), and take *side data* beside the cache: here, its
scales. This module supplies the quantized cache's pair, and nothing else of the kernels changes:

- `_store_quantized_kv`: for each KV head of a new token, s = max|x| / QMAX, the values x / s
  rounded (int8: to the nearest integer, ties to even, within +-127; fp8: to the nearest float8
  e4m3 value), stored as bytes, and s beside them: bit for bit what `quantize_kv` stores.
- `_load_quantized_kv_block`: phase 4's `read_kv_block` reads a block's bytes, then each
  (token, head) row is multiplied by its scale in float32, as `dequantize_kv` does; the kernel
  casts the block to the compute dtype before its products.

fp8 is stored as uint8 (see `QuantizedKVCache`): the cache pointer's dtype tells the formats apart
at compile time, and the bytes are bitcast to `tl.float8e4nv` (e4m3, "fn": no infinities, 448 the
largest). The write rounds to the e4m3 grid in float32 itself, so the cast after it is exact:
Triton's interpreter rounds a float32-to-fp8 cast differently from PyTorch (ties away from zero,
and a carry out of the mantissa is lost), and the GPU's cast needs compute capability 8.9.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phases.p04_triton_kernels.triton_backend import TritonPagedAttention
from phases.p04_triton_kernels.triton_attention import read_kv_block, reshape_and_cache, unified_attention

from .kv_quant import KV_CACHE_DTYPES

INT8_MAX: tl.constexpr = tl.constexpr(KV_CACHE_DTYPES["int8"][1])   # 127
FP8_MAX: tl.constexpr = tl.constexpr(KV_CACHE_DTYPES["fp8"][1])     # 448, e4m3's largest value
# 1.5 * 2^23: float32 x + this - this is x rounded to an integer, ties to even, for |x| < 2^22
# (the sum has no bits below 1). Triton's interpreter has no rint; both it and a GPU add in IEEE.
RNE_MAGIC: tl.constexpr = tl.constexpr(12582912.0)


@triton.jit
def _rint(x):
    """x (float32, |x| < 2^22) rounded to the nearest integer, ties to even (torch.round)."""
    return (x + RNE_MAGIC) - RNE_MAGIC


@triton.jit
def _round_to_e4m3(y):
    """y (float32, |y| <= 448) rounded to the nearest float8 e4m3 value, ties to even, as
    PyTorch's cast rounds: e4m3 keeps 3 mantissa bits, so within y's binade [2^e, 2^(e+1)) its
    values are 2^(e-3) apart (below 2^-6, the subnormals, 2^-9 apart). Exact in float32."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)             # y's binade (subnormals: -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)    # 2^(e-3)
    inv_step = ((127 - e + 3) << 23).to(tl.float32, bitcast=True)
    r = _rint(tl.abs(y) * inv_step) * step                       # powers of two: exact products
    # y's sign bit put back, -0.0 included: triton 3.6 compiles -r as 0 - r, +0.0 for r = 0
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_store(x, cache_ptr, scale_ptr, dst, scale_dst, mask, head_ok):
    """Quantize one token's K (or V), x (KVH_P2, HEAD_P2), per KV head, as `quantize_kv` does,
    and store the bytes and the scales (KVH_P2, 1)."""
    x = x.to(tl.float32)
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1, keep_dims=True)
    if cache_ptr.dtype.element_ty == tl.uint8:  # fp8 e4m3, stored as its bytes
        scale = tl.math.div_rn(tl.maximum(amax, 1e-8), FP8_MAX)  # div_rn: IEEE division, as torch's
        y = _round_to_e4m3(tl.math.div_rn(x, scale))
        q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        scale = tl.math.div_rn(tl.maximum(amax, 1e-8), INT8_MAX)
        y = _rint(tl.math.div_rn(x, scale))
        q = tl.minimum(tl.maximum(y, -INT8_MAX), INT8_MAX).to(tl.int8)
    tl.store(cache_ptr + dst, q, mask=mask)
    tl.store(scale_ptr + scale_dst, scale, mask=head_ok)


@triton.jit
def _store_quantized_kv(k, v, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, dst, scale_dst, mask,
                        head_ok):
    """Phase 4's `write_kv` for a quantized cache (its STORE_KV)."""
    _quantize_store(k, k_cache_ptr, k_scale_ptr, dst, scale_dst, mask, head_ok)
    _quantize_store(v, v_cache_ptr, v_scale_ptr, dst, scale_dst, mask, head_ok)


@triton.jit
def _dequantize(q, scale):
    """Bytes (BLOCK_SIZE, HEAD_P2) and their scales (BLOCK_SIZE,) -> float32 values."""
    if q.dtype == tl.uint8:  # fp8 e4m3, stored as its bytes
        q = q.to(tl.float8e4nv, bitcast=True)
    return q.to(tl.float32) * scale[:, None]


@triton.jit
def _load_quantized_kv_block(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block, kv_head, k_pos,
                             seq_len, head_dim, stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
                             BLOCK_SIZE: tl.constexpr, HEAD_P2: tl.constexpr):
    """Phase 4's `read_kv_block` for a quantized cache (its LOAD_KV): the bytes as phase 4 reads
    them, times each (token, head)'s scale. Slots past seq_len read as 0."""
    k, v = read_kv_block(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block, kv_head, k_pos,
                          seq_len, head_dim, stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
                          BLOCK_SIZE, HEAD_P2)
    scale_offsets = block * stride_sb + tl.arange(0, BLOCK_SIZE) * stride_st + kv_head
    k_scale = tl.load(k_scale_ptr + scale_offsets, mask=k_pos < seq_len, other=0.0)
    v_scale = tl.load(v_scale_ptr + scale_offsets, mask=k_pos < seq_len, other=0.0)
    return _dequantize(k, k_scale), _dequantize(v, v_scale)


def reshape_and_cache_quantized(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, scales: torch.Tensor,
                                slot_mapping: torch.Tensor) -> None:
    """Quantize new tokens' K/V into one layer of a `QuantizedKVCache`, in place.

    k, v: (N, KVH, d) float; kv: (2, num_blocks, block_size, KVH, d) int8 (int8) or uint8 (fp8);
    scales: (2, num_blocks, block_size, KVH) float32; slot_mapping (N,), -1 skips a token.
    """
    reshape_and_cache(k, v, kv[0], kv[1], slot_mapping, scales[0], scales[1], _store_quantized_kv)


def unified_attention_quantized(q: torch.Tensor, kv: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                                *args, **kwargs) -> torch.Tensor:
    """Phase 4's `unified_attention` over one layer of a `QuantizedKVCache` (kv, scales as in
    `reshape_and_cache_quantized`); the other arguments are `unified_attention`'s."""
    return unified_attention(q, kv[0], kv[1], out, *args, k_side=scales[0], v_side=scales[1],
                             load_kv=_load_quantized_kv_block, **kwargs)


class TritonQuantizedPagedAttention(TritonPagedAttention):
    """Phase 4's Triton backend over a `QuantizedKVCache`: the same two launches a layer, with
    the quantizing write and the dequantizing read, each layer in its sliding window if it has one."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv, scales = self.cache.kv[layer_idx], self.cache.scales[layer_idx]
        reshape_and_cache_quantized(k, v, kv, scales, self.meta.slot_mapping)
        return unified_attention_quantized(q, kv, scales, torch.empty_like(q), self.query_start_loc,
                                           self.seq_lens, self.block_tables, self.max_query_len,
                                           self.max_seq_len,
                                           window=self.cache.windows[layer_idx] if self.cache.windows else None)
