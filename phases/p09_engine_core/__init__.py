"""Phase 9: the engine core in a process of its own (msgpack over ZeroMQ); the front process
keeps the tokenizer and the caller."""

from .core import EngineCoreProc
from .core_client import EngineCoreClient, FrontRequest
from .recipe import RECIPE

__all__ = ["EngineCoreClient", "EngineCoreProc", "FrontRequest", "RECIPE"]
