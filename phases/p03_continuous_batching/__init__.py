"""Phase 3: continuous batching, with preemption, chunked prefill and prefix caching."""

from tinyvllm.sequence import SequenceStatus

from .batch_invariant import BatchInvariantAttention, BatchInvariantLinear, make_batch_invariant
from .prefix_cache import PrefixBlockTable, PrefixCachingBlockAllocator
from .recipe import RECIPE
from .scheduler import Scheduler

__all__ = ["RECIPE", "Scheduler", "SequenceStatus", "PrefixCachingBlockAllocator", "PrefixBlockTable",
           "BatchInvariantAttention", "BatchInvariantLinear", "make_batch_invariant"]
