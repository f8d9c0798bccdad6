"""Phase 2 checkpoint: paged attention equals naive attention, the allocator never leaks or
double-books a block, and the engine's static batches give phase 1's tokens. (That cached decode
beats full recompute is phase 2's throughput checkpoint, in tests/test_throughput.py.)"""

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phases.p01_naive_attention import causal_attention
from conftest import BAD_STEPS
from phases.p02_paged_kv import (AttentionMetadata, BlockAllocator, BlockTable, KVCache, PagedAttention,
                                 check_metadata, paged_attention)
from tinyvllm import LLM, SamplingParams
from tinyvllm.testing import resident_bytes


@pytest.mark.parametrize("seed", range(6))
def test_paged_attention_equals_naive(seed):
    """Random block tables, lengths that are not multiples of the block size, GQA, a batch that
    mixes whole prompts, chunks after cached tokens and single-token decodes, and stale values in
    every slot the batch does not own."""
    rng = random.Random(seed)
    h, kvh, d, block_size, num_blocks = rng.choice([(4, 4, 8), (8, 2, 16), (9, 3, 8)]) + (rng.choice([1, 4, 16]), 64)
    free = list(range(num_blocks))
    rng.shuffle(free)  # blocks anywhere in the pool, in any order
    k_cache = torch.randn(num_blocks, block_size, kvh, d)
    v_cache = torch.randn(num_blocks, block_size, kvh, d)
    queries, refs, tables, q_lens, seq_lens = [], [], [], [], []
    for _ in range(rng.randint(1, 5)):
        seq_len = rng.randint(1, 40)
        q_len = rng.choice([1, seq_len, rng.randint(1, seq_len)])
        n_blocks = -(-seq_len // block_size)
        if n_blocks > len(free):
            break
        table = [free.pop() for _ in range(n_blocks)]
        k = k_cache[table].flatten(0, 1)[:seq_len]
        v = v_cache[table].flatten(0, 1)[:seq_len]
        q = torch.randn(q_len, h, d)
        queries.append(q)
        refs.append(causal_attention(q, k, v, num_past=seq_len - q_len))
        tables.append(table)
        q_lens.append(q_len)
        seq_lens.append(seq_len)
    # a slot no sequence owns (free blocks, the rest of a last block) holds whatever an earlier
    # request left there: huge values here, which must not reach any output
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for table, seq_len in zip(tables, seq_lens):
        owned[(torch.tensor(table)[:, None] * block_size + torch.arange(block_size)).flatten()[:seq_len]] = True
    k_cache.view(-1, kvh, d)[~owned] = 1e30
    v_cache.view(-1, kvh, d)[~owned] = -1e30
    slots = [t[p // block_size] * block_size + p % block_size
             for t, n, q_len in zip(tables, seq_lens, q_lens) for p in range(n - q_len, n)]
    meta = AttentionMetadata.build(slots, q_lens, seq_lens, tables, torch.device("cpu"))
    check_metadata(meta, num_blocks, block_size)   # a well-formed step passes checked mode
    out = paged_attention(torch.cat(queries), k_cache, v_cache, meta)
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fault", sorted(BAD_STEPS))
def test_checked_attention_refuses_a_bookkeeping_slip(fault, bad_step):
    """Checked mode: a step whose metadata points outside the pool, into another sequence's slot
    or past its own block table is a ValueError naming the part, the row and the value, raised
    when the step's attention part is made, before any layer attends; unchecked, it is made."""
    cache, meta, q, k, v, pattern = bad_step(fault)
    with pytest.raises(ValueError, match=rf"^PagedAttention: .*{pattern}"):
        PagedAttention(cache, meta)(0, q, k, v)
    cache.checked = False
    PagedAttention(cache, meta)


def test_check_kernels_resolves_per_device_and_environment(tiny_model_dir, monkeypatch):
    """check_kernels: as given; unset, $TINYVLLM_CHECK_KERNELS where set, else on for a CPU; the
    engine's pool carries it to every step's attention part."""
    from tinyvllm import platform

    monkeypatch.delenv("TINYVLLM_CHECK_KERNELS", raising=False)
    assert platform.check_kernels_default(None, "cpu") and not platform.check_kernels_default(None, "cuda")
    assert not platform.check_kernels_default(False, "cpu") and platform.check_kernels_default(True, "cuda")
    monkeypatch.setenv("TINYVLLM_CHECK_KERNELS", "0")
    assert not platform.check_kernels_default(None, "cpu")
    assert LLM(str(tiny_model_dir), phase=2, check_kernels=True).llm_engine.parts.kv_cache.checked is True
    assert LLM(str(tiny_model_dir), phase=2).llm_engine.parts.kv_cache.checked is False
    monkeypatch.setenv("TINYVLLM_CHECK_KERNELS", "yes")
    with pytest.raises(ValueError, match="TINYVLLM_CHECK_KERNELS must be 0 or 1"):
        LLM(str(tiny_model_dir), phase=2)


def test_kv_cache_starts_zeroed(tiny_model_dir, monkeypatch):
    """Masked slots are read too; uninitialized memory could hold NaN, and 0 * NaN = NaN."""
    config = LLM(str(tiny_model_dir), phase=2, num_kv_blocks=8).llm_engine.model_config
    empty = torch.empty  # make "uninitialized" memory visibly dirty while the cache is made
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    cache = KVCache(config, 8, 4, torch.float32, torch.device("cpu"))
    assert cache.kv.shape[2:4] == (8, 4) and not cache.kv.any()


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from Linux's /proc")
def test_cpu_kv_pool_is_resident_only_where_written():
    """On a CPU the pool is zero pages the OS maps in on first touch (kv_cache.zeros), not bytes
    written at the start: 256 MiB of pool add no resident memory, nor do the few blocks written;
    they hold what was written, and the rest reads back as zeros."""
    model = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2, head_dim=64)
    before = resident_bytes()
    # 4,096 blocks of K and V, 4 layers, 16 tokens, 2 heads of 64 floats: 256 MiB
    cache = KVCache(model, 4096, 16, torch.float32, torch.device("cpu"))
    assert cache.kv.numel() * 4 == 256 << 20 and resident_bytes() - before < 16 << 20
    k = torch.randn(3, 2, 64)
    cache.write(1, torch.tensor([0, 17, 4000]), k, -k)
    assert resident_bytes() - before < 16 << 20
    k_cache, v_cache = cache.layer(1)
    assert torch.equal(k_cache.view(-1, 2, 64)[[0, 17, 4000]], k) and torch.equal(v_cache.view(-1, 2, 64)[17], -k[1])
    assert not cache.kv[0].any() and not k_cache.view(-1, 2, 64)[1:17].any()


def test_kv_write_puts_each_token_in_its_slot():
    """Token i's K and V land in slot slot_mapping[i] of the layer written (block slot //
    block_size, offset slot % block_size), whatever the order of the slots; nothing else changes."""
    model = SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, head_dim=4)
    cache = KVCache(model, num_blocks=5, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))  # what earlier steps left
    expected = cache.kv.clone()
    slots = [13, 2, 19, 4, 7]  # out of order, in several blocks, a block's last slot and first
    k, v = torch.randn(5, 2, 4, generator=g), torch.randn(5, 2, 4, generator=g)
    cache.write(1, torch.tensor(slots), k, v)
    for i, slot in enumerate(slots):
        block, offset = divmod(slot, 4)
        for which, x in ((0, k), (1, v)):
            assert torch.equal(cache.kv[1, which, block, offset], x[i]), (
                f"token {i}'s {'KV'[which]} is not in slot {slot} (block {block}, offset {offset}) of layer 1")
    expected[1, 0].view(-1, 2, 4)[slots] = k
    expected[1, 1].view(-1, 2, 4)[slots] = v
    assert torch.equal(cache.kv, expected), "the write changed a slot no new token maps to, or another layer"


@settings(max_examples=60, deadline=None, report_multiple_bugs=False)
@given(st.integers(1, 8), st.integers(4, 40),
       st.lists(st.tuples(st.sampled_from(["alloc", "append", "free"]), st.integers(0, 7), st.integers(1, 30)),
                max_size=80))
def test_allocator_never_leaks_or_double_books(block_size, num_blocks, ops):
    alloc = BlockAllocator(num_blocks, block_size)
    tables = [BlockTable() for _ in range(8)]
    for op, i, n in ops:
        t = tables[i]
        if op == "alloc":
            if alloc.blocks_needed(t.num_tokens + n) - len(t) <= alloc.num_free_blocks:
                alloc.allocate(t, n)
            else:
                with pytest.raises(RuntimeError):
                    alloc.allocate(t, n)
        elif op == "append":
            if alloc.can_append_slot(t):
                slot = alloc.append_slot(t)
                assert slot // block_size == t.block_ids[-1]
        else:
            alloc.free(t)
        owned = [b for t in tables for b in t.block_ids]
        assert len(owned) == len(set(owned)), "a block has two owners"
        assert set(owned).isdisjoint(alloc.free_block_ids)
        assert len(owned) + alloc.num_free_blocks == num_blocks, (
            f"a block leaked after {op}: tables own {len(owned)} blocks and {alloc.num_free_blocks} are "
            f"free, but the pool has {num_blocks}")
        for t in tables:  # waste is less than one block per sequence
            assert len(t) == -(-t.num_tokens // block_size)
    for t in tables:
        alloc.free(t)
    assert alloc.num_free_blocks == num_blocks and sorted(alloc.free_block_ids) == list(range(num_blocks)), (
        f"after freeing every table, {alloc.num_free_blocks} of the pool's {num_blocks} blocks are free")


def test_every_block_is_free_after_generate(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, 2)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 16, 17, 40)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    a = llm.llm_engine.allocator
    assert a.num_free_blocks == a.num_blocks, (
        f"{a.num_blocks - a.num_free_blocks} of {a.num_blocks} KV blocks were not given back after every "
        f"request finished")


def test_small_pool_runs_batches_one_after_another(tiny_model_dir):
    """With a pool that holds only two sequences' worst case, four requests run as two static
    batches, and give the same tokens as phase 1."""
    llm = LLM(str(tiny_model_dir), phase=2, num_kv_blocks=6, block_size=8)  # 48 slots
    ref = LLM(str(tiny_model_dir), phase=1)
    prompts = [{"prompt_token_ids": list(range(5 + i, 15 + i))} for i in range(4)]  # 10 tokens each
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)  # 24 tokens = 3 blocks
    engine = llm.llm_engine
    batches = []
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished_requests():
        engine.step()
        batches.append(sorted(s.group.request_id for s in engine.scheduler.running))
        assert len(batches) < 200, (
            "4 requests of 24 tokens did not finish in 200 steps: the second pair waits for blocks "
            "the first pair should give back when it finishes")
    assert ["0", "1"] in batches and ["2", "3"] in batches
    assert not any(set(b) & {"0", "1"} and set(b) & {"2", "3"} for b in batches)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref.generate(prompts, params, use_tqdm=False)]


def test_request_that_never_fits_is_rejected(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), phase=2, num_kv_blocks=4, block_size=8)  # 32 slots
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate({"prompt_token_ids": list(range(3, 23))}, SamplingParams(max_tokens=20), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": list(range(3, 23))}, SamplingParams(max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12


def _bytes_per_block(model_dir, block_size: int, elem_bytes: int) -> int:
    """K and V, for every layer, block_size tokens, every KV head: from config.json, not from
    the engine's own bytes_per_block."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * head_dim * elem_bytes


@pytest.mark.parametrize("dtype, elem_bytes", [("float32", 4), ("bfloat16", 2)])
def test_kv_pool_size_comes_from_kv_cache_memory(tiny_model_dir, dtype, elem_bytes):
    """kv_cache_memory // bytes per block blocks; num_kv_blocks overrides the budget; a budget
    bigger than max_num_seqs sequences of max_model_len tokens need is not all taken."""
    block_size = 8
    per_block = _bytes_per_block(tiny_model_dir, block_size, elem_bytes)

    def pool_blocks(**engine_args) -> int:
        engine = LLM(str(tiny_model_dir), phase=2, device="cpu", dtype=dtype, block_size=block_size,
                     **engine_args).llm_engine
        assert engine.kv_cache.kv.shape[2] == engine.allocator.num_blocks
        assert engine.kv_cache.kv.nbytes == engine.allocator.num_blocks * per_block
        return engine.allocator.num_blocks

    budget = 5 * per_block + per_block // 2  # five and a half blocks: the pool rounds down
    assert pool_blocks(kv_cache_memory=budget) == budget // per_block == 5
    assert pool_blocks(kv_cache_memory=budget, num_kv_blocks=3) == 3
    capped = pool_blocks(kv_cache_memory=1000 * per_block, max_num_seqs=2, max_model_len=64)
    assert capped == 2 * 64 // block_size


def test_too_small_kv_cache_memory_is_a_clear_error(tiny_model_dir):
    per_block = _bytes_per_block(tiny_model_dir, 16, 4)
    with pytest.raises(ValueError, match=rf"kv_cache_memory.*{per_block - 1} bytes.*{per_block} bytes"):
        LLM(str(tiny_model_dir), phase=2, device="cpu", dtype="float32", kv_cache_memory=per_block - 1)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(str(tiny_model_dir), phase=2, kv_cache_memory=0)
