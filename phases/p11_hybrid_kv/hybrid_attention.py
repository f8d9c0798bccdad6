"""The pool's memory for groups of layers, and attention that reads each layer's group's tables.

    kv:  (group_size, 2, num_blocks, block_size, num_kv_heads, head_dim)

One tensor per position in a group, not per layer: layer l, the j-th of its group, reads and
writes kv[j] through its group's block tables, so a block id is K and V of group_size layers
whichever group holds it (vLLM shares its per-layer tensors between groups the same way). Each
layer's view is made once, so phase 2's `KVCache.layer` and `write` serve unchanged.

A step's metadata is phase 2's, once per group (`HybridMetadata.groups`): the same queries and
lengths, each group's block tables and slots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from phases.p02_paged_kv import AttentionMetadata, KVCache, check_metadata, paged_attention
from phases.p02_paged_kv.kv_cache import zeros
from phases.p04_triton_kernels.cpu_attention import c_decode_attention, c_decode_runs
from tinyvllm.config import ModelConfig

from .kv_cache_interface import KVCacheGroup


def bytes_per_block(model: ModelConfig, groups: list[KVCacheGroup], block_size: int, dtype: torch.dtype) -> int:
    """K and V of one group's layers (they are all the same size) for block_size tokens."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * len(groups[0].layers) * block_size * model.num_key_value_heads * model.head_dim * elem


class HybridKVCache(KVCache):
    """Phase 2's `KVCache`, its memory shared by the groups (see the module docstring)."""

    def __init__(self, model: ModelConfig, groups: list[KVCacheGroup], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, windows: tuple[int | None, ...]):
        self.num_blocks, self.block_size, self.windows = num_blocks, block_size, windows
        self.kv = zeros(len(groups[0].layers), 2, num_blocks, block_size, model.num_key_value_heads,
                        model.head_dim, dtype=dtype, device=device)
        self.group_of = [0] * model.num_hidden_layers     # layer -> its group
        self.views: list = [None] * model.num_hidden_layers
        for g, group in enumerate(groups):
            for j, layer in enumerate(group.layers):
                self.group_of[layer], self.views[layer] = g, tuple(self.kv[j].unbind(0))


@dataclass
class HybridMetadata(AttentionMetadata):
    """Phase 2's metadata (group 0's), and every group's (`groups[g]`)."""

    groups: list[AttentionMetadata] = field(default_factory=list)


def group_metadata(meta: AttentionMetadata, plan, tables: list[list], block_size: int,
                   device: torch.device) -> HybridMetadata:
    """`meta` (built from group 0's tables) with every group's: tables[g][b] is group g's table
    of the plan's b-th sequence."""
    query_lens = [n for _, n in plan.scheduled]
    seq_lens = [seq.num_computed_tokens + n for seq, n in plan.scheduled]
    metas = [meta]
    for group_tables in tables[1:]:
        slots = [t.slot(p, block_size) for t, (seq, n) in zip(group_tables, plan.scheduled)
                 for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n)]
        metas.append(AttentionMetadata.build(slots, query_lens, seq_lens, [t.block_ids for t in group_tables], device))
    fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(AttentionMetadata)}
    return HybridMetadata(**fields, groups=metas)


class HybridAttention:
    """The attention backend of a step: each layer writes and reads through its group's tables,
    attending in its window (phase 2's `paged_attention`; a step of decodes only in one call of
    phase 4's C decode kernel, which starts each row at its window, where `c_decode` and it runs)."""

    def __init__(self, cache: HybridKVCache, meta: HybridMetadata, c_decode: bool = False):
        self.cache, self.meta, self.c_decode = cache, meta, c_decode
        if cache.checked:
            for m in meta.groups:
                check_metadata(m, cache.num_blocks, cache.block_size, type(self).__name__)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return self.cache.windows

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta.groups[self.cache.group_of[layer_idx]]
        k_cache, v_cache = self.cache.layer(layer_idx)
        if self.c_decode and not meta.prefill_rows and c_decode_runs(q, k_cache):   # the write too
            return c_decode_attention(q, k_cache, v_cache, meta, k, v, self.cache.windows[layer_idx])
        self.cache.write(layer_idx, meta.slot_mapping, k, v)
        return paged_attention(q, k_cache, v_cache, meta, self.cache.windows[layer_idx])
