"""Phase 4's recipe: phase 3's, with the attention backend `attention_backend` chooses.

Phases 1-3 attend in PyTorch: every decode step gathers each sequence's blocks into a padded
copy, and every prefill chunk builds phase 1's whole score matrix with the KV heads repeated.
Phase 4 reads the paged cache where it lies:

- "triton": the kernels of `triton_attention.py`, the KV write (`reshape_and_cache`) and one
  paged attention launch for the whole flat batch (`unified_attention`), split-KV for decode
  batches too small to fill the GPU (`TritonPagedAttention`). On a CUDA GPU they are compiled;
  on a CPU they run only in Triton's interpreter (`TRITON_INTERPRET=1` set before Triton is
  imported), for checking.
- "auto" (default): the Triton kernels on CUDA; on a CPU, where Triton cannot compile,
  `cpu_attention.py`: PyTorch's fused CPU attention for prefill chunks too (`CpuPagedAttention`).
- "torch": phase 3's attention exactly, for comparison.

Only the attention part changes; with `batch_invariant=True` it stays phase 3's fixed-order one.
"""

from __future__ import annotations

from functools import partial

import torch

from phases.p01_naive_attention import EngineSetup, Parts
from phases.p03_continuous_batching import RECIPE as PHASE3

from .cpu_attention import CpuPagedAttention, bf16_prefill_runs
from .triton_backend import TritonPagedAttention


def resolve_attention_backend(attention_backend: str, device: torch.device, block_size: int) -> str:
    """What `attention_backend` means on `device`: "triton", "cpu" (the fused CPU path) or
    "torch". Raises ValueError where the Triton kernels cannot run."""
    if attention_backend == "torch":
        return "torch"
    if attention_backend == "auto":
        if device.type != "cuda":
            return "cpu"
        attention_backend = "triton"
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 for the Triton kernels (one block is "
                         f"one tile; attention_backend='triton', or 'auto' on a GPU), got {block_size}")
    from . import triton_attention  # imports Triton: only when it may be used

    if device.type != "cuda" and not triton_attention.interpreter_active():
        raise ValueError(
            "attention_backend='triton' on a CPU needs Triton's interpreter: set the environment "
            "variable TRITON_INTERPRET=1 before Triton is imported (before Python starts), or use "
            "attention_backend='auto' (the fused CPU path) or 'torch'")
    return "triton"


def attention_backend(setup: EngineSetup) -> str:
    """This engine's backend: "triton", "cpu" or "torch" (checked before the model loads)."""
    return resolve_attention_backend(setup.config.attention_backend, setup.device, setup.config.block_size)


def check_backend(setup: EngineSetup) -> None:
    attention_backend(setup)


def make_attention(setup: EngineSetup, parts: Parts):
    backend = attention_backend(setup)
    if setup.config.batch_invariant or backend == "torch":
        return PHASE3.attention(setup, parts)
    if backend == "triton":
        return partial(TritonPagedAttention, parts.kv_cache)
    # prefill's attention in bfloat16 where the engine multiplies in bfloat16 and it was measured
    return partial(CpuPagedAttention, parts.kv_cache, bf16_prefill=bool(setup.bf16_rows) and bf16_prefill_runs())


RECIPE = PHASE3.extend(phase=4, engine_args={"attention_backend"}, checks=(check_backend,),
                       attention=make_attention)
