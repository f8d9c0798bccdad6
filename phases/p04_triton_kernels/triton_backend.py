"""The Triton attention backend for one step: phase 2's interface, phase 4's kernels.

It writes the step's K/V with `reshape_and_cache` and attends with one `unified_attention`
launch for the whole flat batch. The kernels read the step's layout from device tensors
(`query_start_loc`, `seq_lens`, `block_tables` as int32), converted on the device from the
metadata's own tensors: no value is copied from the host, or read back to it. The launch's shape
comes from two host numbers, `max_query_len` and `max_seq_len`; the kernels read each
sequence's true length from `seq_lens`, so a `max_seq_len` above the longest only makes the
launch larger, never the result different.
"""

from __future__ import annotations

import torch

from phases.p02_paged_kv import AttentionMetadata, KVCache, PagedAttention


class TritonPagedAttention(PagedAttention):
    """The Triton backend for one step: the metadata as int32 tensors, made once for all layers."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata):
        super().__init__(cache, meta)
        self.query_start_loc = meta.query_start_loc_tensor.to(torch.int32)   # (B+1,)
        self.seq_lens = meta.seq_lens_tensor.to(torch.int32)                 # (B,)
        self.block_tables = meta.block_tables.to(torch.int32)                # (B, M)
        self.max_query_len, self.max_seq_len = meta.max_query_len, meta.max_seq_len

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from .triton_attention import reshape_and_cache, unified_attention

        k_cache, v_cache = self.cache.layer(layer_idx)
        reshape_and_cache(k, v, k_cache, v_cache, self.meta.slot_mapping)
        return unified_attention(q, k_cache, v_cache, torch.empty_like(q), self.query_start_loc,
                                 self.seq_lens, self.block_tables, self.max_query_len, self.max_seq_len,
                                 window=self.cache.windows[layer_idx] if self.cache.windows else None)
