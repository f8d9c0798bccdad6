"""How far ahead of the codes it reads cpu_lossless.c should ask memory for the next ones.

    python -m phases.p05_quantization.tools.fetch_ahead [--model PATH] [--ahead 0 2048 4096 8192]
        [--rows 1 4 8] [--repeat 40]

The model (a folder or a GGUF file; default: the default model) is loaded as phase 5 loads it
on this machine: each weight with exact codes becomes a `LosslessLinear`. cpu_lossless.c is
built once for each distance (the platform's `codes_fetch_ahead` rule set to it; 0 is the
kernel's own 1024), and a pass calls its product once for every one of those weights, in the
model's order, as a decode step does (through ctypes: nothing between the calls). The weights
of a model are more than the CPU's caches keep, so each pass reads them from memory. The
distances take turns pass by pass, so that a slower moment of the machine falls on all alike.
It prints the median and best milliseconds of a pass for each distance and row count.
"""

from __future__ import annotations

import argparse
import time

import torch

from tinyvllm import platform
from tinyvllm.ckernel import CKernel


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m phases.p05_quantization.tools.fetch_ahead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a local folder or GGUF file (default: the default model)")
    parser.add_argument("--ahead", type=int, nargs="+", default=[0, 2048, 4096, 8192],
                        help="distances in bytes (0: the kernel's own)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8], help="rows of x a product")
    parser.add_argument("--repeat", type=int, default=40, help="passes for each distance and row count")
    args = parser.parse_args(argv)

    from phases.p04_triton_kernels import use_cpu_kernels
    from phases.p05_quantization.lossless import LOSSLESS, LosslessLinear, keep_lossless
    from tinyvllm.download import resolve_model
    from tinyvllm.weights import load_model

    model = use_cpu_kernels(load_model(resolve_model(args.model), torch.float32, torch.device("cpu")), bf16_rows=0)
    keep_lossless(model)
    layers = [m for m in model.modules() if isinstance(m, LosslessLinear)]
    if not layers:
        parser.error("no weight of this model lies on exact codes here (or this CPU kind does not read them)")
    libs = {}
    for ahead in args.ahead:
        kernel = CKernel(LOSSLESS.source, LOSSLESS.flags, LOSSLESS.needs, LOSSLESS.signatures, defines=LOSSLESS.defines)
        with platform.using(platform.current().with_rules(codes_fetch_ahead=ahead)):
            libs[ahead] = kernel.load()
    mb = sum(t.numel() * t.element_size() for m in layers for t in (m.codes, m.scale, m.zero) if t is not None) / 1e6
    print(f"{len(layers)} weights on codes ({mb:.1f} MB: codes, scales, zeros), bits "
          f"{sorted({m.bits for m in layers})}, {torch.get_num_threads()} threads, cpu kind "
          f"{platform.current().kind}; ms a pass, median and best of {args.repeat}")
    print(f"{'rows':>5}  " + "  ".join(f"{f'ahead {a or 1024}':>17}" for a in args.ahead))
    for rows in args.rows:
        xs = {m.in_features: torch.randn(rows, m.in_features) for m in layers}
        outputs = [torch.empty(rows, m.out_features) for m in layers]
        calls = [(xs[m.in_features].data_ptr(), m.codes.data_ptr(), m.scale.data_ptr(),
                  0 if m.zero is None else m.zero.data_ptr(), y.data_ptr(), rows, m.out_features, m.in_features,
                  m.bits) for m, y in zip(layers, outputs)]
        times = {a: [] for a in args.ahead}
        for _ in range(args.repeat + 1):                  # the first round warms up, and is not kept
            for ahead, lib in libs.items():
                start = time.perf_counter()
                for c in calls:
                    lib.lossless_matmul(*c)
                times[ahead].append(time.perf_counter() - start)
        cells = []
        for ahead in args.ahead:
            kept = sorted(times[ahead][1:])
            cells.append(f"{kept[len(kept) // 2] * 1e3:>8.2f} {kept[0] * 1e3:>8.2f}")
        print(f"{rows:>5}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
