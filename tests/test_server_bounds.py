"""The server's bounds that are checked in one process (the app over an AsyncEngine, through
httpx's ASGI transport): the waiting bound counts sequences, /health tells why only to a caller
with the key, and the metrics forget every request a handler started."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tinyvllm import LLM, SamplingParams

pytestmark = pytest.mark.server
KEY = "k"


def _app(engine, **kw):
    from tinyvllm.entrypoints.server import AsyncEngine
    from tinyvllm.entrypoints.server.app import build_app
    ae = AsyncEngine(engine, **kw)
    return ae, build_app(ae, "tiny", api_key=KEY)


def _client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost",
                             headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_the_waiting_bound_counts_sequences_not_requests(tiny_model_dir):
    """Six concurrent requests of n=4 against a bound of 8 waiting sequences: at most the two
    whose 8 sequences fit (and one more seat's worth) are taken; n above the bound is a 400."""
    from tinyvllm.entrypoints.server.async_engine import QueueFullError
    engine = LLM(str(tiny_model_dir), max_num_seqs=1).llm_engine
    ae, _ = _app(engine, max_num_waiting=8)
    params = SamplingParams(n=4, max_tokens=20, ignore_eos=True)

    async def one(i):
        try:
            return [o async for o in ae.generate(f"r{i}", {"prompt_token_ids": [5, 6, 7]}, params)][-1]
        except QueueFullError:
            return None

    async def main():
        return await asyncio.gather(*(one(i) for i in range(6)))

    try:
        outs = asyncio.run(main())
        taken = [o for o in outs if o is not None]
        assert 1 <= len(taken) <= 2, f"{len(taken)} requests of 4 sequences taken under a bound of 8"
        assert all(len(c.token_ids) == 20 for o in taken for c in o.outputs)
        with pytest.raises(ValueError, match="n .*--max-num-waiting"):
            asyncio.run(_first(ae, SamplingParams(n=9)))
    finally:
        ae.shutdown()


async def _first(ae, params):
    return [o async for o in ae.generate("big", {"prompt_token_ids": [5]}, params)]


def test_health_tells_why_only_to_a_caller_with_the_key(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), max_num_seqs=1).llm_engine
    ae, app = _app(engine)

    async def main():
        async with _client(app) as c:
            assert (await c.get("/health", headers={"Authorization": ""})).status_code == 200
            ae.error = RuntimeError("a secret detail of the engine")
            anon = await c.get("/health", headers={"Authorization": ""})
            keyed = await c.get("/health")
            return anon, keyed

    try:
        anon, keyed = asyncio.run(main())
        assert anon.status_code == keyed.status_code == 503
        assert "secret" not in anon.text and anon.json()["error"]["message"] == "unhealthy"
        assert "a secret detail of the engine" in keyed.json()["error"]["message"]
    finally:
        ae.error = None
        ae.shutdown()


def test_the_metrics_forget_every_request_a_handler_started(tiny_model_dir):
    """A multi-prompt request whose third prompt is refused ends the two it started; a stream
    read to its end, and one left after its first chunk, end too: the metrics follow none."""
    engine = LLM(str(tiny_model_dir), max_num_seqs=4).llm_engine
    ae, app = _app(engine)
    metrics = app.state.metrics

    async def main():
        async with _client(app) as c:
            r = await c.post("/v1/completions", json={"prompt": [[5, 6], [7, 8], [10**6]], "max_tokens": 30,
                                                      "ignore_eos": True})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            ok = await c.post("/v1/completions", json={"prompt": [[5, 6], [7, 8]], "max_tokens": 3})
            assert ok.status_code == 200
            async with c.stream("POST", "/v1/completions", json={"prompt": [[5, 6], [7, 8]], "max_tokens": 30,
                                                                 "ignore_eos": True, "stream": True}) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data: {"):
                        break                      # the client stops reading and goes away
        for _ in range(100):                       # the engine thread aborts them at its next turn
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)

    try:
        asyncio.run(main())
        assert metrics.num_open == 0 and not metrics._last
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    finally:
        ae.shutdown()
