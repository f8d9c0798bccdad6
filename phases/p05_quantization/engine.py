"""Phase 5 engine: int8 and int4 weights (`quantization`), a quantized KV cache (`kv_cache_dtype`).

What changes from phase 4:
- After the float checkpoint is loaded, every linear layer and the LM head are replaced by a
  `QuantizedLinear` (int8 per output channel, or int4 per group of `quantization_group_size`
  input columns). The float weights are dropped; with tied embeddings the embedding lookup keeps
  its float table (a lookup reads one row per token, not the whole matrix).
- With `kv_cache_dtype="int8"` or `"fp8"`, the KV pool stores one byte per value plus a scale per
  token and KV head, so the same `kv_cache_memory` holds ~3.8x the blocks, and the scheduler
  admits that many more sequences. Every attention backend reads it: the CPU path and phase 2's
  through `QuantizedPagedAttention`, phase 4's Triton kernels with a quantizing write and a
  dequantizing read passed into them (`triton_kv_quant.py`).

Nothing else changes: the scheduler, the sampler and the attention math are phase 4's.
"""

from __future__ import annotations

import torch
from torch import nn

from phases.p02_paged_kv.kv_cache import num_kv_blocks
from phases.p04_triton_kernels import Engine as Phase4Engine
from phases.p04_triton_kernels import cpu_paged_attention

from .kv_quant import QuantizedKVCache, QuantizedPagedAttention, quantized_bytes_per_block
from .quant import INT4_GROUP_SIZES, QuantizedLinear, check_group_size


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every nn.Linear of the model (its projections and the LM head), by name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def default_group_size(model: nn.Module) -> int:
    """int4's group when none is asked for: 128 (GPTQ's and torchao's default) where it divides
    every linear layer's input size, otherwise 32, the most accurate offered (llama.cpp's Q4
    group). The default model's 576 = 4.5 x 128 gets 32: on it groups of 64 lose 41% of
    perplexity and groups of 32 lose 5% (the lesson's accuracy table), for 0.125 bytes more
    per weight."""
    sizes = {m.in_features for _, m in linear_layers(model)}
    for g in (128, 32):
        if all(i % g == 0 for i in sizes):
            return g
    raise ValueError(f"quantization='int4': no quantization_group_size of {list(INT4_GROUP_SIZES)} divides "
                     f"every layer's input size {sorted(sizes)}")


def quantize_model(model: nn.Module, method: str, group_size: int | None = None) -> nn.Module:
    """Replace every linear layer of `model` by a `QuantizedLinear`, in place; the float weights
    are dropped. Every layer is checked before any is changed, so a model that cannot be
    quantized is left as it was. group_size None (int4): `default_group_size(model)`."""
    layers = linear_layers(model)
    if not layers:
        raise ValueError(f"quantization={method!r}: the model has no linear layers to quantize")
    if method == "int4" and group_size is None:
        group_size = default_group_size(model)
    for name, m in layers:
        if not m.weight.is_floating_point():
            raise ValueError(f"quantization={method!r}: layer {name} has a {m.weight.dtype} weight, not a float one")
        if method == "int4":
            check_group_size(m.in_features, group_size, name)
    for name, m in layers:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, QuantizedLinear(m.weight, m.bias, method, group_size or 128))
    return model


# kernels whose result for a row of x does not depend on the other rows: integer sums, each row
# rounded with its own scale (cpu_int8.c, cpu_vnni.c); the others round x with one scale a call
# (fbgemm) or go through a library's float product (the reference, PyTorch's int4 and int8 kernels)
BATCH_INVARIANT_KERNELS = ("cpu_int8", "cpu_int4", "cpu_int8_vnni")


def check_batch_invariant_quantized(model: nn.Module, kv_cache_dtype: str) -> None:
    """Raise ValueError naming `batch_invariant` where this phase's parts would break it."""
    if kv_cache_dtype != "auto":
        raise ValueError(f"batch_invariant=True attends over a float KV cache; kv_cache_dtype="
                         f"{kv_cache_dtype!r} is not supported with it (use 'auto')")
    kernels = {m.choose_kernel(1) for m in model.modules() if isinstance(m, QuantizedLinear)}
    if not kernels <= set(BATCH_INVARIANT_KERNELS):
        raise ValueError(f"batch_invariant=True with quantization needs tinyvllm's own CPU kernels "
                         f"{list(BATCH_INVARIANT_KERNELS)} (an x86 CPU with AVX2 and a C compiler); this "
                         f"engine's layers would run {sorted(kernels)}")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored (a tied tensor counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen and t.device.type != "meta":
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


class Engine(Phase4Engine):
    """The phase 5 engine: phase 4 with quantized weights and KV cache."""

    phase = 5
    ENGINE_ARGS = Phase4Engine.ENGINE_ARGS | {"quantization", "quantization_group_size", "kv_cache_dtype"}

    def __init__(self, model=None, **engine_args):
        super().__init__(model, **engine_args)
        if (self.attention_backend == "triton" and self.config.kv_cache_dtype.startswith("fp8")
                and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9)):
            raise ValueError(f"kv_cache_dtype={self.config.kv_cache_dtype!r}: the Triton kernels' float8 "
                             f"e4m3 needs a GPU of compute capability 8.9 or more (Ada, Hopper); use "
                             f"kv_cache_dtype='int8', or attention_backend='torch'")
        if self.config.quantization is not None:
            quantize_model(self.model, self.config.quantization, self.config.quantization_group_size)
        if self.config.batch_invariant:
            check_batch_invariant_quantized(self.model, self.config.kv_cache_dtype)

    def make_kv_cache(self):
        """Phase 2's pool, or with kv_cache_dtype int8/fp8 a quantized one: as many blocks of the
        smaller size as the same memory budget holds."""
        if self.config.kv_cache_dtype == "auto":
            return super().make_kv_cache()
        per_block = quantized_bytes_per_block(self.model_config, self.config.block_size)
        blocks = num_kv_blocks(self.config, self.model_config, self.max_model_len, self.dtype,
                               self.device, per_block)
        return QuantizedKVCache(self.model_config, blocks, self.config.block_size, self.dtype,
                                self.device, self.config.kv_cache_dtype)

    def make_attention(self, meta):
        if isinstance(self.kv_cache, QuantizedKVCache):
            if self.attention_backend == "triton":
                from .triton_kv_quant import TritonQuantizedPagedAttention  # imports Triton

                return TritonQuantizedPagedAttention(self.kv_cache, meta)
            attend = cpu_paged_attention if self.attention_backend == "cpu" else None
            return QuantizedPagedAttention(self.kv_cache, meta, attend)
        return super().make_attention(meta)

    def get_stats(self) -> dict[str, float]:
        return {**super().get_stats(), "weight_bytes": weight_bytes(self.model)}
