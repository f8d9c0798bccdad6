"""The pool's memory for groups of layers, and attention that reads each layer's group's tables.

    kv:  (group_size, 2, num_blocks, block_size, num_kv_heads, head_dim)

One tensor per position in a group, not per layer: layer l, the j-th of its group, reads and
writes kv[j] through its group's block tables, so a block id is K and V of group_size layers
whichever group holds it (vLLM shares its per-layer tensors between groups the same way). Each
layer's view is made once, so phase 2's `KVCache.layer` and `write` serve unchanged.

A step's metadata is phase 2's, once per group (`HybridMetadata.groups`): the same queries and
lengths, each group's block tables and slots.

With `kv_cache_dtype` int8 or fp8 the pool is phase 5's quantized one, laid out the same way
(`HybridQuantizedKVCache`: a position in a group where phase 5 has a layer), and each group's
layers attend through phase 5's `QuantizedPagedAttention` over that group's metadata; with
`batch_invariant=True` through phase 3's `BatchInvariantAttention` (`GroupAttention`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from phases.p02_paged_kv import AttentionMetadata, KVCache, check_metadata, paged_attention
from phases.p02_paged_kv.kv_cache import zeros
from phases.p04_triton_kernels.cpu_attention import (CpuPagedAttention, attention_row, c_decode_attention,
                                                     c_decode_runs, cpu_prompt_attention)
from phases.p05_quantization.kv_quant import QuantizedKVCache, quantized_bytes_per_block
from tinyvllm.config import ModelConfig

from .kv_cache_interface import KVCacheGroup


def bytes_per_block(model: ModelConfig, groups: list[KVCacheGroup], block_size: int, dtype: torch.dtype,
                    kv_cache_dtype: str = "auto") -> int:
    """K and V of one group's layers (they are all the same size) for block_size tokens."""
    if kv_cache_dtype != "auto":   # phase 5's bytes a layer, for a group's layers
        return quantized_bytes_per_block(model, block_size) // model.num_hidden_layers * len(groups[0].layers)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * len(groups[0].layers) * block_size * model.num_key_value_heads * model.head_dim * elem


def group_positions(model: ModelConfig, groups: list[KVCacheGroup]) -> tuple[list[int], list[int]]:
    """Each layer's group, and its position in that group."""
    group_of, position = [0] * model.num_hidden_layers, [0] * model.num_hidden_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            group_of[layer], position[layer] = g, j
    return group_of, position


class HybridKVCache(KVCache):
    """Phase 2's `KVCache`, its memory shared by the groups (see the module docstring)."""

    def __init__(self, model: ModelConfig, groups: list[KVCacheGroup], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, windows: tuple[int | None, ...]):
        self.num_blocks, self.block_size, self.windows = num_blocks, block_size, windows
        self.kv = zeros(len(groups[0].layers), 2, num_blocks, block_size, model.num_key_value_heads,
                        model.head_dim, dtype=dtype, device=device)
        self.group_of, self.position = group_positions(model, groups)     # layer -> its group, its place in it
        self.views = [tuple(self.kv[j].unbind(0)) for j in self.position]


class HybridQuantizedKVCache(QuantizedKVCache):
    """Phase 5's 8-bit `QuantizedKVCache`, its memory shared by the groups: `kv` and `scales` hold
    one layer per position in a group, and layer l reads and writes its position's."""

    def __init__(self, model: ModelConfig, groups: list[KVCacheGroup], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, kv_cache_dtype: str, windows: tuple[int | None, ...]):
        one_group = dataclasses.replace(model, num_hidden_layers=len(groups[0].layers), layer_types=None)
        super().__init__(one_group, num_blocks, block_size, dtype, device, kv_cache_dtype)
        self.windows = windows
        self.group_of, self.position = group_positions(model, groups)

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        super().write(self.position[layer_idx], slot_mapping, k, v)

    def gather(self, layer_idx: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().gather(self.position[layer_idx], block_ids)


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
    attending in its window (phase 2's `paged_attention`; with `c_decode`, on a CPU, a step of
    decodes only in one call of phase 4's C decode kernel, which starts each row at its window,
    where it runs, and a step with prompts through phase 4's `cpu_prompt_attention`)."""

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
        window = self.cache.windows[layer_idx]
        if self.c_decode and not meta.prefill_rows and c_decode_runs(q, k_cache):   # the write too
            return c_decode_attention(q, k_cache, v_cache, meta, k, v, window)
        self.cache.write(layer_idx, meta.slot_mapping, k, v)
        if self.c_decode and meta.prefill_rows:   # phase 4's prompt paths on a CPU
            return cpu_prompt_attention(q, k, v, k_cache, v_cache, meta, window)
        return paged_attention(q, k_cache, v_cache, meta, window)


def group_attention_row(attention) -> torch.Tensor | None:
    """A step of decodes through `HybridAttention` as phase 7's cpu_step.c reads it: phase 4's
    `attention_row` of group 0, with each layer's own place filled in (the row's last field):
    where its position's K starts in the pool (floats from the pool's start), its group's slots,
    block tables and their row stride. None where phase 4's row would be None (not the C kernel,
    a prefill in the step), so cpu_step.c serves no step of such an engine."""
    if type(attention) is not HybridAttention or not attention.c_decode:
        return None
    cache, metas = attention.cache, attention.meta.groups
    row = attention_row(CpuPagedAttention(cache, metas[0]))
    if row is None or any(m.decode_block_tables.stride(1) != 1 for m in metas):
        return None
    layer_stride = cache.kv.stride(0)
    own = torch.tensor([[cache.position[layer] * layer_stride, m.slot_mapping.data_ptr(),
                         m.decode_block_tables.data_ptr(), m.decode_block_tables.stride(0)]
                        for layer, m in enumerate(metas[g] for g in cache.group_of)])
    row[-1], row.own, row.metas = own.data_ptr(), own, metas   # the tensors it points into, alive with it
    return row


class GroupAttention:
    """The attention backend of a step as an earlier phase's, once per group: each layer through
    `backend` (cache, metadata) built over its group's metadata. Phase 5's `QuantizedPagedAttention`
    over a `HybridQuantizedKVCache` (the blocks that group's tables use, dequantized; phase 2's
    paged attention in the layer's window), phase 3's `BatchInvariantAttention` over a
    `HybridKVCache` (its C kernel starts each query at its window)."""

    def __init__(self, cache: KVCache, meta: HybridMetadata, backend):
        self.cache, self.meta = cache, meta
        self.groups = [backend(cache, m) for m in meta.groups]

    @property
    def windows(self) -> tuple[int | None, ...]:
        return self.cache.windows

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.groups[self.cache.group_of[layer_idx]](layer_idx, q, k, v)
