"""What the compiled CPU step (`compilation_mode=1`) costs at start and where its time goes.

    python -m phases.p07_cuda_graphs.tools.compile_time [--model DIR] [--quantization int8]
        [--batch 1 2] [--steps 20] [--profile] [--json FILE]

In this process (run it twice: the first run compiles and saves both graphs in
`$TINYVLLM_CACHE/compiled`, the second reads them): `LLM(compilation_mode=1)`, which compiles or
reads both graphs (batch 1, and every larger bucket; `cache` says which it did), then for each --batch, that many requests: their prefill, the first decode step
and the median of `--steps` more steps (and of the engine's time around the compiled
forward in each), a row each. --profile runs five more steps under
torch.profiler and splits their time: the product operators, the attention operator,
TorchDynamo's guard checks and the rest (the graph's own loops, the engine around it).
"""

from __future__ import annotations

import argparse
import json
import time


from phases.p07_cuda_graphs.compiled import use_inductor_cache
from tinyvllm import LLM, SamplingParams
from tinyvllm.entrypoints.bench.timing import elapsed, median

from .report import write_report

PROMPT = "Write a short story about a robot who learns to paint."
PARTS = {  # profiler event -> part (see profile_split for which time each counts)
    "tinyvllm::opaque_linear": "products", "tinyvllm::onednn_linear": "products",
    "aten::mm": "products", "aten::addmm": "products",
    "tinyvllm::unified_attention": "attention", "TorchDynamo Cache Lookup": "guards",
}


def profile_split(engine) -> dict[str, float]:
    """Milliseconds a step in each part, over five steps: tinyvllm's operators with the
    operators they call, the others their own time; 'rest' is everything else (the graph's
    loops, the engine's Python)."""
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(5):
            engine.step()
    ms = {"products": 0.0, "attention": 0.0, "guards": 0.0}
    for e in prof.key_averages():
        part = PARTS.get(e.key)
        if part:
            us = e.cpu_time_total if e.key.startswith("tinyvllm::") else e.self_cpu_time_total
            ms[part] += us / 1000 / 5
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1000 / 5
    ms["rest"] = total - sum(ms.values())
    return {k: round(v, 2) for k, v in ms.items()}


def timed_steps(engine, n: int) -> tuple[list[float], list[float]]:
    """n steps' times, and within each the time of the compiled decode runner's `run`."""
    runner, runs = engine.runner.decode_runner, []
    run = runner.run

    def timed_run(bucket):
        start = time.perf_counter()
        out = run(bucket)
        runs.append(time.perf_counter() - start)
        return out

    runner.run = timed_run
    try:
        steps = [elapsed(engine.step) for _ in range(n)]
    finally:
        del runner.run
    return steps, runs


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    use_inductor_cache()
    start = time.perf_counter()
    llm = LLM(args.model, phase=7, compilation_mode=1, quantization=args.quantization)
    llm_s = round(time.perf_counter() - start, 2)   # loads the weights, compiles or reads both graphs
    engine = llm.llm_engine
    cache = "read" if engine.runner.decode_runner.num_compiled == 0 else "compiled"
    params = SamplingParams(max_tokens=args.steps + 16, temperature=0, ignore_eos=True)
    rows = []
    for batch in args.batch:
        row = {"cache": cache, "weights": args.quantization or "float32", "llm_s": llm_s, "batch": batch}
        rids = [f"b{batch}-{i}" for i in range(batch)]
        for rid in rids:
            engine.add_request(rid, PROMPT, params)
        row["prefill_s"] = round(elapsed(engine.step), 2)
        row["first_decode_s"] = round(elapsed(engine.step), 2)
        steps, runs = timed_steps(engine, args.steps)
        row["step_ms"] = round(1000 * median(steps), 2)
        # the engine around the compiled forward: scheduling, inputs, sampling, outputs (what
        # multi-step decoding or asynchronous output processing could hide at most)
        row["engine_ms"] = round(1000 * median([s - r for s, r in zip(steps, runs)]), 2)
        if args.profile:
            row.update({f"{k}_ms": v for k, v in profile_split(engine).items()})
        engine.abort_request(rids)
        rows.append(row)
        print(json.dumps(row))
    return write_report("compile_time", argv, {"rows": rows}, args.json)


if __name__ == "__main__":
    main()
