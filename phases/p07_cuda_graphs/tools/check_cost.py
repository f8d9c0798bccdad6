"""What checked mode costs a decode step: phase 7's step with `check_kernels` on and off.

    python -m phases.p07_cuda_graphs.tools.check_cost [--model DIR] [--batch 1 48] [--steps 200]
        [--compilation-mode 0 1] [--json FILE]

One engine per compilation mode (0: eager, where `cpu_step.c` or `decode_forward` runs the step;
1: the compiled step), `batch` requests prefilled, then `steps` decode steps with the checks on
and as many with them off, alternating step by step in the same engine (a slower moment of the
machine falls on both alike). Two numbers per row: the time the checks themselves take in a step
(phase 2's `check_metadata` and phase 7's `InputBatch.check`, timed around each call), as a share
of the median unchecked step; and the median checked step against the median unchecked one (the
same cost, seen through the noise of whole steps).
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch

from phases.p07_cuda_graphs.input_batch import InputBatch
from tinyvllm import LLM, SamplingParams
from tinyvllm.entrypoints.bench.timing import elapsed, median

from .report import write_report

# the module (the package's name `paged_attention` is its function)
paged_attention = importlib.import_module("phases.p02_paged_kv.paged_attention")
PROMPT = "Write a short story about a robot who learns to paint."


class CheckClock:
    """While open, the seconds spent in checked mode's two checks add up in `seconds`."""

    def __init__(self):
        self.seconds = 0.0
        self.saved = (paged_attention.check_metadata, InputBatch.check)

    def timed(self, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return call

    def __enter__(self):
        paged_attention.check_metadata = self.timed(self.saved[0])
        InputBatch.check = self.timed(self.saved[1])
        return self

    def __exit__(self, *exc):
        paged_attention.check_metadata, InputBatch.check = self.saved


def set_checked(engine, on: bool) -> None:
    """Checked mode on or off in a built engine: its KV pool (every attention part it makes) and
    its static runner (the persistent batch)."""
    engine.parts.kv_cache.checked = on
    engine.runner.checked = on


def measure(engine, batch: int, steps: int) -> dict:
    params = SamplingParams(max_tokens=2 * steps + 16, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", PROMPT, params)
    engine.step()   # the prefills
    for _ in range(10):
        engine.step()   # warm-up decodes
    times: dict[bool, list[float]] = {True: [], False: []}
    checks: list[float] = []
    with CheckClock() as clock:
        for _ in range(steps):
            for on in (True, False):
                set_checked(engine, on)
                before = clock.seconds
                times[on].append(elapsed(engine.step))
                if on:
                    checks.append(clock.seconds - before)
    engine.abort_request([f"r{i}" for i in range(batch)])
    set_checked(engine, True)
    on, off, check = (1e3 * median(times[True]), 1e3 * median(times[False]), 1e6 * median(checks))
    return {"batch": batch, "steps": steps, "checked_step_ms": round(on, 3), "unchecked_step_ms": round(off, 3),
            "checks_us": round(check, 1), "checks_share": round(check / 1e3 / off, 4),
            "step_difference": round(on / off - 1, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 48])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--compilation-mode", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    ap.add_argument("--json", default=None, help="write the report here")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    rows = []
    for mode in a.compilation_mode:
        engine = LLM(a.model, phase=7, max_num_seqs=max(a.batch), compilation_mode=mode,
                     check_kernels=True).llm_engine
        for b in a.batch:
            row = {"compilation_mode": mode, **measure(engine, b, a.steps)}
            rows.append(row)
            print(f"compilation_mode={mode} batch {b:3d}: checks {row['checks_us']:6.1f} us a step, "
                  f"{100 * row['checks_share']:.2f}% of the unchecked step ({row['unchecked_step_ms']:.2f} ms); "
                  f"checked step {100 * row['step_difference']:+.2f}% (medians of {a.steps})", flush=True)
    write_report("check_cost", None, {"rows": rows}, a.json)


if __name__ == "__main__":
    main()
