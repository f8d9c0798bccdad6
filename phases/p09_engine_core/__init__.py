"""Phase 9: the engine core in a process of its own (msgpack over ZeroMQ), sending token ids; the
front process keeps the tokenizer, the text and its stop strings, and the caller. With
`async_scheduling` the core plans each step while the one before runs (two batches in flight)."""

from .async_scheduler import AsyncScheduler
from .batch_queue import BatchQueue
from .core import EngineCoreProc
from .core_client import EngineCoreClient, FrontRequest
from .output_processor import FrontSequence
from .recipe import RECIPE

__all__ = ["AsyncScheduler", "BatchQueue", "EngineCoreClient", "EngineCoreProc", "FrontRequest", "FrontSequence",
           "RECIPE"]
