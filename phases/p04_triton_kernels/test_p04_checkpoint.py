"""Phase 4 checkpoint, the engine and its CPU path (no Triton interpreter in this process; the
kernels' checks are in test_p04_kernels.py).

- the CPU path gives phase 3's attention on mixed batches (prompts, chunks after cached tokens,
  decodes), with grouped-query heads;
- the engine picks the backend from `attention_backend`, and refuses one it cannot run, with an
  error naming the argument, while an LLM built before keeps generating;
- greedy tokens and seeded samples equal phase 3's with chunked prefill and prefix-cache hits.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import subprocess
import types

import pytest
import torch

from conftest import BAD_STEPS
from phases.p02_paged_kv import KVCache, PagedAttention, paged_attention
from phases.p04_triton_kernels import (
    CpuPagedAttention,
    TritonPagedAttention,
    cpu_attention,
    cpu_paged_attention,
    prefill_attention,
)
from phases.p04_triton_kernels.cpu_attention import (
    KERNELS,
    c_decode_attention,
    c_decode_runs,
    c_prefill_attention,
)
from phases.p04_triton_kernels.tools.kernel_cases import (
    DECODES,
    MIXED,
    engine_tokens,
    make_batch,
)
from tinyvllm import LLM, SamplingParams, platform
from tinyvllm.ckernel import CKernel

pytestmark = pytest.mark.kinds   # paths the platform chooses by CPU kind (make test-kinds)


@pytest.mark.parametrize("batch", [MIXED, DECODES, [("bs+3", "bs+3")], [("2*bs+9", 8)], [("3*bs+9", 20)],
                                   [("40*bs+9", 5), ("bs+2", 1)]],
                         ids=["mixed", "decodes", "one-prompt", "chunk-after-cache", "longer-chunk-after-cache",
                              "tail-after-long-cache"])
@pytest.mark.parametrize("bs,d,group,kvh", [(16, 64, 1, 2), (16, 80, 3, 2), (32, 64, 8, 1)])
@pytest.mark.parametrize("prefill", ["c", "sdpa"])
def test_cpu_path_equals_phase3_attention(monkeypatch, batch, bs, d, group, kvh, prefill):
    """The prefill chunks through cpu_attention.c's kernels (where they run: a few queries after
    cached keys as decode rows, split into segments after a long context) and through
    `prefill_attention` (SDPA): both phase 3's attention."""
    meta, k_cache, v_cache, g = make_batch(batch, bs, kvh, d, torch.float32, "cpu")
    n = len(meta.slot_mapping)
    q = torch.randn(n, group * kvh, d, generator=g)
    k, v = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
    k_cache.view(-1, kvh, d)[meta.slot_mapping] = k   # the step's write, as the backend does first
    v_cache.view(-1, kvh, d)[meta.slot_mapping] = v
    ref = paged_attention(q, k_cache, v_cache, meta)
    out = cpu_paged_attention(q, k, v, k_cache, v_cache, meta, c_prefill=prefill == "c")
    # float32, one fused kernel against another order of the same sums: a few ulps
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=lambda m: (
        f"blocks of {bs}, d={d}, {group} query heads per KV head, prompts through "
        f"{'cpu_attention.c' if prefill == 'c' else 'prefill_attention'}, against phase 3's attention: {m}"))


def _keys_part(q, k, v, causal: bool):
    """Attention of q over keys k, v (float64), and each row's log-sum-exp of scores: (Tq, H, d),
    (1, H, Tq). `causal`: query i sees keys 0..i (upper-left)."""
    h, kvh, d = q.shape[1], k.shape[1], q.shape[2]
    kk, vv = (x.double().repeat_interleave(h // kvh, 1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * d ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[1:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vv), torch.logsumexp(scores, dim=-1)[None]


def _what_it_equals(q, k, v, out, tol) -> str:
    """The common mistake whose result `out` is, if it is one of them ('' otherwise)."""
    def merged(own, lse_own, past, lse_past):   # the cached part weighs sigmoid(lse_past - lse_own)
        return torch.lerp(own, past, torch.sigmoid(lse_past - lse_own)[0].transpose(0, 1)[..., None])

    c = k.shape[0] - q.shape[0]
    own, lse_own = _keys_part(q, k[c:], v[c:], causal=True)
    loose, lse_loose = _keys_part(q, k[c:], v[c:], causal=False)
    mistakes = {"the chunk's own keys seen without the causal mask": loose}
    if c:
        past, lse_past = _keys_part(q, k[:c], v[:c], causal=False)
        bent, lse_bent = _keys_part(q, k[:c], v[:c], causal=True)
        mistakes = {"the chunk's own keys seen without the causal mask": merged(loose, lse_loose, past, lse_past),
                    "only the chunk's own keys attended (the cached keys left out)": own,
                    "only the cached keys attended": past,
                    "the cached keys masked causally (every query sees all of them)": merged(own, lse_own, bent, lse_bent),
                    "the two parts' weights swapped (the cached part weighs sigmoid(lse_past - lse_own))":
                        merged(own, lse_past, past, lse_own)}
    for why, want in mistakes.items():
        if torch.allclose(out.double(), want, atol=tol, rtol=tol, equal_nan=True):
            return f"; it is what {why} gives"
    return ""


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tq,tk", [(7, 40), (1, 9), (16, 17), (9, 9)])
def test_a_chunk_after_cached_keys_merges_two_maskless_calls(monkeypatch, dtype, tol, tq, tk):
    """On a CPU a chunk after cached keys builds no mask: the cached keys in one fused call, the
    chunk's own causally in another, merged by their log-sum-exps; the same attention as SDPA
    over a lower-right mask, computed in float64 (and a prompt with no cached keys before it, in
    one causal call)."""
    g = torch.Generator().manual_seed(tq * tk)
    q = torch.randn(tq, 6, 32, generator=g).to(dtype)
    k, v = (torch.randn(tk, 2, 32, generator=g).to(dtype) for _ in range(2))
    qh, kh, vh = (x.double().transpose(0, 1)[None] for x in (q, k, v))
    mask = torch.ones(tq, tk, dtype=torch.bool).tril(diagonal=tk - tq)
    ref = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    masked = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: masked.append(kw.get("attn_mask")) or sdpa(*a, **kw))
    out = prefill_attention(q, k, v)
    assert not [m for m in masked if m is not None], "a chunk on a CPU builds no mask: two maskless fused calls"
    assert out.dtype == dtype and out.shape == q.shape, (
        f"the output is the queries' shape and dtype, {tuple(q.shape)} {dtype}: got {tuple(out.shape)} {out.dtype}")
    want = ref[0].transpose(0, 1)
    err = (out.double() - want).abs().nan_to_num(float("inf")).max().item()
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol, msg=lambda _: (
        f"{tq} queries after {tk - tq} cached keys ({dtype}): largest error {err:.3g} against SDPA with a lower-right "
        f"causal mask (query i sees keys 0..{tk - tq} + i){_what_it_equals(q, k, v, out, tol)}"))


def float64_attention(q, k, v):
    """Causal attention of q (Tq, H, d), the last Tq of the keys k, v (Tk, KVH, d), in float64."""
    qh, kh, vh = (x.double().transpose(0, 1)[None] for x in (q, k, v))
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(diagonal=k.shape[0] - q.shape[0])
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.skipif(not KERNELS.available(), reason="cpu_attention.c needs an AVX2 CPU and a C compiler")
@pytest.mark.parametrize("tq,tk,h,kvh,d", [(1, 1, 9, 3, 64), (5, 5, 9, 3, 64), (70, 70, 9, 3, 64), (130, 300, 9, 3, 64),
                                           (7, 40, 6, 2, 32), (64, 129, 16, 8, 128), (50, 50, 8, 1, 16),
                                           (33, 97, 4, 4, 80)])
@pytest.mark.parametrize("spread", [1.0, 300.0])
def test_the_c_prefill_kernel_is_causal_attention(tq, tk, h, kvh, d, spread):
    """cpu_attention.c's prefill kernel against the attention in float64: chunks with and without
    cached keys, 1 to 8 query heads per KV head (a task's rows not a multiple of six), the last key
    tile part full, the queries a view with K/V beside them in each row (as the model's fused
    projection leaves them). Scores hundreds apart give no infinity or NaN, and errors of the size
    of SDPA's in float32 (`prefill_attention`): a score near 2,000 is known to about 1e-4."""
    g = torch.Generator().manual_seed(tq * tk + d)
    qkv = torch.randn(tk, h + 2 * kvh, d, generator=g)
    qkv[:, :h] *= spread
    q, k, v = qkv[tk - tq:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:]
    out = c_prefill_attention(q, k, v, torch.empty_like(q))
    ref = float64_attention(q, k, v)
    assert torch.isfinite(out).all()
    error, sdpa_error = ((x.double() - ref).abs().max() for x in (out, prefill_attention(q, k, v)))
    assert error <= max(2 * sdpa_error, 1e-4)
    if spread == 1.0:
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not KERNELS.available(), reason="cpu_attention.c needs an AVX2 CPU and a C compiler")
def test_the_c_prefill_kernel_gives_the_same_numbers_at_any_chunking():
    """A query's output depends on its own keys only, in tiles that start at key 0: a 300-token
    prompt's attention in one call equals, bit for bit, its three chunks' (100 tokens, then 37
    after them, then the rest after 137)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(300, heads, 64, generator=g) for heads in (9, 3, 3))
    whole = c_prefill_attention(q, k, v, torch.empty_like(q))
    chunks = torch.cat([c_prefill_attention(q[a:b], k[:b], v[:b], torch.empty_like(q[a:b]))
                        for a, b in [(0, 100), (100, 137), (137, 300)]])
    assert torch.equal(whole, chunks)


BF16_PREFILL = pytest.mark.skipif(not cpu_attention.c_bf16_built(),
                                  reason="the C prefill kernel's bfloat16 loop needs AVX512-BF16")


def bf16_rounded(*xs):
    return [x.bfloat16().float() for x in xs]


def c_bf16_way(q, k, v, bf16=True):
    if not cpu_attention.c_bf16_built():
        pytest.skip("the C prefill kernel's bfloat16 loop needs AVX512-BF16")
    return c_prefill_attention(q, k, v, torch.empty_like(q), bf16=bf16)


def sdpa_bf16_way(q, k, v, bf16=True):   # what cpu_paged_attention runs where the prefill is not the C kernel's
    return prefill_attention(*(x.bfloat16() if bf16 else x for x in (q, k, v))).float()


@pytest.mark.parametrize("way", [c_bf16_way, sdpa_bf16_way], ids=["c", "sdpa"])
@pytest.mark.parametrize("tq,tk,h,kvh,d", [(16, 16, 9, 3, 64), (70, 70, 9, 3, 64), (130, 300, 9, 3, 64),
                                           (64, 129, 16, 8, 128), (33, 97, 4, 4, 32), (40, 40, 8, 1, 64)])
@pytest.mark.parametrize("spread", [1.0, 300.0])
def test_the_bf16_prefill_kernel_errs_as_bfloat16_operands_do(way, tq, tk, h, kvh, d, spread):
    """A prompt's attention with its products in bfloat16 (the C kernel's loop, or SDPA's over
    bfloat16 copies), against the attention in float64: finite with scores hundreds apart, and its
    error no more than twice that of float64 attention over the same q, k, v rounded to bfloat16
    (the kernels also round each tile's probabilities): what bfloat16 operands cost, and no more.
    The same way in float32 is 10-100x closer."""
    g = torch.Generator().manual_seed(tq * tk + d)
    qkv = torch.randn(tk, h + 2 * kvh, d, generator=g)
    qkv[:, :h] *= spread
    q, k, v = qkv[tk - tq:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:]
    out = way(q, k, v)
    ref = float64_attention(q, k, v)
    assert torch.isfinite(out).all()
    error = (out.double() - ref).abs().max()
    rounding = (float64_attention(*bf16_rounded(q, k, v)) - ref).abs().max()
    assert error <= 2 * rounding + 1e-6, (error, rounding)
    assert (way(q, k, v, bf16=False).double() - ref).abs().max() < error / 10


@pytest.mark.parametrize("t,tk,h,kvh", [(1, 1, 9, 3), (16, 16, 9, 3), (70, 70, 9, 3), (300, 300, 6, 2), (129, 129, 8, 1),
                                        (2000, 2000, 9, 3), (20, 42, 9, 3), (1, 77, 9, 3), (50, 130, 6, 2), (512, 2000, 9, 3)])
@pytest.mark.parametrize("spread", [1.0, 300.0])
def test_a_prompt_s_attention_on_amx_tiles_errs_as_bfloat16_operands_do(t, tk, h, kvh, spread):
    """`amx_attention` (cpu_amx.c, the amx kind, heads of 64): a prompt with nothing cached or a
    chunk after cached keys (its queries the last of the keys, the diagonal anywhere in a block of
    64), any length (padded to 64 keys inside), grouped heads; against float64, finite with scores
    hundreds apart and its error within twice what rounding q, k, v to bfloat16 costs (it rounds
    each block's probabilities too, as the other bfloat16 kernels do). On a kind without AMX tiles
    it does not run: None, for its caller to take SDPA."""
    from phases.p04_triton_kernels.cpu_amx import amx_attention, amx_lib

    g = torch.Generator().manual_seed(tk * h + t)
    kv = torch.randn(tk, h + 2 * kvh, 64, generator=g)
    kv[:, :h] *= spread
    q, k, v = kv[tk - t:, :h], kv[:, h:h + kvh], kv[:, h + kvh:]
    out = amx_attention(q, k, v)
    if not platform.current().has({"amx_tile", "amx_bf16"}):
        assert out is None and amx_lib() is None
        return
    assert out is not None, "an AMX kind with a compiler builds cpu_amx.c"
    ref = float64_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    error = (out.double() - ref).abs().max()
    rounding = (float64_attention(*bf16_rounded(q, k, v)) - ref).abs().max()
    assert error <= 2 * rounding + 1e-6, (error, rounding)
    assert amx_attention(q[..., :32], k[..., :32], v[..., :32]) is None      # heads of 32: not its
    assert amx_attention(k.repeat(2, 1, 1), k, v) is None                     # more queries than keys
    into = torch.empty(t, h, 64)                                               # the caller's rows: no copy
    assert amx_attention(q, k, v, into) is into and torch.equal(into, out)


@BF16_PREFILL
def test_the_bf16_prefill_kernel_gives_the_same_numbers_at_any_chunking():
    """As the float32 kernel's: tiles from key 0, so a prompt in one call and in three chunks agree
    bit for bit."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(300, heads, 64, generator=g) for heads in (9, 3, 3))
    whole = c_prefill_attention(q, k, v, torch.empty_like(q), bf16=True)
    chunks = torch.cat([c_prefill_attention(q[a:b], k[:b], v[:b], torch.empty_like(q[a:b]), bf16=True)
                        for a, b in [(0, 100), (100, 137), (137, 300)]])
    assert torch.equal(whole, chunks)


def _compiler_is_gcc() -> bool:
    try:
        out = subprocess.run([os.environ.get("CC", "cc"), "--version"], capture_output=True, text=True).stdout
    except OSError:
        return False
    return "free software foundation" in out.lower() and "clang" not in out.lower()


@pytest.mark.skipif(not KERNELS.available() or not _compiler_is_gcc(), reason="needs GCC and an AVX2 CPU")
def test_an_older_compiler_builds_the_file_without_the_bf16_kernel(tmp_path):
    """A compiler older than AVX512-BF16 (GCC before 10, told so here by defining __GNUC__ 9) still
    builds every other kernel of cpu_attention.c, and the library says the bfloat16 one is not in
    it: prefill_paths() reads that flag before it ever calls it."""
    old = CKernel(KERNELS.source, [*KERNELS.flags, "-U__GNUC__", "-D__GNUC__=9"], KERNELS.needs,
                  KERNELS.signatures, fallback="-")
    lib = ctypes.CDLL(str(old.build(tmp_path)))
    assert ctypes.c_int.in_dll(lib, "bf16_prefill_built").value == 0
    assert lib.paged_decode_attention and lib.causal_prefill_attention
    assert ctypes.c_int.in_dll(KERNELS.load(), "bf16_prefill_built").value == 1   # this compiler's


def test_prefill_attention_is_bf16_where_the_products_are(tiny_model_dir, make_llm, monkeypatch):
    """The recipe hands CpuPagedAttention the platform's prefill paths: bf16_prefill where the
    engine multiplies in bfloat16 (setup.bf16_rows: dtype="auto" on a kind that does) and the
    bfloat16 kernel runs, never with dtype="float32"; and cpu_paged_attention passes it to the C
    prefill kernel, or where the prefill is not the C kernel's runs a prompt (a chunk after cached
    keys too) on cpu_amx.c's tiles (`amx_attention`) where that runs, else hands SDPA bfloat16
    copies."""
    f32 = make_llm(tiny_model_dir, 4, dtype="float32").llm_engine
    auto = make_llm(tiny_model_dir, 4).llm_engine
    meta = _one_step_meta(auto)
    c_prefill, bf16 = cpu_attention.prefill_paths()
    assert f32.parts.attention(meta).bf16_prefill is False and f32.parts.attention(meta).c_prefill is c_prefill
    assert auto.parts.attention(meta).bf16_prefill is (bool(auto.setup.bf16_rows) and bf16)
    assert c_prefill == bool(platform.current().rule("c_prefill"))
    if not KERNELS.available():
        return
    seen = []
    monkeypatch.setattr(cpu_attention, "c_prefill_attention", lambda q, k, v, out, bf16: seen.append(bf16))
    meta, k_cache, v_cache, g = make_batch([(20, 20), (20, 20)], 16, 2, 64, torch.float32, "cpu")
    q, k = torch.randn(40, 6, 64, generator=g), torch.randn(40, 2, 64, generator=g)
    for flag in (False, True):   # where the prefill is the C kernel's
        cpu_paged_attention(q, k, k, k_cache, v_cache, meta, c_prefill=True, bf16_prefill=flag)
    assert seen == [False, False, True, True]
    sdpa, amx = [], []
    monkeypatch.setattr(cpu_attention, "prefill_attention", lambda q, k, v: sdpa.append(q.dtype) or q)
    monkeypatch.setattr(cpu_attention, "amx_attention", lambda q, k, v, out: amx.append(len(q)))   # None: not here
    for flag in (False, True):   # where it is not
        cpu_paged_attention(q, k, k, k_cache, v_cache, meta, c_prefill=False, bf16_prefill=flag)
    assert seen == [False, False, True, True] and sdpa == [torch.float32] * 2 + [torch.bfloat16] * 2
    assert amx == [20, 20]                   # whole prompts in bfloat16 ask cpu_amx.c first
    monkeypatch.setattr(cpu_attention, "amx_attention", lambda q, k, v, out: amx.append(len(q)) or q.clone())
    sdpa.clear()
    cpu_paged_attention(q, k, k, k_cache, v_cache, meta, c_prefill=False, bf16_prefill=True)
    assert sdpa == [] and amx == [20] * 4
    from phases.p04_triton_kernels.cpu_amx import amx_attention
    if amx_attention(q[:20], k[:20], k[:20]) is not None:   # the real one writes each prompt's rows in place
        monkeypatch.setattr(cpu_attention, "amx_attention", amx_attention)
        out = cpu_paged_attention(q, k, k, k_cache, v_cache, meta, c_prefill=False, bf16_prefill=True)
        assert torch.equal(out, torch.cat([amx_attention(q[r], k[r], k[r]) for r in (slice(0, 20), slice(20, 40))]))
        meta, k_cache, v_cache, g = make_batch([(20, 20), (50, 20)], 16, 2, 64, torch.float32, "cpu")
        out = cpu_paged_attention(q, k, k, k_cache, v_cache, meta, c_prefill=False, bf16_prefill=True)   # 30 cached
        cached_k, cached_v = (c[meta.block_tables[1, :4]].flatten(0, 1)[:50] for c in (k_cache, v_cache))
        assert torch.equal(out[20:], amx_attention(q[20:], cached_k, cached_v)) and sdpa == []


def test_prefill_chunks_take_the_c_kernel_only_where_it_was_measured(monkeypatch):
    """cpu_paged_attention's prefill rows, where the platform's `c_prefill` rule names the kind
    and in float32: a chunk of PREFILL_MIN_QUERIES queries or more through cpu_attention.c's
    prefill kernel, fewer after cached keys (8 of 40) through its decode kernel, a row per query;
    `prefill_attention` (SDPA) for a short prompt with nothing cached, in bfloat16, and where the
    rule does not name the kind (c_prefill=None asks the platform)."""
    calls = []
    monkeypatch.setattr(cpu_attention, "prefill_attention", lambda q, k, v: calls.append("sdpa") or q.clone())
    monkeypatch.setattr(cpu_attention, "c_prefill_attention", lambda q, k, v, out, bf16: calls.append("c"))
    monkeypatch.setattr(cpu_attention, "c_tail_attention", lambda q, *a: calls.append("tail") or q.clone())
    c, tail = ("c", "tail") if KERNELS.available() else ("sdpa", "sdpa")
    for dtype, rule, (total, queries), expected in [
            (torch.float32, True, (20, 20), c), (torch.float32, True, (40, 16), c),
            (torch.float32, True, (40, 8), tail), (torch.float32, True, (8, 8), "sdpa"),
            (torch.bfloat16, True, (20, 20), "sdpa"), (torch.bfloat16, True, (40, 8), "sdpa"),
            (torch.float32, False, (20, 20), "sdpa"), (torch.float32, False, (40, 8), "sdpa")]:
        meta, k_cache, v_cache, g = make_batch([(total, queries)], 16, 2, 64, dtype, "cpu")
        q = torch.randn(queries, 6, 64, generator=g).to(dtype)
        k = torch.randn(queries, 2, 64, generator=g).to(dtype)
        calls.clear()
        with platform.using(platform.current().with_rules(c_prefill=rule)):
            cpu_paged_attention(q, k, k, k_cache, v_cache, meta)
        assert calls == [expected], (dtype, rule, total, queries)


@pytest.mark.skipif(not KERNELS.available(), reason="cpu_attention.c needs an AVX2 CPU and a C compiler")
def test_the_c_decode_path_takes_only_tensors_in_the_cpus_memory():
    """cpu_attention.c reads raw pointers: a GPU's tensors (here the `meta` device's, which hold
    no memory at all) attend through phase 2's decode_attention, never the C call."""
    q, k_cache = torch.empty(2, 4, 64), torch.empty(8, 16, 2, 64)
    assert c_decode_runs(q, k_cache)
    assert not c_decode_runs(q.to("meta"), k_cache.to("meta"))


def stand_in_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype):
    """A one-layer KV pool holding copies of k_cache and v_cache in `dtype`, with phase 2's write."""
    cache = types.SimpleNamespace(kv=torch.stack((k_cache, v_cache))[None].to(dtype, copy=True), checked=True,
                                  num_blocks=k_cache.shape[0], block_size=k_cache.shape[1], windows=())
    cache.layer = lambda i: (cache.kv[i, 0], cache.kv[i, 1])
    cache.write = types.MethodType(KVCache.write, cache)
    return cache


@pytest.mark.skipif(not KERNELS.available(), reason="cpu_attention.c needs an AVX2 CPU and a C compiler")
@pytest.mark.parametrize("bs,d,group,kvh", [(16, 64, 3, 3), (16, 36, 1, 2), (32, 80, 8, 1), (16, 128, 2, 2)])
@pytest.mark.parametrize("columns", ["all", "some"])
def test_decode_step_in_c_equals_phase2(bs, d, group, kvh, columns):
    """A step of decodes only through the backend: cpu_attention.c writes the new K/V and attends
    in one call; phase 2's write and decode_attention give the same cache and, to float32's
    rounding of another summing order, the same output. The block tables also as phase 7's
    static buffers hand them: the first columns of a wider table (a view, rows apart)."""
    meta, k_cache, v_cache, g = make_batch([("bs+3", 1), ("3*bs", 1), (1, 1), ("2*bs+9", 1)], bs, kvh, d,
                                           torch.float32, "cpu")
    if columns == "some":
        wide = torch.zeros(len(meta.seq_lens), meta.block_tables.shape[1] + 5, dtype=torch.int64)
        wide[:, : meta.block_tables.shape[1]] = meta.block_tables
        meta = dataclasses.replace(meta, decode_block_tables=wide[:, : meta.block_tables.shape[1]])
    n = len(meta.slot_mapping)
    q = torch.randn(n, group * kvh, d, generator=g)
    k, v = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
    caches = [stand_in_cache(k_cache, v_cache, torch.float32) for _ in range(2)]
    out = CpuPagedAttention(caches[0], meta)(0, q, k, v)
    ref = PagedAttention(caches[1], meta)(0, q, k, v)
    assert torch.equal(caches[0].kv, caches[1].kv)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not KERNELS.available(), reason="cpu_attention.c needs an AVX2 CPU and a C compiler")
@pytest.mark.parametrize("spread", [1.0, 30.0, 300.0])
def test_c_decode_exponentials_over_any_spread_of_scores(spread):
    """cpu_attention.c's exponentials, eight at a time: scores hundreds apart (e^-87 and below
    underflow float32's normal range) give phase 2's output, nothing infinite or NaN; 43 and 200
    tokens, so the eight-wide loop and its scalar tail both run."""
    meta, k_cache, v_cache, g = make_batch([(43, 1), (200, 1)], 16, 2, 64, torch.float32, "cpu")
    q = torch.randn(len(meta.slot_mapping), 6, 64, generator=g) * spread
    out = c_decode_attention(q, k_cache, v_cache, meta)
    ref = paged_attention(q, k_cache, v_cache, meta)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)



@pytest.mark.skipif(not KERNELS.available(), reason="cpu_attention.c needs an AVX2 CPU and a C compiler")
@pytest.mark.parametrize("bs", [16, 12])
def test_c_decode_splits_long_sequences_the_same_at_any_batch(bs):
    """A sequence longer than a segment (512 keys, in whole blocks) is attended by several tasks,
    their sums merged by their maxima: phase 2's output, and the long row's numbers exactly the
    same alone as beside a short and a middle one (the split falls at the same keys)."""
    from phases.p02_paged_kv import AttentionMetadata

    meta, k_cache, v_cache, g = make_batch([(1300, 1), (40, 1), (600, 1)], bs, 3, 64, torch.float32, "cpu")
    q = torch.randn(3, 9, 64, generator=g)
    out = c_decode_attention(q, k_cache, v_cache, meta)
    torch.testing.assert_close(out, paged_attention(q, k_cache, v_cache, meta), atol=1e-5, rtol=1e-5)
    table = meta.block_tables[0, : -(-1300 // bs)].tolist()
    alone = AttentionMetadata.build(meta.slot_mapping[:1].tolist(), [1], [1300], [table], torch.device("cpu"))
    assert torch.equal(c_decode_attention(q[:1], k_cache, v_cache, alone), out[:1])


@pytest.mark.skipif(not KERNELS.available(), reason="cpu_attention.c needs an AVX2 CPU and a C compiler")
@pytest.mark.parametrize("window", [1, 8, 37, 512, 700])
def test_c_decode_reads_each_row_s_window(window):
    """A layer with a sliding window: each row sees only its last `window` keys, from the middle of
    a block on (its keys before score -inf), the segments before its window's skipped (rows of
    1,300 and 600 tokens: several segments; 40 and 5: inside one). Phase 2's decode in the same
    window (its gather starts at the window's block and masks the rest) gives the same output, and
    keys before each row's window, made huge, change no output."""
    from phases.p02_paged_kv import decode_attention

    meta, k_cache, v_cache, g = make_batch([(1300, 1), (40, 1), (600, 1), (5, 1)], 16, 2, 64, torch.float32, "cpu")
    q = torch.randn(4, 6, 64, generator=g)
    out = c_decode_attention(q, k_cache, v_cache, meta, window=window)
    ref = decode_attention(q, k_cache, v_cache, *meta.decode_inputs(16, torch.float32, window))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, c_decode_attention(q, k_cache, v_cache, meta), atol=1e-3) or window >= 1300
    # keys before every row's window made huge: no row's output moves
    spoiled = k_cache.clone()
    for b, n in enumerate(meta.decode_seq_lens.tolist()):
        for t in range(max(0, n - window)):
            block = meta.decode_block_tables[b, t // 16]
            spoiled[block, t % 16] = 1e4
    torch.testing.assert_close(c_decode_attention(q, spoiled, v_cache, meta, window=window), out, atol=0, rtol=0)


@pytest.mark.parametrize("tq, past, window", [(600, 0, 37), (600, 0, 256), (300, 700, 100), (20, 5, 8),
                                              (513, 0, 2000), (257, 300, 1)])
def test_a_windowed_prompt_attends_in_tiles_over_its_windows_keys(tq, past, window):
    """`window_prefill_attention`: queries in tiles, each tile over the keys its window reaches,
    gives phase 1's windowed causal attention (tiles across the window's edge, after cached keys, a
    window longer than the context, a window of 1); keys before every query's window, made huge,
    change nothing; a prompt through `cpu_prompt_attention` over a paged cache, the same."""
    from phases.p01_naive_attention.attention import causal_attention
    from phases.p04_triton_kernels.cpu_attention import cpu_prompt_attention, window_prefill_attention

    g = torch.Generator().manual_seed(tq + past)
    q, k, v = torch.randn(tq, 6, 64, generator=g), torch.randn(past + tq, 2, 64, generator=g), torch.randn(past + tq, 2, 64, generator=g)
    out = window_prefill_attention(q, k, v, past, window)
    torch.testing.assert_close(out, causal_attention(q, k, v, past, window), atol=2e-5, rtol=1e-5)
    spoiled = k.clone()
    spoiled[: max(0, past - window + 1)] = 1e4    # before the first query's window: no query sees them
    torch.testing.assert_close(window_prefill_attention(q, spoiled, v, past, window), out, atol=0, rtol=0)
    if window < past + tq:
        assert not torch.allclose(out, causal_attention(q, k, v, past), atol=1e-3)
    meta, k_cache, v_cache, _ = make_batch([(past + tq, tq)], 16, 2, 64, torch.float32, "cpu")
    slots = meta.slot_mapping
    k_cache.view(-1, 2, 64)[slots], v_cache.view(-1, 2, 64)[slots] = k[past:], v[past:]   # the step's K/V written
    table = meta.block_tables[0]
    for t in range(past):                                                                # the cached ones
        k_cache[table[t // 16], t % 16], v_cache[table[t // 16], t % 16] = k[t], v[t]
    paged = cpu_prompt_attention(q, k[past:], v[past:], k_cache, v_cache, meta, window)
    torch.testing.assert_close(paged, out, atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(not KERNELS.available(), reason="cpu_attention.c needs an AVX2 CPU and a C compiler")
def test_c_decode_fetching_ahead_changes_no_number(monkeypatch):
    """FETCH_AHEAD (the next block's lines asked of memory while one is read, where the platform's
    `decode_fetch_ahead` rule says) only changes when memory is read: the kernel built the other
    way gives the same outputs bit for bit, over sequences of one token, a part block, whole blocks
    and several segments."""
    assert KERNELS.defines == {"FETCH_AHEAD": "decode_fetch_ahead"}
    flipped = CKernel(KERNELS.source, KERNELS.flags, KERNELS.needs, KERNELS.signatures, defines=KERNELS.defines)
    other = not platform.current().rule("decode_fetch_ahead")
    meta, k_cache, v_cache, g = make_batch([(1, 1), (23, 1), (64, 1), (1100, 1)], 16, 3, 64, torch.float32, "cpu")
    q = torch.randn(4, 9, 64, generator=g)
    out = c_decode_attention(q, k_cache, v_cache, meta)
    with platform.using(platform.current().with_rules(decode_fetch_ahead=other)):
        lib = flipped.load()                                  # built with the other FETCH_AHEAD
    assert lib is not None and lib._name != KERNELS.load()._name
    monkeypatch.setattr(KERNELS, "lib", lib)
    assert torch.equal(c_decode_attention(q, k_cache, v_cache, meta), out)


def test_backend_choice_on_cpu(tiny_model_dir, make_llm):
    from phases.p04_triton_kernels import attention_backend

    auto = make_llm(tiny_model_dir, 4).llm_engine
    assert attention_backend(auto.setup) == "cpu"
    torch_ = make_llm(tiny_model_dir, 4, attention_backend="torch").llm_engine
    assert attention_backend(torch_.setup) == "torch"
    meta = _one_step_meta(auto)
    assert type(auto.parts.attention(meta)) is CpuPagedAttention
    assert type(torch_.parts.attention(meta)).__name__ == "PagedAttention"  # phase 3's, exactly


def _one_step_meta(engine):
    from phases.p02_paged_kv import AttentionMetadata
    return AttentionMetadata.build([0, 1], [2], [2], [[0]], engine.device)


def test_triton_on_cpu_without_interpreter_is_refused(tiny_model_dir, make_llm):
    from phases.p04_triton_kernels import triton_attention

    if triton_attention.interpreter_active():
        pytest.skip("this process runs with TRITON_INTERPRET=1, where attention_backend='triton' is allowed")
    llm = make_llm(tiny_model_dir, 4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"attention_backend='triton'.*TRITON_INTERPRET=1"):
        LLM(str(tiny_model_dir), phase=4, attention_backend="triton")
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(str(tiny_model_dir), phase=4, attention_backend="flash")
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("block_size", [8, 24])
def test_triton_backend_needs_power_of_two_blocks(block_size):
    from phases.p04_triton_kernels import resolve_attention_backend

    with pytest.raises(ValueError, match="block_size"):
        resolve_attention_backend("triton", torch.device("cpu"), block_size)
    assert resolve_attention_backend("auto", torch.device("cpu"), block_size) == "cpu"


def test_triton_backend_metadata_once_per_step(tiny_model_dir, make_llm):
    engine = make_llm(tiny_model_dir, 4).llm_engine
    from phases.p02_paged_kv import AttentionMetadata
    bs = engine.kv_cache.block_size   # each token's slot: its position in its own blocks
    slots = [8] + [bs + p for p in range(4)] + [3 * bs + 18 - bs, 3 * bs + 19 - bs]
    meta = AttentionMetadata.build(slots, [1, 4, 2], [9, 4, 20], [[0], [1], [2, 3]], engine.device)
    backend = TritonPagedAttention(engine.kv_cache, meta)  # made by the engine once per step
    assert backend.query_start_loc.tolist() == [0, 1, 5, 7] and backend.query_start_loc.dtype == torch.int32
    assert (backend.max_query_len, backend.max_seq_len) == (4, 20)


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "tiny_model_dir_llama3"])
def test_cpu_engine_equals_phase3_with_chunks_and_prefix_hits(model_fixture, request):
    model = str(request.getfixturevalue(model_fixture))
    ours, ref = engine_tokens(model, 4), engine_tokens(model, 3)
    assert ours["backend"] == "cpu"
    assert ours["greedy"] == ref["greedy"]
    assert ours["sampled"] == ref["sampled"]


def test_split_kv_rule():
    from phases.p04_triton_kernels.triton_attention import MAX_KV_SPLITS, choose_num_kv_splits

    # (max_query_len, seqs, KV heads, longest context, block_size, SMs)
    assert choose_num_kv_splits(7, 1, 2, 4096, 16, 132) == 1          # a prefill in the batch: no split
    # the H100 sweep's fastest split at each decode shape (lesson, "Tuned on an H100"):
    assert choose_num_kv_splits(1, 64, 3, 4096, 16, 132) == 8         # 192 programs, 16 per SM wanted: 11 -> 8
    assert choose_num_kv_splits(1, 64, 3, 512, 16, 132) == 4          # 32 blocks, >= 8 each: 4
    assert choose_num_kv_splits(1, 8, 3, 4096, 16, 132) == MAX_KV_SPLITS  # 24 programs
    assert choose_num_kv_splits(1, 1, 3, 4096, 16, 132) == MAX_KV_SPLITS  # 3 programs, 256 blocks
    assert choose_num_kv_splits(1, 1, 3, 48, 16, 132) == 1            # 3 blocks: too short to cut
    assert choose_num_kv_splits(1, 1, 1, 16 * 8 * 5, 16, 132) == 4    # 40 blocks, >= 8 each: 5 -> 4
    assert choose_num_kv_splits(1, 2048, 8, 4096, 16, 132) == 1       # 16,384 programs: enough
    for seqs in range(1, 40):
        n = choose_num_kv_splits(1, seqs, 2, 2000, 16, 108)
        assert n & (n - 1) == 0 and 1 <= n <= MAX_KV_SPLITS


@pytest.mark.kinds
@pytest.mark.parametrize("fault", sorted(BAD_STEPS))
def test_checked_cpu_attention_refuses_a_slip(fault, bad_step):
    """cpu_attention.c writes each decode's K/V to its slot and reads its blocks in place, as
    cpu_step.c and the compiled step do through `attention_row`: in checked mode a step that
    points outside the pool or into another sequence is refused when its attention part is made
    (before any of them reads it), on every kind (where the C kernel does not run, too)."""
    cache, meta, q, k, v, pattern = bad_step(fault)
    with pytest.raises(ValueError, match=rf"^CpuPagedAttention: .*{pattern}"):
        CpuPagedAttention(cache, meta)(0, q, k, v)


@pytest.mark.skipif(not KERNELS.available(), reason="cpu_attention.c needs an AVX2 CPU and a C compiler")
def test_a_bfloat16_model_attends_in_float32_over_a_float32_pool(default_model_dir, platform_rules):
    """`bf16_kv_float32`: a bfloat16 model's pool is float32 and its steps attend in cpu_attention.c
    (q, k and v made float32, exactly; the output rounded back to bfloat16), within bfloat16's
    rounding of phase 2's attention over a bfloat16 pool: on the default model the same greedy
    tokens where no two are near a tie, and each step's top log-probabilities within bfloat16's
    noise of the bfloat16 pool's (a prompt's next token can be a near tie in bfloat16: "Write a
    haiku about the sea." ends at once or goes on, as transformers' bfloat16 and float32 forwards
    disagree). Where the rule is off, the pool is the model's dtype."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = {}
    for rule in (False, True):
        platform_rules(bf16_kv_float32=rule)
        llm = LLM(str(default_model_dir), phase=4, dtype="bfloat16", num_kv_blocks=64)
        assert llm.llm_engine.parts.kv_cache.kv.dtype == (torch.float32 if rule else torch.bfloat16)
        outs[rule] = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
    assert outs[True].token_ids == outs[False].token_ids
    diffs = [abs(ours[token].logprob - lp.logprob) for ours, theirs in zip(outs[True].logprobs, outs[False].logprobs)
             for token, lp in theirs.items() if token in ours]
    # bfloat16's noise: at most 0.30, 0.06 on average when measured (one bad head would move nats)
    assert len(diffs) > 40 and max(diffs) < 0.5 and sum(diffs) / len(diffs) < 0.15, diffs
    # one decode step of three rows, through the backend: a float32 pool against a bfloat16 one
    meta, k_cache, v_cache, g = make_batch([(40, 1), (17, 1), (3, 1)], 16, 2, 64, torch.float32, "cpu")
    k_cache, v_cache = k_cache.bfloat16().float(), v_cache.bfloat16().float()   # bfloat16 values
    q, k, v = (torch.randn(3, h, 64, generator=g).bfloat16() for h in (6, 2, 2))
    caches = [stand_in_cache(k_cache, v_cache, dtype) for dtype in (torch.float32, torch.bfloat16)]
    out = CpuPagedAttention(caches[0], meta)(0, q, k, v)
    ref = PagedAttention(caches[1], meta)(0, q, k, v)
    assert out.dtype == torch.bfloat16 and torch.equal(caches[0].kv.bfloat16(), caches[1].kv)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
