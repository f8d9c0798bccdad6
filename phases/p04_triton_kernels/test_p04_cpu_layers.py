"""Phase 4 checkpoint, the model's CPU kernels: `CpuLinear`, `CpuRMSNorm`, `CpuRotaryEmbedding`,
cpu_amx.c's products and SiLU, and which of them a CPU engine's model gets (`use_cpu_kernels`).

Each path gives the plain layer's numbers (F.linear, RMSNorm, RoPE), to float rounding where it
sums in another order, bit for bit where it claims to; each is taken where the platform's rules
say (`tinyvllm.platform`), and only there. Run under `TINYVLLM_CPU_KIND=<kind>` (`make
test-kinds`) they check every kind's paths on one machine: a test asserts the contract of the
path the platform picked for the kind it acts as.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phases.p04_triton_kernels import cpu_layers
from phases.p04_triton_kernels.cpu_amx import amx_fits, amx_lib, amx_matmul, silu_and_mul
from phases.p04_triton_kernels.cpu_layers import (NORM, GEMV, CpuLinear, CpuRMSNorm, CpuRotaryEmbedding, bf16_product,
                                                  fused_add_rms_norm, gemv, onednn_matmul, rope, upcast_linear)
from tinyvllm import LLM, platform
from tinyvllm.layers import Linear, RMSNorm, RotaryEmbedding, rotate_half

pytestmark = pytest.mark.kinds


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("vendor_rule", ["Intel", "other"])
def test_linear_fast_paths_equal_f_linear(rows, bias, vendor_rule):
    """CpuLinear takes, for a few rows, MKL's F.linear on an Intel CPU and (W @ x^T)^T elsewhere
    (one row padded to two), and oneDNN with a packed weight beyond (where this kind uses oneDNN):
    each vendor's rule, tried on this machine, gives the same numbers as F.linear."""
    torch.manual_seed(rows)
    layer = CpuLinear(48, 80, bias=bias)
    layer.small_rows, layer.small_rows_mkl = (3, True) if vendor_rule == "Intel" else (2, False)
    layer.gemv_rows = 0   # the libraries' paths (the next tests: tinyvllm's own)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        y = layer(x)
    assert y.shape == (rows, 80) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))


def test_a_cpu_linear_holds_the_rules_of_its_kind():
    """A CpuLinear made under a platform reads its thresholds from that platform's rules (and
    keeps them after): the rows of cpu_gemv.c, bfloat16's upcast, oneDNN and AMX."""
    for kind in platform.KINDS:
        rules = platform.rules_of(kind)
        with platform.using(rules):
            layer = CpuLinear(64, 32)
        assert (layer.gemv_rows, layer.upcast_rows, layer.amx_rows) == (
            rules.rule("gemv_max_rows"), rules.rule("bf16_upcast_from_rows"), rules.rule("amx_product_max_rows"))
        assert layer.use_onednn == rules.onednn and layer.bf16_onednn == (rules.onednn and rules.rule("bf16_onednn"))
        assert (layer.small_rows, layer.small_rows_mkl) == rules.small_rows
    assert platform.rules_of("other").onednn is False       # a CPU without our kernels: PyTorch's products


@pytest.mark.parametrize("out_features", [80, 2500])   # one chunk of the weight, and three (the last short)
def test_bfloat16_linear_runs_many_rows_in_float32_on_the_kinds_it_was_measured(out_features, monkeypatch):
    """In bfloat16 on a kind whose `bf16_upcast_from_rows` rule names a row count, from that many
    rows CpuLinear computes in float32 (`upcast_linear`, the weight made float32 a chunk at a
    time): float32's product of the same bfloat16 numbers, rounded once to bfloat16; fewer rows,
    or a kind without the rule, keep PyTorch's bfloat16 product."""
    torch.manual_seed(0)
    layer = CpuLinear(48, out_features, bias=True).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(40, 48, dtype=torch.bfloat16)
    exact = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    got = upcast_linear(x, layer.weight, layer.bias)
    assert got.dtype == torch.bfloat16   # within bfloat16's one rounding of float32's result
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -8, atol=1e-6)
    assert layer.upcast_rows == platform.current().rule("bf16_upcast_from_rows")
    calls = []
    monkeypatch.setattr(cpu_layers, "upcast_linear", lambda *a: calls.append(len(a[0])) or exact[: len(a[0])].bfloat16())
    layer.upcast_rows, layer.bf16_onednn = 24, False   # (bf16_onednn: its own test)
    with torch.inference_mode():
        for rows in (1, 23, 24, 40):
            y = layer(x[:rows])
            assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        layer.upcast_rows = 0   # a kind where it was not measured
        layer(x)
    assert calls == [24, 40]


def test_bfloat16_linear_runs_in_onednn_where_bfloat16_is_native(monkeypatch):
    """On a kind whose `bf16_onednn` rule says so (AVX512-BF16: the avx512_vnni kind), a bfloat16
    CpuLinear multiplies in oneDNN on its packed weight at every row count: F.linear's numbers up
    to float32 sums' order, rounded once to bfloat16; elsewhere it is F.linear."""
    torch.manual_seed(0)
    layer = CpuLinear(48, 80, bias=True).to(torch.bfloat16).requires_grad_(False)
    rules = platform.current()
    assert layer.bf16_onednn == bool(rules.onednn and rules.rule("bf16_onednn"))
    calls = []
    pack = cpu_layers.onednn_packed
    monkeypatch.setattr(cpu_layers, "onednn_packed", lambda w: calls.append(w.dtype) or pack(w))
    with torch.inference_mode():
        for rows in (1, 5, 40):
            x = torch.randn(rows, 48, dtype=torch.bfloat16)
            exact = F.linear(x.float(), layer.weight.float(), layer.bias.float())
            y = layer(x)
            assert y.dtype == torch.bfloat16
            torch.testing.assert_close(y.float(), exact, rtol=2 ** -7, atol=1e-2)
    assert calls == ([torch.bfloat16] * 3 if layer.bf16_onednn else [])


@pytest.mark.parametrize("shape", [(80, 48), (7, 13), (963, 1536)])   # (out, in): odd sizes too
def test_linear_gemv_equals_f_linear_and_serves_its_rows(shape, monkeypatch):
    """tinyvllm's own float32 product (cpu_gemv.c) gives F.linear's numbers up to float rounding,
    with and without a bias, and CpuLinear takes it up to `gemv_max_rows()` rows (the platform's
    `gemv_max_rows`: 8 on the avx2 kind, 1 on avx512_vnni, none on a kind not measured; none where
    it cannot build), PyTorch's products beyond."""
    torch.manual_seed(0)
    layer = CpuLinear(shape[1], shape[0], bias=True).requires_grad_(False)
    if not GEMV.available():                           # the "other" kind, or no C compiler
        assert layer.gemv_max_rows() == 0
        return
    for bias in (False, True):
        layer = CpuLinear(shape[1], shape[0], bias=bias).requires_grad_(False)
        for rows in (1, 3, 8):
            x = torch.randn(rows, shape[1])
            torch.testing.assert_close(gemv(x, layer.weight, layer.bias), F.linear(x, layer.weight, layer.bias),
                                       rtol=1e-5, atol=1e-5)
    assert layer.gemv_max_rows() == platform.current().rule("gemv_max_rows")
    layer.gemv_rows, calls = 8, []
    monkeypatch.setattr(cpu_layers, "gemv", lambda *a: calls.append(len(a[0])) or F.linear(*a))
    for rows in (1, 8, 9, 64):
        layer(torch.randn(rows, shape[1]))
    assert calls == [1, 8]
    assert layer.half().gemv_max_rows() == 0   # float32 only


@pytest.mark.parametrize("rows", [1, 3])
def test_linear_traces_into_one_graph(rows):
    """TorchDynamo traces `CpuLinear` whole (notebook 07 compiles the model itself, not through
    phase 7's opaque layers): the trace never asks whether cpu_gemv.c runs on the weight."""
    layer = CpuLinear(48, 80).requires_grad_(False)
    traced = torch.compile(layer, fullgraph=True, backend="eager")   # a graph break raises
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(traced(x), F.linear(x, layer.weight, layer.bias))


def test_linear_packed_weight_follows_the_weight():
    """The packed copy is made again when the weight is changed in place (as loading does) or
    replaced, so the product never uses stale numbers; where the kind uses no oneDNN, nothing is
    packed and the product is F.linear's."""
    layer = CpuLinear(48, 80, bias=False)
    x = torch.randn(16, 48)
    if not layer.use_onednn:
        with torch.inference_mode():
            assert torch.equal(layer(x), F.linear(x, layer.weight))
        assert not any(name.startswith("_onednn_packed") for name in vars(layer.weight))
        return
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
    """With gradients on, CpuLinear is plain F.linear, so the weight gets its gradient."""
    layer = CpuLinear(48, 80)
    layer(torch.randn(16, 48)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == (80, 48)


def needs_onednn():
    if not platform.current().onednn:
        pytest.skip(f"the {platform.current().kind} kind runs PyTorch's plain products: no oneDNN, no bfloat16 rows")


def test_onednn_product_as_an_operator_equals_the_eager_one():
    """`torch.ops.tinyvllm.onednn_linear` (what a compiled graph of many rows calls) gives the
    eager many-rows product's numbers, and its fake version agrees with it."""
    needs_onednn()
    torch.manual_seed(0)
    layer = CpuLinear(64, 40).requires_grad_(False)
    layer.gemv_rows, layer.amx_rows = 0, 0   # 8 rows: oneDNN's, not cpu_gemv.c's or cpu_amx.c's
    x = torch.randn(8, 64)
    op = torch.ops.tinyvllm.onednn_linear
    assert torch.equal(op(x, layer.weight, layer.bias, 0, 0), layer(x))
    layer.bf16_rows = 8   # from 8 rows in bfloat16: the operator decides by its input's rows
    assert torch.equal(op(x, layer.weight, layer.bias, 8, 0), layer(x))
    assert torch.equal(op(x[:7], layer.weight, layer.bias, 8, 0), op(x[:7], layer.weight, layer.bias, 0, 0))
    torch.library.opcheck(op, (x, layer.weight, layer.bias, 8, 0), test_utils=("test_schema", "test_faketensor"))


def test_linear_bfloat16_products_from_bf16_rows():
    """From `bf16_rows` rows a float32 CpuLinear multiplies in bfloat16: its inputs rounded to
    bfloat16, the sums float32's, the output rounded once to bfloat16 and returned in float32
    with the bias added; below that many rows, the float32 product bit for bit."""
    needs_onednn()
    torch.manual_seed(0)
    layer = CpuLinear(64, 40, bias=True).requires_grad_(False)
    layer.gemv_rows, layer.amx_rows = 0, 0
    x = torch.randn(13, 64)
    f32 = layer(x)
    layer.bf16_rows = 13
    assert torch.equal(layer(x[:12]), f32[:12])             # 12 rows: float32's product
    y = layer(x)
    assert y.dtype == torch.float32 and not torch.equal(y, f32)
    exact = F.linear(x.bfloat16().float(), layer.weight.bfloat16().float())
    torch.testing.assert_close(y - layer.bias, exact, rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(y, f32, rtol=0.05, atol=0.05)  # what rounding the inputs costs here


def test_bfloat16_products_reach_every_layer_an_engine_runs(tiny_codes_dir, monkeypatch):
    """dtype="auto" on a kind whose `bf16_products_from_rows` rule names a row count gives every
    float32 product of the engine its rows, the layers made after loading too (phase 5's codes and
    int4 layers, phase 7's fused projections); dtype="float32" and $TINYVLLM_BF16_PRODUCTS=0 (the
    suite's) none; phase 3, whose model is plain, none either."""
    rules = platform.current()
    monkeypatch.delenv("TINYVLLM_BF16_PRODUCTS")
    want = rules.bf16_product_rows("auto", "cpu")
    assert want == ((rules.rule("bf16_products_from_rows") or 0) if rules.onednn else 0)
    for dtype, rows in (("auto", want), ("float32", 0)):
        engine = LLM(str(tiny_codes_dir), phase=7, dtype=dtype, enforce_eager=False, num_kv_blocks=16).llm_engine
        layers = [m for m in engine.model.modules() if isinstance(m, CpuLinear)]
        assert engine.setup.bf16_rows == rows and {m.bf16_rows for m in layers} == {rows}
        assert any(n.endswith("qkv_proj") for n, _ in engine.model.named_modules())
        assert ({type(m).__name__ for m in layers} >= {"LosslessLinear"}) == bool(rules.rule("codes_max_rows")
                                                                                and GEMV.supported())
    int4 = LLM(str(tiny_codes_dir), phase=7, quantization="int4", num_kv_blocks=16).llm_engine.model
    assert {m.bf16_rows for m in int4.modules() if type(m).__name__ == "QuantizedLinear"} == {want}
    plain = LLM(str(tiny_codes_dir), phase=3, num_kv_blocks=16).llm_engine
    assert plain.setup.bf16_rows == want and not any(hasattr(m, "bf16_rows") for m in plain.model.modules())
    monkeypatch.setenv("TINYVLLM_BF16_PRODUCTS", "0")
    assert LLM(str(tiny_codes_dir), phase=7, num_kv_blocks=16).llm_engine.setup.bf16_rows == 0
    monkeypatch.setenv("TINYVLLM_BF16_PRODUCTS", "yes")
    with pytest.raises(ValueError, match="TINYVLLM_BF16_PRODUCTS"):
        LLM(str(tiny_codes_dir), phase=7, num_kv_blocks=16)


@pytest.mark.parametrize("rows", [1, 9, 16, 17, 64, 65, 130])
def test_the_amx_product_sums_bfloat16_operands_in_float32(rows):
    """cpu_amx.c (the amx kind's bfloat16 products, up to `amx_product_max_rows` rows): x and the
    weight rounded to bfloat16, their products summed in float32 and returned unrounded, the bias
    added; past 64 rows in a second pass over the weight; a weight changed in place packed again;
    a wide weight's outputs in groups and its inputs in chunks (`CHUNK_KB`, `GROUP`). Outputs not a
    multiple of 16, or inputs of 32, are not its (they take oneDNN's). Without AMX tiles in the
    kind's flags, the library does not load and no weight is its."""
    torch.manual_seed(rows)
    w, bias, x = torch.randn(96, 320), torch.randn(96), torch.randn(rows, 320)
    if not platform.current().has({"amx_tile", "amx_bf16"}):
        assert amx_lib() is None and not amx_fits(w)
        return
    assert amx_fits(w), "an AMX kind with a C compiler builds cpu_amx.c"
    exact = x.bfloat16().double() @ w.bfloat16().double().T
    torch.testing.assert_close(amx_matmul(x, w, bias).double(), exact + bias.double(), rtol=1e-5, atol=1e-4)
    w.mul_(2)
    torch.testing.assert_close(amx_matmul(x, w, None).double(), 2 * exact, rtol=1e-5, atol=1e-4)
    assert not amx_fits(torch.randn(40, 320)) and not amx_fits(torch.randn(96, 100))
    wide, xs = torch.randn(1040, 800), torch.randn(rows, 800)   # several groups of outputs, inputs in chunks
    torch.testing.assert_close(amx_matmul(xs, wide, None).double(), xs.bfloat16().double() @ wide.bfloat16().double().T,
                               rtol=1e-5, atol=1e-4)


def test_a_bfloat16_model_s_few_rows_take_the_amx_tiles(monkeypatch):
    """A bfloat16 CpuLinear (a model loaded with dtype="bfloat16") multiplies up to
    `amx_product_max_rows` rows on cpu_amx.c where the kind has AMX tiles: x's bfloat16 numbers and
    the weight's, summed in float32, the bias added, rounded once to bfloat16; more rows, or a kind
    without the tiles, keep the product they had (oneDNN's or PyTorch's)."""
    torch.manual_seed(0)
    layer = CpuLinear(320, 96, bias=True).to(torch.bfloat16).requires_grad_(False)
    calls = []
    amx = cpu_layers.amx_matmul
    monkeypatch.setattr(cpu_layers, "amx_matmul", lambda x, w, b: calls.append(len(x)) or amx(x, w, b))
    most, tiles = layer.amx_max_rows(), platform.current().has({"amx_tile", "amx_bf16"}) and amx_lib() is not None
    assert most == (platform.current().rule("amx_product_max_rows") if tiles else 0)
    with torch.inference_mode():
        for rows in sorted({1, 5, max(most, 1), most + 1}):
            x = torch.randn(rows, 320, dtype=torch.bfloat16)
            exact = x.double() @ layer.weight.double().T + layer.bias.double()
            y = layer(x)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
            torch.testing.assert_close(y.double(), exact, rtol=2 ** -7, atol=2e-2)
    assert calls == [r for r in sorted({1, 5, max(most, 1), most + 1}) if r <= most]


def test_bfloat16_products_take_the_amx_kernel_up_to_its_rows(monkeypatch):
    """A float32 product of `bf16_rows` rows or more runs on cpu_amx.c up to `amx_rows` rows
    (where the weight is its), on oneDNN's bfloat16 product past them, in float32 below
    bf16_rows."""
    needs_onednn()
    calls = []
    monkeypatch.setattr(cpu_layers, "amx_fits", lambda w: True)
    monkeypatch.setattr(cpu_layers, "amx_matmul", lambda x, w, b: calls.append(("amx", len(x))) or x.new_zeros(len(x), 16))
    monkeypatch.setattr(cpu_layers, "onednn_bf16", lambda x, w, b: calls.append(("onednn", len(x))) or x.new_zeros(len(x), 16))
    for n in (8, 9, 64, 65):
        assert onednn_matmul(torch.randn(n, 32), torch.randn(16, 32), None, bf16_rows=9, amx_rows=64).shape == (n, 16)
    assert calls == [("amx", 9), ("amx", 64), ("onednn", 65)]


def test_bf16_product_leaves_a_prompt_s_product_in_bfloat16(monkeypatch):
    """`bf16_product`: where a CpuLinear's rows take oneDNN's bfloat16 product (from `bf16_rows`,
    past `amx_max_rows`), the same numbers as `layer(x)` before its float32 copy, from a float32 or
    a bfloat16 x, in the dtype asked; None where `layer(x)` would run another product."""
    needs_onednn()
    torch.manual_seed(0)
    layer = CpuLinear(64, 48, bias=False).requires_grad_(False)
    layer.amx_rows = 8
    monkeypatch.setattr(cpu_layers, "amx_fits", lambda w: True)
    x = torch.randn(9, 64)
    assert bf16_product(layer, x) is None                       # bf16_rows 0: float32 products
    layer.bf16_rows = 4
    y = bf16_product(layer, x, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y.float(), layer(x))
    assert torch.equal(bf16_product(layer, x.bfloat16()), layer(x))   # float32 out by default
    assert bf16_product(layer, x[:8]) is None                   # cpu_amx.c's rows
    assert bf16_product(torch.nn.Linear(64, 48), x) is None
    with_bias = CpuLinear(64, 48, bias=True).requires_grad_(False)
    with_bias.bf16_rows = 4
    assert bf16_product(with_bias, x) is None


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_silu_and_mul_rounds_silu_gate_times_up_once_where_cpu_amx_runs(rows):
    """`silu_and_mul` of a bfloat16 [gate, up]: where cpu_amx.c is built (an AMX kind),
    silu(gate) * up computed in float32 and rounded to bfloat16 once (the exp of its own within
    float32's error, so nearly every value is the correctly rounded one); elsewhere, and for a
    view that is not contiguous, PyTorch's two operators, bit for bit: rounded to bfloat16 twice."""
    torch.manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * 160)).bfloat16()
    gate, up = gate_up.float().chunk(2, dim=-1)
    exact = F.silu(gate) * up
    two_operators = F.silu(gate_up[:, :160]) * gate_up[:, 160:]
    out = silu_and_mul(gate_up)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 160)
    torch.testing.assert_close(out.float(), exact, rtol=2 ** -7, atol=1e-5)
    if amx_lib() is not None:
        torch.testing.assert_close(out.float(), exact, rtol=2 ** -8, atol=1e-6)
        assert (out == exact.bfloat16()).float().mean() > 0.999
    else:
        assert torch.equal(out, two_operators)
    strided = torch.cat([gate_up, gate_up], dim=1)[:, : 2 * 160]      # rows 640 apart: PyTorch's way
    assert torch.equal(silu_and_mul(strided), two_operators if rows > 1 else out)   # (one row is contiguous)


@pytest.mark.parametrize("shape", [(1, 576), (3, 40), (2, 1003)])   # (rows, width): a tail past 16 too
def test_fused_add_rms_norm_equals_the_add_then_the_norm(shape):
    """vLLM's fused residual add + RMSNorm in one call of cpu_norm.c: residual += x exactly, x
    overwritten with RMSNorm's numbers up to float rounding; without a residual a new tensor; None
    (the caller takes PyTorch's operators) for another dtype, inside a traced graph, and where the
    kind cannot build it."""
    torch.manual_seed(0)
    norm = RMSNorm(shape[1], 1e-5).requires_grad_(False)
    if not NORM.available():                                   # the "other" kind, or no C compiler
        assert fused_add_rms_norm(torch.randn(shape), None, norm) is None
        return
    norm.weight.normal_()
    x, residual = torch.randn(shape), torch.randn(shape)
    added = x + residual
    out, res = fused_add_rms_norm(x, residual, norm)
    assert out is x and res is residual and torch.equal(residual, added)
    torch.testing.assert_close(out, norm(added), rtol=1e-5, atol=1e-5)
    y = torch.randn(shape)
    out, res = fused_add_rms_norm(y, None, norm)
    assert res is y and out is not y
    torch.testing.assert_close(out, norm(y), rtol=1e-5, atol=1e-5)
    assert fused_add_rms_norm(y.double(), None, norm) is None
    assert fused_add_rms_norm(y, torch.randn(shape[0] + 1, shape[1]), norm) is None   # another shape
    traced = torch.compile(lambda t: fused_add_rms_norm(t, None, norm), fullgraph=True, backend="eager")
    assert traced(y) is None


def test_cpu_rmsnorm_runs_cpu_norm_c_without_autograd():
    """CpuRMSNorm on float32 rows without autograd: one call of cpu_norm.c where it builds (its own
    order of the squares' sum: float32's rounding apart from RMSNorm's operators); given the
    stream, the block's output is only read and the stream gets the sum, as the plain module's
    (norm(x + residual), x + residual); with autograd recording, the plain module, whose gradient
    flows."""
    torch.manual_seed(0)
    plain = RMSNorm(96, 1e-5)
    plain.weight.data = torch.rand(96) + 0.5
    norm, x = CpuRMSNorm.like(plain), torch.randn(33, 96)
    assert norm.weight is plain.weight and norm.eps == plain.eps
    y = norm(x)                                                        # autograd on: the plain module's
    y.sum().backward()
    assert norm.weight.grad is not None and torch.equal(y, plain(x))
    with torch.inference_mode():
        fast, c = norm(x), fused_add_rms_norm(x.clone(), None, norm)
        torch.testing.assert_close(fast, plain(x), rtol=1e-6, atol=1e-6)
        assert c is None or torch.equal(fast, c[0])
        h, stream = torch.randn(33, 96), x.clone()
        before = h.clone()
        normed, summed = norm(h, stream)
        want_normed, want_sum = plain(before, x)
        assert torch.equal(h, before) and torch.equal(summed, want_sum)
        torch.testing.assert_close(normed, want_normed, rtol=1e-6, atol=1e-6)
        if NORM.available():
            assert torch.equal(normed, norm(want_sum))                # the norm of the sum, one pass


def test_rope_in_c_gives_pytorch_s_numbers_bit_for_bit():
    """CpuRotaryEmbedding.rotate on float32 rows without autograd: cpu_norm.c's `rope` on q and k
    as views of one qkv product where it builds, RotaryEmbedding's operators' bits; a layout it does
    not take (heads not d apart, d not a multiple of 16) or autograd gets the operators."""
    from tinyvllm.config import ModelConfig

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=160, num_hidden_layers=1,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=64)
    plain = RotaryEmbedding(config, 64)
    fast = CpuRotaryEmbedding.like(plain)
    assert fast.cos is plain.cos and fast.sin is plain.sin
    qkv, angle = torch.randn(37, 15 * 64), 50 * torch.rand(37, 1, 32)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    q, k = qkv[:, : 9 * 64].view(37, 9, 64), qkv[:, 9 * 64: 12 * 64].view(37, 3, 64)
    expected = [x * cos + rotate_half(x) * sin for x in (q, k)]
    with torch.inference_mode():
        for got, want in zip(fast.rotate(q, k, cos, sin), expected):
            assert torch.equal(got, want)
        if NORM.available():
            assert rope(q, cos, sin) is not None
            assert rope(qkv[:, : 9 * 64].view(37, 64, 9).transpose(1, 2), cos, sin) is None   # d not in a row
            assert rope(torch.randn(37, 2, 40), cos[..., :40].contiguous(), sin[..., :40].contiguous()) is None
        else:
            assert rope(q, cos, sin) is None
    assert rope(q, cos, sin) is None                                     # autograd on


def test_a_cpu_engine_s_model_gets_the_kernels_its_kind_s_rules_name(tiny_model_dir):
    """Phase 4's model on a CPU (`use_cpu_kernels`), on each kind's rules: every Linear a CpuLinear
    (the same Parameters: a tied head stays tied), every RMSNorm a CpuRMSNorm where
    `c_norm_prompt` says and the rotary embedding CpuRotaryEmbedding's where `c_rope` says, the
    plain modules elsewhere; phase 3's model keeps the plain layers everywhere; with
    batch_invariant=True, phase 4's does too."""
    for kind in platform.KINDS:
        rules = platform.rules_of(kind)
        with platform.using(rules):
            model = LLM(str(tiny_model_dir), phase=4, num_kv_blocks=16).llm_engine.model
        types = {type(m) for m in model.modules()}
        assert Linear not in types and CpuLinear in types, kind
        assert (CpuRMSNorm in types, RMSNorm in types) == ((True, False) if rules.rule("c_norm_prompt") else (False, True))
        assert type(model.model.rotary_emb) is (CpuRotaryEmbedding if rules.rule("c_rope") else RotaryEmbedding)
    phase3 = LLM(str(tiny_model_dir), phase=3, num_kv_blocks=16).llm_engine.model
    assert {type(m) for m in phase3.modules()} & {CpuLinear, CpuRMSNorm, CpuRotaryEmbedding} == set()
