"""tinyvllm's own int8 and int4 products for x86 CPUs, built on first use and called through
ctypes:

- `cpu_int8.c`, for any AVX2 CPU (AVX-512 ones included): `int8_matmul` (the kernel `cpu_int8`,
  x rounded to int16 per row: W8A16) and `int4_matmul` (`cpu_int4`, x rounded to int8 per block of
  32 columns: W4A8, as llama.cpp's Q4_1 x Q8_1);
- `cpu_vnni.c`, for CPUs with AVX512-VNNI: `vnni_int8_matmul` (`cpu_int8_vnni`, x rounded to
  int8 per row: W8A8, four times the multiply-adds of an AVX2 instruction), on a weight packed
  once by `vnni_pack`.

PyTorch 2.13 has no fast int8- or int4-weight product for small row counts on these CPUs (the
lesson's table): fbgemm's needs x in 7-bit parts on AVX2, `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu` convert each weight to float.

Each file is compiled once per machine (`tinyvllm.ckernel.CKernel`). Where there is no
compiler, the CPU lacks the instructions, or the build fails, the library is None (warned once)
and `QuantizedLinear.choose_kernel` picks another kernel.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from tinyvllm.ckernel import CKernel
from tinyvllm.hardware import AVX2_FLAGS, AVX512_VNNI_FLAGS

HERE, P, I64 = Path(__file__).parent, ctypes.c_void_p, ctypes.c_int64


AVX2 = CKernel(HERE / "cpu_int8.c", ["-O3", "-mavx2", "-mfma", "-mf16c", "-fno-math-errno", "-fopenmp", "-shared",
               "-fPIC"], AVX2_FLAGS | {"f16c"}, {"int8_matmul": [P] * 6 + [I64] * 3,
               **dict.fromkeys(("int4_dequant", "int4_dequant_bf16"), [P] * 4 + [I64] * 3),
               **dict.fromkeys(("int4_matmul", "int4_matmul_f16"), [P] * 8 + [I64] * 4)}, fallback="PyTorch's products run")
INT4_FNS = {torch.float32: "int4_matmul", torch.float16: "int4_matmul_f16"}   # by the scales' dtype
VNNI = CKernel(HERE / "cpu_vnni.c", ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                                     "-fopenmp", "-shared", "-fPIC"], AVX512_VNNI_FLAGS,
               {"vnni_pack": [P, P, I64, I64], "vnni_int8_matmul": [P] * 7 + [I64] * 3},
               fallback="another int8 kernel is used")


available = AVX2.available        # cpu_int8, cpu_int4 and dequant_sgemm can run here (AVX2 and a C compiler)
vnni_available = VNNI.available   # cpu_int8_vnni can run here (AVX512-VNNI and a C compiler)


class _Scratch(threading.local):
    """Space for x in integers, grown as needed and reused between calls (one per thread: a
    thread runs one product at a time, and phase 7's background compile runs products beside
    the serving loop's)."""

    def __init__(self):
        self.t: dict[str, torch.Tensor] = {}

    def get(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        t = self.t.get(name)
        if t is None or t.numel() < n:
            t = self.t[name] = torch.empty(max(n, 0 if t is None else t.numel()), dtype=dtype)
        return t


_scratch = _Scratch()


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, I) float32, qweight (O, I) int8, scale (O,) float32 -> (M, O) float32."""
    x, (m, i), y = x.contiguous(), x.shape, torch.empty(x.shape[0], qweight.shape[0])
    (AVX2.lib or AVX2.load()).int8_matmul(x.data_ptr(), qweight.data_ptr(), scale.data_ptr(), y.data_ptr(),
                                          _scratch.get("xq16", m * i, torch.int16).data_ptr(),
                                          _scratch.get("xs", m, torch.float32).data_ptr(), m, qweight.shape[0], i)
    return y


def int4_matmul(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g: int):
    """The product with one int4 weight, packed (O, I/2) uint8 (two values a byte), scale and
    zero (O, I/g) float32 or float16 (`INT4_FNS`), as a function of x (M, I) float32 -> (M, O)
    float32. Its pointers and sizes are looked up once: a decode step calls each layer's product
    once, 121 times for the default model, and this keeps each call's Python to about 10 us (from
    about 25). (No ctypes object in the closure: phase 7 saves the graphs that call it, and
    pickles what they hold. The library is loaded: `available()` came first.)"""
    (o, i), tensors = (packed.shape[0], 2 * packed.shape[1]), (packed, scale, zero)
    w, c, groups, fn = [t.data_ptr() for t in tensors], -(-i // 64), i // g, INT4_FNS[scale.dtype]

    def call(x: torch.Tensor, keep=tensors) -> torch.Tensor:  # keep: the weight outlives its pointers
        m, y, x = x.shape[0], torch.empty(x.shape[0], o), x.contiguous()
        # per row of x: its bytes, its blocks' scales, its groups' sums
        s = _scratch.get("int4", m * (64 * c + 4 * 2 * c + 4 * groups), torch.uint8).data_ptr()
        getattr(AVX2.lib, fn)(x.data_ptr(), *w, y.data_ptr(), s, s + m * 64 * c, s + m * 72 * c, m, o, i, g)
        return y
    return call


def int4_dequant(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g: int, dtype=torch.float32) -> torch.Tensor:
    """q (O, I/2) uint8 (two int4 values a byte), scale and zero (O, I/g) float32 -> the weight
    (O, I) in float32, or rounded to bfloat16 (`dtype`), in scratch space that the next call
    reuses."""
    o, i = q.shape[0], 2 * q.shape[1]
    w = _scratch.get(f"w{dtype}", o * i, dtype)[: o * i]
    fn = "int4_dequant_bf16" if dtype == torch.bfloat16 else "int4_dequant"
    getattr(AVX2.lib or AVX2.load(), fn)(q.data_ptr(), scale.data_ptr(), zero.data_ptr(), w.data_ptr(), o, i, g)
    return w.view(o, i)

# -- AVX512-VNNI ---------------------------------------------------------------------------------

VNNI_MAX_IN_FEATURES = 65536  # int32 sums stay exact up to here (cpu_vnni.c)


def vnni_pack(qweight: torch.Tensor) -> torch.Tensor:
    """qweight (O, I) int8 -> the byte panels cpu_vnni.c reads: (ceil(O/64), ceil(I/4), 64, 4)
    uint8 holding q + 128. The same bytes as qweight, reordered (plus padding)."""
    o, i = qweight.shape
    wp = torch.empty(-(-o // 64), -(-i // 4), 64, 4, dtype=torch.uint8)
    (VNNI.lib or VNNI.load()).vnni_pack(qweight.contiguous().data_ptr(), wp.data_ptr(), o, i)
    return wp


def vnni_int8_matmul(x: torch.Tensor, wp: torch.Tensor, scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """x (M, I) float32 (rounded to int8 in two parts a row), wp from `vnni_pack`, scale (O,)
    float32 -> (M, O) float32."""
    x, (m, i), y = x.contiguous(), x.shape, torch.empty(x.shape[0], out_features)
    (VNNI.lib or VNNI.load()).vnni_int8_matmul(x.data_ptr(), wp.data_ptr(), scale.data_ptr(), y.data_ptr(),
                                               _scratch.get("xq8", 2 * m * 4 * -(-i // 4), torch.int8).data_ptr(),
                                               _scratch.get("xsum8", 2 * m, torch.int32).data_ptr(),
                                               _scratch.get("xs", m, torch.float32).data_ptr(), m, out_features, i)
    return y
