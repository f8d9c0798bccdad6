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

`keep_lossless(model)` is phase 5's default for a float32 model on a CPU whose kind the platform
measured it on (its `codes_max_rows` rule); `quantization` ("int8", "int4") replaces the weights
instead.
"""

from __future__ import annotations

import torch
from torch import nn

from phases.p04_triton_kernels.cpu_layers import CpuLinear
from tinyvllm import platform
from tinyvllm.ckernel import CKernel
from tinyvllm.hardware import AVX2_FLAGS

from .cpu_int8 import HERE, I64, P

SIGNATURES = {"lossless_find": [P] * 5 + [I64] * 3, "lossless_matmul": [P] * 5 + [I64] * 4}
LOSSLESS = CKernel(HERE / "cpu_lossless.c", ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"],
                   AVX2_FLAGS, SIGNATURES, fallback="float32 layers keep their float32 products",
                   defines={"CODES_AHEAD": "codes_fetch_ahead"})


def lossless_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The codes of a float32 weight (O, I) that lies exactly on a grid of blocks of 32 columns:
    4-bit ones (codes, scale, zero) if they give it back bit for bit, else 8-bit ones (codes,
    scale, None), else 8-bit codes with a scale per 16 columns (GGUF Q6_K's groups: "6 bits";
    scale (O, I/16)), else None."""
    if w.dtype != torch.float32 or not w.is_cpu or w.dim() != 2 or w.shape[1] % 32 or not LOSSLESS.available():
        return None
    (o, i), exact, w = w.shape, torch.zeros(1, dtype=torch.int32), w.detach().contiguous()
    for bits, dtype in ((4, torch.uint8), (8, torch.int8), (6, torch.int8)):
        per = 16 if bits == 6 else 32
        codes, scale = torch.empty(o, i // 2 if bits == 4 else i, dtype=dtype), torch.empty(o, i // per)
        zero = torch.empty(o, i // 32)
        LOSSLESS.lib.lossless_find(w.data_ptr(), codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), exact.data_ptr(),
                                   o, i, bits)
        if exact.item():
            return codes, scale, zero if bits == 4 else None
    return None


class LosslessLinear(CpuLinear):
    """A float32 `CpuLinear` that also keeps its weight's exact codes (`lossless_codes`): up to
    `max_rows` rows (the platform's `codes_max_rows`) its product reads them (cpu_lossless.c), or
    fewer where bfloat16 products start sooner (`CpuLinear.own_rows`); from there on it is
    `CpuLinear`'s (oneDNN's on the packed float32 weight, or its bfloat16 copy)."""

    def __init__(self, linear: CpuLinear, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias      # the same Parameters (a tied head stays tied)
        self.bf16_rows = linear.bf16_rows
        self.max_rows = platform.current().rule("codes_max_rows")
        # 4: codes and zero points; 8: int8 codes, a scale per 32 columns; 6: a scale per 16
        self.bits = 4 if zero is not None else 6 if scale.shape[1] * 16 == linear.in_features else 8
        self.register_buffer("codes", codes)                    # (O, I/2) uint8 or (O, I) int8
        self.register_buffer("scale", scale)                    # (O, I/32) float32 (6 bits: (O, I/16))
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
    """`linear` as a `LosslessLinear` where it is a float32 `CpuLinear` with exact codes, on a kind
    whose platform reads them (`codes_max_rows`), else itself."""
    wanted = type(linear) is CpuLinear and platform.current().rule("codes_max_rows")
    codes = lossless_codes(linear.weight) if wanted else None
    return linear if codes is None else LosslessLinear(linear, *codes)


def keep_lossless(model: nn.Module) -> None:
    """Replace each float32 `CpuLinear` of `model` whose weight has exact codes by a
    `LosslessLinear`, in place."""
    for name, m in list(model.named_modules()):
        if (new := lossless(m)) is not m:
            model.set_submodule(name, new)
