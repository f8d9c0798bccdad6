"""The block allocator: the KV cache is a pool of fixed-size blocks, handed out one at a time.

A sequence's KV cache is not one contiguous stretch of memory but a list of blocks, its
*block table*. Token i of the sequence lives in block `block_table[i // block_size]`, at offset
`i % block_size`; its *slot* (the row of the flat cache it is written to) is
`block_id * block_size + offset`. A sequence takes a new block only when its last one is full,
so it wastes at most `block_size - 1` slots, whatever its final length.

Reference counts let several sequences share a block (a prefix cache, for one); a block goes
back to the free list when its count drops to zero.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockTable:
    """The blocks of one sequence, in order, and how many of their slots are filled."""

    __slots__ = ("block_ids", "num_tokens")

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self.block_ids)

    def slot(self, position: int, block_size: int) -> int:
        """The flat cache row of the token at `position`."""
        return self.block_ids[position // block_size] * block_size + position % block_size


class BlockAllocator:
    """A fixed pool of `num_blocks` KV blocks of `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: the most recently freed block is reused first, so a lightly loaded engine
        # touches only a small, cache-warm part of a large pool.
        self.free_block_ids: list[int] = list(reversed(range(num_blocks)))
        self.ref_counts = [0] * num_blocks

    # -- usage ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- one block -----------------------------------------------------------------------------
    def _take_block(self) -> int:
        if not self.free_block_ids:
            raise RuntimeError("out of KV cache blocks")
        block_id = self.free_block_ids.pop()
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        return block_id

    def release_block(self, block_id: int) -> None:
        """One reference fewer on `block_id`; with none left it goes back to the free list."""
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_counts[block_id] == 0:
            self.free_block_ids.append(block_id)

    def reserve_last_block(self) -> int:
        """Take the pool's last block out of circulation for good, before any block is handed
        out, and return its id: a block that no sequence will ever own. The pool is one smaller."""
        last = self.num_blocks - 1
        if self.num_free_blocks != self.num_blocks or last < 1:
            raise RuntimeError("reserve_last_block: the pool must be untouched and hold 2 blocks or more")
        self.free_block_ids.remove(last)
        del self.ref_counts[last]
        self.num_blocks = last
        return last

    # -- a sequence's table --------------------------------------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        """Are there free blocks for `num_tokens` tokens?"""
        return self.blocks_needed(num_tokens) <= self.num_free_blocks

    def allocate(self, table: BlockTable, num_tokens: int) -> None:
        """Grow `table` so it has room for `num_tokens` more tokens (a prompt, or a chunk of one)."""
        # >>> exercise allocate (1 star): Grow `table` so it holds `num_tokens` more tokens: take as many free blocks as it lacks.
        # hint: blocks_needed(table.num_tokens + num_tokens) - len(table) blocks are missing; refuse (RuntimeError) when the free list is shorter; _take_block() gives one.
        # checked by: test_allocator_never_leaks_or_double_books, test_every_block_is_free_after_generate, test_small_pool_runs_batches_one_after_another, test_request_that_never_fits_is_rejected
        needed = self.blocks_needed(table.num_tokens + num_tokens) - len(table)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"out of KV cache blocks: need {needed}, have {self.num_free_blocks}")
        for _ in range(needed):
            table.block_ids.append(self._take_block())
        table.num_tokens += num_tokens
        # <<< exercise allocate

    def can_append_slot(self, table: BlockTable) -> bool:
        return table.num_tokens % self.block_size != 0 or self.num_free_blocks > 0

    def append_slot(self, table: BlockTable) -> int:
        """Room for one more token (a decode step): a new block only when the last is full.
        Returns the new token's slot."""
        self.allocate(table, 1)
        return table.slot(table.num_tokens - 1, self.block_size)

    def free(self, table: BlockTable) -> None:
        """Give back every block of `table` (shared blocks only lose one reference)."""
        # >>> exercise free (1 star): Give every block of `table` back to the pool, and empty the table.
        # hint: release_block(b) for each block, the last one first; then clear block_ids and num_tokens.
        # checked by: test_allocator_never_leaks_or_double_books, test_every_block_is_free_after_generate, test_small_pool_runs_batches_one_after_another
        for block_id in reversed(table.block_ids):  # tail first: an LRU of freed blocks keeps a prefix longest
            self.release_block(block_id)
        table.block_ids.clear()
        table.num_tokens = 0
        # <<< exercise free
