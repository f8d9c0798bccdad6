"""Phase 11: per-layer KV specs, layers grouped by spec, a sliding-window manager in one pool."""

from .hybrid_attention import GroupAttention, HybridAttention, HybridKVCache, HybridMetadata, HybridQuantizedKVCache
from .kv_cache_interface import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec, group_layers, layer_specs
from .kv_cache_manager import CacheHit, HybridKVCacheManager, hit_length
from .recipe import RECIPE
from .scheduler import (HybridAsyncScheduler, HybridModelRunner, HybridScheduler, HybridSpecModelRunner,
                        HybridSpecScheduler)

__all__ = ["RECIPE", "CacheHit", "FullAttentionSpec", "GroupAttention", "HybridAsyncScheduler", "HybridAttention",
           "HybridKVCache", "HybridKVCacheManager", "HybridMetadata", "HybridModelRunner", "HybridQuantizedKVCache",
           "HybridScheduler", "HybridSpecModelRunner", "HybridSpecScheduler", "KVCacheGroup", "SlidingWindowSpec",
           "group_layers", "hit_length", "layer_specs"]
