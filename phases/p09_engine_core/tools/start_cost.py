"""What the engine core's process adds to `LLM()`'s start: phase 8 in one process against phase 9
(its core in a child), each built in a fresh interpreter, alternated, `--rounds` times.

    python -m phases.p09_engine_core.tools.start_cost                  # the default model
    python -m phases.p09_engine_core.tools.start_cost --model DIR --rounds 5

The interpreters import PyTorch and the phases before the clock starts, so what is timed is
`LLM()` alone: for phase 9, the child's own interpreter and imports (which the front's reading
of the config and tokenizer overlaps) and the handshake. Prints each round and the median of
the differences.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ONE = """
import sys, time
import torch, phases
from phases.p09_engine_core import RECIPE
from tinyvllm import LLM
model = sys.argv[2] or None
start = time.perf_counter()
llm = LLM(model, phase=int(sys.argv[1]))
print(time.perf_counter() - start)
llm.llm_engine.shutdown()
"""


def start_seconds(phase: int, model: str | None) -> float:
    out = subprocess.run([sys.executable, "-c", ONE, str(phase), model or ""], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder (default: the default model)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    added = []
    for r in range(args.rounds):
        one, split = start_seconds(8, args.model), start_seconds(9, args.model)
        added.append(split - one)
        print(f"round {r + 1}: phase 8 {one:.2f} s, phase 9 {split:.2f} s, added {split - one:+.2f} s", flush=True)
    print(f"the engine core's process adds {statistics.median(added):+.2f} s (median of {args.rounds})")


if __name__ == "__main__":
    main()
