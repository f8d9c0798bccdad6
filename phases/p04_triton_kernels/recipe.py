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
  `cpu_attention.py`: PyTorch's fused CPU attention for prefill chunks too, and tinyvllm's own C
  kernels where the platform chose them (`CpuPagedAttention`).
- "torch": phase 3's attention exactly, for comparison.

On a CPU the model gets the CPU's kernels too (`use_cpu_kernels`): every `Linear` a `CpuLinear`,
whose products take the library or kernel that is fastest at their row count (cpu_layers.py:
oneDNN's packed products, cpu_gemv.c, AMX tiles, bfloat16 from a few rows with dtype="auto"),
and the norms and RoPE in C where the platform measured them (cpu_layers.py, cpu_norm.c). With
`batch_invariant=True` the model and the attention stay phase 3's fixed-order ones. A bfloat16
model's KV cache is float32 on a CPU where the platform says (`bf16_kv_float32`), so that its
steps attend in those C kernels.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from phases.p01_naive_attention import EngineSetup, Parts
from phases.p03_continuous_batching import RECIPE as PHASE3
from tinyvllm import platform
from tinyvllm.layers import Linear, RMSNorm

from .cpu_attention import CpuPagedAttention, prefill_paths
from .cpu_layers import CpuLinear, CpuRMSNorm, CpuRotaryEmbedding, use_bfloat16_products
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


def use_cpu_kernels(model: torch.nn.Module, bf16_rows: int) -> torch.nn.Module:
    """Give a CPU engine's model the CPU's kernels, in place: every `Linear` a `CpuLinear`
    (products from `bf16_rows` rows in bfloat16; 0: never), and where the platform's rules say,
    every `RMSNorm` a `CpuRMSNorm` (`c_norm_prompt`) and RoPE cpu_norm.c's (`c_rope`). Each keeps
    its module's weights."""
    rules = platform.current()
    for name, m in list(model.named_modules()):
        if type(m) is Linear:
            model.set_submodule(name, CpuLinear.like(m))
        elif type(m) is RMSNorm and rules.rule("c_norm_prompt"):
            model.set_submodule(name, CpuRMSNorm.like(m))
    if rules.rule("c_rope"):
        model.model.rotary_emb = CpuRotaryEmbedding.like(model.model.rotary_emb)
    use_bfloat16_products(model, bf16_rows)
    return model


def make_model(setup: EngineSetup, parts: Parts):
    model = PHASE3.model(setup, parts)
    if setup.device.type == "cpu" and not setup.config.batch_invariant:
        use_cpu_kernels(model, setup.bf16_rows)
    return model


def make_attention(setup: EngineSetup, parts: Parts):
    backend = attention_backend(setup)
    if setup.config.batch_invariant or backend == "torch":
        return PHASE3.attention(setup, parts)
    if backend == "triton":   # its kernel reads each layer's window
        return partial(TritonPagedAttention, parts.kv_cache)
    # the C decode kernel reads each row's window; a windowed layer's prompt goes to phase 2's path
    # prefill's attention in bfloat16 where the engine multiplies in bfloat16 (dtype="auto" from a
    # few rows; a bfloat16 model over a float32 pool, whose q, k and v are bfloat16 values) and
    # it was measured
    c_prefill, bf16_prefill = prefill_paths()
    return partial(CpuPagedAttention, parts.kv_cache, c_prefill=c_prefill,
                   bf16_prefill=(bool(setup.bf16_rows) or float32_kv(setup)) and bf16_prefill)


def float32_kv(setup: EngineSetup) -> bool:
    """A bfloat16 model whose KV cache is float32 (the platform's `bf16_kv_float32`): on a CPU,
    attending in cpu_attention.c, whose kernels are float32's."""
    return (setup.device.type == "cpu" and setup.dtype == torch.bfloat16 and not setup.config.batch_invariant
            and attention_backend(setup) == "cpu" and bool(platform.current().rule("bf16_kv_float32")))


def make_kv_cache(setup: EngineSetup, parts: Parts):
    if float32_kv(setup):   # K and V are bfloat16 values: float32 holds each exactly
        return PHASE3.kv_cache(dataclasses.replace(setup, dtype=torch.float32), parts)
    return PHASE3.kv_cache(setup, parts)


RECIPE = PHASE3.extend(phase=4, engine_args={"attention_backend"}, checks=(check_backend,),
                       model=make_model, kv_cache=make_kv_cache, attention=make_attention)
