"""Phase 5: int8 and int4 weights, and a quantized KV cache."""

from .engine import Engine

__all__ = ["Engine"]
