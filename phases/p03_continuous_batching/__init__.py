"""Phase 3: continuous batching, with preemption, chunked prefill and prefix caching."""

from .engine import Engine
from .prefix_cache import PrefixBlockTable, PrefixCachingBlockAllocator
from .scheduler import Scheduler, SchedulerOutput, SequenceStatus

__all__ = ["Engine", "Scheduler", "SchedulerOutput", "SequenceStatus", "PrefixCachingBlockAllocator",
           "PrefixBlockTable"]
