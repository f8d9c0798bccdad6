"""How much one forward pass costs as the number of query tokens per sequence grows.

Speculation rests on this: verifying k drafts is one pass over k + 1 query tokens instead of one.
This times exactly that pass, the engine's own verify path (its runner's `execute` on a plan with
drafts, logits at every row), for 1..8 query tokens per sequence over a cached context, at a
given batch size.

    python -m phases.p06_speculative_decoding.tools.verify_cost [--batch 1] [--context 256] [--model PATH]
"""

from __future__ import annotations

import argparse
import random

import torch

from tinyvllm.entrypoints.bench.timing import elapsed, median


@torch.inference_mode()
def verify_pass_times(engine, max_query: int = 8, batch: int = 1, context: int = 256,
                      repeat: int = 7, seed: int = 0) -> dict[int, float]:
    """Median seconds of one pass with q = 1..max_query query tokens per sequence, for `batch`
    sequences of `context` cached tokens. `engine`: a phase 6 engine with speculation on (its
    runner scores every draft's row)."""
    from tinyvllm.step import SchedulerOutput

    from ..rollback import truncate_table

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    from tinyvllm.sampling_params import SamplingParams
    for i in range(batch):
        engine.add_request(f"verify-cost-{i}", {"prompt_token_ids": [rng.randrange(vocab) for _ in range(context)]},
                           SamplingParams(temperature=0, max_tokens=max_query + 8, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (and a token or two for the sequences that finish it first)
    seqs = list(engine.scheduler.running)
    times = {}
    for q in range(1, max_query + 1):
        samples = []
        for _ in range(repeat + 1):  # the first pass is a warm-up (weight packing, allocations)
            plan = SchedulerOutput([(seq, q) for seq in seqs], spec_token_ids={seq: [0] * (q - 1) for seq in seqs})
            for seq in seqs:
                engine.allocator.allocate(seq.block_table, q)
            samples.append(elapsed(lambda: engine.runner.execute(plan)))
            for seq in seqs:  # undo: as if the pass never ran
                truncate_table(engine.allocator, seq.block_table, seq.num_computed_tokens)
        times[q] = median(samples[1:])
    engine.abort_request([f"verify-cost-{i}" for i in range(batch)])
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--max-query", type=int, default=8)
    args = p.parse_args()
    import phases

    engine = phases.make_engine(6, args.model, speculative_config={"method": "ngram", "num_speculative_tokens": 1})
    times = verify_pass_times(engine, args.max_query, args.batch, args.context)
    print(f"batch {args.batch}, {args.context} cached tokens each; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("query tokens  pass ms  vs 1 token")
    for q, t in times.items():
        print(f"{q:>12}  {t * 1e3:7.1f}  {t / times[1]:8.2f}x")


if __name__ == "__main__":
    main()
