"""Time every CPU matrix product for int8 and int4 weights on the default model's shapes.

    python -m phases.p05_quantization.tools.bench_kernels [--rows 1 4 32] [--repeat 7] [--group-size 64]
        [--kernels cpu_int4 dequant_sgemm]
    python -m phases.p05_quantization.tools.bench_kernels --step int4 [--rows 1] [--group-size 32]
    python -m phases.p05_quantization.tools.bench_kernels --bf16-rows 13   # as dtype="auto" where
        # the platform's bf16_products_from_rows says: float32 from 13 rows, dequant_sgemm at any, in bfloat16

For each weight shape of SmolLM2-135M (q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536,
LM head 49152x576) and each row count, the best-of-`repeat` time of: float32 through
phase 4's `CpuLinear` (MKL or oneDNN, by rows and CPU vendor), and each `QuantizedLinear` kernel
that can run on this CPU. Each kernel's largest error against the reference path (dequantize,
then matmul) is printed beside it.

Each shape's weight is used again and again, so a small one is read from the CPU's caches. With
`--step METHOD`, the products of one decode step of phase 7 instead (per layer q/k/v fused,
o, gate/up fused, down; 30 layers and the LM head: 121 products), each layer with its own
weights, so that every weight comes from memory, as in the engine: the best of `repeat` steps,
for each kernel of METHOD that runs here.
"""

from __future__ import annotations

import argparse

import torch

from phases.p04_triton_kernels import CpuLinear
from tinyvllm import platform
from tinyvllm.entrypoints.bench.timing import best, times
from tinyvllm.hardware import cpu_vendor

from .. import cpu_int8
from ..quant import QuantizedLinear

# tinyvllm's C kernels need the CPU's instructions: those that cannot run here are left out
RUNS_HERE = {"cpu_int8": cpu_int8.available, "cpu_int4": cpu_int8.available,
             "cpu_int8_vnni": cpu_int8.vnni_available, "dequant_sgemm": cpu_int8.available}

SHAPES = {"q_proj/o_proj": (576, 576), "k_proj/v_proj": (192, 576), "gate/up_proj": (1536, 576),
          "down_proj": (576, 1536), "lm_head": (49152, 576)}


def best_ms(fn, repeat: int) -> float:
    return 1e3 * best(times(fn, repeat))


STEP_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def step_ms(method: str, kernel: str, rows: int, group_size: int, repeat: int) -> float:
    """One decode step's products (`STEP_SHAPES`), each with weights of its own."""
    layers = [QuantizedLinear(torch.randn(o, i) * 0.02, None, method, group_size, kernel=kernel)
              for o, i in STEP_SHAPES]
    xs = {i: torch.randn(rows, i) for i in {i for _, i in STEP_SHAPES}}
    return best_ms(lambda: [q(xs[q.in_features]) for q in layers], repeat)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--step", choices=list(QuantizedLinear.KERNELS), default=None)
    p.add_argument("--kernels", nargs="+", default=None, help="only these kernels (default: all that run here)")
    p.add_argument("--bf16-rows", type=int, default=0, help="products from this many rows in bfloat16 (0: never)")
    a = p.parse_args(argv)

    def wanted(k: str) -> bool:
        return RUNS_HERE.get(k, lambda: True)() and (a.kernels is None or k in a.kernels)

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {cpu_vendor()} CPU of the kind {platform.current().kind} (capability "
          f"{torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads; ms, best of {a.repeat}")
    if a.step:
        for n in a.rows:
            print(f"a decode step's {len(STEP_SHAPES)} products, {a.step}, {n} rows: " + " | ".join(
                f"{k} {step_ms(a.step, k, n, a.group_size, a.repeat):.2f}" for k in QuantizedLinear.KERNELS[a.step]
                if k != "reference" and wanted(k)), flush=True)
        return
    for name in a.shapes:
        o, i = SHAPES[name]
        w = torch.randn(o, i) * 0.02
        lin = CpuLinear(i, o, bias=False).requires_grad_(False)
        lin.weight.copy_(w)
        layers = {f"{m}:{k}": QuantizedLinear(w, None, m, a.group_size, kernel=k)
                  for m, ks in QuantizedLinear.KERNELS.items() for k in ks if wanted(k)}
        for layer in (lin, *layers.values()):
            layer.bf16_rows = a.bf16_rows
        for n in a.rows:
            x = torch.randn(n, i)
            row = [f"float32 {best_ms(lambda: lin(x), a.repeat):.2f}"]
            for label, q in layers.items():
                err = (q(x) - q.reference_forward(x)).abs().max().item()
                row.append(f"{label} {best_ms(lambda: q(x), a.repeat):.2f} (err {err:.0e})")
            print(f"{name} {o}x{i}, {n} rows: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
