"""Phase 9's asynchronous scheduling: the scheduler one step ahead of the model, two batches in
flight, gives phase 8's tokens exactly.

The engine is driven here in this process through the core's `BatchQueue` (what `EngineCoreProc`
steps with `async_scheduling` on), so each case sees the engine's parts; test_p09_checkpoint.py
runs the same path through the process split. `async_scheduling=True` is asked for: a CPU's
default is off. Seeded samples are compared with
`batch_invariant=True`: running ahead changes which rows share a step (a request that EOS ends
still has a row in the step behind it; a waiting one is admitted a step later), and a sample
drawn near a boundary between two tokens may follow a product's last bits.
"""

from __future__ import annotations

import threading
import time

import pytest

import phases
from phases.p09_engine_core.async_scheduler import PLACEHOLDER, AsyncScheduler
from phases.p09_engine_core.batch_queue import BatchQueue
from tinyvllm import SamplingParams
from tinyvllm.testing import token_difference

PROMPTS = ["hello there", "the quick brown fox", "1 2 3", "a b a b a b a b", "hello there, general", "zz"]
PARAMS = [SamplingParams(temperature=0, max_tokens=12, logprobs=2),
          SamplingParams(temperature=0.9, top_p=0.95, seed=11, n=2, max_tokens=10),
          SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[5, 7, 11], min_tokens=2),
          SamplingParams(temperature=0.8, seed=3, max_tokens=25, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=20),
          SamplingParams(temperature=0.7, seed=5, max_tokens=18, stop_token_ids=[3, 9])]


def _engine(model, phase: int, monkeypatch, **args):
    monkeypatch.setenv("TINYVLLM_ENABLE_MULTIPROCESSING", "0")   # the engine here, stepped by the test
    if phase == 9:
        args.setdefault("async_scheduling", True)   # not the default on a CPU
    return phases.make_engine(phase, model, **args)


def _run(engine, prompts, params, ahead: bool, abort_at: dict | None = None):
    """Every request to its end, through a `BatchQueue` (`ahead`) or `Engine.step`; each request's
    last output, and the queue. `abort_at`: step number -> request id aborted before that step."""
    queue = BatchQueue(engine) if ahead else None
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    final, step = {}, 0
    try:
        while engine.has_unfinished_requests():
            if abort_at and step in abort_at:
                engine.abort_request(abort_at[step])
            for out in (queue.step() if queue else engine.step()):
                assert not final.get(out.request_id, (None, False))[1], f"request {out.request_id}: an output after it finished"
                assert PLACEHOLDER not in sum((c.token_ids for c in out.outputs), []), "a placeholder in an output"
                final[out.request_id] = (out, out.finished)
            step += 1
    finally:
        if queue is not None:
            queue.close()
    return {rid: out for rid, (out, _) in final.items()}, queue


def _tokens(final: dict) -> list[list[int]]:
    return [c.token_ids for rid in sorted(final, key=int) for c in final[rid].outputs]


def _ends(final: dict) -> list:
    return [(c.finish_reason, c.stop_reason, None if c.logprobs is None else [sorted(r) for r in c.logprobs])
            for rid in sorted(final, key=int) for c in final[rid].outputs]


def _check_equal(got: dict, want: dict, what: str) -> None:
    assert _tokens(got) == _tokens(want), token_difference(_tokens(got), _tokens(want), what)
    assert _ends(got) == _ends(want), f"{what}: the same tokens, but other finish reasons or logprobs"


def test_async_tokens_equal_phase8(tiny_model_dir, monkeypatch):
    """Greedy and seeded samples, n=2, logprobs, stop token ids, min_tokens, max_tokens: phase 8's
    tokens with two batches in flight; greedy ones also without batch invariance."""
    args = dict(num_kv_blocks=64, block_size=4, batch_invariant=True)
    want, _ = _run(_engine(tiny_model_dir, 8, monkeypatch, **args), PROMPTS, PARAMS, ahead=False)
    engine = _engine(tiny_model_dir, 9, monkeypatch, **args)
    assert isinstance(engine.scheduler, AsyncScheduler)
    got, queue = _run(engine, PROMPTS, PARAMS, ahead=True)
    _check_equal(got, want, "phase 9 with async scheduling against phase 8")
    assert queue.num_ahead > 10 and queue.num_sync == 0, (queue.num_ahead, queue.num_sync)
    greedy = [p for p in PARAMS if p.temperature == 0]
    prompts = [q for q, p in zip(PROMPTS, PARAMS) if p.temperature == 0]
    want, _ = _run(_engine(tiny_model_dir, 8, monkeypatch, num_kv_blocks=64), prompts, greedy, ahead=False)
    got, _ = _run(_engine(tiny_model_dir, 9, monkeypatch, num_kv_blocks=64), prompts, greedy, ahead=True)
    _check_equal(got, want, "greedy, phase 9 with async scheduling against phase 8")


def test_async_preemption_and_prefix_caching(tiny_model_dir, monkeypatch):
    """A pool too small for the batch (sequences preempted while their tokens are in flight) and
    prompts that share a prefix: phase 8's tokens; every block free at the end."""
    prompts = [f"a shared system prompt, then {w}" for w in ("one", "two", "three", "four", "five", "six")]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0, max_tokens=20 + i) for i in range(len(prompts))]
    args = dict(num_kv_blocks=24, block_size=4, batch_invariant=True)
    want, _ = _run(_engine(tiny_model_dir, 8, monkeypatch, **args), prompts, params, ahead=False)
    engine = _engine(tiny_model_dir, 9, monkeypatch, **args)
    got, queue = _run(engine, prompts, params, ahead=True)
    _check_equal(got, want, "phase 9 with async scheduling, preempting, against phase 8")
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert queue.num_ahead > 10
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks and not engine.scheduler.placeholders


def test_async_stops_and_aborts(tiny_model_dir, monkeypatch):
    """A request that a stop token ends in step N was scheduled into N+1: that token is dropped and
    its blocks are freed; one aborted while its tokens are in flight gets no output after; the
    others are phase 8's."""
    args = dict(num_kv_blocks=64, block_size=4, batch_invariant=True)
    eos = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=list(range(0, 320, 3)))   # ends soon
    params = [eos, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), eos,
              SamplingParams(temperature=0.8, seed=2, max_tokens=30, ignore_eos=True)]
    prompts = PROMPTS[:4]
    want, _ = _run(_engine(tiny_model_dir, 8, monkeypatch, **args), prompts, params, ahead=False, abort_at={4: "3"})
    engine = _engine(tiny_model_dir, 9, monkeypatch, **args)
    got, queue = _run(engine, prompts, params, ahead=True, abort_at={4: "3"})
    assert all(got[r].outputs[0].finish_reason == "stop" for r in ("0", "2")), _ends(got)
    _check_equal({r: got[r] for r in "012"}, {r: want[r] for r in "012"},
                 "phase 9 with async scheduling, stop tokens, against phase 8")
    assert len(got["3"].outputs[0].token_ids) <= 4, "the aborted request got tokens after its abort"
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks and not engine.scheduler.placeholders


def test_drafts_and_grammars_fall_back_to_a_synchronous_step(tiny_model_dir, monkeypatch):
    """n-gram drafts and structured outputs need the tokens just sampled: those steps are phase 8's
    synchronous ones (every step with a proposer; while a constrained request lives otherwise),
    and the tokens are phase 8's."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": r"[a-c]{2,4}-[0-9]{3}"}),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    for args, ahead_steps in ((dict(num_kv_blocks=64, speculative_config=spec), False),
                              (dict(num_kv_blocks=64), True)):
        want, _ = _run(_engine(tiny_model_dir, 8, monkeypatch, **args), PROMPTS[:3], params, ahead=False)
        got, queue = _run(_engine(tiny_model_dir, 9, monkeypatch, **args), PROMPTS[:3], params, ahead=True)
        _check_equal(got, want, f"phase 9 with async scheduling and {sorted(args)}, against phase 8")
        assert queue.num_sync > 0 and (queue.num_ahead > 0) == ahead_steps, (args, queue.num_sync, queue.num_ahead)


def test_the_next_step_is_scheduled_while_the_model_runs(tiny_model_dir, monkeypatch):
    """The overlap itself: step N+1 is planned while step N's model runs (in the model thread), not
    after its tokens land."""
    engine = _engine(tiny_model_dir, 9, monkeypatch, num_kv_blocks=64)
    in_model, during, calls = threading.Event(), [], []
    execute, schedule = engine.runner.execute, engine.scheduler.inner.schedule

    def slow_execute(plan):
        in_model.set()
        try:
            time.sleep(0.01)   # a forward long enough to see what the loop does meanwhile
            return execute(plan)
        finally:
            in_model.clear()

    def watched_schedule():
        calls.append(threading.current_thread() is threading.main_thread())
        during.append(in_model.is_set())
        return schedule()

    monkeypatch.setattr(engine.runner, "execute", slow_execute)
    monkeypatch.setattr(engine.scheduler.inner, "schedule", watched_schedule)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 3
    _run(engine, PROMPTS[:3], params, ahead=True)
    assert all(calls), "the scheduler ran outside the loop's thread"
    assert sum(during) >= len(during) - 3, (
        f"only {sum(during)} of {len(during)} steps were scheduled while the model ran the step before: "
        f"the loop waits for each step's tokens before planning the next")


def test_a_failed_batch_fails_its_requests_and_the_batch_behind_it(tiny_model_dir, monkeypatch):
    """A batch whose model run fails: its requests, and those of the batch queued behind it (whose
    placeholders it was to fill), get a StepError and are aborted; a request added later runs, and
    every block is free at the end."""
    from tinyvllm.errors import StepError

    engine = _engine(tiny_model_dir, 9, monkeypatch, num_kv_blocks=64, max_num_seqs=2)
    execute, calls = engine.runner.execute, []

    def failing_third(plan):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return execute(plan)

    monkeypatch.setattr(engine.runner, "execute", failing_third)
    queue = BatchQueue(engine)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, PROMPTS[0], params)
    with pytest.raises(StepError) as failed:
        while engine.has_unfinished_requests():
            queue.step()
    assert set(failed.value.request_ids) == {"a", "b"} and "boom" in str(failed.value)
    assert engine.unfinished_request_ids() == ["c"]   # it was waiting: it runs on
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in queue.step()})
    queue.close()
    assert len(outs["c"].outputs[0].token_ids) == 8
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks and not engine.scheduler.placeholders
