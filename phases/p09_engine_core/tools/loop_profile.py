"""Where the engine core's loop spends its wall time: in the model's forward, or outside it
(schedule, prepare the inputs, sample, update, outputs), one step at a time
(`Engine.step`) against two batches in flight (`BatchQueue`, async scheduling).

    python -m phases.p09_engine_core.tools.loop_profile                       # the default model
    python -m phases.p09_engine_core.tools.loop_profile --rounds 3 --num-prompts 48

The engine is built in this process and stepped as `EngineCoreProc` steps it, without the
sockets; the workload is `tinyvllm bench throughput`'s (chat prompts, max_tokens 16-192, its
seed, a fresh salt each run). A warm-up run first. For each mode and round it prints the loop's
wall time, the output tokens a second, and the fraction of the wall time during which no forward
ran (`ModelClock`): with one step at a time, the loop's own work; with two in flight, what of it
the forward did not hide.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

os.environ.setdefault("TINYVLLM_ENABLE_MULTIPROCESSING", "0")   # the engine here: the tool steps it


class ModelClock:
    """The union of the intervals in which the model's forward runs: phase 7's decode runner
    (`decode_runner.run`: the forward and the logits of a decode step) and the runner it wraps
    (`forward`: a prefill's or a mixed step's forward). Preparing inputs, sampling, scheduling and
    updating are outside."""

    def __init__(self, engine):
        self.busy, self.lock, self.depth, self.since = 0.0, threading.Lock(), 0, 0.0
        runner = engine.runner
        for part, name in ((getattr(runner, "decode_runner", None), "run"), (getattr(runner, "inner", runner), "forward")):
            if part is not None:
                setattr(part, name, self.timed(getattr(part, name)))

    def timed(self, fn):
        def wrapper(*args, **kwargs):
            with self.lock:
                self.depth += 1
                if self.depth == 1:
                    self.since = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.depth -= 1
                    if self.depth == 0:
                        self.busy += time.perf_counter() - self.since
        return wrapper


def run_once(engine, queue, requests, salt: int) -> tuple[float, float, int]:
    """One run of the workload: (wall s, model-busy s, output tokens)."""
    from tinyvllm import SamplingParams

    clock = engine._loop_clock
    for i, r in enumerate(requests):
        engine.add_request(f"{salt}-{i}", {"prompt_token_ids": [salt, *r.prompt_token_ids[1:]]},
                           SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
    busy0, tokens, start = clock.busy, 0, time.perf_counter()
    step = queue.step if queue is not None else engine.step
    while engine.has_unfinished_requests():
        for out in step():
            tokens += len(out.outputs[0].token_ids) if out.finished else 0
    return time.perf_counter() - start, clock.busy - busy0, tokens


def main() -> None:
    import phases
    from phases.p09_engine_core.batch_queue import BatchQueue
    from tinyvllm.entrypoints.bench.workloads import make_workload

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--output-len", default="16-192")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine = phases.make_engine(9, args.model, async_scheduling=True)   # both ways on one engine
    engine._loop_clock = ModelClock(engine)
    workload = make_workload("throughput", engine.tokenizer, engine.model_config.vocab_size,
                             num_prompts=args.num_prompts, output_len=args.output_len)
    queue = BatchQueue(engine)
    salts = iter(workload.salts(2 * args.rounds + 1, 0))
    run_once(engine, queue, workload.requests[:8], next(salts))   # warm-up
    runner = getattr(engine.runner, "decode_runner", None)        # the compiled step, as the bench waits for it
    c_step = getattr(runner, "c_step", None)
    if hasattr(runner, "wait_until_compiled") and not (c_step and c_step.serves(args.num_prompts)):
        print(f"waiting for the compiled decode step: {runner.wait_until_compiled()}", flush=True)
    results = {"one step at a time": [], "two batches in flight": []}
    for r in range(args.rounds):
        for mode, q in (("one step at a time", None), ("two batches in flight", queue)):
            wall, busy, tokens = run_once(engine, q, workload.requests, next(salts))
            results[mode].append((wall, busy, tokens))
            print(f"round {r + 1}, {mode}: {wall:.2f} s, {tokens / wall:.1f} output tok/s, "
                  f"{100 * (1 - busy / wall):.1f}% of the wall time outside the model", flush=True)
    for mode, rows in results.items():
        print(f"{mode}: median {statistics.median(t / w for w, _, t in rows):.1f} output tok/s, "
              f"{100 * statistics.median(1 - b / w for w, b, _ in rows):.1f}% outside the model")
    queue.close()
    engine.shutdown()


if __name__ == "__main__":
    main()
