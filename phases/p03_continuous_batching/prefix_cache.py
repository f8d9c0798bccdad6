"""Prefix caching: full KV blocks are remembered by their content and shared between requests.

Requests often start the same way: one system prompt, a few-shot preamble, the earlier turns of
a chat. Their first blocks of K/V are then identical, because a token's K/V depend only on it and
the tokens before it. So a full block is keyed by

    key(block i) = (hash of key(block i-1), the block_size token ids of block i)

chained, so equal keys mean equal *prefixes*, not just equal blocks. A new request walks its
prompt block by block; every block already in the cache is shared (its reference count goes up)
instead of computed again, and prefill starts after the last hit.

A block whose last user finishes is not thrown away: it keeps its key and waits as *evictable*.
It counts as free, and is reused for something else only when the free list is empty, least
recently used first. So a popular prefix survives between requests.
"""

from __future__ import annotations

from collections import OrderedDict

from phases.p02_paged_kv import BlockAllocator, BlockTable


class PrefixBlockTable(BlockTable):
    """A block table that also remembers how many of its blocks are keyed, and the last key's hash."""

    __slots__ = ("num_hashed_blocks", "last_hash")

    def __init__(self) -> None:
        super().__init__()
        self.num_hashed_blocks = 0
        self.last_hash: int | None = None


class PrefixCachingBlockAllocator(BlockAllocator):
    """A `BlockAllocator` whose full blocks can be found again by their content."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.cached: dict[tuple, int] = {}             # key -> block id
        self.block_key: list[tuple | None] = [None] * num_blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unused keyed blocks, LRU first
        self.num_queries = 0                            # prompt tokens looked up
        self.num_hits = 0                               # of those, found in the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    def reserve_last_block(self) -> int:
        block_id = super().reserve_last_block()
        del self.block_key[block_id]
        return block_id

    def _take_block(self) -> int:
        if not self.free_block_ids and self.evictable:
            block_id, _ = self.evictable.popitem(last=False)  # evict the least recently used
            del self.cached[self.block_key[block_id]]
            self.block_key[block_id] = None
            self.free_block_ids.append(block_id)
        return super()._take_block()

    def release_block(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_counts[block_id] == 0:
            if self.block_key[block_id] is not None:
                self.evictable[block_id] = None  # most recently used at the end
            else:
                self.free_block_ids.append(block_id)

    # -- lookup and sharing --------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Blocks of the cache that hold the longest prefix of `token_ids`. At least one token is
        always left to compute: its logits are what sampling needs, even on a full hit."""
        # >>> exercise match_prefix (2 stars): The cached blocks that hold the longest prefix of `token_ids`, walking it a full block at a time; always leave at least one token to compute.
        # hint: key of block i = (hash of the previous key, the block's token ids); stop at the first key not in self.cached; only (len - 1) // block_size blocks may match.
        # checked by: test_prefix_cache_full_hit_on_block_multiple, test_prefix_cache_shares_a_system_prompt, test_heavy_preemption_keeps_outputs
        bs = self.block_size
        blocks, parent = [], None
        for i in range((len(token_ids) - 1) // bs):
            key = (parent, tuple(token_ids[i * bs: (i + 1) * bs]))
            block_id = self.cached.get(key)
            if block_id is None:
                break
            blocks.append(block_id)
            parent = hash(key)
        return blocks
        # <<< exercise match_prefix

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup: its prompt tokens, and those the cache held (a
        lookup that did not lead to an admission is not counted)."""
        self.num_queries += num_tokens
        self.num_hits += num_hit_tokens

    def allocate_cached(self, table: PrefixBlockTable, blocks: list[int]) -> None:
        """Start an empty table with shared cached blocks (their tokens need no prefill)."""
        assert not table.block_ids
        for block_id in blocks:
            if self.ref_counts[block_id] == 0:
                del self.evictable[block_id]
            self.ref_counts[block_id] += 1
            table.block_ids.append(block_id)
        table.num_tokens = len(blocks) * self.block_size
        table.num_hashed_blocks = len(blocks)
        table.last_hash = hash(self.block_key[blocks[-1]]) if blocks else None

    def cache_full_blocks(self, table: PrefixBlockTable, token_ids: list[int], num_computed: int) -> None:
        """Key every block of `table` that is now full of computed tokens, so others can find it."""
        # >>> exercise cache_full_blocks (2 stars): Key every block of `table` that is now full of computed tokens, so later requests can find it.
        # hint: continue from table.num_hashed_blocks while (i + 1) * block_size <= num_computed; chain table.last_hash; do not re-key a block or a key already cached.
        # checked by: test_prefix_cache_full_hit_on_block_multiple, test_prefix_cache_shares_a_system_prompt
        bs = self.block_size
        while (table.num_hashed_blocks + 1) * bs <= num_computed:
            i = table.num_hashed_blocks
            key = (table.last_hash, tuple(token_ids[i * bs: (i + 1) * bs]))
            block_id = table.block_ids[i]
            if key not in self.cached and self.block_key[block_id] is None:
                self.cached[key] = block_id
                self.block_key[block_id] = key
            table.num_hashed_blocks += 1
            table.last_hash = hash(key)
        # <<< exercise cache_full_blocks

    def free(self, table: BlockTable) -> None:
        super().free(table)
        if isinstance(table, PrefixBlockTable):
            table.num_hashed_blocks, table.last_hash = 0, None
