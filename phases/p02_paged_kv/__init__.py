"""Phase 2: a KV cache in fixed-size blocks: block allocator, block tables, paged attention."""

from .block_allocator import BlockAllocator, BlockTable
from .kv_cache import KVCache
from .model_runner import ModelInputs, ModelRunner
from .paged_attention import (
           AttentionMetadata,
           PagedAttention,
           check_metadata,
           decode_attention,
           decode_gather,
           paged_attention,
)
from .recipe import RECIPE
from .scheduler import KVUsage, StaticBatchScheduler, check_fits_pool

__all__ = ["RECIPE", "BlockAllocator", "BlockTable", "KVCache", "KVUsage", "ModelRunner", "ModelInputs",
           "AttentionMetadata", "PagedAttention", "StaticBatchScheduler", "check_fits_pool",
           "check_metadata", "paged_attention", "decode_attention", "decode_gather"]
