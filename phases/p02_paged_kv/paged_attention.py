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
                                   _decode_inputs=None)

    def decode_inputs(self, block_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode_gather`'s block ids and mask for this step's decode rows: the same for every
        layer, so made once, by the first layer, and reused by the others."""
        if self._decode_inputs is None:
            self._decode_inputs = decode_gather(self.decode_block_tables, self.decode_seq_lens,
                                                block_size, dtype, self.max_decode_seq_len)
        return self._decode_inputs


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """q: (N, H, d); k_cache, v_cache: (num_blocks, block_size, KVH, d) -> (N, H, d)."""
    block_size = k_cache.shape[1]
    if not meta.prefill_rows:  # only decodes (most steps): no gather and scatter of the rows
        return decode_attention(q, k_cache, v_cache, *meta.decode_inputs(block_size, q.dtype))
    out = torch.empty_like(q)
    starts, lens = meta.query_start_loc, meta.seq_lens
    for b in meta.prefill_rows:  # long queries: one sequence at a time
        blocks = meta.block_tables[b, : -(-lens[b] // block_size)]
        k = k_cache[blocks].flatten(0, 1)[: lens[b]]                  # (L, KVH, d)
        v = v_cache[blocks].flatten(0, 1)[: lens[b]]
        qb = q[starts[b]: starts[b + 1]]
        out[starts[b]: starts[b + 1]] = causal_attention(qb, k, v, num_past=lens[b] - len(qb))
    if len(meta.decode_token_idx):
        idx = meta.decode_token_idx
        out[idx] = decode_attention(q[idx], k_cache, v_cache, *meta.decode_inputs(block_size, q.dtype))
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


class PagedAttention:
    """The attention backend for a step: write this step's K/V, then attend over the cache."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata):
        self.cache, self.meta = cache, meta

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer_idx, self.meta.slot_mapping, k, v)
        k_cache, v_cache = self.cache.layer(layer_idx)
        return paged_attention(q, k_cache, v_cache, self.meta)
