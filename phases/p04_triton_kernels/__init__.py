"""Phase 4: Triton kernels for paged attention and the KV-cache write."""

from .engine import Engine

__all__ = ["Engine"]
