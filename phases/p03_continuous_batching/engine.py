"""Phase 3 engine: continuous batching.

Phase 2 ran requests in static batches: a batch started together and the next one waited until
its *last* request ended, while finished requests' seats stood empty. Here the batch is remade at
every step (iteration-level scheduling): a request joins the step after it arrives and leaves the
step it ends. The `Scheduler` decides each step's batch; the model runs it as one flat batch of
prefill chunks and decodes, through phase 2's model runner and paged attention.

Also new: preemption when the cache runs out, chunked prefill, prefix caching, the streaming
API (`add_request`, `step`, `abort_request`, `has_unfinished_requests`), and the batch-invariant
mode (`batch_invariant=True`, `batch_invariant.py`): a request's tokens then do not depend on
its batch or on preemption.
"""

from __future__ import annotations

import torch

from phases.p02_paged_kv import AttentionMetadata, BlockAllocator, PagedAttention
from phases.p02_paged_kv import Engine as Phase2Engine
from tinyvllm.errors import StepError
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.sequence import SequenceGroup

from .batch_invariant import BatchInvariantAttention, check_batch_invariant, make_batch_invariant
from .prefix_cache import PrefixCachingBlockAllocator
from .scheduler import Scheduler

# vLLM's default step budget is 2048 tokens on a GPU; on a CPU a smaller chunk keeps decodes
# flowing while a long prompt is prefilled, and is still large enough for efficient matmuls.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}


class Engine(Phase2Engine):
    """The phase 3 engine: a scheduler that remakes the batch every step."""

    phase = 3
    ENGINE_ARGS = Phase2Engine.ENGINE_ARGS | {"max_num_batched_tokens", "enable_chunked_prefill",
                                             "enable_prefix_caching", "batch_invariant"}

    def __init__(self, model=None, **engine_args):
        super().__init__(model, **engine_args)
        c = self.config
        if c.batch_invariant:  # every product and the attention in one fixed order per output
            check_batch_invariant(self.device, self.dtype, self.model_config.head_dim)
            make_batch_invariant(self.model)
        budget = c.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS.get(self.device.type, 2048)
        if not c.enable_chunked_prefill:
            # without chunks, a whole sequence (prompt + output, on a recompute) must fit one step
            if c.max_num_batched_tokens is not None and c.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({c.max_num_batched_tokens}) must be >= max_model_len "
                    f"({self.max_model_len}) when enable_chunked_prefill is False")
            budget = max(budget, self.max_model_len)
        self.max_num_batched_tokens = budget
        self.scheduler = self.make_scheduler()

    def make_scheduler(self) -> Scheduler:
        """The part that decides each step's batch (a later phase's schedules more per sequence)."""
        c = self.config
        return Scheduler(self.allocator, c.max_num_seqs, self.max_num_batched_tokens, c.enable_chunked_prefill)

    def make_attention(self, meta: AttentionMetadata) -> PagedAttention:
        if self.config.batch_invariant:
            return BatchInvariantAttention(self.kv_cache, meta)
        return super().make_attention(meta)

    def make_allocator(self, num_blocks: int) -> BlockAllocator:
        if self.config.enable_prefix_caching:
            return PrefixCachingBlockAllocator(num_blocks, self.block_size)
        return BlockAllocator(num_blocks, self.block_size)

    # -- requests in and out -------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: the prompt ({num_prompt_tokens} tokens) plus max_tokens "
                f"({params.max_tokens}) is more than max_model_len ({self.max_model_len})")
        super().check_fits(num_prompt_tokens, params)  # and within the whole pool of blocks

    def add_group(self, group: SequenceGroup) -> None:
        self.groups[group.request_id] = group
        for seq in group.seqs:
            self.scheduler.add(seq)

    def release(self, seq) -> None:
        """An aborted sequence (`abort_request`) leaves the scheduler and frees its blocks at once."""
        self.scheduler.finish(seq)

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run the flat batch, sample where a sequence's last token was computed.

        If running the batch fails, its requests are aborted (their blocks freed) and a
        `StepError` names them; the engine stays consistent and the others go on."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        self.update_stats()
        try:
            logits, sampled = self.run_model(out.scheduled)
            self.append_tokens(sampled, logits)
        except Exception as e:
            failed = list(dict.fromkeys(seq.group.request_id for seq, _ in out.scheduled))
            self.abort_request(failed)
            raise StepError(failed, e) from e
        if self.config.enable_prefix_caching:
            for seq, _ in out.scheduled:
                self.allocator.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_computed_tokens)
        for seq in sampled:
            if seq.is_finished:
                self.scheduler.finish(seq)
        return self.collect_outputs([s.group for s in sampled])

    # -- what a server shows -------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The engine's state as plain data: every running and waiting sequence with its KV
        blocks (those shared through the prefix cache apart), the pool, and the counters. A
        server's live page and metrics read this, never the parts themselves."""
        sched, alloc = self.scheduler, self.allocator
        ref_counts = alloc.ref_counts

        def describe(seq) -> dict:
            blocks = list(seq.block_table.block_ids) if seq.block_table is not None else []
            return {"request_id": seq.group.request_id, "index": seq.index,
                    "num_prompt_tokens": len(seq.group.prompt_token_ids),
                    "num_output_tokens": seq.num_output_tokens, "blocks": blocks,
                    "shared_blocks": [b for b in blocks if ref_counts[b] > 1]}

        stats = self.get_stats()
        return {
            "phase": self.phase,
            "running": [describe(s) for s in list(sched.running)],
            "waiting": [describe(s) for s in list(sched.waiting)],
            "num_running": len(sched.running), "num_waiting": len(sched.waiting),
            "num_blocks": alloc.num_blocks, "num_free_blocks": alloc.num_free_blocks,
            "block_size": alloc.block_size,
            "kv_cache_usage_perc": 1.0 - alloc.num_free_blocks / max(alloc.num_blocks, 1),
            "num_preemptions": int(stats.get("num_preemptions", 0)),
            "prefix_cache_queries": int(stats.get("prefix_cache_queries", 0)),
            "prefix_cache_hits": int(stats.get("prefix_cache_hits", 0)),
        }

    # -- numbers for the bench -----------------------------------------------------------------
    def running_sequences(self):
        return self.scheduler.running

    def reset_stats(self) -> None:
        super().reset_stats()
        self.scheduler.num_preemptions = 0
        if isinstance(self.allocator, PrefixCachingBlockAllocator):
            self.allocator.num_queries = self.allocator.num_hits = 0

    def get_stats(self) -> dict[str, float]:
        stats = super().get_stats()
        stats["num_preemptions"] = self.scheduler.num_preemptions
        if isinstance(self.allocator, PrefixCachingBlockAllocator):
            stats["prefix_cache_queries"] = self.allocator.num_queries
            stats["prefix_cache_hits"] = self.allocator.num_hits
        return stats
