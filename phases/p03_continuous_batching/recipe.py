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
from tinyvllm import platform

from .batch_invariant import BatchInvariantAttention, check_batch_invariant, make_batch_invariant
from .prefix_cache import PrefixCachingBlockAllocator
from .scheduler import Scheduler


def max_num_batched_tokens(setup: EngineSetup) -> int:
    """The step's token budget: `max_num_batched_tokens`, or the platform's default (512 tokens a
    step on a CPU, where a smaller chunk keeps decodes flowing while a long prompt is prefilled and
    is still large enough for efficient products; 2048 on a GPU; more on a CPU kind whose
    dtype="auto" multiplies prompts in bfloat16); without chunked prefill at least max_model_len
    (a whole sequence, prompt and output on a recompute, must fit one step)."""
    c = setup.config
    default = platform.current().max_num_batched_tokens(setup.device.type, bool(setup.bf16_rows))
    budget = c.max_num_batched_tokens or default
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
