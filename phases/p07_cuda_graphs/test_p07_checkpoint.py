"""Phase 7 checkpoint: the static decode path gives the eager engine's tokens.

- every bucket size (1..max_num_seqs requests) gives phase 6's greedy tokens (enforce_eager=True);
- a CPU's step runs the rows there are; padded rows (a CUDA graph's bucket) write only the
  scratch block, and never change a real row's tokens;
- batches that shrink (requests finish), grow (requests arrive mid-stream), are preempted, and
  cross bucket boundaries stay correct; seeded sampling too, through the vectorized sampler;
- a static step hands the sampler its logits as it made them, its sequences in their rows' order;
- bad cudagraph_capture_sizes / enforce_eager: errors naming the argument, and an LLM built
  before keeps generating;
- the static step attends with the attention part the recipe chose (phases 2-5's options), on
  metadata made of the buffers, and the metadata a graph captures gives the same logits; phase
  4's Triton kernels run it in the interpreter;
- on a GPU: graph replay equals eager logits for every bucket, one capture per bucket, with the
  Triton kernels and a quantized KV cache too.
"""

from __future__ import annotations

import pytest
import torch

from phases.p05_quantization.quant import QuantizedLinear
from phases.p07_cuda_graphs.decode_runner import bucket_for, default_capture_sizes
from tinyvllm import LLM, SamplingParams
from tinyvllm.testing import token_difference

PROMPTS = ["hello world", "a b c d e f g", "the cat sat", "x", "one two three four five six seven",
           "tiny", "paged attention", "graphs and buckets", "z y x"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def drive(engine, schedule, max_steps=200):
    """Add requests at the steps `schedule` says ({step: [(id, prompt, params)]}); run to the end.
    Returns {id: token ids}."""
    out, step = {}, 0
    while step < max_steps and (engine.has_unfinished_requests() or any(k >= step for k in schedule)):
        for rid, prompt, params in schedule.get(step, []):
            engine.add_request(rid, prompt, params)
        for o in engine.step():
            out[o.request_id] = o.outputs[0].token_ids
        step += 1
    return out


def test_default_capture_sizes():
    assert default_capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and default_capture_sizes(256)[-1] == 256
    assert default_capture_sizes(12) == [1, 2, 4, 8, 12]
    assert default_capture_sizes(1) == [1]
    assert [bucket_for(n, [1, 2, 4, 8]) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


def test_bucket_for_is_the_smallest_that_holds_n():
    for sizes in ([1, 2, 4, 8], [3, 5, 16]):
        for n in range(1, sizes[-1] + 1):
            want = min(s for s in sizes if s >= n)
            try:
                got = bucket_for(n, sizes)
            except ValueError as e:
                raise AssertionError(f"bucket_for({n}, {sizes}) must be {want}, the smallest bucket that holds "
                                     f"{n} rows; it raised: {e}") from None
            assert got == want, f"bucket_for({n}, {sizes}) must be {want}, the smallest bucket that holds {n} rows, got {got}"
    with pytest.raises(ValueError, match="largest bucket"):
        bucket_for(9, [1, 2, 4, 8])


def test_fill_copies_each_row_and_pads_to_the_scratch_block():
    """Two rows in a bucket of 4, blocks of 4, scratch block 9. Row 0: 6 tokens, 5 computed, so its
    query is token 5 at position 5, in slot 3 * 4 + 1 of its table [7, 3]; row 1: 3 tokens, 2
    computed, slot 5 * 4 + 2. Rows 2 and 3: token 0 at position 0, written to the scratch block's
    first slot and attending to it alone."""
    from phases.p07_cuda_graphs.decode_runner import StaticDecodeBuffers

    b = StaticDecodeBuffers(max_rows=4, max_blocks=3, block_size=4, scratch_block=9, device=torch.device("cpu"))
    b.input_ids.fill_(-1), b.positions.fill_(-1), b.slot_mapping.fill_(-1), b.block_tables.fill_(-1)  # an earlier step's
    token_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 0, 0], [20, 21, 22, 0, 0, 0, 0, 0]])
    b.fill(token_ids, torch.tensor([5, 2]), torch.tensor([[7, 3, 0], [5, 0, 0]]), torch.tensor([2, 1]), bucket=4)
    got = {"input_ids": b.input_ids.tolist(), "positions": b.positions.tolist(), "slot_mapping": b.slot_mapping.tolist(),
           "seq_lens": b.seq_lens.tolist()}
    want = {"input_ids": [15, 22, 0, 0], "positions": [5, 2, 0, 0], "slot_mapping": [13, 22, 36, 36],
            "seq_lens": [6, 3, 1, 1]}
    why = {"input_ids": "each row's query is its token at position num_computed; a padded row's is token 0",
           "positions": "a row's query sits at position num_computed; a padded row's at 0",
           "slot_mapping": "position p's slot is block_table[p // 4] * 4 + p % 4; a padded row's the scratch "
                           "block's first, 9 * 4",
           "seq_lens": "a row attends to num_computed + 1 keys, its query's included; a padded row to 1"}
    for name in want:
        assert got[name] == want[name], f"{name}: {why[name]}: expected {want[name]}, got {got[name]}"
    assert b.block_tables[:2, :2].tolist() == [[7, 3], [5, 0]] and b.block_tables[2:, 0].tolist() == [9, 9], (
        f"block_tables: the rows' tables (their used columns), and the scratch block first for a padded row: "
        f"got {b.block_tables.tolist()}")
    assert (b.num_blocks_used, b.max_seq_len) == (2, 6), (
        f"num_blocks_used is the most blocks a real row uses (2), max_seq_len its longest length after the step "
        f"(6): got {b.num_blocks_used}, {b.max_seq_len}")


@pytest.mark.parametrize("n", range(1, 9))
def test_every_bucket_gives_eager_tokens(make_llm, tiny_model_dir, n):
    from phases.p07_cuda_graphs.fused import decode_forward

    fast = make_llm(tiny_model_dir, 7, max_num_seqs=8)
    eager = make_llm(tiny_model_dir, 7, max_num_seqs=8, enforce_eager=True)
    assert fast.llm_engine.runner.decode_runner.model_forward.func is decode_forward  # the leaner forward runs
    before = fast.llm_engine.runner.num_static_steps
    got, want = tokens(fast, PROMPTS[:n], GREEDY), tokens(eager, PROMPTS[:n], GREEDY)
    assert got == want, token_difference(got, want, f"{n} requests, static decode steps against enforce_eager")
    assert fast.llm_engine.runner.num_static_steps - before >= GREEDY.max_tokens - 1  # the decodes ran static


@pytest.mark.kinds
def test_quantized_model_runs_the_lean_forward(make_llm, tiny_model_dir):
    """int8 weights (phase 5): the projections are fused as quantized layers, the decode steps run
    `decode_forward`, and the tokens are enforce_eager's."""
    from phases.p07_cuda_graphs.fused import FusedLlamaAttention, FusedLlamaMLP, decode_forward

    fast = make_llm(tiny_model_dir, 7, max_num_seqs=4, quantization="int8")
    eager = make_llm(tiny_model_dir, 7, max_num_seqs=4, quantization="int8", enforce_eager=True)
    assert fast.llm_engine.runner.decode_runner.model_forward.func is decode_forward
    fused = [m for m in fast.llm_engine.model.modules() if isinstance(m, (FusedLlamaAttention, FusedLlamaMLP))]
    assert len(fused) == 2 * len(fast.llm_engine.model.model.layers)
    assert tokens(fast, PROMPTS[:3], GREEDY) == tokens(eager, PROMPTS[:3], GREEDY)


def pad_like_a_cuda_graph(llm, monkeypatch) -> None:
    """For this test, a CPU engine's decode runner pads its steps to buckets as a CUDA graph's
    does (a CPU's runners run the rows there are: `DecodeRunner.fixed_shapes` is False)."""
    monkeypatch.setattr(llm.llm_engine.runner.decode_runner, "fixed_shapes", True)


@pytest.mark.parametrize("padded", [True, False])
def test_padding_writes_only_the_scratch_block(tiny_model_dir, padded, monkeypatch):
    """3 requests in a bucket of 8: padded (a CUDA graph's shape), the 5 rows past them write the
    scratch block and nothing else; on a CPU's runner the step is 3 rows, and the scratch block
    stays as it was. (An engine of its own: another test's step may have left these same
    values in these slots.)"""
    llm = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8, cudagraph_capture_sizes=(8,))
    if padded:
        pad_like_a_cuda_graph(llm, monkeypatch)
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(f"pad{i}", PROMPTS[i], GREEDY)
    engine.step()  # the prefills
    kv = engine.kv_cache.kv
    before = kv.clone()
    seqs = list(engine.scheduler.running)
    steps = engine.runner.num_static_steps
    engine.step()  # one decode step: 3 real rows, padded to 8 or not
    assert engine.runner.num_static_steps == steps + 1
    bs = engine.config.block_size
    changed = (kv != before).flatten(4).any(-1).any(0).any(0).flatten().nonzero()[:, 0].tolist()  # slots
    real = {s.block_table.slot(s.num_computed_tokens - 1, bs) for s in seqs}
    scratch_block = engine.runner.buffers.scratch_block
    assert scratch_block == engine.kv_cache.num_blocks - 1 == engine.allocator.num_blocks  # never handed out
    scratch = set(range(scratch_block * bs, (scratch_block + 1) * bs))
    assert set(changed) - scratch == real, (
        f"a decode step writes each real row's slot {sorted(real)} and, for padded rows, only the scratch block "
        f"(slots {min(scratch)}..{max(scratch)}): it also wrote slots {sorted(set(changed) - scratch - real)}"
        f"{' and missed ' + str(sorted(real - set(changed))) if real - set(changed) else ''}")
    assert bool(set(changed) & scratch) == padded  # the padded rows did write, there
    engine.abort_request([f"pad{i}" for i in range(3)])


def test_padded_rows_never_change_real_rows(make_llm, tiny_model_dir, monkeypatch):
    exact = make_llm(tiny_model_dir, 7, max_num_seqs=8, cudagraph_capture_sizes=(1, 2, 3, 4, 5, 6, 7, 8))
    padded = make_llm(tiny_model_dir, 7, max_num_seqs=8, cudagraph_capture_sizes=(8,))
    pad_like_a_cuda_graph(padded, monkeypatch)
    for n in (1, 3, 5):
        got, want = tokens(padded, PROMPTS[:n], GREEDY), tokens(exact, PROMPTS[:n], GREEDY)
        assert got == want, token_difference(got, want, f"{n} requests padded to a bucket of 8, against buckets of their size")


def test_shrink_grow_cross_buckets_and_preempt(make_llm, tiny_model_dir):
    """Requests of different lengths finish (shrink: 8 -> 4 -> 2 -> 1 buckets), others arrive
    mid-stream (grow across buckets); a small cache forces preemptions."""
    def sp(k):
        return SamplingParams(max_tokens=k, temperature=0, ignore_eos=True)
    schedule = {0: [(f"a{i}", PROMPTS[i], sp(3 + 3 * i)) for i in range(5)],
                4: [(f"b{i}", PROMPTS[5 + i], sp(12)) for i in range(4)],
                9: [("c0", PROMPTS[0], sp(20))],
                30: [("d0", PROMPTS[2], sp(5))]}
    for kw in ({}, {"num_kv_blocks": 9, "block_size": 8}):
        fast = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8, **kw).llm_engine
        eager = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8, enforce_eager=True,
                    **{k: (v + 1 if k == "num_kv_blocks" else v) for k, v in kw.items()}).llm_engine
        got, want = drive(fast, schedule), drive(eager, schedule)
        assert len(want) == 11 and got == want, (
            f"requests finishing and arriving across buckets{', preempted' if kw else ''}: "
            + token_difference([got.get(k, []) for k in sorted(want)], [want[k] for k in sorted(want)],
                               "static steps against enforce_eager (requests in the order " + ", ".join(sorted(want)) + ")"))
        assert fast.runner.num_static_steps > 10
        if kw:
            assert fast.scheduler.num_preemptions > 0


def test_the_static_step_hands_over_its_logits_as_they_are(tiny_model_dir):
    """A static step's logits go to the sampler as the decode step made them, its sequences in
    their rows' order (no (n, V) copy into the plan's order, 9 MB a step at 48 requests), also
    when the plan's order differs from the rows'; the tokens are the eager engine's."""
    def sp(k):
        return SamplingParams(max_tokens=k, temperature=0, ignore_eos=True)
    schedule = {0: [(f"a{i}", PROMPTS[i], sp(3 + 3 * i)) for i in range(5)],
                4: [(f"b{i}", PROMPTS[5 + i], sp(12)) for i in range(4)]}
    fast = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8).llm_engine
    runner, ib, steps = fast.runner.decode_runner, fast.runner.input_batch, []
    run, sync, sample = runner.run, ib.sync, fast.sampler.sample
    step = {}

    def sample_and_check(out):
        if "made" in step:   # a static step: its plan, the tensor the decode step made, its output
            assert out.logits.data_ptr() == step["made"].data_ptr()
            assert [ib.row_of[s.seq_id] for s in out.seqs] == list(range(len(out.seqs)))
            steps.append(step["plan"] != out.seqs)
        step.clear()
        return sample(out)

    runner.run = lambda bucket: step.setdefault("made", run(bucket))
    ib.sync = lambda seqs: (step.setdefault("plan", list(seqs)), sync(seqs))[1]
    fast.sampler.sample = sample_and_check
    want = drive(LLM(str(tiny_model_dir), phase=7, max_num_seqs=8, enforce_eager=True).llm_engine, schedule)
    assert drive(fast, schedule) == want
    assert len(steps) > 10 and any(steps)   # some steps' plans were not in their rows' order


def test_seeded_sampling_equals_eager(make_llm, tiny_model_dir):
    fast = make_llm(tiny_model_dir, 7, max_num_seqs=8)
    eager = make_llm(tiny_model_dir, 7, max_num_seqs=8, enforce_eager=True)
    handed = []   # the static steps hand the sampler the batch's parameters as tensors
    sample = fast.llm_engine.sampler.sample
    fast.llm_engine.sampler.sample = lambda out: (handed.append(out.sampling is not None), sample(out))[1]
    params = [SamplingParams(max_tokens=8, temperature=0.8, top_k=7, seed=1),
              SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, min_p=0.05, seed=2),
              SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=8, temperature=0.6)]
    got = [o.outputs[0].token_ids for o in fast.generate(PROMPTS[:4], params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS[:4], params, use_tqdm=False)]
    assert got[:3] == want[:3]  # the unseeded row draws its seed from each engine's own generator
    del fast.llm_engine.sampler.sample
    assert any(handed)
    # penalties and logprobs: the same sampler, on tensors from the persistent batch
    p = SamplingParams(max_tokens=6, temperature=0.9, seed=4, presence_penalty=0.5, logprobs=2)
    o1, o2 = fast.generate(PROMPTS[:2], p, use_tqdm=False), eager.generate(PROMPTS[:2], p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in o1] == [o.outputs[0].token_ids for o in o2]
    # the same top tokens; their logprobs within float32's rounding (the decode step's fused
    # add + RMSNorm sums the squares in its own order)
    for a, b in zip(o1[0].outputs[0].logprobs, o2[0].outputs[0].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.mark.parametrize("kwargs,match,exc", [
    ({"cudagraph_capture_sizes": []}, "cudagraph_capture_sizes", ValueError),
    ({"cudagraph_capture_sizes": [4, 2]}, "cudagraph_capture_sizes", ValueError),
    ({"cudagraph_capture_sizes": [1, 16]}, "cudagraph_capture_sizes", ValueError),
    ({"cudagraph_capture_sizes": [0, 2]}, "cudagraph_capture_sizes", ValueError),
    ({"enforce_eager": "yes"}, "enforce_eager", TypeError),
    ({"num_kv_blocks": 1}, "num_kv_blocks", ValueError),
])
def test_bad_input(make_llm, tiny_model_dir, kwargs, match, exc):
    before = make_llm(tiny_model_dir, 7, max_num_seqs=8)
    with pytest.raises(exc, match=match):
        LLM(str(tiny_model_dir), phase=7, max_num_seqs=8, **kwargs)
    assert len(tokens(before, PROMPTS[:2], GREEDY)[0]) == GREEDY.max_tokens


@pytest.mark.slow
def test_default_model_every_bucket(make_llm, default_model_dir):
    fast = make_llm(default_model_dir, 7, max_num_seqs=8)
    eager = make_llm(default_model_dir, 7, max_num_seqs=8, enforce_eager=True)
    p = SamplingParams(max_tokens=8, temperature=0)
    for n in (1, 3, 8):
        assert tokens(fast, PROMPTS[:n], p) == tokens(eager, PROMPTS[:n], p)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_graph_replay_equals_eager_logits_every_bucket(tiny_model_dir, kv_cache_dtype):
    from phases.p07_cuda_graphs.decode_runner import CudaGraphDecodeRunner, DecodeRunner

    # float32: in bfloat16 the captured and eager matmuls may round differently (cuBLAS picks its
    # algorithm per stream); what is checked here is that replay reads the right buffers, through
    # phase 4's Triton kernels (and phase 5's quantized cache read)
    engine = LLM(str(tiny_model_dir), phase=7, max_num_seqs=16, device="cuda", dtype="float32",
                 kv_cache_dtype=kv_cache_dtype).llm_engine
    assert engine.parts.attention.func.__name__.startswith("Triton")
    runner, buffers = engine.runner.decode_runner, engine.runner.buffers
    assert isinstance(runner, CudaGraphDecodeRunner)
    eager = DecodeRunner(engine.model, buffers, engine.parts.attention)
    for i in range(16):
        engine.add_request(f"g{i}", PROMPTS[i % len(PROMPTS)], GREEDY)
    engine.step()  # prefills: the cache now holds every prompt
    ib = engine.runner.input_batch
    ib.sync(list(engine.scheduler.running))
    for _ in range(2):  # the second round replays: no new capture
        for bucket in engine.runner.capture_sizes:
            n = min(bucket, ib.num_reqs)
            buffers.fill(ib.token_ids[:n], ib.num_computed[:n], ib.block_table[:n], ib.num_blocks[:n], bucket)
            want = eager.run(bucket)[:n].clone()
            got = runner.run(bucket)[:n]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert runner.num_captures == len(engine.runner.capture_sizes) == len(runner.graphs)


@pytest.mark.gpu
def test_a_graph_replay_checks_its_buffers_first(tiny_model_dir):
    """Checked mode on a GPU: a captured graph reads the static buffers as they are, so each
    replay checks them first (outside the graph)."""
    engine = LLM(str(tiny_model_dir), phase=7, max_num_seqs=2, device="cuda", dtype="float32",
                 check_kernels=True).llm_engine
    runner, buffers, ib = engine.runner.decode_runner, engine.runner.buffers, engine.runner.input_batch
    engine.add_request("g", PROMPTS[0], GREEDY)
    engine.step()  # the prefill
    ib.sync(list(engine.scheduler.running))
    buffers.fill(ib.token_ids[:1], ib.num_computed[:1], ib.block_table[:1], ib.num_blocks[:1], 1)
    runner.run(1)                                                    # captured, replayed
    buffers.block_tables[0, 0] = engine.parts.kv_cache.num_blocks    # one past the pool
    with pytest.raises(ValueError, match="^StaticDecodeBuffers: sequence row 0, block 0: block id"):
        runner.run(1)


@pytest.mark.kinds
@pytest.mark.parametrize("where", ["persistent batch", "static buffers"])
def test_a_slip_in_the_static_path_fails_its_step_not_the_process(tiny_model_dir, where, monkeypatch):
    """Checked mode, the engine's default on a CPU: a decode step whose persistent batch or static
    buffers point outside the pool (a block id one past its end) fails as a StepError naming what
    is wrong, before cpu_attention.c (or cpu_step.c, or the compiled step) reads it; its requests
    are aborted, their blocks freed, and the engine serves the next request as before."""
    from tinyvllm.errors import StepError

    llm = LLM(str(tiny_model_dir), phase=7, max_num_seqs=4)
    engine = llm.llm_engine
    runner, past_the_pool = engine.runner, engine.parts.kv_cache.num_blocks
    for i in range(2):
        engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
    engine.step()                                       # the prefills (phase 6's runner)
    if where == "persistent batch":                     # a slip in update_row
        update = runner.input_batch.update
        monkeypatch.setattr(runner.input_batch, "update",
                            lambda seq: (update(seq), runner.input_batch.block_table[0].fill_(past_the_pool)))
        pattern = r"InputBatch: row 0 holds seq \d+ with \(tokens, computed, blocks, next token\)"
    else:                                               # a slip in fill_buffers
        fill = runner.buffers.fill
        monkeypatch.setattr(runner.buffers, "fill", lambda *a: (fill(*a), runner.buffers.block_tables[1, 0].fill_(past_the_pool)))
        pattern = rf"CpuPagedAttention: sequence row 1, block 0: block id {past_the_pool} is outside the pool"
    with pytest.raises(StepError, match=pattern) as e:
        engine.step()
    assert sorted(e.value.request_ids) == ["r0", "r1"] and not engine.has_unfinished_requests()
    assert engine.parts.allocator.num_free_blocks == engine.parts.allocator.num_blocks
    monkeypatch.undo()                                  # the slip mended
    eager = LLM(str(tiny_model_dir), phase=7, enforce_eager=True)
    assert tokens(llm, PROMPTS[2:4], GREEDY) == tokens(eager, PROMPTS[2:4], GREEDY)


@pytest.mark.kinds
@pytest.mark.parametrize("fixture,quantization", [("tiny_model_dir", None), ("tiny_model_dir_llama3", None),
                                                  ("tiny_model_dir", "int8"), ("tiny_model_dir", "int4"),
                                                  ("tiny_qwen3_dir", None), ("tiny_qwen2_dir", "int8")])
def test_fused_projections_are_bit_identical(request, monkeypatch, fixture, quantization):
    import copy

    import phases.p04_triton_kernels.cpu_layers as cpu_layers
    import phases.p07_cuda_graphs.fused as fused_module

    from phases.p07_cuda_graphs.fused import (
        FusedLlamaAttention,
        FusedLlamaMLP,
        decode_forward,
        fuse_projections,
        fused_model,
    )

    class NoCache:  # attention stand-in: the projections and MLP are what is checked
        def __call__(self, layer_idx, q, k, v):
            return q + k.repeat_interleave(q.shape[1] // k.shape[1], 1) * v.repeat_interleave(
                q.shape[1] // v.shape[1], 1)

    model = LLM(str(request.getfixturevalue(fixture)), phase=7, enforce_eager=True,
                quantization=quantization).llm_engine.model
    fused = copy.deepcopy(model)
    n_layers = len(model.model.layers)
    assert fuse_projections(fused) == 2 * n_layers
    assert isinstance(fused.model.layers[0].self_attn, FusedLlamaAttention)
    assert isinstance(fused.model.layers[0].mlp, FusedLlamaMLP)
    assert fused_model(fused) and not fused_model(model)
    if quantization:  # phase 5's layers fused as they are: stacked rows, no float weight made
        qkv = fused.model.layers[0].self_attn.qkv_proj
        assert type(qkv) is QuantizedLinear and qkv.method == quantization
        parts = [getattr(model.model.layers[0].self_attn, f"{x}_proj") for x in "qkv"]
        rows = lambda m: m.int8_rows() if m.method == "int8" else m.qweight  # noqa: E731
        assert torch.equal(rows(qkv), torch.cat([rows(m) for m in parts]))
        # the same bytes, or fewer: one layout's padding (cpu_int8_vnni's panels of 64 rows) for all
        assert qkv.weight_bytes() <= sum(m.weight_bytes() for m in parts)
    # an int8 or int4 layer rounds its input to integers: a last-bit difference in the norm's
    # output can move one of them by a step
    tol = 1e-3 if quantization else 1e-4
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n in (1, 2, 3, 8):
            ids, pos = torch.randint(0, 300, (n,), generator=g), torch.arange(n) + 5
            expected = model(ids, pos, NoCache())
            assert torch.equal(expected, fused(ids, pos, NoCache()))
            # the leaner decode forward (add + RMSNorm fused, one RoPE for q and k): float32's
            # rounding apart with cpu_norm.c's norm (its own order of the squares' sum), the same
            # bits with PyTorch's in both (the model's RMSNorm runs cpu_norm.c too where the
            # platform's c_norm_prompt rule says)
            for c_norm in (False, True):
                torch.testing.assert_close(decode_forward(fused, ids, pos, NoCache(), c_norm), expected, rtol=tol,
                                           atol=tol)
            with monkeypatch.context() as m:
                m.setattr(fused_module, "fused_add_rms_norm", lambda *args: None)
                m.setattr(cpu_layers, "fused_add_rms_norm", lambda *args: None)
                assert torch.equal(model(ids, pos, NoCache()), decode_forward(fused, ids, pos, NoCache(), True))


@pytest.mark.kinds
def test_a_prompt_s_mlp_stays_in_bfloat16_between_its_products(tiny_model_dir, monkeypatch):
    """Where the fused MLP's products are oneDNN's bfloat16 ones (dtype="auto", a prompt's rows)
    and the platform's `bf16_mlp` rule is on, gate_up's output is left in bfloat16 and
    `silu_and_mul` and the down projection read it so (phase 4's `bf16_mlp`): the float32 path's
    numbers to bfloat16's rounding, with no float32 gate_up made; the same inside the compiled
    step's OpaqueLinear; rows below `bf16_rows` are float32's."""
    import phases.p04_triton_kernels.cpu_layers as cpu_layers
    import phases.p07_cuda_graphs.fused as fused_module
    from phases.p04_triton_kernels import silu_and_mul, use_bfloat16_products
    from phases.p07_cuda_graphs.compiled import OpaqueLinear
    from tinyvllm import platform

    if not platform.current().onednn:
        pytest.skip("no oneDNN on this kind: its products stay float32")
    model = LLM(str(tiny_model_dir), phase=7, dtype="float32", enforce_eager=True).llm_engine.model
    fused_module.fuse_projections(model)
    mlp = model.model.layers[0].mlp
    assert type(mlp) is fused_module.FusedLlamaMLP and mlp.bf16 == bool(platform.current().rule("bf16_mlp"))
    mlp.bf16 = True                                           # as on a kind whose bf16_mlp rule is on
    for m in (mlp.gate_up_proj, mlp.down_proj):
        m.amx_rows = 0                                        # oneDNN's products at every row count
    x = torch.randn(24, mlp.gate_up_proj.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        f32 = mlp(x)
        use_bfloat16_products(model, 16)
        asked, real = [], cpu_layers.bf16_product
        monkeypatch.setattr(cpu_layers, "bf16_product", lambda m, h, *a: asked.append((h.dtype, *a)) or real(m, h, *a))
        y = mlp(x)
        assert asked == [(torch.float32, torch.bfloat16), (torch.bfloat16,)] and y.dtype == torch.float32
        assert (y - f32).norm() < 2 ** -6 * f32.norm()          # bfloat16 keeps 8 bits
        assert torch.equal(y, real(mlp.down_proj, silu_and_mul(real(mlp.gate_up_proj, x, torch.bfloat16))))
        mlp.gate_up_proj, mlp.down_proj = OpaqueLinear(mlp.gate_up_proj, 0), OpaqueLinear(mlp.down_proj, 1)
        assert torch.equal(mlp(x), y)
        asked.clear()
        assert torch.equal(mlp(x[:15]), f32[:15]) and asked == []


@pytest.mark.kinds
# -- the static step runs the attention the recipe chose ---------------------------------------

@pytest.mark.parametrize("kwargs,expected", [
    ({}, "CpuPagedAttention"),                                        # phase 4's CPU path
    ({"attention_backend": "torch"}, "PagedAttention"),               # phase 2's
    ({"kv_cache_dtype": "int8"}, "QuantizedPagedAttention"),          # phase 5's cache, CPU path
    ({"kv_cache_dtype": "fp8", "attention_backend": "torch"}, "QuantizedPagedAttention"),
    ({"batch_invariant": True}, "BatchInvariantAttention"),           # phase 3's fixed order
])
def test_the_static_step_attends_with_the_recipe_s_attention(tiny_model_dir, kwargs, expected):
    """Phase 7's decode runner is handed the attention part the recipe built (phases 2-5 chose it)
    and makes each step's attention with it, on metadata made of the static buffers; the tokens
    are enforce_eager's, and the metadata a captured graph would read (every block-table column,
    the longest possible length) gives the same logits."""
    from phases.p07_cuda_graphs import DecodeRunner

    if kwargs.get("batch_invariant"):
        from phases.p03_continuous_batching.batch_invariant import KERNELS
        if not KERNELS.available():
            pytest.skip("batch_invariant=True needs AVX2 and a C compiler")
    fast = LLM(str(tiny_model_dir), phase=7, max_num_seqs=4, **kwargs)
    eager = LLM(str(tiny_model_dir), phase=7, max_num_seqs=4, enforce_eager=True, **kwargs)
    engine = fast.llm_engine
    assert engine.runner.decode_runner.attention is engine.parts.attention
    made = []
    attention = engine.parts.attention
    engine.runner.decode_runner.attention = lambda meta: made.append(attention(meta)) or made[-1]
    assert tokens(fast, PROMPTS[:3], GREEDY) == tokens(eager, PROMPTS[:3], GREEDY)
    assert made and {type(a).__name__ for a in made} == {expected}
    for i in range(3):  # a decode step's buffers, run the way a graph is captured
        engine.add_request(f"f{i}", PROMPTS[i], GREEDY)
    engine.step()
    engine.step()
    buffers = engine.runner.buffers
    with torch.inference_mode():
        used = DecodeRunner(engine.model, buffers, attention).run(4)[:3]
        fixed = DecodeRunner(engine.model, buffers, attention, fixed_shapes=True).run(4)[:3]
    torch.testing.assert_close(fixed, used, rtol=1e-5, atol=1e-5)
    engine.abort_request([f"f{i}" for i in range(3)])


@pytest.mark.interpreter
def test_triton_kernels_on_the_static_buffers_in_the_interpreter(tiny_model_dir):
    """Phase 4's Triton kernels (phase 5's quantized read too) run phase 7's static decode step,
    in Triton's interpreter: on the metadata a captured graph reads, they give PyTorch's logits,
    and the engine gives the torch backend's tokens."""
    from phases.p04_triton_kernels.tools.kernel_cases import run_in_subprocess

    result = run_in_subprocess("phases.p07_cuda_graphs.tools.static_cases", str(tiny_model_dir))
    assert result["auto"]["attention"] == "TritonPagedAttention"
    assert result["int8"]["attention"] == "TritonQuantizedPagedAttention"
    for kv, r in result.items():
        assert r["fixed_err"] <= 1e-3 * r["scale"] and r["used_err"] <= 1e-3 * r["scale"], (kv, r)
        assert r["static_steps"] >= 1, (kv, r)
    assert result["int8"]["tokens_equal"], result
