"""Phase 11's checkpoint: layers grouped by their KV spec, a windowed group that gives back the
blocks its window left behind, one pool, a prefix hit every group serves; transformers' tokens.

Folders transformers wrote with a window of 8 tokens and blocks of 4: Gemma 3 (windowed, windowed,
global), Mistral (every layer windowed), Qwen2 (global, then windowed)."""

import random

import pytest
import torch

from phases.p02_paged_kv.block_allocator import cdiv
from phases.p11_hybrid_kv import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec, group_layers, hit_length
from tinyvllm import LLM, SamplingParams

pytestmark = pytest.mark.phase11
transformers = pytest.importorskip("transformers")

WINDOW, BLOCK = 8, 4
FAMILIES = {"gemma3": ("Gemma3ForCausalLM", {"num_layers": 3, "sliding_window_pattern": 3}),
            "mistral": ("MistralForCausalLM", {}),
            "qwen2": ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 1})}
# float32 products (not this CPU kind's bfloat16 for prompts), as transformers multiplies
ARGS = dict(phase=11, dtype="float32", block_size=BLOCK)
_HF: dict = {}


@pytest.fixture(scope="module", autouse=True)
def in_this_process():
    """The engine in this process, so the tests can look at its parts."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINYVLLM_ENABLE_MULTIPROCESSING", "0")
        yield


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tinyvllm.testing import make_tiny_family

    return {name: make_tiny_family(tmp_path_factory.mktemp(name), arch, sliding_window=WINDOW, seed=5, **fields)
            for name, (arch, fields) in FAMILIES.items()}


def prompts(n: int = 3) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 300) for _ in range(length)] for length in (5, 23, 40, 31)[:n]]


def hf_greedy(folder, max_tokens: int) -> list[list[int]]:
    key = (str(folder), max_tokens)
    if key not in _HF:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        with torch.no_grad():
            _HF[key] = [model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                                       min_new_tokens=max_tokens)[0, len(p):].tolist() for p in prompts()]
    return _HF[key]


def generate(llm, max_tokens: int = 12, n: int = 3) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(n)], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# -- the pieces ------------------------------------------------------------------------------------

def test_first_needed_block():
    spec = SlidingWindowSpec(BLOCK, WINDOW)
    # the query at p sees p - 7 .. p: at 10, keys 3..10 (block 0 still read); at 11, keys 4..11
    for num_computed, want in ((0, 0), (7, 0), (10, 0), (11, 1), (14, 1), (15, 2), (40, 8)):
        got = spec.first_needed_block(num_computed)
        assert got == want, (f"a query at position {num_computed} sees keys {max(0, num_computed - WINDOW + 1)}.."
                             f"{num_computed} (window {WINDOW}): its first block is {want}, got {got}")
    assert FullAttentionSpec(BLOCK).first_needed_block(40) == 0


def test_layers_group_by_spec_in_groups_of_one_size():
    full, window = FullAttentionSpec(BLOCK), SlidingWindowSpec(BLOCK, WINDOW)
    groups = group_layers([window] * 5 + [full] + [window] * 5 + [full])   # Gemma 3's pattern, 12 layers
    assert [g.layers for g in groups] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10), (5, 11)]
    assert group_layers([window] * 4) == [KVCacheGroup(window, (0, 1, 2, 3))]


def test_hit_length():
    full, window = KVCacheGroup(FullAttentionSpec(BLOCK), (0,)), KVCacheGroup(SlidingWindowSpec(BLOCK, WINDOW), (1,))
    # the windowed group lost its first blocks (evicted), the full group holds every one: a hit
    # of 6 blocks needs only the windowed group's blocks 4 and 5 (positions 17..23 for the query at 24)
    hits = [[True] * 6, [False] * 4 + [True] * 2]
    assert hit_length([full, window], hits, 6) == 6, "a window needs only its own blocks cached"
    # the full group misses block 3: no hit past 3 blocks, and at 3 the window needs blocks 1, 2
    hits = [[True] * 3 + [False] * 3, [False] * 4 + [True] * 2]
    assert hit_length([full, window], hits, 6) == 0, \
        "a hit length is one every group serves: the full group stops at 3, where the window's blocks 1-2 are missing"
    hits = [[True] * 3 + [False] * 3, [False] + [True] * 5]
    assert hit_length([full, window], hits, 6) == 3, "the full group's 3 blocks, and the window's blocks 1-2 at 3"
    # the window first: it serves 6, the full group only 3, where the window's blocks 1-2 are missing
    hits = [[False] * 4 + [True] * 2, [True] * 3 + [False] * 3]
    assert hit_length([window, full], hits, 6) == 0, \
        "a hit length is one every group serves: at the full group's 3 the window's blocks 1-2 are missing"
    assert hit_length([window], [[False, True, True, False, True, True]], 6) == 6
    assert hit_length([window], [[True, True, True, True, True, False]], 6) == 5


# -- the engine ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equals_transformers_past_the_window(family, folders):
    """Up to 52 tokens (6.5 windows); a pool and a token budget small enough to chunk the prompts
    and preempt, so blocks are freed, given back and allocated again across the window's edge."""
    blocks = {"gemma3": 40, "mistral": 14, "qwen2": 24}[family]   # Gemma 3 and Qwen2 preempt
    llm = LLM(str(folders[family]), **ARGS, num_kv_blocks=blocks, max_num_batched_tokens=16)
    got, want = generate(llm), hf_greedy(folders[family], 12)
    assert got == want, f"{family}: tokens {got} are not transformers' {want}"
    assert (llm.llm_engine.get_stats()["num_preemptions"] > 0) == (family != "mistral")
    manager = llm.llm_engine.parts.allocator
    assert manager.num_free_blocks == manager.num_blocks - 1, "every block but the null one is free after generate"


@pytest.mark.parametrize("draft", ["the target itself", "another model"])
def test_drafts_roll_back_in_every_group_past_the_window(draft, folders, tmp_path):
    """Speculative decoding on windowed Gemma 3 (3 drafts a step from a draft model): the target
    as its own draft has every draft accepted, another random model almost none, so tables grow
    by 4 tokens a step and roll back across the window's edge; a pool small enough to preempt;
    transformers' tokens, and every block back in the pool at the end."""
    from tinyvllm.testing import make_tiny_family

    target = folders["gemma3"]
    model = target if draft == "the target itself" else make_tiny_family(
        tmp_path, FAMILIES["gemma3"][0], sliding_window=WINDOW, seed=6, **FAMILIES["gemma3"][1])
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    llm = LLM(str(target), **ARGS, num_kv_blocks=40, max_num_batched_tokens=16, speculative_config=spec)
    got, want = generate(llm, 20), hf_greedy(target, 20)
    assert got == want, f"drafts from {draft}: tokens {got} are not transformers' {want}"
    stats, manager = llm.llm_engine.get_stats(), llm.llm_engine.parts.allocator
    drafts, accepted = stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]
    assert drafts > 30 and (accepted == drafts if model == target else accepted < drafts / 2), (drafts, accepted)
    assert stats["num_preemptions"] > 0
    assert manager.num_free_blocks == manager.num_blocks - 1, "every block but the null one is free after generate"


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_an_int8_kv_cache_shared_by_the_groups(family, folders):
    """kv_cache_dtype="int8": phase 5's 8-bit pool, one layer of it per position in a group, each
    group through phase 5's attention over its own tables: phase 5's tokens on the same cache
    (which holds every layer's whole context), with preemption, the pool's blocks 8-bit sized."""
    from phases.p11_hybrid_kv import HybridQuantizedKVCache

    args = dict(ARGS, kv_cache_dtype="int8", max_num_batched_tokens=16)
    llm = LLM(str(folders[family]), **args, num_kv_blocks={"gemma3": 40, "qwen2": 24}[family])
    got, cache = generate(llm, 20), llm.llm_engine.parts.kv_cache
    assert isinstance(cache, HybridQuantizedKVCache) and cache.kv.dtype == torch.int8
    assert cache.kv.shape[0] == 1   # a group's layers (here one), not the model's 3 or 2
    assert got == generate(LLM(str(folders[family]), **dict(args, phase=5), attention_backend="torch",
                               num_kv_blocks=64), 20)
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0
    manager = llm.llm_engine.parts.allocator
    assert manager.num_free_blocks == manager.num_blocks - 1


@pytest.mark.parametrize("kind", ["avx2", None])
def test_decode_steps_run_as_phase_7_s_over_each_group_s_tables(kind, folders):
    """A step of decodes only runs as phase 7 runs one: as the avx2 kind (where cpu_step.c serves a
    float32 model) in one call of cpu_step.c, each layer attending through its own group's slots
    and tables (Qwen2: a full group, then a windowed one; Mistral: one windowed group); as this
    machine acts, cpu_step.c or phase 7's `decode_forward`. Transformers' tokens at 7.5 windows,
    chunked and preempted; Gemma 3 and enforce_eager keep the model's own forward."""
    from contextlib import nullcontext

    from tinyvllm import platform

    if kind is not None and kind not in platform.acting_kinds():
        pytest.skip(f"this CPU cannot act as {kind}")
    with platform.using(platform.platform_as(kind)) if kind else nullcontext():
        for family, blocks in (("mistral", 16), ("qwen2", 24)):
            llm = LLM(str(folders[family]), **ARGS, num_kv_blocks=blocks, max_num_batched_tokens=16)
            assert generate(llm, 20) == hf_greedy(folders[family], 20), f"{family}: not transformers' tokens"
            step = llm.llm_engine.parts.runner.decode_step
            assert step is not None, f"{family}: decode steps run the model's own forward"
            if kind == "avx2":
                assert step.num_c_steps >= 15, f"{family}: cpu_step.c ran {step.num_c_steps} steps"
        for family, args in (("gemma3", {}), ("qwen2", {"enforce_eager": True})):
            llm = LLM(str(folders[family]), **ARGS, **args, num_kv_blocks=40)
            assert llm.llm_engine.parts.runner.decode_step is None


def test_batch_invariant_in_each_window(folders):
    """batch_invariant=True: phase 3's fixed-order attention per group, in each layer's window:
    transformers' tokens, and each prompt's log-probabilities the same alone as beside the others,
    chunked and preempted."""
    from phases.p03_continuous_batching.batch_invariant import KERNELS

    if not KERNELS.available():
        pytest.skip("batch_invariant.c needs an x86 CPU with AVX2 and a C compiler")
    llm = LLM(str(folders["gemma3"]), **ARGS, num_kv_blocks=40, max_num_batched_tokens=16, batch_invariant=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in together] == hf_greedy(folders["gemma3"], 12)
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0
    for p, both in zip(prompts(), together):
        alone = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0]
        assert alone.logprobs == both.outputs[0].logprobs, "a prompt alone scores otherwise than in a batch"


def test_a_long_request_holds_the_window_not_the_context(folders):
    """At every decode step a request holds its full group's blocks, and in each windowed group only
    the blocks its window reaches, one more at most: here 64 tokens hold 16 + 2 x 3 blocks, not 3 x 16."""
    llm = LLM(str(folders["gemma3"]), **ARGS, num_kv_blocks=64, enable_prefix_caching=False)
    engine = llm.llm_engine
    manager = engine.parts.allocator
    engine.add_request("long", {"prompt_token_ids": prompts()[2]}, SamplingParams(temperature=0, max_tokens=24,
                                                                                  ignore_eos=True))
    worst = 0
    while engine.has_unfinished_requests():
        seq = next(iter(engine.parts.scheduler.running), None)
        engine.step()
        if seq is not None and seq.num_computed_tokens > 40:   # decoding
            n = seq.num_computed_tokens
            held = manager.num_used_blocks - 1            # the one request's, and the null block
            limit = cdiv(n, BLOCK) + 2 * (cdiv(WINDOW, BLOCK) + 1)
            assert held <= limit, (f"at {n} tokens of its one request the pool has {held} blocks in use; its full "
                                   f"group needs {cdiv(n, BLOCK)} and each of its 2 windowed groups at most "
                                   f"{cdiv(WINDOW, BLOCK) + 1}")
            assert manager.num_blocks_held(seq.block_table) == held, "the request's tables hold what the pool lent"
            worst = max(worst, held)
    assert worst >= cdiv(64, BLOCK), "the full group's blocks are held"


def test_prefix_hits_past_the_window(folders):
    """The same prompts again: every group finds its blocks, the hit is one length they all serve,
    and the tokens are transformers'."""
    llm = LLM(str(folders["qwen2"]), **ARGS, num_kv_blocks=64)
    first = generate(llm)
    stats = llm.llm_engine.get_stats()
    again = generate(llm)
    hits = llm.llm_engine.get_stats()["prefix_cache_hits"] - stats.get("prefix_cache_hits", 0)
    assert first == again == hf_greedy(folders["qwen2"], 12), "the prompts again, with prefix hits, give other tokens"
    assert hits >= 40 + 20, f"the prompts again hit {hits} cached tokens; 5 + 23 + 40 tokens were cached"


def test_more_requests_fit_one_pool(folders):
    """A pool of 128 blocks: 6 requests of up to 52 tokens run at once, never preempted (decoding,
    each holds at most 13 + 2 x 3 blocks); holding every group's whole context they would need
    up to 3 x 13 blocks each, 6 x 39 = 234 for the longest."""
    llm = LLM(str(folders["gemma3"]), **ARGS, num_kv_blocks=128, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts(3) * 2):
        llm.llm_engine.add_request(str(i), {"prompt_token_ids": p}, params)
    most = 0
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
        most = max(most, len(llm.llm_engine.parts.scheduler.running))
    assert most == 6 and llm.llm_engine.get_stats()["num_preemptions"] == 0


@pytest.mark.parametrize("engine_args, name", [
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}}, "kv_transfer_config"),
])
def test_what_holds_one_table_per_sequence_refuses_a_windowed_model_by_name(engine_args, name, folders):
    """(A CPU that cannot build the batch-invariant kernel refuses batch_invariant=True before.)"""
    with pytest.raises(ValueError, match=rf"{name}=.*(phase 11 runs a model with a sliding window \(sliding_window=8"
                                         r"|needs an x86 CPU)"):
        LLM(str(folders["mistral"]), **ARGS, num_kv_blocks=64, **engine_args)


def test_ranks_on_other_hosts_refuse_a_windowed_model_by_name(folders, monkeypatch):
    monkeypatch.setenv("TINYVLLM_TP_TOKEN", "ab" * 32)
    with pytest.raises(ValueError, match=r"nnodes=2: phase 11 runs a model with a sliding window \(sliding_window=8"):
        LLM(str(folders["mistral"]), **ARGS, num_kv_blocks=64, tensor_parallel_size=2, nnodes=2,
            master_addr="127.0.0.1")


def test_a_model_without_a_window_runs_phase_9s_parts(tiny_model_dir):
    from phases.p11_hybrid_kv import HybridKVCacheManager

    llm = LLM(str(tiny_model_dir), phase=11, num_kv_blocks=32)
    assert not isinstance(llm.llm_engine.parts.allocator, HybridKVCacheManager)


def test_a_gemma3_shaped_request_of_4096_tokens():
    """The manager alone, Gemma 3's shape (five layers of window 512 to one global, blocks of 16):
    a 4,096-token request, prefilled in chunks of 512 then decoded, holds at most the global
    layers' blocks of its context and 512 / 16 + 1 for each windowed group, plus the null block:
    3.6 times fewer than the 6 x 256 of a manager that keeps every layer's context."""
    from phases.p03_continuous_batching import PrefixBlockTable
    from phases.p11_hybrid_kv import HybridKVCacheManager

    specs = ([SlidingWindowSpec(16, 512)] * 5 + [FullAttentionSpec(16)]) * 2    # 12 layers: groups of 2
    manager = HybridKVCacheManager(4096, 16, group_layers(specs), max_chunk=512, enable_caching=False)
    table = PrefixBlockTable()
    for _ in range(8):                                       # the prompt, 8 chunks of 512
        manager.allocate(table, 512)
    for _ in range(64):                                      # 64 decode steps
        manager.allocate(table, 1)
        limit = cdiv(table.num_tokens, 16) + 5 * (512 // 16 + 1) + 1      # and the null block
        used = manager.num_used_blocks
        assert used <= limit, f"a request of {table.num_tokens} tokens holds {used} blocks of the pool, more than {limit}"
    assert 6 * 256 / used > 3.5
    manager.free(table)
    assert manager.num_free_blocks == manager.num_blocks - 1
