"""The four platform rules of a float32 decode step on this CPU, added one at a time: cpu_gemv.c
up to `--gemv-rows` rows (`gemv_max_rows`), phase 5's lossless codes up to `--codes-rows`
(`codes_max_rows`), the fused residual add + RMSNorm (`c_norm_decode`) and cpu_step.c (`c_step`,
serving where every product has a C kernel). What a session on a new kind of CPU runs before it
sets the kind's row of these rules (tinyvllm/platform.py).

    python -m phases.p07_cuda_graphs.tools.kind_rules [--model DIR] [--batch 1 8] [--rounds 3]
        [--gemv-rows 1] [--codes-rows 12] [--json FILE]

The default model has codes (cpu_gemv.c then serves no layer); a float32 one without
(`python -m tinyvllm.testing random-like`) shows cpu_gemv.c.

One eager `LLM()` (compilation_mode=0) per set of rules, built in this process with the rules of
its set on whatever this CPU's kind is (`tinyvllm.platform.using`: an engine reads its rules when
it is built); a round runs each engine once, in turn, on `batch`
prompts of 32 tokens for 128 new tokens (greedy), after a round not kept. Prints each set's
output tok/s per round, the median, and whether its tokens are the first set's.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tinyvllm import LLM, SamplingParams, platform

from .report import write_report

NAMES = ("none", "gemv", "gemv, codes", "gemv, codes, norm", "gemv, codes, norm, cpu_step")


def rules_of(rules: tuple) -> dict:
    """The platform rules of a set: (gemv rows, codes rows, fused norm, cpu_step)."""
    return dict(zip(("gemv_max_rows", "codes_max_rows", "c_norm_decode", "c_step"), rules))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gemv-rows", type=int, default=1)
    p.add_argument("--codes-rows", type=int, default=12)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    # the i-th set: the first i rules on, in NAMES' order
    sets = {name: (args.gemv_rows if i > 0 else 0, args.codes_rows if i > 1 else 0, i > 2, i > 3)
            for i, name in enumerate(NAMES)}
    engines = {}
    for name, rules in sets.items():
        with platform.using(platform.current().with_rules(**rules_of(rules))):
            engines[name] = LLM(args.model, phase=7, compilation_mode=0, device="cpu")
    rows = [row for batch in args.batch for row in measure(engines, sets, batch, args.rounds)]
    return write_report("kind_rules", argv, {"rows": rows}, args.json)


def measure(engines: dict, sets: dict, batch: int, rounds: int) -> list[dict]:
    """A row per set of rules: `batch` prompts a round, each engine in turn, medians."""
    params, rows = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True), []
    prompts = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(batch)]
    tok_s, tokens = {name: [] for name in sets}, {}
    for r in range(rounds + 1):
        for name in sets:
            start = time.perf_counter()
            outs = engines[name].generate(prompts, params, use_tqdm=False)
            if r:
                tok_s[name].append(round(128 * batch / (time.perf_counter() - start), 1))
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    for name in sets:
        row = {"batch": batch, "rules": name, "tok_s": tok_s[name], "median_tok_s": statistics.median(tok_s[name]),
               "same_tokens": tokens[name] == tokens["none"]}
        rows.append(row)
        print(f"batch {batch:3d}  {name:24s} {' '.join(map(str, row['tok_s']))}  median {row['median_tok_s']}"
              f"  same tokens: {row['same_tokens']}")
    return rows


if __name__ == "__main__":
    main()
