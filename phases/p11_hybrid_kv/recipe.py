"""Phase 11's recipe: phase 10's, with a KV cache whose layers may need different blocks.

For a model with a sliding window shorter than max_model_len (Gemma 3, windowed Mistral and
Qwen2), the parts that hold and hand out blocks are new; for any other model every part is
phase 10's.

    kv_cache    `HybridKVCache`: one pool of blocks shared by the groups of layers
                (kv_cache_interface.py: a spec per layer, layers of one spec grouped)
    allocator   `HybridKVCacheManager`: per sequence one block table per group; a windowed
                group gives back the blocks its window left behind; a prefix hit every group serves
    attention   `HybridAttention`: each layer through its group's tables, in its window (on a
                CPU a step of decodes in phase 4's C kernel, which reads each row's window);
                with kv_cache_dtype int8/fp8, `HybridQuantizedKVCache` and `GroupAttention`:
                phase 5's 8-bit pool and attention, per group; with batch_invariant, phase 3's
    runner      `HybridModelRunner`: phase 2's inputs, with every group's tables and slots
                (`HybridSpecModelRunner` with `speculative_config`: phase 6's, drafts scored too);
                a step of decodes only as phase 7's (`DecodeStep`: one call of cpu_step.c, each
                layer through its group's tables, or phase 7's `decode_forward`)
    scheduler   `HybridScheduler`: phase 3's rules, asking the manager what a sequence's groups take
                (`HybridSpecScheduler`: phase 6's, rejected drafts rolled back in every group;
                with async_scheduling, phase 9's around it: `HybridAsyncScheduler`)
    model       phase 6's, its products fused as phase 7's (unless enforce_eager, and for Llama's
                layers: Gemma 3 runs its own forward); not compiled, and no persistent batch:
                phase 7's static path keeps one block table per sequence

With several ranks, each rank's pool holds its KV heads and phase 8's executor runs the driver's
runner, each forward sent to the workers with every group's tables (the model's own forward: the
decode step in one C call runs on one rank). Refused by name for such a model: a KV connector
(phase 10's parts hold one table per sequence).
"""

from __future__ import annotations

from functools import partial

from phases.p01_naive_attention import EngineSetup, Parts
from phases.p02_paged_kv.kv_cache import num_kv_blocks
from phases.p03_continuous_batching.batch_invariant import BatchInvariantAttention
from phases.p03_continuous_batching.recipe import max_num_batched_tokens
from phases.p04_triton_kernels.cpu_layers import use_bfloat16_products
from phases.p04_triton_kernels.recipe import attention_backend
from phases.p05_quantization.kv_quant import QuantizedPagedAttention
from phases.p06_speculative_decoding import RECIPE as PHASE6
from phases.p06_speculative_decoding.recipe import spec_config
from phases.p07_cuda_graphs.fused import fuse_projections, fused_model
from phases.p08_tensor_parallel.recipe import rank_setup, run_on_ranks
from phases.p10_kv_tiers import RECIPE as PHASE10
from tinyvllm import platform

from .decode_step import DecodeStep
from .hybrid_attention import GroupAttention, HybridAttention, HybridKVCache, HybridQuantizedKVCache, bytes_per_block
from .kv_cache_interface import group_layers, layer_specs
from .kv_cache_manager import HybridKVCacheManager
from .scheduler import (HybridAsyncScheduler, HybridModelRunner, HybridScheduler, HybridSpecModelRunner,
                        HybridSpecScheduler)

PREVIOUS = PHASE10   # the phase this one extends


def is_hybrid(setup: EngineSetup) -> bool:
    """A layer of the model attends in a window shorter than max_model_len."""
    return any(setup.model_config.layer_windows(setup.max_model_len))


def groups(setup: EngineSetup):
    return group_layers(layer_specs(setup.model_config, setup.max_model_len, setup.config.block_size))


def check_hybrid(setup: EngineSetup) -> None:
    if not is_hybrid(setup):
        return
    c, w = setup.config, setup.model_config.sliding_window
    if c.nnodes > 1:
        raise ValueError(f"nnodes={c.nnodes}: phase 11 runs a model with a sliding window (sliding_window={w}, "
                         f"shorter than max_model_len={setup.max_model_len}) on several ranks of one host; the "
                         f"ranks of other hosts build phase 8's parts, which hold one block table per sequence. "
                         f"Pass nnodes=1, or max_model_len <= {w}")
    if c.kv_transfer_config is not None:
        raise ValueError(f"kv_transfer_config={c.kv_transfer_config!r}: phase 11 runs a model with a sliding "
                         f"window (sliding_window={w}, shorter than max_model_len={setup.max_model_len}) "
                         f"with a block table per group of layers, which a KV connector does not have yet; "
                         f"leave kv_transfer_config at None, or pass max_model_len <= {w}")


def fused_step(setup: EngineSetup) -> bool:
    """A hybrid model's decode steps run as phase 7's (`DecodeStep`): unless enforce_eager, for
    Llama's layers (not Gemma 3's)."""
    return not setup.config.enforce_eager and not setup.model_config.post_norms


def make_model(setup: EngineSetup, parts: Parts):
    if not is_hybrid(setup):
        return PREVIOUS.model(setup, parts)
    model = PHASE6.model(setup, parts)
    if fused_step(setup):   # phase 7's fused products (not compiled: phase 7's static path does not run it)
        fuse_projections(model)
        use_bfloat16_products(model, setup.bf16_rows)
    return model


def make_kv_cache(setup: EngineSetup, parts: Parts):
    if not is_hybrid(setup):
        return PREVIOUS.kv_cache(setup, parts)
    c, gs, windows = setup.config, groups(setup), setup.model_config.layer_windows(setup.max_model_len)
    model = rank_setup(setup, parts).model_config   # with several ranks, this rank's KV heads
    per_block = bytes_per_block(model, gs, c.block_size, setup.dtype, c.kv_cache_dtype)
    blocks = num_kv_blocks(c, model, setup.max_model_len, setup.dtype, setup.device, per_block)
    if c.kv_cache_dtype != "auto":   # phase 5's 8-bit pool, shared by the groups as the float one
        cache = HybridQuantizedKVCache(model, gs, blocks, c.block_size, setup.dtype, setup.device,
                                       c.kv_cache_dtype, windows)
    else:
        cache = HybridKVCache(model, gs, blocks, c.block_size, setup.dtype, setup.device, windows)
    cache.checked = setup.check_kernels
    return cache


def make_allocator(setup: EngineSetup, parts: Parts):
    if not is_hybrid(setup):
        return PREVIOUS.allocator(setup, parts)
    c = setup.config
    return HybridKVCacheManager(parts.kv_cache.num_blocks, c.block_size, groups(setup),
                                max_num_batched_tokens(setup), c.enable_prefix_caching)


def make_attention(setup: EngineSetup, parts: Parts):
    if not is_hybrid(setup):
        return PREVIOUS.attention(setup, parts)
    if isinstance(parts.kv_cache, HybridQuantizedKVCache):
        return partial(GroupAttention, parts.kv_cache, backend=QuantizedPagedAttention)
    if setup.config.batch_invariant:
        return partial(GroupAttention, parts.kv_cache, backend=BatchInvariantAttention)
    return partial(HybridAttention, parts.kv_cache, c_decode=attention_backend(setup) == "cpu")


def make_runner(setup: EngineSetup, parts: Parts):
    if not is_hybrid(setup):
        return PREVIOUS.runner(setup, parts)
    runner = HybridModelRunner if spec_config(setup) is None else HybridSpecModelRunner
    step = None
    if fused_step(setup) and fused_model(parts.model) and setup.config.tensor_parallel_size == 1:
        rules, on_cpu = platform.current(), setup.device.type == "cpu"
        step = DecodeStep(parts.model, c_norm=on_cpu and bool(rules.rule("c_norm_decode")),
                          c_step=on_cpu and bool(rules.rule("c_step")))
    runner = runner(parts.model, parts.attention, setup.config.block_size, setup.device, manager=parts.allocator,
                    decode_step=step)
    return run_on_ranks(setup, parts, runner, phase=11)   # several ranks: phase 8's executor, workers of phase 11


def make_scheduler(setup: EngineSetup, parts: Parts):
    if not is_hybrid(setup):
        return PREVIOUS.scheduler(setup, parts)
    c, spec = setup.config, spec_config(setup)
    args = (parts.allocator, c.max_num_seqs, max_num_batched_tokens(setup), c.enable_chunked_prefill, setup.max_model_len)
    inner = HybridScheduler(*args) if spec is None else HybridSpecScheduler(*args, proposer=parts.proposer, spec=spec)
    if not platform.async_scheduling_default(c.async_scheduling, setup.device.type):
        return inner
    return HybridAsyncScheduler(inner)   # phase 9's, each step ahead with every group's tables frozen


RECIPE = PREVIOUS.extend(
    phase=11, checks=(check_hybrid,), model=make_model, kv_cache=make_kv_cache, allocator=make_allocator,
    attention=make_attention, runner=make_runner, scheduler=make_scheduler,
)
