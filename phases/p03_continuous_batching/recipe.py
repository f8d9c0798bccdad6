"""Phase 3's recipe: phase 2's, with a scheduler that remakes the batch every step.

    scheduler   `Scheduler`: continuous batching (a request joins the step after it arrives and
                leaves the step it ends), preemption, chunked prefill, prefix caching
    allocator   `PrefixCachingBlockAllocator` with `enable_prefix_caching` (the default): full
                blocks found again by their content and shared; else phase 2's
    model, attention    with `batch_invariant=True`, every product and the attention in one
                fixed order per output (`batch_invariant.py`); else phase 2's

The runner, the KV cache and the sampler are phase 2's (and phase 1's): the flat batch of
prefill chunks and decodes is what phase 2's runner already runs.
"""

from __future__ import annotations

from functools import partial

from phases.p01_naive_attention import EngineSetup, Parts
from phases.p02_paged_kv import RECIPE as PHASE2
from phases.p02_paged_kv import BlockAllocator
from tinyvllm.hardware import cpu_kind

from .batch_invariant import BatchInvariantAttention, check_batch_invariant, make_batch_invariant
from .prefix_cache import PrefixCachingBlockAllocator
from .scheduler import Scheduler

# 2048 tokens a step on a GPU (vLLM's LLM takes 8192 or more there, EngineArgs' batch defaults);
# on a CPU a smaller chunk keeps decodes flowing while a long prompt is prefilled, and is still
# large enough for efficient matmuls.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}
# A CPU engine whose prompts multiply in bfloat16 (dtype="auto": `setup.bf16_rows`), per CPU kind:
# on the amx kind oneDNN's AMX products and phase 7's bfloat16 MLP run faster on larger chunks. A
# 2,000-token prompt's first token on a 2-core Xeon VM: 1.33-1.38 s in chunks of 512, 1.26-1.28
# in 1,024, 1.15-1.21 in 2,048; 48 chat prompts offline 500-588 tok/s either way, the VM's noise
# (medians of 5, two rounds; lab note 7). vLLM takes 4096 on a CPU.
BF16_MAX_NUM_BATCHED_TOKENS = {"amx": 2048}


def max_num_batched_tokens(setup: EngineSetup) -> int:
    """The step's token budget: `max_num_batched_tokens`, or the default of the device (of the
    CPU kind, with bfloat16 products); without chunked prefill at least max_model_len (a whole
    sequence, prompt and output on a recompute, must fit one step)."""
    c = setup.config
    default = BF16_MAX_NUM_BATCHED_TOKENS.get(cpu_kind()) if setup.bf16_rows and setup.device.type == "cpu" else None
    budget = c.max_num_batched_tokens or default or DEFAULT_MAX_NUM_BATCHED_TOKENS.get(setup.device.type, 2048)
    return budget if c.enable_chunked_prefill else max(budget, setup.max_model_len)


def check_budget(setup: EngineSetup) -> None:
    c = setup.config
    if not c.enable_chunked_prefill and c.max_num_batched_tokens is not None \
            and c.max_num_batched_tokens < setup.max_model_len:
        raise ValueError(f"max_num_batched_tokens ({c.max_num_batched_tokens}) must be >= max_model_len "
                         f"({setup.max_model_len}) when enable_chunked_prefill is False")


def check_invariance(setup: EngineSetup) -> None:
    if setup.config.batch_invariant:
        check_batch_invariant(setup.device, setup.dtype, setup.model_config.head_dim)


def make_model(setup: EngineSetup, parts: Parts):
    model = PHASE2.model(setup, parts)
    if setup.config.batch_invariant:
        make_batch_invariant(model)
    return model


def make_allocator(setup: EngineSetup, parts: Parts) -> BlockAllocator:
    if setup.config.enable_prefix_caching:
        return PrefixCachingBlockAllocator(parts.kv_cache.num_blocks, setup.config.block_size)
    return PHASE2.allocator(setup, parts)


def make_attention(setup: EngineSetup, parts: Parts):
    if setup.config.batch_invariant:
        return partial(BatchInvariantAttention, parts.kv_cache)
    return PHASE2.attention(setup, parts)


def make_scheduler(setup: EngineSetup, parts: Parts) -> Scheduler:
    c = setup.config
    return Scheduler(parts.allocator, c.max_num_seqs, max_num_batched_tokens(setup), c.enable_chunked_prefill,
                     setup.max_model_len)


RECIPE = PHASE2.extend(
    phase=3,
    engine_args={"max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching", "batch_invariant"},
    checks=(check_budget, check_invariance),
    model=make_model, allocator=make_allocator, attention=make_attention, scheduler=make_scheduler,
)
