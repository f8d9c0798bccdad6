"""The batch-invariant mode (`batch_invariant=True`): a request's tokens do not depend on what it
was batched with, nor on whether it was preempted.

Why they can: a token's K/V is computed once, in the step that first runs it (a prefill chunk,
or a decode step), and read by every later step. After a preemption the sequence is recomputed
as one prefill of its prompt and its output so far: the same tokens, but through different
code (a prefill's matrix products have hundreds of rows and its attention is a causal tile
loop; a decode step's has a row per sequence and a padded gather). A floating-point sum in
another order can differ in its last bit, and where two candidate tokens' logits are that
close, greedy decoding picks the other one and the text goes another way from there.

The mode removes every such difference, as vLLM's `VLLM_BATCH_INVARIANT=1` does on a GPU with
its own matmul and attention kernels: each output is computed from its own inputs in one fixed
order, whatever else is in the step (`batch_invariant.c`).

- Every float `Linear` of the model becomes a `BatchInvariantLinear` (the same weight), whose
  product is `bi_linear`. A layer of another kind keeps its own product, which must be
  batch-invariant itself (exact integer sums are, for one): an engine that brings such layers
  checks them.
- The attention backend is `BatchInvariantAttention`: the cache write as before, then
  `bi_attention`, one kernel for prefill tokens and decode tokens alike (in a layer's sliding
  window, where it has one).
- The rest of the model is row by row already (RMSNorm, RoPE, SiLU, the residual adds): the
  tests check each on this machine.

The cost (the lesson's table): a CPU-only, float32 mode whose products run in tinyvllm's
AVX2 kernel instead of oneDNN's.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch
from torch import nn

from phases.p02_paged_kv import AttentionMetadata, KVCache, PagedAttention
from tinyvllm.ckernel import CKernel
from tinyvllm import platform
from tinyvllm.hardware import AVX2_FLAGS
from tinyvllm.layers import Linear

P, I64 = ctypes.c_void_p, ctypes.c_int64
KERNELS = CKernel(Path(__file__).with_name("batch_invariant.c"),
                  ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"], AVX2_FLAGS,
                  {"bi_linear": [P] * 4 + [I64] * 3, "bi_attention": [P] * 7 + [I64] * 7 + [ctypes.c_float]},
                  fallback="batch_invariant=True cannot run")
MAX_HEAD_DIM = 256


def check_batch_invariant(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Raise ValueError naming `batch_invariant` where its kernels cannot run."""
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"batch_invariant=True runs on a CPU in float32 (tinyvllm's C kernels); this "
                         f"engine is on {device} in {str(dtype).removeprefix('torch.')}: use device='cpu' "
                         f"and dtype='float32', or batch_invariant=False")
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"batch_invariant=True needs a head_dim that is a multiple of 8, at most "
                         f"{MAX_HEAD_DIM}; this model's is {head_dim}")
    if not KERNELS.available():
        raise ValueError(f"batch_invariant=True needs an x86 CPU with AVX2 and a C compiler (CC) to build "
                         f"batch_invariant.c; this CPU is of the kind {platform.current().kind!r}")


class BatchInvariantLinear(Linear):
    """`Linear` whose CPU float32 product is `bi_linear`: each output in one fixed order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
            return super().forward(x)
        x = x.contiguous()
        m, k = x.shape
        y = torch.empty(m, self.out_features)
        bias = None if self.bias is None else self.bias.data_ptr()
        KERNELS.lib.bi_linear(x.data_ptr(), self.weight.contiguous().data_ptr(), bias, y.data_ptr(),
                              m, self.out_features, k)
        return y


def make_batch_invariant(model: nn.Module) -> int:
    """Replace every float `Linear` of `model` by a `BatchInvariantLinear` holding the same weight
    (a tied LM head stays tied). Returns how many were replaced."""
    count = 0
    for name, m in list(model.named_modules()):
        if type(m) is Linear:
            model.set_submodule(name, BatchInvariantLinear.like(m))
            count += 1
    return count


class BatchInvariantAttention(PagedAttention):
    """Phase 2's backend (the same cache write), attending with `bi_attention`: every query
    token, of a prefill chunk or a decode, over its own keys 0 .. p in order."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata):
        super().__init__(cache, meta)
        starts, lens = meta.query_start_loc, meta.seq_lens or meta.seq_lens_tensor.tolist()
        seq, pos = [], []
        for b, seq_len in enumerate(lens):  # sequence b's queries are its last n positions
            n = starts[b + 1] - starts[b]
            seq += [b] * n
            pos += range(seq_len - n, seq_len)
        self.token_seq = torch.tensor(seq, dtype=torch.int64)          # (N,)
        self.token_pos = torch.tensor(pos, dtype=torch.int64)          # (N,)
        self.block_tables = meta.block_tables.contiguous()             # (B, M)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer_idx, self.meta.slot_mapping, k, v)
        k_cache, v_cache = self.cache.layer(layer_idx)                 # (num_blocks, bs, KVH, d) each
        q = q.contiguous()
        n, h, d = q.shape
        out = torch.empty_like(q)
        window = (self.cache.windows[layer_idx] if self.cache.windows else None) or 0   # 0: every key
        KERNELS.lib.bi_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                                 self.block_tables.data_ptr(), self.token_seq.data_ptr(),
                                 self.token_pos.data_ptr(), n, h, k_cache.shape[2], d, k_cache.shape[1],
                                 self.block_tables.shape[1], window, 1 / math.sqrt(d))
        return out
