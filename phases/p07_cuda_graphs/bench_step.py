"""Time one decode step, phase 7's static path against enforce_eager (phase 6), on one model.

    python -m phases.p07_cuda_graphs.bench_step [--model DIR] [--batch 1 8] [--steps 30] [--gc-freeze]
        [--profile]
    python -m phases.p07_cuda_graphs.bench_step --fused [--model DIR] [--batch 1 8]

Each batch: `batch` requests are prefilled, then `steps` decode steps are timed (median of the
per-step times); with --profile, torch.profiler's table of one step's top CPU ops is printed.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from tinyvllm import LLM, SamplingParams

PROMPT = "Write a short story about a robot who learns to paint."


def decode_step_times(engine, batch: int, steps: int, gc_freeze: bool) -> list[float]:
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", PROMPT, params)
    engine.step()           # prefills
    engine.step()           # warm-up decode
    if gc_freeze:
        gc.collect()
        gc.freeze()         # move what exists now out of the collector's reach
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort_request([f"r{i}" for i in range(batch)])
    if gc_freeze:
        gc.unfreeze()
    return times


class _NoCache:
    """Attention stand-in (returns q): times the projections and MLP alone."""

    def __call__(self, layer_idx, q, k, v):
        return q


def bench_fused(model_dir, batches: list[int], repeat: int = 15) -> None:
    """The model's forward with separate and with fused projections, interleaved, min of `repeat`."""
    import copy

    from .fused import fuse_projections

    model = LLM(model_dir, phase=7, enforce_eager=True).llm_engine.model
    t = time.perf_counter()
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    print(f"copy + fuse_projections: {time.perf_counter() - t:.2f} s")
    for n in batches:
        device = model.model.embed_tokens.weight.device
        ids, pos = torch.randint(0, 1000, (n,), device=device), torch.arange(n, device=device) + 20
        times: dict[str, list[float]] = {"separate": [], "fused": []}
        for _ in range(repeat):
            for name, m in (("separate", model), ("fused", fused)):
                t = time.perf_counter()
                m(ids, pos, _NoCache())
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the GPU's time, not the launches'
                times[name].append(time.perf_counter() - t)
        print(f"batch {n:3d}  forward separate {1e3 * min(times['separate']):7.1f} ms, "
              f"fused {1e3 * min(times['fused']):7.1f} ms (min of {repeat}, interleaved)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--gc-freeze", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--fused", action="store_true", help="time separate against fused projections")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    if a.fused:
        return bench_fused(a.model, a.batch)
    engines = {"phase 7": LLM(a.model, phase=7, max_num_seqs=max(a.batch)).llm_engine,
               "enforce_eager (phase 6)": LLM(a.model, phase=7, max_num_seqs=max(a.batch),
                                              enforce_eager=True).llm_engine}
    for b in a.batch:
        for name, engine in engines.items():
            ms = 1e3 * statistics.median(decode_step_times(engine, b, a.steps, a.gc_freeze))
            print(f"batch {b:3d}  {name:24s} decode step {ms:7.2f} ms (median of {a.steps})", flush=True)
            if a.profile:
                from torch.profiler import ProfilerActivity, profile

                params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
                for i in range(b):
                    engine.add_request(f"p{i}", PROMPT, params)
                engine.step(), engine.step()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    engine.step()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
                engine.abort_request([f"p{i}" for i in range(b)])


if __name__ == "__main__":
    main()
