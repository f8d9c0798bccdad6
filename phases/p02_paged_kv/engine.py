"""Phase 2 engine: a paged KV cache, with static batching.

What changes from phase 1:
- The K and V of every token are computed once, written into the KV cache, and read back at
  every later step. A decode step runs the model on *one* new token per sequence instead of the
  whole sequence again.
- The cache is a pool of fixed-size blocks (`BlockAllocator`); each sequence owns a block table.
- Requests run in *static batches*: as many as fit are admitted together, their prompts are
  prefilled in one forward pass, then every decode step advances all of them by one token. The
  next batch starts only when the last request of this one has finished.

A request is admitted only when the blocks for its worst case (prompt + max_tokens) are free, so
a running batch never runs out of cache. A request whose worst case exceeds the whole pool can
never run, and is rejected when it is added.
"""

from __future__ import annotations

import functools
import time

import torch

from phases.p01_naive_attention import Engine as Phase1Engine
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.sequence import Sequence

from .block_allocator import BlockAllocator, BlockTable, cdiv
from .kv_cache import KVCache, num_kv_blocks
from .model_runner import ModelRunner
from .paged_attention import AttentionMetadata, PagedAttention


class Engine(Phase1Engine):
    """The phase 2 engine: KV cache in blocks, static batches."""

    phase = 2
    ENGINE_ARGS = Phase1Engine.ENGINE_ARGS | {"block_size", "num_kv_blocks", "kv_cache_memory",
                                             "gpu_memory_utilization", "max_num_seqs"}

    def __init__(self, model=None, **engine_args):
        super().__init__(model, **engine_args)
        self.block_size = self.config.block_size
        self.kv_cache = self.make_kv_cache()
        self.allocator = self.make_allocator(self.kv_cache.num_blocks)
        self.running: list[Sequence] = []  # the current static batch
        self._stats = self._zero_stats()

    def make_kv_cache(self) -> KVCache:
        """The KV pool, as many blocks as the memory budget holds (a later phase stores it in
        fewer bytes)."""
        blocks = num_kv_blocks(self.config, self.model_config, self.max_model_len, self.dtype, self.device)
        return KVCache(self.model_config, blocks, self.block_size, self.dtype, self.device)

    def make_allocator(self, num_blocks: int) -> BlockAllocator:
        return BlockAllocator(num_blocks, self.block_size)

    def make_attention(self, meta: AttentionMetadata) -> PagedAttention:
        """The attention backend of one step (later phases plug in their own)."""
        return PagedAttention(self.kv_cache, meta)

    def release(self, seq: Sequence) -> None:
        """An aborted sequence leaves the queue, or the running batch with its blocks."""
        super().release(seq)
        if seq in self.running:
            self.running.remove(seq)
            self.allocator.free(seq.block_table)

    # -- admission -----------------------------------------------------------------------------
    def max_len(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The most tokens a sequence can hold: prompt + max_tokens, within max_model_len."""
        if params.max_tokens is None:
            return self.max_model_len
        return min(num_prompt_tokens + params.max_tokens, self.max_model_len)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        need = cdiv(self.max_len(num_prompt_tokens, params), self.block_size)
        if need > self.allocator.num_blocks:
            raise ValueError(
                f"max_tokens: the prompt ({num_prompt_tokens} tokens) plus max_tokens needs {need} KV "
                f"blocks of {self.block_size} tokens, but the whole cache has {self.allocator.num_blocks}; "
                f"lower max_tokens or give the cache more blocks (num_kv_blocks, kv_cache_memory)")

    def _admit_batch(self) -> None:
        """Start the next static batch: queued sequences, in order, while their worst case fits."""
        reserved = 0
        while self.queue and len(self.running) < self.config.max_num_seqs:
            seq = self.queue[0]
            worst = cdiv(self.max_len(seq.num_prompt_tokens, seq.params), self.block_size)
            if reserved + worst > self.allocator.num_free_blocks:
                break
            reserved += worst
            self.queue.popleft()
            seq.block_table = BlockTable()
            self.running.append(seq)

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Prefill a new batch, or advance every running sequence by one token."""
        if not self.running:
            self._admit_batch()
            if not self.running:
                return []
            now = time.perf_counter()
            batch = []
            for seq in self.running:  # prefill: every prompt token of every sequence
                seq.group.metrics.first_scheduled_time = seq.group.metrics.first_scheduled_time or now
                self.allocator.allocate(seq.block_table, seq.num_tokens)
                batch.append((seq, seq.num_tokens))
        else:
            batch = []
            for seq in self.running:  # decode: the one token sampled last step
                self.allocator.append_slot(seq.block_table)
                batch.append((seq, 1))
        self.update_stats()
        logits, sampled = self.run_model(batch)
        self.append_tokens(sampled, logits)
        for seq in sampled:
            if seq.is_finished:
                self.allocator.free(seq.block_table)
        self.running = [s for s in self.running if not s.is_finished]
        return self.collect_outputs([s.group for s in sampled])

    # -- the model on a flat batch -------------------------------------------------------------
    @functools.cached_property
    def model_runner(self) -> ModelRunner:
        """Made at the first step, once every phase's constructor has set up what it needs."""
        return self.make_model_runner()

    def make_model_runner(self) -> ModelRunner:
        """The part that turns a batch of sequences into the model's inputs and runs it."""
        return ModelRunner(self.model, self.sampler, self.block_size, self.make_attention, self.device)

    def run_model(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """The model runner on `num_new` tokens of each sequence: the logits of the sequences whose
        last token was computed, (S, V), and those sequences."""
        return self.model_runner.run(batch)

    # -- numbers for the bench -----------------------------------------------------------------
    def reset_stats(self) -> None:
        self._stats = self._zero_stats()

    def _zero_stats(self) -> dict:
        return dict(num_kv_blocks=self.allocator.num_blocks, block_size=self.block_size,
                    peak_kv_blocks_used=0, peak_kv_tokens_reserved=0, peak_kv_tokens_used=0,
                    contiguous_kv_tokens_reserved=0)

    def update_stats(self) -> None:
        """Record the cache's use at its peak: blocks held, the slots they reserve, the tokens
        actually stored, and what a contiguous max_model_len cache per sequence would reserve."""
        used = self.allocator.num_used_blocks
        if used > self._stats["peak_kv_blocks_used"]:
            tables = [s.block_table for s in self.running_sequences()]
            bs = self.block_size
            filled: dict[int, int] = {}  # tokens stored in each block; a shared block counts once
            for t in tables:
                for i, block in enumerate(t.block_ids):
                    filled[block] = max(filled.get(block, 0), min(bs, t.num_tokens - i * bs))
            self._stats.update(
                peak_kv_blocks_used=used, peak_kv_tokens_reserved=used * bs,
                peak_kv_tokens_used=sum(filled.values()),
                contiguous_kv_tokens_reserved=len(tables) * self.max_model_len)

    def running_sequences(self) -> list[Sequence]:
        return self.running

    def get_stats(self) -> dict[str, float]:
        return dict(self._stats)
