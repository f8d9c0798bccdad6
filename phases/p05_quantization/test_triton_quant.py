"""The Triton int8/int4 kernels against the reference path: on a CPU through Triton's interpreter
(in a subprocess, so TRITON_INTERPRET=1 never reaches this test process), and compiled on CUDA."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent("""
    import torch
    from phases.p05_quantization.quant import QuantizedLinear, unpack_int4
    from phases.p05_quantization.triton_quant import wq_matmul

    def like(layer, x, out):
        # what common mistakes in a tile's dequantization give: the nibbles swapped, the zero left out
        if layer.method != "int4":
            return ""
        packed, scale, zero = layer.qweight, layer.scale.float(), layer.zero.float()
        q = unpack_int4(packed).float()
        o, i = q.shape
        swapped = torch.stack((packed >> 4, packed & 0xF), dim=-1).flatten(1).float()
        def deq(levels, with_zero=True):
            g = levels.reshape(o, scale.shape[1], -1) * scale[..., None] + (zero[..., None] if with_zero else 0)
            return g.reshape(o, i)
        mistakes = {{"column 2j read from the high nibble (it is the low one)": deq(swapped),
                     "the zero point left out (w = q * scale + zero)": deq(q, with_zero=False)}}
        for why, w in mistakes.items():
            alt = torch.nn.functional.linear(x, w.to(x.device), layer.bias)
            if torch.allclose(out, alt, rtol=1e-3, atol=1e-3):
                return f"; it is what {{why}} gives"
        return ""
    torch.manual_seed(0)
    device = "{device}"
    for method in ("int8", "int4"):
        for rows, gemv in ((1, True), (3, True), (5, False), (40, False)):
            w, b = torch.randn(72, 96) * 0.05, torch.randn(72) * 0.1   # N=72, K=96: partial tiles
            layer = QuantizedLinear(w, b, method, 32, kernel="reference").to(device)
            x = torch.randn(rows, 96, device=device)
            ref = layer.reference_forward(x)
            out = wq_matmul(x, layer, gemv=gemv)
            err = ((out - ref).norm() / ref.norm()).item()
            assert err < {tol}, (f"wq_matmul, {{method}} weights, {{rows}} rows ({{'gemv' if gemv else 'gemm'}}): "
                                 f"relative error {{err:.1e}} against dequantize-then-matmul" + like(layer, x, out))
            print(method, rows, "gemv" if gemv else "gemm", f"{{err:.1e}}")
""")


@pytest.mark.interpreter
def test_triton_kernels_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHECK.format(device="cpu", tol=1e-5)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    last = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.strip()), "")
    assert proc.returncode == 0, f"{last.removeprefix('AssertionError: ')}\n{proc.stderr[-3000:]}"
    assert proc.stdout.count("\n") == 8
    assert "TRITON_INTERPRET" not in os.environ


@pytest.mark.gpu
def test_triton_kernels_compiled_on_cuda():
    exec(CHECK.format(device="cuda", tol=1e-2), {})  # tf32 in tl.dot: a wider bound


@pytest.mark.gpu
def test_quantized_linear_takes_the_triton_kernel_on_cuda():
    from phases.p05_quantization.quant import QuantizedLinear
    layer = QuantizedLinear(torch.randn(64, 128), None, "int4", 32).cuda()
    x = torch.randn(2, 128, device="cuda")
    assert torch.allclose(layer(x), layer.reference_forward(x), rtol=1e-2, atol=1e-2)
