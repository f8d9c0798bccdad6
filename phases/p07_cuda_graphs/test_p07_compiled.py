"""Phase 7 checkpoint, the compiled CPU step (`compilation_mode=1`): torch.compile of the decode
forward gives the eager step's numbers.

- greedy tokens equal phase 6's (enforce_eager=True) at batch 1 and across buckets, in float32,
  int8 and int4 (phase 5's C products run inside the graph as operators);
- the logits of one compiled step equal the eager step's within float rounding;
- with cpu_ops.cpp built, a compiled step runs phase 5's products and phase 4's decode attention
  from the operators' C++ kernels, never entering their Python ones, with the layers' own numbers;
- two graphs, compiled when the engine starts, serve every bucket (batch 1, and one with a
  dynamic batch), in every engine of a process;
- a request's bad value or a bad compilation_mode is an error naming it, and the engine goes on;
- by default (compilation_mode unset) the engine serves eagerly at once, and after
  COMPILE_AFTER_STEPS decode steps compiles (a worker) and reads the graphs in the background,
  then runs the compiled step, with the same tokens; a failed compile leaves it eager.

Each engine compiles when it starts (seconds on the tiny model; inductor's cache makes a second
start faster).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from phases.p04_triton_kernels.cpu_attention import CpuPagedAttention
from phases.p05_quantization import QuantizedLinear
from phases.p07_cuda_graphs import compiled
from phases.p07_cuda_graphs.compiled import CompiledDecodeRunner
from phases.p07_cuda_graphs.decode_runner import DecodeRunner
from phases.p07_cuda_graphs.cpu_step import CStep
from tinyvllm import LLM, SamplingParams, platform
from tinyvllm.testing import token_difference

PROMPTS = ["hello world", "a b c d e f g", "the cat sat", "x", "one two three four five six seven"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)   # three windows of 8 tokens
NEW_GRAPH = ("a step made a graph of its own: the two graphs of the start must serve every bucket "
             "(batch 1, and every larger bucket through one graph whose batch dimension is marked dynamic)")


@pytest.fixture(autouse=True)
def graphs_not_cpu_step(monkeypatch):
    """The compiled graphs are what this file checks: cpu_step.c, which serves the steps it can
    ahead of them (test_p07_cpu_step.py), is off (every step takes decode_forward or a graph)."""
    monkeypatch.setattr(CStep, "serves", lambda self, rows: False)


def graphs_made(runner) -> tuple[int, set]:
    """How many graphs the runner compiled or read, and which shapes (batch 1: True)."""
    return runner.num_compiled + runner.num_loaded, set(runner.graphs)


def tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_compiled_run_calls_the_graph_of_its_shape_in_the_step_s_context(monkeypatch):
    """`CompiledDecodeRunner.run` with stand-in graphs (nothing compiled): batch 1 calls its own
    graph, a larger bucket the dynamic one, on the first `bucket` rows of the buffers, under
    inference mode, with the step's attention and layers in the forward context (and the same
    step handed to the C++ kernels) while the graph runs, and all of it taken back after."""
    import threading
    from types import SimpleNamespace

    from phases.p07_cuda_graphs.decode_runner import StaticDecodeBuffers

    seen, handed = [], []

    def graph(name):
        def call(model, ids, positions):
            seen.append((name, ids.tolist(), positions.tolist(), getattr(compiled._STEP, "attention", None),
                         getattr(compiled._STEP, "layers", None), torch.is_inference_mode_enabled()))
            return torch.zeros(len(ids), 5)
        return call

    monkeypatch.setattr(compiled, "use_step", lambda layers, attention=None: handed.append((layers, attention)))
    buf = StaticDecodeBuffers(max_rows=8, max_blocks=2, block_size=4, scratch_block=3, device=torch.device("cpu"))
    buf.input_ids.copy_(torch.arange(100, 108)), buf.positions.copy_(torch.arange(8))
    ready = threading.Event()
    ready.set()
    runner = SimpleNamespace(graphs={True: graph("batch 1"), False: graph("dynamic")}, shapes_seen=set(),
                             attention=lambda meta: ("attention", len(meta.slot_mapping)), opaque_layers="layers",
                             native_layers="native", model="model", c_step=None, ready=ready, buf=buf)
    for bucket, name in ((1, "batch 1"), (3, "dynamic")):
        seen.clear(), handed.clear()
        monkeypatch.setattr(compiled._STEP, "layers", None, raising=False)   # what an earlier step left
        logits = CompiledDecodeRunner.run(runner, bucket, buf)
        assert [s[0] for s in seen] == [name], (
            f"a step of {bucket} row(s) calls the graph of its shape, self.graphs[bucket == 1] (the {name} graph), "
            f"once: called {[s[0] for s in seen]}")
        _, ids, positions, attention, layers, inference = seen[0]
        assert ids == list(range(100, 100 + bucket)) and positions == list(range(bucket)), (
            f"the graph takes the first {bucket} rows of the buffers' input_ids and positions: got ids {ids}")
        assert attention == ("attention", bucket) and layers == "layers", (
            f"while the graph runs, the forward context holds this step's attention, self.attention(b.metadata("
            f"bucket)), and the model's layers, self.opaque_layers: it held {attention!r} and {layers!r}")
        assert inference, "the graph runs under torch.inference_mode()"
        assert handed == [("native", ("attention", bucket)), (None, None)], (
            f"the C++ kernels get the same step, use_step(self.native_layers, _STEP.attention), and it is taken back "
            f"after the graph, use_step(None), even if the graph raised: use_step was called with {handed}")
        assert getattr(compiled._STEP, "attention", None) is None, "after the step, _STEP.attention is taken back"
        assert logits.shape[0] == bucket
    assert runner.shapes_seen == {True, False}, (
        f"run records each shape it ran, bucket == 1, in shapes_seen: {runner.shapes_seen}")


@pytest.mark.kinds
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_compiled_step_gives_eager_tokens(make_llm, tiny_model_dir, quantization):
    kw = {"quantization": quantization} if quantization else {}
    compiled = make_llm(tiny_model_dir, 7, max_num_seqs=8, compilation_mode=1, **kw)
    eager = make_llm(tiny_model_dir, 7, max_num_seqs=8, enforce_eager=True, **kw)
    engine = compiled.llm_engine
    assert isinstance(engine.runner.decode_runner, CompiledDecodeRunner)
    before = engine.runner.num_static_steps
    assert graphs_made(engine.runner.decode_runner) == (2, {True, False})        # made at start
    for prompts in (PROMPTS[:1], PROMPTS):                                    # batch 1; buckets 8, 4, 2, 1
        try:
            got = tokens(compiled, prompts)
        except RuntimeError as e:
            raise AssertionError(
                f"the compiled step raised on {len(prompts)} requests: {str(e).splitlines()[0]} (a step runs the "
                "graph of its shape, self.graphs[bucket == 1], on the first `bucket` rows of the buffers)") from e
        want = tokens(eager, prompts)
        assert got == want, token_difference(got, want, f"{len(prompts)} requests, compiled steps against eager ones")
    assert engine.runner.num_static_steps - before >= 2 * (GREEDY.max_tokens - 1)   # the decodes ran compiled
    assert engine.runner.decode_runner.shapes_seen == {True, False}, "run must record bucket == 1 in shapes_seen"
    assert graphs_made(engine.runner.decode_runner) == (2, {True, False}), NEW_GRAPH


def test_compiled_step_reads_each_layer_s_window(make_llm, tiny_windowed_dir):
    """A model whose every layer attends in a sliding window of 8 tokens: the compiled step's
    attention (cpu_ops.cpp, each layer's window from the step's attention row) gives the eager
    step's tokens over outputs of three windows (one graph, of one row: a step of one request)."""
    compiled = make_llm(tiny_windowed_dir, 7, compilation_mode=1, cudagraph_capture_sizes=[1])
    eager = make_llm(tiny_windowed_dir, 7, enforce_eager=True)
    before = compiled.llm_engine.runner.num_static_steps
    for prompt in PROMPTS[1:3]:
        got, want = tokens(compiled, [prompt], LONG), tokens(eager, [prompt], LONG)
        assert got == want, token_difference(got, want, "one request past the window")
    assert compiled.llm_engine.runner.num_static_steps - before >= 2 * (LONG.max_tokens - 1)
    assert graphs_made(compiled.llm_engine.runner.decode_runner)[0] == 1


def test_compiled_logits_equal_eager_and_two_graphs_serve_every_bucket(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir, 7, max_num_seqs=8, compilation_mode=1, num_kv_blocks=64)
    engine = llm.llm_engine
    runner = engine.runner.decode_runner
    eager = DecodeRunner(runner.model, runner.buf, runner.attention)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()                                   # the prefills
    engine.step()                                   # a decode step: the buffers hold 5 real rows
    for bucket in (1, 2, 4, 8, 2, 1):
        kv = engine.kv_cache.kv.clone()
        want = eager.run(bucket)                    # writes this step's K/V ...
        kv_eager = engine.kv_cache.kv.clone()
        engine.kv_cache.kv.copy_(kv)                # ... undone: the compiled step writes them again
        got = runner.run(bucket)
        assert got.shape == want.shape, (
            f"bucket {bucket}: the compiled step gives logits for the bucket's first {bucket} rows of the buffers, "
            f"{tuple(want.shape)}; got {tuple(got.shape)}")
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, bucket=bucket: f"bucket {bucket}: the compiled step's logits against the eager step's: {m}")
        torch.testing.assert_close(engine.kv_cache.kv, kv_eager, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, bucket=bucket: f"bucket {bucket}: the K/V the compiled step wrote against the eager step's: {m}")
    assert graphs_made(runner) == (2, {True, False}), NEW_GRAPH   # the two graphs of the start
    engine.abort_request([f"r{i}" for i in range(len(PROMPTS))])


def needs_native():
    if not compiled.NATIVE.available():
        pytest.skip("cpu_ops.cpp needs AVX2 and a C++ compiler with PyTorch's headers")


@pytest.mark.kinds
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_a_compiled_step_never_enters_python(make_llm, tiny_model_dir, quantization, monkeypatch):
    """With cpu_ops.cpp built, the graph's operators run phase 5's products and phase 4's decode
    attention from C++: neither operator's Python kernel runs in a compiled step, and its logits
    and the K/V it writes are the eager step's. Without the step's tables (`use_step` a no-op)
    every call goes through Python, as where the C++ cannot be built."""
    needs_native()
    kw = {"quantization": quantization} if quantization else {}
    engine = make_llm(tiny_model_dir, 7, max_num_seqs=8, compilation_mode=1, **kw).llm_engine
    runner = engine.runner.decode_runner
    eager = DecodeRunner(runner.model, runner.buf, runner.attention)
    calls = []
    monkeypatch.setattr(runner, "opaque_layers", [lambda x, f=f: calls.append("linear") or f(x) for f in runner.opaque_layers])
    attend = CpuPagedAttention.__call__
    monkeypatch.setattr(CpuPagedAttention, "__call__", lambda self, *a: calls.append("attention") or attend(self, *a))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"n{i}", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    layers = len(runner.opaque_layers)
    # layers whose kernel is not one of phase 5's C ones the C++ kernel hands to Python (int8 on
    # an AVX512-VNNI CPU: cpu_int8_vnni); on an AVX2 one every layer of both formats is served
    in_python = int((runner.native_layers[:, 0] == 0).sum())
    assert in_python == 0 or platform.current().kind != "avx2"
    # cpu_int8_vnni rounds x to int8 (W8A8): a last-bit difference in the graph's norm can move
    # one of them by a step, as in test_fused_projections_are_bit_identical
    tol, kv_tol = (1e-3, 1e-3) if in_python else (1e-4, 1e-5)
    for bucket, tables in ((1, True), (8, True), (2, False)):
        if not tables:
            monkeypatch.setattr(compiled, "use_step", lambda *args: None)
        kv = engine.kv_cache.kv.clone()
        want = eager.run(bucket)
        kv_eager = engine.kv_cache.kv.clone()
        engine.kv_cache.kv.copy_(kv)
        calls.clear()
        got = runner.run(bucket)
        every_call = ["attention"] * runner.model.config.num_hidden_layers + ["linear"] * layers
        # and a layer whose C kernel takes fewer rows (cpu_gemv.c's one on the avx512_vnni kind)
        beyond = int(((runner.native_layers[:, 0] == 0) | (runner.native_layers[:, -1] <= bucket)).sum())
        assert sorted(calls) == (["linear"] * beyond if tables else sorted(every_call))
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        torch.testing.assert_close(engine.kv_cache.kv, kv_eager, rtol=kv_tol, atol=kv_tol)
    engine.abort_request([f"n{i}" for i in range(len(PROMPTS))])


@pytest.mark.kinds
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_cpp_product_is_the_layers_own(method):
    """cpu_ops.cpp's `opaque_linear` runs a layer's C product from its row of the layer table,
    bias included: the layer's own numbers, bit for bit. A layer without a row, or a call with
    rows enough for `dequant_sgemm`, goes to the Python kernel."""
    needs_native()
    torch.manual_seed(0)
    layers = [QuantizedLinear(torch.randn(96, 64), torch.randn(96), method, group_size=32) for _ in range(2)]
    table = torch.tensor([compiled.layer_row(m) for m in layers])
    table[1] = 0
    python = []
    compiled._STEP.layers = [lambda x, m=m: python.append(x.shape[0]) or m(x) for m in layers]
    compiled.use_step(table)
    try:
        for rows in (1, 3, 64):
            x = torch.randn(rows, 64)
            for i, m in enumerate(layers):
                assert torch.equal(torch.ops.tinyvllm.opaque_linear(x, i, 96), m(x))
    finally:
        compiled.use_step(None)
        del compiled._STEP.layers
    many = layers[0].dequant_from_rows() or 1 << 62
    in_python = [rows for rows in (1, 3, 64) for i in range(2) if i == 1 or table[0, 0] == 0 or rows >= many]
    assert python == in_python


@pytest.mark.kinds
def test_the_cpp_bfloat16_product_is_the_layers_own():
    """Many rows of a float32 layer whose products run in bfloat16 (`bf16_rows`, dtype="auto"):
    cpu_ops.cpp rounds x to bfloat16 and the output back to float32 with its own loops, the bias
    added with the second, bit for bit what the layer gives from Python (Tensor.bfloat16, ties to
    even; .float(); add_): sizes that leave a tail past the 16 and 8 values a loop takes, and
    an x with ties, a NaN, infinities and values too small for bfloat16."""
    from phases.p04_triton_kernels.cpu_layers import CpuLinear, bfloat16_weights

    needs_native()
    if not platform.current().onednn:
        pytest.skip("bfloat16 products run in oneDNN, which this kind does not use")
    torch.manual_seed(0)
    layer = CpuLinear(72, 100)
    torch.nn.init.normal_(layer.weight, std=0.1)
    torch.nn.init.normal_(layer.bias)
    layer.gemv_rows, layer.bf16_rows = 1, 4      # the C++ kernel serves a layer with a row of its own
    table = torch.tensor([compiled.layer_row(layer)])
    if table[0, 0] == 0:
        pytest.skip("cpu_gemv.c cannot run here: the layer has no row of the layer table")
    table.packed = bfloat16_weights([layer])
    compiled._STEP.layers = [lambda x: pytest.fail("went to the Python kernel")]
    compiled.use_step(table)
    try:
        for rows in (4, 37):
            x = torch.randn(rows, 72)
            x[0, :4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1e-40])   # ties; a denormal
            x[1, 5], x[2, 70], x[3, 71] = float("nan"), float("inf"), -float("inf")
            with torch.no_grad():
                want = layer(x)
            torch.testing.assert_close(torch.ops.tinyvllm.opaque_linear(x, 0, 100), want, rtol=0, atol=0,
                                       equal_nan=True)
    finally:
        compiled.use_step(None)
        del compiled._STEP.layers


def test_buckets_above_one_share_a_graph_dynamic_from_its_first_compile(tiny_model_dir):
    """Without batch 1 among the buckets the engine starts with one graph, whose batch dimension
    is dynamic: it serves buckets 2, 4 and 8."""
    llm = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8, compilation_mode=1, cudagraph_capture_sizes=[2, 4, 8])
    runner = llm.llm_engine.runner.decode_runner
    assert graphs_made(runner) == (1, {False})
    eager = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8, enforce_eager=True)
    assert tokens(llm, PROMPTS) == tokens(eager, PROMPTS)                  # buckets 8, 4, 2
    assert runner.shapes_seen == {False} and graphs_made(runner) == (1, {False})


@pytest.mark.kinds
def test_one_row_without_a_graph_of_one_runs_eagerly(tiny_model_dir, platform_rules):
    """Buckets without 1 (`cudagraph_capture_sizes=[8]`) compile only the graph of many rows; a
    step of one row there, where cpu_step.c does not take it (a kind without it: here its rule
    off), runs the eager step and gives its tokens."""
    platform_rules(c_step=False)
    llm = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8, compilation_mode=1, cudagraph_capture_sizes=[8])
    runner = llm.llm_engine.runner.decode_runner
    eager = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8, enforce_eager=True)
    assert runner.c_step is None and set(runner.graphs) == {False}
    assert tokens(llm, PROMPTS[:1]) == tokens(eager, PROMPTS[:1])        # one row at every step
    assert tokens(llm, PROMPTS) == tokens(eager, PROMPTS) and runner.shapes_seen == {False}


@pytest.mark.kinds
@pytest.mark.parametrize("batch_invariant,dtype", [(False, "float32"), (True, "float32"), (False, "bfloat16")])
def test_layers_are_opaque_where_a_product_of_their_own_serves_them(make_llm, tiny_model_dir, batch_invariant, dtype):
    """`make_opaque` wraps each float32 `CpuLinear` that runs tinyvllm's own product (cpu_gemv.c:
    where the platform's `gemv_max_rows` says), as cpu_ops.cpp calls it, and each bfloat16 one where
    `upcast_linear` serves its many rows (`bf16_upcast_from_rows`) or cpu_amx.c its few
    (`amx_product_max_rows`; cpu_ops.cpp calls either from Python, its row all zeros), and never a subclass with a product of its own (phase 3's
    `BatchInvariantLinear` keeps its bits)."""
    import copy

    from phases.p04_triton_kernels.cpu_layers import GEMV, CpuLinear

    if batch_invariant:
        from phases.p03_continuous_batching.batch_invariant import KERNELS
        if not KERNELS.available():
            pytest.skip("batch_invariant=True needs AVX2 and a C compiler")
    llm = make_llm(tiny_model_dir, 7, batch_invariant=batch_invariant, dtype=dtype, compilation_mode=0)
    model = copy.deepcopy(llm.llm_engine.model)
    rules = platform.current()
    plain = [m for m in model.modules() if type(m) is CpuLinear]
    served = not batch_invariant and (GEMV.available() and rules.rule("gemv_max_rows") > 0 if dtype == "float32"
                                      else rules.rule("bf16_upcast_from_rows") > 0
                                      or all(m.amx_max_rows() > 0 for m in plain))
    assert bool(plain) != batch_invariant
    assert compiled.make_opaque(model) == (len(plain) if served else 0)
    rows = model.native_layers
    assert len(rows) == len(model.opaque_layers)
    if dtype == "float32":
        assert (rows[:, 1] == 32).all() and (rows[:, -1] == rules.rule("gemv_max_rows") + 1).all()
    else:
        assert (rows == 0).all()


@pytest.mark.kinds
def test_compiled_step_reads_a_checkpoint_on_codes_from_them(tiny_codes_dir, platform_rules):
    """Phase 5's `LosslessLinear` layers fused (the codes of the stacked q/k/v and gate/up rows
    found again) and opaque: the layer table sends cpu_ops.cpp to cpu_lossless.c (kind 1, the
    codes' bits in the group field), and the compiled step gives the eager step's tokens."""
    from phases.p05_quantization.lossless import LOSSLESS

    if not LOSSLESS.available():
        pytest.skip("cpu_lossless.c needs AVX2 and a C compiler")
    platform_rules(codes_max_rows=8)
    llm = LLM(str(tiny_codes_dir), phase=7, max_num_seqs=8, compilation_mode=1)
    rows = llm.llm_engine.model.native_layers
    assert len(rows) == 2 * 4 + 1 and (rows[:, 1] == 1).all() and sorted(rows[:, 8].tolist()) == [4] * 8 + [8]
    eager = LLM(str(tiny_codes_dir), phase=7, max_num_seqs=8, enforce_eager=True)
    assert tokens(llm, PROMPTS) == tokens(eager, PROMPTS)


@pytest.mark.kinds
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_compiled_step_multiplies_many_rows_in_bfloat16_from_cpp(tiny_codes_dir, monkeypatch, platform_rules,
                                                                   quantization):
    """Where dtype="auto" multiplies many rows in bfloat16 (`CpuLinear.bf16_rows`), cpu_ops.cpp runs
    those rows too, on the packed bfloat16 weights `make_opaque` keeps with the layer table: a
    bucket past the codes' rows never enters Python, and the compiled step gives the eager step's
    tokens. int4 layers keep no such weight: their many rows are `dequant_sgemm`'s, in Python (from
    32 rows, past these buckets), and a layer whose kernel has no C row (the int8 head where it is
    cpu_int8_vnni's) is called from Python at every row count."""
    from phases.p05_quantization.lossless import LOSSLESS

    needs_native()
    if not (LOSSLESS.available() and platform.current().onednn):
        pytest.skip("cpu_lossless.c needs AVX2 and a C compiler; bfloat16 products, oneDNN")
    # codes up to 8 rows, but bfloat16 from 5: the codes (and cpu_step.c) up to 4
    platform_rules(codes_max_rows=8, bf16_products_from_rows=5)
    monkeypatch.delenv("TINYVLLM_BF16_PRODUCTS")
    llm = LLM(str(tiny_codes_dir), phase=7, max_num_seqs=8, compilation_mode=1, quantization=quantization)
    runner = llm.llm_engine.runner.decode_runner
    if quantization is None:
        weights, rows, amx, amx_fn, amx_rows = runner.native_layers.packed   # amx: cpu_amx.c's copies, where it runs
        assert rows == [5] * len(runner.opaque_layers) and all(w.is_mkldnn for w in weights)
        assert bool(amx_fn) == bool(amx_rows) == any(w.numel() for w in amx)
        assert (runner.native_layers[:, -1] == 5).all() and getattr(runner.c_step, "max_rows", 0) in (0, 4)
    else:
        assert runner.native_layers.packed is None
    calls = []
    monkeypatch.setattr(runner, "opaque_layers", [lambda x, f=f: calls.append(len(x)) or f(x) for f in runner.opaque_layers])
    eager = LLM(str(tiny_codes_dir), phase=7, max_num_seqs=8, enforce_eager=True, quantization=quantization)
    assert tokens(llm, PROMPTS) == tokens(eager, PROMPTS)     # buckets 8, 4, 2, 1
    every_row_in_c = quantization is None or bool((runner.native_layers[:, 0] != 0).all())
    assert runner.shapes_seen >= {False} and (calls == []) == every_row_in_c


def test_a_saved_graph_s_key_follows_the_engine_s_source_not_its_tests(tmp_path, monkeypatch):
    """A changed line of tinyvllm or a phase compiles again; a changed test reuses the graphs."""
    model = torch.nn.Linear(2, 2)
    (tmp_path / "part.py").write_text("x = 1\n")
    (tmp_path / "test_part.py").write_text("def test(): pass\n")
    monkeypatch.setattr(compiled, "SOURCES", (tmp_path,))
    key = compiled.compile_key(model)
    (tmp_path / "test_part.py").write_text("def test(): assert 1\n")
    assert compiled.compile_key(model) == key
    (tmp_path / "part.py").write_text("x = 2\n")
    assert compiled.compile_key(model) != key


def test_a_graph_folder_another_user_could_write_is_refused(tiny_model_dir, tmp_path, monkeypatch, recwarn):
    """A saved graph is code the engine runs: the folder of saved graphs is refused by name, before
    a graph is read from it or written to it, when another user could write it. With
    compilation_mode=1 the engine does not start; by default it serves eagerly, and says why."""
    monkeypatch.setattr(compiled, "cache_dir", lambda: tmp_path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    folder = tmp_path / "compiled"
    folder.mkdir()
    folder.chmod(0o777)
    refused = f"the cache folder {folder} is writable by every user"
    with pytest.raises(PermissionError, match=refused):
        LLM(str(tiny_model_dir), phase=7, max_num_seqs=2, compilation_mode=1)
    monkeypatch.delenv("TINYVLLM_COMPILATION_MODE", raising=False)
    llm = LLM(str(tiny_model_dir), phase=7, max_num_seqs=2)
    assert llm.llm_engine.runner.decode_runner.wait_until_compiled(60) is False
    assert any(f"compiling the decode step failed (PermissionError: {refused}" in str(w.message) for w in recwarn.list)
    assert tokens(llm, PROMPTS[:2]) == tokens(make_eager(tiny_model_dir), PROMPTS[:2])
    assert not list(folder.iterdir())


@pytest.mark.parametrize("value", [2, -1, "1", 1.0, True])
def test_bad_compilation_mode_names_it(make_llm, tiny_model_dir, value):
    before = make_llm(tiny_model_dir, 7, max_num_seqs=8, compilation_mode=1)
    with pytest.raises(ValueError, match="compilation_mode"):
        LLM(str(tiny_model_dir), phase=7, compilation_mode=value)
    assert len(tokens(before, PROMPTS[:2])[0]) == GREEDY.max_tokens


def test_a_bad_request_leaves_the_compiled_engine_running(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir, 7, max_num_seqs=8, compilation_mode=1)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(PROMPTS[:2], SamplingParams(temperature=-1.0))
    assert len(tokens(llm, PROMPTS[:3])) == 3


def test_every_engine_of_a_process_runs_its_own_graphs(tiny_model_dir, tiny_model_dir_llama3, tmp_path,
                                                      monkeypatch):
    """The graphs are saved ($TINYVLLM_CACHE/compiled): a second engine of the same model and
    arguments reads them instead of compiling; an engine of another model (other shapes, tied
    embeddings) compiles its own. Engines of both, their steps interleaved, each keep their tokens:
    a graph finds its attention and layers in the forward context of its own step."""
    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path))
    first = LLM(str(tiny_model_dir), phase=7, max_num_seqs=4, compilation_mode=1)
    second = LLM(str(tiny_model_dir), phase=7, max_num_seqs=4, compilation_mode=1)
    other = LLM(str(tiny_model_dir_llama3), phase=7, max_num_seqs=1, compilation_mode=1)
    made = [(e.llm_engine.runner.decode_runner.num_compiled, e.llm_engine.runner.decode_runner.num_loaded)
            for e in (first, second, other)]
    assert made == [(2, 0), (0, 2), (1, 0)]
    assert len(list((tmp_path / "compiled").glob("decode-*.bin"))) == 3
    want = {d: tokens(LLM(str(d), phase=7, max_num_seqs=4, enforce_eager=True), PROMPTS[:3])
            for d in (tiny_model_dir, tiny_model_dir_llama3)}
    for llm, d in ((first, tiny_model_dir), (other, tiny_model_dir_llama3), (second, tiny_model_dir),
                   (other, tiny_model_dir_llama3)):
        assert tokens(llm, PROMPTS[:3]) == want[d]


def test_compile_time_tool_reports_start_and_parts(tiny_model_dir, tmp_path, capsys):
    from phases.p07_cuda_graphs.tools import compile_time

    out = tmp_path / "compile.json"
    report = compile_time.main(["--model", str(tiny_model_dir), "--quantization", "int8", "--batch", "1", "3",
                                "--steps", "3", "--profile", "--json", str(out)])
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["cache"] in ("compiled", "read") and row["weights"] == "int8"
        assert row["llm_s"] > 0 and 0 < row["engine_ms"] < row["step_ms"]
        parts = [row[k] for k in ("products_ms", "attention_ms", "guards_ms", "rest_ms")]
        assert parts[0] > 0 and parts[1] > 0 and sum(parts) > 0
    assert report["command"].endswith("--json " + str(out)) and '"batch": 3' in capsys.readouterr().out
    assert out.exists() and report["machine"]["cpu_kind"]


def test_bf16_rows_tool_builds_a_float32_engine_and_ones_of_bfloat16_products(tiny_model_dir, tmp_path,
                                                                              monkeypatch):
    """The measurement behind the platform's `bf16_products_from_rows`: each engine after the first
    runs its products in bfloat16 from one of --rows rows (whatever this CPU's kind), the first
    never, and the process's own platform is as it was after."""
    from phases.p07_cuda_graphs.tools import bf16_rows

    if not platform.current().onednn:
        pytest.skip("bfloat16 products run in oneDNN, which this kind does not use")
    monkeypatch.delenv("TINYVLLM_BF16_PRODUCTS")   # the suite's float32 setting would turn both off
    before, out = platform.current(), tmp_path / "bf16.json"
    report = bf16_rows.main(["--model", str(tiny_model_dir), "--rows", "2", "5", "--rounds", "1", "--requests", "3",
                             "--prompt-len", "40", "--json", str(out)])
    assert [r["bf16_rows"] for r in report["rows"]] == [0, 2, 5] and platform.current() is before
    for row in report["rows"]:
        assert len(row["tok_s"]) == 1 and row["median_tok_s"] > 0 and row["median_ttft_ms"] > 0
    assert report["rows"][0]["same_requests"] == 3 and out.exists()


def test_start_time_tool_reports_first_token_and_the_switch(tiny_model_dir, tmp_path):
    from phases.p07_cuda_graphs.tools import start_time

    out = tmp_path / "start.json"
    report = start_time.main(["--model", str(tiny_model_dir), "--compilation-mode", "1", "--json", str(out)])
    row = report["row"]
    assert row["compiled"] and row["graphs"]["compiled"] + row["graphs"]["read"] == 2
    # each time rounded to 10 ms (a fast machine's first token on the tiny model can round to 0)
    assert row["llm_s"] > 0 and row["first_token_s"] >= 0 and row["compiled_after_s"] >= row["llm_s"]
    assert row["llm_to_first_token_s"] == pytest.approx(row["llm_s"] + row["first_token_s"], abs=0.011)
    assert json.loads(out.read_text())["row"] == row and report["machine"]["cpu_kind"]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_compiled_step_with_preemption_seeds_penalties_int8_kv_and_drafts(tiny_model_dir, spec):
    """The compiled step under what the rest of the engine does: a pool small enough to preempt,
    seeded and penalized requests with logprobs, an int8 KV cache (its attention backend found
    through the forward context), n-gram drafts: phase 6's tokens."""
    kw = dict(max_num_seqs=8, block_size=8, kv_cache_dtype="int8", speculative_config=spec)
    compiled = LLM(str(tiny_model_dir), phase=7, compilation_mode=1, num_kv_blocks=10, **kw)
    eager = LLM(str(tiny_model_dir), phase=7, enforce_eager=True, num_kv_blocks=11, **kw)  # + the scratch block
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, top_k=7, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=18, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, presence_penalty=0.5, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)]
    got = compiled.generate(PROMPTS, params, use_tqdm=False)
    want = eager.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    engine = compiled.llm_engine
    assert engine.runner.num_static_steps > 10 and engine.scheduler.num_preemptions > 0


def test_default_compiles_in_the_background_while_serving_eagerly(tiny_model_dir, monkeypatch, tmp_path):
    """`LLM()` as users get it on a CPU (compilation_mode unset): requests are served at once, by
    the eager step, and nothing is compiled or read until the engine has run COMPILE_AFTER_STEPS
    decode steps (a short run stays eager: making the graphs would cost it more than they save);
    then a worker process compiles beside more requests and a thread reads the graphs it saved,
    and decode steps run compiled; the tokens never change. A second engine finds the graphs
    saved and reads them, with no worker, once it too has run that many decode steps."""
    monkeypatch.delenv("TINYVLLM_COMPILATION_MODE", raising=False)
    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path))    # no graph saved yet
    monkeypatch.setattr(compiled, "COMPILE_AFTER_STEPS", 10**9)
    eager = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8, enforce_eager=True)
    want = tokens(eager, PROMPTS)
    llm = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8)
    runner = llm.llm_engine.runner.decode_runner
    assert isinstance(runner, CompiledDecodeRunner) and not runner.ready.is_set()
    assert tokens(llm, PROMPTS) == want and runner.shapes_seen == set()      # served eagerly
    time.sleep(0.5)                                   # a short run: no worker, nothing due
    assert runner.eager_steps >= GREEDY.max_tokens - 1 and runner.worker is None and not runner.due.is_set()
    monkeypatch.setattr(compiled, "COMPILE_AFTER_STEPS", runner.eager_steps + 1)
    for _ in range(2):          # the next decode step makes them due; eager steps beside the compile
        assert tokens(llm, PROMPTS) == want
    assert runner.due.is_set()
    assert runner.wait_until_compiled(300) and runner.compile_error is None
    assert runner.worker.returncode == 0 and (runner.num_compiled, runner.num_loaded) == (0, 2)
    assert tokens(llm, PROMPTS) == want               # now compiled
    assert runner.shapes_seen == {True, False} and graphs_made(runner) == (2, {True, False}), NEW_GRAPH
    monkeypatch.setattr(compiled, "COMPILE_AFTER_STEPS", 10**9)
    llm2 = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8)
    again = llm2.llm_engine.runner.decode_runner
    assert tokens(llm2, PROMPTS[:1]) == want[:1]
    time.sleep(0.5)    # the graphs are saved, but a short run does not read them
    assert again.worker is None and again.num_loaded == 0 and not again.ready.is_set()
    monkeypatch.setattr(compiled, "COMPILE_AFTER_STEPS", again.eager_steps + 1)
    assert tokens(llm2, PROMPTS[:1]) == want[:1]
    assert again.ready.wait(60) and again.num_loaded == 2
    assert again.worker is None and again.compile_error is None


def test_a_failed_background_compile_leaves_the_engine_eager(tiny_model_dir, monkeypatch, recwarn, tmp_path):
    """A compile worker that fails (here: it cannot build the model) is warned, with its last
    line, and the engine serves on with the eager step."""
    from phases.p07_cuda_graphs import recipe

    monkeypatch.delenv("TINYVLLM_COMPILATION_MODE", raising=False)
    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path))
    request = recipe.compile_request
    monkeypatch.setattr(recipe, "compile_request",
                        lambda setup, parts: {**request(setup, parts), "model": str(tmp_path / "gone")})
    llm = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8)
    runner = llm.llm_engine.runner.decode_runner
    assert runner.wait_until_compiled(120) is False and isinstance(runner.compile_error, RuntimeError)
    assert runner.worker.returncode != 0
    assert any("compiling the decode step failed (RuntimeError: the compile worker exited with" in str(w.message)
               for w in recwarn.list)
    eager = make_eager(tiny_model_dir)
    assert tokens(llm, PROMPTS) == tokens(eager, PROMPTS)


def test_a_stopped_compile_worker_leaves_the_engine_eager_and_quiet(tiny_model_dir, monkeypatch, recwarn, tmp_path):
    """A worker killed before it finishes (its engine collected, the interpreter exiting: a
    `tinyvllm generate` that ends during the compile) stops the background compile without a
    warning; the engine serves on eagerly."""

    monkeypatch.delenv("TINYVLLM_COMPILATION_MODE", raising=False)
    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(compiled, "COMPILE_AFTER_STEPS", 1)
    llm = LLM(str(tiny_model_dir), phase=7, max_num_seqs=8)
    runner = llm.llm_engine.runner.decode_runner
    tokens(llm, PROMPTS[:1])                          # its first decode step makes the graphs due
    deadline = time.monotonic() + 60
    while runner.worker is None and time.monotonic() < deadline:
        time.sleep(0.05)
    runner.worker.kill()
    assert runner.wait_until_compiled(60) is False and runner.worker.returncode < 0
    assert not any("compiling the decode step failed" in str(w.message) for w in recwarn.list)
    assert tokens(llm, PROMPTS) == tokens(make_eager(tiny_model_dir), PROMPTS)


def make_eager(model_dir):
    return LLM(str(model_dir), phase=7, max_num_seqs=8, enforce_eager=True)


@pytest.mark.parametrize("env, compiled", [("0", False), ("1", True)])
def test_the_environment_sets_an_unset_compilation_mode(tiny_model_dir, monkeypatch, env, compiled):
    """$TINYVLLM_COMPILATION_MODE stands for an unset compilation_mode (1: compiled before the
    first request); an engine argument wins over it; a bad value is an error naming it."""
    monkeypatch.setenv("TINYVLLM_COMPILATION_MODE", env)
    runner = LLM(str(tiny_model_dir), phase=7, max_num_seqs=1).llm_engine.runner.decode_runner
    assert isinstance(runner, CompiledDecodeRunner) is compiled
    if compiled:
        assert runner.ready.is_set() and runner.thread.ident is None    # compiled at start
    monkeypatch.setenv("TINYVLLM_COMPILATION_MODE", "2")
    with pytest.raises(ValueError, match="TINYVLLM_COMPILATION_MODE"):
        LLM(str(tiny_model_dir), phase=7)
    runner = LLM(str(tiny_model_dir), phase=7, compilation_mode=0).llm_engine.runner.decode_runner
    assert not isinstance(runner, CompiledDecodeRunner)


def test_run_length_tool_interleaves_the_ways_and_takes_medians(tiny_model_dir):
    """`tools/run_length`: each round runs every way once, in turn (a slow moment of the machine
    falls on each), and a row per (tokens, way) holds the median of its rounds and how many read
    the graphs; a child of the eager way is one request in `compilation_mode=0`."""
    from types import SimpleNamespace

    from phases.p07_cuda_graphs.tools import run_length

    calls, times = [], iter([5.0, 9.0, 6.0, 4.0, 8.0, 5.5, 6.0, 7.0, 6.5])

    def fake_run(cmd, **kw):
        calls.append(cmd[-2:])
        ready = 2.0 if cmd[-2] != "eager" else None
        return SimpleNamespace(stdout=f"noise\n{json.dumps({'request_s': next(times), 'ready_s': ready})}\n")
    rows = run_length.rounds(["tool"], [100], 3, run=fake_run)
    assert calls == [[way, "100"] for _ in range(3) for way in run_length.WAYS]
    got = {r["way"]: (r["request_s"], r["runs"], r["graphs_read"], r["ready_s"]) for r in rows}
    assert got == {"eager": (5.0, [5.0, 4.0, 6.0], 0, None), "at once": (8.0, [9.0, 8.0, 7.0], 3, 2.0),
                   "as it comes": (6.0, [6.0, 5.5, 6.5], 3, 2.0)}
    assert rows[0]["tok_per_s"] == 20.0
    eager = run_length.child("eager", 3, str(tiny_model_dir), None)
    assert eager["request_s"] > 0 and eager["ready_s"] is None


def test_kind_rules_tool_adds_the_rules_in_turn_and_restores_them(tiny_model_dir, tmp_path):
    """`tools/kind_rules`: a row per set of rules and batch, each set the one before plus a rule,
    the same greedy tokens in every set; the process's own platform is back after it."""
    from phases.p07_cuda_graphs.tools import kind_rules

    before = platform.current()
    report = kind_rules.main(["--model", str(tiny_model_dir), "--batch", "1", "2", "--rounds", "1",
                              "--json", str(tmp_path / "rules.json")])
    assert [(r["batch"], r["rules"]) for r in report["rows"]] == [(b, n) for b in (1, 2) for n in kind_rules.NAMES]
    assert all(r["same_tokens"] and r["median_tok_s"] > 0 for r in report["rows"])
    assert platform.current() is before
    assert json.loads((tmp_path / "rules.json").read_text())["rows"] == report["rows"]
