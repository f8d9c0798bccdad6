"""AMX tiles (an Intel Xeon, the platform's "amx" kind): cpu_amx.c's products, SiLU and attention.

AMX gives a core eight tile registers of 16 rows x 64 bytes and one instruction, TDPBF16PS, that
multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one into 16 x 16 float32 sums. cpu_amx.c uses them
for three jobs (see its comment):

- `amx_matmul`: a float32 model's bfloat16 products at a decode step's rows, reading the weight
  once in the order it lies (`amx_packed`, its tiles), where oneDNN's product of so few rows reads
  it slower (`CpuLinear`, up to the platform's `amx_product_max_rows` rows);
- `silu_and_mul`: silu(gate) * up of a prompt's bfloat16 MLP in one pass, rounded once;
- `amx_attention`: a prompt chunk's causal attention, 16 queries by 64 keys a tile block, an online
  softmax in float32 (phase 4's CPU path, where a prompt's attention multiplies in bfloat16).

The library is built and loaded at the first call, with Linux's leave to use the tile state asked
for then; where either fails (another kind, no compiler, a kernel that refuses), `amx_lib()` is
None and each caller takes oneDNN's, PyTorch's or SDPA's way.
"""

from __future__ import annotations

import ctypes
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from tinyvllm.ckernel import CKernel
from tinyvllm.hardware import AMX_BF16_FLAGS

P, I64 = ctypes.c_void_p, ctypes.c_int64
AMX = CKernel(Path(__file__).with_name("cpu_amx.c"), ["-O3", "-mavx512f", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
              "-fopenmp", "-shared", "-fPIC"], AMX_BF16_FLAGS,
              {"amx_linear": [P] * 5 + [I64] * 3, "silu_and_mul": [P] * 2 + [I64] * 2,
               "amx_attention": [P] * 4 + [I64] * 4 + [ctypes.c_float],
               "amx_pack_kv": [P] * 2 + [I64] * 2 + [P] * 2 + [I64] * 2},
              fallback="bfloat16 products stay oneDNN's, a prompt's attention SDPA's")


def amx_lib():
    """cpu_amx.c, built and loaded at the first call, with Linux's leave to use the AMX tiles
    asked for then (None where either fails: its callers take PyTorch's or oneDNN's way)."""
    if not AMX.tried:
        lib = AMX.load()
        if lib is not None and lib.amx_permit() != 0:
            warnings.warn("tinyvllm: Linux refused the AMX tile state; bfloat16 products stay oneDNN's")
            AMX.lib = None
    return AMX.lib


def amx_fits(weight: torch.Tensor) -> bool:
    """`amx_matmul` takes this weight: float32 or bfloat16 (O, I) in a CPU's memory, O a multiple
    of 16 and I of 32 (whole tiles), the library here."""
    return (weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.is_cpu and amx_lib() is not None)


def kept(w: torch.Tensor, name: str, make) -> torch.Tensor:
    """make(), kept on the tensor `w` as `name` from its first call until `w` changes."""
    key = (w.data_ptr(), w.dtype, w._version if not w.is_inference() else None)
    cached = getattr(w, name, None)
    if cached is None or cached[0] != key:
        cached = (key, make())
        setattr(w, name, cached)
    return cached[1]


def amx_packed(w: torch.Tensor) -> torch.Tensor:
    """`w` (O, I) float32 (or bfloat16) as cpu_amx.c's bfloat16 tiles, kept on the tensor (`kept`):
    rounded by PyTorch, then each 16 outputs' tiles of 32 inputs, a tile 16 pairs of inputs by 16
    outputs."""
    o, i = w.shape
    return kept(w, "_amx_packed", lambda: w.detach().bfloat16().view(o // 16, 16, i // 32, 16, 2)
                .permute(0, 2, 3, 1, 4).contiguous())


def amx_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, I) @ weight (O, I)^T + bias in cpu_amx.c: x (float32) rounded to bfloat16, the
    weight's AMX copy (of a float32 or a bfloat16 weight), the sums and the output float32 (where
    `amx_fits(weight)`)."""
    x, (o, i) = x.contiguous(), weight.shape
    bias = bias if bias is None or bias.dtype == torch.float32 else bias.float()
    y, xb = torch.empty(x.shape[0], o), torch.empty(64 * i, dtype=torch.int16)
    AMX.lib.amx_linear(x.data_ptr(), amx_packed(weight).data_ptr(), None if bias is None else bias.data_ptr(),
                       y.data_ptr(), xb.data_ptr(), x.shape[0], o, i)
    return y


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a bfloat16 (M, 2I) [gate, up], as bfloat16 (M, I): cpu_amx.c's one pass
    (float32 inside, rounded once) where that library is built, else PyTorch's two operators
    (rounded twice)."""
    lib, (m, two_i) = amx_lib(), gate_up.shape
    if lib is None or two_i % 32 or not gate_up.is_contiguous() or gate_up.dtype != torch.bfloat16:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    out = gate_up.new_empty(m, two_i // 2)
    lib.silu_and_mul(gate_up.data_ptr(), out.data_ptr(), m, two_i // 2)
    return out


def amx_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Causal attention of a prompt's queries q (T, H, 64), the last T of the keys k, v (TK, KVH,
    64), TK >= T (more: a chunk after cached keys) -> (T, H, 64) float32 (written into `out` where
    given: contiguous float32), on cpu_amx.c's AMX tiles: q, k and v rounded to bfloat16, their
    products summed in float32, the softmax in float32, its weights rounded to bfloat16 for the
    second product. None where it does not run (heads of another size, the library not here)."""
    (t, heads, d), (tk, kv_heads) = q.shape, k.shape[:2]
    if d != 64 or heads % kv_heads or tk < t or not q.is_cpu or amx_lib() is None:
        return None
    q, (k, v) = q.float().contiguous(), (x if x.dtype == torch.float32 and x.stride()[1:] == (64, 1)
                                           else x.float().contiguous() for x in (k, v))
    kp, vp = (torch.empty(kv_heads * -(-tk // 64) * 64 * 32, dtype=torch.int32) for _ in range(2))
    AMX.lib.amx_pack_kv(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), kp.data_ptr(), vp.data_ptr(), tk, kv_heads)
    if out is None or out.shape != (t, heads, 64) or out.dtype != torch.float32 or not out.is_contiguous():
        out = q.new_empty(t, heads, 64)
    AMX.lib.amx_attention(q.data_ptr(), kp.data_ptr(), vp.data_ptr(), out.data_ptr(), t, tk, heads, kv_heads,
                          d ** -0.5)
    return out
