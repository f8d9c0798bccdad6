"""Phase 4: Triton kernels for paged attention and the KV-cache write; on a CPU, the CPU's kernels.

The kernels live in `triton_attention` (imported on use: importing it imports Triton, and whether
Triton interprets or compiles is decided then); the CPU path in `cpu_attention` (attention),
`cpu_layers` (the model's products, norms and RoPE) and `cpu_amx` (AMX tiles).
"""

from .cpu_amx import amx_attention, amx_fits, amx_matmul, silu_and_mul
from .cpu_attention import CpuPagedAttention, cpu_paged_attention, prefill_attention, prefill_paths
from .cpu_layers import (GEMV, CpuLinear, CpuRMSNorm, CpuRotaryEmbedding, bf16_mlp, bf16_product, fused_add_rms_norm,
                         gemv, onednn_bf16, onednn_matmul, runs_bf16, use_bfloat16_products)
from .recipe import RECIPE, attention_backend, resolve_attention_backend, use_cpu_kernels
from .triton_backend import TritonPagedAttention

__all__ = [
           "RECIPE",
           "CpuLinear",
           "CpuPagedAttention",
           "CpuRMSNorm",
           "CpuRotaryEmbedding",
           "GEMV",
           "TritonPagedAttention",
           "amx_attention",
           "amx_fits",
           "amx_matmul",
           "attention_backend",
           "bf16_mlp",
           "bf16_product",
           "cpu_paged_attention",
           "fused_add_rms_norm",
           "gemv",
           "onednn_bf16",
           "onednn_matmul",
           "prefill_attention",
           "prefill_paths",
           "resolve_attention_backend",
           "runs_bf16",
           "silu_and_mul",
           "use_bfloat16_products",
           "use_cpu_kernels",
]
