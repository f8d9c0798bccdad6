"""A whole model's linear layers, quantized: which layers, in which format, in groups of what size.

    quantize_model(model, "int4")     every nn.Linear -> a `QuantizedLinear` (quant.py), in place:
                                      the projections in the method asked for, the LM head in
                                      `HEAD_METHOD`'s format, int4 in groups of
                                      `default_group_size` unless a size is given
    make_batch_invariant_quantized    pins each layer to a kernel whose rows do not depend on the
                                      batch (`batch_invariant=True`)

    keep_checkpoint_codes(model)      an AWQ/GPTQ checkpoint's layers -> `QuantizedLinear`s of its
                                      own 4-bit codes, exactly (no `quantization` asked)

Phase 5's model factory (recipe.py) calls them after the checkpoint is loaded. vLLM makes
each layer quantized as it builds the model, from the checkpoint's `quantization_config`
(`vllm/model_executor/layers/quantization/`); here a float model is quantized once it is loaded,
and a quantized checkpoint's codes, which the loader keeps beside its float weights, replace them.
"""

from __future__ import annotations

from torch import nn

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


def keep_checkpoint_codes(model: nn.Module) -> None:
    """Each layer an AWQ/GPTQ checkpoint stored as 4-bit codes (`model.checkpoint_codes`,
    tinyvllm/quantized_checkpoint.py: already this format's layout, w = code * scale + zero a
    group) becomes a `QuantizedLinear` of those very codes, its float weight dropped, where int4
    offers the group size; the others keep their float weight."""
    for name, c in getattr(model, "checkpoint_codes", {}).items():
        m, codes = model.get_submodule(name), [t.to(model.get_submodule(name).weight.device) for t in c[:3]]
        if c.group_size in INT4_GROUP_SIZES and (m.out_features, m.in_features // 2) == tuple(c.codes.shape):
            model.set_submodule(name, QuantizedLinear.from_quantized(*codes, m.bias, "int4", c.group_size,
                                                                     dtype=m.weight.dtype))
    model.checkpoint_codes = {}


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
