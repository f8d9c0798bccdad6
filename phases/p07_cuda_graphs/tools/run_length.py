"""One request in a fresh process, as `tinyvllm generate` makes it: its time by the number of
tokens, for each moment the graphs can be made.

    python -m phases.p07_cuda_graphs.tools.run_length [--model DIR] [--quantization int8]
        [--tokens 200 1000] [--repeat 3] [--json FILE]

First one engine waits for the compiled graphs, so that they are saved (`$TINYVLLM_CACHE/compiled`).
Then, for each --tokens N, --repeat rounds of three fresh processes, one after another: eager
(`compilation_mode=0`); the graphs read at the first decode step (`COMPILE_AFTER_STEPS` set to 1
in that process); and as it comes (read after `COMPILE_AFTER_STEPS` decode steps). Each makes
`LLM()` and one request: a 128-token prompt and N new tokens (greedy, ignore_eos), timed from the
request to its last token. A row each (N, way): the median seconds, tokens a second, in how many
rounds the graphs were read before the request ended, and when (seconds after its start).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

from .report import write_report

WAYS = {"eager": "compilation_mode=0", "at once": "graphs read at the first decode step",
        "as it comes": "graphs read after COMPILE_AFTER_STEPS decode steps"}


def child(way: str, tokens: int, model: str | None, quantization: str | None) -> dict:
    """One request in this process, made the `way` named; its seconds."""
    from phases.p07_cuda_graphs import compiled
    from tinyvllm import LLM, SamplingParams

    if way == "at once":
        compiled.COMPILE_AFTER_STEPS = 1
    kw = {"compilation_mode": 0} if way == "eager" else {}
    llm = LLM(model, phase=7, quantization=quantization, **kw)
    prompt = [i % llm.llm_engine.model_config.vocab_size for i in range(1000, 1128)]
    runner, ready = llm.llm_engine.runner.decode_runner, []
    start = time.perf_counter()
    if hasattr(runner, "ready"):   # when the graphs were ready, from the request's start
        threading.Thread(target=lambda: (runner.ready.wait(), ready.append(time.perf_counter() - start)),
                         daemon=True).start()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"request_s": seconds, "ready_s": ready[0] if ready else None}


def rounds(command: list[str], tokens: list[int], repeat: int, run=subprocess.run) -> list[dict]:
    """For each N of `tokens`, `repeat` rounds of one fresh process a way (`command` + --child WAY
    N), interleaved so that a slow moment of the machine falls on each way; a row each (N, way)."""
    rows = []
    for n in tokens:
        runs: dict[str, list[dict]] = {way: [] for way in WAYS}
        for _ in range(repeat):
            for way in WAYS:
                out = run(command + ["--child", way, str(n)], check=True, capture_output=True, text=True)
                runs[way].append(json.loads(out.stdout.strip().splitlines()[-1]))
        for way, got in runs.items():
            s = statistics.median(r["request_s"] for r in got)
            ready = [r["ready_s"] for r in got if r["ready_s"] is not None]
            rows.append({"tokens": n, "way": way, "how": WAYS[way], "request_s": round(s, 2),
                         "tok_per_s": round(n / s, 1), "runs": [round(r["request_s"], 2) for r in got],
                         "graphs_read": len(ready), "ready_s": round(statistics.median(ready), 1) if ready else None})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--tokens", type=int, nargs="+", default=[200, 1000])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--child", nargs=2, metavar=("WAY", "TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.model, args.quantization)))
        return {}

    from phases.p07_cuda_graphs import compiled
    from tinyvllm import LLM

    llm = LLM(args.model, phase=7, quantization=args.quantization)
    if not llm.llm_engine.runner.decode_runner.wait_until_compiled():
        raise SystemExit("the background compile failed: nothing to read")
    del llm
    command = [sys.executable, "-m", "phases.p07_cuda_graphs.tools.run_length"]
    command += [a for k, v in (("--model", args.model), ("--quantization", args.quantization)) if v for a in (k, v)]
    rows = rounds(command, args.tokens, args.repeat)
    return write_report("run_length", argv, {"compile_after_steps": compiled.COMPILE_AFTER_STEPS,
                                             "repeat": args.repeat, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
