"""What each layer needs from the KV cache (a spec), and the layers grouped by spec.

A full-attention layer keeps every token's K/V; a layer with a sliding window of W tokens reads
only the last W, so the blocks before them can go back to the pool. vLLM describes each layer by
a spec (vllm/v1/kv_cache_interface.py: `FullAttentionSpec`, `SlidingWindowSpec`), and we keep
its names:

    Gemma 3, 6 layers:   S S S S S F        S: SlidingWindowSpec(window=512)   F: FullAttentionSpec
    groups of 1 layer:   [0] [1] [2] [3] [4] [5]      each group its own block table per sequence

Layers of one spec form groups of equal size (the greatest common divisor of the specs' layer
counts: Gemma 3 1B's 26 layers, 22 windowed and 4 global, make 11 + 2 groups of 2), so every
group's block is the same number of bytes, and one pool of block ids serves them all: block b of
the pool is, for whichever group holds it, K and V of `group_size` layers for block_size tokens
(`HybridKVCache`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phases.p02_paged_kv.block_allocator import cdiv
from tinyvllm.config import ModelConfig


@dataclass(frozen=True)
class FullAttentionSpec:
    """A layer that attends to every earlier token: its blocks are held for the whole sequence."""

    block_size: int

    def first_needed_block(self, num_computed: int) -> int:
        """The first block a query at position `num_computed` (or later) still reads."""
        return 0

    def max_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one sequence of `num_tokens` holds at once, chunks of up to `max_chunk`."""
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A layer whose query at position p reads keys p - sliding_window + 1 .. p only."""

    sliding_window: int = 0

    def first_needed_block(self, num_computed: int) -> int:
        """Blocks wholly before the window of the next query (at `num_computed`) are never read
        again by this sequence."""
        # >>> exercise first_needed_block (1 star): The first block a query at position `num_computed` still reads through a window of `sliding_window` tokens.
        # hint: it sees keys num_computed - sliding_window + 1 .. num_computed; the first of them (never below 0) lies in block first // block_size.
        # checked by: test_first_needed_block, test_a_long_request_holds_the_window_not_the_context, test_greedy_equals_transformers_past_the_window
        return max(0, num_computed - self.sliding_window + 1) // self.block_size
        # <<< exercise first_needed_block

    def max_blocks(self, num_tokens: int, max_chunk: int) -> int:
        # a chunk of max_chunk queries, and the window before its first: W - 1 + chunk positions
        return min(cdiv(num_tokens, self.block_size), cdiv(self.sliding_window - 1 + max_chunk, self.block_size) + 1)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share a spec, and so one block table per sequence (vLLM's KVCacheGroupSpec)."""

    spec: KVCacheSpec
    layers: tuple[int, ...]


def layer_specs(model: ModelConfig, max_model_len: int, block_size: int) -> list[KVCacheSpec]:
    """Each layer's spec, from its window (`ModelConfig.layer_windows`)."""
    return [FullAttentionSpec(block_size) if w is None else SlidingWindowSpec(block_size, w)
            for w in model.layer_windows(max_model_len)]


def group_layers(specs: list[KVCacheSpec]) -> list[KVCacheGroup]:
    """Layers of one spec, in groups of the same size for every spec (the gcd of the counts):
    spec by spec in order of first appearance, layers in order."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_spec.values()))
    return [KVCacheGroup(spec, tuple(layers[i: i + size]))
            for spec, layers in by_spec.items() for i in range(0, len(layers), size)]
