"""Phase 4's CPU path: PyTorch's fused attention over the paged cache, for prefill chunks too.

Triton cannot compile for a CPU, so on a CPU `attention_backend="auto"` runs this instead of the
kernels. What it changes from phase 2's `paged_attention`:

- A prefill chunk (a whole prompt, or a chunk with cached tokens before it) goes through
  `torch.nn.functional.scaled_dot_product_attention`, whose CPU kernel is a flash-attention
  loop (tiles of keys, online softmax): no (H, Tq, Tk) score matrix in memory, and the KV heads
  are read in place by every query head that shares them (`enable_gqa=True`) instead of being
  repeated. Phase 1's `causal_attention` built the whole score matrix with repeated heads.
- The causal mask is *lower-right* aligned: the chunk's Tq queries are the last Tq of the Tk
  keys, so query i sees keys 0 .. Tk - Tq + i. A prompt with nothing cached (Tq == Tk) takes
  SDPA's own `is_causal=True`, which skips the tiles above the diagonal without any mask tensor.
  A chunk after cached keys takes no mask either (given one, the kernel scores every tile): the
  cached keys in one call, the chunk's own causally in another, merged by their log-sum-exps, as
  split-KV merges its segments; on a GPU's tensors (a reference in tests) SDPA with the mask.
- A prompt with nothing cached attends over the K/V it just computed: no read of the cache.
- In float32, where the platform's `c_prefill` rule says (the kinds it was measured on), a chunk of at least
  `PREFILL_MIN_QUERIES` queries goes instead through `cpu_attention.c`'s
  `causal_prefill_attention`: the same loop in register tiles, lower-right causal in one call,
  faster than SDPA at every prompt length measured (the lab note's table); fewer queries after
  cached tokens (a speculative verify) through its decode kernel, a row per query, over the
  block table in place (`c_tail_attention`). Where the engine multiplies in bfloat16
  (`dtype="auto"` where the platform's `bf16_prefill` rule says), so do a prompt's attention
  products: the same loop's (`causal_prefill_attention_bf16`, AVX512-BF16) where the prefill is
  the C kernel's, else on tinyvllm's own AMX tiles where they run (the amx kind: `amx_attention`,
  cpu_amx.c; a chunk after cached keys over the keys gathered from its blocks), else SDPA's over
  bfloat16 copies; the softmax stays float32.
- Decodes attend in `cpu_attention.c`, one call per layer for all of a step's decode rows, over
  the block table in place: no padded gather, no mask, where phase 2's `decode_attention` makes
  about ten operator calls (float32 cache, AVX2; elsewhere phase 2's). In a step of decodes only
  the same call first writes the new K/V.

Shapes follow phase 2: q (N, H, d); k_cache, v_cache (num_blocks, block_size, KVH, d).
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from phases.p01_naive_attention.attention import causal_attention
from phases.p02_paged_kv import AttentionMetadata, PagedAttention
from phases.p02_paged_kv.paged_attention import decode_attention, paged_attention
from tinyvllm import platform
from tinyvllm.ckernel import CKernel
from tinyvllm.hardware import AVX2_FLAGS, AVX512_BF16_FLAGS

from .cpu_amx import amx_attention

P, I64 = ctypes.c_void_p, ctypes.c_int64
# FETCH_AHEAD: the decode kernel asks for each next block of the cache while it reads one, where
# the platform's `decode_fetch_ahead` rule says (the same numbers either way)
KERNELS = CKernel(Path(__file__).with_name("cpu_attention.c"),
                  ["-O3", "-mavx2", "-mfma", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"], AVX2_FLAGS,
                  {"paged_decode_attention": [P] * 10 + [I64] * 7 + [ctypes.c_float],
                   "paged_window_decode_attention": [P] * 11 + [I64] * 7 + [ctypes.c_float],
                   "causal_prefill_attention": [P] * 5 + [I64] * 9 + [ctypes.c_float],
                   "causal_prefill_attention_bf16": [P] * 6 + [I64] * 9 + [ctypes.c_float]},
                  fallback="attention takes PyTorch's path (phase 2's decode_attention, SDPA)",
                  defines={"FETCH_AHEAD": "decode_fetch_ahead"})
PREFILL_KEYS = 64          # keys per tile in causal_prefill_attention (PREFILL_KEYS in the C)
# From how many queries a chunk takes the C prefill kernel: fewer after a long context (a
# prefix-cache hit, a speculative verify) leave two threads three tasks (one per KV head) and
# every key to transpose, where SDPA splits the work by query head (lab note 4)
PREFILL_MIN_QUERIES = 16
# The op SDPA's CPU flash kernel is: (q, k, v, dropout_p, is_causal) -> (out, logsumexp), the
# second the log of each query's sum of exp(score), which SDPA itself drops. Heads may be grouped.
FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def c_decode_runs(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """cpu_attention.c can attend here: float32 tensors in the CPU's memory and a cache in one
    piece, on an AVX2 CPU (a GPU's tensors go to phase 2's decode_attention)."""
    if not (q.is_cpu and k_cache.is_cpu):
        return False
    lib = KERNELS.lib if KERNELS.tried else KERNELS.load()   # built and loaded at the first call only
    return lib is not None and q.dtype == k_cache.dtype == torch.float32 and k_cache.is_contiguous()


def c_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                       window: int | None = None) -> torch.Tensor:
    """The decode rows' attention in one call of cpu_attention.c: q (B, H, d), the query of each
    of meta's decode rows -> (B, H, d). Given k, v (B, KVH, d) (a step of decodes only), the same
    call first writes them into meta.slot_mapping's slots. window: the layer's sliding window
    (None: every earlier key), each row then reading from its window's first key on."""
    starts = None
    if window is not None and window < meta.max_decode_seq_len:
        starts = (meta.decode_seq_lens - window).clamp_(min=0)
    return paged_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                        meta.max_decode_seq_len, k, v, meta.slot_mapping, starts)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, max_len: int, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                 slots: torch.Tensor | None = None, starts: torch.Tensor | None = None) -> torch.Tensor:
    """cpu_attention.c's `paged_decode_attention`: q (B, H, d), row b seeing the first lens[b]
    keys (int64, at most max_len) of the blocks listed by tables[b] (B, M) int64, rows any number
    of entries apart (0: one table for all) -> (B, H, d); given k, v, first writes them to slots.
    Given starts (B,) int64, row b sees only its keys from starts[b] on (`paged_window_decode_attention`)."""
    q, lens = q.contiguous(), lens.contiguous()
    (b, h, d), (block_size, kvh) = q.shape, k_cache.shape[1:3]
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    write = k is not None
    if write:
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    scores = torch.empty(b * h * max_len)
    lib = KERNELS.lib or KERNELS.load()
    head = (q.data_ptr(), k.data_ptr() if write else None, v.data_ptr() if write else None, k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr() if write else None, tables.data_ptr(), lens.data_ptr())
    tail = (out.data_ptr(), scores.data_ptr(), b, h, kvh, d, block_size, tables.stride(0), max_len, 1 / math.sqrt(d))
    if starts is None:
        lib.paged_decode_attention(*head, *tail)
    else:
        starts = starts.contiguous()
        lib.paged_window_decode_attention(*head, starts.data_ptr(), *tail)
    return out


def c_prefill_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
    """cpu_attention.c's prefill kernel takes this chunk: float32 tensors in the CPU's memory, each
    token's heads in one piece, d a multiple of 16, at least PREFILL_MIN_QUERIES queries, the
    library built."""
    return (all(x.is_cpu and x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
                for x in (q, k, v, out)) and q.shape[2] % 16 == 0 and q.shape[0] >= PREFILL_MIN_QUERIES
            and (KERNELS.lib if KERNELS.tried else KERNELS.load()) is not None)


def c_bf16_built() -> bool:
    """The C prefill kernel's bfloat16 loop can run here: AVX512-BF16 on this platform's kind, and
    the library built by a compiler that knows those instructions."""
    lib = (KERNELS.lib if KERNELS.tried else KERNELS.load()) if platform.current().has(AVX512_BF16_FLAGS) else None
    return lib is not None and ctypes.c_int.in_dll(lib, "bf16_prefill_built").value == 1


def prefill_paths() -> tuple[bool, bool]:
    """(c_prefill, bf16_prefill) on this platform: whether a float32 prompt's attention takes
    cpu_attention.c's prefill kernel, and whether a prompt's attention may multiply in bfloat16
    where the engine's products do (through the C kernel's bfloat16 loop where the prefill is the
    C kernel's, AMX tiles or SDPA elsewhere)."""
    p = platform.current()
    c_prefill = bool(p.rule("c_prefill"))
    return c_prefill, bool(p.rule("bf16_prefill")) and (not c_prefill or c_bf16_built())


def c_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        bf16: bool = False) -> torch.Tensor:
    """`prefill_attention` in one call of cpu_attention.c, written into out: q, out (Tq, H, d);
    k, v (Tk, KVH, d), Tk >= Tq, the queries the last Tq of the keys (see c_prefill_runs).
    bf16: its products in bfloat16 (where `prefill_paths` says; d a multiple of 32)."""
    (tq, h, d), (tk, kvh) = q.shape, k.shape[:2]
    size = kvh * -(-tk // PREFILL_KEYS) * PREFILL_KEYS * d
    if bf16:   # the keys' and the values' bfloat16 pairs, tile by tile
        kt, vt = torch.empty(size // 2, dtype=torch.int32), torch.empty(size // 2, dtype=torch.int32)
        (KERNELS.lib or KERNELS.load()).causal_prefill_attention_bf16(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), kt.data_ptr(), vt.data_ptr(), tq, tk, h, kvh,
            d, q.stride(0), k.stride(0), v.stride(0), out.stride(0), 1 / math.sqrt(d))
        return out
    kt = torch.empty(size)   # the keys transposed, tile by tile
    (KERNELS.lib or KERNELS.load()).causal_prefill_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), kt.data_ptr(), tq, tk, h, kvh, d, q.stride(0),
        k.stride(0), v.stride(0), out.stride(0), 1 / math.sqrt(d))
    return out


def c_tail_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                     seq_len: int) -> torch.Tensor:
    """A few queries after cached keys (a speculative verify, a prefix hit's short tail), their K/V
    in the cache: cpu_attention.c's decode kernel, each query one decode row, query i seeing the
    first seq_len - Tq + i + 1 keys of the blocks `table` (M,) lists (every row reads that one
    table: rows 0 apart), in place. q (Tq, H, d) -> (Tq, H, d)."""
    tq = q.shape[0]
    return paged_decode(q, k_cache, v_cache, table.expand(tq, -1), torch.arange(seq_len - tq + 1, seq_len + 1),
                        seq_len)


def decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The decode rows' attention (their K/V already in the cache): cpu_attention.c where it
    runs, phase 2's `decode_attention` elsewhere."""
    if c_decode_runs(q, k_cache):
        return c_decode_attention(q, k_cache, v_cache, meta)
    return decode_attention(q, k_cache, v_cache, *meta.decode_inputs(k_cache.shape[1], q.dtype))


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of Tq queries that are the last Tq of Tk keys, with grouped-query heads.

    q: (Tq, H, d); k, v: (Tk, KVH, d), Tk >= Tq -> (Tq, H, d).
    """
    # >>> exercise prefill_attention (3 stars): A prefill chunk's attention through PyTorch's fused SDPA: Tq queries that are the last Tq of Tk keys, causal, grouped-query heads; after cached keys, two maskless calls merged by their log-sum-exps on a CPU.
    # hint: SDPA wants (1, heads, T, d): transpose and add a batch dimension; with Tq == Tk is_causal=True works. With Tk > Tq on a CPU: FLASH over the Tk - Tq cached keys (no mask) and over the chunk's own Tq keys (is_causal), then lerp(own, past, sigmoid(lse_past - lse_own)) in float32; elsewhere a lower-right mask, tril(diagonal=Tk - Tq). enable_gqa=True.
    # checked by: test_a_chunk_after_cached_keys_merges_two_maskless_calls, test_cpu_path_equals_phase3_attention, test_cpu_engine_equals_phase3_with_chunks_and_prefix_hits
    tq, tk = q.shape[0], k.shape[0]
    # SDPA wants (batch, heads, tokens, d); its CPU flash kernel takes the 4-D form (a 3-D input
    # goes to the slower unfused path): a batch of one, and transposed views, no copies
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, H or KVH, T, d)
    if tq == tk:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    elif q.is_cpu:
        # every cached key is seen, so that part needs no mask; the chunk's own keys are causal,
        # upper-left = lower-right for a square. Each part is a softmax over its own keys; the
        # whole softmax weighs them by their sums of exp(score): exp(lse_past) against exp(lse_own)
        c = tk - tq
        own, lse_own = FLASH(qh, kh[:, :, c:], vh[:, :, c:], 0.0, True)     # (1, H, Tq, d), (1, H, Tq)
        past, lse_past = FLASH(qh, kh[:, :, :c], vh[:, :, :c], 0.0, False)
        share = torch.sigmoid(lse_past - lse_own)[..., None]             # the cached part's, float32
        out = torch.lerp(own.float(), past.float(), share).to(q.dtype)
    else:
        # lower-right: query i sits at position tk - tq + i (SDPA's is_causal is upper-left)
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)                              # (Tq, H, d)
    # <<< exercise prefill_attention


def cpu_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata, c_prefill: bool | None = None,
                        bf16_prefill: bool = False) -> torch.Tensor:
    """Attention for one step's flat batch on a CPU (the new K/V already written to the cache).

    q: (N, H, d); k, v: (N, KVH, d), this step's new keys and values (a prompt with nothing
    cached attends over these directly); k_cache, v_cache: (num_blocks, block_size, KVH, d)
    -> (N, H, d). c_prefill: a float32 prefill chunk through cpu_attention.c's kernel (None: where
    the platform's rule says; False keeps every chunk on SDPA, which `tinyvllm bench kernels` times
    beside it); bf16_prefill: the prefill chunks' products in bfloat16, the C kernel's (d a
    multiple of 32), else AMX tiles or SDPA's over bfloat16 copies.
    """
    if c_prefill is None:
        c_prefill = prefill_paths()[0]
    block_size = k_cache.shape[1]
    if not meta.prefill_rows:  # only decodes (most steps)
        return decode_rows(q, k_cache, v_cache, meta)
    out = torch.empty_like(q)
    starts, lens = meta.query_start_loc, meta.seq_lens
    for b in meta.prefill_rows:
        rows = slice(starts[b], starts[b + 1])
        tq = starts[b + 1] - starts[b]
        if c_prefill and tq < min(lens[b], PREFILL_MIN_QUERIES) and c_decode_runs(q, k_cache):
            # a few queries after cached keys: as decodes, in place
            out[rows] = c_tail_attention(q[rows], k_cache, v_cache, meta.block_tables[b], lens[b])
            continue
        if lens[b] == tq:  # nothing cached before: the new K/V is all of it
            kb, vb = k[rows], v[rows]
        else:  # cached tokens first: read this sequence's blocks, in order
            blocks = meta.block_tables[b, : -(-lens[b] // block_size)]
            kb = k_cache.index_select(0, blocks).flatten(0, 1)[: lens[b]]   # (L, KVH, d)
            vb = v_cache.index_select(0, blocks).flatten(0, 1)[: lens[b]]
        if c_prefill and c_prefill_runs(q[rows], kb, vb, out[rows]):
            c_prefill_attention(q[rows], kb, vb, out[rows], bf16_prefill and q.shape[2] % 32 == 0)
        elif bf16_prefill and (amx := amx_attention(q[rows], kb, vb, out[rows])) is not None:
            if amx.data_ptr() != out[rows].data_ptr():           # on AMX tiles (after cached keys too)
                out[rows] = amx
        elif bf16_prefill and not c_prefill:                     # SDPA's products on bfloat16 copies
            out[rows] = prefill_attention(*(x.to(torch.bfloat16) for x in (q[rows], kb, vb)))
        else:
            out[rows] = prefill_attention(q[rows], kb, vb)
    if len(meta.decode_token_idx):
        idx = meta.decode_token_idx
        out[idx] = decode_rows(q[idx], k_cache, v_cache, meta)
    return out


class CpuPagedAttention(PagedAttention):
    """Phase 2's backend (same cache write) with `cpu_paged_attention` for the attending; a step
    of decodes only is one call of `c_decode_attention` (phase 2's, whole, where it cannot run).
    c_prefill, bf16_prefill: `cpu_paged_attention`'s, chosen when the recipe builds the part. A
    bfloat16 model over a float32 pool attends in float32 (its q, k and v made float32, exactly),
    its output rounded back to bfloat16."""

    def __init__(self, cache, meta: AttentionMetadata, c_prefill: bool = True, bf16_prefill: bool = False):
        super().__init__(cache, meta)                                        # (phase 2's: checked mode too)
        self.c_prefill, self.bf16_prefill = c_prefill, bf16_prefill

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.dtype != self.cache.kv.dtype:   # a bfloat16 model over a float32 pool (phase 4's `float32_kv`)
            return self(layer_idx, q.float(), k.float(), v.float()).to(q.dtype)
        window = self.windows[layer_idx] if self.windows else None
        if not self.meta.prefill_rows:
            k_cache, v_cache = self.cache.layer(layer_idx)
            if c_decode_runs(q, k_cache):   # the write and the attention in one call
                return c_decode_attention(q, k_cache, v_cache, self.meta, k, v, window)
            return super().__call__(layer_idx, q, k, v)
        self.cache.write(layer_idx, self.meta.slot_mapping, k, v)
        k_cache, v_cache = self.cache.layer(layer_idx)
        return cpu_prompt_attention(q, k, v, k_cache, v_cache, self.meta, window, self.c_prefill, self.bf16_prefill)


def cpu_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, meta: AttentionMetadata, window: int | None = None,
                         c_prefill: bool | None = None, bf16_prefill: bool = False) -> torch.Tensor:
    """A step with prompts, its K/V written: `cpu_paged_attention`; a layer with a sliding window
    through phase 2's paged attention in that window, each prompt's queries in tiles over the
    keys their windows reach (`window_prefill_attention`)."""
    if window is not None:
        return paged_attention(q, k_cache, v_cache, meta, window, window_prefill_attention)
    return cpu_paged_attention(q, k, v, k_cache, v_cache, meta, c_prefill, bf16_prefill)


WINDOW_TILE = 256   # queries per SDPA call of a windowed prompt (128-512 within 20% at 4,096 tokens)


def window_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_past: int = 0,
                             window: int | None = None) -> torch.Tensor:
    """Phase 1's `causal_attention` (q (Tq, H, d) at positions num_past.., k, v (Tk, KVH, d)), by
    tiles of WINDOW_TILE queries, each one SDPA call over the keys its window reaches (masked to
    each query's): Tq * (window + tile) scores, not Tq * Tk."""
    if window is None:
        return causal_attention(q, k, v, num_past)
    out = torch.empty_like(q)
    for t0 in range(0, q.shape[0], WINDOW_TILE):
        t1 = min(q.shape[0], t0 + WINDOW_TILE)
        first, last = num_past + t0, num_past + t1 - 1               # the tile's queries' positions
        k0 = max(0, first - window + 1)                               # the first key any of them sees
        q_pos = torch.arange(first, last + 1, device=q.device)[:, None]
        k_pos = torch.arange(k0, last + 1, device=q.device)[None, :]
        seen = (k_pos <= q_pos) & (k_pos > q_pos - window)            # (tile, keys): True where attended
        qh, kh, vh = (x.transpose(0, 1)[None] for x in (q[t0:t1], k[k0:last + 1], v[k0:last + 1]))
        out[t0:t1] = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seen, enable_gqa=True)[0].transpose(0, 1)
    return out


def attention_row(attention) -> torch.Tensor | None:
    """The step's attention as a C caller reads it (phase 7's compiled step and its cpu_step.c),
    where it is decodes through `CpuPagedAttention` with cpu_attention.c over a float32 cache:
    the C function, the step's slots, block table (and its row stride), lengths and longest
    length (the static buffers' tensors, contiguous: read in place), the block size, KV heads,
    and where the cache starts and each layer's K and V lie in it; then, for a model with sliding
    windows, each layer's window (0: none), the C function that starts each row at its window
    (`paged_window_decode_attention`) and room for those starts (0, 0, 0 without windows: the
    tensors hang on the row, alive while it is); last, where each layer's own slots and tables
    lie when its group of layers has its own (0 here: every layer reads the step's; phase 11
    fills it). None for any other step or attention part."""
    if type(attention) is not CpuPagedAttention or attention.meta.prefill_rows:
        return None
    meta, kv = attention.meta, attention.cache.kv        # kv: (layers, 2, blocks, block_size, KVH, d)
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    if not c_decode_runs(kv, kv) or tables.stride(1) != 1 or not lens.is_contiguous():
        return None
    windowed = [0, 0, 0]
    if any(attention.windows or ()):
        windows = torch.tensor([w or 0 for w in attention.windows], dtype=torch.int64)
        starts = torch.zeros(len(lens), dtype=torch.int64)
        windowed = [windows.data_ptr(), KERNELS.address("paged_window_decode_attention"), starts.data_ptr()]
    row = torch.tensor([KERNELS.address("paged_decode_attention"), meta.slot_mapping.data_ptr(), tables.data_ptr(),
                        tables.stride(0), lens.data_ptr(), meta.max_decode_seq_len, *kv.shape[3:5], kv.data_ptr(),
                        *kv.stride()[:2], *windowed, 0])
    if windowed[0]:
        row.windows, row.starts = windows, starts
    return row
