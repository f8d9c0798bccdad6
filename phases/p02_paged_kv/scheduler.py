"""Phase 2's scheduler: static batches over the paged KV cache.

As many waiting sequences as fit are admitted together, their prompts are prefilled in one
step, then every step advances all of them by one token. The next batch starts only when the
last sequence of this one has finished, while the seats of those that finished early stay empty.

A sequence is admitted only when the blocks for its worst case (prompt + max_tokens) are free,
so a running batch never runs out of cache; a request whose worst case exceeds the whole pool
can never run, and is refused when it is added (`check_fits`).
"""

from __future__ import annotations

from collections import deque

from phases.p01_naive_attention import mark_scheduled
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.sequence import Sequence
from tinyvllm.step import SamplerOutput, SchedulerOutput, append_sampled

from .block_allocator import BlockAllocator, BlockTable, cdiv


def max_len(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> int:
    """The most tokens a sequence can hold: prompt + max_tokens, within max_model_len."""
    if params.max_tokens is None:
        return max_model_len
    return min(num_prompt_tokens + params.max_tokens, max_model_len)


def check_fits_pool(allocator: BlockAllocator, num_prompt_tokens: int, params: SamplingParams,
                    max_model_len: int) -> None:
    """Raise ValueError when a request's worst case needs more blocks than the whole pool has."""
    need = cdiv(max_len(num_prompt_tokens, params, max_model_len), allocator.block_size)
    if need > allocator.num_blocks:
        raise ValueError(
            f"max_tokens: the prompt ({num_prompt_tokens} tokens) plus max_tokens needs {need} KV "
            f"blocks of {allocator.block_size} tokens, but the whole cache has {allocator.num_blocks}; "
            f"lower max_tokens or give the cache more blocks (num_kv_blocks, kv_cache_memory)")


class KVUsage:
    """The pool's use at its peak, for the bench: blocks held, the slots they reserve, the tokens
    actually stored, and what a contiguous max_model_len cache per sequence would reserve."""

    def __init__(self, allocator: BlockAllocator, max_model_len: int):
        self.allocator, self.max_model_len = allocator, max_model_len
        self.reset_stats()

    def reset_stats(self) -> None:
        self.peak = dict(num_kv_blocks=self.allocator.num_blocks, block_size=self.allocator.block_size,
                         peak_kv_blocks_used=0, peak_kv_tokens_reserved=0, peak_kv_tokens_used=0,
                         contiguous_kv_tokens_reserved=0)

    def record(self, running: list[Sequence]) -> None:
        """Called once a step's blocks are allocated; a new peak is measured in full."""
        used = self.allocator.num_used_blocks
        if used > self.peak["peak_kv_blocks_used"]:
            bs = self.allocator.block_size
            filled: dict[int, int] = {}  # tokens stored in each block; a shared block counts once
            for t in (s.block_table for s in running):
                for i, block in enumerate(t.block_ids):
                    filled[block] = max(filled.get(block, 0), min(bs, t.num_tokens - i * bs))
            self.peak.update(peak_kv_blocks_used=used, peak_kv_tokens_reserved=used * bs,
                             peak_kv_tokens_used=sum(filled.values()),
                             contiguous_kv_tokens_reserved=len(running) * self.max_model_len)

    def stats(self) -> dict[str, float]:
        return dict(self.peak)


class StaticBatchScheduler:
    """Static batches: admit what fits, prefill it, decode it until the last one ends."""

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_model_len: int):
        self.allocator, self.max_num_seqs, self.max_model_len = allocator, max_num_seqs, max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # the current static batch
        self.kv_usage = KVUsage(allocator, max_model_len)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        check_fits_pool(self.allocator, num_prompt_tokens, params, self.max_model_len)

    def schedule(self) -> SchedulerOutput:
        """Prefill a new batch, or advance every running sequence by one token."""
        if not self.running:
            self._admit_batch()
            for seq in self.running:  # prefill: every prompt token of every sequence
                mark_scheduled(seq)
                self.allocator.allocate(seq.block_table, seq.num_tokens)
            plan = SchedulerOutput([(seq, seq.num_tokens) for seq in self.running])
        else:
            for seq in self.running:  # decode: the one token sampled last step
                self.allocator.append_slot(seq.block_table)
            plan = SchedulerOutput([(seq, 1) for seq in self.running])
        self.kv_usage.record(self.running)
        return plan

    def _admit_batch(self) -> None:
        """Start the next static batch: queued sequences, in order, while their worst case fits."""
        reserved = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            worst = cdiv(max_len(seq.num_prompt_tokens, seq.params, self.max_model_len), self.allocator.block_size)
            if reserved + worst > self.allocator.num_free_blocks:
                break
            reserved += worst
            self.waiting.popleft()
            seq.block_table = BlockTable()
            self.running.append(seq)

    def update(self, plan: SchedulerOutput, sampled: SamplerOutput) -> None:
        """The step's tokens are in the cache; append the sampled ones; the finished leave."""
        for seq, n in plan.scheduled:
            seq.num_computed_tokens += n
        for seq in append_sampled(sampled):   # the sequences that finished
            self.finish(seq)

    def finish(self, seq: Sequence) -> None:
        """A finished (or aborted) sequence leaves the queue, or the batch with its blocks."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.allocator.free(seq.block_table)

    def stats(self) -> dict[str, float]:
        return self.kv_usage.stats()

    def reset_stats(self) -> None:
        self.kv_usage.reset_stats()
