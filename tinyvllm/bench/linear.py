"""How fast the model's matrix products run at decode-sized batches: `F.linear` against the
model's own `Linear` (oneDNN with a packed weight, or for 1-2 rows the product written the other
way round, on a CPU).

    .venv/bin/python -m tinyvllm.bench.linear                  # the default model, CPU
    .venv/bin/python -m tinyvllm.bench.linear --rows 1 2 12 16 64 --repeat 7

For each row count it multiplies a batch of that many rows through every weight matrix of the
model once, as one decode step does, and prints the best time of `--repeat` passes for both
ways. The weights are the model's own, so they do not fit the CPU's caches: the time is what a
real step pays. `tinyvllm.model.Linear` quotes this command's numbers.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)


def time_linears(linears: list, rows: int, fn, repeat: int) -> float:
    """Best seconds, over `repeat` passes, to push `rows` rows through every layer with fn."""
    inputs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}
    best = float("inf")
    for _ in range(repeat + 1):  # the first pass warms up, and is not kept
        t = time.perf_counter()
        for m in linears:
            fn(m, inputs[m.in_features])
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tinyvllm.bench.linear", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a local Hugging Face folder (default: the default model)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS),
                        help="row counts (sequences in a decode step) to time")
    parser.add_argument("--repeat", type=int, default=5, help="passes per measurement; the best is kept")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.repeat < 1:
        parser.error("--rows and --repeat must be >= 1")

    from tinyvllm.download import resolve_model
    from tinyvllm.model import Linear
    from tinyvllm.weights import load_model

    model = load_model(resolve_model(args.model), torch.float32, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    params = sum(m.weight.numel() for m in linears)
    print(f"{len(linears)} weight matrices, {params / 1e6:.0f}M weights, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; best of {args.repeat} passes")
    print(f"{'rows':>5}  {'F.linear ms':>11}  {'Linear ms':>9}  {'speedup':>7}")
    with torch.inference_mode():
        for rows in args.rows:
            ref = time_linears(linears, rows, lambda m, x: F.linear(x, m.weight, m.bias), args.repeat)
            ours = time_linears(linears, rows, lambda m, x: m(x), args.repeat)
            print(f"{rows:>5}  {ref * 1e3:>11.1f}  {ours * 1e3:>9.1f}  {ref / ours:>6.2f}x")


if __name__ == "__main__":
    main()
