"""Phase 3 checkpoint: the scheduler's rules, and the same tokens as phase 2 and transformers
under any arrival order, heavy preemption, any chunk size, and prefix caching on or off. Every
block is free again after each run."""

import random

import pytest
import torch

from conftest import BAD_STEPS
from phases.p02_paged_kv import BlockAllocator, BlockTable
from phases.p03_continuous_batching import PrefixCachingBlockAllocator, Scheduler, SequenceStatus
from tinyvllm import LLM, SamplingParams
from tinyvllm.testing import token_difference

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(n, seed, lo=1, hi=60):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randint(lo, hi))]} for _ in range(n)]


@pytest.fixture(scope="module")
def prompts():
    return _prompts(10, seed=3)


@pytest.fixture(scope="module")
def hf_tokens(tiny_model_dir, prompts):
    """transformers' greedy tokens on the tiny model: the reference."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: EOS may come, and does not stop
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p["prompt_token_ids"]])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                 do_sample=False, pad_token_id=0)
            out.append(gen[0, ids.shape[1]:].tolist())
    return out


def _all_blocks_free(engine):
    a = engine.allocator
    return a.num_free_blocks == a.num_blocks and not any(a.ref_counts)


def _held(engine) -> str:
    a = engine.allocator
    return (f"{a.num_blocks - a.num_free_blocks} of {a.num_blocks} KV blocks are still held after every request "
            f"finished (blocks with a reference: {[b for b, n in enumerate(a.ref_counts) if n]})")


def _run(engine, prompts, params, order, arrive_every=1):
    """Add requests in `order`, a new one every `arrive_every` steps, and run to the end."""
    pending = list(order)
    results = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % arrive_every == 0:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i], params)
        for out in engine.step():
            if out.finished:
                results[int(out.request_id[1:])] = out.outputs[0].token_ids
        step += 1
    return [results[i] for i in range(len(prompts))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_arrival_order_equals_transformers_and_phase2(seed, tiny_model_dir, prompts, hf_tokens, make_llm):
    engine = LLM(str(tiny_model_dir), phase=3, max_num_seqs=4).llm_engine
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    got = _run(engine, prompts, GREEDY, order, arrive_every=seed + 1)
    assert got == hf_tokens, token_difference(got, hf_tokens, f"arrival order {order}, against transformers")
    phase2 = [o.outputs[0].token_ids for o in make_llm(tiny_model_dir, 2).generate(prompts, GREEDY, use_tqdm=False)]
    assert got == phase2, token_difference(got, phase2, f"arrival order {order}, against phase 2")
    assert _all_blocks_free(engine), _held(engine)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_heavy_preemption_keeps_outputs(prefix_caching, tiny_model_dir, prompts, hf_tokens):
    # 12 blocks of 8: ~2 sequences at a time; 10 requests arrive together and fight for them
    engine = LLM(str(tiny_model_dir), phase=3, num_kv_blocks=12, block_size=8,
                 enable_prefix_caching=prefix_caching).llm_engine
    got = _run(engine, prompts, GREEDY, range(len(prompts)), arrive_every=1)
    assert got == hf_tokens, token_difference(got, hf_tokens, "12 blocks of 8 shared by 10 requests (preempted often), "
                                     "against transformers")
    assert engine.get_stats()["num_preemptions"] >= 5, (
        f"10 requests in 12 blocks of 8 must preempt at least 5 times, counted {engine.get_stats()['num_preemptions']}")
    assert _all_blocks_free(engine), _held(engine)


def test_seeded_sampling_survives_preemption(tiny_model_dir, prompts):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    roomy = LLM(str(tiny_model_dir), phase=3).generate(prompts, params, use_tqdm=False)
    tight_llm = LLM(str(tiny_model_dir), phase=3, num_kv_blocks=12, block_size=8)
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    assert tight_llm.llm_engine.get_stats()["num_preemptions"] > 0, "12 blocks of 8 for 10 requests must preempt"
    tight, roomy = [o.outputs[0].token_ids for o in tight], [o.outputs[0].token_ids for o in roomy]
    assert tight == roomy, token_difference(tight, roomy, "seeded sampling, preempted (12 blocks) against not preempted: a "
                                   "preempted request recomputes its tokens and draws on from its own generator")


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_prefill_any_chunk_size(chunk, tiny_model_dir, prompts, hf_tokens):
    engine = LLM(str(tiny_model_dir), phase=3, max_num_batched_tokens=chunk).llm_engine
    got = _run(engine, prompts, GREEDY, range(len(prompts)))
    assert got == hf_tokens, token_difference(got, hf_tokens, f"max_num_batched_tokens={chunk}, against transformers")
    assert _all_blocks_free(engine), _held(engine)


def test_long_prompt_does_not_stall_running_requests(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), phase=3, max_num_batched_tokens=32).llm_engine
    engine.add_request("short", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()  # the short one is running
    engine.add_request("long", {"prompt_token_ids": list(range(3, 303))}, SamplingParams(max_tokens=2, ignore_eos=True))
    steps_of_long_prefill = 0
    while engine.groups.get("long") and engine.groups["long"].seqs[0].num_output_tokens == 0:
        before = engine.groups["short"].seqs[0].num_output_tokens
        engine.step()
        steps_of_long_prefill += 1
        assert engine.groups["short"].seqs[0].num_output_tokens == before + 1  # a token every step
    assert steps_of_long_prefill >= 300 // 32  # the 300-token prompt went in chunks


def test_prefix_cache_full_hit_on_block_multiple(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), phase=3, block_size=16)
    off = LLM(str(tiny_model_dir), phase=3, block_size=16, enable_prefix_caching=False)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(40, 72))}  # 32 tokens: exactly 2 blocks
    computed = []
    hook = engine.model.register_forward_pre_hook(lambda m, a: computed.append(len(a[0])))
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    n_first = sum(computed)
    computed.clear()
    ids = prompt["prompt_token_ids"]
    hit = engine.allocator.match_prefix(ids)
    assert len(hit) == 1, (f"match_prefix of the cached 32-token prompt (2 full blocks of 16) must give 1 block, "
                           f"got {len(hit)}: at least one token is left to compute, for the last token's logits")
    whole = ids + first.outputs[0].token_ids   # 56 tokens: 3 full blocks, the third filled by generated tokens
    assert len(engine.allocator.match_prefix(whole)) == 3, (
        f"the first request's 56 tokens are cached as 3 full blocks of 16 (each key chains the hash of the one "
        f"before; the third block filled while decoding): match_prefix of them gives "
        f"{len(engine.allocator.match_prefix(whole))} blocks")
    second = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    hook.remove()
    assert first.outputs[0].token_ids == second.outputs[0].token_ids, (
        f"the same prompt again, from the prefix cache, gives other tokens: {second.outputs[0].token_ids} "
        f"instead of {first.outputs[0].token_ids}")
    assert second.outputs[0].token_ids == off.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    # the first block is a hit; the last block is recomputed to get the last token's logits
    assert second.num_cached_tokens == 16 and first.num_cached_tokens == 0, (
        f"cached tokens: {first.num_cached_tokens} for the first request (expected 0), "
        f"{second.num_cached_tokens} for the same prompt again (expected 16: its first block)")
    assert sum(computed) == n_first - 16
    stats = engine.get_stats()
    assert stats["prefix_cache_queries"] == 64 and stats["prefix_cache_hits"] == 16
    assert _all_blocks_free(engine), _held(engine)


def test_prefix_cache_shares_a_system_prompt(tiny_model_dir):
    system = list(range(3, 3 + 64))  # 4 blocks of 16
    prompts = [{"prompt_token_ids": system + [100 + i, 200 + i]} for i in range(4)]
    llm = LLM(str(tiny_model_dir), phase=3)
    ref = LLM(str(tiny_model_dir), phase=1).generate(prompts, GREEDY, use_tqdm=False)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    outs = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    got, want = [o.outputs[0].token_ids for o in outs], [o.outputs[0].token_ids for o in ref[1:]]
    assert got == want, token_difference(got, want, "requests sharing a cached 64-token system prompt, against phase 1")
    assert all(o.num_cached_tokens == 64 for o in outs), (
        f"each later request shares the cached 64-token system prompt (4 chained blocks of 16): cached tokens "
        f"{[o.num_cached_tokens for o in outs]}, expected 64 each")
    # the shared blocks are counted once: the tokens stored never exceed the slots reserved
    stats = llm.llm_engine.get_stats()
    assert stats["peak_kv_tokens_used"] <= stats["peak_kv_tokens_reserved"]
    # the peak, 10 blocks, comes when each request's own tokens (2 prompt, then generated) reach
    # 17 and take a second block of its own: 4 shared blocks of 16 plus 3 x 17 tokens
    assert stats["peak_kv_blocks_used"] == 4 + 3 * 2
    assert stats["peak_kv_tokens_used"] == 64 + 3 * 17


def test_abort_frees_blocks_at_once(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), phase=3).llm_engine
    engine.add_request("a", {"prompt_token_ids": list(range(3, 60))}, SamplingParams(max_tokens=50))
    engine.add_request("b", {"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    used = engine.allocator.num_used_blocks
    engine.abort_request("a")
    assert engine.allocator.num_used_blocks < used and "a" not in engine.groups
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["b"]
    assert len(outs[-1].outputs[0].token_ids) == 5
    assert _all_blocks_free(engine)


def test_request_that_can_never_fit_is_rejected(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), phase=3, num_kv_blocks=4, block_size=8, max_model_len=200)
    ok = {"prompt_token_ids": [7, 8, 9]}
    with pytest.raises(ValueError, match="max_tokens"):  # over the whole pool of 32 slots
        llm.generate(ok, SamplingParams(max_tokens=40), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(ok, SamplingParams(max_tokens=199), use_tqdm=False)
    assert len(llm.generate(ok, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids) == 8


# -- the scheduler's rules, with fake sequences ---------------------------------------------------

class _Group:
    def __init__(self):
        self.num_cached_tokens = 0
        self.metrics = type("M", (), {"first_scheduled_time": None})()


class _Seq:
    def __init__(self, n_prompt, name=""):
        self.name = name
        self.token_ids = list(range(1, n_prompt + 1))
        self.num_computed_tokens = 0
        self.block_table = None
        self.group = _Group()
        self.finish_reason = None

    @property
    def num_tokens(self):
        return len(self.token_ids)

    def decode_one(self):  # what the engine does after a step: the prompt is computed, a token appended
        self.token_ids.append(7)


def _sched(blocks=100, block_size=4, max_seqs=8, budget=32, chunked=True, prefix=False):
    alloc = (PrefixCachingBlockAllocator if prefix else BlockAllocator)(blocks, block_size)
    return Scheduler(alloc, max_seqs, budget, chunked, max_model_len=512)


def _step(s):
    out = s.schedule()
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.decode_one()
    return out


def test_token_budget_and_chunks():
    s = _sched(budget=32)
    a, b = _Seq(20, "a"), _Seq(20, "b")
    s.add(a), s.add(b)
    out = _step(s)
    assert [(x.name, n) for x, n in out.scheduled] == [("a", 20), ("b", 12)] and out.num_batched_tokens == 32, (
        f"a step's budget is 32 tokens: a's 20-token prompt, then a chunk of 12 of b's; scheduled "
        f"{[(x.name, n) for x, n in out.scheduled]}")
    out = _step(s)  # a decodes (1 token), b finishes its prompt (8)
    assert [(x.name, n) for x, n in out.scheduled] == [("a", 1), ("b", 8)], (
        f"the next step: a decodes 1 token, b computes the last 8 of its prompt; scheduled "
        f"{[(x.name, n) for x, n in out.scheduled]}")


def test_the_default_budget_follows_the_device_and_the_cpu_kind():
    """512 tokens a step on a CPU, 2048 on a GPU; on a CPU kind whose platform rule
    (`bf16_max_num_batched_tokens`) names a budget, that many where the prompts multiply in
    bfloat16 (dtype="auto"); an asked budget wins, and without chunking a whole sequence fits."""
    from types import SimpleNamespace

    from phases.p03_continuous_batching import recipe
    from tinyvllm import platform

    def budget(device="cpu", bf16_rows=0, asked=None, chunked=True):
        config = SimpleNamespace(max_num_batched_tokens=asked, enable_chunked_prefill=chunked)
        return recipe.max_num_batched_tokens(SimpleNamespace(config=config, device=torch.device(device),
                                                             bf16_rows=bf16_rows, max_model_len=4096))

    for kind in platform.KINDS:
        with platform.using(platform.rules_of(kind)):
            want = getattr(platform.RULES["bf16_max_num_batched_tokens"], kind) or 512
            assert (budget(), budget(bf16_rows=6), budget("cuda"), budget(bf16_rows=6, asked=64)) == (512, want, 2048, 64)
            assert budget(bf16_rows=6, chunked=False) == 4096
    assert platform.RULES["bf16_max_num_batched_tokens"].amx == 2048


def test_no_chunking_waits_for_room():
    s = _sched(budget=32, chunked=False)
    a, b = _Seq(20, "a"), _Seq(20, "b")
    s.add(a), s.add(b)
    got = [(x.name, n) for x, n in _step(s).scheduled]
    assert got == [("a", 20)], (f"without chunked prefill, b's 20-token prompt waits for a step with room for all "
                                f"of it (a took 20 of 32): scheduled {got}")
    got = [(x.name, n) for x, n in _step(s).scheduled]
    assert got == [("a", 1), ("b", 20)], f"the next step: a decodes, b's whole prompt fits; scheduled {got}"


def test_max_num_seqs():
    s = _sched(max_seqs=2, budget=100)
    seqs = [_Seq(3, name) for name in "abc"]
    for x in seqs:
        s.add(x)
    got = _names(x for x, _ in _step(s).scheduled)
    assert got == ["a", "b"], f"max_num_seqs=2: two sequences run at most, the first two to arrive; scheduled {got}"
    assert seqs[2].status == SequenceStatus.WAITING
    seqs[0].finish_reason = "stop"
    s.finish(seqs[0])
    got = _names(x for x, _ in _step(s).scheduled)
    assert got == ["b", "c"], f"a finished, so its seat goes to c at once: scheduled {got}"


def _names(seqs) -> list[str]:
    return [x.name for x in seqs]


def test_preemption_takes_the_newest_first():
    s = _sched(blocks=3, block_size=4, budget=100)
    a, b, c, d = _Seq(4, "a"), _Seq(3, "b"), _Seq(3, "c"), _Seq(3, "d")
    for x in (a, b, c, d):
        s.add(x)
    _step(s)  # a, b, c hold one block each (a's is full); d waits for a block
    assert _names(s.running) == ["a", "b", "c"] and _names(s.waiting) == ["d"], (
        f"3 blocks of 4 hold a, b and c, and d waits: running {_names(s.running)}, waiting {_names(s.waiting)}")
    out = _step(s)  # a needs a second block: c (newest) is preempted, not b
    assert out.preempted == [c], f"a needs a block: the newest running sequence, c, must be preempted, got {_names(out.preempted)}"
    assert c.status == SequenceStatus.PREEMPTED, f"a preempted sequence's status must be PREEMPTED, got {c.status.name}"
    assert c not in s.running, f"a preempted sequence must leave the running list: running {_names(s.running)}"
    assert _names(s.waiting) == ["c", "d"], (
        "a preempted sequence goes back to the front of the waiting queue, before d that never ran: "
        f"waiting is {_names(s.waiting)}")
    assert c.num_computed_tokens == 0, (
        f"a preempted sequence must restart from 0 computed tokens (its KV blocks are gone), got {c.num_computed_tokens}")
    assert len(c.token_ids) == 4  # its sampled token is kept
    assert s.allocator.num_free_blocks == 0 and len(a.block_table) == 2, (
        f"c's block must be free for a's second: a holds {len(a.block_table)} blocks")
    assert s.num_preemptions == 1, f"the scheduler counts each preemption (num_preemptions): got {s.num_preemptions}"
    assert [x for x, _ in out.scheduled] == [a, b]


# -- the batch-invariant mode --------------------------------------------------------------------

from phases.p03_continuous_batching.batch_invariant import KERNELS as BI_KERNELS  # noqa: E402
from phases.p03_continuous_batching.batch_invariant import BatchInvariantLinear  # noqa: E402

needs_bi = pytest.mark.skipif(not BI_KERNELS.available(),
                              reason="batch_invariant=True needs an x86 CPU with AVX2 and a C compiler")
WITH_LOGPROBS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)


def _tokens_and_logprobs(llm, prompts, params=WITH_LOGPROBS):
    """Each request's greedy tokens and the exact float log-probability of each."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@needs_bi
@pytest.mark.parametrize("rows", [slice(0, 1), slice(3, 4), slice(2, 9), slice(0, 33)])
def test_batch_invariant_linear_rows_do_not_depend_on_the_others(rows):
    torch.manual_seed(0)
    for out_features, in_features in ((80, 48), (7, 13), (33, 200)):
        layer = BatchInvariantLinear(in_features, out_features, bias=True)
        x = torch.randn(40, in_features)
        with torch.inference_mode():
            full = layer(x)
            assert torch.equal(layer(x[rows]), full[rows])      # the same bits, alone or in a batch
            torch.testing.assert_close(full, torch.nn.functional.linear(x, layer.weight, layer.bias))


BATCHINGS = {
    "preemption, small pool": dict(num_kv_blocks=12, block_size=8),
    "one request at a time": dict(max_num_seqs=1),
    "chunks of 7 tokens": dict(max_num_batched_tokens=7),
    "no prefix caching, chunks of 16": dict(enable_prefix_caching=False, max_num_batched_tokens=16),
}


@needs_bi
@pytest.mark.parametrize("setup", list(BATCHINGS))
def test_batch_invariant_mode_gives_the_same_bits_under_any_batching(setup, tiny_model_dir, prompts, make_llm):
    """With batch_invariant=True, every token and its log-probability come out bit for bit the
    same whatever the batch, the chunks, prefix caching or preemption (a preempted request is
    recomputed as one prefill of everything it had)."""
    roomy = _tokens_and_logprobs(make_llm(tiny_model_dir, 3, batch_invariant=True), prompts)
    llm = LLM(str(tiny_model_dir), phase=3, batch_invariant=True, **BATCHINGS[setup])
    assert _tokens_and_logprobs(llm, prompts) == roomy
    if setup.startswith("preemption"):
        assert llm.llm_engine.get_stats()["num_preemptions"] >= 5
    assert _all_blocks_free(llm.llm_engine)


@needs_bi
def test_batch_invariant_prefill_and_decode_agree_bit_for_bit(tiny_model_dir):
    """A decode step's log-probabilities equal those the same tokens get as a prefill
    (prompt_logprobs): the two paths of the engine compute the same bits. (In the default mode
    they differ in the last bits on a CPU; the next test says what that mode promises.)"""
    llm = LLM(str(tiny_model_dir), phase=3, batch_invariant=True)
    prompt = [5, 17, 99, 3, 42, 7, 8, 61, 2]
    out = llm.generate({"prompt_token_ids": prompt}, WITH_LOGPROBS, use_tqdm=False)[0].outputs[0]
    decoded = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
    again = llm.generate({"prompt_token_ids": prompt + out.token_ids},
                         SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    prefilled = [again.prompt_logprobs[len(prompt) + i][t].logprob for i, t in enumerate(out.token_ids)]
    assert decoded == prefilled


def test_batch_invariant_refuses_what_it_cannot_keep(tiny_model_dir):
    with pytest.raises(ValueError, match="batch_invariant=True runs on a CPU in float32"):
        LLM(str(tiny_model_dir), phase=3, batch_invariant=True, dtype="bfloat16")
    with pytest.raises(ValueError, match="batch_invariant=True attends over a float KV cache"):
        LLM(str(tiny_model_dir), phase=5, batch_invariant=True, kv_cache_dtype="int8")
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        LLM(str(tiny_model_dir), phase=3, batch_invariant="yes")


@needs_bi
@pytest.mark.slow
def test_batch_invariant_default_model_under_preemption(default_model_dir):
    """The default model: 6 prompts of 40-160 tokens, 24 greedy tokens each, with a pool small
    enough to preempt, against one request at a time: the same tokens and log-probabilities, to
    the bit, in the batch-invariant mode (in the default mode a CPU's float rounding may change
    a near-tie: the lesson)."""
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randint(40, 160))]}
               for _ in range(6)]
    alone = _tokens_and_logprobs(LLM(str(default_model_dir), phase=3, batch_invariant=True, max_num_seqs=1,
                                     kv_cache_memory=2**26), prompts)
    tight = LLM(str(default_model_dir), phase=3, batch_invariant=True, num_kv_blocks=24)
    assert _tokens_and_logprobs(tight, prompts) == alone
    assert tight.llm_engine.get_stats()["num_preemptions"] > 0


@pytest.mark.parametrize("fault", sorted(BAD_STEPS))
def test_checked_batch_invariant_attention_refuses_a_slip(fault, bad_step):
    """batch_invariant.c reads every token's keys through its row's block table: in checked mode
    a step that points outside the pool or into another sequence is refused before it runs."""
    from phases.p03_continuous_batching.batch_invariant import BatchInvariantAttention

    cache, meta, q, k, v, pattern = bad_step(fault)
    with pytest.raises(ValueError, match=rf"^BatchInvariantAttention: .*{pattern}"):
        BatchInvariantAttention(cache, meta)(0, q, k, v)
