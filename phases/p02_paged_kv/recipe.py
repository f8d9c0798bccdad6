"""Phase 2's recipe: phase 1's, with a paged KV cache and static batches.

    kv_cache    `KVCache`: one tensor of fixed-size blocks for every layer's K and V
    allocator   `BlockAllocator`: hands out blocks; each sequence owns a `BlockTable`
    attention   `PagedAttention`: write the step's K/V into its slots, attend through the tables
    runner      `ModelRunner`: only the new tokens of each sequence (a decode: one), as a flat batch
    scheduler   `StaticBatchScheduler`: admit what fits, prefill it, decode it to the end

The model and the sampler are phase 1's. A decode step now runs the model on one token per
sequence instead of the whole sequence again.
"""

from __future__ import annotations

from functools import partial

from phases.p01_naive_attention import RECIPE as PHASE1
from phases.p01_naive_attention import EngineSetup, Parts

from .block_allocator import BlockAllocator
from .kv_cache import KVCache, num_kv_blocks
from .model_runner import ModelRunner
from .paged_attention import PagedAttention
from .scheduler import StaticBatchScheduler


def make_kv_cache(setup: EngineSetup, parts: Parts) -> KVCache:
    """The KV pool: as many blocks as the memory budget holds (`num_kv_blocks`)."""
    c = setup.config
    blocks = num_kv_blocks(c, setup.model_config, setup.max_model_len, setup.dtype, setup.device)
    cache = KVCache(setup.model_config, blocks, c.block_size, setup.dtype, setup.device)
    cache.checked = setup.check_kernels   # checked mode: each step's metadata checked against the pool
    cache.windows = setup.model_config.layer_windows(setup.max_model_len)   # what each layer attends to
    return cache


def make_allocator(setup: EngineSetup, parts: Parts) -> BlockAllocator:
    return BlockAllocator(parts.kv_cache.num_blocks, setup.config.block_size)


def make_attention(setup: EngineSetup, parts: Parts):
    """Per step: a `PagedAttention` over the pool, with that step's metadata."""
    return partial(PagedAttention, parts.kv_cache)


def make_runner(setup: EngineSetup, parts: Parts) -> ModelRunner:
    return ModelRunner(parts.model, parts.attention, setup.config.block_size, setup.device)


def make_scheduler(setup: EngineSetup, parts: Parts) -> StaticBatchScheduler:
    return StaticBatchScheduler(parts.allocator, setup.config.max_num_seqs, setup.max_model_len)


RECIPE = PHASE1.extend(
    phase=2,
    engine_args={"block_size", "num_kv_blocks", "kv_cache_memory", "gpu_memory_utilization", "max_num_seqs",
                 "check_kernels"},
    kv_cache=make_kv_cache, allocator=make_allocator, attention=make_attention, runner=make_runner,
    scheduler=make_scheduler,
)
