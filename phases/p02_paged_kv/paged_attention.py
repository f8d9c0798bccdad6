"""Paged attention in PyTorch: each sequence attends over its own blocks of the cache.

The step's tokens come flat, as in phase 1's model: q (N, H, d), sequence after sequence.
`AttentionMetadata` says how they are grouped:

    query_start_loc (B+1,)  sequence b's queries are q[query_start_loc[b] : query_start_loc[b+1]]
    seq_lens        (B,)    tokens of sequence b in the cache *after* this step's write
    block_tables    (B, M)  sequence b's block ids, padded with 0 past its last block
    slot_mapping    (N,)    where each new token's K/V is written

The backend first writes the new K/V into their slots, then, for each sequence, gathers its
`seq_len` cached keys and values through its block table and attends. A query at position p
sees cached positions 0..p, so the causal mask is phase 1's, shifted by the tokens already
cached: we reuse phase 1's `causal_attention` for it.

Decode rows (one query each) are the common case and run together: their blocks are gathered
into one padded batch, masked by length, and handed to PyTorch's fused attention.

A layer with a sliding window of W tokens (`KVCache.windows`) reads only the blocks that hold
its queries' last W positions (`window_gather` for decodes), and masks the keys before them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from phases.p01_naive_attention import causal_attention

from .kv_cache import KVCache


@dataclass
class AttentionMetadata:
    """How the flat tokens of one step map to sequences and cache slots. Built once per step
    (`build`), read by every layer. The same numbers come as host lists (for loops in Python)
    and as tensors on the device (for kernels)."""

    slot_mapping: torch.Tensor     # (N,) int64
    query_start_loc: list[int]     # (B+1,) sequence b's queries: [query_start_loc[b], query_start_loc[b+1])
    seq_lens: list[int]            # (B,) cached tokens of each sequence after this step (host)
    block_tables: torch.Tensor     # (B, M) int64, padded with 0
    prefill_rows: list[int]        # sequences with several queries (prompts, or chunks of them)
    # the decode rows (one query each), ready for decode_attention
    decode_token_idx: torch.Tensor     # (Bd,) their query's index in the flat batch
    decode_block_tables: torch.Tensor  # (Bd, M)
    decode_seq_lens: torch.Tensor      # (Bd,)
    query_start_loc_tensor: torch.Tensor   # (B+1,) int64, on the device
    seq_lens_tensor: torch.Tensor          # (B,) int64, on the device
    max_query_len: int
    max_seq_len: int               # at least the longest sequence (what a padded gather spans)
    max_decode_seq_len: int        # the same, over the decode rows (what their padded gather spans)
    _decode_inputs: tuple | None = None  # decode_inputs' result, made by the first layer
    _window_inputs: dict | None = None   # window_gather's, per window, made by the first such layer

    @classmethod
    def build(cls, slot_mapping: list[int], query_lens: list[int], seq_lens: list[int],
              block_tables: list[list[int]], device: torch.device) -> "AttentionMetadata":
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], device=device)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        decode = [b for b, n in enumerate(query_lens) if n == 1]
        lens = torch.tensor(seq_lens, device=device)
        return cls(
            slot_mapping=torch.tensor(slot_mapping, device=device), query_start_loc=starts,
            seq_lens=seq_lens, block_tables=tables,
            prefill_rows=[b for b, n in enumerate(query_lens) if n != 1],
            decode_token_idx=torch.tensor([starts[b] for b in decode], device=device),
            decode_block_tables=tables if len(decode) == len(query_lens) else tables[decode],
            decode_seq_lens=lens if len(decode) == len(query_lens) else lens[decode],
            query_start_loc_tensor=torch.tensor(starts, device=device), seq_lens_tensor=lens,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            max_decode_seq_len=max((seq_lens[b] for b in decode), default=0))

    def with_block_ids(self, renumber: torch.Tensor) -> "AttentionMetadata":
        """The same step with every block id b read as renumber[b] (an attention backend that
        copies the blocks it needs into a compact buffer attends there)."""
        return dataclasses.replace(self, block_tables=renumber[self.block_tables],
                                   decode_block_tables=renumber[self.decode_block_tables],
                                   _decode_inputs=None, _window_inputs=None)

    def decode_inputs(self, block_size: int, dtype: torch.dtype,
                      window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode_gather`'s block ids and mask for this step's decode rows (`window_gather`'s for
        a layer with a sliding window): the same for every layer of a window, so made once, by
        the first such layer, and reused by the others."""
        if window is not None and window < self.max_decode_seq_len:
            if self._window_inputs is None:
                self._window_inputs = {}
            if window not in self._window_inputs:
                self._window_inputs[window] = window_gather(self.decode_block_tables, self.decode_seq_lens,
                                                            block_size, dtype, window)
            return self._window_inputs[window]
        if self._decode_inputs is None:
            self._decode_inputs = decode_gather(self.decode_block_tables, self.decode_seq_lens,
                                                block_size, dtype, self.max_decode_seq_len)
        return self._decode_inputs


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, window: int | None = None,
                    prompt_attention=causal_attention) -> torch.Tensor:
    """q: (N, H, d); k_cache, v_cache: (num_blocks, block_size, KVH, d) -> (N, H, d). `window`:
    the layer's sliding window in tokens (None: every earlier token). `prompt_attention`: a
    prompt row's attention over the keys gathered for it, `causal_attention`'s arguments (a later
    phase's faster one)."""
    block_size = k_cache.shape[1]
    if not meta.prefill_rows:  # only decodes (most steps): no gather and scatter of the rows
        return decode_attention(q, k_cache, v_cache, *meta.decode_inputs(block_size, q.dtype, window))
    out = torch.empty_like(q)
    starts, lens = meta.query_start_loc, meta.seq_lens
    for b in meta.prefill_rows:  # long queries: one sequence at a time
        qb = q[starts[b]: starts[b + 1]]
        # the first block any query of the row sees: block 0, or with a window the one holding
        # the first query's earliest key
        first = 0 if window is None else max(0, lens[b] - len(qb) - window + 1) // block_size
        blocks = meta.block_tables[b, first: -(-lens[b] // block_size)]
        k = k_cache[blocks].flatten(0, 1)[: lens[b] - first * block_size]   # (L, KVH, d)
        v = v_cache[blocks].flatten(0, 1)[: lens[b] - first * block_size]
        out[starts[b]: starts[b + 1]] = prompt_attention(qb, k, v, num_past=lens[b] - len(qb) - first * block_size,
                                                         window=window)
    if len(meta.decode_token_idx):
        idx = meta.decode_token_idx
        out[idx] = decode_attention(q[idx], k_cache, v_cache, *meta.decode_inputs(block_size, q.dtype, window))
    return out


def decode_gather(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                  dtype: torch.dtype, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What `decode_attention` needs to gather B sequences into one padded batch of T slots, T
    the blocks of `max_seq_len` tokens times block_size. block_tables: (B, M); seq_lens: (B,);
    max_seq_len: at least the longest of seq_lens (a host int: the shapes depend on it) ->

        block_ids (B * T / block_size,)  each sequence's blocks, one sequence after another
        mask      (B, 1, 1, T)           added to the scores: 0 on a sequence's tokens, -inf on
                                         the slots past its length (rest of its last block, padding)
    """
    # >>> exercise decode_gather (2 stars): For B decoding sequences: the block ids to gather (each sequence padded to the longest's blocks) and the additive mask (0 on real tokens, -inf past each length).
    # hint: max_blocks = ceil(max_seq_len / block_size); block_tables[:, :max_blocks].flatten(); a slot t of row b is past the end when t >= seq_lens[b].
    # checked by: test_decode_gather_pads_each_sequence_to_the_longest, test_paged_attention_equals_naive, test_greedy_equals_phase1
    max_blocks = -(-max_seq_len // block_size)
    block_ids = block_tables[:, :max_blocks].flatten()
    past_end = torch.arange(max_blocks * block_size, device=seq_lens.device)[None, :] >= seq_lens[:, None]
    mask = torch.zeros(past_end.shape, dtype=dtype, device=seq_lens.device).masked_fill_(past_end, float("-inf"))
    return block_ids, mask[:, None, None, :]
    # <<< exercise decode_gather


def window_gather(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                  dtype: torch.dtype, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_gather` for a layer with a sliding window of `window` tokens: each sequence's
    last `window` positions span at most ceil((window - 1) / block_size) + 1 blocks, so only
    those are gathered, from the block holding position seq_len - window on (each row its own
    first block); the mask hides the slots before the window and past the end."""
    nb = -(-(window - 1) // block_size) + 1                         # blocks a window can touch
    first = (seq_lens - window).clamp(min=0) // block_size          # (B,) each row's first block
    cols = first[:, None] + torch.arange(nb, device=seq_lens.device)[None, :]   # (B, nb)
    block_ids = block_tables.gather(1, cols.clamp(max=block_tables.shape[1] - 1)).flatten()
    pos = (cols[:, :, None] * block_size + torch.arange(block_size, device=seq_lens.device)).flatten(1)  # (B, T)
    outside = (pos >= seq_lens[:, None]) | (pos < seq_lens[:, None] - window)
    mask = torch.zeros(outside.shape, dtype=dtype, device=seq_lens.device).masked_fill_(outside, float("-inf"))
    return block_ids, mask[:, None, None, :]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query per sequence. q: (B, H, d); block_ids, mask: from `decode_gather` -> (B, H, d).

    Gather each sequence's blocks into a padded (B, T) batch, mask the padding, and let PyTorch's
    fused attention (`scaled_dot_product_attention`, grouped-query aware) do the math: the same
    softmax(q k^T / sqrt(d)) v as phase 1, without materializing the repeated K/V heads.
    """
    b, t = mask.shape[0], mask.shape[-1]
    # gather each sequence's blocks, one after another (index_select: a plain copy of whole
    # blocks, several times faster on a CPU than k_cache[table] advanced indexing)
    k = k_cache.index_select(0, block_ids).view(b, t, *k_cache.shape[2:]).transpose(1, 2)  # (B, KVH, T, d)
    v = v_cache.index_select(0, block_ids).view(b, t, *v_cache.shape[2:]).transpose(1, 2)
    # the masked slots hold finite values, zeros or an earlier request's K/V (see KVCache), so
    # their weight is exactly 0 after the softmax. An additive float mask made once per step:
    # SDPA would turn a boolean one into this at every layer.
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, enable_gqa=True)  # (B, H, 1, d)
    return out[:, :, 0]


def check_metadata(meta: AttentionMetadata, num_blocks: int, block_size: int, part: str = "attention") -> None:
    """Checked mode: refuse a step whose metadata would make attention read or write outside the
    KV pool, or inside another sequence's blocks, before any kernel sees it. A kernel written in C
    (phases 3, 4 and 7) indexes the pool with whatever it is handed, so a bookkeeping slip in the
    scheduler, the allocator or a persistent batch would corrupt memory (or the tokens) instead
    of failing. Every sequence row b must have at least one query, at least as many tokens as
    queries, a block table as long as its length needs, and in those columns block ids of the
    pool, [0, num_blocks); every token t must write the slot of its own position in its own
    blocks, and the longest lengths must bound the rows' (a kernel sizes its buffers by them).
    Raises a ValueError naming `part`, the row or token and the bad value. Plain Python over the
    tensors' values: microseconds a step (phase 7's tools/check_cost.py measures it)."""
    for name, t in (("slot_mapping", meta.slot_mapping), ("block_tables", meta.block_tables),
                    ("seq_lens", meta.seq_lens_tensor), ("query_start_loc", meta.query_start_loc_tensor),
                    ("decode_seq_lens", meta.decode_seq_lens)):
        if t.dtype != torch.int64:
            raise ValueError(f"{part}: {name} must be int64 (the kernels read 8-byte ids), got {t.dtype}")
    if fault := metadata_fault(meta, num_blocks, block_size):
        raise ValueError(f"{part}: {fault}")


def metadata_fault(meta: AttentionMetadata, num_blocks: int, block_size: int) -> str | None:
    """What `check_metadata` finds wrong, in words (the first row or token at fault), or None.
    A loop in Python over small lists: at one row a step it costs a tenth of what numpy's or
    PyTorch's operators would, each of which pays a fixed price to start."""
    starts, lens, slots, decode_lens = (t.tolist() for t in (
        meta.query_start_loc_tensor, meta.seq_lens_tensor, meta.slot_mapping, meta.decode_seq_lens))
    rows, cols = meta.block_tables.shape
    if (meta.slot_mapping.dim() != 1 or meta.seq_lens_tensor.dim() != 1 or len(lens) != rows
            or len(starts) != rows + 1 or len(slots) != starts[-1]):
        return (f"{rows} rows of block tables, but seq_lens {tuple(meta.seq_lens_tensor.shape)}, query_start_loc "
                f"{tuple(meta.query_start_loc_tensor.shape)} and slot_mapping {tuple(meta.slot_mapping.shape)} "
                f"for {starts[-1]} tokens")
    need = [-(-n // block_size) for n in lens]                      # blocks each row reads
    tables = meta.block_tables[:, :max(need, default=0)].tolist()   # only the columns read
    for b, (seq_len, table) in enumerate(zip(lens, tables)):
        first, end = starts[b], starts[b + 1]
        if not 1 <= end - first <= seq_len:
            return (f"sequence row {b} has {end - first} queries and a length of {seq_len} tokens "
                    "(needs 1 <= queries <= length)")
        if need[b] > cols:
            return f"sequence row {b} of {seq_len} tokens needs {need[b]} blocks, but its block table has {cols} columns"
        for j, block in enumerate(table):
            if not 0 <= block < num_blocks:
                return f"sequence row {b}, block {j}: block id {block} is outside the pool of {num_blocks} blocks"
        for t in range(first, end):                 # each token writes its own position's slot
            p = seq_len - (end - t)
            own = table[p // block_size] * block_size + p % block_size
            if slots[t] != own:
                return (f"token {t} (sequence row {b}, position {p}) writes slot {slots[t]}, but its own slot "
                        f"is {own} (block {table[p // block_size]}, offset {p % block_size})")
        if seq_len > meta.max_seq_len:
            return f"sequence row {b} has {seq_len} tokens, more than max_seq_len={meta.max_seq_len}"
    if max(decode_lens, default=0) > meta.max_decode_seq_len:
        return f"a decode row has {max(decode_lens)} tokens, more than max_decode_seq_len={meta.max_decode_seq_len}"
    return None


class PagedAttention:
    """The attention backend for a step: write this step's K/V, then attend over the cache. Where
    the pool is checked (`KVCache.checked`), the step's metadata is checked against it first."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata):
        self.cache, self.meta = cache, meta
        if cache.checked and not (meta.slot_mapping.is_cuda and torch.cuda.is_current_stream_capturing()):
            check_metadata(meta, cache.num_blocks, cache.block_size, type(self).__name__)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return self.cache.windows

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer_idx, self.meta.slot_mapping, k, v)
        k_cache, v_cache = self.cache.layer(layer_idx)
        return paged_attention(q, k_cache, v_cache, self.meta, self.cache.windows[layer_idx] if self.cache.windows else None)
