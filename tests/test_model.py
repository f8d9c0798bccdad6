"""Our decoder equals transformers' on tiny random folders: Llama (grouped-query attention, tied
embeddings, Llama 3.x RoPE scaling), Qwen2 (q/k/v biases) and Qwen3 (q/k norms, head_dim apart)."""

import pytest
import torch

from phases.p01_naive_attention import NaiveAttention
from tinyvllm.weights import load_model


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "tiny_model_dir_llama3", "tiny_qwen2_dir",
                                           "tiny_qwen3_dir"])
def test_logits_equal_transformers(model_fixture, request):
    transformers = pytest.importorskip("transformers")
    folder = request.getfixturevalue(model_fixture)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = load_model(folder, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 300, (200,), generator=torch.Generator().manual_seed(0))  # past llama3's 64
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        got = ours.compute_logits(ours(ids, torch.arange(len(ids)), NaiveAttention()))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("vendor_rule", ["Intel", "other"])
def test_linear_fast_paths_equal_f_linear(rows, bias, vendor_rule):
    """The model's Linear takes, for a few rows, MKL's F.linear on an Intel CPU and (W @ x^T)^T
    elsewhere (one row padded to two), and oneDNN with a packed weight beyond: each vendor's
    rule, tried on this machine, gives the same numbers as F.linear."""
    from tinyvllm.model import Linear

    torch.manual_seed(rows)
    layer = Linear(48, 80, bias=bias)
    layer.small_rows, layer.small_rows_mkl = (3, True) if vendor_rule == "Intel" else (2, False)
    layer.gemv_rows = 0   # the libraries' paths (the next test: tinyvllm's own)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        y = layer(x)
    assert y.shape == (rows, 80) and y.is_contiguous()
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("out_features", [80, 2500])   # one chunk of the weight, and three (the last short)
def test_bfloat16_linear_runs_many_rows_in_float32_on_the_kinds_it_was_measured(out_features, monkeypatch):
    """In bfloat16 on a CPU kind BF16_UPCAST_ROWS names, from that many rows Linear computes in
    float32 (`upcast_linear`, the weight made float32 a chunk at a time): float32's product of
    the same bfloat16 numbers, rounded once to bfloat16; fewer rows, or a kind not named, keep
    PyTorch's bfloat16 product."""
    from tinyvllm import model
    from tinyvllm.hardware import cpu_kind

    torch.manual_seed(0)
    layer = model.Linear(48, out_features, bias=True).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(40, 48, dtype=torch.bfloat16)
    exact = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    got = model.upcast_linear(x, layer.weight, layer.bias)
    assert got.dtype == torch.bfloat16   # within bfloat16's one rounding of float32's result
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -8, atol=1e-6)
    assert layer.upcast_rows == model.BF16_UPCAST_ROWS.get(cpu_kind(), 0)
    calls = []
    monkeypatch.setattr(model, "upcast_linear", lambda *a: calls.append(len(a[0])) or exact[: len(a[0])].bfloat16())
    layer.upcast_rows, layer.bf16_onednn = 24, False   # (BF16_ONEDNN_KINDS: its own test)
    with torch.inference_mode():
        for rows in (1, 23, 24, 40):
            y = layer(x[:rows])
            assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        layer.upcast_rows = 0   # a kind where it was not measured
        layer(x)
    assert calls == [24, 40]


def test_bfloat16_linear_runs_in_onednn_where_bfloat16_is_native(monkeypatch):
    """On a CPU kind BF16_ONEDNN_KINDS names (AVX512-BF16: the avx512_vnni kind), a bfloat16
    Linear multiplies in oneDNN on its packed weight at every row count: F.linear's numbers up
    to float32 sums' order, rounded once to bfloat16; elsewhere it is F.linear."""
    from tinyvllm import model
    from tinyvllm.hardware import cpu_kind

    torch.manual_seed(0)
    layer = model.Linear(48, 80, bias=True).to(torch.bfloat16).requires_grad_(False)
    assert layer.bf16_onednn == (model.onednn_available() and cpu_kind() in model.BF16_ONEDNN_KINDS)
    calls = []
    pack = model.onednn_packed
    monkeypatch.setattr(model, "onednn_packed", lambda w: calls.append(w.dtype) or pack(w))
    with torch.inference_mode():
        for rows in (1, 5, 40):
            x = torch.randn(rows, 48, dtype=torch.bfloat16)
            exact = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
            y = layer(x)
            assert y.dtype == torch.bfloat16
            torch.testing.assert_close(y.float(), exact, rtol=2 ** -7, atol=1e-2)
    assert calls == ([torch.bfloat16] * 3 if layer.bf16_onednn else [])


@pytest.mark.parametrize("shape", [(80, 48), (7, 13), (963, 1536)])   # (out, in): odd sizes too
def test_linear_gemv_equals_f_linear_and_serves_its_rows(shape, monkeypatch):
    """tinyvllm's own float32 product (cpu_gemv.c) gives F.linear's numbers up to float rounding,
    with and without a bias, and Linear takes it up to `gemv_max_rows()` rows (`GEMV_MAX_ROWS`: 8
    on the avx2 kind, 1 on avx512_vnni; none on a kind not measured), PyTorch's products beyond."""
    from tinyvllm import model
    from tinyvllm.hardware import cpu_kind

    if not model.GEMV.available():
        pytest.skip("cpu_gemv.c needs AVX2 and a C compiler")
    torch.manual_seed(0)
    for bias in (False, True):
        layer = model.Linear(shape[1], shape[0], bias=bias).requires_grad_(False)
        for rows in (1, 3, 8):
            x = torch.randn(rows, shape[1])
            torch.testing.assert_close(model.gemv(x, layer.weight, layer.bias),
                                       torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert layer.gemv_max_rows() == model.GEMV_MAX_ROWS.get(cpu_kind(), 0) and "amx" not in model.GEMV_MAX_ROWS
    layer.gemv_rows, calls = 8, []
    monkeypatch.setattr(model, "gemv", lambda *a: calls.append(len(a[0])) or torch.nn.functional.linear(*a))
    for rows in (1, 8, 9, 64):
        layer(torch.randn(rows, shape[1]))
    assert calls == [1, 8]
    assert layer.half().gemv_max_rows() == 0   # float32 only


@pytest.mark.parametrize("shape", [(1, 576), (3, 40), (2, 1003)])   # (rows, width): a tail past 16 too
def test_fused_add_rms_norm_equals_the_add_then_the_norm(shape):
    """vLLM's fused residual add + RMSNorm in one call of cpu_norm.c: residual += x exactly, x
    overwritten with RMSNorm's numbers up to float rounding; without a residual a new tensor;
    None (the caller takes PyTorch's operators) for another dtype and inside a traced graph."""
    from tinyvllm import model
    from tinyvllm.hardware import cpu_kind

    torch.manual_seed(0)
    norm = model.RMSNorm(shape[1], 1e-5).requires_grad_(False)
    if cpu_kind() not in model.FUSED_NORM_KINDS or not model.NORM.available():   # not measured there, or no C
        assert model.fused_add_rms_norm(torch.randn(shape), None, norm) is None
        return
    norm.weight.normal_()
    x, residual = torch.randn(shape), torch.randn(shape)
    added = x + residual
    out, res = model.fused_add_rms_norm(x, residual, norm)
    assert out is x and res is residual and torch.equal(residual, added)
    torch.testing.assert_close(out, norm(added), rtol=1e-5, atol=1e-5)
    y = torch.randn(shape)
    out, res = model.fused_add_rms_norm(y, None, norm)
    assert res is y and out is not y
    torch.testing.assert_close(out, norm(y), rtol=1e-5, atol=1e-5)
    assert model.fused_add_rms_norm(y.double(), None, norm) is None
    assert model.fused_add_rms_norm(y, torch.randn(shape[0] + 1, shape[1]), norm) is None   # another shape
    traced = torch.compile(lambda t: model.fused_add_rms_norm(t, None, norm), fullgraph=True, backend="eager")
    assert traced(y) is None


@pytest.mark.parametrize("rows", [1, 3])
def test_linear_traces_into_one_graph(rows):
    """TorchDynamo traces `Linear` whole (notebook 07 compiles the model itself, not through
    phase 7's opaque layers): the trace never asks whether cpu_gemv.c runs on the weight."""
    from tinyvllm.model import Linear

    layer = Linear(48, 80).requires_grad_(False)
    traced = torch.compile(layer, fullgraph=True, backend="eager")   # a graph break raises
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(traced(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_linear_packed_weight_follows_the_weight():
    """The packed copy is made again when the weight is changed in place (as loading does) or
    replaced, so the product never uses stale numbers."""
    from tinyvllm.model import Linear

    if not Linear.use_onednn:
        pytest.skip("no oneDNN on this machine: Linear uses F.linear, nothing is packed")
    layer = Linear(48, 80, bias=False)
    x = torch.randn(16, 48)
    with torch.inference_mode():
        layer(x)
        first = layer.packed_weight()
        assert layer.packed_weight() is first                 # packed once, then reused
    with torch.no_grad():
        layer.weight.mul_(2.0)                                # in place: the loader's copy_
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), x @ layer.weight.T)
        assert layer.packed_weight() is not first
    layer.weight = torch.nn.Parameter(torch.randn(80, 48))    # replaced
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), x @ layer.weight.T)


def test_linear_keeps_autograd_working():
    """With gradients on, Linear is plain F.linear, so the weight gets its gradient."""
    from tinyvllm.model import Linear

    layer = Linear(48, 80)
    layer(torch.randn(16, 48)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == (80, 48)


def test_onednn_product_as_an_operator_equals_the_eager_one():
    """`torch.ops.tinyvllm.onednn_linear` (what a compiled graph of many rows calls) gives the
    eager many-rows product's numbers, and its fake version agrees with it."""
    from tinyvllm.model import Linear

    if not Linear.use_onednn:
        pytest.skip("no oneDNN on this CPU")
    torch.manual_seed(0)
    layer = Linear(64, 40).requires_grad_(False)
    layer.gemv_rows = 0   # 8 rows: oneDNN's, not cpu_gemv.c's
    x = torch.randn(8, 64)
    op = torch.ops.tinyvllm.onednn_linear
    assert torch.equal(op(x, layer.weight, layer.bias, 0), layer(x))
    layer.bf16_rows = 8   # from 8 rows in bfloat16: the operator decides by its input's rows
    assert torch.equal(op(x, layer.weight, layer.bias, 8), layer(x))
    assert torch.equal(op(x[:7], layer.weight, layer.bias, 8), op(x[:7], layer.weight, layer.bias, 0))
    torch.library.opcheck(op, (x, layer.weight, layer.bias, 8), test_utils=("test_schema", "test_faketensor"))


def test_linear_bfloat16_products_from_bf16_rows():
    """From `bf16_rows` rows a float32 Linear multiplies in bfloat16: its inputs rounded to
    bfloat16, the sums float32's, the output rounded once to bfloat16 and returned in float32 with
    the bias added; below that many rows, the float32 product bit for bit."""
    from tinyvllm.model import Linear

    if not Linear.use_onednn:
        pytest.skip("no oneDNN on this CPU")
    torch.manual_seed(0)
    layer = Linear(64, 40, bias=True).requires_grad_(False)
    layer.gemv_rows = 0
    x = torch.randn(13, 64)
    f32 = layer(x)
    layer.bf16_rows = 13
    assert torch.equal(layer(x[:12]), f32[:12])             # 12 rows: float32's product
    y = layer(x)
    assert y.dtype == torch.float32 and not torch.equal(y, f32)
    exact = torch.nn.functional.linear(x.bfloat16().float(), layer.weight.bfloat16().float())
    torch.testing.assert_close(y - layer.bias, exact, rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(y, f32, rtol=0.05, atol=0.05)  # what rounding the inputs costs here


def test_bfloat16_products_reach_every_layer_an_engine_runs(tiny_codes_dir, monkeypatch):
    """dtype="auto" on a CPU kind BF16_PRODUCT_ROWS names gives every float32 product of the
    engine its rows, the layers made after loading too (phase 5's codes and int4 layers, phase
    7's fused projections); dtype="float32" and $TINYVLLM_BF16_PRODUCTS=0 (the suite's) none."""
    from tinyvllm import LLM
    from tinyvllm.hardware import cpu_kind
    from tinyvllm.model import BF16_PRODUCT_ROWS, Linear, onednn_available

    want = BF16_PRODUCT_ROWS.get(cpu_kind(), 0) if onednn_available() else 0
    monkeypatch.delenv("TINYVLLM_BF16_PRODUCTS")
    for dtype, rows in (("auto", want), ("float32", 0)):
        engine = LLM(str(tiny_codes_dir), phase=7, dtype=dtype, enforce_eager=False, num_kv_blocks=16).llm_engine
        layers = [m for m in engine.model.modules() if isinstance(m, Linear)]
        assert engine.setup.bf16_rows == rows and {m.bf16_rows for m in layers} == {rows}
        assert {type(m).__name__ for m in layers} >= {"LosslessLinear"}
        assert any(n.endswith("qkv_proj") for n, _ in engine.model.named_modules())
    int4 = LLM(str(tiny_codes_dir), phase=7, quantization="int4", num_kv_blocks=16).llm_engine.model
    assert {m.bf16_rows for m in int4.modules() if type(m).__name__ == "QuantizedLinear"} == {want}
    monkeypatch.setenv("TINYVLLM_BF16_PRODUCTS", "0")
    assert LLM(str(tiny_codes_dir), phase=7, num_kv_blocks=16).llm_engine.setup.bf16_rows == 0
    monkeypatch.setenv("TINYVLLM_BF16_PRODUCTS", "yes")
    with pytest.raises(ValueError, match="TINYVLLM_BF16_PRODUCTS"):
        LLM(str(tiny_codes_dir), phase=7, num_kv_blocks=16)


@pytest.mark.parametrize("rows", [1, 9, 16, 17, 64, 65, 130])
def test_the_amx_product_sums_bfloat16_operands_in_float32(rows):
    """cpu_amx.c (the amx kind's bfloat16 products, up to AMX_PRODUCT_ROWS rows): x and the
    weight rounded to bfloat16, their products summed in float32 and returned unrounded, the bias
    added; past 64 rows in a second pass over the weight; a weight changed in place packed again;
    a wide weight's outputs in groups and its inputs in chunks (`CHUNK_KB`, `GROUP`). Outputs not a
    multiple of 16, or inputs of 32, are not its (they take oneDNN's)."""
    from tinyvllm.model import amx_matmul, amx_rows

    torch.manual_seed(rows)
    w, bias, x = torch.randn(96, 320), torch.randn(96), torch.randn(rows, 320)
    if not amx_rows(w):
        pytest.skip("cpu_amx.c runs on the amx kind (AMX tiles, AVX512-BF16)")
    exact = x.bfloat16().double() @ w.bfloat16().double().T
    torch.testing.assert_close(amx_matmul(x, w, bias).double(), exact + bias.double(), rtol=1e-5, atol=1e-4)
    w.mul_(2)
    torch.testing.assert_close(amx_matmul(x, w, None).double(), 2 * exact, rtol=1e-5, atol=1e-4)
    assert amx_rows(torch.randn(40, 320)) == amx_rows(torch.randn(96, 100)) == 0
    wide, xs = torch.randn(1040, 800), torch.randn(rows, 800)   # several groups of outputs, inputs in chunks
    torch.testing.assert_close(amx_matmul(xs, wide, None).double(), xs.bfloat16().double() @ wide.bfloat16().double().T,
                               rtol=1e-5, atol=1e-4)


def test_bfloat16_products_take_the_amx_kernel_up_to_its_rows(monkeypatch):
    """A float32 product of `bf16_rows` rows or more runs on cpu_amx.c up to `amx_rows(weight)`
    rows (AMX_PRODUCT_ROWS), on oneDNN's bfloat16 product past them, in float32 below bf16_rows."""
    from tinyvllm import model

    if not model.onednn_available():
        pytest.skip("no oneDNN on this CPU")
    calls = []
    monkeypatch.setattr(model, "amx_rows", lambda w: 64)
    monkeypatch.setattr(model, "amx_matmul", lambda x, w, b: calls.append(("amx", len(x))) or x.new_zeros(len(x), 16))
    monkeypatch.setattr(model, "onednn_bf16", lambda x, w, b: calls.append(("onednn", len(x))) or x.new_zeros(len(x), 16))
    for n in (8, 9, 64, 65):
        assert model.onednn_matmul(torch.randn(n, 32), torch.randn(16, 32), None, bf16_rows=9).shape == (n, 16)
    assert calls == [("amx", 9), ("amx", 64), ("onednn", 65)]


def test_the_products_tool_times_each_way_with_bfloat16_beside_float32(tiny_codes_dir, capsys):
    """`python -m tinyvllm.entrypoints.bench.linear`: a column per way a float32 `Linear` can
    take, the bfloat16 product (`BF16_PRODUCT_ROWS`) and the codes among them, a line per row count."""
    from tinyvllm.entrypoints.bench import linear
    from tinyvllm.model import onednn_available

    linear.main(["--model", str(tiny_codes_dir), "--rows", "1", "16", "--repeat", "1"])
    lines = capsys.readouterr().out.splitlines()
    header = lines[1]
    assert "F.linear" in header and "Linear" in header
    assert ("oneDNN bf16" in header) == onednn_available()
    assert [line.split()[0] for line in lines[2:]] == ["1", "16"]
    ways = (len(header) - 5) // 13                      # "rows", then 11 characters and 2 spaces a way
    assert all(len(line.split()) == 1 + ways and float(line.split()[-1]) > 0 for line in lines[2:])


def test_bf16_product_leaves_a_prompt_s_product_in_bfloat16(monkeypatch):
    """`bf16_product`: where a Linear's rows take oneDNN's bfloat16 product (from `bf16_rows`,
    past `amx_rows`), the same numbers as `layer(x)` before its float32 copy, from a float32 or a
    bfloat16 x, in the dtype asked; None where `layer(x)` would run another product."""
    from tinyvllm import model

    if not model.Linear.use_onednn:
        pytest.skip("no oneDNN on this CPU")
    monkeypatch.setattr(model, "amx_rows", lambda w: 8)
    torch.manual_seed(0)
    layer = model.Linear(64, 48, bias=False).requires_grad_(False)
    x = torch.randn(9, 64)
    assert model.bf16_product(layer, x) is None                 # bf16_rows 0: float32 products
    layer.bf16_rows = 4
    y = model.bf16_product(layer, x, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y.float(), layer(x))
    assert torch.equal(model.bf16_product(layer, x.bfloat16()), layer(x))   # float32 out by default
    assert model.bf16_product(layer, x[:8]) is None             # cpu_amx.c's rows
    assert model.bf16_product(torch.nn.Linear(64, 48), x) is None
    with_bias = model.Linear(64, 48, bias=True).requires_grad_(False)
    with_bias.bf16_rows = 4
    assert model.bf16_product(with_bias, x) is None



@pytest.mark.parametrize("rows", [1, 7, 300])
def test_silu_and_mul_rounds_silu_gate_times_up_once(rows):
    """`silu_and_mul` of a bfloat16 [gate, up]: silu(gate) * up computed in float32 and rounded
    to bfloat16 once (cpu_amx.c where it is built: the exp of its own within float32's error,
    so nearly every value is the correctly rounded one); PyTorch's two operators elsewhere (a view
    that is not contiguous, an I not a multiple of 16), to bfloat16's rounding twice."""
    import torch.nn.functional as F

    from tinyvllm.model import silu_and_mul

    torch.manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * 160)).bfloat16()
    gate, up = gate_up.float().chunk(2, dim=-1)
    exact = F.silu(gate) * up
    out = silu_and_mul(gate_up)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 160)
    torch.testing.assert_close(out.float(), exact, rtol=2 ** -8, atol=1e-6)
    assert (out == exact.bfloat16()).float().mean() > 0.999
    strided = torch.cat([gate_up, gate_up], dim=1)[:, : 2 * 160]      # rows 640 apart: PyTorch's way
    torch.testing.assert_close(silu_and_mul(strided).float(), exact, rtol=2 ** -7, atol=1e-5)


def test_rmsnorm_runs_cpu_norm_c_without_autograd(monkeypatch):
    """RMSNorm on float32 rows without autograd, on a kind NORM_MODULE_KINDS names: one call of
    cpu_norm.c where it runs (its own order of the squares' sum: float32's rounding apart from
    PyTorch's operators); with autograd recording, PyTorch's operators, whose gradient flows."""
    from tinyvllm import model
    from tinyvllm.model import RMSNorm, fused_add_rms_norm

    monkeypatch.setattr(model, "NORM_MODULE_HERE", True)

    torch.manual_seed(0)
    norm, x = RMSNorm(96, 1e-5), torch.randn(33, 96)
    norm.weight.data = torch.rand(96) + 0.5
    y = norm(x)                                                        # autograd on: PyTorch's
    y.sum().backward()
    assert norm.weight.grad is not None
    reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(y, reference)
    with torch.inference_mode():
        fast, c = norm(x), fused_add_rms_norm(x.clone(), None, norm)
        torch.testing.assert_close(fast, reference.detach(), rtol=1e-6, atol=1e-6)
        if c is not None:                                              # a kind FUSED_NORM_KINDS names
            assert torch.equal(fast, c[0])


def test_a_layer_s_residual_add_joins_the_c_norm_with_the_same_numbers(monkeypatch):
    """On a kind NORM_MODULE_KINDS names, a decoder layer adds attention's output to its input and
    normalizes the sum in one cpu_norm.c pass: the numbers of the add and then the module's norm,
    bit for bit, and the caller's input is left as it was."""
    from tinyvllm import model
    from tinyvllm.config import ModelConfig

    if not (model.FUSED_NORM_HERE and model.NORM.available()):
        pytest.skip("cpu_norm.c's add + RMSNorm is not this kind's")
    monkeypatch.setattr(model, "NORM_MODULE_HERE", True)
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=160, num_hidden_layers=1,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=32)
    layer = model.LlamaDecoderLayer(config, 0).requires_grad_(False)
    for p in layer.parameters():
        p.normal_(0, 0.2)
    attn = lambda i, q, k, v: q * 0.5 + k.repeat_interleave(3, 1)     # any attention: its output is added
    x, rope = torch.randn(70, 96), (torch.ones(70, 1, 32), torch.zeros(70, 1, 32))
    before, real, joined = x.clone(), model.fused_add_rms_norm, []
    monkeypatch.setattr(model, "fused_add_rms_norm", lambda x, r, *a: joined.append(r is not None) or real(x, r, *a))
    with torch.inference_mode():
        out = layer(x, rope, attn)
        assert joined.count(True) == 1                                 # the add went into the norm's call
        h = x + layer.self_attn(layer.input_layernorm(x), rope, attn)
        assert torch.equal(out, h + layer.mlp(layer.post_attention_layernorm(h)))
    assert torch.equal(x, before)


def test_rope_in_c_gives_pytorch_s_numbers_bit_for_bit(monkeypatch):
    """`apply_rotary` on float32 rows without autograd, on a kind ROPE_KINDS names: cpu_norm.c's
    `rope` on q and k as views of one qkv product, PyTorch's operators' bits; a layout it does not
    take (heads not d apart, d not a multiple of 16) or autograd gets the operators."""
    from tinyvllm import model

    monkeypatch.setattr(model, "ROPE_HERE", True)
    torch.manual_seed(0)
    qkv, angle = torch.randn(37, 15 * 64), 50 * torch.rand(37, 1, 32)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    q, k = qkv[:, : 9 * 64].view(37, 9, 64), qkv[:, 9 * 64: 12 * 64].view(37, 3, 64)
    expected = [x * cos + model._rotate_half(x) * sin for x in (q, k)]
    with torch.inference_mode():
        if model.rope(q, cos, sin) is None:
            pytest.skip("cpu_norm.c is not built on this CPU (AVX2)")
        for got, want in zip(model.apply_rotary(q, k, cos, sin), expected):
            assert got.is_contiguous() and torch.equal(got, want)
        assert model.rope(qkv[:, : 9 * 64].view(37, 64, 9).transpose(1, 2), cos, sin) is None   # d not in a row
        assert model.rope(torch.randn(37, 2, 40), cos[..., :40].contiguous(), sin[..., :40].contiguous()) is None
    assert model.rope(q, cos, sin) is None                                     # autograd on
