"""A failed step never stops the server: AsyncEngine and the OpenAI app, in this process, with
a tiny model and a step made to fail on purpose. The failed request's client gets an OpenAI
error object (a plain response) or an error event and [DONE] (a stream); every other request is
answered; no KV block is left behind. An error the engine cannot survive stops it and calls
`on_dead`, which the server turns into a non-zero exit."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

import phases
from tinyvllm import SamplingParams
from tinyvllm.errors import StepError
from tinyvllm.entrypoints.server.app import build_app
from tinyvllm.entrypoints.server.async_engine import AsyncEngine, EngineDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class _Boom(Exception):
    pass


class _Fatal(BaseException):  # not an Exception: nothing may swallow it
    pass


def _failing(engine, names: set[str], error=_Boom):
    """Make the engine's runner fail whenever a request whose id contains one of `names` is in
    the plan."""
    execute = engine.runner.execute

    def run(plan):
        if any(name in rid for rid in plan.request_ids() for name in names):
            raise error("injected failure")
        return execute(plan)

    engine.runner.execute = run


@pytest.fixture
def engine(tiny_model_dir, engine_in_this_process):
    # these tests reach into the engine (its runner): in this process (phase 9's core otherwise
    # runs in its own; its failures are its checkpoint's)
    return phases.make_engine(phases.latest_phase(), str(tiny_model_dir), max_num_seqs=1)


async def _collect(ae: AsyncEngine, rid: str, prompt=None):
    outs = [o async for o in ae.generate(rid, prompt or {"prompt_token_ids": [5, 6, 7]}, GREEDY)]
    return outs[-1]


def test_async_engine_survives_a_failed_step(engine):
    _failing(engine, {"bad"})
    ae = AsyncEngine(engine)

    async def main():
        bad = asyncio.ensure_future(_collect(ae, "bad"))
        good = asyncio.ensure_future(_collect(ae, "good", {"prompt_token_ids": [9, 8]}))
        with pytest.raises(StepError, match="injected failure") as e:
            await bad
        assert e.value.request_ids == ["bad"]
        assert len((await good).outputs[0].token_ids) == GREEDY.max_tokens
        later = await _collect(ae, "later")          # the engine still serves
        assert len(later.outputs[0].token_ids) == GREEDY.max_tokens

    try:
        asyncio.run(main())
        assert ae.error is None and ae.num_failed_steps == 1
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    finally:
        ae.shutdown()


def test_a_checked_engine_refuses_a_bad_batch_and_serves_the_others(tiny_model_dir, engine_in_this_process):
    """`--check-kernels` (the default on a CPU): a decode step whose persistent batch points one
    block past the KV pool, for one request only, is refused with an error for that request's
    client, never read by a C kernel; the other requests are answered and the engine serves on."""
    engine = phases.make_engine(phases.latest_phase(), str(tiny_model_dir), max_num_seqs=1, check_kernels=True)
    ib = engine.parts.runner.input_batch
    update = ib.update

    def slipped(seq):   # a bookkeeping slip, for the request named "bad" only
        update(seq)
        if "bad" in seq.group.request_id:
            ib.block_table[ib.row_of[seq.seq_id], 0] = engine.parts.kv_cache.num_blocks

    ib.update = slipped
    ae = AsyncEngine(engine)

    async def main():
        bad = asyncio.ensure_future(_collect(ae, "bad"))
        good = asyncio.ensure_future(_collect(ae, "good", {"prompt_token_ids": [9, 8]}))
        with pytest.raises(StepError, match="InputBatch: row 0 holds seq") as e:
            await bad
        assert e.value.request_ids == ["bad"]
        assert len((await good).outputs[0].token_ids) == GREEDY.max_tokens
        assert len((await _collect(ae, "later")).outputs[0].token_ids) == GREEDY.max_tokens

    try:
        asyncio.run(main())
        assert ae.error is None and ae.num_failed_steps == 1
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    finally:
        ae.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_error_the_engine_cannot_survive_stops_it_and_calls_on_dead(engine):
    _failing(engine, {"bad"}, error=_Fatal)
    dead = []
    ae = AsyncEngine(engine, on_dead=lambda: dead.append(True))

    async def main():
        with pytest.raises(EngineDeadError, match="injected failure"):
            await _collect(ae, "bad")
        with pytest.raises(EngineDeadError):
            await _collect(ae, "after")

    asyncio.run(main())
    ae.shutdown()
    assert dead == [True] and isinstance(ae.error, _Fatal)


def test_the_server_answers_a_failed_step_with_an_error_and_goes_on(engine):
    _failing(engine, {"boom"})
    ae = AsyncEngine(engine)
    app = build_app(ae, "tiny")
    rids = iter(["boom", "ok-1", "boom", "ok-2"])
    import tinyvllm.entrypoints.server.serving_completion as app_module   # where the routes name requests

    class _Ids:  # the app names its requests from uuid4: give them the names above, in order
        def __init__(self):
            self.hex = next(rids)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"prompt": "hi", "max_tokens": 4, "temperature": 0}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 500
            err = r.json()["error"]
            assert err["type"] == "server_error" and err["code"] == "step_failed"
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
            # the stream's first output arrives after the step that fails: a plain 500 error
            assert r.status_code == 500 and r.json()["error"]["code"] == "step_failed"
            r = await client.post("/v1/completions", json={**body, "stream": True})
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert r.status_code == 200 and events[-1] == "[DONE]"
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"

    original = app_module.uuid.uuid4
    app_module.uuid.uuid4 = _Ids
    try:
        asyncio.run(main())
    finally:
        app_module.uuid.uuid4 = original
        ae.shutdown()
    assert ae.error is None and engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_a_stream_cut_by_a_failed_step_ends_with_an_error_event_and_done(engine, monkeypatch):
    """The failure comes after the first tokens reached the handler (so the stream has begun: a
    failure before that is a plain 500, tested above): an error event, then [DONE]."""
    from tinyvllm.entrypoints.server import async_engine

    engine_steps, taken, get = {"n": 0}, threading.Event(), async_engine._Mailbox.get
    execute = engine.runner.execute

    async def get_and_tell(self):
        out = await get(self)
        taken.set()
        return out

    def fails_later(plan):
        engine_steps["n"] += 1
        if engine_steps["n"] == 3:
            assert taken.wait(30), "the handler never took the first tokens"
            raise _Boom("injected failure")
        return execute(plan)

    monkeypatch.setattr(async_engine._Mailbox, "get", get_and_tell)

    engine.runner.execute = fails_later
    ae = AsyncEngine(engine)
    app = build_app(ae, "tiny")

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "temperature": 0,
                                                           "stream": True})
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert r.status_code == 200 and events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "step_failed"
            assert any("choices" in json.loads(e) for e in events[:-2])   # tokens came first

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_health_reports_a_stuck_step(engine):
    """/health answers 503 while one step runs longer than health_step_timeout, 200 again after."""
    execute = engine.runner.execute

    def slow(plan):
        time.sleep(1.5)
        return execute(plan)

    engine.runner.execute = slow
    ae = AsyncEngine(engine)
    app = build_app(ae, "tiny", health_step_timeout=0.5)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            job = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}))
            seen = []
            while not job.done():
                r = await client.get("/health")
                seen.append(r.status_code)
                if r.status_code == 503:
                    assert "stuck" in r.json()["error"]["message"]
                await asyncio.sleep(0.1)
            assert (await job).status_code == 200
            assert 503 in seen, seen
            assert (await client.get("/health")).status_code == 200

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()


def test_bearer_and_host_checks():
    from tinyvllm.entrypoints.server.app import LOOPBACK_NAMES, bearer_matches, host_allowed
    assert bearer_matches("Bearer k3y", "k3y") and bearer_matches("bearer  k3y ", "k3y")
    assert not bearer_matches("Bearer k3", "k3y") and not bearer_matches("k3y", "k3y")
    assert not bearer_matches(None, "k3y") and not bearer_matches("Basic k3y", "k3y")
    for host in ("localhost", "localhost:8000", "127.0.0.1:1", "[::1]:8000", "LOCALHOST", None):
        assert host_allowed(host, LOOPBACK_NAMES), host
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "[::2]:80"):
        assert not host_allowed(host, LOOPBACK_NAMES), host
