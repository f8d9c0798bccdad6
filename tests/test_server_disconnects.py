"""Disconnects and slow readers, in this process: the OpenAI app called as ASGI with a client
that hangs up on a signal, over an engine slowed on purpose. A request whose client goes away
before its first token is aborted while it waits, streaming or not; a slow reader holds one
output per request, not one per step."""

from __future__ import annotations

import asyncio
import json
import time

import phases
from tinyvllm import SamplingParams
from tinyvllm.entrypoints.server.app import build_app
from tinyvllm.entrypoints.server.async_engine import AsyncEngine, _Mailbox


def _slowed(engine, seconds: float):
    execute = engine.runner.execute

    def slow(plan):
        time.sleep(seconds)
        return execute(plan)

    engine.runner.execute = slow


async def _post(app, path: str, body: dict, gone: asyncio.Event) -> list[dict]:
    """One POST through the app as ASGI; the client hangs up once `gone` is set."""
    sent: list[dict] = []
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if pending:
            return pending.pop(0)
        if gone.is_set():                 # returned at once: the app's is_disconnected() sees it
            return {"type": "http.disconnect"}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    return sent


def test_a_client_gone_before_its_first_token_is_aborted_while_it_waits(tiny_model_dir, engine_in_this_process):
    engine = phases.make_engine(phases.latest_phase(), str(tiny_model_dir), max_num_seqs=1)
    _slowed(engine, 0.05)
    ae = AsyncEngine(engine)
    app = build_app(ae, "tiny")

    async def main():
        blocker = asyncio.ensure_future(_collect(ae))      # holds the only seat for ~2 s
        await asyncio.sleep(0.2)
        for stream in (False, True):
            gone = asyncio.Event()
            call = asyncio.ensure_future(_post(app, "/v1/completions", {
                "prompt": "waits", "max_tokens": 8, "stream": stream}, gone))
            await asyncio.sleep(0.3)
            assert len(engine.scheduler.waiting) == 1            # queued behind the blocker
            gone.set()                                            # the client hangs up
            sent = await asyncio.wait_for(call, 5)
            assert sent[0]["status"] == 499
            for _ in range(100):                                  # the engine thread's next turn
                if not engine.scheduler.waiting:
                    break
                await asyncio.sleep(0.02)
            assert not engine.scheduler.waiting and list(engine.groups) == ["blocker"]
        await blocker

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


async def _collect(ae: AsyncEngine):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return [o async for o in ae.generate("blocker", {"prompt_token_ids": [5, 6, 7]}, params)][-1]


def test_a_slow_reader_holds_one_output_not_one_per_step():
    async def main():
        box = _Mailbox()
        for i in range(1000):          # a thousand steps' outputs before the reader looks
            box.put(i)
        assert await box.get() == 999 and box.latest is None
        box.put(RuntimeError("failed"))
        box.put(1001)                  # an error is never overwritten by a later output
        assert isinstance(await box.get(), RuntimeError)

    asyncio.run(main())
