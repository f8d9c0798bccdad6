"""What the compiled CPU step (`compilation_mode=1`) costs at start and where its time goes.

    python -m phases.p07_cuda_graphs.tools.compile_time [--model DIR] [--quantization int8]
        [--steps 20] [--profile] [--json FILE]

In this process (run it twice: the first run with an empty `$TINYVLLM_CACHE/inductor` compiles,
the second reads the cache): `LLM()`, the first request's prefill, then the first decode step at
batch 1 and at batch 2 (each compiles or loads its graph: batch 1, then every larger bucket),
then the median of `--steps` more steps at each. --profile runs five more batch-1 steps under
torch.profiler and splits their time: the product operators, the attention operator,
TorchDynamo's guard checks and the graph's own code.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.entrypoints.bench.machine import machine_info
from tinyvllm.entrypoints.bench.timing import elapsed, median

PROMPT = "Write a short story about a robot who learns to paint."
PARTS = {  # profiler event -> part (self CPU time)
    "tinyvllm::vnni_int8_matmul": "products", "tinyvllm::int8_matmul": "products",
    "tinyvllm::int4_matmul": "products", "aten::mm": "products", "aten::addmm": "products",
    "tinyvllm::unified_attention": "attention", "TorchDynamo Cache Lookup": "guards",
}


def profile_split(engine) -> dict[str, float]:
    """Milliseconds a step in each part, over five batch-1 steps; 'attention' includes the
    operators it calls, 'graph' is the rest of the step."""
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(5):
            engine.step()
    ms = {"products": 0.0, "attention": 0.0, "guards": 0.0}
    for e in prof.key_averages():
        part = PARTS.get(e.key)
        if part:
            us = e.cpu_time_total if part == "attention" else e.self_cpu_time_total
            ms[part] += us / 1000 / 5
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1000 / 5
    ms["graph and the rest"] = total - sum(ms.values())
    return {k: round(v, 2) for k, v in ms.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out: dict = {"machine": machine_info(torch.device("cpu")), "quantization": args.quantization}
    start = time.perf_counter()
    llm = LLM(args.model, phase=7, compilation_mode=1, quantization=args.quantization)
    engine = llm.llm_engine
    out["llm_s"] = round(time.perf_counter() - start, 2)
    params = SamplingParams(max_tokens=4 * args.steps + 16, temperature=0, ignore_eos=True)
    for batch in (1, 2):
        rids = [f"b{batch}-{i}" for i in range(batch)]
        for rid in rids:
            engine.add_request(rid, PROMPT, params)
        out[f"prefill_s_batch{batch}"] = round(elapsed(engine.step), 2)
        out[f"first_decode_s_batch{batch}"] = round(elapsed(engine.step), 2)   # compiles or loads
        out[f"step_ms_batch{batch}"] = round(1000 * median([elapsed(engine.step) for _ in range(args.steps)]), 2)
        if batch == 1 and args.profile:
            out["split_ms_batch1"] = profile_split(engine)
        engine.abort_request(rids)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
