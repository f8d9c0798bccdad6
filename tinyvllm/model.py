"""A Llama-family decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The same code runs every family `tinyvllm.registry` lists (Llama, Mistral, Qwen2, Qwen3): what
differs between them is a few switches of `ModelConfig` (biases on the projections, an RMSNorm
over each head's q and k).

The model works on a *flat* batch of tokens, the way vLLM does: `input_ids` and `positions` are
1-D tensors of N tokens that may belong to several sequences. The model never needs to know how
the tokens are grouped: that knowledge lives in the *attention backend* passed to `forward`.
Every phase of tinyvllm plugs in its own backend (naive attention, paged attention, Triton
kernels, ...) and leaves the rest of the model untouched.

    backend(layer_idx, q, k, v) -> out      # q: (N, H, d)  k, v: (N, KVH, d)  out: (N, H, d)

Parameter names match Hugging Face's `LlamaForCausalLM` (and Qwen3's `q_norm`/`k_norm`), so a
checkpoint loads by name.
"""

from __future__ import annotations

import ctypes
import math
import platform
import warnings
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.ckernel import CKernel
from tinyvllm.config import ModelConfig
from tinyvllm.hardware import AMX_BF16_FLAGS, AVX2_FLAGS, cpu_kind, cpu_vendor


class AttentionBackend(Protocol):
    """What a phase plugs into the model: attention over whatever tokens the step holds."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------------------------

def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, with Llama 3.x ("llama3") or linear scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    # llama3: low frequencies (long wavelengths) are slowed by `factor`, high ones kept, and the
    # band between is blended smoothly. Same formula as Meta's reference and transformers.
    low_ff = float(scaling.get("low_freq_factor", 1.0))
    high_ff = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_len / low_ff
    high_freq_wavelen = old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_positions`, looked up per token."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config, self.max_positions = config, max_positions
        # on the CPU even while the model is built on the meta device (weights.load_model): there
        # this arithmetic would first import much of PyTorch's compiler (~2 s, once per process)
        with torch.device("cpu"):
            cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = rope_inv_freq(self.config)
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                       # (P, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)                # (P, d): Hugging Face's half layout
        return emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) rows of the step's positions, each (N, 1, d): looked up once per step,
        shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate each (even, odd) half-pair of q (N, H, d) and k (N, KVH, d) by its position's angle.
    On a kind `ROPE_KINDS` names, float32 rows without autograd: one call of cpu_norm.c's `rope`
    for each, the same numbers."""
    fast = rope(q, cos, sin), rope(k, cos, sin)
    if fast[0] is not None and fast[1] is not None:
        return fast
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x (N, heads, d), each head's d floats in a row (a view of the qkv product will do), rotated
    by cos, sin (N, 1, d) in cpu_norm.c; None where it does not run (the caller's operators do)."""
    n, heads, d = x.shape
    if (not ROPE_HERE or x.dtype != torch.float32 or not x.is_cpu or torch.is_grad_enabled() or d % 16
            or x.stride(2) != 1 or x.stride(1) != d or torch.compiler.is_compiling()
            or cos.shape != (n, 1, d) or cos.dtype != torch.float32 or not cos.is_contiguous()
            or sin.shape != cos.shape or sin.dtype != torch.float32 or not sin.is_contiguous()
            or (NORM.lib if NORM.tried else NORM.load()) is None):
        return None
    out = x.new_empty(n, heads, d)
    NORM.lib.rope(x.data_ptr(), x.stride(0), heads, cos.data_ptr(), sin.data_ptr(), out.data_ptr(), n, d)
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------

def onednn_available() -> bool:
    """True where PyTorch can run oneDNN's packed matrix products: an x86 CPU build with oneDNN."""
    return (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


# tinyvllm's own float32 product of a few rows (cpu_gemv.c, see its comment), up to this many rows
# per CPU kind. On an AVX2 AMD EPYC the default model's 211 products took 32.8 ms against 52.9 for
# the product Linear took before at 1 row ((W x^T)^T), 48.7 against 59.6 at 4 and 72.6 against
# 75.0 at 8 (oneDNN), 96.0 against oneDNN's 90.4 at 12 (`python -m tinyvllm.entrypoints.bench.linear`,
# docs/assets/bench/linear-cpu-amd-avx2.txt). On an AVX-512 Zen 4 EPYC (avx512_vnni) it ties
# MKL's at one row and loses from two (22.1 against 21.4, 35.1 against 29.3 at 8:
# linear-codes-zen4-avx512.txt), but one row is what cpu_step.c needs of a float32 model without
# codes: a batch-1 step there 36.9 tok/s without both, 34.7 with cpu_gemv.c alone, 42.0 with both
# (`python -m phases.p07_cuda_graphs.tools.kind_rules --model <random-like>`,
# kind-rules-zen4-avx512-float32.json). On the amx kind (an Intel Xeon, family 6 model 207: a GPU
# machine's host pinned to 2 cores, torch 2.11) MKL's F.linear at 1 row takes 24.4 ms against
# cpu_gemv.c's 28.7 (linear-codes-xeon-amx.txt), and a batch-1 step gains nothing from it (30.9 ->
# 31.8 tok/s, kind-rules-xeon-amx.json): not chosen there.
GEMV_MAX_ROWS = {"avx2": 8, "avx512_vnni": 1}
GEMV = CKernel(Path(__file__).with_name("cpu_gemv.c"), ["-O3", "-mavx2", "-mfma", "-fno-math-errno", "-fopenmp",
               "-shared", "-fPIC"], AVX2_FLAGS, {"f32_matmul": [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3},
               fallback="Linear keeps PyTorch's float32 products")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (N, I) @ weight (O, I)^T + bias, float32 on the CPU, through cpu_gemv.c."""
    x, y = x.contiguous(), torch.empty(x.shape[0], weight.shape[0])
    GEMV.lib.f32_matmul(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], weight.shape[0], x.shape[1])
    return y if bias is None else y.add_(bias)


# From how many rows a bfloat16 product on the CPU runs in float32, per CPU kind. Without
# bfloat16 arithmetic (AVX2: no AVX512-BF16, no AMX) PyTorch's bfloat16 product ran at about 20
# GFLOP/s on an AVX2 Zen 4 EPYC against float32's 80-110: a prompt of 1,000 tokens took 10.0 s to
# its first token against float32's 2.5; with each chunk of the weight made float32 first, 3.2.
# A decode step of the default model, bfloat16's products against float32's a chunk at a time,
# alternating rounds in one process (ms, median of 5 steps a round): 48 rows 562-797 against
# 337-544, 32 rows 453-558 against 366-438, 24 rows 343-452 against 196-395 (each round won); 16
# rows two rounds of four won; one row (reading half the bytes wins) 18 against 138 for the
# products alone. Not measured where bfloat16 is native (the avx512_vnni kind).
BF16_UPCAST_ROWS = {"avx2": 24}
# The CPU kinds where a bfloat16 product runs in oneDNN on the packed weight at every row count, as
# float32's many rows do. Where bfloat16 is native (AVX512-BF16), on an AVX-512 Zen 4 EPYC
# (avx512_vnni), the default model's 211 products took 16.5 ms against F.linear's 21.4 at 1 row,
# 21.4 against 31.3 at 16, 51.1 against 62.2 at 64 (`python -m tinyvllm.entrypoints.bench.linear
# --dtype bfloat16`, docs/assets/bench/linear-bf16-zen4-avx512.txt; float32's oneDNN at 64 rows:
# 96.4). Not measured on the amx kind.
BF16_ONEDNN_KINDS = ("avx512_vnni",)
# From how many rows a float32 model's products run in bfloat16 when dtype="auto", per CPU kind
# (`use_bfloat16_products`): the rows rounded to bfloat16, oneDNN's product on a bfloat16 copy of
# the packed weight, its output made float32 again (what PyTorch's autocast does for a matrix
# product; up to `AMX_PRODUCT_ROWS` rows cpu_amx.c's, its output not rounded). The activations,
# norms, decode attention and the few-row products (phase 5's codes, up to `LOSSLESS_MAX_ROWS` or
# one row fewer than these: `Linear.own_rows`) stay float32; a prompt's
# attention multiplies in bfloat16 too where phase 4's `PREFILL_BF16_KINDS` names the kind. On an
# AVX-512 Zen 4 EPYC (avx512_vnni), in one process, 48 requests offline 1.43x, a 2,000-token
# prompt's first token 1.45x; perplexity over the shipped text 13.540 against 13.539 (lab note 7,
# accuracy-bf16-products-zen4-avx512.json), 13.546 with the prompt's attention in bfloat16 too
# (lab note 4, accuracy-bf16-prefill-attention-zen4-avx512.json). From 7 rows there, not 13:
# the compiled step of 7, 8, 10 and 12 requests 18.9 -> 17.5, 20.9 -> 19.0, 26.9 -> 20.5 and
# 31.8 -> 23.2 ms against the codes (at 6, 16.4 against 15.8: even; both ways alternating in one
# process, lab note 7); 48 requests offline, eager, the same (429.5 against 432.3 tok/s,
# bf16-rows-zen4-avx512.json). On the amx kind (the Xeon above), where AMX multiplies bfloat16
# tiles: the products 37.1 ms against the codes' 49.3 at 12 rows, 46.8 against float32's 97.2 at
# 64 (linear-codes-xeon-amx.txt); 48 requests offline 1.68x, a 2,000-token prompt's first token
# 1.43x (`python -m phases.p07_cuda_graphs.tools.bf16_rows --rows 9`, bf16-rows-xeon-amx.json).
# From 6 rows there, not 9, since cpu_amx.c (`AMX_PRODUCT_ROWS`) takes those rows: a 2-core Xeon
# VM's compiled step of 6 and 8 requests 31.8 -> 24.6 and 36.5 -> 26.8 ms against the codes'
# cpu_step.c, a second pair of runs 27.7 -> 27.6 and 32.9 -> 27.8; at 4, 23.5 against 24.4
# (`compile_time`, lab note 7). Nothing to gain without bfloat16 arithmetic (avx2).
BF16_PRODUCT_ROWS = {"avx512_vnni": 7, "amx": 6}


def use_bfloat16_products(model: nn.Module, rows: int) -> None:
    """From `rows` rows on (0: never), every layer of `model` with a `bf16_rows` (a float32
    `Linear`; phase 5's int4 layers, for their prompts) multiplies in bfloat16
    (`BF16_PRODUCT_ROWS`). A phase that makes layers of its own (phase 5's, phase 7's fused
    projections) calls it again."""
    for m in model.modules():
        if hasattr(m, "bf16_rows"):
            m.bf16_rows = rows


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


# -ffp-contract=off: `rope` rounds each product before the sum, as PyTorch's operators do
NORM = CKernel(Path(__file__).with_name("cpu_norm.c"), ["-O3", "-mavx2", "-mfma", "-ffp-contract=off",
              "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"], AVX2_FLAGS,
              {"add_rms_norm": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float],
               "rope": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2},
              fallback="the residual add and RMSNorm, and RoPE, stay PyTorch's operators")
# The CPU kinds where `apply_rotary` runs cpu_norm.c's `rope`: on a 2-core Xeon VM (amx), q and k
# of 2,000 rows 0.69 ms against 6.2 for PyTorch's operators (a /tmp script, best of 20), `LLM()`'s
# 2,000-token first token 0.849 -> 0.820 s (alternating rounds, medians of 8; lab note 7).
# Unmeasured on the other kinds, which keep PyTorch's operators.
ROPE_KINDS = ("amx",)
ROPE_HERE = cpu_kind() in ROPE_KINDS
# The CPU kinds where `fused_add_rms_norm` runs: measured on an AVX2 Zen 4 EPYC (lab note 7: the
# eager decode step 20.4 -> 18.5 ms median) and on an AVX-512 one (avx512_vnni), where it is
# within the VM's noise: batch 1 83.9 -> 81.0 tok/s, batch 8 257.8 -> 287.2 (`python -m
# phases.p07_cuda_graphs.tools.kind_rules`, docs/assets/bench/kind-rules-zen4-avx512.json), 32
# sequences 349.6 -> 354.9 (medians of 5 alternating rounds); on the amx kind (a GPU
# machine's Xeon host pinned to 2 cores) batch 1 55.0 -> 61.0, batch 8 179.5 -> 216.4
# (kind-rules-xeon-amx.json).
FUSED_NORM_KINDS = ("avx2", "avx512_vnni", "amx")
FUSED_NORM_HERE = cpu_kind() in FUSED_NORM_KINDS   # asked once: cpu_kind() costs a microsecond a call


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """vLLM's fused residual add + RMSNorm in one call of cpu_norm.c, for float32 rows (N, D) in a
    CPU's memory: residual += x, then x = norm(residual), both in place, returns (x, residual);
    without a residual, (norm(x), x). Given `out` (x's shape, contiguous), the norm goes there and
    x is only read. None where it does not run (another dtype or device, a graph being traced, a
    CPU kind not in FUSED_NORM_KINDS, no C compiler): the caller takes PyTorch's operators."""
    w = norm.weight
    if (x.dtype != torch.float32 or w.dtype != torch.float32 or not x.is_cpu or x.dim() != 2
            or not x.is_contiguous() or w.shape != x.shape[1:]
            or any(t is not None and (t.shape != x.shape or t.dtype != x.dtype or not t.is_contiguous())
                   for t in (residual, out))
            or torch.compiler.is_compiling() or not FUSED_NORM_HERE
            or (NORM.lib if NORM.tried else NORM.load()) is None):   # built and loaded at the first call only
        return None
    if out is None:
        out = torch.empty_like(x) if residual is None else x
    NORM.lib.add_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), w.data_ptr(),
                          out.data_ptr(), x.shape[0], x.shape[1], norm.eps)
    return out, x if residual is None else residual


class Linear(nn.Linear):
    """`nn.Linear` (same weight, same names), with faster paths on an x86 CPU.

    On a CPU the speed of a matrix product depends on the library that runs it and on the
    *shape*, far more than on its arithmetic. `F.linear` goes to MKL, Intel's math library,
    which takes its fast code paths only on Intel CPUs; oneDNN, PyTorch's other CPU math
    library, does well on both vendors once the rows are many enough. So, in float32:

    - From `small_rows + 1` rows on (decode batches, prefills), the product runs in oneDNN with
      the weight *pre-packed* once into oneDNN's blocked layout, the way vLLM's CPU backend does.
      The packed copy is made at the first call and again whenever the weight changes; it costs
      one more copy of the weights in memory.
    - Up to `small_rows` rows, on an Intel CPU, plain `F.linear` (MKL's own small-row kernel);
      on any other CPU (W @ x^T)^T, which MKL runs with a kernel that streams W fastest there,
      one row alone padded with a row of zeros (its output dropped) to take it too.
    - Before both, up to `gemv_max_rows()` rows on a CPU of a kind `GEMV_MAX_ROWS` names (AVX2
      without AVX-512): tinyvllm's own AVX2 loop (cpu_gemv.c), which streams the weights faster
      than either library there. Phase 7's compiled step calls it from C++.

    From `bf16_rows` rows on (0, the default: never; `use_bfloat16_products`), a float32
    product runs in bfloat16 on a bfloat16 copy of the packed weight, its output float32; on the
    amx kind up to `AMX_PRODUCT_ROWS` rows on AMX tiles of tinyvllm's own (cpu_amx.c).

    In bfloat16 on a CPU of a kind `BF16_UPCAST_ROWS` names (no bfloat16 arithmetic), from that
    many rows (a prefill, a large batch) the product runs in float32 (`upcast_linear`).

    Elsewhere (a GPU, another dtype, an ARM CPU, or when autograd needs the weight's gradient)
    it is plain `F.linear`. Inside a graph torch.compile traces with a dynamic row count, the
    oneDNN product is the operator `torch.ops.tinyvllm.onednn_linear` (phase 7's compiled step).

    The row counts where each path takes over were chosen on both kinds of CPU with
    `python -m tinyvllm.entrypoints.bench.linear --repeat 9` (all 211 weight matrices of the
    default model, best of 9); its output is kept in docs/assets/bench/linear-cpu-*.txt.

    The numbers equal F.linear's up to float rounding (tests/test_model.py).
    """

    use_onednn = onednn_available()
    # MKL's small-row kernel on an Intel CPU, the transposed product elsewhere: up to here
    small_rows, small_rows_mkl = (3, True) if cpu_vendor() == "Intel" else (2, False)
    gemv_rows = GEMV_MAX_ROWS.get(cpu_kind(), 0)
    upcast_rows = BF16_UPCAST_ROWS.get(cpu_kind(), 0)
    bf16_onednn = use_onednn and cpu_kind() in BF16_ONEDNN_KINDS
    bf16_rows = 0

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
            return torch.ops.tinyvllm.onednn_linear(x, self.weight, self.bias, self.bf16_rows)
        return onednn_matmul(x, self.weight, self.bias, self.bf16_rows)

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

    def has_own_product(self) -> bool:
        """Whether `forward` runs a product of its own on this weight (cpu_gemv.c in float32,
        `upcast_linear` in bfloat16) that a compiler tracing it would not see: phase 7's compiled
        step calls such a layer as it is."""
        w = self.weight
        return bool(self.gemv_max_rows()) or (w.dtype == torch.bfloat16 and w.is_cpu and self.upcast_rows > 0)

    def packed_weight(self) -> torch.Tensor:
        """The weight in oneDNN's layout, packed again if the weight was replaced or changed."""
        return onednn_packed(self.weight)


def onednn_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  bf16_rows: int = 0) -> torch.Tensor:
    """x (N, I) @ weight (O, I)^T + bias in oneDNN on the packed weight; a float32 x of at least
    `bf16_rows` rows (0: never) in bfloat16, on the weight's packed bfloat16 copy, the output
    float32 (the bias added in float32); up to `amx_rows(weight)` rows, that product is
    cpu_amx.c's instead."""
    if 0 < bf16_rows <= x.shape[0] and x.dtype == torch.float32:
        return (amx_matmul if x.shape[0] <= amx_rows(weight) else onednn_bf16)(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, onednn_packed(weight), bias, "none", [], "")


def bf16_product(layer: nn.Module, x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """`layer(x)` as `out_dtype` where `runs_bf16(layer, x)`: x may be float32 or bfloat16, and
    oneDNN's output is bfloat16 before any conversion, so a caller that goes on in bfloat16 reads
    half the bytes and makes no float32 copy. None elsewhere: the caller runs `layer(x)`."""
    return onednn_bf16_out(x, layer.weight).to(out_dtype) if runs_bf16(layer, x) else None


def runs_bf16(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether `layer` is a `Linear` (or subclass) whose product at x's rows is oneDNN's bfloat16
    one (from `bf16_rows`, past `amx_rows`), without a bias, outside a trace and autograd."""
    if torch.compiler.is_compiling() or not isinstance(layer, Linear) or not layer.bf16_rows:
        return False   # (a graph being traced asks nothing more: amx_rows may load a library)
    w, n = layer.weight, x.shape[0] if x.dim() == 2 else 0
    return (layer.use_onednn and layer.bias is None and n >= max(layer.bf16_rows, amx_rows(w) + 1)
            and w.dtype == torch.float32 and x.is_cpu and x.dtype in (torch.float32, torch.bfloat16)
            and not (w.requires_grad and torch.is_grad_enabled()))


def amx_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Causal attention of a prompt's queries q (T, H, 64), the last T of the keys k, v (TK, KVH,
    64), TK >= T (more: a chunk after cached keys) -> (T, H, 64) float32 (written into `out` where
    given: contiguous float32), on cpu_amx.c's AMX tiles (`amx_attention` there: q, k and v rounded
    to bfloat16, their products summed in float32, the softmax in float32, its weights rounded to
    bfloat16 for the second product); None where it does not run (heads of another size, a CPU
    kind without `AMX_PRODUCT_ROWS`, the library not built)."""
    (t, heads, d), (tk, kv_heads) = q.shape, k.shape[:2]
    if (d != 64 or heads % kv_heads or tk < t or not q.is_cpu or not AMX_PRODUCT_ROWS.get(cpu_kind())
            or amx_lib() is None):
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


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a bfloat16 (M, 2I) [gate, up], as bfloat16 (M, I): cpu_amx.c's one pass
    (float32 inside, rounded once) where that library is built, else PyTorch's two operators."""
    lib, (m, two_i) = amx_lib(), gate_up.shape
    if lib is None or two_i % 32 or not gate_up.is_contiguous() or gate_up.dtype != torch.bfloat16:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    out = gate_up.new_empty(m, two_i // 2)
    lib.silu_and_mul(gate_up.data_ptr(), out.data_ptr(), m, two_i // 2)
    return out


# The CPU kinds where `gated_mlp` keeps a prompt's MLP in bfloat16: on a 2-core Xeon VM (amx), one
# layer's MLP at 2,000 rows 6.8-7.9 ms against 9.3-15.7 the float32 way (a /tmp script, best of 7),
# and `LLM()`'s 2,000-token first token 1.440 -> 1.175 s with 2,048-token steps (lab note 7).
# Unmeasured on avx512_vnni, which keeps the float32 way.
BF16_MLP_KINDS = ("amx",)
BF16_MLP_HERE = cpu_kind() in BF16_MLP_KINDS


def gated_mlp(gate_up: nn.Module, down: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate) * up), [gate, up] = gate_up(x): a fused MLP (phase 7's). Where both
    products are oneDNN's bfloat16 ones at x's rows (`runs_bf16`: a prompt's, with dtype="auto"),
    on a kind `BF16_MLP_KINDS` names, gate_up's output stays bfloat16 and `silu_and_mul` and
    down read it so: half the bytes of float32's and no float32 copy of the widest activation
    (the SiLU's product rounded to bfloat16 as down's input is anyway). A layer in a compiled
    step's wrapper (`.layer`) is looked into for that."""
    inner_gate_up, inner_down = (getattr(m, "layer", m) for m in (gate_up, down))
    if BF16_MLP_HERE and runs_bf16(inner_gate_up, x) and runs_bf16(inner_down, x):
        return bf16_product(inner_down, silu_and_mul(bf16_product(inner_gate_up, x, torch.bfloat16)))
    gate, up = gate_up(x).chunk(2, dim=-1)
    return down(F.silu(gate) * up)


def onednn_bf16_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (N, I) rounded to bfloat16 @ the weight's packed bfloat16 copy in oneDNN, the output
    bfloat16 (oneDNN rounds its float32 sums)."""
    return torch.ops.mkldnn._linear_pointwise(x.bfloat16(), onednn_packed(weight, torch.bfloat16), None, "none", [], "")


def onednn_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`onednn_bf16_out` made float32 again, the bias added in float32."""
    y = onednn_bf16_out(x, weight).float()
    return y if bias is None else y.add_(bias)


def bfloat16_weights(layers: list[nn.Module]) -> tuple | None:
    """For a C++ caller of `layers` (phase 7's cpu_ops.cpp): each `Linear`'s weight packed in
    bfloat16 and its `bf16_rows` (an empty tensor and 0 for another layer, or one without), its
    AMX copy where cpu_amx.c takes its rows (else empty), that function's address and up to how
    many rows it serves (0: none); None where no layer has any."""
    rows = [m.bf16_rows if isinstance(m, Linear) else 0 for m in layers]
    if not any(rows):
        return None
    amx = [amx_packed(m.weight) if r and amx_rows(m.weight) else torch.empty(0) for m, r in zip(layers, rows)]
    most = max(amx_rows(m.weight) if r else 0 for m, r in zip(layers, rows))
    return ([onednn_packed(m.weight, torch.bfloat16) if r else torch.empty(0) for m, r in zip(layers, rows)], rows,
            amx, AMX.address("amx_linear") if most else 0, most)


def onednn_packed(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`w` (made `dtype` first, where given) in oneDNN's blocked layout, made at the first call
    and kept on the tensor itself until `w` changes."""
    dtype = dtype or w.dtype
    return kept(w, f"_onednn_packed_{dtype}", lambda: torch.ops.mkldnn._reorder_linear_weight(w.detach().to(dtype)))


def kept(w: torch.Tensor, name: str, make) -> torch.Tensor:
    """make(), kept on the tensor `w` as `name` from its first call until `w` changes."""
    key = (w.data_ptr(), w.dtype, w._version if not w.is_inference() else None)
    cached = getattr(w, name, None)
    if cached is None or cached[0] != key:
        cached = (key, make())
        setattr(w, name, cached)
    return cached[1]


# Up to how many rows a float32 model's bfloat16 products (`bf16_rows`) run on tinyvllm's own AMX
# kernel (cpu_amx.c) instead of oneDNN's, per CPU kind. At a decode step's rows the product is
# bound by reading the weights, which oneDNN does at about 10 GB/s on a 2-core Xeon VM (amx): the
# default model's 211 products at 1, 16, 48, 128 and 256 rows took 18.7, 21.2, 31.0, 58.1 and
# 116.1 ms on cpu_amx.c against oneDNN's 31.4, 35.6, 45.1, 64.1 and 126.4 (`python -m
# tinyvllm.entrypoints.bench.linear`, linear-amx-xeon-amx.txt). With its projections fused (30
# layers of four products, random weights, a /tmp script) 128 rows were even (74.7 against 73.7)
# and from 512 oneDNN's won (164 against 182 ms; 2,000 rows 447 against 760): a prompt's products
# use oneDNN's tiles better than this one-pass loop does.
AMX_PRODUCT_ROWS = {"amx": 128}
AMX = CKernel(Path(__file__).with_name("cpu_amx.c"), ["-O3", "-mavx512f", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
              "-fopenmp", "-shared", "-fPIC"], AMX_BF16_FLAGS,
              {"amx_linear": [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3,
               "silu_and_mul": [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2,
               "amx_attention": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_float],
               "amx_pack_kv": [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2},
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


def amx_rows(weight: torch.Tensor) -> int:
    """Up to how many rows a bfloat16 product on this float32 weight runs on cpu_amx.c (0: not
    here): a kind `AMX_PRODUCT_ROWS` names, outputs a multiple of 16 and inputs of 32, the
    library there (`amx_lib`)."""
    rows = AMX_PRODUCT_ROWS.get(cpu_kind(), 0)
    if not rows or weight.shape[0] % 16 or weight.shape[1] % 32 or weight.dtype != torch.float32 or not weight.is_cpu:
        return 0
    return rows if amx_lib() is not None else 0


def amx_packed(w: torch.Tensor) -> torch.Tensor:
    """`w` (O, I) float32 as cpu_amx.c's bfloat16 tiles, kept on the tensor (`kept`): rounded by
    PyTorch, then each 16 outputs' tiles of 32 inputs, a tile 16 pairs of inputs by 16 outputs."""
    o, i = w.shape
    return kept(w, "_amx_packed", lambda: w.detach().bfloat16().view(o // 16, 16, i // 32, 16, 2)
                .permute(0, 2, 3, 1, 4).contiguous())


def amx_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, I) @ weight (O, I)^T + bias in cpu_amx.c: x rounded to bfloat16, the weight's AMX
    copy, the sums and the output float32 (where `amx_rows(weight)`)."""
    x, (o, i) = x.contiguous(), weight.shape
    y, xb = torch.empty(x.shape[0], o), torch.empty(64 * i, dtype=torch.int16)
    AMX.lib.amx_linear(x.data_ptr(), amx_packed(weight).data_ptr(), None if bias is None else bias.data_ptr(),
                       y.data_ptr(), xb.data_ptr(), x.shape[0], o, i)
    return y


# oneDNN's product with a packed weight, for a graph torch.compile builds: inductor cannot lower
# `mkldnn._linear_pointwise` on a packed weight it did not pack itself, but it calls an operator
# registered here as it is (phase 7's compiled step)
@torch.library.custom_op("tinyvllm::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bf16_rows: int) -> torch.Tensor:
    return onednn_matmul(x, weight, bias, bf16_rows)


@onednn_linear.register_fake
def _(x, weight, bias, bf16_rows):
    return x.new_empty(x.shape[0], weight.shape[0])


# The CPU kinds where the RMSNorm module calls cpu_norm.c (`fused_add_rms_norm` without a residual,
# as `decode_forward`'s first layer does on every FUSED_NORM_KINDS kind): on a 2-core Xeon VM (amx)
# a prompt's 2,000 rows 0.24 ms against 0.79 for the module's six operators, `LLM()`'s 2,000-token
# first token 1.284 -> 1.141 s (alternating rounds; lab note 7). Unmeasured at a prompt's rows on
# the other kinds, which keep the operators there.
NORM_MODULE_KINDS = ("amx",)
NORM_MODULE_HERE = cpu_kind() in NORM_MODULE_KINDS


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 rows on a CPU kind NORM_MODULE_KINDS names: one C call, its own order of the
        # squares' sum; where autograd may need the graph, PyTorch's operators
        if NORM_MODULE_HERE and not torch.is_grad_enabled() and (fused := fused_add_rms_norm(x, None, self)) is not None:
            return fused[0]
        dtype = x.dtype
        x = x.float()  # the variance in float32, as the reference does, whatever the model dtype
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, d, bias = config.hidden_size, config.head_dim, config.qkv_bias
        self.q_proj = Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=config.o_bias)
        # Qwen3: each head's q and k normalized over its d values (one weight of d, every head)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)      # (N, H, d)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)   # (N, KVH, d)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)   # (N, KVH, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        out = attn(self.layer_idx, q, k, v)                             # (N, H, d)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope, attn):
        h = self.self_attn(self.input_layernorm(x), rope, attn)
        # where the RMSNorm module is cpu_norm.c's, the residual add joins it: h = x + h, then its
        # norm, in one pass (an add is an add: the same numbers); x, the caller's, is only read
        if NORM_MODULE_HERE and not torch.is_grad_enabled() and (
                fused := fused_add_rms_norm(x, h, self.post_attention_layernorm, torch.empty_like(h))) is not None:
            return fused[1] + self.mlp(fused[0])
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        # `_weight`: no random init, the weights are always loaded (weights.load_model). On the
        # meta device the init (normal_) would cost ~2 s of PyTorch imports, once per process.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, max_positions)

    def forward(self, input_ids, positions, attn):
        x = self.embed_tokens(input_ids)                                # (N, D)
        rope = self.rotary_emb(positions, x.dtype)                      # (cos, sin), (N, 1, d) each
        for layer in self.layers:
            x = layer(x, rope, attn)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head. `forward` returns hidden states; `compute_logits` turns the
    rows you need (usually the last token of each sequence) into vocabulary scores. Every family
    of `tinyvllm.registry` is this class with its config's switches."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions or config.max_position_embeddings)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: (N,) -> hidden states (N, D)."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(M, D) -> (M, V) float32 logits."""
        return self.lm_head(hidden).float()
