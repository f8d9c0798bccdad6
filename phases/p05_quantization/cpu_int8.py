"""tinyvllm's own int8 and int4 products for AVX2 CPUs (`cpu_int8.c`), built on first use and
called through ctypes: `int8_matmul` (the kernel `cpu_int8`) and `int4_matmul` (`cpu_int4`).

PyTorch 2.13 has no fast int8- or int4-weight product for small row counts on an AVX2 CPU
without VNNI (the lesson's table): fbgemm's needs x in 7-bit parts, `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu` convert each weight to float. `cpu_int8.c` is ~160 lines of C that
keep the weight in int8 (or int4), round each row of x to int16 with its own scale, and
multiply-add in integers (see its comments).

It is compiled once per machine with the system's C compiler (`CC`, default `cc`) into
`$TINYVLLM_CACHE/kernels/` (default ~/.cache/tinyvllm), the file named after a hash of the
source and the flags. Where there is no compiler, no AVX2, or the build fails, `available()` is
False and the engine keeps fbgemm's kernel (`QuantizedLinear.choose_kernel`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_int8.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None = None
_tried = False


def avx2() -> bool:
    """PyTorch's reading of this CPU: AVX2 or better (an AVX-512 CPU runs AVX2 code too)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def measured_here() -> bool:
    """An AVX2 CPU without AVX-512: where cpu_int8 was measured faster than fbgemm (the lesson)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def build(cache: Path | None = None) -> Path:
    """Compile cpu_int8.c (once: the file is reused while the source and flags are the same)."""
    from tinyvllm.download import cache_dir

    src = SOURCE.read_bytes()
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(src + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    out = (cache or cache_dir() / "kernels") / f"cpu_int8-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)  # several processes may build
        os.close(fd)
        try:
            subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True,
                           capture_output=True, text=True)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def load():
    """The compiled library, or None where it cannot be built here (warned once)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        if avx2():
            try:
                _lib = ctypes.CDLL(str(build()))
                _lib.int8_matmul.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3
                _lib.int8_matmul.restype = None
                _lib.int4_matmul.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 4
                _lib.int4_matmul.restype = None
            except (OSError, subprocess.CalledProcessError) as e:
                detail = getattr(e, "stderr", "") or e
                warnings.warn(f"tinyvllm: could not build cpu_int8.c ({detail}); int8 uses fbgemm's kernel")
    return _lib


def available() -> bool:
    return load() is not None


_xq = torch.empty(0, dtype=torch.int16)  # scratch space for x in int16, reused between calls
_xs = torch.empty(0)
_xsum = torch.empty(0, dtype=torch.int32)


def _scratch(m: int, i: int) -> None:
    global _xq, _xs
    if _xq.numel() < m * i or _xs.numel() < m:
        _xq, _xs = torch.empty(max(m * i, _xq.numel()), dtype=torch.int16), torch.empty(max(m, _xs.numel()))


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, I) float32, qweight (O, I) int8, scale (O,) float32 -> (M, O) float32."""
    lib = _lib if _lib is not None else load()
    x = x.contiguous()
    m, i = x.shape
    _scratch(m, i)
    y = torch.empty(m, qweight.shape[0])
    lib.int8_matmul(x.data_ptr(), qweight.data_ptr(), scale.data_ptr(), y.data_ptr(), _xq.data_ptr(),
                    _xs.data_ptr(), m, qweight.shape[0], i)
    return y


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """x (M, I) float32, packed (O, I/2) uint8 (two int4 values a byte), scale and zero (O, I/g)
    float32 -> (M, O) float32."""
    global _xsum
    lib = _lib if _lib is not None else load()
    x = x.contiguous()
    m, i = x.shape
    _scratch(m, i)
    if _xsum.numel() < m * (i // group_size):
        _xsum = torch.empty(m * (i // group_size), dtype=torch.int32)
    y = torch.empty(m, packed.shape[0])
    lib.int4_matmul(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), zero.data_ptr(), y.data_ptr(),
                    _xq.data_ptr(), _xsum.data_ptr(), _xs.data_ptr(), m, packed.shape[0], i, group_size)
    return y
