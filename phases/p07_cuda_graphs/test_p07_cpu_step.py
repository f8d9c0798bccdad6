"""Phase 7 checkpoint, cpu_step.c: a decode step's layers in one C call, on an AVX2 CPU.

- at every row count it serves, its logits are `decode_forward`'s within float32 rounding (its
  SiLU takes libm's expf), the first layer's K/V written bit for bit (the same products, RoPE's
  same roundings, the same cache write; but Qwen3's, normed per head in C), later layers' within
  rounding; on float32 weights (cpu_gemv.c), a checkpoint on codes, int8 and int4 weights, q/k/v
  biases (Qwen2), per-head norms of q and k (Qwen3), sliding windows (Mistral's: each row from
  its window's first key); and `decode_forward` does not run;
- greedy tokens equal phase 6's (enforce_eager=True) at batch 1 and across buckets;
- it serves only where every product and the attention have C kernels: bfloat16 and an int8 KV
  cache take `decode_forward`, as do more rows than the products' kernels take; and only on the
  CPU kinds where it was measured (the platform's `c_step` rule);
- with the compiled step on, the rows it serves never make a compile due, and run it even when
  the graphs are ready.
"""

from __future__ import annotations

import pytest
import torch

from phases.p07_cuda_graphs import compiled
from phases.p07_cuda_graphs.cpu_step import STEP, CStep
from phases.p07_cuda_graphs.fused import layer_row
from tinyvllm import LLM, SamplingParams, platform

pytestmark = pytest.mark.kinds   # paths the platform chooses by CPU kind (make test-kinds)

PROMPTS = ["hello world", "a b c d e f g", "the cat sat", "x", "one two three four five six seven"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def serving(llm, rows: int = 1) -> CStep:
    """The engine's cpu_step.c, skipping where it serves no step of `rows` here."""
    c_step, rules = llm.llm_engine.runner.decode_runner.c_step, platform.current()
    if c_step is None or not c_step.serves(rows):
        assert not (rules.kind == "avx2" and rules.rule("c_step") and STEP.available()), \
            "on an AVX2 CPU every product of these models has a C kernel"
        pytest.skip(f"cpu_step.c serves {rows} rows of this model where each product has a C kernel for them "
                    f"(the rules c_step, gemv_max_rows, codes_max_rows; this kind: {rules.kind!r})")
    return c_step


CASES = [("tiny_model_dir", {}), ("tiny_codes_dir", {}), ("tiny_model_dir", {"quantization": "int8"}),
         ("tiny_model_dir", {"quantization": "int4"}), ("tiny_qwen2_dir", {}), ("tiny_qwen3_dir", {}),
         ("tiny_windowed_dir", {})]   # each layer in a window of 8 tokens


@pytest.mark.parametrize("fixture, kw", CASES)
def test_cpu_step_equals_decode_forward(request, make_llm, fixture, kw, monkeypatch):
    llm = make_llm(request.getfixturevalue(fixture), 7, max_num_seqs=8, num_kv_blocks=64, **kw)
    engine, c_step = llm.llm_engine, serving(llm, 1)
    runner = engine.runner.decode_runner
    python_forward, calls = runner.model_forward, []
    monkeypatch.setattr(runner, "model_forward", lambda *a: calls.append(1) or python_forward(*a))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"c{i}", prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    engine.step()                                   # the prefills
    engine.step()                                   # a decode step: the buffers hold 5 real rows
    kv = engine.kv_cache.kv                         # (layers, 2, blocks, block_size, KVH, d)
    for bucket in [b for b in (1, 2, 4, 8) if c_step.serves(b)]:   # (1 only: cpu_gemv.c's one row)
        before = kv.clone()
        runner.c_step = None
        want = runner.run(bucket)                   # decode_forward: writes this step's K/V ...
        kv_want = kv.clone()
        kv.copy_(before)                            # ... undone: cpu_step.c writes them again
        runner.c_step, calls[:] = c_step, []
        got = runner.run(bucket)
        assert calls == [], "cpu_step.c served the step: decode_forward must not run"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        if fixture != "tiny_qwen3_dir":             # (whose k norm sums its squares in its own order)
            assert torch.equal(kv[0], kv_want[0])   # the first layer's K/V: the same arithmetic
        torch.testing.assert_close(kv, kv_want, rtol=1e-4, atol=1e-5)
    engine.abort_request([f"c{i}" for i in range(len(PROMPTS))])


@pytest.mark.parametrize("fixture, kw", CASES[1:])
def test_cpu_step_gives_eager_tokens(request, make_llm, fixture, kw):
    model = request.getfixturevalue(fixture)
    llm = make_llm(model, 7, max_num_seqs=8, **kw)
    serving(llm)
    eager = make_llm(model, 7, max_num_seqs=8, enforce_eager=True, **kw)
    assert tokens(llm, PROMPTS[:1]) == tokens(eager, PROMPTS[:1])              # batch 1
    assert tokens(llm, PROMPTS) == tokens(eager, PROMPTS)                      # buckets 8, 4, 2, 1


def test_cpu_step_serves_only_c_kernels(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir, 7, max_num_seqs=16)
    c_step = serving(llm)
    eager = make_llm(tiny_model_dir, 7, max_num_seqs=16, enforce_eager=True)
    prompts = PROMPTS * 2                                                   # 10 rows: bucket 16
    assert not c_step.serves(16) and tokens(llm, prompts) == tokens(eager, prompts)
    # bfloat16: the products are not C ones, and cpu_step.c computes in float32
    assert not make_llm(tiny_model_dir, 7, max_num_seqs=8, dtype="bfloat16").llm_engine.runner.decode_runner.c_step
    # an int8 KV cache is phase 5's attention, not phase 4's C kernel: its first step finds out
    int8_kv = make_llm(tiny_model_dir, 7, max_num_seqs=8, kv_cache_dtype="int8")
    want = tokens(make_llm(tiny_model_dir, 7, max_num_seqs=8, kv_cache_dtype="int8", enforce_eager=True), PROMPTS[:1])
    assert tokens(int8_kv, PROMPTS[:1]) == want    # one row: cpu_step.c's to serve on every kind
    assert not int8_kv.llm_engine.runner.decode_runner.c_step.serves(1)


def test_cpu_step_serves_only_where_it_was_measured(tiny_model_dir, platform_rules):
    """A CPU kind whose `c_step` rule is off (here: as if this one's were) keeps the step it had:
    decode_forward, or the compiled graph; with it on, int4 weights' steps are cpu_step.c's
    wherever it builds."""
    platform_rules(c_step=False)
    llm = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8, quantization="int4", compilation_mode=0)
    assert not llm.llm_engine.runner.decode_runner.c_step
    platform_rules(c_step=True)
    on = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8, quantization="int4", compilation_mode=0)
    c_step = on.llm_engine.runner.decode_runner.c_step
    assert bool(c_step and c_step.serves(1)) == (STEP.supported() and CStep(on.llm_engine.model, layer_row).serves(1))


def test_rows_cpu_step_serves_never_make_a_compile_due(tiny_codes_dir, monkeypatch, tmp_path):
    """With the compiled step on, a step cpu_step.c serves is not an eager step of the compile
    rule (the graphs would not serve it: compiling for it only costs), and it runs cpu_step.c
    even once the graphs are ready (faster at its rows: lab note 7). (A model on codes: cpu_step.c
    serves its 5 rows on every kind whose `c_step` rule is on.)"""
    tiny_model_dir = tiny_codes_dir
    monkeypatch.delenv("TINYVLLM_COMPILATION_MODE", raising=False)
    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(compiled, "COMPILE_AFTER_STEPS", 1)
    llm = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8)
    runner = llm.llm_engine.runner.decode_runner
    serving(llm, len(PROMPTS))
    want = tokens(LLM(str(tiny_model_dir), phase=7, max_num_seqs=8, enforce_eager=True), PROMPTS)
    assert tokens(llm, PROMPTS) == want
    assert runner.eager_steps == 0 and not runner.due.is_set() and runner.worker is None
    started = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8, compilation_mode=1)
    graphs = started.llm_engine.runner.decode_runner.graphs
    for shape in list(graphs):
        graphs[shape] = lambda *a: pytest.fail("a step cpu_step.c serves ran a compiled graph")
    assert tokens(started, PROMPTS) == want
