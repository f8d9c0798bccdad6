"""Phase 7: a persistent batch, static buffers and captured decode steps."""

from .engine import Engine

__all__ = ["Engine"]
