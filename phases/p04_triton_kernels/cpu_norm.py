"""RMSNorm with its residual add, and RoPE, in one C call each (cpu_norm.c): `CpuRMSNorm`,
`CpuRotaryEmbedding`.

Between the products, a decoder layer runs small elementwise work: the residual add and the RMSNorm
after it, the rotation of q and k. PyTorch does each as several operator calls, each a pass over
the rows and, at a decode step's few rows, a few microseconds of dispatch. cpu_norm.c does the add
and the norm in one pass (vLLM's `fused_add_rms_norm`) and RoPE on q and k where they lie in the
qkv product's output. The norm sums its squares in its own order (float32 rounding apart from
PyTorch's); RoPE rounds as PyTorch's operators do (`-ffp-contract=off`), bit for bit.

Where each runs is the platform's: the model's norms and RoPE where `c_norm_prompt` and `c_rope`
say (measured at a prompt's rows), phase 7's decode step's norms where `c_norm_decode` does.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tinyvllm.ckernel import CKernel
from tinyvllm.hardware import AVX2_FLAGS
from tinyvllm.layers import RMSNorm, RotaryEmbedding

P, I64 = ctypes.c_void_p, ctypes.c_int64
# -ffp-contract=off: `rope` rounds each product before the sum, as PyTorch's operators do
NORM = CKernel(Path(__file__).with_name("cpu_norm.c"), ["-O3", "-mavx2", "-mfma", "-ffp-contract=off",
               "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"], AVX2_FLAGS,
               {"add_rms_norm": [P] * 4 + [I64] * 2 + [ctypes.c_float], "rope": [P, I64, I64] + [P] * 3 + [I64] * 2},
               fallback="the residual add and RMSNorm, and RoPE, stay PyTorch's operators")


def norm_lib():
    """cpu_norm.c, built and loaded at the first call (None where it cannot be)."""
    return NORM.lib if NORM.tried else NORM.load()


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """vLLM's fused residual add + RMSNorm in one call of cpu_norm.c, for float32 rows (N, D) in a
    CPU's memory: residual += x, then x = norm(residual), both in place, returns (x, residual);
    without a residual, (norm(x), x). Given `out` (x's shape, contiguous), the norm goes there and
    x is only read. None where it does not run (another dtype or device, a graph being traced, no
    C compiler): the caller takes PyTorch's operators."""
    w = norm.weight
    if (x.dtype != torch.float32 or w.dtype != torch.float32 or not x.is_cpu or x.dim() != 2
            or not x.is_contiguous() or w.shape != x.shape[1:]
            or any(t is not None and (t.shape != x.shape or t.dtype != x.dtype or not t.is_contiguous())
                   for t in (residual, out))
            or torch.compiler.is_compiling() or norm_lib() is None):
        return None
    if out is None:
        out = torch.empty_like(x) if residual is None else x
    NORM.lib.add_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), w.data_ptr(),
                          out.data_ptr(), x.shape[0], x.shape[1], norm.eps)
    return out, x if residual is None else residual


class CpuRMSNorm(RMSNorm):
    """`RMSNorm` whose float32 rows, outside autograd, take `fused_add_rms_norm`: the block's
    output x is only read, the stream (`residual`) gets the sum in place, as vLLM's fused op does;
    elsewhere the plain module."""

    @classmethod
    def like(cls, norm: RMSNorm) -> "CpuRMSNorm":
        new = cls(norm.weight.shape[0], norm.eps)
        new.weight = norm.weight
        return new

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not torch.is_grad_enabled() and (fused := fused_add_rms_norm(x, residual, self, torch.empty_like(x))):
            return fused[0] if residual is None else fused
        return super().forward(x, residual)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x (N, heads, d), each head's d floats in a row (a view of the qkv product will do), rotated
    by cos, sin (N, 1, d) in cpu_norm.c; None where it does not run (the caller's operators do)."""
    n, heads, d = x.shape
    if (x.dtype != torch.float32 or not x.is_cpu or torch.is_grad_enabled() or d % 16
            or x.stride(2) != 1 or x.stride(1) != d or torch.compiler.is_compiling()
            or cos.shape != (n, 1, d) or cos.dtype != torch.float32 or not cos.is_contiguous()
            or sin.shape != cos.shape or sin.dtype != torch.float32 or not sin.is_contiguous()
            or norm_lib() is None):
        return None
    out = x.new_empty(n, heads, d)
    NORM.lib.rope(x.data_ptr(), x.stride(0), heads, cos.data_ptr(), sin.data_ptr(), out.data_ptr(), n, d)
    return out


class CpuRotaryEmbedding(RotaryEmbedding):
    """`RotaryEmbedding` (the same tables) whose `rotate` is one call of cpu_norm.c's `rope` for q
    and one for k, where both run there; PyTorch's operators elsewhere."""

    @classmethod
    def like(cls, rotary: RotaryEmbedding) -> "CpuRotaryEmbedding":
        return cls(rotary.config, rotary.max_positions, (rotary.cos, rotary.sin))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        fast = rope(q, cos, sin), rope(k, cos, sin)
        if fast[0] is not None and fast[1] is not None:
            return fast
        return super().rotate(q, k, cos, sin)
