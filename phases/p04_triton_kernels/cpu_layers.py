"""The model's layers on a CPU: products routed by their row count (`CpuLinear`), the residual add
and RMSNorm, and RoPE, in one C call each (`CpuRMSNorm`, `CpuRotaryEmbedding`).

**Products.** On a CPU the speed of a matrix product depends on the library that runs it and on
its *shape*, far more than on its arithmetic. `F.linear` goes to MKL, Intel's math library, which
takes its fast code paths only on Intel CPUs; oneDNN, PyTorch's other CPU math library, does well
on both vendors once the rows are many enough. `CpuLinear` (phase 4's replacement of every
`Linear` of a CPU engine's model, the same weight) takes, for a float32 product of N rows:

    N <= gemv_max_rows        cpu_gemv.c: tinyvllm's own AVX2 loop, which streams the weights
                              fastest where the platform measured it (an AVX2 EPYC)
    N <= small_rows           a library's small-row product: MKL's F.linear on an Intel CPU,
                              (W @ x^T)^T elsewhere (one row padded with a row of zeros)
    otherwise                 oneDNN on the weight *pre-packed* once into its blocked layout, the
                              way vLLM's CPU backend does (one more copy of the weights in memory)

and with `dtype="auto"` on a CPU that computes bfloat16, from `bf16_rows` rows on the product runs
in bfloat16 (x rounded, the sums float32's, the output float32): on cpu_amx.c's AMX tiles up to
the platform's `amx_product_max_rows`, then on oneDNN's packed bfloat16 copy of the weight. A
bfloat16 model's products run in oneDNN where bfloat16 is native (`bf16_onednn`), or from many rows
in float32 where it is not (`upcast_linear`). Each threshold is a rule of `tinyvllm.platform`, read
when the layer is made; every path gives F.linear's numbers up to float rounding (phase 4's tests).
Elsewhere (a GPU, another dtype, autograd recording the weight's gradient) it is plain `F.linear`.
Inside a graph torch.compile traces with a dynamic row count, the oneDNN product is the operator
`torch.ops.tinyvllm.onednn_linear` (phase 7's compiled step).

**Norms and RoPE.** Between the products a decoder layer runs small elementwise work: the residual
add and the RMSNorm after it, the rotation of q and k. PyTorch does each as several operator
calls, each a pass over the rows and, at a decode step's few rows, a few microseconds of dispatch.
cpu_norm.c does the add and the norm in one pass (vLLM's `fused_add_rms_norm`) and RoPE on q and k
where they lie in the qkv product's output. The norm sums its squares in its own order (float32
rounding apart from PyTorch's); RoPE rounds as PyTorch's operators do (`-ffp-contract=off`), bit
for bit. Where each runs is the platform's: the model's norms and RoPE where `c_norm_prompt` and
`c_rope` say (measured at a prompt's rows), phase 7's decode step's norms where `c_norm_decode` does.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm import platform
from tinyvllm.ckernel import CKernel
from tinyvllm.hardware import AVX2_FLAGS
from tinyvllm.layers import Linear, RMSNorm, RotaryEmbedding

from .cpu_amx import AMX, amx_fits, amx_matmul, amx_packed, kept, silu_and_mul

P, I64 = ctypes.c_void_p, ctypes.c_int64

GEMV = CKernel(Path(__file__).with_name("cpu_gemv.c"), ["-O3", "-mavx2", "-mfma", "-fno-math-errno", "-fopenmp",
               "-shared", "-fPIC"], AVX2_FLAGS, {"f32_matmul": [P] * 3 + [I64] * 3},
               fallback="Linear keeps PyTorch's float32 products")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (N, I) @ weight (O, I)^T + bias, float32 on the CPU, through cpu_gemv.c."""
    x, y = x.contiguous(), torch.empty(x.shape[0], weight.shape[0])
    GEMV.lib.f32_matmul(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], weight.shape[0], x.shape[1])
    return y if bias is None else y.add_(bias)


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  chunk: int = 1024) -> torch.Tensor:
    """x (N, I) @ weight (O, I)^T + bias computed in float32, returned in x's dtype: the weight
    made float32 `chunk` output rows at a time (2.4 MB at I = 576: it stays in the core's cache
    for the product), never all at once."""
    xf, out = x.float(), x.new_empty(x.shape[0], weight.shape[0])
    for s in range(0, weight.shape[0], chunk):
        out[:, s:s + chunk] = F.linear(xf, weight[s:s + chunk].float(),
                                       None if bias is None else bias[s:s + chunk].float())
    return out


def onednn_packed(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`w` (made `dtype` first, where given) in oneDNN's blocked layout, made at the first call
    and kept on the tensor itself until `w` changes."""
    dtype = dtype or w.dtype
    return kept(w, f"_onednn_packed_{dtype}", lambda: torch.ops.mkldnn._reorder_linear_weight(w.detach().to(dtype)))


def onednn_bf16_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (N, I) rounded to bfloat16 @ the weight's packed bfloat16 copy in oneDNN, the output
    bfloat16 (oneDNN rounds its float32 sums)."""
    return torch.ops.mkldnn._linear_pointwise(x.bfloat16(), onednn_packed(weight, torch.bfloat16), None, "none", [], "")


def onednn_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`onednn_bf16_out` made float32 again, the bias added in float32."""
    y = onednn_bf16_out(x, weight).float()
    return y if bias is None else y.add_(bias)


def amx_rows_for(weight: torch.Tensor, rows: int) -> int:
    """`rows` (the platform's `amx_product_max_rows`) where cpu_amx.c takes this weight
    (`amx_fits`), else 0; kept on the weight, asked again when its memory, dtype or shape change."""
    if not rows:
        return 0
    key, cached = (weight.data_ptr(), weight.dtype, tuple(weight.shape)), getattr(weight, "_amx_ok", None)
    if cached is None or cached[0] != key:
        cached = weight._amx_ok = (key, amx_fits(weight))
    return rows if cached[1] else 0


def onednn_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  bf16_rows: int = 0, amx_rows: int = 0) -> torch.Tensor:
    """x (N, I) @ weight (O, I)^T + bias in oneDNN on the packed weight; a float32 x of at least
    `bf16_rows` rows (0: never) in bfloat16, on the weight's packed bfloat16 copy, the output
    float32 (the bias added in float32); up to `amx_rows` rows (where cpu_amx.c takes the weight),
    that product is cpu_amx.c's."""
    if 0 < bf16_rows <= x.shape[0] and x.dtype == torch.float32:
        return (amx_matmul if x.shape[0] <= amx_rows_for(weight, amx_rows) else onednn_bf16)(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, onednn_packed(weight), bias, "none", [], "")


# oneDNN's product with a packed weight, for a graph torch.compile builds: inductor cannot lower
# `mkldnn._linear_pointwise` on a packed weight it did not pack itself, but it calls an operator
# registered here as it is (phase 7's compiled step)
@torch.library.custom_op("tinyvllm::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bf16_rows: int,
                  amx_rows: int) -> torch.Tensor:
    return onednn_matmul(x, weight, bias, bf16_rows, amx_rows)


@onednn_linear.register_fake
def _(x, weight, bias, bf16_rows, amx_rows):
    return x.new_empty(x.shape[0], weight.shape[0])


class CpuLinear(Linear):
    """`Linear` (the same weight, the same names) with the product of the CPU path chosen by its
    rows (the module docstring); its thresholds are the platform's rules when it is made."""

    bf16_rows = 0   # from this many rows a float32 product runs in bfloat16 (0: never; `use_bfloat16_products`)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        p = platform.current()
        self.use_onednn = p.onednn
        self.small_rows, self.small_rows_mkl = p.small_rows      # MKL's small-row kernel on Intel
        self.gemv_rows = p.rule("gemv_max_rows")
        self.upcast_rows = p.rule("bf16_upcast_from_rows")
        self.bf16_onednn = self.use_onednn and p.rule("bf16_onednn")
        self.amx_rows = p.rule("amx_product_max_rows")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0] if x.dim() == 2 else 0
        if (x.device.type != "cpu" or n == 0 or x.dtype != torch.float32
                or (self.weight.requires_grad and torch.is_grad_enabled())):
            if x.dtype == torch.bfloat16 and x.is_cpu and n and not torch.is_grad_enabled():
                if (self.weight.dtype == torch.bfloat16 and not torch.compiler.is_compiling()
                        and n <= self.amx_max_rows()):   # a bfloat16 model's few rows: AMX tiles
                    return amx_matmul(x.float(), self.weight, self.bias).bfloat16()
                if self.bf16_onednn and self.weight.dtype == torch.bfloat16:
                    return self.onednn_product(x)
                if 0 < self.upcast_rows <= n and not torch.compiler.is_compiling():
                    return upcast_linear(x, self.weight, self.bias)   # (a trace never asks)
            return F.linear(x, self.weight, self.bias)
        if not torch.compiler.is_compiling() and n <= self.gemv_max_rows():   # (a trace never asks)
            return gemv(x, self.weight, self.bias)
        # a graph torch.compile traces for more than one row takes the many-rows path at any
        # count (its row count is dynamic: `n <= small_rows` would split the graph in two)
        if (n == 1) if torch.compiler.is_compiling() else (n <= self.small_rows):
            if self.small_rows_mkl or not self.use_onednn:
                return F.linear(x, self.weight, self.bias)
            if n == 1:
                x = torch.cat([x, x.new_zeros(1, x.shape[1])])           # (2, in)
            y = (self.weight @ x.T)[:, :n].T.contiguous()                # (n, out)
            return y if self.bias is None else y + self.bias
        return self.onednn_product(x) if self.use_onednn else F.linear(x, self.weight, self.bias)

    def onednn_product(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's product on the packed weight (`onednn_matmul`); in a graph being traced, the
        same call as an operator the compiler leaves alone."""
        if torch.compiler.is_compiling():
            return torch.ops.tinyvllm.onednn_linear(x, self.weight, self.bias, self.bf16_rows, self.amx_rows)
        return onednn_matmul(x, self.weight, self.bias, self.bf16_rows, self.amx_rows)

    def own_rows(self, rows: int) -> int:
        """Up to how many rows a product of a subclass's own that serves up to `rows` runs, before
        the bfloat16 products take over (from `bf16_rows`, where they are on)."""
        return min(rows, self.bf16_rows - 1) if self.bf16_rows else rows

    def gemv_max_rows(self) -> int:
        """Up to how many rows `forward` runs cpu_gemv.c (0: never), fewer where the bfloat16
        products start sooner (`own_rows`). Whether it can run on the weight is kept on the
        weight, asked again when its memory or dtype changes (`.half()` keeps the Parameter): a
        few microseconds a call less."""
        w = self.weight
        key, cached = (w.data_ptr(), w.dtype), getattr(w, "_gemv_ok", None)
        if cached is None or cached[0] != key:
            cached = w._gemv_ok = (key, w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
                                   and GEMV.available())
        return self.own_rows(self.gemv_rows) if cached[1] else 0

    def amx_max_rows(self) -> int:
        """Up to how many rows a bfloat16 product on this weight runs on cpu_amx.c (0: not here)."""
        return amx_rows_for(self.weight, self.amx_rows)

    def has_own_product(self) -> bool:
        """Whether `forward` runs a product of its own on this weight (cpu_gemv.c in float32,
        `upcast_linear` or cpu_amx.c's tiles in bfloat16) that a compiler tracing it would not
        see: phase 7's compiled step calls such a layer as it is."""
        w = self.weight
        return bool(self.gemv_max_rows()) or (w.dtype == torch.bfloat16 and w.is_cpu
                                              and (self.upcast_rows > 0 or self.amx_max_rows() > 0))

    def packed_weight(self) -> torch.Tensor:
        """The weight in oneDNN's layout, packed again if the weight was replaced or changed."""
        return onednn_packed(self.weight)


def use_bfloat16_products(model: nn.Module, rows: int) -> None:
    """From `rows` rows on (0: never), every layer of `model` with a `bf16_rows` (a float32
    `CpuLinear`; phase 5's int4 layers, for their prompts) multiplies in bfloat16 (the platform's
    `bf16_products_from_rows`, with dtype="auto"). A phase that makes layers of its own (phase 5's,
    phase 7's fused projections) calls it again."""
    for m in model.modules():
        if hasattr(m, "bf16_rows"):
            m.bf16_rows = rows


def runs_bf16(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether `layer` is a `CpuLinear` (or subclass) whose product at x's rows is oneDNN's
    bfloat16 one (from `bf16_rows`, past `amx_max_rows`), without a bias, outside a trace and
    autograd."""
    if torch.compiler.is_compiling() or not isinstance(layer, CpuLinear) or not layer.bf16_rows:
        return False   # (a graph being traced asks nothing more: amx_max_rows may load a library)
    w, n = layer.weight, x.shape[0] if x.dim() == 2 else 0
    return (layer.use_onednn and layer.bias is None and n >= max(layer.bf16_rows, layer.amx_max_rows() + 1)
            and w.dtype == torch.float32 and x.is_cpu and x.dtype in (torch.float32, torch.bfloat16)
            and not (w.requires_grad and torch.is_grad_enabled()))


def bf16_product(layer: nn.Module, x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """`layer(x)` as `out_dtype` where `runs_bf16(layer, x)`: x may be float32 or bfloat16, and
    oneDNN's output is bfloat16 before any conversion, so a caller that goes on in bfloat16 reads
    half the bytes and makes no float32 copy. None elsewhere: the caller runs `layer(x)`."""
    return onednn_bf16_out(x, layer.weight).to(out_dtype) if runs_bf16(layer, x) else None


def bfloat16_weights(layers: list[nn.Module]) -> tuple | None:
    """For a C++ caller of `layers` (phase 7's cpu_ops.cpp): each `CpuLinear`'s weight packed in
    bfloat16 and its `bf16_rows` (an empty tensor and 0 for another layer, or one without), its
    AMX copy where cpu_amx.c takes its rows (else empty), that function's address and up to how
    many rows it serves (0: none); None where no layer has any."""
    rows = [m.bf16_rows if isinstance(m, CpuLinear) else 0 for m in layers]
    if not any(rows):
        return None
    amx = [amx_packed(m.weight) if r and m.amx_max_rows() else torch.empty(0) for m, r in zip(layers, rows)]
    most = max(m.amx_max_rows() if r else 0 for m, r in zip(layers, rows))
    return ([onednn_packed(m.weight, torch.bfloat16) if r else torch.empty(0) for m, r in zip(layers, rows)], rows,
            amx, AMX.address("amx_linear") if most else 0, most)


def bf16_mlp(gate_up: nn.Module, down: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """down(silu(gate) * up) of a fused MLP ([gate, up] = gate_up(x): phase 7's), kept in bfloat16
    between its products where both are oneDNN's bfloat16 ones at x's rows (`runs_bf16`: a
    prompt's, with dtype="auto"): gate_up's output stays bfloat16 and cpu_amx.c's `silu_and_mul`
    and down read it so, half the bytes of float32's and no float32 copy of the widest activation
    (the SiLU's product rounded to bfloat16 as down's input is anyway); the output float32. None
    where they are not (the caller runs the MLP as it is). A layer in a compiled step's wrapper
    (`.layer`) is looked into."""
    gate_up, down = (getattr(m, "layer", m) for m in (gate_up, down))
    if not (runs_bf16(gate_up, x) and runs_bf16(down, x)):
        return None
    return bf16_product(down, silu_and_mul(bf16_product(gate_up, x, torch.bfloat16)))


# -- norms and RoPE ------------------------------------------------------------------------------

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
        if x.dim() == 2 and not torch.is_grad_enabled() and (  # (N, D) rows; a head's q or k norm (N, H, d) is PyTorch's
                fused := fused_add_rms_norm(x, residual, self, torch.empty_like(x))):
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
