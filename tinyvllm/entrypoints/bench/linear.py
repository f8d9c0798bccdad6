"""How fast the model's matrix products run at decode-sized batches, each way phase 4's `CpuLinear`
can take on a CPU: `F.linear` (MKL), the product written the other way round, (W @ x^T)^T, oneDNN
with a packed weight, the same in bfloat16 on a bfloat16 copy of it (float32 in and out: what the
platform's `bf16_products_from_rows` turns on), on the amx kind tinyvllm's AMX kernel for those
(cpu_amx.c), tinyvllm's own AVX2 loop (cpu_gemv.c), the weight read from its exact 4- or 8-bit
codes where it has them (phase 5's cpu_lossless.c: "codes"), and `CpuLinear` itself, which picks
one of these by rows, CPU vendor and kind (the rules of `tinyvllm.platform`).

    .venv/bin/python -m tinyvllm.entrypoints.bench.linear                  # the default model, CPU
    .venv/bin/python -m tinyvllm.entrypoints.bench.linear --rows 1 2 12 16 64 --repeat 7
    .venv/bin/python -m tinyvllm.entrypoints.bench.linear --dtype bfloat16   # no cpu_gemv, no codes

For each row count it multiplies a batch of that many rows through every weight matrix of the
model once, as one decode step does, and prints the best time of `--repeat` passes for each
way. The weights are the model's own, so they do not fit the CPU's caches: the time is what a
real step pays. The platform's product rules name this command's reports.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from .timing import best, times

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)


def time_linears(linears: list, rows: int, fn, repeat: int) -> float:
    """Best seconds, over `repeat` passes, to push `rows` rows through every layer with fn."""
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m in linears}

    def one_pass():
        for m in linears:
            fn(m, inputs[m.in_features])

    return best(times(one_pass, repeat))  # the first pass warms up, and is not kept


def lossless_layers(linears: list) -> dict:
    """For each weight that lies exactly on 4- or 8-bit codes (phase 5's `lossless_codes`), a
    `LosslessLinear` of it that reads them at any row count, by the layer's id."""
    from phases.p05_quantization import LosslessLinear, lossless_codes

    layers = {}
    for m in linears:
        codes = lossless_codes(m.weight)
        if codes is not None:
            layers[id(m)] = LosslessLinear(m, *codes)
            layers[id(m)].max_rows = 1 << 30      # this layer's own: its codes at every row count
    return layers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tinyvllm.entrypoints.bench.linear", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a local Hugging Face folder (default: the default model)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS),
                        help="row counts (sequences in a decode step) to time")
    parser.add_argument("--repeat", type=int, default=5, help="passes per measurement; the best is kept")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the weights' and rows' dtype (bfloat16: no cpu_gemv, no codes)")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.repeat < 1:
        parser.error("--rows and --repeat must be >= 1")

    from phases.p04_triton_kernels import GEMV, CpuLinear, amx_fits, amx_matmul, gemv, onednn_bf16, use_cpu_kernels
    from tinyvllm.download import resolve_model
    from tinyvllm.hardware import cpu_vendor
    from tinyvllm.weights import load_model

    dtype = getattr(torch, args.dtype)
    model = use_cpu_kernels(load_model(resolve_model(args.model), dtype, torch.device("cpu")), bf16_rows=0)
    linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
    Linear = linears[0]   # every layer's rules are the platform's
    params = sum(m.weight.numel() for m in linears)

    def transposed(m, x):
        x2 = torch.cat([x, x.new_zeros(1, x.shape[1])]) if len(x) == 1 else x
        return (m.weight @ x2.T)[:, : len(x)].T.contiguous()

    ways = {"F.linear": lambda m, x: F.linear(x, m.weight, m.bias), "(W x^T)^T": transposed}
    if Linear.use_onednn:
        ways["oneDNN"] = lambda m, x: torch.ops.mkldnn._linear_pointwise(x, m.packed_weight(), m.bias,
                                                                          "none", [], "")
        if dtype == torch.float32:
            ways["oneDNN bf16"] = lambda m, x: onednn_bf16(x, m.weight, m.bias)
    if dtype == torch.float32 and all(amx_fits(m.weight) for m in linears):
        ways["AMX bf16"] = lambda m, x: amx_matmul(x, m.weight, m.bias)   # cpu_amx.c, at any rows
    if GEMV.available() and dtype == torch.float32:
        ways["cpu_gemv"] = lambda m, x: gemv(x, m.weight, m.bias)
    codes = lossless_layers(linears) if dtype == torch.float32 else {}
    if codes:
        ways["codes"] = lambda m, x: codes[id(m)](x) if id(m) in codes else m(x)
    ways["Linear"] = lambda m, x: m(x)
    print(f"{len(linears)} weight matrices in {args.dtype}, {params / 1e6:.0f}M weights, torch {torch.__version__}, "
          f"{cpu_vendor() or 'unknown'} CPU, {torch.get_num_threads()} threads; ms, best of {args.repeat} "
          f"passes; Linear takes tinyvllm's cpu_gemv up to {Linear.gemv_rows} rows (0: not on this CPU kind), "
          f"then MKL's F.linear up to {Linear.small_rows} rows on an Intel CPU, else (W x^T)^T up to "
          f"{Linear.small_rows}, then oneDNN")
    print(f"{'rows':>5}  " + "  ".join(f"{name:>11}" for name in ways))
    with torch.inference_mode():
        for rows in args.rows:
            times = [time_linears(linears, rows, fn, args.repeat) for fn in ways.values()]
            print(f"{rows:>5}  " + "  ".join(f"{t * 1e3:>11.1f}" for t in times))


if __name__ == "__main__":
    main()
