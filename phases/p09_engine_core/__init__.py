"""Phase 9: the engine core in a process of its own (msgpack over ZeroMQ), sending token ids; the
front process keeps the tokenizer, the text and its stop strings, and the caller."""

from .core import EngineCoreProc
from .core_client import EngineCoreClient, FrontRequest
from .output_processor import FrontSequence
from .recipe import RECIPE

__all__ = ["EngineCoreClient", "EngineCoreProc", "FrontRequest", "FrontSequence", "RECIPE"]
