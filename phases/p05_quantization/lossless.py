"""A float32 checkpoint that was stored quantized, read from its codes: `LosslessLinear`.

The default model ships as a GGUF file whose projections are Q4_1 (4-bit codes, a scale and a
minimum per block of 32 columns) and whose embedding, the tied LM head, is Q8_0 (8-bit codes and a
scale per block of 32). Converted to float32, every weight is still exactly code * scale (+ zero):
the 538 MB a float32 decode step reads hold about 80 + 31 MB of information. `lossless_codes`
finds those codes where they exist (and proves it: they must give back every float32 weight bit
for bit, cpu_lossless.c); a `LosslessLinear` keeps both, the float32 weight for many rows (a
prefill: PyTorch's float32 product, bound by arithmetic) and the codes for a few (a decode step,
bound by the bytes it reads), where cpu_lossless.c rebuilds each weight exactly in registers
and multiplies in float32. The model's weights and arithmetic stay float32's; only the order of
the sums changes, as it does between any two float32 kernels. vLLM likewise runs a GGUF
checkpoint from its quantized blocks.

`keep_lossless(model)` is phase 5's default for a float32 model on an AVX2 CPU
(`LOSSLESS_MAX_ROWS`); `quantization` ("int8", "int4") replaces the weights instead.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyvllm.ckernel import CKernel
from tinyvllm.hardware import AVX2_FLAGS, cpu_kind
from tinyvllm.model import Linear

from .cpu_int8 import HERE, I64, P

SIGNATURES = {"lossless_find": [P] * 5 + [I64] * 3, "lossless_matmul": [P] * 5 + [I64] * 4}
LOSSLESS = CKernel(HERE / "cpu_lossless.c", ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"],
                   AVX2_FLAGS, SIGNATURES, fallback="float32 layers keep their float32 products")

# Up to how many rows a `LosslessLinear` reads its codes, per CPU kind. On an AVX2 AMD EPYC (Zen 4)
# the default model's 211 products took 7.8 ms from their codes against 29.9 with cpu_gemv.c at
# 1 row, 23.0 against oneDNN's 38.9 at 8, 33.9 against 45.6 at 12, 56.3 against 60.5 at 16 and
# 105.2 against 75.4 at 24 (`python -m tinyvllm.entrypoints.bench.linear`,
# docs/assets/bench/linear-codes-zen4.txt; two more runs: 16 rows a tie). On an AVX-512 Zen 4
# EPYC (avx512_vnni): 7.0 against Linear's 21.4 at 1 row, 27.1 against 32.1 at 12, 42.0 against
# 35.8 at 16 (linear-codes-zen4-avx512.txt; the engine at batch 1 83.9 against 33.7 tok/s, at 8 257.8
# against 186.3: kind-rules-zen4-avx512.json). On the amx kind (a GPU machine's Xeon host pinned
# to 2 cores) 18.4 against 27.4 at 1 row, 38.1 against 51.1 at 8, where oneDNN's bfloat16 products
# (`BF16_PRODUCT_ROWS`, from 6 rows there since cpu_amx.c) take over: 37.1 against 49.3 at 12
# (linear-codes-xeon-amx.txt; the engine at batch 1 31.8 -> 55.0 tok/s, at 8 147.2 -> 179.5:
# kind-rules-xeon-amx.json).
LOSSLESS_MAX_ROWS = {"avx2": 12, "avx512_vnni": 12, "amx": 8}


def lossless_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The codes of a float32 weight (O, I) that lies exactly on a grid of blocks of 32 columns:
    4-bit ones (codes, scale, zero) if they give it back bit for bit, else 8-bit ones (codes,
    scale, None), else None."""
    if w.dtype != torch.float32 or not w.is_cpu or w.dim() != 2 or w.shape[1] % 32 or not LOSSLESS.available():
        return None
    (o, i), exact, w = w.shape, torch.zeros(1, dtype=torch.int32), w.detach().contiguous()
    for bits, dtype in ((4, torch.uint8), (8, torch.int8)):
        codes, scale, zero = torch.empty(o, i * bits // 8, dtype=dtype), torch.empty(o, i // 32), torch.empty(o, i // 32)
        LOSSLESS.lib.lossless_find(w.data_ptr(), codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), exact.data_ptr(),
                                   o, i, bits)
        if exact.item():
            return codes, scale, zero if bits == 4 else None
    return None


class LosslessLinear(Linear):
    """A float32 `Linear` that also keeps its weight's exact codes (`lossless_codes`): up to
    `max_rows` rows its product reads them (cpu_lossless.c), or fewer where bfloat16 products
    start sooner (`Linear.own_rows`); from there on it is `Linear`'s (oneDNN's on the packed
    float32 weight, or its bfloat16 copy)."""

    max_rows = LOSSLESS_MAX_ROWS.get(cpu_kind(), 0)

    def __init__(self, linear: Linear, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias      # the same Parameters (a tied head stays tied)
        self.bits = 4 if zero is not None else 8
        self.register_buffer("codes", codes)                    # (O, I/2) uint8 or (O, I) int8
        self.register_buffer("scale", scale)                    # (O, I/32) float32
        self.register_buffer("zero", zero)                      # (O, I/32) float32, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.dim() == 2 and 0 < len(x) <= self.own_rows(self.max_rows) and x.dtype == torch.float32
                and x.is_cpu) or torch.compiler.is_compiling():
            return super().forward(x)
        x, y = x.contiguous(), torch.empty(len(x), self.out_features)
        LOSSLESS.lib.lossless_matmul(x.data_ptr(), self.codes.data_ptr(), self.scale.data_ptr(),
                                     0 if self.zero is None else self.zero.data_ptr(), y.data_ptr(), *y.shape,
                                     self.in_features, self.bits)
        return y if self.bias is None else y.add_(self.bias)


def lossless(linear: nn.Module) -> nn.Module:
    """`linear` as a `LosslessLinear` where it is a float32 `Linear` with exact codes, else itself."""
    codes = lossless_codes(linear.weight) if type(linear) is Linear and LosslessLinear.max_rows else None
    return linear if codes is None else LosslessLinear(linear, *codes)


def keep_lossless(model: nn.Module) -> None:
    """Replace each float32 `Linear` of `model` whose weight has exact codes by a `LosslessLinear`,
    in place."""
    for name, m in list(model.named_modules()):
        if (new := lossless(m)) is not m:
            model.set_submodule(name, new)
