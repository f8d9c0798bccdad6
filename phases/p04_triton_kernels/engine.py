"""Phase 4 engine: phase 3's engine with a new attention backend, chosen by `attention_backend`.

Phases 1-3 attend in PyTorch: every decode step gathers each sequence's blocks into a padded
copy, and every prefill chunk builds phase 1's whole score matrix with the KV heads repeated.
Phase 4 reads the paged cache where it lies:

- "triton": the kernels of `triton_attention.py`, the KV write (`reshape_and_cache`) and one
  paged attention launch for the whole flat batch (`unified_attention`), split-KV for decode
  batches too small to fill the GPU. On a CUDA GPU they are compiled; on a CPU they run only in
  Triton's interpreter (`TRITON_INTERPRET=1` set before Triton is imported), for checking.
- "auto" (default): the Triton kernels on CUDA; on a CPU, where Triton cannot compile,
  `cpu_attention.py`: PyTorch's fused CPU attention for prefill chunks too.
- "torch": phase 3's attention exactly, for comparison.

Only the backend changes: the scheduler, the cache and the model runner are phase 3's (and
phase 2's); `make_attention` hands the model runner this phase's backend for each step.
"""

from __future__ import annotations

import torch

from phases.p02_paged_kv import AttentionMetadata, KVCache, PagedAttention
from phases.p03_continuous_batching import Engine as Phase3Engine
from tinyvllm.config import EngineConfig
from tinyvllm.weights import resolve_device

from .cpu_attention import CpuPagedAttention


def resolve_attention_backend(attention_backend: str, device: torch.device, block_size: int) -> str:
    """What `attention_backend` means on `device`: "triton", "cpu" (the fused CPU path) or
    "torch". Raises ValueError where the Triton kernels cannot run."""
    if attention_backend == "torch":
        return "torch"
    if attention_backend == "auto":
        if device.type != "cuda":
            return "cpu"
        attention_backend = "triton"
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 for the Triton kernels (one block is "
                         f"one tile; attention_backend='triton', or 'auto' on a GPU), got {block_size}")
    from . import triton_attention  # imports Triton: only when it may be used

    if device.type != "cuda" and not triton_attention.interpreter_active():
        raise ValueError(
            "attention_backend='triton' on a CPU needs Triton's interpreter: set the environment "
            "variable TRITON_INTERPRET=1 before Triton is imported (before Python starts), or use "
            "attention_backend='auto' (the fused CPU path) or 'torch'")
    return "triton"


class TritonPagedAttention(PagedAttention):
    """The Triton backend for one step: the metadata as int32 tensors, made once for all layers."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata):
        super().__init__(cache, meta)
        device = meta.slot_mapping.device
        starts = meta.query_start_loc
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)  # (B+1,)
        self.seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32, device=device)   # (B,)
        self.block_tables = meta.block_tables.to(torch.int32)                          # (B, M)
        self.max_query_len = max(b - a for a, b in zip(starts, starts[1:]))
        self.max_seq_len = max(meta.seq_lens)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from .triton_attention import reshape_and_cache, unified_attention

        k_cache, v_cache = self.cache.layer(layer_idx)
        reshape_and_cache(k, v, k_cache, v_cache, self.meta.slot_mapping)
        return unified_attention(q, k_cache, v_cache, torch.empty_like(q), self.query_start_loc,
                                 self.seq_lens, self.block_tables, self.max_query_len, self.max_seq_len)


class Engine(Phase3Engine):
    """The phase 4 engine: phase 3 with Triton kernels on a GPU and fused attention on a CPU."""

    phase = 4
    ENGINE_ARGS = Phase3Engine.ENGINE_ARGS | {"attention_backend"}

    def __init__(self, model=None, **engine_args):
        # "triton", "cpu" or "torch": what attention_backend means on this device; decided before
        # the model loads, so a backend that cannot run fails at once
        config = EngineConfig.from_kwargs(**engine_args)
        self.attention_backend = resolve_attention_backend(config.attention_backend,
                                                           resolve_device(config.device), config.block_size)
        super().__init__(model, **engine_args)

    def make_attention(self, meta: AttentionMetadata) -> PagedAttention:
        if self.config.batch_invariant:  # phase 3's fixed-order kernel, whatever the backend
            return super().make_attention(meta)
        if self.attention_backend == "triton":
            return TritonPagedAttention(self.kv_cache, meta)
        if self.attention_backend == "cpu":
            return CpuPagedAttention(self.kv_cache, meta)
        return super().make_attention(meta)
