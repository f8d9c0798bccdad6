"""Phase 6: speculative decoding with exact rejection sampling."""

from .engine import Engine

__all__ = ["Engine"]
