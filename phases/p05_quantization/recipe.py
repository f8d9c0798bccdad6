"""Phase 5's recipe: phase 4's, with quantized weights (`quantization`) and a quantized KV cache
(`kv_cache_dtype`).

    model       after the float checkpoint is loaded, every linear layer and the LM head become a
                `QuantizedLinear` (int8 per output channel, or int4 per group of
                `quantization_group_size` input columns, the LM head then int8); the float weights
                are dropped. With tied embeddings the lookup keeps its float table (it reads one
                row per token). Without `quantization`, each float32 layer whose weight lies
                exactly on 4- or 8-bit codes (a checkpoint stored in Q4_1 or Q8_0, as the default
                model) becomes a `LosslessLinear`: the same weight, read from its codes in a
                decode step (lossless.py).
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
from phases.p04_triton_kernels.cpu_linear import use_bfloat16_products

from .kv_quant import QuantizedKVCache, QuantizedPagedAttention, quantized_bytes_per_block
from .lossless import keep_lossless
from .quant import INT4_GROUP_SIZES, QuantizedLinear, check_group_size


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every nn.Linear of the model (its projections and the LM head), by name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def default_group_size(model: nn.Module) -> int:
    """int4's group when none is asked for: 128 (GPTQ's and torchao's default) where it divides
    every linear layer's input size, otherwise 32, the most accurate offered (llama.cpp's Q4
    group). The default model's 576 = 4.5 x 128 gets 32: on it groups of 64 lose 32% of
    perplexity and groups of 32 0.08% (the lab note's accuracy table), for 0.125 bytes more
    per weight."""
    sizes = {m.in_features for _, m in linear_layers(model)}
    for g in (128, 32):
        if all(i % g == 0 for i in sizes):
            return g
    raise ValueError(f"quantization='int4': no quantization_group_size of {list(INT4_GROUP_SIZES)} divides "
                     f"every layer's input size {sorted(sizes)}")


# The LM head's format where it is not the layers': 8 bits under int4, as llama.cpp's Q4 files
# keep their output matrix in Q8_0 (GPTQ and AWQ keep it in float). On the default model, whose
# projections int4 g32 reproduces exactly, a 4-bit head costs +5.4% perplexity on the shipped
# text and an 8-bit one +0.08%, for about 0.6 ms more a decode step (lab note 5).
HEAD_METHOD = {"int4": "int8"}


def quantize_model(model: nn.Module, method: str, group_size: int | None = None) -> nn.Module:
    """Replace every linear layer of `model` by a `QuantizedLinear`, in place (the LM head in
    `HEAD_METHOD`'s format); the float weights are dropped. Every layer is checked before any is
    changed, so a model that cannot be quantized is left as it was. group_size None (int4):
    `default_group_size(model)`."""
    layers = [(name, m, HEAD_METHOD.get(method, method) if name == "lm_head" else method)
              for name, m in linear_layers(model)]
    if not layers:
        raise ValueError(f"quantization={method!r}: the model has no linear layers to quantize")
    if method == "int4" and group_size is None:
        group_size = default_group_size(model)
    for name, m, layer_method in layers:
        if not m.weight.is_floating_point():
            raise ValueError(f"quantization={method!r}: layer {name} has a {m.weight.dtype} weight, not a float one")
        if layer_method == "int4":
            check_group_size(m.in_features, group_size, name)
    for name, m, layer_method in layers:
        model.set_submodule(name, QuantizedLinear(m.weight, m.bias, layer_method, group_size or 128))
    return model


# kernels whose result for a row of x does not depend on the other rows: integer sums, each row
# rounded with its own scale (cpu_int8.c, cpu_vnni.c); the others round x with one scale a call
# (fbgemm) or go through a library's float product (the reference, PyTorch's int4 and int8 kernels)
BATCH_INVARIANT_KERNELS = ("cpu_int8", "cpu_int4", "cpu_int8_vnni")


def make_batch_invariant_quantized(model: nn.Module, kv_cache_dtype: str) -> None:
    """Raise ValueError naming `batch_invariant` where this phase's parts would break it; pin
    every layer to the integer kernel it runs at one row."""
    if kv_cache_dtype != "auto":
        raise ValueError(f"batch_invariant=True attends over a float KV cache; kv_cache_dtype="
                         f"{kv_cache_dtype!r} is not supported with it (use 'auto')")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for m in layers:  # one kernel at every row count: no `dequant_sgemm` for a prefill
        m.kernel = m.choose_kernel(1)
    if not {m.kernel for m in layers} <= set(BATCH_INVARIANT_KERNELS):
        raise ValueError(f"batch_invariant=True with quantization needs tinyvllm's own CPU kernels "
                         f"{list(BATCH_INVARIANT_KERNELS)} (an x86 CPU with AVX2 and a C compiler); this "
                         f"engine's layers would run {sorted({m.kernel for m in layers})}")


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
    else:   # float32 weights stored exactly as codes (the default model's) are read from them
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
    return QuantizedKVCache(setup.model_config, blocks, c.block_size, setup.dtype, setup.device, c.kv_cache_dtype)


def make_attention(setup: EngineSetup, parts: Parts):
    if not isinstance(parts.kv_cache, QuantizedKVCache):
        return PHASE4.attention(setup, parts)
    backend = attention_backend(setup)
    if backend == "triton":
        from .triton_kv_quant import TritonQuantizedPagedAttention  # imports Triton

        return partial(TritonQuantizedPagedAttention, parts.kv_cache)
    return partial(QuantizedPagedAttention, parts.kv_cache,
                   attend=cpu_paged_attention if backend == "cpu" else None)


RECIPE = PHASE4.extend(
    phase=5, engine_args={"quantization", "quantization_group_size", "kv_cache_dtype"}, checks=(check_fp8,),
    model=make_model, kv_cache=make_kv_cache, attention=make_attention,
)
