"""Phase 4: Triton kernels for paged attention and the KV-cache write; on a CPU, fused attention.

The kernels live in `triton_attention` (imported on use: importing it imports Triton, and whether
Triton interprets or compiles is decided then); the CPU path in `cpu_attention`.
"""

from .cpu_attention import CpuPagedAttention, cpu_paged_attention, prefill_attention
from .recipe import RECIPE, attention_backend, resolve_attention_backend
from .triton_backend import TritonPagedAttention

__all__ = [
           "RECIPE",
           "CpuPagedAttention",
           "TritonPagedAttention",
           "attention_backend",
           "cpu_paged_attention",
           "prefill_attention",
           "resolve_attention_backend",
]
