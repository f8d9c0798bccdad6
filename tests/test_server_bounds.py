"""The server's bounds that are checked in one process (the app over an AsyncEngine, through
httpx's ASGI transport): the waiting bound counts sequences, /health tells why only to a caller
with the key, the metrics forget every request a handler started, a chat's template variables
count toward the prompt cap, and an unexpected error's text goes to the log, not the client."""

from __future__ import annotations

import asyncio
import json
import re

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


def _client(app, **transport):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, **transport), base_url="http://localhost",
                             headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def _post(app, path: str, body: dict, **transport) -> httpx.Response:
    async def post():
        async with _client(app, **transport) as client:
            return await client.post(path, json=body)
    return asyncio.run(post())


def test_chat_template_kwargs_count_toward_the_prompt_cap(tiny_model_dir):
    """A short chat with a template variable longer than the cap is refused before the template
    renders it (the template may put any variable in the prompt), as a long message is."""
    ae, app = _app(LLM(str(tiny_model_dir)).llm_engine)
    try:
        cap = 512 * 50                       # the tiny model's max_model_len, times the characters a token
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        for path in ("/v1/chat/completions", "/tokenize"):
            assert _post(app, path, {**chat, "chat_template_kwargs": {"notes": "x" * 100}}).status_code == 200
            r = _post(app, path, {**chat, "chat_template_kwargs": {"notes": "x" * cap}})
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
    finally:
        ae.shutdown()


def test_an_unexpected_error_is_a_500_without_its_text(tiny_model_dir, caplog):
    """A bug's exception (here the tokenizer's, its text holding a path) is answered 500 "internal
    error" with an id; the text and the traceback are in the server's log, beside that id."""
    ae, app = _app(LLM(str(tiny_model_dir)).llm_engine)

    def broken(*args, **kwargs):
        raise RuntimeError("cannot read /home/someone/private/notes.txt")

    ae.tokenizer.encode = broken
    try:
        r = _post(app, "/tokenize", {"prompt": "hi"}, raise_app_exceptions=False)
    finally:
        ae.shutdown()
    assert r.status_code == 500
    err = r.json()["error"]
    assert "/home/someone" not in r.text and "RuntimeError" not in r.text
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    error_id = re.fullmatch(r"internal error \(request id (err-[0-9a-f]{16})\): the server's log has the details",
                            err["message"]).group(1)
    logged = [rec for rec in caplog.records if error_id in rec.getMessage()]
    assert logged and "/home/someone/private/notes.txt" in caplog.text


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
        state = engine.snapshot()   # the engine's blocks, where it runs (phase 9: its core process)
        assert state["num_free_blocks"] == state["num_blocks"]
    finally:
        ae.shutdown()


# -- any value a request can carry -------------------------------------------------------------

HUGE = [3.5e38, 1e39, 1e100, 1e308, 2**64, 2**70, 10**30]
EDGES = [0, 1, -1, 2, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, 2**70, -(2**70), 0.5, 1e-300, 1e38, 3.5e38,
         1e308, -1e308, float("nan"), float("inf"), float("-inf"), True, "1", None, [], {}]


def _requests(vocab: int):
    """Whole /v1/completions bodies: a few fields with values the server takes, and one wild
    one, drawn from its type's full range, weighted toward huge magnitudes, and from the edges
    of every range (a request of several wild fields is refused for its first, and tests nothing
    of the others)."""
    from hypothesis import strategies as st
    wild_number = st.one_of(st.sampled_from(EDGES), st.sampled_from(HUGE), st.integers(-(2**70), 2**70),
                            st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=1e30))
    text = st.one_of(st.text(max_size=12), st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                                                   min_size=1, max_size=3),
                     st.sampled_from(["", "x" * 30_000, "\x00", "\u202e", "\U0010ffff"]))
    ids = st.one_of(st.lists(wild_number, max_size=6), st.just(list(range(5000))), st.just([10**6]))
    ok_ids = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=5)
    valid = {
        "n": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
        "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "seed": st.integers(-(2**63), 2**63 - 1),
        "max_tokens": st.integers(1, 12), "min_tokens": st.integers(0, 2), "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.01, 10),
        "logprobs": st.integers(0, 5), "stop": st.lists(st.text("abc ", min_size=1, max_size=3), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, vocab - 1), max_size=4), "ignore_eos": st.booleans(),
        "echo": st.booleans(),
        "structured_outputs": st.sampled_from([{"choice": ["yes", "no"]}, {"regex": "[ab]{1,3}"}]),
    }
    wild = {name: wild_number for name in valid}
    wild.update(stop=st.one_of(text, st.lists(text, max_size=20)), stop_token_ids=ids,
                structured_outputs=st.dictionaries(st.sampled_from(["regex", "choice", "json", "grammar"]), text,
                                                   max_size=2))

    @st.composite
    def request(draw):
        body = {"prompt": draw(st.one_of(st.text("abcdef ", min_size=1, max_size=20), ok_ids,
                                         st.lists(ok_ids, min_size=1, max_size=2), text, ids)),
                "max_tokens": 4}
        for name in draw(st.lists(st.sampled_from(sorted(valid)), unique=True, max_size=4)):
            body[name] = draw(valid[name])
        name = draw(st.sampled_from(sorted(wild)))
        body[name] = draw(wild[name])
        return body

    return request()


def test_no_value_a_request_carries_hurts_another(tiny_model_dir):
    """Property: whatever a request carries, it gets a 400 naming one of its fields or a normal
    answer (200, tokens of the vocabulary), and a greedy request running beside it gets exactly
    its own tokens."""
    pytest.importorskip("hypothesis", reason="the property test needs the dev extras: pip install -e '.[dev]'")
    from hypothesis import HealthCheck, example, given, settings

    engine = LLM(str(tiny_model_dir), max_num_seqs=8).llm_engine
    ae, app = _app(engine)
    vocab = engine.model_config.vocab_size
    victim = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    want = LLM(str(tiny_model_dir)).generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    want_text = engine.tokenizer.decode(want)
    loop = asyncio.new_event_loop()
    client = _client(app)

    @settings(max_examples=100, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=_requests(vocab))
    # and always the values of known attacks: each once overflowed a tensor of a step it shared
    @example(body={"prompt": "x", "top_k": 2**70, "top_p": 0.9})
    @example(body={"prompt": "x", "temperature": 1e308, "n": 2})
    @example(body={"prompt": "x", "temperature": 3.5e38, "top_p": 0.5})
    @example(body={"prompt": "x", "repetition_penalty": 1e308, "logprobs": 2})
    @example(body={"prompt": "x", "stop_token_ids": list(range(5000)), "n": 3})
    @example(body={"prompt": "\ud800", "max_tokens": 2})
    def check(body):

        async def both():
            # json.dumps as a client may write it: NaN, Infinity and \\ud800 escapes included
            raw = json.dumps(body).encode()
            return await asyncio.gather(client.post("/v1/completions", json=victim),
                                        client.post("/v1/completions", content=raw,
                                                    headers={"Content-Type": "application/json"}))
        v, r = loop.run_until_complete(both())
        assert v.status_code == 200 and v.json()["choices"][0]["text"] == want_text, (body, v.text)
        assert r.status_code in (200, 400), (body, r.status_code, r.text[:300])
        if r.status_code == 400:
            assert r.json()["error"]["param"] in body, (body, r.json())
        else:
            choices = r.json()["choices"]
            assert choices and all(c["finish_reason"] in ("stop", "length") for c in choices), (body, r.text[:300])

    try:
        check()
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
        ae.shutdown()
