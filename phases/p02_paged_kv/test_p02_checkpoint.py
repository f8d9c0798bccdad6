"""Phase 2 checkpoint: paged attention equals naive attention, the allocator never leaks or
double-books a block, and the engine's static batches give phase 1's tokens. (That cached decode
beats full recompute is phase 2's throughput checkpoint, in tests/test_throughput.py.)"""

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from phases.p01_naive_attention import causal_attention
from conftest import BAD_STEPS
from phases.p02_paged_kv import (AttentionMetadata, BlockAllocator, BlockTable, KVCache, PagedAttention,
                                 check_metadata, paged_attention)
from phases.p02_paged_kv.paged_attention import decode_gather
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
    for b, ref in enumerate(refs):   # sequence by sequence, so a failure says which
        mine = out[meta.query_start_loc[b]: meta.query_start_loc[b + 1]]
        err = (mine - ref).abs().max().item()
        kind = "decode" if q_lens[b] == 1 else f"{q_lens[b]} queries"
        stale = (" (the slots no sequence owns hold +-1e30: a slot past the sequence's length, or of another "
                 "sequence's block, was attended)" if not err < 1e20 else "")
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5, msg=(
            f"sequence {b} ({kind} over {seq_lens[b]} keys, blocks of {block_size}): largest error {err:.3g} "
            f"against phase 1's attention over its keys{stale}"))


def test_decode_gather_pads_each_sequence_to_the_longest():
    """Three decoding sequences of 5, 9 and 1 tokens in blocks of 4: each gathers the longest's
    3 blocks (its table's first 3 entries, padding included), and the mask hides every slot at or
    past its length."""
    tables = torch.tensor([[7, 2, 9, 0], [4, 5, 6, 0], [3, 0, 0, 0]])
    lengths = (5, 9, 1)
    block_ids, mask = decode_gather(tables, torch.tensor(lengths), 4, torch.float32, max_seq_len=9)
    assert block_ids.tolist() == [7, 2, 9, 4, 5, 6, 3, 0, 0], (
        f"the blocks to gather are each sequence's first ceil(9 / 4) = 3 table entries, one sequence after "
        f"another: expected [7, 2, 9, 4, 5, 6, 3, 0, 0], got {block_ids.tolist()}")
    assert mask.shape == (3, 1, 1, 12), (f"the mask is (B, 1, 1, 3 blocks x 4 slots) = (3, 1, 1, 12), "
                                         f"got {tuple(mask.shape)}")
    for b, length in enumerate(lengths):
        row = mask[b, 0, 0]
        seen = [t for t in range(12) if row[t] == 0]
        assert seen == list(range(length)) and bool((row[length:] == float("-inf")).all()), (
            f"sequence {b} has {length} tokens: slots 0..{length - 1} are attended (mask 0) and slots {length}..11 "
            f"hidden (-inf); the mask attends slots {seen}")


def test_prepare_flattens_the_plan():
    """A chunk of 3 tokens after 5 cached ones and a decode after 9: the flat tokens, their
    positions and slots (through each block table, blocks of 4), the query and sequence lengths."""
    from phases.p02_paged_kv.model_runner import ModelRunner
    from tinyvllm.step import SchedulerOutput

    def seq(tokens, computed, blocks):
        table = BlockTable()
        table.block_ids, table.num_tokens = blocks, len(tokens)
        return SimpleNamespace(token_ids=tokens, num_computed_tokens=computed, block_table=table)

    chunk, decode = seq(list(range(100, 110)), 5, [6, 1, 3]), seq(list(range(200, 210)), 9, [2, 8, 5])
    plan = SchedulerOutput()
    plan.scheduled += [(chunk, 3), (decode, 1)]
    inputs = ModelRunner(None, None, 4, torch.device("cpu")).prepare(plan)
    got = inputs.input_ids.tolist()
    assert got == [105, 106, 107, 209], f"the new tokens follow each sequence's computed ones: expected [105, 106, 107, 209], got {got}"
    got = inputs.positions.tolist()
    assert got == [5, 6, 7, 9], (f"positions continue after the computed tokens (5 and 9): expected [5, 6, 7, 9], "
                                 f"got {got}")
    got = inputs.meta.slot_mapping.tolist()
    assert got == [5, 6, 7, 21], (f"position p's slot is block_ids[p // 4] * 4 + p % 4: positions 5, 6, 7 of "
                                  f"blocks [6, 1, 3] and 9 of [2, 8, 5] give [5, 6, 7, 21], got {got}")
    assert inputs.meta.query_start_loc == [0, 3, 4], f"query lengths 3 and 1: query_start_loc [0, 3, 4], got {inputs.meta.query_start_loc}"
    assert inputs.meta.seq_lens == [8, 10], (f"seq_lens count each sequence's tokens after this step (5 + 3, 9 + 1): "
                                             f"expected [8, 10], got {inputs.meta.seq_lens}")


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
@example(4, 8, [("alloc", 0, 5), ("free", 0, 1), ("alloc", 0, 3)])   # always: a table in use freed
def test_allocator_never_leaks_or_double_books(block_size, num_blocks, ops):
    alloc = BlockAllocator(num_blocks, block_size)
    tables = [BlockTable() for _ in range(8)]
    for op, i, n in ops:
        t = tables[i]
        before = t.num_tokens
        if op == "alloc":
            if alloc.blocks_needed(t.num_tokens + n) - len(t) <= alloc.num_free_blocks:
                alloc.allocate(t, n)
                assert t.num_tokens == before + n, (
                    f"allocate({n} tokens) on a table of {before} must leave it holding {before + n} tokens, "
                    f"it holds {t.num_tokens}")
            else:
                try:
                    alloc.allocate(t, n)
                except RuntimeError:
                    pass
                else:
                    raise AssertionError(f"allocate({n} tokens) on a table of {before} needs more blocks than the "
                                         f"{alloc.num_free_blocks} free: it must raise RuntimeError")
        elif op == "append":
            if alloc.can_append_slot(t):
                slot = alloc.append_slot(t)
                assert slot // block_size == t.block_ids[-1]
        else:
            alloc.free(t)
            assert not t.block_ids and t.num_tokens == 0, (
                f"free must empty the table: it still holds {len(t.block_ids)} blocks and {t.num_tokens} tokens")
        owned = [b for t in tables for b in t.block_ids]
        assert len(owned) == len(set(owned)), f"a block has two owners after {op}: {sorted(owned)}"
        assert set(owned).isdisjoint(alloc.free_block_ids), (
            f"a block both owned and free after {op}: {sorted(set(owned) & set(alloc.free_block_ids))}")
        assert len(owned) + alloc.num_free_blocks == num_blocks, (
            f"a block leaked after {op}: tables own {len(owned)} blocks and {alloc.num_free_blocks} are "
            f"free, but the pool has {num_blocks}")
        for t in tables:  # waste is less than one block per sequence
            assert len(t) == -(-t.num_tokens // block_size), (
                f"after {op}, a table of {t.num_tokens} tokens holds {len(t)} blocks of {block_size}: it needs "
                f"exactly ceil({t.num_tokens} / {block_size}) = {-(-t.num_tokens // block_size)}")
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
    got = [o.outputs[0].token_ids for o in outs]
    want = [r.outputs[0].token_ids for r in ref.generate(prompts, params, use_tqdm=False)]
    assert got == want, f"4 requests through a pool of 6 blocks give other tokens than phase 1: {got} vs {want}"


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
