"""Phase 5's recipe: phase 4's, with quantized weights (`quantization`) and a quantized KV cache
(`kv_cache_dtype`).

    model       after the float checkpoint is loaded, every linear layer and the LM head become a
                `QuantizedLinear` (int8 per output channel, or int4 per group of
                `quantization_group_size` input columns, the LM head then int8: `quantize_model`
                in quantize_layers.py); the float weights are dropped. With tied embeddings the
                lookup keeps its float table (it reads one row per token). Without
                `quantization`, each float32 layer whose weight lies exactly on 4- or 8-bit codes
                (a checkpoint stored in Q4_1 or Q8_0, as the default model) becomes a
                `LosslessLinear`: the same weight, read from its codes in a decode step
                (lossless.py); an AWQ/GPTQ checkpoint's int4 layers become `QuantizedLinear`s
                of its own codes (`keep_checkpoint_codes`).
    kv_cache    with kv_cache_dtype "int8" or "fp8": `QuantizedKVCache`, one byte per value plus a
                scale per token and KV head, so the same `kv_cache_memory` holds ~3.8x the blocks
                (and the scheduler admits that many more sequences)
    attention   over a quantized cache, every backend reads it: the CPU path and phase 2's through
                `QuantizedPagedAttention`, phase 4's Triton kernels with a quantizing write and a
                dequantizing read passed into them (`TritonQuantizedPagedAttention`)

The scheduler, the runner and the sampler are phase 4's.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from phases.p01_naive_attention import EngineSetup, Parts
from phases.p02_paged_kv.kv_cache import num_kv_blocks
from phases.p04_triton_kernels import RECIPE as PHASE4
from phases.p04_triton_kernels import attention_backend, cpu_paged_attention
from phases.p04_triton_kernels.cpu_layers import use_bfloat16_products

from .kv_quant import QuantizedKVCache, QuantizedPagedAttention, quantized_bytes_per_block
from .lossless import keep_lossless
from .quantize_layers import keep_checkpoint_codes, make_batch_invariant_quantized, quantize_model


def check_fp8(setup: EngineSetup) -> None:
    c = setup.config
    if (c.kv_cache_dtype.startswith("fp8") and setup.device.type == "cuda" and attention_backend(setup) == "triton"
            and torch.cuda.get_device_capability(setup.device) < (8, 9)):
        raise ValueError(f"kv_cache_dtype={c.kv_cache_dtype!r}: the Triton kernels' float8 e4m3 needs a GPU "
                         f"of compute capability 8.9 or more (Ada, Hopper); use kv_cache_dtype='int8', "
                         f"or attention_backend='torch'")


def make_model(setup: EngineSetup, parts: Parts) -> nn.Module:
    model, c = PHASE4.model(setup, parts), setup.config
    if c.quantization is not None:
        quantize_model(model, c.quantization, c.quantization_group_size)
    else:   # an AWQ/GPTQ checkpoint's codes, and float32 weights stored exactly as codes (the
        keep_checkpoint_codes(model)   # default model's), are read from them
        keep_lossless(model)
    if c.batch_invariant:
        make_batch_invariant_quantized(model, c.kv_cache_dtype)
    use_bfloat16_products(model, setup.bf16_rows)   # the new layers' too
    return model


def make_kv_cache(setup: EngineSetup, parts: Parts):
    """Phase 2's pool, or with kv_cache_dtype int8/fp8 a quantized one: as many blocks of the
    smaller size as the same memory budget holds."""
    c = setup.config
    if c.kv_cache_dtype == "auto":
        return PHASE4.kv_cache(setup, parts)
    per_block = quantized_bytes_per_block(setup.model_config, c.block_size)
    blocks = num_kv_blocks(c, setup.model_config, setup.max_model_len, setup.dtype, setup.device, per_block)
    cache = QuantizedKVCache(setup.model_config, blocks, c.block_size, setup.dtype, setup.device, c.kv_cache_dtype)
    cache.checked = setup.check_kernels   # checked mode (phase 2's make_kv_cache)
    cache.windows = setup.model_config.layer_windows(setup.max_model_len)   # (phase 2's make_kv_cache)
    return cache


def make_attention(setup: EngineSetup, parts: Parts):
    if not isinstance(parts.kv_cache, QuantizedKVCache):
        return PHASE4.attention(setup, parts)
    backend = attention_backend(setup)
    if backend == "triton":   # each layer in its window (on the CPU path through phase 2's)
        from .triton_kv_quant import TritonQuantizedPagedAttention  # imports Triton

        return partial(TritonQuantizedPagedAttention, parts.kv_cache)
    return partial(QuantizedPagedAttention, parts.kv_cache,
                   attend=cpu_paged_attention if backend == "cpu" else None)


RECIPE = PHASE4.extend(
    phase=5, engine_args={"quantization", "quantization_group_size", "kv_cache_dtype"}, checks=(check_fp8,),
    model=make_model, kv_cache=make_kv_cache, attention=make_attention,
)
