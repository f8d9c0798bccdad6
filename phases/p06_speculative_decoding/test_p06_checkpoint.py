"""Phase 6 checkpoint through the engine: speculation changes how many passes run, never which
tokens come out. Greedy: the same tokens as phase 5 with every proposer, batch mix, chunk size,
preemption; stops, max_tokens and min_tokens cut inside accepted runs exactly; sampling: the same
distribution; bad configs: clear errors. After every run every block is free again."""

import random

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.testing import make_tiny_llama, token_difference

from .ngram_proposer import NgramProposer
from .test_p06_rejection_sampler import chi2_critical

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def loopy_dir(tmp_path_factory):
    """A tiny random model with small weights: its greedy output soon repeats itself, as a real
    model's answer repeats its prompt, so n-gram drafts are often (not always) accepted."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-loopy"), std=0.1, seed=2)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """Another tiny random model with the same tokenizer: a draft that is often wrong."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), hidden_size=32, num_layers=1, seed=5)


def _prompts(n, seed):
    """Half of them repeat themselves (n-gram proposals from the start), half are random."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            piece = [rng.randrange(3, 300) for _ in range(rng.randint(2, 6))]
            out.append({"prompt_token_ids": piece * rng.randint(2, 5)})
        else:
            out.append({"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))]})
    return out


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def near_draft_dir(loopy_dir, tmp_path_factory):
    """The loopy model with noise on every weight: a draft that agrees with it often, not always."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("tiny-near-draft")
    for f in loopy_dir.iterdir():
        shutil.copy(f, folder / f.name)
    g = torch.Generator().manual_seed(0)
    weights = load_file(str(loopy_dir / "model.safetensors"))
    save_file({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in weights.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _all_blocks_free(engine):
    a = engine.allocator
    ok = a.num_free_blocks == a.num_blocks and not any(a.ref_counts)
    proposer = getattr(engine, "proposer", None)
    if hasattr(proposer, "engine"):  # the draft model's own cache
        d = proposer.engine.allocator
        ok = ok and d.num_free_blocks == d.num_blocks and not proposer.states
    return ok


_LLMS: dict = {}


def llm(model, phase, **kwargs) -> LLM:
    key = (str(model), phase, repr(sorted(kwargs.items())))
    if key not in _LLMS:
        _LLMS[key] = LLM(str(model), phase=phase, **kwargs)
    return _LLMS[key]


# -- greedy: exactly phase 5's tokens ----------------------------------------------------------
SETUPS = {
    "default": {},
    "chunked prefill, small budget": dict(max_num_batched_tokens=8),
    "preemption, small pool": dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=16),
    "no prefix caching": dict(enable_prefix_caching=False),
}


def test_ngram_proposer_proposes_what_followed_the_earliest_longest_match():
    """Greedy output is the same whatever the proposer guesses, so the proposer's own rule is
    checked here: the longest n-gram first, its earliest occurrence, up to k tokens after it."""
    def proposes(min_n, max_n, tokens, k, want, rule):
        got = NgramProposer(min_n, max_n).propose(tokens, k)
        assert got == want, f"{rule}: NgramProposer({min_n}, {max_n}).propose({tokens}, k={k}) must be {want}, got {got}"

    seq = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]  # the last 3 tokens occur at 0 and at 6
    proposes(1, 3, seq, 2, [4, 5], "the earliest match (of [1, 2, 3] at 0 and at 6) proposes what followed it")
    proposes(1, 3, seq, 10, [4, 5, 9, 1, 2, 3, 7, 8, 1, 2], "up to k tokens")
    proposes(1, 3, [5, 2, 3, 6, 1, 2, 3], 2, [6, 1], "the longest n that matches ([2, 3], not [3])")
    proposes(1, 3, [3, 8, 2, 3, 9, 2, 3], 2, [9, 2],
             "the longest n that matches first ([2, 3] at 2), before a shorter one ([3] at 0)")
    proposes(1, 3, [7, 1, 8, 1], 2, [8, 1], "a 1-gram when no longer one matches")
    proposes(2, 3, [7, 1, 8, 1], 2, [], "no n-gram shorter than prompt_lookup_min")
    proposes(1, 3, [1, 2, 3, 4], 3, [], "no match, no proposal")
    proposes(1, 3, seq, 0, [], "k = 0: nothing")
    proposes(1, 3, [4], 3, [], "a single token has nothing before it to match")


def test_truncate_table_gives_back_the_blocks_past_the_tokens():
    """A table of 10 tokens in blocks of 4 (3 blocks) rolled back to 5 keeps 2 blocks and frees
    the last; to 8 it stays at 5 tokens (it only shrinks); to 4, 1 block."""
    from phases.p02_paged_kv import BlockAllocator, BlockTable

    from .rollback import truncate_table

    alloc, table = BlockAllocator(8, 4), BlockTable()
    alloc.allocate(table, 10)
    first, last = table.block_ids[:2], table.block_ids[2]
    truncate_table(alloc, table, 5)
    assert table.block_ids == first and table.num_tokens == 5, (
        f"10 tokens rolled back to 5 (blocks of 4): the first 2 blocks {first} stay and num_tokens is 5; "
        f"the table holds {table.block_ids}, num_tokens {table.num_tokens}")
    assert alloc.num_free_blocks == 6 and last in alloc.free_block_ids, (
        f"block {last}, left with no token, goes back to the pool: {alloc.num_free_blocks} of 8 blocks are free, not 6")
    truncate_table(alloc, table, 8)
    assert table.block_ids == first and table.num_tokens == 5, (
        f"rolled 'back' to 8 tokens, a table of 5 stays as it is (it only shrinks): blocks {table.block_ids}, "
        f"num_tokens {table.num_tokens}")
    truncate_table(alloc, table, 4)
    assert table.block_ids == first[:1] and table.num_tokens == 4 and alloc.num_free_blocks == 7, (
        f"to 4 tokens: one full block kept, the second freed; the table holds {table.block_ids}, num_tokens "
        f"{table.num_tokens}, {alloc.num_free_blocks} blocks free")


@pytest.mark.parametrize("setup", list(SETUPS))
def test_ngram_greedy_same_tokens_as_phase5(loopy_dir, setup):
    args = SETUPS[setup]
    prompts = _prompts(8, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (32, 5, 20, 32, 1, 12, 32, 9)]
    ref = _tokens(llm(loopy_dir, 5, **args), prompts, params)
    spec = llm(loopy_dir, 6, speculative_config=NGRAM, **args)
    spec.llm_engine.reset_stats()
    outs = spec.generate(prompts, params)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == ref, token_difference(got, ref, f"{setup}: phase 6 with n-gram drafts against phase 5")
    stats = spec.llm_engine.get_stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats
    # per request, in RequestOutput.metrics, adding up to the engine's counts
    assert sum(o.metrics.spec_num_draft_tokens for o in outs) == stats["spec_num_draft_tokens"]
    assert sum(o.metrics.spec_num_accepted_tokens for o in outs) == stats["spec_num_accepted_tokens"]
    if setup.startswith("preemption"):
        assert stats["num_preemptions"] > 0
    a = spec.llm_engine.allocator
    assert _all_blocks_free(spec.llm_engine), (
        f"{setup}: {a.num_blocks - a.num_free_blocks} of {a.num_blocks} KV blocks are still held after every request "
        f"finished")


@pytest.mark.parametrize("draft", ["another model", "the target itself"])
def test_draft_model_greedy_same_tokens_as_phase5(tiny_model_dir, draft_dir, draft):
    path = draft_dir if draft == "another model" else tiny_model_dir
    prompts = _prompts(6, seed=2)
    ref = _tokens(llm(tiny_model_dir, 5), prompts, GREEDY)
    spec = llm(tiny_model_dir, 6, speculative_config={"method": "draft_model", "model": str(path),
                                                       "num_speculative_tokens": 3})
    spec.llm_engine.reset_stats()
    assert _tokens(spec, prompts, GREEDY) == ref
    stats = spec.llm_engine.get_stats()
    assert stats["spec_num_drafts"] > 0
    if draft == "the target itself":  # it always agrees: every draft accepted, 4 tokens a pass
        assert stats["spec_acceptance_rate"] == 1.0
        assert stats["spec_mean_accepted_length"] > 3.5
    assert _all_blocks_free(spec.llm_engine)


def test_draft_model_under_preemption(tiny_model_dir, draft_dir):
    args = dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=16)
    prompts = _prompts(4, seed=4)
    ref = _tokens(llm(tiny_model_dir, 5, **args), prompts, GREEDY)
    spec = llm(tiny_model_dir, 6, speculative_config={"method": "draft_model", "model": str(draft_dir),
                                                       "num_speculative_tokens": 3}, **args)
    spec.llm_engine.reset_stats()
    assert _tokens(spec, prompts, GREEDY) == ref
    assert spec.llm_engine.get_stats()["num_preemptions"] > 0
    assert _all_blocks_free(spec.llm_engine)


def test_disable_by_batch_size(loopy_dir):
    prompts = _prompts(4, seed=3)
    ref = _tokens(llm(loopy_dir, 5), prompts, GREEDY)
    for limit, speculates in ((3, False), (4, True)):
        spec = llm(loopy_dir, 6, speculative_config=dict(NGRAM, disable_by_batch_size=limit))
        spec.llm_engine.reset_stats()
        assert _tokens(spec, prompts, GREEDY) == ref
        assert (spec.llm_engine.get_stats()["spec_num_drafts"] > 0) == speculates


# -- stopping inside an accepted run -----------------------------------------------------------
@pytest.fixture(scope="module")
def always_accepting(tiny_model_dir):
    """The target as its own draft: every draft is accepted, so each pass emits k + 1 = 4 tokens
    and every stop below falls inside an accepted run."""
    return llm(tiny_model_dir, 6, speculative_config={"method": "draft_model", "model": str(tiny_model_dir),
                                                       "num_speculative_tokens": 3})


PROMPT = {"prompt_token_ids": [17, 99, 230, 5, 61, 17, 99]}


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return _tokens(llm(tiny_model_dir, 5), [PROMPT], SamplingParams(temperature=0, max_tokens=24,
                                                                     ignore_eos=True))[0]


def _stop_cases(ref, tokenizer):
    first = {t: i for i, t in reversed(list(enumerate(ref)))}  # where each token first comes
    at6 = next(t for t in ref if first[t] >= 6)
    early = next(t for t in ref if 1 <= first[t] < 5)
    text = tokenizer.decode(ref, skip_special_tokens=True)
    return {
        "max_tokens mid-run": dict(max_tokens=7),
        "stop_token_ids": dict(max_tokens=24, stop_token_ids=[at6]),
        "stop_token_ids before min_tokens": dict(max_tokens=24, stop_token_ids=[early], min_tokens=first[early] + 3),
        "stop string": dict(max_tokens=24, stop=[text[len(text) // 2: len(text) // 2 + 2]]),
        "stop string kept": dict(max_tokens=24, stop=[text[len(text) // 3: len(text) // 3 + 2]],
                                 include_stop_str_in_output=True),
        "logprobs": dict(max_tokens=10, logprobs=2),
    }


@pytest.mark.parametrize("case", ["max_tokens mid-run", "stop_token_ids", "stop_token_ids before min_tokens",
                                  "stop string", "stop string kept", "logprobs"])
def test_stops_inside_accepted_runs_are_exact(tiny_model_dir, always_accepting, reference, case):
    args = _stop_cases(reference, always_accepting.llm_engine.tokenizer)[case]
    params = SamplingParams(temperature=0, ignore_eos=True, **args)
    want = llm(tiny_model_dir, 5).generate([PROMPT], params)[0].outputs[0]
    always_accepting.llm_engine.reset_stats()
    got = always_accepting.generate([PROMPT], params)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
           (want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert always_accepting.llm_engine.get_stats()["spec_num_accepted_tokens"] > 0
    if case == "logprobs":  # one entry per emitted token, the target's values
        assert len(got.logprobs) == len(got.token_ids)
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)
    assert _all_blocks_free(always_accepting.llm_engine)


def test_eos_inside_an_accepted_run(tiny_model_dir, always_accepting, reference):
    """EOS: make a token of the reference output the end-of-sequence token of both engines."""
    eos = reference[6]
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = []
    for engine_llm in (llm(tiny_model_dir, 5), always_accepting):
        engine = engine_llm.llm_engine
        saved, engine.eos_token_ids = engine.eos_token_ids, frozenset({eos})
        try:
            outs.append(engine_llm.generate([PROMPT], params)[0].outputs[0])
        finally:
            engine.eos_token_ids = saved
    assert outs[1].finish_reason == "stop" and outs[1].token_ids[-1] == eos
    assert (outs[1].token_ids, outs[1].text) == (outs[0].token_ids, outs[0].text)
    assert _all_blocks_free(always_accepting.llm_engine)


@pytest.mark.parametrize("config", ["ngram", "draft"])
def test_abort_mid_speculation_frees_every_block(loopy_dir, config):
    spec = NGRAM if config == "ngram" else {"method": "draft_model", "model": str(loopy_dir),
                                             "num_speculative_tokens": 3}
    engine = llm(loopy_dir, 6, speculative_config=spec).llm_engine
    engine.reset_stats()
    for i, p in enumerate(_prompts(3, seed=6)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while engine.get_stats()["spec_num_drafts"] < 3:
        engine.step()
    assert engine.has_unfinished_requests()
    engine.abort_request(["r0", "r1", "r2"])
    assert not engine.has_unfinished_requests()
    a = engine.allocator
    assert _all_blocks_free(engine), (
        f"every request aborted mid-speculation: {a.num_blocks - a.num_free_blocks} of {a.num_blocks} KV blocks are "
        f"still held (the rejected drafts' blocks go back to the pool when their table is rolled back)")


# -- sampling: the same distribution -----------------------------------------------------------
def _homogeneous(a: list, b: list) -> tuple[bool, float]:
    """Chi-square test that two samples come from one distribution (at the 0.1% level).
    Outcomes seen fewer than 10 times in both samples together are pooled into one."""
    total = {c: a.count(c) + b.count(c) for c in set(a) | set(b)}
    rare = {c for c, t in total.items() if t < 10}
    a = ["rare" if c in rare else c for c in a]
    b = ["rare" if c in rare else c for c in b]
    cats = set(a) | set(b)
    stat = 0.0
    for c in cats:
        na, nb = a.count(c), b.count(c)
        ea, eb = (na + nb) * len(a) / (len(a) + len(b)), (na + nb) * len(b) / (len(a) + len(b))
        stat += (na - ea) ** 2 / ea + (nb - eb) ** 2 / eb
    return stat < chi2_critical(max(1, len(cats) - 1)), stat


@pytest.mark.parametrize("config", ["ngram", "draft"])
def test_sampling_distribution_is_the_target_s(loopy_dir, near_draft_dir, config):
    """The first tokens of one prompt over 200 seeds, with and without speculation."""
    spec = dict(NGRAM, num_speculative_tokens=3) if config == "ngram" else {
        "method": "draft_model", "model": str(near_draft_dir), "num_speculative_tokens": 3}
    # a prompt that ends in the loop the model falls into: drafts often right, often wrong
    start = [40, 41, 42, 43, 44]
    loop = _tokens(llm(loopy_dir, 5), [{"prompt_token_ids": start}], GREEDY)[0]
    prompt = {"prompt_token_ids": start + loop}
    n = 200
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=s)
              for s in range(n)]
    plain = _tokens(llm(loopy_dir, 5), [prompt] * n, params)
    engine_llm = llm(loopy_dir, 6, speculative_config=spec)
    engine_llm.llm_engine.reset_stats()
    fast = _tokens(engine_llm, [prompt] * n, params)
    stats = engine_llm.llm_engine.get_stats()
    assert 20 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats
    for j in range(1, 3):  # token 0 comes from the prefill, no drafts; 1, 2 are verified ones
        ok, stat = _homogeneous([tuple(t[: j + 1]) for t in plain], [tuple(t[: j + 1]) for t in fast])
        assert ok, f"tokens 0..{j}: chi2 {stat:.1f}"
    # seeds reproduce: the same requests again give the same tokens
    assert _tokens(engine_llm, [prompt] * 20, params[:20]) == fast[:20]


# -- bad input ---------------------------------------------------------------------------------
BAD = {
    "k < 1": ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
    "k not int": ({"method": "ngram", "num_speculative_tokens": 2.5}, TypeError, "num_speculative_tokens"),
    "k missing": ({"method": "ngram"}, ValueError, "num_speculative_tokens"),
    "unknown method": ({"method": "medusa", "num_speculative_tokens": 2}, ValueError, "method"),
    "min > max": ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                   "prompt_lookup_max": 2}, ValueError, "prompt_lookup_min"),
    "min < 1": ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, ValueError,
                "prompt_lookup_min"),
    "unknown key": ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel": 1},
                    ValueError, "draft_tensor_parallel"),
    "bad disable_by_batch_size": ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
                                  ValueError, "disable_by_batch_size"),
    "missing draft path": ({"method": "draft_model", "model": "/nonexistent/draft", "num_speculative_tokens": 2},
                           ValueError, "model"),
    "no draft path": ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, "model"),
    "not a dict": ("ngram", TypeError, "speculative_config"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_speculative_config(tiny_model_dir, case):
    config, error, name = BAD[case]
    before = llm(tiny_model_dir, 6, speculative_config=NGRAM)
    with pytest.raises(error, match=name):
        LLM(str(tiny_model_dir), phase=6, speculative_config=config)
    assert len(_tokens(before, [PROMPT], SamplingParams(temperature=0, max_tokens=3))[0]) == 3


def test_draft_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    other = make_tiny_llama(tmp_path / "other-vocab", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(tiny_model_dir), phase=6, speculative_config={"method": "draft_model", "model": str(other),
                                                               "num_speculative_tokens": 2})


def test_phase5_refuses_speculation(tiny_model_dir):
    with pytest.raises(ValueError, match="speculative_config.*phase 6"):
        LLM(str(tiny_model_dir), phase=5, speculative_config=NGRAM)


# -- the default model -------------------------------------------------------------------------
@pytest.mark.slow
def test_default_model_ngram_greedy_same_tokens(default_model_dir):
    """A prompt that asks to repeat a list: the answer copies it, n-gram drafts are accepted."""
    text = ("Repeat this list exactly: apples, pears, plums, cherries, lemons, limes, grapes. "
            "The list again: apples, pears, plums,")
    params = SamplingParams(temperature=0, max_tokens=20)
    ref = LLM(str(default_model_dir), phase=5).generate([text], params)[0].outputs[0].token_ids
    spec = LLM(str(default_model_dir), phase=6, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    assert spec.generate([text], params)[0].outputs[0].token_ids == ref
    stats = spec.llm_engine.get_stats()
    assert stats["spec_num_accepted_tokens"] > 0, stats


def test_draft_quantization_is_phase5s(tiny_model_dir):
    """A draft's own `quantization` is phase 5's feature: refused, naming it, while phase 5 lacks
    it; once phase 5 has it, a quantized copy of the target drafts and greedy output is unchanged."""
    from phases.p05_quantization import RECIPE as PHASE5

    config = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 2,
              "quantization": "int8"}
    if "quantization" not in PHASE5.engine_args:
        with pytest.raises(ValueError, match="quantization"):
            LLM(str(tiny_model_dir), phase=6, speculative_config=config)
        return
    ref = _tokens(llm(tiny_model_dir, 5), [PROMPT], GREEDY)
    assert _tokens(LLM(str(tiny_model_dir), phase=6, speculative_config=config), [PROMPT], GREEDY) == ref


def test_reuse_workload_prompts_are_seeded_and_reused(tiny_model_dir):
    """The bench's `reuse` dataset: the same seed gives the same prompts; the kinds take turns
    (a function to edit, records to reformat, lines to extract), each with eight items to copy,
    and the function is valid Python."""
    from tinyvllm.entrypoints.bench.workloads import make_workload
    from tinyvllm.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir)
    a = make_workload("latency", tok, 320, dataset="reuse", num_prompts=6, seed=3)
    b = make_workload("latency", tok, 320, dataset="reuse", num_prompts=6, seed=3)
    c = make_workload("latency", tok, 320, dataset="reuse", num_prompts=6, seed=4)
    assert a.requests == b.requests and a.requests != c.requests
    texts = [tok.decode(list(r.prompt_token_ids[1:])) for r in a.requests]
    for i, text in enumerate(texts):
        marker = ("_score * ", "name=", "@example.org")[i % 3]
        assert text.count(marker) == 8, (i, text)
        if i % 3 == 0:
            code = text[text.index("def summarize"):]
            code = code[: code.index("return ")] + code[code.index("return "):].split("\n")[0]
            compile(code, "summarize", "exec")  # the loop's body is inside the loop
    with pytest.raises(ValueError, match="input-len"):
        make_workload("latency", tok, 320, dataset="reuse", input_len=8)
