"""A CPU's matrix products, routed by their row count: `CpuLinear`.

On a CPU the speed of a matrix product depends on the library that runs it and on its *shape*,
far more than on its arithmetic. `F.linear` goes to MKL, Intel's math library, which takes its
fast code paths only on Intel CPUs; oneDNN, PyTorch's other CPU math library, does well on both
vendors once the rows are many enough. `CpuLinear` (phase 4's replacement of every `Linear` of a
CPU engine's model, the same weight) takes, for a float32 product of N rows:

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
from tinyvllm.layers import Linear

from .cpu_amx import AMX, amx_fits, amx_matmul, amx_packed, kept

GEMV = CKernel(Path(__file__).with_name("cpu_gemv.c"), ["-O3", "-mavx2", "-mfma", "-fno-math-errno", "-fopenmp",
               "-shared", "-fPIC"], AVX2_FLAGS, {"f32_matmul": [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3},
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
        """Up to how many rows `forward` runs cpu_gemv.c (0: never). Whether it can run on the
        weight is kept on the weight, asked again when its memory or dtype changes (`.half()`
        keeps the Parameter): a few microseconds a call less."""
        w = self.weight
        key, cached = (w.data_ptr(), w.dtype), getattr(w, "_gemv_ok", None)
        if cached is None or cached[0] != key:
            cached = w._gemv_ok = (key, w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
                                   and GEMV.available())
        return self.gemv_rows if cached[1] else 0

    def amx_max_rows(self) -> int:
        """Up to how many rows a bfloat16 product on this weight runs on cpu_amx.c (0: not here)."""
        return amx_rows_for(self.weight, self.amx_rows)

    def has_own_product(self) -> bool:
        """Whether `forward` runs a product of its own on this weight (cpu_gemv.c in float32,
        `upcast_linear` in bfloat16) that a compiler tracing it would not see: phase 7's compiled
        step calls such a layer as it is."""
        w = self.weight
        return bool(self.gemv_max_rows()) or (w.dtype == torch.bfloat16 and w.is_cpu and self.upcast_rows > 0)

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
