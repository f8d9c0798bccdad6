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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from phases.p01_naive_attention import causal_attention

from .kv_cache import KVCache


@dataclass
class AttentionMetadata:
    """How the flat tokens of one step map to sequences and cache slots. Built once per step
    (`build`), read by every layer."""

    slot_mapping: torch.Tensor     # (N,) int64
    query_start_loc: list[int]     # (B+1,) sequence b's queries: [query_start_loc[b], query_start_loc[b+1])
    seq_lens: list[int]            # (B,) cached tokens of each sequence after this step
    block_tables: torch.Tensor     # (B, M) int64, padded with 0
    prefill_rows: list[int]        # sequences with several queries (prompts, or chunks of them)
    # the decode rows (one query each), ready for decode_attention
    decode_token_idx: torch.Tensor     # (Bd,) their query's index in the flat batch
    decode_block_tables: torch.Tensor  # (Bd, M)
    decode_seq_lens: torch.Tensor      # (Bd,)

    @classmethod
    def build(cls, slot_mapping: list[int], query_lens: list[int], seq_lens: list[int],
              block_tables: list[list[int]], device: torch.device) -> "AttentionMetadata":
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], device=device)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        decode = [b for b, n in enumerate(query_lens) if n == 1]
        return cls(
            slot_mapping=torch.tensor(slot_mapping, device=device), query_start_loc=starts,
            seq_lens=seq_lens, block_tables=tables,
            prefill_rows=[b for b, n in enumerate(query_lens) if n != 1],
            decode_token_idx=torch.tensor([starts[b] for b in decode], device=device),
            decode_block_tables=tables[decode],
            decode_seq_lens=torch.tensor([seq_lens[b] for b in decode], device=device))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """q: (N, H, d); k_cache, v_cache: (num_blocks, block_size, KVH, d) -> (N, H, d)."""
    if not meta.prefill_rows:  # only decodes (most steps): no gather and scatter of the rows
        return decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens)
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts, lens = meta.query_start_loc, meta.seq_lens
    for b in meta.prefill_rows:  # long queries: one sequence at a time
        blocks = meta.block_tables[b, : -(-lens[b] // block_size)]
        k = k_cache[blocks].flatten(0, 1)[: lens[b]]                  # (L, KVH, d)
        v = v_cache[blocks].flatten(0, 1)[: lens[b]]
        qb = q[starts[b]: starts[b + 1]]
        out[starts[b]: starts[b + 1]] = causal_attention(qb, k, v, num_past=lens[b] - len(qb))
    if len(meta.decode_token_idx):
        idx = meta.decode_token_idx
        out[idx] = decode_attention(q[idx], k_cache, v_cache, meta.decode_block_tables,
                                    meta.decode_seq_lens)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """One query per sequence. q: (B, H, d); block_tables: (B, M); seq_lens: (B,) -> (B, H, d).

    Gather each sequence's blocks into a padded (B, T) batch, mask the padding, and let PyTorch's
    fused attention (`scaled_dot_product_attention`, grouped-query aware) do the math: the same
    softmax(q k^T / sqrt(d)) v as phase 1, without materializing the repeated K/V heads.
    """
    b, block_size = len(q), k_cache.shape[1]
    max_blocks = -(-int(seq_lens.max()) // block_size)
    ids = block_tables[:, :max_blocks].flatten()
    # gather each sequence's blocks, one after another (index_select: a plain copy of whole
    # blocks, several times faster on a CPU than k_cache[table] advanced indexing)
    k = k_cache.index_select(0, ids).view(b, max_blocks * block_size, *k_cache.shape[2:])
    v = v_cache.index_select(0, ids).view(b, max_blocks * block_size, *v_cache.shape[2:])
    k, v = k.transpose(1, 2), v.transpose(1, 2)                       # (B, KVH, T, d)
    # the slots past a sequence's length (the rest of its last block, padding blocks) are masked;
    # they hold finite values, zeros or an earlier request's K/V (see KVCache), so 0 * v stays 0
    valid = torch.arange(k.shape[2], device=q.device)[None, :] < seq_lens[:, None]  # (B, T)
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=valid[:, None, None, :],
                                         enable_gqa=True)             # (B, H, 1, d)
    return out[:, :, 0]


class PagedAttention:
    """The attention backend for a step: write this step's K/V, then attend over the cache."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata):
        self.cache, self.meta = cache, meta

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer_idx, self.meta.slot_mapping, k, v)
        k_cache, v_cache = self.cache.layer(layer_idx)
        return paged_attention(q, k_cache, v_cache, self.meta)
