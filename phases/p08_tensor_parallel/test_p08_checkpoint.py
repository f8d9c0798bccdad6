"""Phase 8's checkpoint: tensor parallelism over two ranks gives one rank's tokens, each rank holds
its share of the weights and of the KV cache, bad sizes are refused naming the argument, and no
rank outlives its engine."""

from __future__ import annotations

import copy
import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phases.p08_tensor_parallel.layers import VocabParallelEmbedding, _keep_rows, head_ranges
from phases.p08_tensor_parallel.parallel import TensorParallelGroup, shard_range
from tinyvllm import LLM, SamplingParams
from tinyvllm.entrypoints.bench.serve import start_builtin_server
from tinyvllm.testing import make_tiny_llama

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(20, 57))},
           {"prompt_token_ids": [3] * 9}]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def tokens(llm, params, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, kv_cache_memory=1 << 22)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir):
    return LLM(str(tiny_model_dir), phase=8, kv_cache_memory=1 << 22)


@pytest.mark.parametrize("num_heads, num_kv_heads, world", [(4, 2, 2), (9, 3, 2), (8, 2, 4), (8, 1, 2),
                                                            (6, 3, 3), (4, 4, 1), (12, 2, 4)])
def test_head_ranges_cover_every_head_once(num_heads, num_kv_heads, world):
    group = num_heads // num_kv_heads
    where = f"{num_heads} query heads over {num_kv_heads} KV heads, {world} ranks"
    q_seen, kv_seen = [], set()
    for rank in range(world):
        (q0, q1), (k0, k1) = head_ranges(num_heads, num_kv_heads, rank, world)
        assert q1 > q0 and k1 > k0, f"{where}: rank {rank} holds no heads: query {q0}..{q1 - 1}, KV {k0}..{k1 - 1}"
        q_seen += range(q0, q1)
        kv_seen |= set(range(k0, k1))
        # every query head of this rank sits with its own KV head
        strays = [q for q in range(q0, q1) if not k0 <= q // group < k1]
        assert not strays, (f"{where}: rank {rank} holds query heads {q0}..{q1 - 1} and KV heads {k0}..{k1 - 1}; query "
                            f"head q needs KV head q // {group}, so {strays} are on a rank without their KV head")
    assert sorted(q_seen) == list(range(num_heads)) and kv_seen == set(range(num_kv_heads)), (
        f"{where}: every query head on exactly one rank, every KV head on some rank: the ranks hold query heads "
        f"{sorted(q_seen)} and KV heads {sorted(kv_seen)}")


def test_shard_ranges_split_evenly():
    for n, world in [(10, 3), (49152, 2), (1536, 4), (3, 2)]:
        parts = [shard_range(n, r, world) for r in range(world)]
        assert parts[0][0] == 0 and parts[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert max(b - a for a, b in parts) - min(b - a for a, b in parts) <= 1


class _OneRankOfMany(TensorParallelGroup):
    """A rank's group without the other ranks: all_reduce hands back this rank's part, and keeps
    a copy, so a test can add the parts of every rank itself."""

    def __init__(self):
        super().__init__()
        self.parts = []

    def all_reduce(self, x):
        self.parts.append(x.clone())
        return x


def test_row_parallel_linear_sums_its_partial_product():
    """A rank's RowParallelLinear: its partial product x_r @ W_r^T (+ bias) goes through the
    group's all_reduce once, which here hands back this rank's part."""
    from phases.p08_tensor_parallel.layers import RowParallelLinear

    linear, x, group = nn.Linear(6, 4), torch.randn(3, 6), _OneRankOfMany()
    with torch.no_grad():
        out, want = RowParallelLinear(linear, group)(x), linear(x)
    assert len(group.parts) == 1, (f"the partial product goes through the group's all_reduce once (the sum over "
                                   f"ranks): all_reduce was called {len(group.parts)} times")
    assert group.parts[0].shape == want.shape and torch.allclose(group.parts[0], want), (
        f"what is summed over the ranks is this rank's partial product, self.linear(x) {tuple(want.shape)}: "
        f"all_reduce got a {tuple(group.parts[0].shape)} tensor" + (" (the input?)" if group.parts[0].shape == x.shape else ""))
    assert torch.allclose(out, want), "the layer returns what all_reduce gives back"


def test_vocab_parallel_embedding_sums_to_the_whole_table():
    """Each of 3 ranks holds its rows of a 10-token table: its part is the row of each id it
    holds and zeros for the others, and the parts' sum (the all-reduce) is the whole lookup."""
    table = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([0, 9, 3, 4, 3, 6, 7, 2])
    parts = []
    for rank in range(3):
        v0, v1 = shard_range(10, rank, 3)
        group = _OneRankOfMany()
        out = VocabParallelEmbedding(table[v0:v1].clone(), v0, group)(ids)
        assert len(group.parts) == 1, "the rank's part goes through the group's all_reduce once (the sum over ranks)"
        part = group.parts[0]
        assert part.shape == (len(ids), 4) and torch.equal(out, part)
        for i, t in enumerate(ids.tolist()):
            want = table[t] if v0 <= t < v1 else torch.zeros(4)
            assert torch.equal(part[i], want), (
                f"rank {rank} holds ids {v0}..{v1 - 1}: for id {t} its part must be "
                + ("that id's row" if v0 <= t < v1 else "zeros (another rank holds the id)"))
        parts.append(part)
    torch.testing.assert_close(sum(parts), F.embedding(ids, table), rtol=0, atol=0)


def test_column_parallel_keeps_its_output_columns():
    """Three ranks keep their rows of a linear layer (with a bias): side by side, their outputs are
    the whole layer's, and each holds only its own rows in memory."""
    full = nn.Linear(6, 10)
    x = torch.randn(5, 6)
    outs = []
    for rank in range(3):
        o0, o1 = shard_range(10, rank, 3)
        layer = copy.deepcopy(full)
        _keep_rows(layer, o0, o1)
        assert layer.weight.shape == (o1 - o0, 6) and layer.bias.shape == (o1 - o0,), (
            f"rank {rank} keeps outputs {o0}..{o1 - 1}: weight ({o1 - o0}, 6) and bias ({o1 - o0},), got "
            f"{tuple(layer.weight.shape)} and {tuple(layer.bias.shape)}")
        assert layer.out_features == o1 - o0, (f"out_features must say how many outputs the shard has, {o1 - o0}: "
                                               f"got {layer.out_features}")
        assert layer.weight.untyped_storage().nbytes() == (o1 - o0) * 6 * 4, (
            "the shard's weight still holds the whole matrix's memory: clone the rows it keeps")
        assert not layer.weight.requires_grad
        outs.append(layer(x))
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(outs, dim=1), full(x))


def test_two_ranks_give_one_rank_tokens(two_ranks, one_rank):
    """Greedy and seeded sampling, prompts of several lengths at once: the same tokens."""
    assert tokens(two_ranks, GREEDY) == tokens(one_rank, GREEDY)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    assert tokens(two_ranks, seeded) == tokens(one_rank, seeded)
    assert two_ranks.llm_engine.runner.num_static_steps > 0       # decode steps took phase 7's path


def test_row_parallel_sums_the_partial_products(two_ranks, one_rank):
    """The logits of one prompt: the two ranks' sums differ from one rank's by float rounding only."""
    a, b = one_rank.llm_engine, two_ranks.llm_engine
    out_a = one_rank.generate(PROMPTS[1], SamplingParams(max_tokens=1, logprobs=5), use_tqdm=False)[0]
    out_b = two_ranks.generate(PROMPTS[1], SamplingParams(max_tokens=1, logprobs=5), use_tqdm=False)[0]
    la, lb = out_a.outputs[0].logprobs[0], out_b.outputs[0].logprobs[0]
    assert list(la) == list(lb)
    for t in la:
        assert abs(la[t].logprob - lb[t].logprob) < 1e-4
    assert a.model_config.vocab_size == b.model_config.vocab_size


def test_each_rank_holds_its_share(two_ranks, one_rank, tiny_model_dir):
    """The driver's weights and KV cache hold half of the heads and MLP columns, so the same KV
    memory holds twice the blocks (on every rank: the block tables are shared)."""
    full, shard = one_rank.llm_engine, two_ranks.llm_engine
    c = full.model_config
    layer = shard.model.model.layers[0]
    assert layer.self_attn.num_heads == c.num_attention_heads // 2
    assert layer.self_attn.num_kv_heads == c.num_key_value_heads // 2
    assert shard.kv_cache.kv.shape[-2] == c.num_key_value_heads // 2
    assert shard.kv_cache.num_blocks == 2 * full.kv_cache.num_blocks
    params = sum(p.numel() for p in shard.model.parameters())
    assert params < 0.6 * sum(p.numel() for p in full.model.parameters())


def test_quantized_and_speculative_over_two_ranks(tiny_model_dir):
    """int8 weights (each rank quantizes its own share) and n-gram drafts run over two ranks, with
    one rank's greedy tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    args = dict(quantization="int8", speculative_config=spec, kv_cache_memory=1 << 22)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}, PROMPTS[1]]
    one = tokens(LLM(str(tiny_model_dir), phase=8, **args), GREEDY, prompts)
    llm = LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, **args)
    try:
        assert tokens(llm, GREEDY, prompts) == one
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("args", [dict(num_kv_blocks=7, max_num_seqs=4), dict(batch_invariant=True),
                                  dict(kv_cache_dtype="int8"), dict(quantization="int4"), dict(enforce_eager=True)],
                         ids=["preempting", "batch_invariant", "int8_kv", "int4", "enforce_eager"])
def test_features_above_the_model_run_unchanged(tiny_model_dir, args):
    """Preemption (a pool too small for the batch), batch invariance, a quantized KV cache, int4
    weights, phase 6's eager steps: two ranks give one rank's greedy tokens. (Not an int8 cache
    after int4 weights: two ranks sum a row-parallel layer's products in another order, 1e-5 apart
    there, and a K or V value next to a rounding boundary of the cache's grid moves a whole step;
    one rank's and two ranks' first-token log-probabilities then differ by up to 2.6e-2 at some
    prompts: lab note 5.)"""
    prompts = [{"prompt_token_ids": list(range(30, 30 + n))} for n in (4, 40, 20, 33)]
    one = LLM(str(tiny_model_dir), phase=8, **args)
    want = tokens(one, GREEDY, prompts)
    llm = LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, **args)
    try:
        assert tokens(llm, GREEDY, prompts) == want
        if "num_kv_blocks" in args:
            assert llm.llm_engine.scheduler.num_preemptions > 0
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.timing
def test_an_idle_engine_outlasts_the_rendezvous_timeout(tiny_model_dir, monkeypatch):
    """Workers wait for the next step as long as the engine is idle: only joining is timed."""
    monkeypatch.setenv("TINYVLLM_RENDEZVOUS_TIMEOUT_S", "2")
    llm = LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, kv_cache_memory=1 << 22)
    try:
        first = tokens(llm, GREEDY, PROMPTS[:1])
        time.sleep(4)
        assert tokens(llm, GREEDY, PROMPTS[:1]) == first
    finally:
        llm.llm_engine.shutdown()


def test_bad_sizes_are_refused(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=64)      # more ranks than cores
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=0)
    with pytest.raises(TypeError, match="tensor_parallel_size"):
        LLM(str(tiny_model_dir), phase=8, tensor_parallel_size="2")
    # 3 query heads and 1 KV head cannot be split over 2 ranks
    odd = make_tiny_llama(tmp_path / "odd", hidden_size=48, num_heads=3, num_kv_heads=1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        LLM(str(odd), phase=8, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2.*phase 7 does not have"):
        LLM(str(tiny_model_dir), phase=7, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="compilation_mode=1 with tensor_parallel_size=2"):
        LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, compilation_mode=1)


def _tp_processes(parent: int | None = None) -> set[int]:
    """The pids of the worker ranks running on this machine (of one parent process: other
    engines, a notebook's say, may run beside the tests)."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines() if "-m phases.p08_tensor_parallel" in line
            and (parent is None or int(line.split()[1]) == parent)}


def test_no_rank_outlives_its_engine(tiny_model_dir):
    """Shutdown, garbage collection and a worker that dies mid-run: no rank is left running, and
    a dead worker fails the step with an error instead of hanging."""
    llm = LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, kv_cache_memory=1 << 22)
    worker = llm.llm_engine.runner.workers[0]
    assert worker.poll() is None and worker.pid in _tp_processes()
    llm.llm_engine.shutdown()
    assert worker.poll() == 0
    llm = LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, kv_cache_memory=1 << 22)
    worker = llm.llm_engine.runner.workers[0]
    del llm
    gc.collect()
    assert worker.poll() is not None
    llm = LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, kv_cache_memory=1 << 22)
    worker = llm.llm_engine.runner.workers[0]
    worker.kill()
    worker.wait()
    group = llm.llm_engine.model.group

    class Posted:   # gloo may leave a root's send to a dead rank waiting forever: none may be posted
        def broadcast(self, *args):
            raise AssertionError("a broadcast was posted to a rank that had exited")

    real_pg, group.pg = group.pg, Posted()
    with pytest.raises(Exception, match=r"rank 1 of this host exited with code -9"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    group.pg = real_pg
    llm.llm_engine.shutdown()
    assert worker.poll() is not None and worker.pid not in _tp_processes()


@pytest.mark.timing
def test_a_worker_exits_when_its_driver_is_killed_while_it_loads(tiny_model_dir):
    """A driver killed (SIGKILL: no shutdown, no finalizer) while its worker still loads: the
    worker ends once it can look (seconds), though its waits would allow ten minutes, and the
    rendezvous directory goes with it."""
    root = Path(__file__).resolve().parents[2]
    script = (f"from tinyvllm import LLM; LLM({str(tiny_model_dir)!r}, phase=8, tensor_parallel_size=2, "
              f"kv_cache_memory=1 << 22)")
    driver = subprocess.Popen([sys.executable, "-c", script], cwd=root,
                              env={**os.environ, "PYTHONPATH": str(root), "TINYVLLM_RENDEZVOUS_TIMEOUT_S": "600"})
    worker = None
    try:
        deadline = time.monotonic() + 60
        while not _tp_processes(parent=driver.pid) and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.02)
        (worker,) = _tp_processes(parent=driver.pid)
        store_path = Path(f"/proc/{worker}/cmdline").read_bytes().split(b"\0")[5].decode()
        os.kill(driver.pid, signal.SIGKILL)                 # the worker is still importing or loading
        driver.wait()
        killed = time.monotonic()
        # it looks for its parent once its imports are done: seconds on a quiet machine, longer
        # beside a busy suite (once more than 20 s); far below the 600 s its waits would allow
        while worker in _tp_processes() and time.monotonic() - killed < 90:
            time.sleep(0.05)
        assert worker not in _tp_processes(), "the worker outlived its driver by 90 s"
        deadline = time.monotonic() + 5
        while os.path.exists(os.path.dirname(store_path.removeprefix("file:"))) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(os.path.dirname(store_path.removeprefix("file:")))
    finally:
        if driver.poll() is None:
            driver.kill()
        if worker in _tp_processes():   # it did outlive the driver: leave nothing running
            os.kill(worker, signal.SIGKILL)


@pytest.mark.server
def test_serve_with_two_ranks(tiny_model_dir, one_rank):
    """`tinyvllm serve --tensor-parallel-size 2` answers with one rank's tokens, and its worker
    stops with it, leaving no rendezvous directory behind."""
    root = Path(__file__).resolve().parents[2]
    proc, url = start_builtin_server([str(tiny_model_dir), "--log-level", "warning", "--served-model-name", "tiny",
                                      "--phase", "8", "--tensor-parallel-size", "2"], timeout=120, cwd=root,
                                     env={**os.environ, "PYTHONPATH": str(root)},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        started = _tp_processes(parent=proc.pid)
        assert len(started) == 1
        store_path = Path(f"/proc/{next(iter(started))}/cmdline").read_bytes().split(b"\0")[5].decode()
        body = {"model": "tiny", "prompt": PROMPTS[1]["prompt_token_ids"], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        text = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        want = one_rank.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].text
        assert text == want
    finally:
        proc.terminate()
        proc.wait(30)
    deadline = time.monotonic() + 10
    while started & _tp_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not started & _tp_processes()
    assert not os.path.exists(os.path.dirname(store_path))
