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
    from phases.p05_quantization.quant import QuantizedLinear
    from phases.p05_quantization.triton_quant import wq_matmul
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
                                 f"relative error {{err:.1e}} against dequantize-then-matmul")
            print(method, rows, "gemv" if gemv else "gemm", f"{{err:.1e}}")
""")


@pytest.mark.interpreter
def test_triton_kernels_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHECK.format(device="cpu", tol=1e-5)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
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
