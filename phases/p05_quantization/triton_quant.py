"""Triton kernels for CUDA: a matrix product that dequantizes int8 or int4 weights inside its loop.

The weight never exists in float in memory: each program loads a tile of int8 values (or of
packed int4 bytes, two values each), its scales (and zero points), turns the tile into float in
registers and multiplies. The bytes read from memory are the quantized ones, which is the whole
point at small batch.

- `wq_gemv`: one program per (row, tile of BLOCK_N outputs): a dot product by broadcasting and
  summing, for decode batches of a few rows.
- `wq_gemm`: tiles of BLOCK_M x BLOCK_N with `tl.dot`, for prefills and large batches.

Layouts are `QuantizedLinear`'s: int8 qweight (N, K) with scale (N,); int4 qweight (N, K/2)
uint8, column 2j in the low nibble, with scale and zero (N, K/group). Checked against the
reference on a CPU through Triton's interpreter (test_triton_quant.py, in a subprocess with
TRITON_INTERPRET=1), and compiled on CUDA by the gpu-marked tests; their speed on an H100 is in the bench reports
(docs/assets/bench/gpu-h100-latency-p7-int8.json, -p7-int4.json, gpu-h100-throughput-64-int4.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant_tile(qw_ptr, scale_ptr, zero_ptr, rk, rn, K, N, stride_qn, stride_sn,
                  GROUP: tl.constexpr, INT4: tl.constexpr):
    """The weight tile W^T[rk, rn] in float32, (BLOCK_K, BLOCK_N)."""
    # >>> exercise dequant_tile (2 stars): Dequantize inside the product: one tile of W^T (input columns rk, outputs rn) from int8 values and their row's scale, or from packed int4 bytes and their group's scale and zero point.
    # hint: W[n, k] sits at qw_ptr + n * stride_qn + k (int4: byte k // 2, low nibble for even k, high for odd); int4's scale and zero of W[n, k] are at n * stride_sn + k // GROUP; mask loads outside K and N.
    # checked by: test_triton_kernels_in_the_interpreter
    mask = (rk < K)[:, None] & (rn < N)[None, :]
    if INT4:
        byte = tl.load(qw_ptr + rn[None, :] * stride_qn + (rk // 2)[:, None], mask=mask, other=0).to(tl.int32)
        q = tl.where((rk % 2 == 0)[:, None], byte & 0xF, byte >> 4).to(tl.float32)
        g = rk // GROUP
        s = tl.load(scale_ptr + rn[None, :] * stride_sn + g[:, None], mask=mask, other=0.0)
        z = tl.load(zero_ptr + rn[None, :] * stride_sn + g[:, None], mask=mask, other=0.0)
        return q * s + z
    q = tl.load(qw_ptr + rn[None, :] * stride_qn + rk[:, None], mask=mask, other=0).to(tl.float32)
    s = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
    return q * s[None, :]
    # <<< exercise dequant_tile


@triton.jit
def _wq_gemv_kernel(x_ptr, qw_ptr, scale_ptr, zero_ptr, out_ptr, N, K, stride_xm, stride_qn,
                    stride_sn, stride_om, GROUP: tl.constexpr, INT4: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)      # (BK,)
        w = _dequant_tile(qw_ptr, scale_ptr, zero_ptr, rk, rn, K, N, stride_qn, stride_sn, GROUP, INT4)
        acc += tl.sum(x[:, None] * w, axis=0)                                                # (BN,)
    tl.store(out_ptr + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _wq_gemm_kernel(x_ptr, qw_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, stride_xm, stride_qn,
                    stride_sn, stride_om, GROUP: tl.constexpr, INT4: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=(rm < M)[:, None] & (rk < K)[None, :], other=0.0).to(tl.float32)  # (BM, BK)
        w = _dequant_tile(qw_ptr, scale_ptr, zero_ptr, rk, rn, K, N, stride_qn, stride_sn, GROUP, INT4)
        acc += tl.dot(x, w)                                                                   # (BM, BN)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


GEMV_MAX_ROWS = 8  # up to here one program per row (decode); beyond, tl.dot tiles
# A decode step's products are small (576 outputs): 16 outputs a program give 4x the programs of
# 64, and 128 columns an iteration a quarter of the dependent loads of 32. On an H100, phase 7 at
# batch 1 went from 210 to 271 tok/s with int4 weights, 255 to 293 with int8 (lab note 5).
GEMV_BLOCKS = dict(BLOCK_N=16, BLOCK_K=128)


def wq_matmul(x: torch.Tensor, layer, gemv: bool | None = None) -> torch.Tensor:
    """x (M, K) @ dequantize(layer)^T -> (M, N), dequantizing inside the kernel. `layer`: a
    `QuantizedLinear`; `gemv`: force one kernel (None: by the number of rows)."""
    x = x.contiguous()
    (m, k), n = x.shape, layer.out_features
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    int4 = layer.method == "int4"
    zero = layer.zero if int4 else layer.scale  # unused for int8
    stride_sn = layer.scale.stride(0) if int4 else 0
    group = layer.group_size if int4 else 1
    if gemv if gemv is not None else m <= GEMV_MAX_ROWS:
        grid = (m, triton.cdiv(n, GEMV_BLOCKS["BLOCK_N"]))
        _wq_gemv_kernel[grid](x, layer.qweight, layer.scale, zero, out, n, k, x.stride(0),
                              layer.qweight.stride(0), stride_sn, out.stride(0), GROUP=group,
                              INT4=int4, **GEMV_BLOCKS)
    else:
        grid = (triton.cdiv(m, 32), triton.cdiv(n, 64))
        _wq_gemm_kernel[grid](x, layer.qweight, layer.scale, zero, out, m, n, k, x.stride(0),
                              layer.qweight.stride(0), stride_sn, out.stride(0), GROUP=group,
                              INT4=int4, BLOCK_M=32, BLOCK_N=64, BLOCK_K=32)
    return out if layer.bias is None else out + layer.bias
