"""Whether bfloat16 products pay in a float32 engine on this CPU, and from how many rows: the
measurement a session on a new kind of CPU runs before it sets the kind's row of the platform's
`bf16_products_from_rows` rule (tinyvllm/platform.py; `python -m tinyvllm.entrypoints.bench.linear`
times the products alone).

    python -m phases.p07_cuda_graphs.tools.bf16_rows [--model DIR] [--rows 13 [7 ...]] [--rounds 2]
        [--requests 48] [--prompt-len 2000] [--json FILE]

Eager engines (`compilation_mode=0`, `dtype="auto"`, on the CPU, no prefix cache, so each
round prefills its prompts again) built in this process: one with float32 products, and for
each of `--rows` one whose products run in bfloat16 from that many rows on, as if the rule said
that number on this CPU's kind. A round runs each in turn, after a round not
kept: `--requests` requests offline (seeded random prompts of 20 to 59 tokens, 16 to 191 new
tokens, greedy, ignoring end-of-sequence), then one prompt of `--prompt-len` tokens to its first
token. Prints each engine's output tok/s and first-token ms per round, the medians, and how many
requests kept every greedy token of the float32 engine (on random weights the tokens are noise).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tinyvllm import LLM, SamplingParams, platform

from .report import write_report


def build(model_dir: str | None, rows: int) -> LLM:
    """An eager engine whose float32 products run in bfloat16 from `rows` rows (0: never)."""
    with platform.using(platform.current().with_rules(bf16_products_from_rows=rows)):
        return LLM(model_dir, phase=7, compilation_mode=0, enable_prefix_caching=False, device="cpu")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[13])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if min(args.rows) < 1 or args.rounds < 1 or args.requests < 1 or args.prompt_len < 1:
        p.error("--rows, --rounds, --requests and --prompt-len must be >= 1")
    engines = {"float32 products": build(args.model, 0),
               **{f"bfloat16 from {rows} rows": build(args.model, rows) for rows in args.rows}}
    vocab = next(iter(engines.values())).llm_engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(rng.randrange(20, 60))]}
               for _ in range(args.requests)]
    params = [SamplingParams(max_tokens=rng.randrange(16, 192), temperature=0, ignore_eos=True) for _ in prompts]
    long = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.prompt_len)]}]
    first = SamplingParams(max_tokens=1, temperature=0)
    out_tokens = sum(sp.max_tokens for sp in params)
    tok_s, ttft, tokens = {n: [] for n in engines}, {n: [] for n in engines}, {}
    for r in range(args.rounds + 1):
        for name, llm in engines.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            offline = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate(long, first, use_tqdm=False)
            first_s = time.perf_counter() - start
            tokens[name] = [o.outputs[0].token_ids for o in outs]
            if r:
                tok_s[name].append(round(out_tokens / offline, 1))
                ttft[name].append(round(1000 * first_s, 1))
    base = tokens["float32 products"]
    rows = []
    for name in engines:
        row = {"engine": name, "bf16_rows": engines[name].llm_engine.setup.bf16_rows, "tok_s": tok_s[name],
               "median_tok_s": statistics.median(tok_s[name]), "ttft_ms": ttft[name],
               "median_ttft_ms": statistics.median(ttft[name]),
               "same_requests": sum(a == b for a, b in zip(tokens[name], base)), "requests": len(prompts)}
        rows.append(row)
        print(f"{name:24s} tok/s {row['tok_s']} median {row['median_tok_s']}  first token of {args.prompt_len} "
              f"ms {row['ttft_ms']} median {row['median_ttft_ms']}  requests with float32's tokens "
              f"{row['same_requests']}/{len(prompts)}")
    return write_report("bf16_rows", argv, {"kind": platform.current().kind, "output_tokens": out_tokens, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
