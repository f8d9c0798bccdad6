"""Phase 10's checkpoint: a KV connector whose offload tier gives phase 9's tokens, faster where a
prefix has left the pool, and degrades to recomputing, never to a failed request.

- Tokens: phase 10 with the tier gives phase 9's greedy tokens while prefixes cycle through a
  pool too small for them (loads through the prefill path, the decode path and a shared prefix),
  in one process and through the engine core's process; and, batch-invariant, exactly phase 9's
  on random batches with preemptions, tier evictions and n-gram drafts.
- A prefix evicted from the pool and loaded back is the block saved, bit for bit, and counted as
  a prefix-cache hit.
- The connector's scheduler side counts whole blocks and leaves a token to compute; the tier
  evicts its least recently used block, never one a step loads from, and never grows past
  `cpu_bytes_to_use`.
- Bad input: a damaged block, a tier file of another model or block size, a truncated one, and
  an unwritable folder are refused with a warning and recomputed; a bad `kv_transfer_config` is
  refused by name.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import types
import zlib

import pytest
import torch

from phases.p10_kv_tiers import OffloadingConnectorScheduler, OffloadStore, block_digest
from tinyvllm import LLM, SamplingParams

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def tier(cpu_bytes: int = 1 << 22, **extra) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes, **extra}}


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setenv("TINYVLLM_ENABLE_MULTIPROCESSING", "0")


def make(model, phase=10, num_kv_blocks=24, **args) -> LLM:
    return LLM(str(model), phase=phase, num_kv_blocks=num_kv_blocks, block_size=BS, compilation_mode=0, **args)


def run(llm: LLM, batches) -> list[list[int]]:
    """Each batch (a list of prompts) generated in turn; every output's tokens."""
    return [o.outputs[0].token_ids for batch in batches
            for o in llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)]


# -- tokens ------------------------------------------------------------------------------------------
def test_phase10_with_the_tier_gives_phase9_s_tokens(tiny_model_dir, in_process):
    """Eight 41-token prompts cycled twice through a pool that holds about two: the second pass
    loads 10 blocks of each from the tier. A 41-token prompt leaves one token to compute, so its
    step is a decode step (phase 7's static path, here eager); a batch of four sharing a tier
    prefix, and 38-token prompts (a prefill of the rest), go through the prefill path."""
    ps = prompts(8, 41)
    shared = [ps[0][:24] + q[:14] for q in prompts(4, 14, seed=1)]
    batches = [[p] for p in ps] * 2 + [shared, [p[:38] for p in ps[:3]]]
    want = run(make(tiny_model_dir, phase=9), batches)
    llm = make(tiny_model_dir, kv_transfer_config=tier())
    got = run(llm, batches)
    stats = llm.llm_engine.get_stats()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"output {i}: phase 10 with the tier gave {g}, phase 9 {w}"
    assert stats["kv_offload_loaded_blocks"] >= 8 * 10, (
        f"the second pass should load 10 blocks of each of 8 prompts from the tier; it loaded "
        f"{stats['kv_offload_loaded_blocks']}")


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                          "prompt_lookup_max": 3}], ids=["plain", "ngram-drafts"])
def test_any_mix_of_batches_gives_phase9_s_tokens(spec, tiny_model_dir, in_process):
    """Random batches of prompts that share random lengths of five prefixes, four seats, a pool of
    19 blocks (preemptions), a tier of 20 slots (evictions there too). With batch_invariant=True a
    token does not depend on the rows beside it, so the outputs must be phase 9's exactly, though
    the batches differ (phase 10's hits shorten its prefills)."""
    rng = random.Random(1)
    bases = prompts(5, 30, seed=12)
    batches = [[rng.choice(bases)[:rng.randrange(0, 31)] + prompts(1, rng.randrange(1, 20), seed=100 * i + j)[0]
                for j in range(rng.randrange(1, 6))] for i in range(24)]
    lengths = [rng.randrange(1, 12) for _ in range(6)]
    budget = 4096 + 20 * (64 + 2 * 2 * BS * 2 * 16 * 4)
    runs, stats = {}, None
    for phase, extra in ((9, {}), (10, {"kv_transfer_config": tier(budget)})):
        llm = make(tiny_model_dir, phase=phase, num_kv_blocks=20, max_num_seqs=4, batch_invariant=True,
                   speculative_config=spec, **extra)
        runs[phase] = [o.outputs[0].token_ids for i, b in enumerate(batches) for o in llm.generate(
            [{"prompt_token_ids": p} for p in b],
            [SamplingParams(temperature=0, max_tokens=lengths[(i + j) % 6], ignore_eos=True) for j in range(len(b))])]
        stats = llm.llm_engine.get_stats()
    wrong = [i for i, (a, b) in enumerate(zip(runs[9], runs[10])) if a != b]
    assert not wrong, f"outputs {wrong} differ from phase 9's, e.g. {runs[10][wrong[0]]} against {runs[9][wrong[0]]}"
    assert stats["kv_offload_loaded_blocks"] > 0 and stats["kv_offload_evicted_blocks"] > 0, stats


def test_through_the_engine_core_process(tiny_model_dir):
    """The connector lives in the engine core's process: the same tokens, the tier's counters
    read through the client."""
    ps = prompts(6, 41, seed=2)
    batches = [[p] for p in ps] * 2
    want = run(make(tiny_model_dir, phase=9), batches)
    llm = make(tiny_model_dir, kv_transfer_config=tier())
    try:
        assert run(llm, batches) == want
        assert llm.llm_engine.get_stats()["kv_offload_loaded_blocks"] >= 6 * 10
    finally:
        llm.llm_engine.shutdown()


def _pool_blocks(engine, token_ids: list[int]) -> list[int]:
    return engine.allocator.match_prefix(token_ids)


def test_a_prefix_evicted_from_the_pool_is_loaded_back_bit_identical(tiny_model_dir, in_process):
    llm = make(tiny_model_dir, kv_transfer_config=tier())
    engine = llm.llm_engine
    a, others = prompts(1, 41, seed=3)[0], prompts(6, 41, seed=4)
    first = run(llm, [[a]])
    blocks = _pool_blocks(engine, a)
    assert len(blocks) == 10, f"the pool should hold the prompt's 10 full blocks after it ran, found {len(blocks)}"
    saved = engine.kv_cache.kv[:, :, blocks].clone()   # (layers, 2, 10, block_size, KVH, d)
    run(llm, [[p] for p in others])
    assert _pool_blocks(engine, a) == [], "the other prompts should have evicted the prefix from the pool"
    before = engine.get_stats()
    again = run(llm, [[a]])
    after = engine.get_stats()
    loaded = _pool_blocks(engine, a)
    assert len(loaded) == 10, f"the prefix should be back in the pool (10 blocks), found {len(loaded)}"
    back = engine.kv_cache.kv[:, :, loaded]
    for layer in range(back.shape[0]):
        for i in range(10):
            assert torch.equal(back[layer, :, i], saved[layer, :, i]), (
                f"layer {layer}'s K/V of block {i} loaded back differ from the block saved "
                f"(max difference {(back[layer, :, i] - saved[layer, :, i]).abs().max().item():.3g})")
    assert again == first, f"the prompt gave {again} with its prefix loaded back, {first} when it was computed"
    assert after["kv_offload_loaded_blocks"] - before["kv_offload_loaded_blocks"] == 10
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 40, "the loaded prefix counts as a hit"


# -- the scheduler side and the tier, alone ------------------------------------------------------------
def _store(tmp_path, num_slots: int) -> OffloadStore:
    shape = (2, 2, BS, 1, 4)   # layers, K/V, block_size, KV heads, head_dim: 256 bytes of float32
    slot_bytes = 64 + 256
    store = OffloadStore(4096 + num_slots * slot_bytes, shape, torch.float32, {"model": "m", "block_size": BS},
                         directory=str(tmp_path))
    assert store.num_slots == num_slots and store.open()
    return store


def _put(store: OffloadStore, digest: bytes) -> None:
    slot = store.allocate(digest)
    store.block(slot).fill_(1.0)
    store.commit(slot, digest)


class _Seq:
    def __init__(self, token_ids: list[int]):
        self.token_ids, self.num_tokens = token_ids, len(token_ids)


def test_matched_tokens_count_whole_blocks_and_leave_one_token(tmp_path):
    store = _store(tmp_path, 16)
    connector = OffloadingConnectorScheduler(store, types.SimpleNamespace(block_size=BS))
    tokens = list(range(100, 120))                       # 20 tokens: 5 full blocks
    seq = _Seq(tokens)
    digests, parent = [], b""
    for i in range(5):
        parent = block_digest(parent, tokens[i * BS:(i + 1) * BS])
        digests.append(parent)
    for d in digests:
        _put(store, d)
    got = connector.get_num_new_matched_tokens(seq, 0)
    assert got == 16, (f"the tier holds all 5 blocks of a 20-token sequence: 4 blocks (16 tokens) may be "
                       f"matched, leaving one token to compute; got {got}")
    got = connector.get_num_new_matched_tokens(seq, 8)
    assert got == 8, f"with 8 tokens in the pool, blocks 2 and 3 (8 tokens) are the tier's to add; got {got}"
    store.index.pop(digests[1])
    got = connector.get_num_new_matched_tokens(seq, 0)
    assert got == 4, f"the tier lacks block 1: only block 0 (4 tokens) matches, a prefix stops at a gap; got {got}"
    odd = _Seq(tokens[:19])
    got = connector.get_num_new_matched_tokens(odd, 4)
    assert got == 0, f"after block 0, the tier lacks block 1: nothing more matches; got {got}"


def test_a_fetch_in_flight_keeps_its_request_waiting_and_lands_once(tmp_path):
    """A consumer fed over a socket asks the producer once, for the blocks from the first its tier
    lacks; while they are on their way the request waits (False), then they land in the tier (the
    bytes sent), and the request goes on (True). A failed fetch: it goes on, and no later request
    asks again."""
    from concurrent.futures import Future

    store = _store(tmp_path, 16)
    asked, future = [], Future()
    stub = types.SimpleNamespace(submit=lambda d: asked.append(d) or future, address="producer:1")
    connector = OffloadingConnectorScheduler(store, types.SimpleNamespace(block_size=BS), remote=stub)
    seq = _Seq(list(range(100, 120)))                  # 5 full blocks: 4 may be loaded
    digests = connector.block_digests(seq, 4)
    _put(store, digests[0])                            # block 0 is here already
    assert connector.fetch(seq, 0, wait=False) is False and asked == [digests[1:]]
    assert connector.fetch(seq, 0, wait=False) is False and len(asked) == 1, "asked again"
    data = torch.arange(64, dtype=torch.float32).numpy().tobytes()
    future.set_result([(d, zlib.crc32(data), data) for d in digests[1:3]])   # the producer held blocks 1 and 2
    assert connector.fetch(seq, 0, wait=False) is True
    assert [store.lookup(d) is not None for d in digests] == [True, True, True, False]
    assert store.verify(digests[2], store.slot_of(digests[2]))
    assert store.block(store.slot_of(digests[2])).numpy().tobytes() == data
    assert connector.num_fetched_blocks == 2 and connector.fetch(seq, 0, wait=False) is True and len(asked) == 1
    failed, later = Future(), _Seq(list(range(200, 220)))
    failed.set_exception(ConnectionError("the other engine closed the connection"))
    stub.submit = lambda d: asked.append(d) or failed
    assert connector.fetch(later, 0, wait=True) is True and connector.remote_failed
    assert connector.fetch(_Seq(list(range(300, 320))), 0, wait=True) is True and len(asked) == 2


def test_a_block_read_for_another_engine_is_whole_or_none(tmp_path):
    """`OffloadStore.read` (what a producer's server sends): a saved block's CRC and bytes; nothing
    for a block the tier lacks, or one whose bytes no longer match their CRC."""
    store = _store(tmp_path, 4)
    _put(store, b"a" * 32)
    crc, data = store.read(b"a" * 32)
    assert data == store.block(store.slot_of(b"a" * 32)).numpy().tobytes() and zlib.crc32(data) == crc
    assert store.read(b"b" * 32) is None
    store.block(store.slot_of(b"a" * 32))[0, 0, 0, 0, 0] = 7.0   # damaged after its save
    assert store.read(b"a" * 32) is None


def test_the_tier_evicts_its_least_recently_used_block(tmp_path):
    store = _store(tmp_path, 3)
    for d in (b"a", b"b", b"c"):
        store.allocate(d)
    store.touch(b"a")                                   # order now: b, c, a
    slot_b = store.index[b"b"]
    assert store.allocate(b"d") == slot_b, "a full tier reuses the slot of its least recently used block (b)"
    assert list(store.index) == [b"c", b"a", b"d"], (
        f"b (least recently used) should have been forgotten and d added last; the index is {list(store.index)}")
    store.pin(store.index[b"c"])                        # a step loads from c: not evicted
    store.allocate(b"e")
    assert b"c" in store.index and b"a" not in store.index, (
        f"with c pinned, the least recently used block that is not pinned (a) goes; the index is {list(store.index)}")
    for d in list(store.index):
        store.pin(store.index[d])
    assert store.allocate(b"f") is None, "every slot pinned: no slot, nothing evicted"
    assert store.num_evicted == 2


def test_the_tier_never_grows_past_its_bound(tiny_model_dir, in_process):
    budget = 4096 + 12 * (64 + 2 * 2 * BS * 2 * 16 * 4)   # 12 slots of the tiny model's blocks
    llm = make(tiny_model_dir, kv_transfer_config=tier(budget))
    ps = prompts(6, 41, seed=5)
    want = run(make(tiny_model_dir, phase=9), [[p] for p in ps] * 2)
    assert run(llm, [[p] for p in ps] * 2) == want
    store = llm.llm_engine.parts.attention.worker.store
    stats = llm.llm_engine.get_stats()
    assert store.num_slots == 12 and len(store.index) <= 12, f"{len(store.index)} blocks in a tier of 12 slots"
    assert os.fstat(store.fd).st_size <= budget, f"the tier file is {os.fstat(store.fd).st_size} bytes, over {budget}"
    assert stats["kv_offload_evicted_blocks"] > 0, "60 blocks through 12 slots: the tier must have evicted some"


# -- bad input -------------------------------------------------------------------------------------------
def test_a_damaged_block_is_refused_and_recomputed(tiny_model_dir, in_process, caplog):
    llm = make(tiny_model_dir, kv_transfer_config=tier())
    engine = llm.llm_engine
    a, others = prompts(1, 41, seed=6)[0], prompts(6, 41, seed=7)
    first = run(llm, [[a]])
    store = engine.parts.attention.worker.store
    digest = block_digest(b"", a[:BS])
    store.block(store.index[digest])[0, 0, 0, 0, 0] += 1.0    # one value of block 0, in the file
    run(llm, [[p] for p in others])
    before = engine.get_stats()
    with caplog.at_level(logging.WARNING, logger="tinyvllm.kv_offload"):
        assert run(llm, [[a]]) == first
    after = engine.get_stats()
    assert "does not hold the block saved" in caplog.text, f"no warning named the damaged block: {caplog.text!r}"
    assert after["kv_offload_refused_blocks"] == 1
    assert after["kv_offload_loaded_blocks"] == before["kv_offload_loaded_blocks"], \
        "a prefix whose first block is damaged loads nothing after it (a prefix stops at its first gap)"


@pytest.mark.parametrize("change, warning", [
    ("same", None),
    ("block_size", "from another block size"),
    ("model", "from another model"),
    ("truncated", "is truncated"),
    ("garbage", "not a tier file"),
])
def test_a_tier_file_is_reused_only_by_the_engine_that_wrote_it(change, warning, tiny_model_dir, tiny_model_dir_llama3,
                                                              tmp_path, in_process, caplog):
    path = str(tmp_path / "tier.bin")
    a = prompts(1, 41, seed=8)[0]
    llm = make(tiny_model_dir, kv_transfer_config=tier(path=path))
    first = run(llm, [[a]])
    llm.llm_engine.shutdown()
    model, block_size = tiny_model_dir, BS
    if change == "block_size":
        block_size = 8
    elif change == "model":
        model = tiny_model_dir_llama3
    elif change == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    elif change == "garbage":
        with open(path, "r+b") as f:
            f.write(b"\x00" * 64)
    with caplog.at_level(logging.WARNING, logger="tinyvllm.kv_offload"):
        again = LLM(str(model), phase=10, num_kv_blocks=24, block_size=block_size, compilation_mode=0,
                    kv_transfer_config=tier(path=path))
        got = run(again, [[a]])
    loaded = again.llm_engine.get_stats()["kv_offload_loaded_blocks"]
    if warning is None:
        assert got == first and loaded == 10, f"the engine that wrote the file reuses it: {loaded} blocks loaded"
        assert "refused" not in caplog.text
    else:
        assert warning in caplog.text and "refused" in caplog.text, f"no warning {warning!r}: {caplog.text!r}"
        assert loaded == 0, f"a refused file is started empty; {loaded} blocks were loaded from it"
        if model == tiny_model_dir and block_size == BS:
            assert got == first


def test_an_unwritable_tier_turns_the_tier_off_and_requests_go_on(tiny_model_dir, in_process, caplog):
    ps = prompts(3, 41, seed=9)
    want = run(make(tiny_model_dir, phase=9), [[p] for p in ps] * 2)
    with caplog.at_level(logging.WARNING, logger="tinyvllm.kv_offload"):
        llm = make(tiny_model_dir, kv_transfer_config=tier(path="/proc/no-such-folder/tier.bin"))
        assert run(llm, [[p] for p in ps] * 2) == want
    assert "the KV offload tier is off" in caplog.text, caplog.text
    assert llm.llm_engine.get_stats()["kv_offload_loaded_blocks"] == 0


# -- prefill in one engine, decode in another ----------------------------------------------------------
def role(name: str, path: str, cpu_bytes: int = 1 << 22) -> dict:
    return {**tier(cpu_bytes, path=path), "kv_role": name}


def test_a_producer_prefills_and_a_consumer_decodes_from_its_blocks(tiny_model_dir, tmp_path, in_process):
    """The producer computes each prompt (one token) and saves its blocks into the shared file;
    the consumer loads every full block of each prompt from there, computes only the rest, and
    gives phase 9's tokens. The consumer saves nothing, the producer loads nothing."""
    path = str(tmp_path / "shared.bin")
    ps = prompts(4, 41, seed=10)
    want = run(make(tiny_model_dir, phase=9), [ps])
    producer = make(tiny_model_dir, kv_transfer_config=role("kv_producer", path))
    consumer = make(tiny_model_dir, num_kv_blocks=64, kv_transfer_config=role("kv_consumer", path))
    producer.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=1))
    got = run(consumer, [ps])
    c, p = consumer.llm_engine.get_stats(), producer.llm_engine.get_stats()
    assert got == want, f"the consumer gave {got}, phase 9 {want}"
    assert c["kv_offload_loaded_blocks"] == 4 * 10, f"the consumer should load 10 blocks of each of 4 prompts: {c}"
    assert c["kv_offload_saved_blocks"] == 0 and p["kv_offload_loaded_blocks"] == 0
    assert p["kv_offload_saved_blocks"] >= 4 * 10


def remote(kv_role: str, port: int, **extra) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": kv_role, "kv_ip": "127.0.0.1", "kv_port": port,
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 22, **extra}}


@pytest.fixture
def kv_token(monkeypatch):
    """The secret both engines of a pair over a socket sign with (a fresh one each test)."""
    from tinyvllm import secret_env

    token = secrets.token_hex(32)
    monkeypatch.setenv("TINYVLLM_KV_TOKEN", token)
    monkeypatch.delitem(secret_env._TAKEN, "TINYVLLM_KV_TOKEN", raising=False)
    return token


def test_a_consumer_reads_the_producer_s_blocks_over_a_socket(tiny_model_dir, in_process, kv_token):
    """No shared file: the producer serves its tier on a port, the consumer asks it for each
    prompt's blocks (in the background, the request waiting for them), keeps them in a tier of its
    own, loads them and gives phase 9's tokens; a block it received is bit for bit the producer's."""
    ps = prompts(4, 41, seed=10)
    want = run(make(tiny_model_dir, phase=9), [ps])
    producer = make(tiny_model_dir, kv_transfer_config=remote("kv_producer", 0))
    server = producer.llm_engine.parts.attention.worker.remote
    port = server.address[1]
    consumer = make(tiny_model_dir, num_kv_blocks=64, kv_transfer_config=remote("kv_consumer", port))
    producer.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=1))
    got = run(consumer, [ps])
    c = consumer.llm_engine.get_stats()
    assert got == want, f"the consumer gave {got}, phase 9 {want}"
    assert c["kv_remote_fetched_blocks"] == 4 * 10 and c["kv_offload_loaded_blocks"] == 4 * 10, c
    assert server.num_served_blocks == 4 * 10
    mine, theirs = consumer.llm_engine.parts.attention.worker.store, producer.llm_engine.parts.attention.worker.store
    for digest, slot in list(theirs.index.items())[:5]:
        assert torch.equal(mine.block(mine.slot_of(digest)), theirs.block(slot))
    # a prompt the producer never saw: nothing to fetch, computed here, the same tokens
    other = prompts(1, 41, seed=77)
    assert run(consumer, [other]) == run(make(tiny_model_dir, phase=9), [other])
    assert consumer.llm_engine.get_stats()["kv_remote_fetched_blocks"] == 4 * 10


def test_a_killed_producer_leaves_the_consumer_computing(tiny_model_dir, in_process, kv_token, caplog):
    """The producer gone (its server closed) after the consumer connected: the consumer's fetch
    fails with a warning naming the producer, the prompt is computed here (phase 9's tokens), and
    so is every later one."""
    ps = prompts(2, 41, seed=21)
    want = run(make(tiny_model_dir, phase=9), [[p] for p in ps])
    producer = make(tiny_model_dir, kv_transfer_config=remote("kv_producer", 0))
    server = producer.llm_engine.parts.attention.worker.remote
    consumer = make(tiny_model_dir, kv_transfer_config=remote("kv_consumer", server.address[1]))
    producer.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=1))
    server.close()
    consumer.llm_engine.parts.attention.worker.remote.conn.shutdown(2)   # as a dead host's connection ends
    with caplog.at_level("WARNING", logger="tinyvllm.kv_offload"):
        assert run(consumer, [[p] for p in ps]) == want
    assert "did not send the blocks" in caplog.text and f"127.0.0.1:{server.address[1]}" in caplog.text
    assert consumer.llm_engine.get_stats()["kv_remote_fetched_blocks"] == 0


@pytest.mark.parametrize("change, error", [
    ("no producer", r"the kv_producer at 127.0.0.1:\d+ cannot be reached"),
    ("block_size", r"holds other blocks: the producer's block_size is 4, the consumer's 8"),
    ("token", r"refused this engine \(the other engine closed the connection\).*the same TINYVLLM_KV_TOKEN"),
])
def test_a_consumer_over_a_socket_is_refused_at_start_by_name(change, error, tiny_model_dir, in_process,
                                                              kv_token, monkeypatch):
    port = 9   # (discard: nothing listens there)
    if change != "no producer":
        producer = make(tiny_model_dir, kv_transfer_config=remote("kv_producer", 0))
        port = producer.llm_engine.parts.attention.worker.remote.address[1]
    if change == "token":   # the consumer's host holds another secret
        from tinyvllm import secret_env

        monkeypatch.setitem(secret_env._TAKEN, "TINYVLLM_KV_TOKEN", secrets.token_hex(32))
    with pytest.raises(ValueError, match=error):
        LLM(str(tiny_model_dir), phase=10, num_kv_blocks=24, block_size=8 if change == "block_size" else BS,
            compilation_mode=0, kv_transfer_config=remote("kv_consumer", port))


def test_a_pair_on_a_socket_without_its_secret_is_refused_by_name(tiny_model_dir, in_process, monkeypatch):
    monkeypatch.delenv("TINYVLLM_KV_TOKEN", raising=False)
    with pytest.raises(ValueError, match=r"kv_transfer_config with kv_port: set TINYVLLM_KV_TOKEN to the same secret"):
        make(tiny_model_dir, kv_transfer_config=remote("kv_producer", 0))


def test_frames_without_the_token_or_sent_again_are_refused_unread(tiny_model_dir, in_process, kv_token, caplog):
    """A process without the token, and one that sends the consumer's fetch again (a replay on a
    new connection, or twice on one), gets nothing: the server drops the connection with a log
    line, and goes on serving the real consumer."""
    import socket

    from phases.p08_tensor_parallel.parallel import Stamp, sign_bytes
    from phases.p10_kv_tiers.kv_remote import HELLO, read_frame, send_frame

    producer = make(tiny_model_dir, kv_transfer_config=remote("kv_producer", 0))
    server = producer.llm_engine.parts.attention.worker.remote
    ps = prompts(1, 41, seed=5)
    producer.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=1))
    identity = producer.llm_engine.parts.attention.worker.store.identity
    token = bytes.fromhex(kv_token)

    def session(key_token: bytes, counters: list[int]) -> list[bytes]:
        """A connection: the hello under `key_token`, then a fetch of one digest per counter."""
        got = []
        with socket.create_connection(server.address, timeout=10) as conn:
            nonce = bytes(read_frame(conn, 64)[len(HELLO):])
            send_frame(conn, sign_bytes(json.dumps(identity).encode(), key_token, Stamp("kv-hello", nonce, 1, 0)))
            try:
                got.append(read_frame(conn, 1 << 20))
                for c in counters:
                    send_frame(conn, sign_bytes(bytes(32), key_token, Stamp("kv-fetch", nonce, 1, c)))
                    got.append(read_frame(conn, 1 << 20))
            except ConnectionError:
                pass
        return got

    with caplog.at_level("WARNING", logger="tinyvllm.kv_offload"):
        assert session(secrets.token_bytes(32), [1]) == []          # another token: not even a hello back
        assert len(session(token, [1, 1])) == 2                      # the hello and the first fetch, not the second
    assert caplog.text.count("refused, connection dropped") == 2, caplog.text
    consumer = make(tiny_model_dir, kv_transfer_config=remote("kv_consumer", server.address[1]))
    assert run(consumer, [ps]) and consumer.llm_engine.get_stats()["kv_remote_fetched_blocks"] == 10


def test_blocks_that_name_one_slot_share_its_ways(tmp_path):
    """In a file one engine writes for another, nine blocks whose digests name the same slot: the
    producer puts the first eight in the eight slots from it (`WAYS`), the consumer finds each by
    its header; the ninth replaces the one written longest ago, which the consumer no longer finds."""
    from phases.p10_kv_tiers.offload_store import WAYS

    shape, path = (2, 2, BS, 1, 4), str(tmp_path / "shared.bin")
    identity = {"model": "m", "block_size": BS}
    size = 4096 + 32 * (64 + 256)
    producer = OffloadStore(size, shape, torch.float32, identity, path=path, role="kv_producer")
    assert producer.open() and producer.num_slots == 32
    digests = [bytes([5]) + bytes(7) + i.to_bytes(24, "little") for i in range(WAYS + 1)]   # all name slot 5
    slots = [producer.allocate(d) for d in digests[:WAYS]]
    assert slots == list(range(5, 5 + WAYS)), f"the first {WAYS} take the {WAYS} ways from slot 5: {slots}"
    for i, (d, slot) in enumerate(zip(digests, slots)):
        producer.block(slot).fill_(float(i))
        producer.commit(slot, d)
    producer.allocate(digests[1])                        # written again: its own slot, now the newest
    consumer = OffloadStore(size, shape, torch.float32, identity, path=path, role="kv_consumer")
    assert consumer.open()
    assert [consumer.lookup(d) for d in digests[:WAYS]] == slots
    assert consumer.lookup(digests[WAYS]) is None
    last = producer.allocate(digests[WAYS])
    assert last == slots[0], "a full set: the block written longest ago (the first) makes room"
    producer.block(last).fill_(-1.0)
    producer.commit(last, digests[WAYS])
    assert consumer.lookup(digests[0]) is None and consumer.lookup(digests[WAYS]) == slots[0]
    assert torch.equal(consumer.block(slots[2]), torch.full(shape, 2.0)) and producer.num_evicted == 1


def test_a_long_prompt_is_loaded_whole_from_a_small_shared_file(tiny_model_dir, tmp_path, in_process):
    """A prompt of 60 blocks in a shared file of 96 slots (a file where, if each block had only the
    slot its digest names, several of them would replace each other): the consumer loads all 60."""
    path = str(tmp_path / "shared.bin")
    ps = prompts(1, 241, seed=12)
    size = 4096 + 96 * (64 + 2048)                    # the tiny model's block: 2 layers, K and V, 2 KiB
    producer = make(tiny_model_dir, num_kv_blocks=80, kv_transfer_config=role("kv_producer", path, size))
    consumer = make(tiny_model_dir, num_kv_blocks=80, kv_transfer_config=role("kv_consumer", path, size))
    store = consumer.llm_engine.parts.scheduler.connector.store
    producer.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=1))
    assert run(consumer, [ps]) == run(make(tiny_model_dir, phase=9, num_kv_blocks=80), [ps])
    assert store.num_slots == 96 and consumer.llm_engine.get_stats()["kv_offload_loaded_blocks"] == 60


def test_a_long_load_waits_its_turns_beside_running_requests(tiny_model_dir, tmp_path, in_process):
    """load_blocks_per_step=4: a prompt of 10 tier blocks that arrives while another request
    decodes loads 4, 4, then 2 blocks in three steps (its loaded blocks held for it, the other
    request's tokens coming every step), then runs; alone, a request loads its 10 at once. Both
    give phase 9's tokens; a request aborted while it loads gives back what it held."""
    path = str(tmp_path / "shared.bin")
    ps = prompts(3, 41, seed=13)
    want = run(make(tiny_model_dir, phase=9), [[p] for p in ps])
    producer = make(tiny_model_dir, kv_transfer_config=role("kv_producer", path))
    producer.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=1))
    config = role("kv_consumer", path)
    config["kv_connector_extra_config"]["load_blocks_per_step"] = 4
    consumer = make(tiny_model_dir, num_kv_blocks=64, kv_transfer_config=config)
    engine, loads = consumer.llm_engine, []
    worker = engine.parts.attention.worker
    start = worker.start_load_kv
    worker.start_load_kv = lambda meta: loads.append(len(meta.loads) if meta else 0) or start(meta)
    long_output = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("busy", {"prompt_token_ids": [7, 8, 9]}, long_output)
    engine.step()
    engine.add_request("long", {"prompt_token_ids": ps[0]}, GREEDY)
    outputs, busy_tokens = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "busy":
                busy_tokens.append(len(out.outputs[0].token_ids))
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert [n for n in loads if n] == [4, 4, 2], f"the loads of each step: {loads}"
    assert busy_tokens[:4] == [2, 3, 4, 5], f"the running request got a token every step: {busy_tokens}"
    assert outputs["long"] == want[0]
    loads.clear()
    engine.add_request("alone", {"prompt_token_ids": ps[1]}, GREEDY)
    assert [o.request_id for o in engine.step()] == ["alone"] and loads == [10]   # alone: at once, and runs
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert outputs["alone"] == want[1]
    free = engine.parts.allocator.num_free_blocks
    engine.add_request("busy2", {"prompt_token_ids": [5, 6]}, long_output)
    engine.step()
    engine.add_request("gone", {"prompt_token_ids": ps[2]}, GREEDY)
    engine.step()
    assert engine.parts.scheduler.connector.held, "the long prompt is loading, its first blocks held"
    engine.abort_request(["gone", "busy2"])
    assert not engine.parts.scheduler.connector.held and engine.parts.allocator.num_free_blocks == free


def test_a_step_with_transfers_leaves_the_c_step_to_the_next(tiny_codes_dir, in_process, monkeypatch):
    """A decode step that saves a block (every 4 tokens here) runs its layers one by one, between
    their saves; the steps after it are cpu_step.c's again, where it serves this model."""
    llm = make(tiny_codes_dir, num_kv_blocks=48, kv_transfer_config=tier())
    c_step = llm.llm_engine.runner.decode_runner.c_step
    if c_step is None or not c_step.serves(1):
        pytest.skip("cpu_step.c serves no step of this model on this CPU kind (the platform's rules)")
    served, call = [], type(c_step).__call__

    def counted(self, *args):
        out = call(self, *args)
        served.append(out is not None)
        return out

    monkeypatch.setattr(type(c_step), "__call__", counted)
    want = run(make(tiny_codes_dir, phase=9, num_kv_blocks=48), [prompts(1, 9, seed=14)])
    served.clear()
    assert run(llm, [prompts(1, 9, seed=14)]) == want
    assert llm.llm_engine.get_stats()["kv_offload_saved_blocks"] >= 3
    assert c_step.serves(1) and served and all(served), f"cpu_step.c ran these decode steps: {served}"


def test_a_producer_and_a_consumer_each_in_an_engine_core_process(tiny_model_dir, tmp_path):
    """Two engines, two engine core processes, one shared file: the consumer reads what the
    producer's process wrote."""
    path = str(tmp_path / "shared.bin")
    ps = prompts(3, 41, seed=11)
    want = run(make(tiny_model_dir, phase=9), [[p] for p in ps])
    producer = make(tiny_model_dir, kv_transfer_config=role("kv_producer", path))
    consumer = make(tiny_model_dir, kv_transfer_config=role("kv_consumer", path))
    try:
        producer.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=1))
        assert run(consumer, [[p] for p in ps]) == want
        assert consumer.llm_engine.get_stats()["kv_offload_loaded_blocks"] == 3 * 10
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()


@pytest.mark.parametrize("change, error", [
    ("no producer", r"cannot open the producer's tier file .*start the kv_producer first"),
    ("block_size", r"kv_consumer: KV tier file .* is from another block size \(4, this engine's 8\)"),
    ("model", r"kv_consumer: KV tier file .* is from another model \('\w+', this engine's '\w+'\)"),
    ("cpu_bytes_to_use", r"is from another size \(cpu_bytes_to_use\)"),
])
def test_a_consumer_of_another_model_or_block_size_is_refused_at_start(change, error, tiny_model_dir,
                                                                     tiny_model_dir_llama3, tmp_path, in_process):
    path = str(tmp_path / "shared.bin")
    if change != "no producer":
        make(tiny_model_dir, kv_transfer_config=role("kv_producer", path))
    model, args = tiny_model_dir, dict(num_kv_blocks=24, block_size=BS, compilation_mode=0)
    cpu_bytes = 1 << 22
    if change == "block_size":
        args["block_size"] = 8
    elif change == "model":
        model = tiny_model_dir_llama3
    elif change == "cpu_bytes_to_use":
        cpu_bytes = 1 << 21
    with pytest.raises(ValueError, match=error):
        LLM(str(model), phase=10, kv_transfer_config=role("kv_consumer", path, cpu_bytes), **args)


@pytest.mark.parametrize("args, error", [
    (dict(kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_both"}), r"\['kv_connector'\] must be"),
    (dict(kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_consumer"}),
     r"\['path'\] is needed with kv_role='kv_consumer'"),
    (dict(kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "both"}), r"\['kv_role'\] must be"),
    (dict(kv_transfer_config={"kv_connector": "OffloadingConnector", "rank": 0}), r"unknown key\(s\) \['rank'\]"),
    (dict(kv_transfer_config=tier(num_cpu_blocks=8)), r"kv_connector_extra_config'\]: unknown key\(s\) \['num_cpu_blocks'\]"),
    (dict(kv_transfer_config=tier(0)), r"\['cpu_bytes_to_use'\] must be an int >= 1"),
    (dict(kv_transfer_config=tier(5000)), r"cpu_bytes_to_use=5000 holds no KV block"),
    (dict(kv_transfer_config=tier(load_blocks_per_step=-1)), r"\['load_blocks_per_step'\] must be an int >= 0"),
    (dict(kv_transfer_config=tier(load_blocks_per_step=2.5)), r"\['load_blocks_per_step'\] must be an int >= 0"),
    (dict(kv_transfer_config=tier(), enable_prefix_caching=False), r"leave enable_prefix_caching=True"),
    (dict(kv_transfer_config=tier(), kv_cache_dtype="int8"), r"kv_cache_dtype='int8'"),
    (dict(kv_transfer_config=tier(), async_scheduling=True), r"async_scheduling: a step's loads and saves must end"),
    (dict(kv_transfer_config="OffloadingConnector"), r"kv_transfer_config must be a dict"),
    (dict(kv_transfer_config=tier(), phase=9), r"phase 9 does not have this feature \(phase 10 is the first"),
])
def test_a_bad_kv_transfer_config_is_refused_by_name(args, error, tiny_model_dir, in_process):
    args = {"phase": 10, **args}
    with pytest.raises((ValueError, TypeError), match=error):
        LLM(str(tiny_model_dir), num_kv_blocks=24, block_size=BS, **args)


@pytest.mark.server
def test_a_proxy_gives_one_endpoint_for_a_producer_and_a_consumer(tiny_model_dir, tmp_path):
    """`tinyvllm serve` as kv_producer and as kv_consumer, `tinyvllm proxy` in front of them: a
    completion through the proxy, whole and streamed, gives phase 9's greedy text, and the
    consumer loaded the prompts' full blocks from the tier; a bad request is the prefill server's
    400, which the decode server never sees; with the prefill server killed, a 502 naming it."""
    import json
    import subprocess
    import sys
    import time

    import httpx

    from tinyvllm.entrypoints.bench.serve import _free_port, start_builtin_server

    path = str(tmp_path / "shared.bin")
    procs = []

    def serve(kv_role: str) -> str:
        proc, url = start_builtin_server(
            [str(tiny_model_dir), "--phase", "10", "--block-size", str(BS), "--num-kv-blocks", "24",
             "--compilation-mode", "0", "--log-level", "warning", "--served-model-name", "tiny",
             "--kv-transfer-config", json.dumps(role(kv_role, path))], timeout=120,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        return url

    try:
        prefill = serve("kv_producer")          # the consumer opens the producer's tier file at start
        decode = serve("kv_consumer")
        port = _free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "tinyvllm.entrypoints.cli", "proxy", "--prefill", prefill,
                                       "--decode", decode, "--port", str(port), "--log-level", "warning"]))
        proxy = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(proxy + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the proxy did not answer /health within 60 s"
            time.sleep(0.3)
        texts = ["one two three four five six seven eight nine ten eleven twelve",
                 "the quick brown fox jumps over the lazy dog again and again"]
        body = dict(model="tiny", max_tokens=8, temperature=0, ignore_eos=True)
        whole = httpx.post(proxy + "/v1/completions", json={**body, "prompt": texts[0]}, timeout=60)
        assert whole.status_code == 200, whole.text
        got = [whole.json()["choices"][0]["text"]]
        with httpx.stream("POST", proxy + "/v1/completions", json={**body, "prompt": texts[1], "stream": True},
                          timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        got.append("".join(c["choices"][0]["text"] for c in chunks))
        offline = LLM(str(tiny_model_dir), phase=9, compilation_mode=0)
        assert got == [o.outputs[0].text for o in offline.generate(texts, SamplingParams(**{
            k: body[k] for k in ("max_tokens", "temperature", "ignore_eos")}), use_tqdm=False)]
        metrics = httpx.get(decode + "/metrics", timeout=10).text
        loaded = float(next(line.split()[-1] for line in metrics.splitlines()
                            if line.startswith("tinyvllm:kv_offload_loaded_blocks_total")))
        assert loaded >= 2 * 2, f"the consumer loaded {loaded} blocks of the two prompts from the tier"
        bad = httpx.post(proxy + "/v1/completions", json={**body, "prompt": texts[0], "temperature": -1}, timeout=60)
        assert bad.status_code == 400 and "temperature" in bad.text
        assert httpx.post(proxy + "/v1/completions", content=b"{not json", timeout=10).status_code == 400
        procs[0].kill()                                   # the prefill server dies: named, and the proxy goes on
        procs[0].wait(30)
        gone = httpx.post(proxy + "/v1/completions", json={**body, "prompt": texts[0]}, timeout=60)
        assert gone.status_code == 502 and f"the prefill server {prefill} cannot be reached" in gone.text
        assert httpx.get(proxy + "/health", timeout=10).status_code == 502
        assert httpx.get(proxy + "/v1/models", timeout=10).status_code == 200
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
