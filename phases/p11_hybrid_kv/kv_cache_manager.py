"""One pool of blocks, one block table per group per sequence, and a window's blocks let go.

    sequence of 22 tokens, block_size 4, a windowed group (W = 8) and a full one:

    full group     [ 3 ][ 9 ][ 4 ][ 12 ][ 7 ][ 2 ]          every block, for the whole sequence
    window group   [ N ][ N ][ N ][ 15 ][ 6 ][ 11 ]         N: the null block; blocks 0-2 back in
                    positions 0-11 are wholly before          the pool (their keys kept: evictable)
                    the next query's window (15 - 22)

`HybridKVCacheManager` is the allocator part. It keeps phase 3's prefix-caching pool (`pool`: one
list of free block ids for every group, one LRU of cached blocks) with groups on top, and answers
the scheduler's questions as a phase 3 allocator does (it is one, so the scheduler's prefix
caching stays on; its free list and cache are the pool's): the scheduler holds one
`PrefixBlockTable` per sequence, which is group 0's table, and the manager keeps the others
beside it (`tables`), as vLLM's managers keep each request's blocks by its id. Every call the
scheduler makes (allocate, free, match_prefix, allocate_cached, cache_full_blocks) does it in each
group:

- allocate: a windowed group first gives back the blocks wholly before the window of the step's
  first query (`SlidingWindowSpec.first_needed_block`), putting the null block in their place so
  that block i still holds positions i * block_size on; then every group grows as phase 2's does.
- prefix caching: each group keys its own blocks (its chain of keys starts from its group's id,
  so equal tokens in two groups are two entries). A hit must be one length every group serves:
  a full group any prefix of its cached blocks, a windowed group a length whose window's blocks
  are cached, whatever came before them (`hit_length`).
- rollback (phase 6's rejected drafts): every group's table shrinks as phase 6's does
  (`truncate`). The blocks a window gave back were those before the window of the step's first
  query, the drafts' last real token; a sequence rolls back to that token or later, whose window
  starts no earlier, so no block given back is needed again.

vLLM: `SingleTypeKVCacheManager`, `FullAttentionManager` and `SlidingWindowManager`
(vllm/v1/core/single_type_kv_cache_manager.py), one `BlockPool` (block_pool.py), and
`HybridKVCacheCoordinator` (kv_cache_coordinator.py) for the hit every group agrees on.
"""

from __future__ import annotations

import copy

from phases.p02_paged_kv import BlockTable
from phases.p03_continuous_batching import PrefixBlockTable, PrefixCachingBlockAllocator
from phases.p06_speculative_decoding import truncate_table

from .kv_cache_interface import KVCacheGroup, SlidingWindowSpec


class CacheHit(list):
    """`match_prefix`'s answer: as a list, group 0's hit blocks (so len(hit) * block_size is the
    hit length the scheduler reads); iterated, every group's real blocks (what the scheduler
    checks for blocks that stop being free); `groups`: each group's blocks, null ones included."""

    def __init__(self, groups: list[list[int]], null_block: int):
        super().__init__(groups[0] if groups else [])
        self.groups, self.null_block = groups, null_block

    def __iter__(self):
        return (b for blocks in self.groups for b in blocks if b != self.null_block)


def hit_length(groups: list[KVCacheGroup], cached: list[list[bool]], max_blocks: int) -> int:
    """The longest hit, in blocks, that every group can serve. cached[g][i]: block i of the
    prompt is in group g's cache. A full group serves h blocks when its first h are cached; a
    windowed one when the blocks its window reads at position h * block_size are cached."""
    # >>> exercise hit_length (2 stars): The longest prefix hit (in blocks, at most max_blocks) that every group can serve: a full group needs all of its first h blocks cached, a windowed group only the blocks its window reads after them.
    # hint: start from h = max_blocks and lower h until no group objects; for group g the blocks needed at h are first_needed_block(h * block_size) .. h - 1; a full group's first_needed_block is 0.
    # checked by: test_hit_length, test_prefix_hits_past_the_window
    h = max_blocks
    changed = True
    while changed:
        changed = False
        for group, hits in zip(groups, cached):
            while h > 0 and not all(hits[group.spec.first_needed_block(h * group.spec.block_size): h]):
                h -= 1
                changed = True
    return h
    # <<< exercise hit_length


class HybridKVCacheManager(PrefixCachingBlockAllocator):
    """The allocator part for a model whose layers need different caches (see the module
    docstring). `max_chunk`: the most tokens a sequence runs in one step (the token budget)."""

    def __init__(self, num_blocks: int, block_size: int, groups: list[KVCacheGroup], max_chunk: int,
                 enable_caching: bool = True):
        # not super().__init__: the pool is `pool`'s, and what phase 3's scheduler reads of its
        # allocator (the sizes, the reference counts, the evictable blocks, the lookup counts) is it
        self.pool = PrefixCachingBlockAllocator(num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts, self.evictable, self.cached = self.pool.ref_counts, self.pool.evictable, self.pool.cached
        self.num_queries = self.num_hits = 0
        self.groups, self.max_chunk, self.enable_caching = groups, max_chunk, enable_caching
        self.null_block = self.pool.free_block_ids.pop()   # never written, never freed: a hole in a table
        self.ref_counts[self.null_block] = 1
        self.tables: dict[BlockTable, list[PrefixBlockTable]] = {}   # group 0's table -> every group's

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def release_block(self, block_id: int) -> None:
        self.pool.release_block(block_id)

    def group_tables(self, table: BlockTable) -> list[PrefixBlockTable]:
        """Every group's table of the sequence whose group-0 table is `table`."""
        if table not in self.tables:
            others = [PrefixBlockTable() for _ in self.groups[1:]]
            for g, t in enumerate(others, 1):   # each group's chain of keys starts apart
                t.last_hash = hash(("kv cache group", g))
            self.tables[table] = [table, *others]
        return self.tables[table]

    # -- sizes ---------------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` holds at once, over every group."""
        return sum(g.spec.max_blocks(num_tokens, self.max_chunk) for g in self.groups)

    def blocks_to_grow(self, table: BlockTable, num_new: int) -> int:
        """Free blocks `num_new` more tokens of the sequence take, less those its windows give back."""
        total = 0
        for group, t in zip(self.groups, self.group_tables(table)):
            first = group.spec.first_needed_block(t.num_tokens)
            total += self.pool.blocks_needed(t.num_tokens + num_new) - len(t)
            # a block another sequence shares stays held
            total -= sum(1 for b in t.block_ids[:first] if b != self.null_block and self.ref_counts[b] == 1)
        return total

    # -- a sequence's tables -------------------------------------------------------------------
    def remove_skipped_blocks(self, table: BlockTable, spec: SlidingWindowSpec) -> None:
        """Give back the blocks wholly before the window of the next query (at table.num_tokens):
        the null block takes each one's place."""
        # >>> exercise remove_skipped_blocks (2 stars): Free the blocks of `table` that the window of its next query (at table.num_tokens) no longer reaches, leaving the null block in their places.
        # hint: every block before spec.first_needed_block(table.num_tokens) goes; walk back from there and stop at the first null one (those before it went earlier); release_block gives one back.
        # checked by: test_a_long_request_holds_the_window_not_the_context, test_greedy_equals_transformers_past_the_window
        i = spec.first_needed_block(table.num_tokens) - 1
        while i >= 0 and table.block_ids[i] != self.null_block:
            self.release_block(table.block_ids[i])
            table.block_ids[i] = self.null_block
            i -= 1
        # <<< exercise remove_skipped_blocks

    def allocate(self, table: BlockTable, num_tokens: int) -> None:
        for group, t in zip(self.groups, self.group_tables(table)):
            if isinstance(group.spec, SlidingWindowSpec):
                self.remove_skipped_blocks(t, group.spec)
            self.pool.allocate(t, num_tokens)

    def frozen_tables(self, table: BlockTable) -> list[PrefixBlockTable]:
        """Copies of the other groups' tables of the sequence whose group-0 table is `table`, as
        they are now (phase 9's `frozen_copy` copies group 0's): a step planned ahead runs on
        them while the step planned after it grows the live ones and gives back what a window left."""
        frozen = []
        for t in self.group_tables(table)[1:]:
            f = copy.copy(t)
            f.block_ids = list(t.block_ids)
            frozen.append(f)
        return frozen

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Roll every group's table of the sequence back to `num_tokens` slots (phase 6's
        `truncate_table` in each: the null blocks lie before the window, never past num_tokens)."""
        for t in self.group_tables(table):
            truncate_table(self.pool, t, num_tokens)

    def free(self, table: BlockTable) -> None:
        for t in self.tables.pop(table, [table]):
            for block_id in reversed(t.block_ids):
                if block_id != self.null_block:
                    self.release_block(block_id)
            t.block_ids.clear()
            t.num_tokens = 0
            if isinstance(t, PrefixBlockTable):
                t.num_hashed_blocks, t.last_hash = 0, None

    # -- prefix caching ------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> CacheHit:
        """The longest prefix every group holds (`hit_length`), as each group's blocks."""
        bs, max_blocks = self.block_size, (len(token_ids) - 1) // self.block_size
        if not self.enable_caching:
            return CacheHit([], self.null_block)
        found = []        # per group: the cached block of each prompt block, or None
        for g in range(len(self.groups)):
            parent, blocks = (None if g == 0 else hash(("kv cache group", g))), []
            for i in range(max_blocks):
                key = (parent, tuple(token_ids[i * bs: (i + 1) * bs]))
                blocks.append(self.cached.get(key))
                parent = hash(key)
            found.append(blocks)
        h = hit_length(self.groups, [[b is not None for b in blocks] for blocks in found], max_blocks)
        hits = []
        for group, blocks in zip(self.groups, found):
            first = group.spec.first_needed_block(h * bs) if h else 0
            hits.append([self.null_block] * first + blocks[first:h])
        return CacheHit(hits, self.null_block)

    def allocate_cached(self, table: PrefixBlockTable, blocks: CacheHit) -> None:
        for t, hit in zip(self.group_tables(table), blocks.groups):
            real = [b for b in hit if b != self.null_block]
            self.pool.allocate_cached(t, real)
            t.block_ids[:0] = [self.null_block] * (len(hit) - len(real))
            t.num_tokens, t.num_hashed_blocks = len(hit) * self.block_size, len(hit)

    def cache_full_blocks(self, table: PrefixBlockTable, token_ids: list[int], num_computed: int) -> None:
        if self.enable_caching:
            for t in self.group_tables(table):
                self.pool.cache_full_blocks(t, token_ids, num_computed)

    # -- what the bench and the tests read -----------------------------------------------------
    def num_blocks_held(self, table: BlockTable) -> int:
        """Blocks of the pool the sequence holds now, over every group (the null block not counted)."""
        return sum(1 for t in self.group_tables(table) for b in t.block_ids if b != self.null_block)
