"""Phase 2: a KV cache in fixed-size blocks: block allocator, block tables, paged attention."""

from .block_allocator import BlockAllocator, BlockTable
from .engine import Engine
from .kv_cache import KVCache
from .paged_attention import AttentionMetadata, PagedAttention, decode_attention, decode_gather, paged_attention

__all__ = ["Engine", "BlockAllocator", "BlockTable", "KVCache", "AttentionMetadata", "PagedAttention",
           "paged_attention", "decode_attention", "decode_gather"]
