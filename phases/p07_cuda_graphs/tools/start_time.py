"""How long `LLM()` takes to a first token, and when the compiled step takes over.

    python -m phases.p07_cuda_graphs.tools.start_time [--model DIR] [--compilation-mode 0|1]
        [--quantization int8] [--json FILE]

In this process: `LLM()` (compilation_mode unset unless given: compiled in the background),
then the first token of a 128-token prompt, a 16-token request right after, then
`wait_until_compiled()` (the background compile: a worker process when no graph is saved, a
thread that reads the saved graphs) and 16 more tokens. Run it twice to see a start with no
saved graph, then one that reads them (`$TINYVLLM_CACHE/compiled`).
"""

from __future__ import annotations

import argparse
import json
import time


from tinyvllm import LLM, SamplingParams

from .report import write_report



def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--compilation-mode", type=int, default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    kw = {"quantization": args.quantization}
    if args.compilation_mode is not None:
        kw["compilation_mode"] = args.compilation_mode

    def tokens(n: int) -> float:   # a 128-token prompt, then n tokens
        prompt = [i % llm.llm_engine.model_config.vocab_size for i in range(1000, 1128)]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                     use_tqdm=False)
        return round(time.perf_counter() - start, 2)

    start = time.perf_counter()
    llm = LLM(args.model, phase=7, **kw)
    row = {"compilation_mode": args.compilation_mode, "llm_s": round(time.perf_counter() - start, 2)}
    row["first_token_s"] = tokens(1)
    row["llm_to_first_token_s"] = round(row["llm_s"] + row["first_token_s"], 2)
    row["next_16_tokens_s"] = tokens(16)
    runner = llm.llm_engine.runner.decode_runner
    wait = getattr(runner, "wait_until_compiled", None)
    row["compiled"] = bool(wait and wait())
    row["compiled_after_s"] = round(time.perf_counter() - start, 2) if row["compiled"] else None
    row["graphs"] = None if not wait else {"compiled": runner.num_compiled, "read": runner.num_loaded,
                                           "by_worker": getattr(runner, "worker", None) is not None}
    row["then_16_tokens_s"] = tokens(16)
    print(json.dumps(row))
    return write_report("start_time", argv, {"row": row}, args.json)


if __name__ == "__main__":
    main()
