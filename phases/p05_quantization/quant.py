"""Weights in 8 and 4 bits: quantize, pack, dequantize, and a `QuantizedLinear` that multiplies.

int8 (W8A16), per output channel, symmetric. Each row of W (one output channel) gets one scale:

    s = max|w_row| / 127        q = round(w / s) in [-127, 127]        w ~ q * s

int4 (W4A16), per group of `group_size` input columns, asymmetric. Each group of a row gets a
scale and a zero point, so a group whose values are all positive does not waste half of the 16
levels on negatives. The zero point is kept in float, as the value of level 0 (the group's
minimum), as llama.cpp's Q4_1 and PyTorch's int4 kernels keep it:

    s = (max - min) / 15        m = min
    q = clamp(round((w - m) / s), 0, 15)                            w ~ q * s + m

Two int4 values share a byte: column 2j in the low nibble, column 2j+1 in the high one.

Rounding to the nearest level makes the error of each weight at most half a step, s / 2 (tested
with hypothesis in test_quant.py).

`QuantizedLinear.reference_forward` is the readable path: dequantize the whole matrix, then an
ordinary matmul. `forward` takes the fastest kernel measured on this kind of CPU for the format
(`choose_kernel`, `bench_kernels.py` and the lesson): tinyvllm's own `cpu_int8_vnni`
(cpu_vnni.c) for int8 where the CPU has AVX512-VNNI, `cpu_int8` and `cpu_int4` (cpu_int8.c) on
any other AVX2 CPU, and for int4 from many rows on (a prompt's prefill) `dequant_sgemm`, the
weight unpacked to float32 in C for PyTorch's float32 product; every kernel is tested against
the reference. The int8 weight is stored in
the layout of the kernel that reads it, as vLLM's `process_weights_after_loading` repacks a
checkpoint's weights for its kernels: rows (O, I), or cpu_vnni.c's panels.
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm import platform

from . import cpu_int8

INT4_GROUP_SIZES = (32, 64, 128)

# The LM head, whose float32 copy would take 113 MB, and which `cpu_int4` multiplies faster at every
# row count measured, never takes `dequant_sgemm`: nor does any layer of more weights than this.
DEQUANT_MAX_WEIGHTS = 1 << 22


# ---------------------------------------------------------------------------------------------
# int8: per output channel, symmetric
# ---------------------------------------------------------------------------------------------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (O, I) float -> q (O, I) int8, scale (O,) float32, with w ~ q * scale[:, None]."""
    # >>> exercise quantize_int8 (1 star): Symmetric int8 per output row: one scale per row, the row's largest magnitude over 127.
    # hint: scale = max|w_row| / 127 (never 0); q = round(w / scale) clamped to [-127, 127], as int8.
    # checked by: test_int8_round_trip_within_half_a_step, test_each_cpu_kernel_matches_the_reference
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127                   # (O,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (O, I)
    return q, scale
    # <<< exercise quantize_int8


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q (O, I) int8, scale (O,) -> w (O, I)."""
    return (q.float() * scale[:, None]).to(dtype)


# ---------------------------------------------------------------------------------------------
# int4: per group of input columns, asymmetric, two values per byte
# ---------------------------------------------------------------------------------------------

def check_group_size(in_features: int, group_size: int, name: str = "") -> None:
    """Raise ValueError unless `group_size` is offered and divides the layer's input size."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {list(INT4_GROUP_SIZES)}, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"quantization_group_size={group_size} does not divide the input size {in_features} of "
                         f"layer {name or '?'}; choose one of {list(INT4_GROUP_SIZES)} that divides it")


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (O, I) float -> q (O, I) uint8 in [0, 15] (not yet packed), scale (O, I/g) float32,
    zero (O, I/g) float32 (the value of level 0: the group's minimum), with w ~ q * scale + zero,
    group by group."""
    # >>> exercise quantize_int4 (2 stars): Asymmetric int4 per group of `group_size` input columns: a scale and a zero point (the group's minimum) per group, levels 0..15.
    # hint: reshape to (O, G, g); lo, hi = min and max per group; scale = (hi - lo) / 15; q = round((w - lo) / scale) clamped to [0, 15].
    # checked by: test_int4_round_trip_within_half_a_step, test_int4_groups_beat_one_scale_per_row_with_an_outlier_column
    o, i = w.shape
    check_group_size(i, group_size)
    g = w.float().reshape(o, i // group_size, group_size)                  # (O, G, g)
    lo, hi = g.amin(-1), g.amax(-1)                                          # (O, G)
    scale = ((hi - lo) / 15).clamp(min=1e-8)                                 # (O, G)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)     # (O, G, g)
    return q.reshape(o, i).to(torch.uint8), scale, lo
    # <<< exercise quantize_int4


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q (O, I) uint8 values in [0, 15] -> (O, I/2) uint8: column 2j low nibble, 2j+1 high."""
    # >>> exercise pack_int4 (1 star): Two 4-bit values a byte: column 2j in the low nibble, column 2j + 1 in the high one.
    # hint: q[:, 0::2] | (q[:, 1::2] << 4).
    # checked by: test_int4_packed_layout, test_int4_round_trip_within_half_a_step
    return q[:, 0::2] | (q[:, 1::2] << 4)
    # <<< exercise pack_int4


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(O, I/2) uint8 -> (O, I) uint8 in [0, 15]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(1)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype=torch.float32) -> torch.Tensor:
    """packed (O, I/2), scale and zero (O, G) -> w (O, I)."""
    q = unpack_int4(packed)
    o, i = q.shape
    g = q.reshape(o, scale.shape[1], -1).float()                            # (O, G, g)
    return (g * scale[..., None] + zero[..., None]).reshape(o, i).to(dtype)


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------

def vnni_fits(in_features: int) -> bool:
    """cpu_int8_vnni runs here (AVX512-VNNI and a compiler) and its int32 sums stay exact."""
    return in_features <= cpu_int8.VNNI_MAX_IN_FEATURES and cpu_int8.vnni_available()


def fbgemm_available() -> bool:
    """fbgemm's dynamic int8 linear: PyTorch's x86 CPU builds have it."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored in int8 or int4 (no float copy).

    Args:
        weight: the float weight (O, I); it is quantized here and not kept.
        bias: optional (O,) float bias, kept in float.
        method: "int8" or "int4".
        group_size: int4's group of input columns (32, 64 or 128).
        kernel: which matrix product `forward` runs on a CPU: "auto" (default on a CPU: the one
            measured fastest on this kind of CPU, `choose_kernel`), "reference"
            (dequantize-then-matmul), or one of `KERNELS[method]`.

    `qweight` holds the int8 weight in its kernel's layout (`layout`): "rows", (O, I) as
    `quantize_int8` returns it, or "vnni", the byte panels of `cpu_int8.vnni_pack`;
    `int8_rows()` gives it as (O, I) either way. int4's is two values a byte, (O, I/2).
    """

    KERNELS = {"int8": ("reference", "cpu_int8", "cpu_int8_vnni", "fbgemm_w8a8", "int8pack_mm"),
               "int4": ("reference", "cpu_int4", "int4pack_mm", "dequant_sgemm")}
    bf16_rows = 0   # dequant_sgemm in bfloat16 from here (phase 4's use_bfloat16_products)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, method: str,
                 group_size: int = 128, kernel: str | None = None):
        super().__init__()
        if method not in self.KERNELS:
            raise ValueError(f"quantization must be one of {list(self.KERNELS)}, got {method!r}")
        kernel = kernel or ("auto" if weight.device.type == "cpu" else "reference")
        if kernel not in ("auto", *self.KERNELS[method]):
            raise ValueError(f"kernel for {method} must be 'auto' or one of {self.KERNELS[method]}, got {kernel!r}")
        if kernel in ("cpu_int8", "cpu_int4", "dequant_sgemm") and not cpu_int8.available():
            raise ValueError(f"kernel={kernel!r} needs an AVX2 CPU and a C compiler (cpu_int8.py); use 'auto'")
        if kernel == "cpu_int8_vnni" and not vnni_fits(weight.shape[1]):
            raise ValueError(f"kernel={kernel!r} needs a CPU with AVX512-VNNI, a C compiler and at most "
                             f"{cpu_int8.VNNI_MAX_IN_FEATURES} input features (cpu_int8.py); use 'auto'")
        self.method, self.group_size, self.kernel = method, group_size, kernel
        (self.out_features, self.in_features), self.dtype = weight.shape, weight.dtype
        rules = platform.current()   # where the kind's measurements moved the kernels' boundaries
        self.dequant_rows, self.f16_scales = rules.rule("int4_dequant_from_rows"), rules.rule("int4_f16_scales")
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        w = weight.detach()
        if method == "int8":
            self._store(*quantize_int8(w))
        else:
            q, scale, zero = quantize_int4(w, group_size)
            self._store(pack_int4(q), scale, zero)
        self._packed: dict = {}  # other kernels' own layouts of the weight, made at their first call

    @classmethod
    def from_quantized(cls, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                       bias: torch.Tensor | None, method: str, group_size: int = 128,
                       kernel: str | None = None, dtype: torch.dtype = torch.float32) -> "QuantizedLinear":
        """A layer from weights already quantized: int8 rows (O, I) and scale (O,), or int4 packed
        (O, I/2), scale and zero (O, G), as a checkpoint stored quantized gives them. Each output
        row keeps its own scales, so the rows of several layers stacked make a layer whose output
        is theirs side by side, exactly."""
        in_features = qweight.shape[1] * (2 if method == "int4" else 1)
        layer = cls(torch.zeros(1, in_features, dtype=dtype, device=qweight.device), None, method,
                    group_size, kernel)
        layer.out_features = qweight.shape[0]
        layer._store(qweight, scale, zero)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    def _store(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None) -> None:
        """Keep the quantized weight in the layout its kernel reads: refused, by shape and dtype,
        where it is not the layout the C kernels index (int8 (O, I) with float32 scales (O,);
        int4 uint8 (O, I/2) with float32 scales and zero points (O, I/group_size))."""
        o, i, g = self.out_features, self.in_features, self.group_size
        q, scale = q.contiguous(), scale.contiguous()
        want = ((o, i), torch.int8, (o,)) if self.method == "int8" else ((o, i // 2), torch.uint8, (o, i // g))
        have = (tuple(q.shape), q.dtype, tuple(scale.shape))
        if have != want or scale.dtype != torch.float32 or (zero is not None and (
                zero.shape != scale.shape or zero.dtype != torch.float32)):
            raise ValueError(f"QuantizedLinear: an {self.method} weight of {o} x {i} is stored as {want[1]} "
                             f"{want[0]} with float32 scales {want[2]}, got {q.dtype} {have[0]} and scales "
                             f"{scale.dtype} {have[2]}" + ("" if zero is None else f", zero points {zero.dtype} "
                                                           f"{tuple(zero.shape)}"))
        vnni = (self.method == "int8" and q.device.type == "cpu" and self.kernel in ("auto", "cpu_int8_vnni")
                and vnni_fits(self.in_features))
        self.layout = "vnni" if vnni else "rows"
        self.register_buffer("qweight", cpu_int8.vnni_pack(q) if vnni else q)   # int8 (O, I) or panels
        self.register_buffer("scale", scale)                                     # (O,) or int4's (O, G)
        if zero is not None:
            self.register_buffer("zero", zero.contiguous())                      # int4's (O, G) float32

    def int8_rows(self) -> torch.Tensor:
        """The int8 weight as (O, I), whatever layout it is stored in."""
        if self.layout == "rows":
            return self.qweight
        p, k4 = self.qweight.shape[:2]                                           # (P, I/4, 64, 4)
        rows = self.qweight.permute(0, 2, 1, 3).reshape(p * 64, k4 * 4)[: self.out_features, : self.in_features]
        return (rows.to(torch.int16) - 128).to(torch.int8)

    def choose_kernel(self, num_rows: int) -> str:
        """The fastest kernel measured for this format on this kind of CPU (bench_kernels.py, the
        lesson), at every row count:

        - int8 with AVX512-VNNI: `cpu_int8_vnni` (the layer is stored for it; measured on an Intel
          Xeon, faster than float32, cpu_int8 and fbgemm at 1 to 64 rows in every layer);
        - int8 on any other AVX2 CPU: `cpu_int8` (measured on an AMD EPYC, faster than fbgemm's
          from 1 to 256 rows in every layer but the LM head at one row);
        - int4 on any AVX2 CPU, AVX-512 ones included: `cpu_int4` (faster than PyTorch's int4
          kernel and the reference at every row count, on every CPU measured);
        - int4 from `dequant_from_rows()` rows on (on an AVX2 EPYC, 64): `dequant_sgemm`, the
          weight unpacked to float32 in C for PyTorch's float32 product. With that many rows the
          integer loop is bound by its multiply-adds, and the float32 product does more per cycle;
        - where none of them can be built: int8, fbgemm's int8 (W8A8, x in a coarse and a fine
          int8 part); int4, PyTorch's int4 kernel at one row (it packs outputs in sixteens: a
          layer of another width takes the reference), dequantize-then-matmul from two on.
        """
        if self.kernel != "auto":
            return self.kernel
        if self.layout == "vnni":
            return "cpu_int8_vnni"
        if cpu_int8.available():
            if num_rows >= (self.dequant_from_rows() or num_rows + 1):
                return "dequant_sgemm"
            return "cpu_int8" if self.method == "int8" else "cpu_int4"
        if self.method == "int8":
            return "fbgemm_w8a8" if fbgemm_available() else ("int8pack_mm" if num_rows == 1 else "reference")
        return "int4pack_mm" if num_rows == 1 and self.out_features % 16 == 0 else "reference"

    def dequant_from_rows(self) -> int | None:
        """From how many rows "auto" takes `dequant_sgemm` on this CPU (None: never); with
        dtype="auto"'s bfloat16 products (`bf16_rows`), in bfloat16 from `bf16_rows` or 32 rows,
        whichever is more (on an AVX-512 Zen 4 EPYC it beat `cpu_int4` from 32 rows in every
        layer but k/v, and lost at 16: quant-kernels-int4-zen4-avx512.txt; on the amx kind the
        same, k/v too: quant-kernels-int4-xeon-amx.txt)."""
        small = self.method == "int4" and self.out_features * self.in_features <= DEQUANT_MAX_WEIGHTS
        many = max(self.bf16_rows, 32) if self.bf16_rows else self.dequant_rows
        return many if small and self.kernel == "auto" else None

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.method == "int4" else f", layout={self.layout}"
        return f"in={self.in_features}, out={self.out_features}, {self.method}{g}, kernel={self.kernel}"

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight back in float, (O, I)."""
        dtype = dtype or self.dtype
        if self.method == "int8":
            return dequantize_int8(self.int8_rows(), self.scale, dtype)
        return dequantize_int4(self.qweight, self.scale, self.zero, dtype)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The readable path: dequantize the whole weight, then an ordinary matmul."""
        return F.linear(x, self.dequantize(x.dtype), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, I) -> (N, O)."""
        if x.is_cuda and x.dim() == 2:
            from .triton_quant import wq_matmul  # Triton: dequantized inside the matmul loop
            return wq_matmul(x, self)
        if not x.is_cpu or x.dim() != 2:
            return self.reference_forward(x)
        kernel = self.choose_kernel(x.shape[0])
        if kernel == "reference":
            return self.reference_forward(x)
        # the C kernels compute in float32; a bfloat16 x gets bfloat16 back (a dtype test, not
        # .to(): a microsecond less at each of a step's 211 calls)
        return y if (y := KERNEL_FNS[kernel](self, x)).dtype == x.dtype else y.to(x.dtype)

    def kernel_call(self):
        """This layer's product as one callable, x (N, I) on a CPU -> (N, O), with its kernel
        chosen once: tinyvllm's C kernels serve any number of rows, so a caller that runs the
        layer at every step (phase 7's compiled graph) skips `forward`'s checks and choice (but
        the switch to `dequant_sgemm` at `dequant_from_rows()`); the other kernels, chosen by the
        number of rows, keep `forward`."""
        kernel, many = self.choose_kernel(1), self.dequant_from_rows()
        if not kernel.startswith("cpu_") or self.dtype != torch.float32:
            return self.forward
        return partial(KERNEL_FNS[kernel], self) if many is None else lambda x: KERNEL_FNS[
            kernel if x.shape[0] < many else "dequant_sgemm"](self, x)

    def packed(self, kernel: str):
        """The weight in `kernel`'s layout (a second, integer copy of it), or for cpu_int4 its product
        as a function of x; made once."""
        if kernel not in self._packed:
            self._packed[kernel] = PACKERS[kernel](self)
        return self._packed[kernel]

    def weight_bytes(self) -> int:
        """Bytes of the stored weight (quantized values, scales, zero points, bias)."""
        return sum(t.numel() * t.element_size() for t in (*self.buffers(), *self.parameters()))


# -- kernels: each takes (layer, x (N, I)) -> (N, O), float32 (int8pack_mm, int4pack_mm: x's dtype) --

def _pack_fbgemm(layer: QuantizedLinear):
    # torch 2.13 warns that quantized tensors (qint8) are deprecated (pytorch/pytorch#184982);
    # fbgemm's prepack still takes one, once per layer at load. Silenced here, said in the lesson.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        qw = torch._make_per_channel_quantized_tensor(
            layer.int8_rows(), layer.scale.double(), torch.zeros_like(layer.scale, dtype=torch.long), 0)
    # no bias inside: each call's output is rescaled per row first, then the bias is added once
    return torch.ops.quantized.linear_prepack(qw, None)


def _fbgemm_w8a8(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """fbgemm's int8 x int8 -> int32 product, with x itself in int8: W8A8.

    fbgemm multiplies uint8 activations by the int8 weight, so x must be rounded to 8 bits at
    every call, with one scale for the whole call. We keep 7 of them (levels -63..63 around
    zero point 64): on AVX2, without VNNI, fbgemm sums pairs of u8 x s8 products in 16 bits,
    which saturate above 7-bit activations (with 8 bits we measured errors up to 12% of a layer's
    output). One 7-bit scale is not enough for an LLM's hidden states, whose few huge channels
    (the outliers of LLM.int8()) set the scale and round every other channel to a handful of
    levels. So each row (token) is first divided by its own largest value (a token's scale,
    as vLLM's per-token W8A8 does), then goes in as two parts: a *coarse* one, rounded to
    levels of 1/63, and a *fine* one, what that rounding lost (at most 1/126), which times 126
    has the coarse part's range and so takes the same scale. Both go through fbgemm in one call
    of 2N rows, and y = (y_coarse + y_fine / 126) * the row's scale: the weight is read once,
    and each token keeps about 13 bits."""
    x = x if x.dtype == torch.float32 else x.float()
    row_max = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_(min=1e-12)  # (N, 1)
    x = x / row_max                                                              # each row in [-1, 1]
    coarse = torch.fake_quantize_per_tensor_affine(x, 1 / 63, 64, 0, 127)      # levels of 1/63
    both = torch.cat((x, (x - coarse).mul_(126)))                              # (2N, I)
    y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        both, 1 / 63, 64, layer.packed("fbgemm_w8a8"))                          # (2N, O)
    n = len(x)
    y = y[:n].add_(y[n:], alpha=1 / 126).mul_(row_max)                          # (N, O)
    return y if layer.bias is None else y.add_(layer.bias)


def _cpu_int8(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    rows = layer.qweight if layer.layout == "rows" else layer.packed("cpu_int8")
    y = cpu_int8.int8_matmul(x.float(), rows, layer.scale)
    return y if layer.bias is None else y.add_(layer.bias)


def _cpu_int8_vnni(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    wp = layer.qweight if layer.layout == "vnni" else layer.packed("cpu_int8_vnni")
    y = cpu_int8.vnni_int8_matmul(x.float(), wp, layer.scale, layer.out_features)
    return y if layer.bias is None else y.add_(layer.bias)


def _cpu_int4(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    y = layer.packed("cpu_int4")(x.float())
    return y if layer.bias is None else y.add_(layer.bias)


def _dequant_sgemm(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    # bfloat16 where dtype="auto" chose bfloat16 products (the platform's bf16_products_from_rows)
    dtype = torch.bfloat16 if layer.bf16_rows else torch.float32
    w = cpu_int8.int4_dequant(layer.qweight, layer.scale, layer.zero, layer.group_size, dtype)
    return F.linear(x.to(dtype), w, None if layer.bias is None else layer.bias.to(dtype)).float()


def _int8pack_mm(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:  # a layer stored as rows
    y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), layer.int8_rows(), layer.scale.to(x.dtype))
    return y if layer.bias is None else y + layer.bias


def _pack_int4(layer: QuantizedLinear):
    q = unpack_int4(layer.qweight).to(torch.int32)                            # (O, I)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # PyTorch's int4 kernel computes (q - 8) * scale + zero_f: ours is q * scale + zero, so
    # zero_f = zero + 8 * scale. Layout (G, O, 2).
    zf = layer.zero + 8 * layer.scale
    return packed, torch.stack((layer.scale, zf), dim=-1).transpose(0, 1).contiguous()


def _int4pack_mm(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    packed, sz = layer.packed("int4pack_mm")
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, layer.group_size, sz.to(x.dtype))
    return y if layer.bias is None else y + layer.bias


KERNEL_FNS = {"cpu_int8": _cpu_int8, "cpu_int8_vnni": _cpu_int8_vnni, "fbgemm_w8a8": _fbgemm_w8a8,
              "int8pack_mm": _int8pack_mm,
              "cpu_int4": _cpu_int4, "int4pack_mm": _int4pack_mm, "dequant_sgemm": _dequant_sgemm}
PACKERS = {"fbgemm_w8a8": _pack_fbgemm, "int4pack_mm": _pack_int4,  # cpu_int4: the weight's caller
           "cpu_int4": lambda layer: cpu_int8.int4_matmul(layer.qweight, *layer.packed("scales"), layer.group_size),
           "scales": lambda m: tuple(t.half() if m.f16_scales else t for t in (m.scale, m.zero)),
           "cpu_int8_vnni": lambda layer: cpu_int8.vnni_pack(layer.int8_rows()),
           "cpu_int8": QuantizedLinear.int8_rows}  # the rows of a layer stored for cpu_int8_vnni
