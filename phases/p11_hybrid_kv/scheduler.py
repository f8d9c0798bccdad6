"""Phase 3's scheduler and phase 2's runner, asking the hybrid manager where they asked one table.

The scheduler's rules are phase 3's. Two of its questions change: can a running sequence grow
by n tokens (`can_grow`: the free blocks against what every group takes, less what its windows
give back), and can a request ever fit (`check_fits`: the most its groups hold at once, against
the pool). The runner builds phase 2's inputs, then each group's tables and slots beside them;
a step of decodes only it runs as phase 7 does (decode_step.py: cpu_step.c, every layer reading
its group's tables).
With `speculative_config`, phase 6's scheduler and runner do the same (`HybridSpecScheduler`,
`HybridSpecModelRunner`): a sequence's drafts are tokens every group grows by, and rejected
ones go back from every group's table. With `async_scheduling`, phase 9's scheduler wraps it
(`HybridAsyncScheduler`): a step planned ahead carries frozen copies of every group's tables.
"""

from __future__ import annotations

import torch

from phases.p02_paged_kv import ModelInputs, ModelRunner
from phases.p02_paged_kv.scheduler import max_len
from phases.p03_continuous_batching import Scheduler
from phases.p06_speculative_decoding import SpecModelRunner, SpecScheduler
from phases.p09_engine_core.async_scheduler import AsyncScheduler, Batch
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.sequence import Sequence
from tinyvllm.step import SchedulerOutput

from .decode_step import DecodeStep
from .hybrid_attention import group_metadata
from .kv_cache_manager import HybridKVCacheManager


class HybridScheduler(Scheduler):
    """Phase 3's `Scheduler` over a `HybridKVCacheManager`."""

    allocator: HybridKVCacheManager

    def can_grow(self, seq: Sequence, num_new: int) -> bool:
        return self.allocator.blocks_to_grow(seq.block_table, num_new) <= self.allocator.num_free_blocks

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        super().check_fits(num_prompt_tokens, params)
        need = self.allocator.blocks_needed(max_len(num_prompt_tokens, params, self.max_model_len))
        if need > self.allocator.num_blocks - 1:    # the null block is no one's
            raise ValueError(
                f"max_tokens: the prompt ({num_prompt_tokens} tokens) plus max_tokens needs {need} KV blocks "
                f"over the model's {len(self.allocator.groups)} groups of layers, but the cache has "
                f"{self.allocator.num_blocks - 1}; lower max_tokens or give the cache more blocks (num_kv_blocks, "
                f"kv_cache_memory)")


class HybridSpecScheduler(HybridScheduler, SpecScheduler):
    """Phase 6's `SpecScheduler` over a `HybridKVCacheManager`: drafts count in every group's
    growth (`can_grow`), and rejected ones roll back every group's table."""

    def roll_back(self, seq: Sequence, num_tokens: int) -> None:
        self.allocator.truncate(seq.block_table, num_tokens)


class HybridAsyncScheduler(AsyncScheduler):
    """Phase 9's `AsyncScheduler` over a `HybridScheduler`: a step planned ahead runs on frozen
    copies of its sequences, each of which also carries frozen copies of every group's tables
    (`group_tables`, read by the runner): the step planned after it meanwhile grows the live
    tables and gives back the blocks a window left."""

    def schedule_ahead(self) -> Batch:
        batch = super().schedule_ahead()
        for view, _ in batch.view.scheduled:
            real = batch.real[view.seq_id].block_table
            view.group_tables = [view.block_table, *self.inner.allocator.frozen_tables(real)]
        return batch


class HybridModelRunner(ModelRunner):
    """Phase 2's `ModelRunner`, with each group's tables and slots in the metadata; a step of
    decodes only through `decode_step` where one is given (`DecodeStep`)."""

    def __init__(self, *args, manager: HybridKVCacheManager, decode_step: DecodeStep | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.manager, self.decode_step = manager, decode_step

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        if self.decode_step is None or inputs.meta.prefill_rows:
            return super().forward(inputs)
        return self.decode_step(inputs.input_ids, inputs.positions, self.attention(inputs.meta))

    def prepare(self, plan: SchedulerOutput) -> ModelInputs:
        inputs = super().prepare(plan)       # group 0's tables are the ones the scheduler holds
        # a step planned ahead (phase 9) carries its own frozen copies of every group's tables
        tables = [getattr(seq, "group_tables", None) or self.manager.group_tables(seq.block_table)
                  for seq, _ in plan.scheduled]
        by_group = [list(group) for group in zip(*tables)]
        inputs.meta = group_metadata(inputs.meta, plan, by_group, self.block_size, self.device)
        return inputs


class HybridSpecModelRunner(HybridModelRunner, SpecModelRunner):
    """Phase 6's `SpecModelRunner` (k + 1 rows of logits for a sequence with k drafts), with each
    group's tables and slots."""
