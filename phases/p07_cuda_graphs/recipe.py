"""Phase 7's recipe: phase 6's, with decode steps on a persistent batch and static buffers, run
as CUDA graphs on a GPU and by a compiled forward on a CPU.

    model       each layer's q/k/v and gate/up projections fused into one product each, float or
                phase 5's int8/int4 (`fuse_projections`: the same outputs bit for bit, fewer
                operator calls); where the step is compiled, phase 5's quantized layers
                wrapped so the compiler sees each as one operator (`make_opaque`)
    allocator   the phase before's, less the pool's last block: the scratch block that the
                padded rows of a bucket write to, which no sequence ever owns
    runner      `StaticModelRunner`: a decode-only step (every request computes just its newest
                token) runs on the persistent `InputBatch` and the `StaticDecodeBuffers` through
                a decode runner: one CUDA graph per bucket of `cudagraph_capture_sizes` on a GPU
                (`CudaGraphDecodeRunner`, the rows padded to the bucket), on a CPU the rows there
                are, by the same forward eagerly (`DecodeRunner`) or compiled by torch.compile
                (`CompiledDecodeRunner`: by default in the background while the engine serves
                eagerly, before the first request with `compilation_mode=1`, never with 0). Each
                attends through the attention part the recipe chose (phase 4's Triton kernels on
                a GPU). Every other step (prefill chunks, drafts, more requests than the
                largest bucket) runs on the phase before's runner.

The sampler is the one sampler: it takes the batch's parameters as tensors from the persistent
batch. `enforce_eager=True` leaves every part as phase 6 has it.
"""

from __future__ import annotations

from phases.p01_naive_attention import EngineSetup, Parts
from phases.p02_paged_kv.block_allocator import cdiv
from phases.p04_triton_kernels.cpu_layers import use_bfloat16_products
from phases.p05_quantization import QuantizedPagedAttention
from phases.p06_speculative_decoding import RECIPE as PHASE6
from tinyvllm import platform

from .compiled import CompiledDecodeRunner, make_opaque
from .decode_runner import CudaGraphDecodeRunner, DecodeRunner, StaticDecodeBuffers, default_capture_sizes
from .fused import fuse_projections
from .input_batch import InputBatch
from .model_runner import StaticModelRunner

# attention parts whose shapes depend on the data (the quantized torch path copies the blocks a
# step uses, found by torch.unique): they run on the static buffers eagerly, never captured
NOT_CAPTURABLE = (QuantizedPagedAttention,)


def capture_sizes(setup: EngineSetup) -> list[int]:
    c = setup.config
    return c.cudagraph_capture_sizes or default_capture_sizes(c.max_num_seqs)


def compile_when(setup: EngineSetup) -> str | None:
    """When this engine compiles its decode step: "start" (compilation_mode=1), "background" (the
    platform's default on a CPU), or None (eager: compilation_mode=0, a GPU, enforce_eager, several
    ranks). $TINYVLLM_COMPILATION_MODE (0 or 1), when set, stands for an unset compilation_mode."""
    c = setup.config
    if c.compilation_mode == 0 or c.enforce_eager or setup.device.type != "cpu" or c.tensor_parallel_size > 1:
        return None
    return "start" if c.compilation_mode == 1 else platform.compile_default(setup.device.type)


def compile_request(setup: EngineSetup, parts: Parts) -> dict:
    """What `compile_worker` builds to compile this engine's graphs: the same model, phase and
    arguments, compiled before its start, without what does not shape the graph (a draft model;
    a KV pool: just the blocks one sequence of max_model_len needs, plus the scratch block)."""
    args = {k: v for k, v in setup.engine_args.items() if k not in ("kv_cache_memory", "gpu_memory_utilization")}
    args.update(compilation_mode=1, speculative_config=None, max_model_len=setup.max_model_len,
                num_kv_blocks=cdiv(setup.max_model_len, setup.config.block_size) + 1)
    return {"model": str(setup.model_path), "phase": parts.phase, "engine_args": args}


def check_static(setup: EngineSetup) -> None:
    c = setup.config
    if c.enforce_eager:
        return
    if c.compilation_mode and setup.device.type != "cpu":
        raise ValueError("compilation_mode=1 compiles the decode step on a CPU; on a GPU phase 7 "
                         "captures CUDA graphs (leave compilation_mode at 0)")
    if c.num_kv_blocks is not None and c.num_kv_blocks < 2:
        raise ValueError(f"num_kv_blocks must be >= 2 when enforce_eager is False (one block is "
                         f"the scratch block of padded decode rows), got {c.num_kv_blocks}")


def make_model(setup: EngineSetup, parts: Parts):
    model = PHASE6.model(setup, parts)
    if not setup.config.enforce_eager:
        fuse_projections(model)
        use_bfloat16_products(model, setup.bf16_rows)   # the fused layers' too
        if compile_when(setup):
            make_opaque(model)
    return model


def make_allocator(setup: EngineSetup, parts: Parts):
    allocator = PHASE6.allocator(setup, parts)
    if not setup.config.enforce_eager:
        allocator.reserve_last_block()   # the scratch block: kv_cache.num_blocks - 1
    return allocator


def make_decode_runner(setup: EngineSetup, parts: Parts, buffers: StaticDecodeBuffers):
    """What runs a decode step on the static buffers: a CUDA graph per bucket on a GPU; on a CPU
    the same forward compiled by torch.compile (in the background by default, at start with
    `compilation_mode=1`) or eagerly (`compilation_mode=0`)."""
    attention = parts.attention
    if setup.device.type == "cuda" and getattr(attention, "func", None) not in NOT_CAPTURABLE:
        return CudaGraphDecodeRunner(parts.model, buffers, attention, parts.kv_cache)
    when = compile_when(setup)
    if when:
        return CompiledDecodeRunner(parts.model, buffers, attention, capture_sizes(setup),
                                    background=compile_request(setup, parts) if when == "background" else None)
    return DecodeRunner(parts.model, buffers, attention)


def make_runner(setup: EngineSetup, parts: Parts):
    inner = PHASE6.runner(setup, parts)
    if setup.config.enforce_eager:
        return inner
    # its static decode step (the fused forward, the compiled or C step) runs Llama's layers, each
    # in its sliding window where it has one (the attention part's, or the C kernel's in its row)
    setup.model_config.refuse_other_layers("phase 7's static decode step", "pass enforce_eager=True")
    c, sizes = setup.config, capture_sizes(setup)
    max_blocks = cdiv(setup.max_model_len, c.block_size)
    input_batch = InputBatch(c.max_num_seqs, setup.max_model_len, max_blocks, setup.model_config.vocab_size)
    buffers = StaticDecodeBuffers(sizes[-1], max_blocks, c.block_size, parts.kv_cache.num_blocks - 1, setup.device)
    return StaticModelRunner(inner, input_batch, buffers, make_decode_runner(setup, parts, buffers), sizes,
                             checked=setup.check_kernels)


RECIPE = PHASE6.extend(
    phase=7, engine_args={"enforce_eager", "cudagraph_capture_sizes", "compilation_mode"}, checks=(check_static,),
    model=make_model, allocator=make_allocator, runner=make_runner,
)
