"""Phase 4's Triton kernels: the KV-cache write, and one paged attention kernel for a flat batch.

Three kernels, each launched from a small Python function of the same name:

- `reshape_and_cache`: one program per new token writes its K and V, all KV heads, into the
  cache slot `slot_mapping` names; a slot of -1 (padding) is skipped.
- `unified_attention`: one launch for the whole step, prefill chunks and decodes together, driven
  by `query_start_loc`, `seq_lens` and `block_tables` (phase 2's `AttentionMetadata`). A program
  takes a *query tile* (BLOCK_Q consecutive queries of one sequence, times the GROUP query heads
  that share one KV head: BLOCK_M = BLOCK_Q * GROUP rows) and walks that sequence's blocks
  through its block table, one block of keys and values at a time, with the online softmax.
  Blocks wholly below the diagonal are attended without a mask, the blocks that cross it with
  the causal mask, and blocks wholly in the future are never loaded.
- split-KV (flash-decoding): when a decode batch has too few (sequence, KV head) pairs to fill
  the GPU, each sequence's blocks are cut into `num_kv_splits` segments attended by separate
  programs; each writes its partial output and its log-sum-exp, and `merge_attn_states` merges
  them. The rule is `choose_num_kv_splits`.

The cache is read in one place (`read_kv_block`) and written in one place (`write_kv`), and
the kernels call both through `tl.constexpr` arguments (`LOAD_KV`, `STORE_KV`: a `@triton.jit`
function is a compile-time constant): an extension point. Another cache layout passes its own
pair, and its *side data* (a tensor per K and per V, (num_blocks, block_size, KVH), that the
pair may read and write beside the values), without a copy of the kernels. The plain pair is
compiled in by default, with no side data.

On a CPU these run only under Triton's interpreter, which must be switched on *before* Triton is
imported (`TRITON_INTERPRET=1`): `@triton.jit` decides at import time whether a kernel is compiled
or interpreted. `interpreter_active()` tells which happened.

Layouts (phase 2's): q, out (N, H, d); new k, v (N, KVH, d); k_cache, v_cache
(num_blocks, block_size, KVH, d), last dimension contiguous.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# The most segments split-KV cuts a sequence into, and the fewest blocks a segment gets: a
# segment much shorter than that costs more in partial results and merging than it saves.
MAX_KV_SPLITS = 16
MIN_BLOCKS_PER_SPLIT = 8
# Decode programs split-KV aims at per SM. A decode program is small (a 16-row tile, two warps)
# and waits on memory most of the time, so an SM needs many of them in flight; on an H100 the
# sweep in the lesson found the fastest split at 64 x 4,096 tokens where this rule puts it.
PROGRAMS_PER_SM = 16
# Launch options of a decode step (a 16 x 16 score tile): two warps and two stages were the
# fastest, or within 7% of it, at every decode shape of that sweep (Triton's defaults are four
# warps and three stages).
DECODE_NUM_WARPS, DECODE_NUM_STAGES = 2, 2
# On a CPU (the interpreter) there are no SMs to fill; this stands in for their number so the
# rule gives the same kind of answer it gives on a small GPU.
INTERPRETER_NUM_SMS = 4


def interpreter_active() -> bool:
    """Whether this module's kernels run in Triton's interpreter (TRITON_INTERPRET=1 was set
    before Triton was imported) rather than compiled."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(reshape_and_cache_kernel, InterpretedFunction)


# -- the KV-cache write -----------------------------------------------------------------------
@triton.jit
def write_kv(k, v, k_cache_ptr, v_cache_ptr, k_side_ptr, v_side_ptr, dst, side_dst, mask, head_ok):
    """Store one token's K and V, (KVH_P2, HEAD_P2) each, at offsets `dst` (under `mask`): the only
    place the kernels write the cache. The side-data arguments (offsets `side_dst`, (KVH_P2, 1),
    under `head_ok`) are for another layout's `STORE_KV`: unused here."""
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def reshape_and_cache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_side_ptr, v_side_ptr,
                              slot_mapping_ptr, num_kv_heads, head_dim,
                              stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
                              BLOCK_SIZE: tl.constexpr, KVH_P2: tl.constexpr, HEAD_P2: tl.constexpr,
                              STORE_KV: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padded row: nothing to store
        return
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    h = tl.arange(0, KVH_P2)[:, None]                  # (KVH_P2, 1): every KV head at once
    d = tl.arange(0, HEAD_P2)[None, :]                 # (1, HEAD_P2): padded to a power of two
    mask = (h < num_kv_heads) & (d < head_dim)
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    dst = block * stride_cb + offset * stride_ct + h * stride_ch + d
    side_dst = block * stride_sb + offset * stride_st + h   # the (token, head) entry of side data
    STORE_KV(k, v, k_cache_ptr, v_cache_ptr, k_side_ptr, v_side_ptr, dst, side_dst, mask,
             h < num_kv_heads)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_side: torch.Tensor | None = None,
                      v_side: torch.Tensor | None = None, store_kv=None) -> None:
    """Write new tokens' K/V into the paged cache, in place.

    k, v: (N, KVH, d); k_cache, v_cache: (num_blocks, block_size, KVH, d), with the same strides;
    slot_mapping: (N,) int, slot = block_id * block_size + offset, or -1 to skip the token.
    k_side, v_side, store_kv: another cache layout's side data, (num_blocks, block_size, KVH)
    each, and the `@triton.jit` function that stores into it (`write_kv`'s arguments); None:
    the values are stored as they are.
    """
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    n, kvh, d = k.shape
    if n == 0:
        return
    k_side, v_side, stride_sb, stride_st = _side_data(k_side, v_side, k_cache, v_cache)
    reshape_and_cache_kernel[(n,)](
        k, v, k_cache, v_cache, k_side, v_side, slot_mapping, kvh, d,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_sb, stride_st,
        BLOCK_SIZE=k_cache.shape[1], KVH_P2=triton.next_power_of_2(kvh),
        HEAD_P2=triton.next_power_of_2(d), STORE_KV=store_kv or write_kv)


def _side_data(k_side, v_side, k_cache, v_cache) -> tuple:
    """The side-data arguments of a launch: the tensors and their block and token strides (the
    KV head's is 1), or, with none, the cache itself (unused) and 0s."""
    if k_side is None:
        return k_cache, v_cache, 0, 0
    assert k_side.stride() == v_side.stride() and k_side.stride(-1) == 1
    return k_side, v_side, k_side.stride(0), k_side.stride(1)


# -- paged attention --------------------------------------------------------------------------
@triton.jit
def _find_seq_idx(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence a query tile belongs to. Sequence s's tiles are numbered from
    query_start_loc[s] // BLOCK_Q + s (an upper bound on the tiles before it, so no two sequences
    share a number), and those first numbers increase with s: a binary search finds the last s
    whose first number is <= tile_idx."""
    lo: tl.int32 = 0  # typed: a loop-carried variable must keep one type when compiled
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def read_kv_block(k_cache_ptr, v_cache_ptr, k_side_ptr, v_side_ptr, block, kv_head, k_pos, seq_len,
                   head_dim, stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
                   BLOCK_SIZE: tl.constexpr, HEAD_P2: tl.constexpr):
    """One block of K and V for one KV head, (BLOCK_SIZE, HEAD_P2) each: the only place the
    kernels read the cache. Slots past seq_len (the unused end of the last block) read as 0. The
    side-data arguments are for another layout's `LOAD_KV`: unused here."""
    n = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_P2)
    offsets = block * stride_cb + n[:, None] * stride_ct + kv_head * stride_ch + d[None, :]
    mask = (k_pos < seq_len)[:, None] & (d < head_dim)[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
    return k, v


@triton.jit
def _attend_block(q, acc, m_i, l_i, j, k_cache_ptr, v_cache_ptr, k_side_ptr, v_side_ptr,
                  block_table_ptr, kv_head, q_pos, q_first, seq_len, qk_scale, head_dim,
                  stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
                  BLOCK_SIZE: tl.constexpr, HEAD_P2: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                  IEEE_DOT: tl.constexpr, LOAD_KV: tl.constexpr):
    """Fold block j of the sequence into the running (acc, m_i, l_i): one online-softmax step.
    q_first: each row's first visible key (0, or the start of its sliding window)."""
    # >>> exercise attend_block (3 stars): One block of keys in the online softmax: scores, a new running max, rescale the sum and the accumulator, add this block's exp-weighted values.
    # hint: work in log2 units (qk_scale already holds log2(e)): p = exp2(s - m_new), alpha = exp2(m_i - m_new); mask keys past seq_len (and, if MASK, after the query's position) to -inf before the max.
    # checked by: test_kernel_in_interpreter, test_engine_in_interpreter_gives_phase3_tokens
    block = tl.load(block_table_ptr + j).to(tl.int64)             # through the block table
    k_pos = j * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)              # (BLOCK_SIZE,) key positions
    k, v = LOAD_KV(k_cache_ptr, v_cache_ptr, k_side_ptr, v_side_ptr, block, kv_head, k_pos, seq_len,
                   head_dim, stride_cb, stride_ct, stride_ch, stride_sb, stride_st, BLOCK_SIZE, HEAD_P2)
    k, v = k.to(q.dtype), v.to(q.dtype)  # no-ops here; another layout's loader may give float32
    if IEEE_DOT:  # float32: true float32 products (a GPU's tl.dot would round them to TF32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale                      # (BLOCK_M, BLOCK_SIZE), log2 units
    if CAUSAL_MASK:  # only the blocks that cross the diagonal (or hold the end of the sequence)
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
        visible = visible & (k_pos[None, :] >= q_first[:, None])      # a sliding window's start
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))                     # (BLOCK_M,) running max
    # a row that has seen no visible key yet keeps m = -inf; subtract 0 there, not -inf (NaN)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])                               # (BLOCK_M, BLOCK_SIZE)
    alpha = tl.exp2(m_i - m_safe)                                  # rescales what came before
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i
    # <<< exercise attend_block


@triton.jit
def unified_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_side_ptr, v_side_ptr, block_tables_ptr,
        seq_lens_ptr, query_start_loc_ptr, part_out_ptr, part_lse_ptr,
        qk_scale, num_seqs, num_query_heads, head_dim, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_sb,
        stride_st, stride_bt,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HEAD_P2: tl.constexpr, NUM_SPLITS: tl.constexpr,
        IEEE_DOT: tl.constexpr, LOAD_KV: tl.constexpr):
    tile_idx = tl.program_id(0)   # a query tile, numbered across the whole flat batch
    kv_head = tl.program_id(1)
    split = tl.program_id(2)      # the KV segment (always 0 without split-KV)

    seq = _find_seq_idx(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q)
    seq_q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - seq_q_start
    q_start = (tile_idx - (seq_q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of the tile, in the chunk
    if q_start >= q_len:  # the grid is an upper bound on the tiles: this one has no queries
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this step's queries

    # the tile's rows: BLOCK_Q queries x the GROUP query heads of this KV head (GQA)
    m = tl.arange(0, BLOCK_M)
    q_idx = q_start + m // GROUP                      # (BLOCK_M,) query within the chunk
    head = kv_head * GROUP + m % GROUP                # (BLOCK_M,) query head
    d = tl.arange(0, HEAD_P2)
    row_ok = (m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_ok = d < head_dim                               # head_dim need not be a power of two
    q_rows = (seq_q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, HEAD_P2)
    q_pos = context_len + q_idx                       # (BLOCK_M,) absolute positions
    # a sliding window of `window` tokens (0: none): each row sees keys q_pos - window + 1 on
    q_first = tl.where(window > 0, tl.maximum(q_pos - window + 1, 0), 0)

    # which blocks: up to the tile's last query; the first num_full need no causal mask
    last_q_pos = context_len + tl.minimum(q_start + BLOCK_Q, q_len) - 1
    num_blocks = tl.cdiv(last_q_pos + 1, BLOCK_SIZE)   # later blocks: the future, never loaded
    num_full = (context_len + q_start + 1) // BLOCK_SIZE
    # with a window, blocks wholly before the tile's first query's window are never loaded, and
    # every block loaded is masked (a row's window starts inside any of them)
    first_block = tl.where(window > 0, tl.maximum(context_len + q_start - window + 1, 0) // BLOCK_SIZE, 0)
    num_full = tl.where(window > 0, 0, num_full)
    lo = 0
    hi = num_blocks
    if NUM_SPLITS > 1:  # this program's segment of the blocks
        per_split = tl.cdiv(num_blocks, NUM_SPLITS)
        lo = split * per_split
        hi = tl.minimum(lo + per_split, num_blocks)
    lo = tl.maximum(lo, first_block)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)                # running sum of exp
    acc = tl.zeros([BLOCK_M, HEAD_P2], tl.float32)       # running weighted sum of V
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for j in range(lo, tl.minimum(hi, num_full)):
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, j, k_cache_ptr, v_cache_ptr, k_side_ptr,
                                      v_side_ptr, block_table_ptr, kv_head, q_pos, q_first, seq_len, qk_scale,
                                      head_dim, stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
                                      BLOCK_SIZE, HEAD_P2, False, IEEE_DOT, LOAD_KV)
    for j in range(tl.maximum(lo, num_full), hi):
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, j, k_cache_ptr, v_cache_ptr, k_side_ptr,
                                      v_side_ptr, block_table_ptr, kv_head, q_pos, q_first, seq_len, qk_scale,
                                      head_dim, stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
                                      BLOCK_SIZE, HEAD_P2, True, IEEE_DOT, LOAD_KV)

    store_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:  # a partial result: normalized output and log-sum-exp (natural log; -inf if empty)
        has_keys = l_i > 0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        row = q_rows * num_query_heads + head             # (token, head) as one index
        tl.store(part_out_ptr + (row[:, None] * NUM_SPLITS + split) * HEAD_P2 + d[None, :], out,
                 mask=store_mask)
        tl.store(part_lse_ptr + row * NUM_SPLITS + split, lse, mask=row_ok)


@triton.jit
def _merge_attn_states_kernel(out_ptr, part_out_ptr, part_lse_ptr, num_query_heads, head_dim,
                              stride_ot, stride_oh,
                              NUM_SPLITS: tl.constexpr, HEAD_P2: tl.constexpr):
    """One (token, head): its NUM_SPLITS partial outputs merged into the output row."""
    # >>> exercise merge_attn_states (2 stars): Merge one (token, head)'s split-KV partial results: weigh each segment's normalized output by its share of the softmax sum, from the log-sum-exps.
    # hint: row = token * num_query_heads + head; load the NUM_SPLITS lse values and the (NUM_SPLITS, HEAD_P2) outputs; weight = exp(lse - max lse) (an empty segment, lse -inf, weighs 0); out = sum(weight * part) / sum(weight); store the first head_dim values.
    # checked by: test_merge_attn_states_in_interpreter, test_kernel_in_interpreter
    token = tl.program_id(0)
    head = tl.program_id(1)
    row = token.to(tl.int64) * num_query_heads + head
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_P2)
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + s)                  # (NUM_SPLITS,)
    weight = tl.exp(lse - tl.max(lse, axis=0))                           # an empty segment: 0
    part = tl.load(part_out_ptr + (row * NUM_SPLITS + s[:, None]) * HEAD_P2 + d[None, :])
    out = tl.sum(weight[:, None] * part, axis=0) / tl.sum(weight, axis=0)  # (HEAD_P2,)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < head_dim)
    # <<< exercise merge_attn_states


def merge_attn_states(out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Merge split-KV partial results into `out`, in place.

    out: (N, H, d); part_out: (N, H, S, HEAD_P2) float32, each segment's output normalized by its
    own softmax sum; part_lse: (N, H, S) float32, each segment's log-sum-exp of the scores (-inf
    for a segment with no keys). The merged output weighs segment s by exp(lse_s - max lse):
    softmax over all keys, rebuilt from its pieces.
    """
    n, h, d = out.shape
    num_splits = part_lse.shape[-1]
    _merge_attn_states_kernel[(n, h)](out, part_out, part_lse, h, d, out.stride(0), out.stride(1),
                                      NUM_SPLITS=num_splits, HEAD_P2=part_out.shape[-1])


def choose_num_kv_splits(max_query_len: int, num_seqs: int, num_kv_heads: int, max_seq_len: int,
                         block_size: int, num_sms: int) -> int:
    """The split-KV rule: how many segments each sequence's blocks are cut into.

    Split only a batch of decodes (a prefill chunk brings enough query tiles of its own): its
    (sequence, KV head) pairs are one program each; split so that there are about
    PROGRAMS_PER_SM programs per SM, with at least MIN_BLOCKS_PER_SPLIT blocks per segment and at
    most MAX_KV_SPLITS segments, rounded down to a power of two (a compiled kernel per count).
    """
    programs = num_seqs * num_kv_heads
    if max_query_len > 1:
        return 1
    by_sms = -(-PROGRAMS_PER_SM * num_sms // programs)
    by_length = -(-max_seq_len // block_size) // MIN_BLOCKS_PER_SPLIT
    splits = min(MAX_KV_SPLITS, by_sms, by_length)
    return 1 if splits < 2 else 2 ** int(math.log2(splits))


def num_sms(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (INTERPRETER_NUM_SMS on a CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_NUM_SMS


def launch_options(max_query_len: int, num_warps: int | None, num_stages: int | None) -> dict:
    """Triton launch options: those asked for, else DECODE_NUM_WARPS/STAGES for a batch of
    decodes, else Triton's defaults."""
    if max_query_len == 1:
        num_warps = num_warps or DECODE_NUM_WARPS
        num_stages = num_stages or DECODE_NUM_STAGES
    return {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      max_query_len: int, max_seq_len: int, scale: float | None = None,
                      num_kv_splits: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, k_side: torch.Tensor | None = None,
                      v_side: torch.Tensor | None = None, load_kv=None, window: int | None = None) -> torch.Tensor:
    """Paged attention for a flat batch of prefill chunks and decodes, in one launch.

    q, out: (N, H, d); k_cache, v_cache: (num_blocks, block_size, KVH, d), holding every token of
    every sequence (this step's too: call `reshape_and_cache` first); query_start_loc (B+1,),
    seq_lens (B,), block_tables (B, M): int32, as in `AttentionMetadata`. max_query_len and
    max_seq_len (host ints) choose the tile shape and the split. num_kv_splits: None picks it by
    `choose_num_kv_splits`; a power of two forces it. num_warps, num_stages: Triton's launch
    options (None: `launch_options`' choice), for tuning sweeps. k_side, v_side, load_kv:
    another cache layout's side data, (num_blocks, block_size, KVH) each, and the `@triton.jit`
    function that reads a block of it (`read_kv_block`'s arguments); None: the cache is read as
    it is. window: the layer's sliding window in tokens (None: every earlier key). Returns out.
    """
    q = _last_dim_contiguous(q)
    n, h, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    if n == 0:
        return out
    group = h // kvh
    # the rows of a tile: 16 is the smallest tl.dot tile on a GPU; prefill tiles take more
    # queries per program (fewer programs, each K/V block shared by more rows)
    block_m = max(16 if max_query_len == 1 else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    num_seqs = seq_lens.shape[0]
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(max_query_len, num_seqs, kvh, max_seq_len, block_size,
                                             num_sms(q.device))
    head_p2 = triton.next_power_of_2(d)
    if num_kv_splits > 1:
        part_out = torch.empty(n, h, num_kv_splits, head_p2, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(n, h, num_kv_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    k_side, v_side, stride_sb, stride_st = _side_data(k_side, v_side, k_cache, v_cache)
    grid = (n // block_q + num_seqs, kvh, num_kv_splits)
    unified_attention_kernel[grid](
        out, q, k_cache, v_cache, k_side, v_side, block_tables, seq_lens, query_start_loc,
        part_out, part_lse,
        (scale if scale is not None else d ** -0.5) * 1.4426950408889634,  # log2(e): exp2 below
        num_seqs, h, d, window or 0, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_sb, stride_st,
        block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_SIZE=block_size, HEAD_P2=head_p2,
        NUM_SPLITS=num_kv_splits, IEEE_DOT=q.dtype == torch.float32, LOAD_KV=load_kv or read_kv_block,
        **launch_options(max_query_len, num_warps, num_stages))
    if num_kv_splits > 1:
        merge_attn_states(out, part_out, part_lse)
    return out


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
