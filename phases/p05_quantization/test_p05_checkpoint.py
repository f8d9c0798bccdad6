"""Phase 5 checkpoint: quantize/dequantize round trips within each format's bound, the packed int4
layout, every CPU kernel against the reference path, the quantized KV cache (round trip, more
blocks in the same memory, more sequences admitted), the engine with every format, and bad input
that leaves an LLM built before still generating."""

import subprocess
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torch.nn.functional as F

from conftest import BAD_STEPS
from phases.p05_quantization import cpu_int8
from phases.p05_quantization.lossless import LOSSLESS, LosslessLinear, lossless, lossless_codes
from phases.p05_quantization.quantize_layers import HEAD_METHOD, linear_layers, quantize_model
from phases.p05_quantization.kv_quant import (KV_CACHE_DTYPES, QuantizedKVCache, dequantize_kv,
                                              quantize_kv, quantized_bytes_per_block)
from phases.p05_quantization.quant import (QuantizedLinear, dequantize_int4, dequantize_int8,
                                           pack_int4, quantize_int4, quantize_int8, unpack_int4)
from tinyvllm import LLM, SamplingParams
from phases.p04_triton_kernels import CpuLinear
from tinyvllm import platform
from tinyvllm.ckernel import CKernel
from tinyvllm.testing import on_codes, resident_bytes

pytestmark = pytest.mark.kinds   # paths the platform chooses by CPU kind (make test-kinds)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3, 42, 7, 8]}, {"prompt_token_ids": [200, 11, 13]}]


def _weights(seed, rows, cols, outlier):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    if outlier:
        w[:, cols // 3] *= 40  # one outlier input column
    return w


def _off_by_more_than_half_a_step(w, back, step, rule: str) -> str:
    """The first element that came back further than half a step, in words."""
    r, c = ((back - w).abs() > step / 2 + 1e-6).nonzero()[0].tolist()
    return (f"row {r}, column {c}: {w[r, c]:.5f} comes back as {back[r, c]:.5f}, off by {(back - w)[r, c].abs():.2e}, "
            f"more than half a step ({step[r, c] / 2:.2e}): {rule}")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), rows=st.integers(1, 9), cols=st.sampled_from([64, 128, 192]),
       outlier=st.booleans())
def test_int8_round_trip_within_half_a_step(seed, rows, cols, outlier):
    w = _weights(seed, rows, cols, outlier)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (rows,), (
        f"int8: q is int8 of w's shape and scale has one value per row, ({rows},): got {q.dtype}, {tuple(scale.shape)}")
    assert torch.allclose(scale, w.abs().amax(1) / 127), (
        f"each row's scale is its own largest magnitude over 127: expected {(w.abs().amax(1) / 127).tolist()[:4]}..., "
        f"got {scale.tolist()[:4]}...")
    back = dequantize_int8(q, scale)
    step = scale[:, None].expand_as(w)
    assert ((back - w).abs() <= step / 2 + 1e-7).all(), _off_by_more_than_half_a_step(
        w, back, step, "q = round(w / scale), clamped to [-127, 127]")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), rows=st.integers(1, 9), cols=st.sampled_from([64, 128, 192]),
       group=st.sampled_from([32, 64]), outlier=st.booleans())
def test_int4_round_trip_within_half_a_step(seed, rows, cols, group, outlier):
    w = _weights(seed, rows, cols, outlier)
    q, scale, zero = quantize_int4(w, group)
    assert int(q.max()) <= 15 and scale.shape == (rows, cols // group) and zero.shape == scale.shape, (
        f"int4, groups of {group}: levels 0..15 and a scale and zero per row and group, ({rows}, {cols // group}): "
        f"levels up to {int(q.max())}, scale {tuple(scale.shape)}, zero {tuple(zero.shape)}")
    packed = pack_int4(q)
    assert packed.shape == (rows, cols // 2), f"two columns a byte: ({rows}, {cols // 2}), got {tuple(packed.shape)}"
    back = dequantize_int4(packed, scale, zero)
    step = scale.repeat_interleave(group, dim=1)
    # half a step, plus a float32 rounding of the range (scale ~ 1e-2, values ~ 1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all(), _off_by_more_than_half_a_step(
        w, back, step, "a group's levels 0..15 span its minimum to its maximum: scale = (max - min) / 15, "
        "q = round((w - min) / scale), packed with column 2j in the low nibble")


def test_int4_groups_beat_one_scale_per_row_with_an_outlier_column():
    w = _weights(0, 16, 256, outlier=True)
    per_group = (dequantize_int4(pack_int4((r := quantize_int4(w, 32))[0]), r[1], r[2]) - w).abs()
    plain = w.clone()
    err_other_cols = per_group[:, 128:].mean()  # far from the outlier's group
    q, s = quantize_int8(plain)                  # per row: the outlier sets the whole row's step
    err_row_scale_4bit = ((torch.round(plain / (s[:, None] * 127 / 7)).clamp(-7, 7)
                           * (s[:, None] * 127 / 7)) - plain).abs()[:, 128:].mean()
    assert err_other_cols < err_row_scale_4bit / 3


def test_int4_packed_layout():
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 3, 12]], dtype=torch.uint8)
    packed = pack_int4(q)
    want = [[1 | 2 << 4, 15], [7 | 8 << 4, 3 | 12 << 4]]
    assert packed.tolist() == want, (f"each row's columns 2j and 2j+1 share a byte, 2j in the low nibble: "
                                     f"{q.tolist()} packs to {want}, got {packed.tolist()}")
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("method,kernel", [(m, k) for m, ks in QuantizedLinear.KERNELS.items() for k in ks])
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_each_cpu_kernel_matches_the_reference(method, kernel, rows):
    if kernel in ("cpu_int8", "cpu_int4", "dequant_sgemm") and not cpu_int8.available():
        pytest.skip(f"{kernel} needs an AVX2 CPU and a C compiler")
    if kernel == "cpu_int8_vnni" and not cpu_int8.vnni_available():
        pytest.skip(NO_VNNI)
    torch.manual_seed(rows)
    w, b = torch.randn(96, 128) * 0.05, torch.randn(96) * 0.1
    layer = QuantizedLinear(w, b, method, 32, kernel=kernel)
    x = torch.randn(rows, 128)
    ref = layer.reference_forward(x)
    assert torch.allclose(ref, torch.nn.functional.linear(x, layer.dequantize(), b))
    # fbgemm also quantizes the activations (7-bit, one scale per call): W8A8, so a wider bound;
    # cpu_int8 rounds each row of x to int16 (15 bits for its largest value), cpu_int8_vnni to
    # two int8 parts (about 15 bits); cpu_int4 to int8 per block of 32 (W4A8: its bound is
    # argued element by element in test_cpu_int4_groups_and_odd_shapes)
    tol = {"fbgemm_w8a8": 0.05, "cpu_int8": 1e-3, "cpu_int8_vnni": 1e-3, "cpu_int4": 2e-2}.get(kernel, 1e-4)
    assert ((layer(x) - ref).norm() / ref.norm()) < tol
    # a bfloat16 layer: every kernel hands back x's dtype (the C ones compute in float32), with
    # the bias, also through kernel_call (phase 7's compiled step)
    half = QuantizedLinear(w.bfloat16(), b.bfloat16(), method, 32, kernel=kernel)
    ref = half.reference_forward(x.bfloat16()).float()
    for y in (half(x.bfloat16()), half.kernel_call()(x.bfloat16())):
        assert y.dtype == torch.bfloat16 and ((y.float() - ref).norm() / ref.norm()) < max(tol, 1e-2)


NO_VNNI = (f"cpu_int8_vnni needs AVX512-VNNI (avx512_vnni, avx512bw and avx512vl in /proc/cpuinfo) and a C "
           f"compiler; this CPU is of the kind {platform.current().kind!r}")
cpu_int8_here = pytest.mark.skipif(not cpu_int8.available(), reason="cpu_int8 needs an AVX2 CPU and a C compiler")
vnni_here = pytest.mark.skipif(not cpu_int8.vnni_available(), reason=NO_VNNI)


@cpu_int8_here
@pytest.mark.parametrize("out_features,in_features", [(7, 40), (13, 2050), (4, 16), (50, 4200)])
def test_cpu_int8_odd_shapes_and_long_rows(out_features, in_features):
    """Output rows not a multiple of 4 (the tail rows), input columns not a multiple of 16 (the
    tail columns), and rows longer than the kernel's 2048-column int32 chunk."""
    torch.manual_seed(in_features)
    w, b = torch.randn(out_features, in_features) * 0.05, torch.randn(out_features)
    layer = QuantizedLinear(w, b, "int8", kernel="cpu_int8")
    x = torch.randn(5, in_features) * 3
    x[2, 1] = 500.0                      # an outlier sets only its own row's int16 scale
    ref = layer.reference_forward(x)
    rel = ((layer(x) - ref).norm(dim=1) / ref.norm(dim=1))
    assert rel.max() < 1e-3
    assert torch.equal(layer(x[3:4]), layer(x)[3:4])  # a row's result does not depend on the others


@cpu_int8_here
@pytest.mark.parametrize("out_features,in_features,group", [(7, 64, 32), (5, 96, 32), (13, 2176, 128)])
def test_cpu_int4_reads_16_bit_scales_on_the_kinds_named(out_features, in_features, group):
    """Where the platform's `int4_f16_scales` rule says, `cpu_int4` (and the C layer table) reads
    a 16-bit copy of the scales and zeros (int4_matmul_f16): on scales that 16 bits hold exactly,
    the very numbers of the float32 entry point; elsewhere the float32 ones."""
    from phases.p07_cuda_graphs.fused import layer_row

    torch.manual_seed(in_features)
    w, x = torch.randn(out_features, in_features) * 0.05, torch.randn(3, in_features)
    out, rows = {}, {}
    for f16 in (False, True):
        with platform.using(platform.current().with_rules(int4_f16_scales=f16)):
            layer = QuantizedLinear(w, None, "int4", group, kernel="cpu_int4")
        layer.scale, layer.zero = layer.scale.half().float(), layer.zero.half().float()
        out[f16], rows[f16] = layer(x), layer_row(layer)
        assert layer.packed("scales")[0].dtype == (torch.float16 if f16 else torch.float32)
    assert torch.equal(out[False], out[True])
    assert rows[False][0] == cpu_int8.AVX2.address("int4_matmul") != rows[True][0]
    assert rows[True][0] == cpu_int8.AVX2.address("int4_matmul_f16")


@cpu_int8_here
@pytest.mark.parametrize("out_features,in_features,group", [(7, 64, 32), (5, 96, 32), (13, 2176, 128),
                                                                (50, 4224, 64)])
def test_cpu_int4_groups_and_odd_shapes(out_features, in_features, group):
    """cpu_int4 (the same C file): every group size, output rows in any number, long rows, a
    row that ends halfway through the kernel's 64-column chunk (96 = 64 + 32).

    The kernel multiplies the rounded weight by x rounded to int8 per block of 32 columns, each
    value moved by at most half its block's step (the block's largest |x| / 127 / 2). So each
    output is within sum_i |w_i| * step_i / 2 of the reference (plus float32's rounding): a
    wrong scale, block or column breaks that bound, the rounding never does."""
    torch.manual_seed(in_features)
    w, b = torch.randn(out_features, in_features) * 0.05, torch.randn(out_features)
    layer = QuantizedLinear(w, b, "int4", group, kernel="cpu_int4")
    x = torch.randn(5, in_features) * 3
    x[2, 1] = 500.0
    ref, wq = layer.reference_forward(x), layer.dequantize().abs()
    step = x.abs().reshape(5, -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(x.shape) / 127
    assert ((layer(x) - ref).abs() <= (step / 2) @ wq.t() + 1e-5 * (x.abs() @ wq.t())).all()
    assert torch.equal(layer(x[3:4]), layer(x)[3:4])


@vnni_here
@pytest.mark.parametrize("out_features,in_features", [(7, 40), (13, 2050), (64, 16), (50, 4201), (130, 576)])
def test_cpu_int8_vnni_odd_shapes_and_exact_integer_sums(out_features, in_features):
    """Output rows not a multiple of 16 or 64 (the masked tail of a panel), input columns not a
    multiple of 4 or 16 (padding), long rows; the rounding of x is the documented one, its sums
    exact: the result equals the two-part formula computed in float64."""
    torch.manual_seed(in_features)
    w, b = torch.randn(out_features, in_features) * 0.05, torch.randn(out_features)
    layer = QuantizedLinear(w, b, "int8", kernel="cpu_int8_vnni")
    assert layer.layout == "vnni" and torch.equal(layer.int8_rows(), quantize_int8(w)[0])
    x = torch.randn(7, in_features) * 3
    x[2, 1] = 500.0                      # an outlier sets only its own row's scale
    ref = layer.reference_forward(x)
    out = layer(x)
    assert ((out - ref).norm(dim=1) / ref.norm(dim=1)).max() < 1e-3
    xs = x.abs().amax(1, keepdim=True) / 127                            # each row's scale
    v = x * (1 / xs)
    coarse = torch.round(v)
    fine = torch.round((v - coarse) * 254)
    q, s = layer.int8_rows().double(), layer.scale.double()
    exact = (coarse.double() @ q.T + (fine.double() @ q.T) / 254) * xs.double() * s + b.double()
    assert torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    for rows in (slice(3, 4), slice(0, 2), slice(1, 6)):  # a row's result does not depend on the others
        assert torch.equal(layer(x[rows]), out[rows])


def test_int8_weight_is_stored_in_its_kernels_layout(monkeypatch):
    """auto on a VNNI CPU stores the panels cpu_vnni.c reads (no second copy); elsewhere, or
    with another kernel asked for, the rows. Either way int8_rows() gives quantize_int8's rows,
    and every kernel still runs on a layer stored for another."""
    torch.manual_seed(0)
    w = torch.randn(70, 96) * 0.05
    auto = QuantizedLinear(w, None, "int8")
    assert auto.layout == ("vnni" if cpu_int8.vnni_available() else "rows")
    assert torch.equal(auto.int8_rows(), quantize_int8(w)[0])
    assert QuantizedLinear(w, None, "int8", kernel="reference").layout == "rows"
    x = torch.randn(3, 96)
    for kernel in ("reference", "fbgemm_w8a8") + (("cpu_int8",) if cpu_int8.available() else ()):
        monkeypatch.setattr(auto, "kernel", kernel)
        torch.testing.assert_close(auto(x), auto.reference_forward(x), rtol=0.05, atol=0.05)
    fused = QuantizedLinear.from_quantized(torch.cat([auto.int8_rows()] * 2), torch.cat([auto.scale] * 2),
                                           None, None, "int8")
    assert fused.layout == auto.layout and fused.out_features == 140
    torch.testing.assert_close(fused(x), torch.cat([auto.reference_forward(x)] * 2, dim=1), rtol=1e-3, atol=1e-3)


def test_the_kernel_chosen_follows_the_cpu_kind_and_a_failed_build_falls_back(monkeypatch, tmp_path):
    from phases.p05_quantization.quant import fbgemm_available

    layer = QuantizedLinear(torch.randn(8, 32), None, "int8")
    int4 = QuantizedLinear(torch.randn(8, 32), None, "int4", 32)
    fallback = "fbgemm_w8a8" if fbgemm_available() else "int8pack_mm"   # at one row
    kind = platform.current().kind
    if kind in ("avx512_vnni", "amx") and cpu_int8.vnni_available():
        assert layer.choose_kernel(1) == layer.choose_kernel(512) == "cpu_int8_vnni"
    elif kind in ("avx2", "avx512_vnni", "amx") and cpu_int8.available():
        assert layer.choose_kernel(1) == layer.choose_kernel(512) == "cpu_int8"
    else:
        assert layer.choose_kernel(1) == fallback
    if cpu_int8.available():
        many = platform.current().rule("int4_dequant_from_rows")   # 64 on avx2; never on a kind not measured
        assert int4.choose_kernel(1) == int4.choose_kernel((many or 64) - 1) == "cpu_int4"
        assert int4.choose_kernel(many or 64) == ("dequant_sgemm" if many else "cpu_int4")
    monkeypatch.setenv("CC", "false")    # a compiler that always fails
    for lib in (cpu_int8.AVX2, cpu_int8.VNNI):
        with pytest.raises(subprocess.CalledProcessError):
            lib.build(tmp_path)
        assert list(tmp_path.iterdir()) == []  # no half-written library left behind
        monkeypatch.setattr(lib, "lib", None)
        monkeypatch.setattr(lib, "tried", False)
        monkeypatch.setattr(lib, "build", lambda build=lib.build: build(tmp_path))
        with pytest.warns(UserWarning, match=f"could not build {lib.source.name}") if lib.supported() else nullcontext():
            assert not lib.available()
    layer = QuantizedLinear(torch.randn(8, 32), None, "int8")
    assert layer.layout == "rows" and layer.choose_kernel(1) == fallback
    with pytest.raises(ValueError, match="kernel='cpu_int8'"):
        QuantizedLinear(torch.randn(8, 32), None, "int8", kernel="cpu_int8")
    with pytest.raises(ValueError, match="kernel='cpu_int8_vnni'"):
        QuantizedLinear(torch.randn(8, 32), None, "int8", kernel="cpu_int8_vnni")


def test_quantized_linear_keeps_no_float_weight():
    layer = QuantizedLinear(torch.randn(64, 128), None, "int4", 64)
    assert all(not t.is_floating_point() or t.numel() < 64 * 128 // 8
               for t in (*layer.buffers(), *layer.parameters()))
    assert layer.weight_bytes() < 64 * 128 * 4 / 6


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), fmt=st.sampled_from(sorted(KV_CACHE_DTYPES)))
def test_kv_round_trip(seed, fmt):
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(seed))
    q, scale = quantize_kv(x, fmt)
    err = (dequantize_kv(q, scale, torch.float32) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    # int8: half a step of max/127; e4m3: 3 mantissa bits, relative 2^-4 of the value, at most
    bound = amax / 254 if fmt == "int8" else x.abs() / 16 + amax / 448 * 2 ** -6
    assert (err <= bound + 1e-6).all()


def test_quantized_kv_cache_write_and_gather(tiny_model_dir):
    from tinyvllm.config import ModelConfig
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    cache = QuantizedKVCache(cfg, 4, 8, torch.float32, torch.device("cpu"), "int8")
    k, v = torch.randn(3, cfg.num_key_value_heads, cfg.head_dim), torch.randn(3, cfg.num_key_value_heads, cfg.head_dim)
    slots = torch.tensor([9, 10, 30])  # block 1 offsets 1, 2; block 3 offset 6
    cache.write(1, slots, k, v)
    kg, vg = cache.gather(1, torch.tensor([3, 1]))
    assert torch.allclose(kg[1, 1], k[0], atol=k.abs().max() / 200)
    assert torch.allclose(vg[0, 6], v[2], atol=v.abs().max() / 200)
    assert kg[0, 0].abs().sum() == 0


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from Linux's /proc")
def test_quantized_cpu_kv_pool_is_resident_only_where_written():
    """Phase 2's pool of zero pages (kv_cache.zeros) holds the 8-bit values and their scales too:
    about 128 MiB of pool add no resident memory until written."""
    model = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2, head_dim=64)
    before = resident_bytes()
    cache = QuantizedKVCache(model, 8192, 16, torch.float32, torch.device("cpu"), "int8")
    assert cache.kv.numel() == 128 << 20 and resident_bytes() - before < 16 << 20
    assert not cache.kv.any() and not cache.scales.any()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_kv_write_stores_values_and_scales_in_their_slots(fmt):
    """Token i's quantized K and V, and their scales (one per KV head), land in slot
    slot_mapping[i] of the layer written; fp8 is stored as its bytes; nothing else changes."""
    model = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=8)
    cache = QuantizedKVCache(model, 3, 4, torch.float32, torch.device("cpu"), fmt)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g) * 5
    slots = [6, 0, 11, 3]  # out of order, in every block
    cache.write(1, torch.tensor(slots), k, v)
    stored_as = KV_CACHE_DTYPES[fmt][0]
    for which, x in ((0, k), (1, v)):
        q, scale = quantize_kv(x, fmt)
        values = cache.kv[1, which].view(-1, 2, 8)
        scales = cache.scales[1, which].view(-1, 2)
        other = quantize_kv(v if which == 0 else k, fmt)[0]
        for i, slot in enumerate(slots):
            name = f"token {i}'s {'KV'[which]}, slot {slot} (block {slot // 4}, offset {slot % 4})"
            stored = values[slot].view(stored_as).float()
            assert torch.equal(stored, q[i].float()), (
                f"{name}: the stored values are not quantize_kv's"
                + (f" (they are the {'VK'[which]} of the token)" if torch.equal(stored, other[i].float()) else "")
                + (" (fp8 is stored as its bytes: q.view(cache.kv.dtype))" if fmt != "int8" else ""))
            assert torch.equal(scales[slot], scale[i]), f"{name}: the stored scales are not quantize_kv's"
        others = torch.ones(12, dtype=torch.bool)
        others[slots] = False
        assert not values[others].any() and not scales[others].any(), "a slot no new token maps to changed"
    assert not cache.kv[0].any() and not cache.scales[0].any(), "layer 0 changed: write only layer_idx"


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_same_memory_holds_more_blocks_and_admits_more_sequences(tiny_model_dir, fmt):
    budget = 64 * 1024
    plain = LLM(str(tiny_model_dir), phase=5, kv_cache_memory=budget, block_size=8, max_num_seqs=64)
    quant = LLM(str(tiny_model_dir), phase=5, kv_cache_memory=budget, block_size=8, max_num_seqs=64,
                kv_cache_dtype=fmt)
    pe, qe = plain.llm_engine, quant.llm_engine
    cfg = pe.model_config
    assert qe.kv_cache.num_blocks == budget // quantized_bytes_per_block(cfg, 8)
    assert qe.kv_cache.num_blocks >= 3 * pe.kv_cache.num_blocks
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    running = {}
    for name, llm in (("auto", plain), (fmt, quant)):
        e = llm.llm_engine
        for i in range(40):
            e.add_request(str(i), {"prompt_token_ids": [3 + i, 5, 7, 9, 11, 13, 15]}, params)
        e.step()
        running[name] = len(e.scheduler.running)
        while e.has_unfinished_requests():
            e.step()
    assert running[fmt] >= 2 * running["auto"]


# relative error of the logits against float with the *same rounded weights*: the kernels the
# engine picks round only the activations, per row (cpu_int8: int16, measured 1.6e-4;
# cpu_int8_vnni: two int8 parts, about as fine; fbgemm where none is built: two 7-bit parts,
# wider) or per block of 32 (cpu_int4: int8, measured 1.8e-2 here, where the int4 weights' own
# rounding moves the same logits by 0.34); a quantized KV cache against plain float weights. A
# wrong scale, layout or block gives errors of order 1.
INT8_BOUND = 1e-3 if cpu_int8.available() or cpu_int8.vnni_available() else 0.15


@pytest.mark.parametrize("quantization,kv,bound,dtype", [
    ("int8", "auto", INT8_BOUND, "float32"), ("int4", "auto", 0.05, "float32"), (None, "int8", 0.05, "float32"),
    (None, "fp8", 0.15, "float32"),
    # a bfloat16 model: the C kernels compute in float32 and hand back bfloat16 (bfloat16's own
    # rounding, 8 bits, sets the bound; without them fbgemm's 7-bit activations do)
    ("int8", "auto", max(0.02, INT8_BOUND), "bfloat16"), ("int4", "auto", 0.05, "bfloat16")])
def test_engine_logits_match_float_with_the_rounded_weights(tiny_model_dir, make_llm, quantization, kv, bound, dtype):
    ref = LLM(str(tiny_model_dir), phase=5, dtype=dtype)
    if quantization:  # each layer rounded as the engine rounds it (the LM head: HEAD_METHOD)
        for name, m in linear_layers(ref.llm_engine.model):
            method = HEAD_METHOD.get(quantization, quantization) if name == "lm_head" else quantization
            m.weight.data = QuantizedLinear(m.weight, None, method, 32).dequantize()
    llm = make_llm(tiny_model_dir, 5, quantization=quantization, quantization_group_size=32, kv_cache_dtype=kv,
                   dtype=dtype)
    if quantization:
        formats = {name: m.method for name, m in llm.llm_engine.model.named_modules() if isinstance(m, QuantizedLinear)}
        assert formats.pop("lm_head") == HEAD_METHOD.get(quantization, quantization)
        assert set(formats.values()) == {quantization}
    ids = torch.tensor(PROMPTS[0]["prompt_token_ids"])

    def logits(engine):
        captured = []
        orig = engine.sampler.sample
        engine.sampler.sample = lambda out: (captured.append(out.logits.clone()), orig(out))[1]
        try:
            engine.add_request("x", {"prompt_token_ids": ids.tolist()}, SamplingParams(temperature=0, max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
        finally:
            del engine.sampler.sample
        return torch.cat(captured)

    a, b = logits(ref.llm_engine), logits(llm.llm_engine)
    assert ((a - b).norm() / a.norm()) < bound
    e = llm.llm_engine
    if quantization:
        assert not linear_layers(e.model)
        assert sum(isinstance(m, QuantizedLinear) for m in e.model.modules()) == 7 * 2 + 1


def test_engine_weight_bytes_shrink(tiny_model_dir, make_llm):
    sizes = {q: make_llm(tiny_model_dir, 5, quantization=q, quantization_group_size=32).llm_engine.get_stats()["weight_bytes"]
             for q in (None, "int8", "int4")}
    assert sizes["int4"] < sizes["int8"] < sizes[None] * 0.5


def test_bad_input_is_refused_and_an_earlier_llm_keeps_generating(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, 5, quantization="int8")
    before = llm.generate(PROMPTS, GREEDY)
    with pytest.raises(ValueError, match="quantization_group_size=128 does not divide"):
        LLM(str(tiny_model_dir), phase=5, quantization="int4", quantization_group_size=128)
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(tiny_model_dir), phase=5, quantization="int3")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(tiny_model_dir), phase=5, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="no linear layers"):
        quantize_model(torch.nn.Sequential(torch.nn.ReLU()), "int8")
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 8))  # 8 columns: no group of 32
    with pytest.raises(ValueError, match="quantization_group_size=32 does not divide the input size 8 of layer 1"):
        quantize_model(model, "int4", 32)
    assert isinstance(model[0], torch.nn.Linear)  # checked before anything was changed
    after = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


@pytest.mark.slow
def test_default_model_int8_greedy_agrees_with_float(default_model_dir, make_llm):
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    params = SamplingParams(temperature=0, max_tokens=16)
    ref = make_llm(default_model_dir, 5).generate(prompts, params)
    out = make_llm(default_model_dir, 5, quantization="int8").generate(prompts, params)
    agree = [sum(a == b for a, b in zip(r.outputs[0].token_ids, o.outputs[0].token_ids)) / len(r.outputs[0].token_ids)
             for r, o in zip(ref, out)]
    assert sum(agree) / len(agree) >= 0.5  # stated threshold: half the greedy tokens, position by position


@pytest.mark.parametrize("bias", [False, True])
def test_fbgemm_two_parts_keep_precision_beside_an_outlier_channel(bias):
    """A hidden state with one huge channel sets fbgemm's single activation scale; x sent as a
    coarse and a fine int8 part keeps the rest's precision (one scale alone: > 2% error)."""
    torch.manual_seed(0)
    layer = QuantizedLinear(torch.randn(64, 128) * 0.05, torch.randn(64) if bias else None, "int8",
                            kernel="fbgemm_w8a8")
    x = torch.randn(4, 128) * 0.5
    x[:, 7] = 60.0
    ref = layer.reference_forward(x)
    plain = torch.ops.quantized.linear_dynamic(x, layer.packed("fbgemm_w8a8"), True)  # one scale for all
    if bias:
        plain = plain + layer.bias  # the packed weight holds no bias
    err = lambda y: ((y - ref).norm() / ref.norm()).item()
    assert err(layer(x)) < 0.002 and err(plain) > 0.02
    # a token far larger than the others (a sequence's first token often is) does not set the
    # other tokens' step: each row has its own scale
    x = torch.randn(4, 128) * 0.5
    x[0] *= 500.0
    out, ref = layer(x), layer.reference_forward(x)
    row_err = ((out - ref).norm(dim=1) / ref.norm(dim=1)).max().item()
    assert row_err < 0.002


def test_int4_group_size_defaults_to_128_where_it_fits_else_32(tiny_model_dir):
    from torch import nn

    from phases.p05_quantization.quantize_layers import default_group_size

    # the default model: hidden 576 = 4.5 x 128, MLP 1536: 128 does not divide 576, so 32 (the
    # most accurate offered; 64 would also divide, and loses 32% of perplexity on that model)
    assert default_group_size(nn.Sequential(nn.Linear(576, 1536), nn.Linear(1536, 576))) == 32
    assert default_group_size(nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))) == 128
    with pytest.raises(ValueError, match="quantization_group_size"):
        default_group_size(nn.Sequential(nn.Linear(48, 64)))
    model = LLM(str(tiny_model_dir), phase=5, quantization="int4").llm_engine.model  # no group size asked
    assert {m.group_size for m in model.modules() if hasattr(m, "group_size")} == {32}  # tiny: inputs 64, 128


def test_step_parts_times_every_way(tiny_model_dir, capsys):
    from phases.p05_quantization import quant
    from phases.p05_quantization.tools import step_parts

    chosen = quant.QuantizedLinear.choose_kernel
    step_parts.main(["--model", str(tiny_model_dir), "--steps", "2"])
    out = capsys.readouterr().out
    ways = (["none", "fbgemm_one_part", "fbgemm_w8a8"] + (["calls", "cpu_int8"] if cpu_int8.available() else [])
            + (["cpu_int8_vnni"] if cpu_int8.vnni_available() else []))
    assert [line.split()[0] for line in out.splitlines()[1:]] == ways
    assert quant.QuantizedLinear.choose_kernel is chosen and "_step_parts" not in quant.KERNEL_FNS


@pytest.mark.skipif(not LOSSLESS.available(), reason="cpu_lossless.c needs AVX2 and a C compiler")
def test_fetch_ahead_times_a_pass_at_each_distance(tiny_codes_dir, platform_rules, capsys):
    """The tool behind the `codes_fetch_ahead` rule: a pass over every weight on codes, for each
    distance and row count asked."""
    from phases.p05_quantization.tools import fetch_ahead

    platform_rules(codes_max_rows=8)
    fetch_ahead.main(["--model", str(tiny_codes_dir), "--ahead", "0", "2048", "--rows", "1", "3", "--repeat", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert "bits [4, 8]" in lines[0] and lines[1].split() == ["rows", "ahead", "1024", "ahead", "2048"]
    assert [line.split()[0] for line in lines[2:]] == ["1", "3"] and all(len(line.split()) == 5 for line in lines[2:])


@cpu_int8_here
def test_bench_kernels_times_a_decode_step(monkeypatch, capsys):
    """The tool's --step mode: every product of a step with its own weights, per kernel that runs
    here (shapes made small for the test)."""
    from phases.p05_quantization.tools import bench_kernels

    monkeypatch.setattr(bench_kernels, "STEP_SHAPES", [(96, 64), (64, 128)] * 2)
    bench_kernels.main(["--step", "int4", "--rows", "1", "--repeat", "1", "--group-size", "32"])
    out = capsys.readouterr().out
    assert "a decode step's 4 products, int4, 1 rows: cpu_int4 " in out and "reference" not in out


@cpu_int8_here
def test_bench_kernels_multiplies_in_bfloat16_as_dtype_auto_does(monkeypatch, capsys):
    """--bf16-rows: `dequant_sgemm` multiplies in bfloat16 (its error against the reference path
    is bfloat16's, where without the flag it is float32's)."""
    from phases.p05_quantization.tools import bench_kernels

    monkeypatch.setitem(bench_kernels.SHAPES, "k_proj/v_proj", (64, 128))
    errors = {}
    for rows in ("0", "1"):
        bench_kernels.main(["--rows", "16", "--repeat", "1", "--group-size", "32", "--kernels", "dequant_sgemm",
                            "--shapes", "k_proj/v_proj", "--bf16-rows", rows])
        out = capsys.readouterr().out
        errors[rows] = float(out.split("int4:dequant_sgemm")[1].split("(err ")[1].split(")")[0])
    assert errors["0"] < 1e-5 < 1e-3 < errors["1"]


@pytest.mark.parametrize("method,kernel", [("int4", "auto"), ("int8", "auto"), ("int4", "reference")])
def test_kernel_call_gives_forward_s_result(method, kernel):
    """`kernel_call`: the layer's product with its kernel chosen once (what phase 7's compiled
    graph calls), the same numbers as `forward` at any row count; a kernel chosen by the number
    of rows is `forward` itself."""
    torch.manual_seed(3)
    layer = QuantizedLinear(torch.randn(40, 64) * 0.05, torch.randn(40), method, 32, kernel=kernel)
    call = layer.kernel_call()
    for rows in (1, 5):
        x = torch.randn(rows, 64)
        assert torch.equal(call(x), layer(x))
    assert (call == layer.forward) == (not layer.choose_kernel(1).startswith("cpu_"))


@cpu_int8_here
def test_many_rows_switch_to_dequant_sgemm_also_in_kernel_call(monkeypatch, platform_rules):
    """From `dequant_from_rows()` rows on, "auto" (and the callable phase 7's graph runs) takes
    `dequant_sgemm`; below, the integer loop, and so does a layer larger than
    `DEQUANT_MAX_WEIGHTS` at any row count. The two round x differently, so the results tell
    them apart."""
    from phases.p05_quantization import quant

    torch.manual_seed(6)
    platform_rules(int4_dequant_from_rows=4)
    layer = QuantizedLinear(torch.randn(24, 64) * 0.05, None, "int4", 32)
    call = layer.kernel_call()
    few, many = torch.randn(3, 64), torch.randn(4, 64)
    loop = QuantizedLinear.from_quantized(layer.qweight, layer.scale, layer.zero, None, "int4", 32, kernel="cpu_int4")
    assert layer.choose_kernel(3) == "cpu_int4" and layer.choose_kernel(4) == "dequant_sgemm"
    assert torch.equal(call(few), loop(few)) and torch.equal(call(many), layer(many))
    assert not torch.equal(call(many), loop(many))
    monkeypatch.setattr(quant, "DEQUANT_MAX_WEIGHTS", 24 * 64 - 1)   # a layer as large as the LM head
    assert layer.choose_kernel(4) == "cpu_int4" and torch.equal(layer.kernel_call()(many), loop(many))


@cpu_int8_here
def test_int4_many_rows_in_bfloat16_where_dtype_auto_chose_them():
    """With `bf16_rows` (dtype="auto"'s bfloat16 products, `use_bfloat16_products`) int4's
    `dequant_sgemm` takes over from there or from 32 rows, whichever is more, the unpacked weight
    and x rounded to bfloat16: near the float32 product of the same weight, not equal to it;
    below, the integer loop."""
    torch.manual_seed(7)
    layer = QuantizedLinear(torch.randn(48, 64) * 0.05, torch.randn(48) * 0.1, "int4", 32)
    x = torch.randn(40, 64)
    loop, f32 = layer(x), torch.nn.functional.linear(x, layer.dequantize(), layer.bias)
    layer.bf16_rows = 13
    assert layer.dequant_from_rows() == 32 and layer.choose_kernel(31) == "cpu_int4"
    layer.bf16_rows = 40
    assert layer.choose_kernel(39) == "cpu_int4" and layer.choose_kernel(40) == "dequant_sgemm"
    assert torch.equal(layer(x[:39]), loop[:39]) and torch.equal(layer.kernel_call()(x[:39]), loop[:39])
    y = layer(x)
    assert y.dtype == torch.float32 and not torch.equal(y, f32) and torch.equal(layer.kernel_call()(x), y)
    torch.testing.assert_close(y, f32, rtol=0.02, atol=0.02)


@cpu_int8_here
@pytest.mark.parametrize("out_features,in_features,group", [(7, 64, 32), (5, 96, 32), (13, 2176, 128), (9, 192, 64)])
def test_int4_dequant_in_float32_and_bfloat16(out_features, in_features, group):
    """cpu_int8.c unpacks int4 for `dequant_sgemm` 16 values at a time: in float32 the reference
    dequantization (up to the rounding of a fused multiply-add), and in bfloat16 (one pass, for
    bfloat16 products) the very bits of rounding that float32 weight with PyTorch (to nearest,
    ties to even)."""
    torch.manual_seed(in_features)
    layer = QuantizedLinear(torch.randn(out_features, in_features) * 0.05, None, "int4", group)
    args = (layer.qweight, layer.scale, layer.zero, group)
    w = cpu_int8.int4_dequant(*args).clone()
    torch.testing.assert_close(w, layer.dequantize(), rtol=1e-6, atol=1e-7)
    w16 = cpu_int8.int4_dequant(*args, torch.bfloat16)
    assert w16.dtype == torch.bfloat16 and torch.equal(w16, w.bfloat16())
    # every value 1 * scale + 0, each scale halfway between two bfloat16 numbers: ties to even
    halfway = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8)])
    groups = in_features // group
    scale = halfway[torch.arange(out_features * groups) % 3].reshape(out_features, groups)
    args = (torch.full_like(layer.qweight, 0x11), scale, torch.zeros_like(scale), group)
    assert torch.equal(cpu_int8.int4_dequant(*args, torch.bfloat16), cpu_int8.int4_dequant(*args).bfloat16())


@cpu_int8_here
def test_batch_invariant_keeps_the_integer_loop_at_every_row_count(tiny_model_dir, platform_rules):
    """batch_invariant=True with int4: a prompt long enough for `dequant_sgemm` (here from 8 rows)
    still gets, as a prefill, the bits its tokens got as decodes."""
    platform_rules(int4_dequant_from_rows=8)
    llm = LLM(str(tiny_model_dir), phase=5, quantization="int4", batch_invariant=True)
    kernels = {n: m.kernel for n, m in llm.llm_engine.model.named_modules() if isinstance(m, QuantizedLinear)}
    head = "cpu_int8_vnni" if cpu_int8.vnni_available() else "cpu_int8"            # the head: 8 bits
    assert kernels.pop("lm_head") == head and set(kernels.values()) == {"cpu_int4"}
    prompt = [5, 17, 99, 3, 42, 7, 8, 61, 2]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    decoded = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
    again = llm.generate({"prompt_token_ids": prompt + out.token_ids},
                         SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert decoded == [again.prompt_logprobs[len(prompt) + i][t].logprob for i, t in enumerate(out.token_ids)]


# -- a float32 checkpoint whose weights lie on codes (lossless.py) ------------------------------

def _linear(w: torch.Tensor, bias: torch.Tensor | None = None) -> CpuLinear:
    layer = CpuLinear(w.shape[1], w.shape[0], bias=bias is not None).requires_grad_(False)
    layer.weight.data = w
    if bias is not None:
        layer.bias.data = bias
    return layer


needs_lossless = pytest.mark.skipif(not LOSSLESS.available(), reason="cpu_lossless.c needs AVX2 and a C compiler")


@needs_lossless
@pytest.mark.parametrize("bits", [4, 8])
def test_lossless_codes_give_back_every_weight_bit_for_bit(bits, platform_rules):
    """The codes found rebuild every weight exactly: through the kernel, x one-hot rows give back
    the weight's columns bit for bit. A weight one float step off its grid, or random weights,
    have none."""
    platform_rules(codes_max_rows=8)
    w = on_codes(_weights(0, 40, 96, True), bits)
    codes, scale, zero = lossless_codes(w)
    assert (zero is not None) == (bits == 4) and codes.numel() == w.numel() * bits // 8 and scale.shape == (40, 3)
    layer = LosslessLinear(_linear(w), codes, scale, zero)
    eye = torch.eye(96)
    columns = torch.cat([layer(eye[j:j + 8]) for j in range(0, 96, 8)])   # (96, 40)
    assert torch.equal(columns.T, w)
    off = w.clone()
    off[3, 5] = torch.nextafter(off[3, 5], torch.tensor(1.0))
    assert lossless_codes(off) is None and lossless_codes(_weights(0, 40, 96, True)) is None


@needs_lossless
def test_narrower_signed_codes_are_found_on_8_bits(platform_rules):
    """A block of 5-bit signed codes (GGUF Q5_0's d * (q - 16), q in 0..31: the type llama.cpp
    writes a Q4_K_M file's rows of 576 in) is read on 8 bits: its scale is d, though its largest
    magnitude is 16 d (or 15 d, or less), not 127 d; every weight comes back bit for bit."""
    platform_rules(codes_max_rows=8)
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-16, 16, (24, 96), generator=g).float()
    q[:4, :32] = q[:4, :32].clamp(-9, 9)                              # blocks whose top code is 9
    d = (torch.rand(24, 3, 1, generator=g) * 1e-2 + 1e-3).half().float().expand(24, 3, 32).reshape(24, 96)
    w = q * d
    codes, scale, zero = lossless_codes(w)
    assert zero is None and codes.dtype == torch.int8 and torch.equal(scale, d[:, ::32])
    layer = LosslessLinear(_linear(w), codes, scale, zero)
    eye = torch.eye(96)
    assert torch.equal(torch.cat([layer(eye[j:j + 8]) for j in range(0, 96, 8)]).T, w)


@needs_lossless
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_codes_with_a_scale_per_16_columns(rows, platform_rules):
    """GGUF Q6_K's groups: 6-bit signed codes, a scale per 16 columns (d * sc_j, sc_j a signed
    byte): found as int8 codes with a scale per 16 ("6 bits"), every weight given back bit for
    bit through the kernel, and its product the float32 one up to the order of the sums."""
    platform_rules(codes_max_rows=8)
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-32, 32, (40, 128), generator=g).float()
    sc = torch.randint(-128, 128, (40, 8, 1), generator=g).float()
    sc[0, 0] = 0                                                         # a group of zeros
    d = (torch.rand(40, 1, 1, generator=g) * 1e-4 + 1e-5).half().float()
    w = (d * sc).expand(40, 8, 16).reshape(40, 128) * q
    codes, scale, zero = lossless_codes(w)
    layer = LosslessLinear(_linear(w), codes, scale, zero)
    assert layer.bits == 6 and zero is None and scale.shape == (40, 8) and codes.dtype == torch.int8
    eye = torch.eye(128)
    assert torch.equal(torch.cat([layer(eye[j:j + 8]) for j in range(0, 128, 8)]).T, w)
    x = torch.randn(rows, 128)
    torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-5, atol=1e-6)


@needs_lossless
@pytest.mark.parametrize("bits", [4, 8, 6])
def test_codes_fetched_from_farther_ahead_change_no_number(bits, monkeypatch):
    """CODES_AHEAD (how far ahead cpu_lossless.c asks for the codes, the platform's
    `codes_fetch_ahead` rule, a number of bytes) only changes when memory is read: the kernel
    built with another distance is another library and gives the same outputs bit for bit, for
    1 to 6 rows, over rows longer than the distance and a last one shorter."""
    assert LOSSLESS.defines == {"CODES_AHEAD": "codes_fetch_ahead"}
    ours = platform.current().rule("codes_fetch_ahead")
    g = torch.Generator().manual_seed(7)
    if bits == 6:                                  # Q6_K's: d * sc_j * q, a scale per 16 columns
        sc = torch.randint(-128, 128, (37, 256, 1), generator=g).float() * 2e-4
        w = sc.half().float().expand(37, 256, 16).reshape(37, 4096) * torch.randint(-32, 32, (37, 4096), generator=g)
    else:
        w = on_codes(torch.randn(37, 4096, generator=g) * 0.05, bits)
    codes = lossless_codes(w)
    assert codes is not None
    layer = LosslessLinear(_linear(w), *codes)
    layer.max_rows = 8
    assert layer.bits == bits
    xs = [torch.randn(rows, w.shape[1], generator=g) for rows in range(1, 7)]
    outs = [layer(x) for x in xs]
    names = {LOSSLESS.load()._name}
    for other in (2048 if ours != 2048 else 8192, 16384):
        farther = CKernel(LOSSLESS.source, LOSSLESS.flags, LOSSLESS.needs, LOSSLESS.signatures,
                          defines=LOSSLESS.defines)
        with platform.using(platform.current().with_rules(codes_fetch_ahead=other)):
            lib = farther.load()                                         # built with -DCODES_AHEAD=other
        assert lib is not None and lib._name not in names                # the distance reached the compiler
        names.add(lib._name)
        monkeypatch.setattr(LOSSLESS, "lib", lib)
        assert all(torch.equal(layer(x), y) for x, y in zip(xs, outs))
        monkeypatch.undo()


@needs_lossless
def test_lossless_codes_round_once_as_a_fused_multiply_add(platform_rules):
    """4-bit weights are `q * s + m` rounded once (a GGUF reader's, whose q * s is exact): with
    scales of 24 significant bits, where rounding q * s first would move some weights, the codes
    are found and the kernel's one multiply-add gives every weight back bit for bit."""
    platform_rules(codes_max_rows=8)
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (24, 64), generator=g).double()
    q[:, ::32], q[:, 1::32] = 0, 15                                   # each block spans 0..15
    s = (torch.rand(24, 2, 1, generator=g) * 0.01 + 0.005).expand(24, 2, 32).reshape(24, 64)
    m = (torch.rand(24, 2, 1, generator=g) * -0.05).expand(24, 2, 32).reshape(24, 64)
    once = (q * s.float().double() + m.float().double()).float()      # exact in float64, rounded once
    twice = (q.float() * s.float()) + m.float()
    assert not torch.equal(once, twice)                               # the two roundings differ here
    codes, scale, zero = lossless_codes(once)
    layer = LosslessLinear(_linear(once), codes, scale, zero)
    eye = torch.eye(64)
    assert torch.equal(torch.cat([layer(eye[j:j + 8]) for j in range(0, 64, 8)]).T, once)


@needs_lossless
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9])
def test_lossless_linear_is_the_float32_product_read_from_its_codes(rows, platform_rules):
    """Up to max_rows rows the product reads the codes (changing them changes it), from there on
    the float weight; either way it is the float32 product up to the order of its sums."""
    platform_rules(codes_max_rows=8)
    w = on_codes(_weights(1, 70, 160, True), 4)           # 70 output rows: not a multiple of 4
    plain = _linear(w, torch.randn(70))
    layer = lossless(plain)
    assert type(layer) is LosslessLinear and layer.weight is plain.weight and layer.bits == 4
    x = torch.randn(rows, 160)
    ref = F.linear(x.double(), w.double(), plain.bias.double())
    y = layer(x)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    layer.codes.zero_()
    assert torch.equal(layer(x), y) == (rows > 8)


@needs_lossless
def test_lossless_codes_stop_where_bfloat16_products_start(platform_rules):
    """With dtype="auto"'s bfloat16 products from `bf16_rows` rows, the codes serve up to one row
    fewer (`Linear.own_rows`), below `max_rows` too: from there on the layer's product is the
    bfloat16 one its float32 weight gives."""
    from phases.p04_triton_kernels import onednn_matmul

    if not platform.current().onednn:
        pytest.skip("bfloat16 products run in oneDNN, which this kind does not use")
    platform_rules(codes_max_rows=8)
    layer = lossless(_linear(on_codes(_weights(1, 70, 160, True), 4), torch.randn(70)))
    layer.bf16_rows = 5
    assert layer.own_rows(layer.max_rows) == 4
    for rows in (1, 4, 5, 8):
        x = torch.randn(rows, 160)
        assert torch.equal(layer(x), onednn_matmul(x, layer.weight, layer.bias, 5)) == (rows >= 5)


@needs_lossless
def test_engine_reads_a_checkpoint_on_codes_from_them_with_float32_s_tokens(tiny_codes_dir, platform_rules):
    """Without `quantization`, where the platform's `codes_max_rows` rule says, every layer of a checkpoint
    on codes becomes a LosslessLinear (the head on 8 bits); its logits are the float32 engine's up
    to rounding, its greedy tokens the same. `quantization` replaces the weights instead."""
    platform_rules(codes_max_rows=8)
    llm = LLM(str(tiny_codes_dir), phase=5)
    bits = {name: m.bits for name, m in llm.llm_engine.model.named_modules() if type(m) is LosslessLinear}
    assert len(bits) == 7 * 2 + 1 and bits.pop("lm_head") == 8 and set(bits.values()) == {4}
    platform_rules(codes_max_rows=0)
    float32 = LLM(str(tiny_codes_dir), phase=5)
    assert not any(type(m) is LosslessLinear for m in float32.llm_engine.model.modules())
    out, ref = (e.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1))
                for e in (llm, float32))
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    for o, r in zip(out, ref):
        got, want = ([lp[t].logprob for t, lp in zip(c.outputs[0].token_ids, c.outputs[0].logprobs)] for c in (o, r))
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    quantized = LLM(str(tiny_codes_dir), phase=5, quantization="int8")
    assert not any(type(m) is LosslessLinear for m in quantized.llm_engine.model.modules())


@pytest.mark.parametrize("fault", sorted(BAD_STEPS))
def test_checked_quantized_attention_refuses_a_slip(fault, bad_step):
    """The int8 KV cache's attention writes each token's 8-bit K/V and scales to its slot and
    gathers the blocks the tables list: in checked mode a step that points outside the pool or
    into another sequence is refused before it writes or reads."""
    from phases.p05_quantization.kv_quant import QuantizedPagedAttention

    cache, meta, q, k, v, pattern = bad_step(fault, QuantizedKVCache, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match=rf"^QuantizedPagedAttention: .*{pattern}"):
        QuantizedPagedAttention(cache, meta)(0, q, k, v)


@pytest.mark.parametrize("method,slip,match", [
    ("int4", ("pack_int4", lambda q: q), r"int4 weight of 8 x 64 is stored as torch.uint8 \(8, 32\).*got torch.uint8 \(8, 64\)"),
    ("int4", ("quantize_int4", lambda w, g: (torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 2, 1),
                                             torch.zeros(8, 2, 1))), r"scales \(8, 2\), got .* scales torch.float32 \(8, 2, 1\)"),
    ("int8", ("quantize_int8", lambda w: (torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 1))),
     r"int8 weight of 8 x 64 is stored as torch.int8 \(8, 64\) with float32 scales \(8,\)"),
    ("int8", ("quantize_int8", lambda w: (torch.zeros(8, 64, dtype=torch.int32), torch.ones(8))), r"got torch.int32"),
])
def test_a_quantized_weight_in_another_layout_is_refused(method, slip, match, monkeypatch):
    """The C products read a quantized weight by its shape and dtype alone: one in another layout
    (a slip in quantize_int8, quantize_int4 or pack_int4) is refused when the layer is made, not
    read past its end at the first product."""
    from phases.p05_quantization import quant

    monkeypatch.setattr(quant, *slip)
    with pytest.raises(ValueError, match=match):
        QuantizedLinear(torch.randn(8, 64), None, method, group_size=32)
