"""Rolling back rejected drafts: their slots were written in the verifying pass, and are given up.

A sequence verified with k drafts wrote k + 1 tokens' K/V; if j drafts were accepted, the cache
keeps the last real token and those j, and the rest of the slots are free again: its
`num_computed_tokens` moves back, and blocks left with no slot go back to the pool (in the
target's cache and in the draft model's).
"""

from __future__ import annotations

from phases.p02_paged_kv import BlockAllocator, BlockTable


def truncate_table(allocator: BlockAllocator, table: BlockTable, num_tokens: int) -> None:
    """Shrink `table` to `num_tokens` slots: blocks left with no slot go back to the pool."""
    # >>> exercise truncate_table (1 star): Roll a block table back to `num_tokens` slots: blocks left with no slot go back to the pool.
    # hint: keep = blocks_needed(num_tokens); release_block the blocks past it, the last first; num_tokens can only shrink.
    # checked by: test_truncate_table_gives_back_the_blocks_past_the_tokens, test_abort_mid_speculation_frees_every_block, test_ngram_greedy_same_tokens_as_phase5
    keep = allocator.blocks_needed(num_tokens)
    while len(table.block_ids) > keep:
        allocator.release_block(table.block_ids.pop())
    table.num_tokens = min(table.num_tokens, num_tokens)
    # <<< exercise truncate_table
