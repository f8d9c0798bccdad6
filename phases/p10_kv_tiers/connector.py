"""A KV connector: the pool's blocks to and from a store outside it, in two halves.

vLLM's connector (vllm/distributed/kv_transfer/kv_connector/v1/base.py) has a *scheduler side*,
which decides, and a *worker side*, which moves bytes; what passes between them each step is a
small record, `KVConnectorMetadata`, carried on the plan (`SchedulerOutput.kv_connector_metadata`).

    scheduler side (OffloadingConnectorScheduler)       worker side (OffloadingConnectorWorker)
    get_num_new_matched_tokens(seq, num_computed)
        how many more of its tokens the store holds
    update_state_after_alloc(seq, blocks, n)
        those tokens go into these pool blocks
    build_connector_meta(plan) -> metadata  ------->    start_load_kv(metadata)        before the forward
        loads (pool block <- slot),                     wait_for_layer_load(layer)     before a layer's attention
        saves (pool block -> slot)                      save_kv_layer(layer)           after it
    request_finished(seq)                               wait_for_save()                after the forward

The store here is the offload tier (offload_store.py): every block that becomes full of computed
tokens is saved there, layer by layer as the forward writes it (what vLLM's OffloadingConnector
does), so a block the pool later evicts is already in the tier and eviction costs nothing. A
request whose prefix the pool no longer holds but the tier does is given fresh pool blocks, keyed
in the prefix cache at once, and the tier's bytes are copied into them layer by layer just before
each layer's attention reads them: the scheduler counts those tokens as computed.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from phases.p03_continuous_batching import PrefixBlockTable
from tinyvllm.sequence import Sequence
from tinyvllm.step import SchedulerOutput

from .offload_store import OffloadStore

logger = logging.getLogger("tinyvllm.kv_offload")


@dataclass
class KVConnectorMetadata:
    """One step's transfers: `loads` (pool block, tier slot), made before each layer's attention;
    `saves` (pool block, tier slot, digest), made after each layer's attention wrote this step's
    K/V."""

    loads: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int, bytes]] = field(default_factory=list)


def block_digest(parent: bytes, token_ids: list[int]) -> bytes:
    """A block's key in the tier: sha256 of its parent's digest and its token ids (int64 bytes)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class OffloadingConnectorScheduler:
    """The scheduler's side: which of a request's blocks the tier holds, where they go in the
    pool, and which of this step's new full blocks the tier takes.

    Args:
        store: the tier (its index and LRU are used here, its bytes by the worker side).
        allocator: the prefix-caching allocator of the pool.
        load_blocks_per_step: while other requests run, the most blocks a waiting request loads a
            step (0: all at once); it waits, its loaded blocks held, until the rest are in.
        remote: a consumer's connection to a producer on another host (kv_remote.py), which
            sends the blocks of a prompt this tier lacks (`fetch`).
    """

    def __init__(self, store: OffloadStore, allocator, load_blocks_per_step: int = 0, remote=None):
        self.store, self.allocator = store, allocator
        self.load_blocks_per_step = load_blocks_per_step
        self.remote, self.remote_failed = remote, False
        self.fetches: dict[Sequence, Future | list | None] = {}   # a request's blocks on their way, or landing
        self.held: dict[Sequence, PrefixBlockTable] = {}   # blocks loaded for a request still loading
        self.block_size = allocator.block_size
        self.digests: dict[Sequence, list[bytes]] = {}     # each running sequence's block digests
        self.loads: list[tuple[int, int, tuple]] = []      # (pool block, slot, prefix-cache key) for this step
        self.warned_full = False
        self.reset_stats()

    def block_digests(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The digests of `seq`'s first `num_blocks` blocks (made once per sequence, chained)."""
        have, bs = self.digests.setdefault(seq, []), self.block_size
        while len(have) < num_blocks:
            i = len(have)
            have.append(block_digest(have[-1] if have else b"", seq.token_ids[i * bs:(i + 1) * bs]))
        return have[:num_blocks]

    # -- what the store holds -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """Tokens of `seq` after its first `num_computed_tokens` (what the pool's prefix cache
        holds, whole blocks) that the tier holds too, whole blocks from there on; at least one of
        its tokens is always left to compute, for its logits."""
        # >>> exercise matched_tokens (2 stars): How many tokens after the pool's `num_computed_tokens` the tier holds: whole blocks, in order from the first block the pool lacks, up to the first block the tier lacks; leave at least one token of the sequence to compute.
        # hint: self.block_digests(seq, n) gives the first n blocks' digests; self.store.lookup(digest) is None for a block the tier lacks; (seq.num_tokens - 1) // block_size blocks at most may be matched.
        # checked by: test_matched_tokens_count_whole_blocks_and_leave_one_token, test_a_prefix_evicted_from_the_pool_is_loaded_back_bit_identical
        bs = self.block_size
        last = (seq.num_tokens - 1) // bs
        num_blocks = 0
        for digest in self.block_digests(seq, last)[num_computed_tokens // bs:]:
            if self.store.lookup(digest) is None:
                break
            num_blocks += 1
        return num_blocks * bs
        # <<< exercise matched_tokens

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        """The last `num_external_tokens // block_size` of `block_ids` (`seq`'s blocks) are fresh
        pool blocks for tokens the tier holds: load them this step (their slots pinned till then)."""
        n = num_external_tokens // self.block_size
        digests = self.block_digests(seq, len(block_ids))
        for i in range(len(block_ids) - n, len(block_ids)):
            slot = self.store.slot_of(digests[i])
            self.store.pin(slot)
            self.store.touch(digests[i])
            self.loads.append((block_ids[i], slot, self.allocator.block_key[block_ids[i]]))

    def load_prefix(self, seq: Sequence, others_running: bool = False) -> bool:
        """Before the scheduler looks at a waiting `seq`: the blocks of its prefix that the tier
        holds past the pool's become keyed pool blocks (a prefix-cache hit for the scheduler),
        loaded this step; as many as leave the pool room for the rest of its tokens, their bytes
        checked. With `others_running`, at most `load_blocks_per_step` of them: then False while
        more remain (the request waits; what it loaded is held for it till the rest is in)."""
        a, bs = self.allocator, self.block_size
        before = self.held.pop(seq, None)
        if self.store.role == "kv_producer" or not self.store.open():
            return True
        cached = a.match_prefix(seq.token_ids)
        if self.remote is not None and not self.fetch(seq, len(cached), wait=not others_running):
            return False   # its blocks are on their way from the producer: it waits, the others run
        num_external = self.get_num_new_matched_tokens(seq, len(cached) * bs)
        if not num_external and before is None:
            return True
        table = PrefixBlockTable()
        if cached:
            a.allocate_cached(table, cached)   # held, so taking blocks below cannot evict them
        if before is not None:
            a.free(before)                     # (now held by `table` instead)
        rest = seq.num_tokens - table.num_tokens
        while num_external and a.blocks_needed(num_external) + a.blocks_needed(rest - num_external) > a.num_free_blocks:
            num_external -= bs
        limit = self.load_blocks_per_step if others_running else 0
        more = bool(limit) and num_external > limit * bs
        if more:
            num_external = limit * bs
        digests = self.block_digests(seq, (table.num_tokens + num_external) // bs)
        for i in range(table.num_tokens // bs, len(digests)):   # the bytes of those the step takes
            if not self.store.verify(digests[i], self.store.slot_of(digests[i])):
                num_external, more = (i - table.num_tokens // bs) * bs, False
                break
        if num_external:
            a.allocate(table, num_external)
            a.cache_full_blocks(table, seq.token_ids, table.num_tokens)   # keyed: the scheduler finds them
            self.update_state_after_alloc(seq, table.block_ids, num_external)
        if more:
            self.held[seq] = table
            return False
        a.free(table)   # back to the cache, evictable, till the scheduler shares them
        return True

    def fetch(self, seq: Sequence, num_cached_blocks: int, wait: bool) -> bool:
        """A consumer fed over a socket: ask the producer, once per request, for the blocks of its
        prompt this tier lacks (from the first it lacks, after the pool's); True once they have
        landed in this tier (or the fetch failed: a warning, and they are computed), False while
        they are on their way or landing (with `wait`, as when nothing else runs, it waits for
        them and lands them all; else `load_blocks_per_step` land a step)."""
        if seq not in self.fetches:
            digests = self.block_digests(seq, (seq.num_tokens - 1) // self.block_size)[num_cached_blocks:]
            first = next((i for i, d in enumerate(digests) if self.store.lookup(d) is None), None)
            wanted = None if first is None or self.remote_failed else digests[first:]
            self.fetches[seq] = None if wanted is None else self.remote.submit(wanted)
        pending = self.fetches[seq]
        if pending is None:
            return True
        if isinstance(pending, Future):
            if not pending.done() and not wait:
                return False
            try:
                pending = self.fetches[seq] = pending.result()
            except (OSError, ValueError) as e:   # (RefusedValue is a ValueError)
                logger.warning("kv_consumer: the producer at %s did not send the blocks (%s); this request's "
                               "prompt, and every later one's, is computed here", self.remote.address, e)
                self.fetches[seq], self.remote_failed = None, True
                return True
        # they land a few a step while others run (load_blocks_per_step), as they load
        take = len(pending) if wait or not self.load_blocks_per_step else self.load_blocks_per_step
        for digest, crc, data in pending[:take]:
            slot = self.store.allocate(digest)
            if slot is None:
                break
            self.store.write(slot, digest, data, crc)
            self.num_fetched_blocks += 1
        del pending[:take]
        if pending:
            return False
        self.fetches[seq] = None
        return True

    # -- one step's record ------------------------------------------------------------------------
    def build_connector_meta(self, plan: SchedulerOutput) -> KVConnectorMetadata | None:
        """This step's loads (those whose pool block still holds their key: a later admission may
        have evicted one) and saves (every block this step fills, that the tier lacks). None when
        the step runs nothing: its loads wait for the next step that runs."""
        if not plan.scheduled:
            return None
        bs, a = self.block_size, self.allocator
        meta = KVConnectorMetadata(loads=[(b, s) for b, s, key in self.loads if a.block_key[b] == key])
        for seq, n in plan.scheduled:
            first, end = seq.num_computed_tokens // bs, min(seq.num_computed_tokens + n, seq.num_tokens) // bs
            if end <= first or self.store.role == "kv_consumer" or not self.store.open():
                continue
            for i, digest in enumerate(self.block_digests(seq, end)[first:], start=first):
                if digest in self.store.index:
                    self.store.touch(digest)
                    continue
                slot = self.store.allocate(digest)
                if slot is None:
                    self.num_save_skipped += 1
                    if not self.warned_full:
                        logger.warning("KV tier: every slot is being loaded from this step; a block is not saved")
                        self.warned_full = True
                    continue
                meta.saves.append((seq.block_table.block_ids[i], slot, digest))
        self.loads, self.store.pinned = [], set()
        self.num_loaded_blocks += len(meta.loads)
        self.num_saved_blocks += len(meta.saves)
        return meta

    def request_finished(self, seq: Sequence) -> bool:
        """`seq` left: forget its digests. True would keep its blocks until a save still under way
        ends (vLLM's asynchronous connectors); here every save ends with its step."""
        self.digests.pop(seq, None)
        self.fetches.pop(seq, None)   # (blocks still on their way are dropped when they land)
        held = self.held.pop(seq, None)
        if held is not None:   # it left while loading: its blocks go back to the cache
            self.allocator.free(held)
        return False

    def invalidate_blocks(self, block_ids: list[int]) -> None:
        """Pool blocks whose load did not finish (a failed step): they leave the prefix cache."""
        a = self.allocator
        for b in block_ids:
            key = a.block_key[b]
            if key is not None and a.cached.get(key) == b:
                del a.cached[key]
            a.block_key[b] = None
            if b in a.evictable:
                del a.evictable[b]
                a.free_block_ids.append(b)

    # -- counters ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {"kv_offload_loaded_blocks": self.num_loaded_blocks, "kv_offload_saved_blocks": self.num_saved_blocks,
                "kv_offload_save_skipped": self.num_save_skipped, "kv_offload_evicted_blocks": self.store.num_evicted,
                "kv_offload_refused_blocks": self.store.num_refused, "kv_offload_bytes": self.store.num_bytes,
                "kv_offload_capacity_bytes": self.store.capacity_bytes, "kv_remote_fetched_blocks": self.num_fetched_blocks}

    def reset_stats(self) -> None:
        self.num_loaded_blocks = self.num_saved_blocks = self.num_save_skipped = self.num_fetched_blocks = 0


class OffloadingConnectorWorker:
    """The worker's side: copies between the pool and the tier, a layer at a time, as the
    metadata of the step says.

    Args:
        store: the tier's bytes.
        kv: the pool, (layers, 2, blocks, block_size, KV heads, head_dim).
    """

    def __init__(self, store: OffloadStore, kv: torch.Tensor):
        self.store, self.kv = store, kv
        self.remote = None   # a producer's KVBlockServer, a consumer's KVBlockClient (kv_port: kv_remote.py)
        self.num_layers = kv.shape[0]
        self.meta: KVConnectorMetadata | None = None
        self.loaded: set[int] = set()   # layers of this step whose loads are made
        self.saved: set[int] = set()

    @property
    def has_layer_work(self) -> bool:
        """Whether this step's forward must call the per-layer hooks."""
        return self.meta is not None

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        """The step's record, before its forward. On a GPU, whose captured graphs replay without
        calling back per layer, every load is made here."""
        self.meta = meta if meta is not None and (meta.loads or meta.saves) else None
        self.loaded, self.saved = set(), set()
        if self.meta is not None and self.kv.device.type != "cpu":
            for layer in range(self.num_layers):
                self.wait_for_layer_load(layer)

    def wait_for_layer_load(self, layer: int) -> None:
        """Layer `layer`'s K and V of every block this step loads, tier slot -> pool block."""
        if self.meta is None or layer in self.loaded:
            return
        # >>> exercise layer_load (1 star): Copy this layer's K and V of every block the step loads from its tier slot into its pool block.
        # hint: self.store.block(slot) is (layers, 2, block_size, KVH, d); self.kv[layer, :, block] is the pool block's (2, block_size, KVH, d) for this layer; mark the layer in self.loaded.
        # checked by: test_a_prefix_evicted_from_the_pool_is_loaded_back_bit_identical, test_phase10_with_the_tier_gives_phase9_s_tokens
        for block, slot in self.meta.loads:
            self.kv[layer, :, block].copy_(self.store.block(slot)[layer])
        self.loaded.add(layer)
        # <<< exercise layer_load

    def save_kv_layer(self, layer: int) -> None:
        """Layer `layer`'s K and V of every block this step fills, pool block -> tier slot (after
        the layer's attention wrote them)."""
        if self.meta is None or layer in self.saved:
            return
        for block, slot, _ in self.meta.saves:
            self.store.block(slot)[layer].copy_(self.kv[layer, :, block])
        self.saved.add(layer)

    def wait_for_save(self) -> None:
        """After the forward: the layers no hook saved (a decode path that runs every layer in
        one call), then each saved slot's header, which makes it findable."""
        if self.meta is None:
            return
        missing = set(range(self.num_layers)) - self.loaded
        if self.meta.loads and missing:
            raise RuntimeError(f"KV connector: the loads of layers {sorted(missing)} were not made before "
                               f"their attention ran (a forward that did not call wait_for_layer_load)")
        for layer in range(self.num_layers):
            self.save_kv_layer(layer)
        for _, slot, digest in self.meta.saves:
            self.store.commit(slot, digest)
        self.meta = None

    def failed_loads(self) -> list[int]:
        """After a forward that failed: the pool blocks whose loads were not all made; its saves
        are dropped from the tier's index. Then the step is forgotten."""
        if self.meta is None:
            return []
        blocks = [] if len(self.loaded) == self.num_layers else [b for b, _ in self.meta.loads]
        for _, slot, digest in self.meta.saves:
            self.store.discard(digest, slot)
        self.meta = None
        return blocks
