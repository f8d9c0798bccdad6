"""The OpenAI-compatible server: a real `tinyvllm serve` in a subprocess on a free port, a tiny
random model, driven by the official `openai` client and plain HTTP. One server per module."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.entrypoints.bench.serve import start_builtin_server

pytestmark = pytest.mark.server
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key"


def start_server(model_dir: Path, *extra: str):
    """`tinyvllm serve` on a free port, its output captured; (process, base url) once it answers."""
    return start_builtin_server([str(model_dir), "--log-level", "warning", "--served-model-name", "tiny",
                                 *extra], timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    proc, url = start_server(tiny_model_dir, "--api-key", API_KEY, "--max-num-seqs", "8")
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(str(tiny_model_dir), max_num_seqs=8)


def _post(server, path, body, key=API_KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server + path, json=body, headers=headers, timeout=60, **kw)


def _get(server, path, key=API_KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server + path, headers={**headers, **kw.pop("headers", {})}, timeout=60, **kw)


def _metric(server, name) -> float:
    text = _get(server, "/metrics").text
    m = re.search(rf"^tinyvllm:{name} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


# -- the API, through the openai client ---------------------------------------------------------
def test_models_health_and_tokenize(server, client, offline):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server + "/health").status_code == 200
    ids = _post(server, "/tokenize", {"prompt": "hello world"}).json()["tokens"]
    assert ids == offline.get_tokenizer().encode("hello world")
    text = _post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text == offline.get_tokenizer().decode(ids, skip_special_tokens=False)


def test_chat_template_kwargs_are_checked_and_passed(server, offline):
    """vLLM's `chat_template_kwargs`: more variables for the template (unused ones change
    nothing); a name the engine sets itself is a 400 naming the field."""
    msgs = [{"role": "user", "content": "hi"}]
    want = offline.get_tokenizer().encode(offline.get_tokenizer().apply_chat_template(msgs),
                                          add_special_tokens=False)
    got = _post(server, "/tokenize", {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})
    assert got.json()["tokens"] == want
    for path, body in (("/tokenize", {"messages": msgs}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 2})):
        r = _post(server, path, {**body, "chat_template_kwargs": {"messages": []}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        assert "'messages' is set by the engine" in r.json()["error"]["message"]


def test_greedy_completions_equal_offline_generate(client, offline):
    prompts = ["hello there", "a b c d e", "the quick brown fox"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = offline.generate(prompts, params, use_tqdm=False)
    got = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in got.choices] == [w.outputs[0].text for w in want]
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert got.usage.completion_tokens == 3 * 8
    assert got.usage.total_tokens == got.usage.prompt_tokens + 24
    # token ids as the prompt give the same answer
    ids = offline.get_tokenizer().encode(prompts[0])
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == want[0].outputs[0].text


def test_streamed_completion_equals_unstreamed(client):
    kw = {"model": "tiny", "prompt": "once upon", "max_tokens": 10, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streamed_and_not(client, offline):
    messages = [{"role": "user", "content": "hi there"}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0]
    got = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == 8
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_n_seed_stop_and_logprobs(client, offline):
    kw = {"model": "tiny", "prompt": "seed test", "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 2,
              "extra_body": {"ignore_eos": True}}
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert len(a.choices) == 2 and [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 12
    # stop: the answer ends before the stop string, finish_reason "stop"
    full = client.completions.create(model="tiny", prompt="stop test", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[3:5]
    cut = client.completions.create(model="tiny", prompt="stop test", max_tokens=12, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]
    # logprobs equal the offline engine's
    lp = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0, logprobs=2,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    want = offline.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert lp.token_logprobs == pytest.approx([s[t].logprob for t, s in zip(want.token_ids, want.logprobs)],
                                              abs=1e-4)
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    assert len(chat.choices[0].logprobs.content) == 3
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)


def test_32_concurrent_streams_each_get_offline_tokens(server, offline):
    prompts = [f"request {i} says" + " hi" * (i % 5) for i in range(32)]
    max_tokens = [4 + i % 7 for i in range(32)]
    want = offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                                      for m in max_tokens], use_tqdm=False)
    aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY)

    async def one(p, m):
        text, n = "", 0
        stream = await aclient.completions.create(model="tiny", prompt=p, max_tokens=m, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                n = chunk.usage.completion_tokens
        return text, n

    async def main():
        return await asyncio.gather(*(one(p, m) for p, m in zip(prompts, max_tokens)))

    got = asyncio.run(main())
    assert [g[0] for g in got] == [w.outputs[0].text for w in want]
    assert [g[1] for g in got] == max_tokens


def test_disconnect_mid_stream_frees_blocks(server):
    _wait_idle(server)   # the streams of the test before may still be finishing
    free_before = _metric(server, "num_free_blocks")
    with httpx.stream("POST", server + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"prompt": "a long one", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                            "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data:"):
                break
        assert _metric(server, "num_free_blocks") < free_before   # it holds blocks while running
    deadline = time.time() + 20
    while time.time() < deadline and _metric(server, "num_free_blocks") != free_before:
        time.sleep(0.1)
    assert _metric(server, "num_free_blocks") == free_before
    assert _metric(server, "num_requests_running") == 0


def _wait_all_free(server, free_before, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline and (_metric(server, "num_free_blocks") != free_before
                                      or _metric(server, "num_requests_running") != 0):
        time.sleep(0.1)
    assert _metric(server, "num_free_blocks") == free_before
    assert _metric(server, "num_requests_running") == 0


def test_a_non_streaming_client_that_goes_away_is_aborted(server):
    """A non-streaming request whose client hangs up mid-generation is aborted: every KV block
    comes back. (A chat with no max_tokens would otherwise generate to the end of the context
    for nobody.)"""
    _wait_idle(server)   # an earlier test's client that went away may still be counted
    free_before, aborted_before = _metric(server, "num_free_blocks"), _aborted(server)
    # nearly the tiny model's whole context (512): hundreds of steps, where the client waits 50 ms
    body = {"prompt": "a long one", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, json=body,
                   timeout=httpx.Timeout(60, read=0.05))
    _wait_all_free(server, free_before)
    assert _aborted(server) >= aborted_before + 1   # aborted, not run to its end


def _wait_idle(server, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline and (_metric(server, "num_requests_running")
                                      or _metric(server, "num_requests_waiting")):
        time.sleep(0.05)


def _aborted(server) -> float:
    m = re.search(r'^tinyvllm:request_success_total\{finished_reason="abort"\} (\S+)$',
                  _get(server, "/metrics").text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


# -- bad input: OpenAI's error object with a 4xx naming the parameter; the server goes on --------
BAD = [
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 2}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ({"prompt": "x " * 2000}, 400, "prompt"),
    ({"prompt": [99999]}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "seed": 2**70}, 400, "seed"),
    ({"prompt": "x", "n": 10**7}, 400, "n"),
    ({"prompt": "x", "stop": ["s"] * 17}, 400, "stop"),
    ({"prompt": "x", "stop": "s" * 2000}, 400, "stop"),
    ({"prompt": ["x"] * 65}, 400, "prompt"),
    ({"prompt": "x" * 26_000}, 400, "prompt"),   # over max_model_len (512) x 50 characters
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     400, "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema",
                                         "json_schema": {"schema": {"type": "no-such-type"}}}},
     400, "response_format"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, 400, "response_format"),
    ({"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}, 400, "structured_outputs"),
    ({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"prompt": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"prompt": "x", "logit_bias": {"42": 100}}, 400, "logit_bias"),
    # values that overflow the sampler's tensors, or cost every token a scan
    ({"prompt": "x", "top_k": 2**70, "top_p": 0.9}, 400, "top_k"),
    ({"prompt": "x", "top_k": 100_000}, 400, "top_k"),              # above the vocabulary
    ({"prompt": "x", "temperature": 1e308}, 400, "temperature"),
    ({"prompt": "x", "repetition_penalty": 1e308}, 400, "repetition_penalty"),
    ({"prompt": "x", "stop_token_ids": list(range(2000))}, 400, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ({"prompt": "x", "n": 2, "min_tokens": 2**70}, 400, "min_tokens"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_input_gets_error_object(server, body, status, param):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    ok = _post(server, "/v1/completions", {"prompt": "fine", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_bad_value_beside_a_running_stream_leaves_it_whole(server, client, offline):
    """A request whose values are out of range is refused when it is made (a 400 naming the
    field), so it never joins a step: a stream running beside it gets every token it would get
    alone."""
    want = offline.generate(["victim"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text

    async def main():
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            async def victim():
                text = ""
                async with c.stream("POST", server + "/v1/completions", json={
                        "prompt": "victim", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                        "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            body = json.loads(line[6:])
                            assert "error" not in body, body
                            text += body["choices"][0]["text"]
                return text

            async def attackers():
                await asyncio.sleep(0.05)
                return [await c.post(server + "/v1/completions", json={"prompt": "x", "max_tokens": 4, **bad})
                        for bad in ({"top_k": 2**70, "top_p": 0.9}, {"temperature": 1e308, "top_k": 2**70},
                                    {"temperature": 1e308})]
            return await asyncio.gather(victim(), attackers())

    text, refused = asyncio.run(main())
    assert text == want
    for r in refused:
        assert r.status_code == 400 and r.json()["error"]["param"] in ("top_k", "temperature"), r.text
        assert "victim" not in r.text


def test_text_that_is_not_unicode_is_a_400_naming_the_field(server):
    """JSON can escape a lone surrogate; no tokenizer takes one."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for path, body, param in [
            ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
            ("/v1/completions", '{"prompt": "\\udfff", "max_tokens": 2}', "prompt"),
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', "messages"),
            ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}', "stop")]:
        r = httpx.post(server + path, content=body, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
        assert "Unicode" in r.json()["error"]["message"]


def test_every_field_of_a_message_counts_toward_the_prompt_cap(server):
    """A 30,000-character role (extra fields are allowed too) is refused before it is tokenized."""
    for message in ({"role": "u" * 30_000, "content": "hi"}, {"role": "user", "content": "hi", "name": "n" * 30_000}):
        for path in ("/v1/chat/completions", "/tokenize"):
            r = _post(server, path, {"messages": [message]})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "messages" and r.json()["error"]["code"] == "context_length_exceeded"


def test_detokenize_is_capped(server):
    r = _post(server, "/detokenize", {"tokens": [1] * 600})       # max_model_len is 512
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert _post(server, "/detokenize", {"tokens": [1] * 500}).status_code == 200


def test_echo_returns_the_prompt_for_text_and_token_ids_streamed_or_not(server, offline):
    tok = offline.get_tokenizer()
    ids = tok.encode("echo me")
    for prompt, shown in (("echo me", "echo me"), (ids, tok.decode(ids, skip_special_tokens=False))):
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "echo": True}
        plain = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
        assert plain.startswith(shown) and len(plain) > len(shown), plain
        r = _post(server, "/v1/completions", {**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert chunks[0]["choices"][0]["text"].startswith(shown)
        assert "".join(c["choices"][0]["text"] for c in chunks) == plain


def test_response_format_and_structured_outputs(server, client):
    """OpenAI's response_format (a JSON schema or any JSON object) and vLLM's structured_outputs
    constrain what the tiny random model writes."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    # JSON may have whitespace between its tokens, and a random model likes it: a prefix, then
    assert chat.choices[0].message.content.startswith("{"), chat
    compact = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    assert isinstance(json.loads(compact.choices[0].message.content)["ok"], bool), compact
    assert compact.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="tiny", prompt="x", max_tokens=20, temperature=0, stream=True,
                                       extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert "".join(c.choices[0].text for c in chunks) in ("red", "green")
    anything = client.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}})
    assert anything.choices[0].text.lstrip().startswith("{"), anything


def test_tools_on_a_server_without_auto_tool_choice(server, client):
    """Without --enable-auto-tool-choice, tools with tool_choice "auto" (their default) are a 400
    naming tool_choice, as on vLLM; a named function needs no flag (tests/test_server_tools.py
    has the rest)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "tools": [tool]}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    named = client.chat.completions.create(model="tiny", tool_choice={"type": "function", "function": {"name": "f"}},
                                           **body)
    assert isinstance(json.loads(named.choices[0].message.tool_calls[0].function.arguments)["ok"], bool)


def test_a_body_over_the_cap_is_refused_with_413(server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    big = json.dumps({"prompt": "x", "user": "u" * (9 * 2**20)}).encode()      # over 8 MiB
    r = httpx.post(server + "/v1/completions", headers=headers, content=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "x", "user": "'
        for _ in range(10):
            yield b"u" * 2**20
        yield b'"}'
    r = httpx.post(server + "/v1/completions", headers=headers, content=chunks(), timeout=60)
    assert r.status_code == 413
    assert httpx.post(server + "/v1/completions", headers=headers, timeout=60,
                      json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_invalid_json_bad_chat_and_auth(server):
    r = httpx.post(server + "/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = _post(server, "/v1/chat/completions", {"messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_k": -5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    for key in (None, "wrong"):
        r = _post(server, "/v1/completions", {"prompt": "x"}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_the_key_guards_everything_but_the_page_and_health(server):
    """As llama.cpp's server: with --api-key only / and /health are open; the engine state, the
    metrics (prefix-cache counters probe other users' prompts), the tokenizer and the schema need
    the key. The scheme's case does not matter; a key of the right length but wrong is refused."""
    guarded = [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/engine/state"),
               ("GET", "/openapi.json"), ("GET", "/docs"), ("POST", "/tokenize"), ("POST", "/detokenize"),
               ("POST", "/v1/completions")]
    for method, path in guarded:
        for headers in ({}, {"Authorization": f"Bearer {'x' * len(API_KEY)}"}, {"Authorization": API_KEY}):
            r = httpx.request(method, server + path, headers=headers, json={}, timeout=60)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path, headers)
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = httpx.get(server + "/v1/engine/state", headers={"Authorization": f"{scheme} {API_KEY}"}, timeout=60)
        assert r.status_code == 200, scheme
    assert httpx.get(server + "/health", timeout=60).status_code == 200
    assert httpx.get(server + "/", timeout=60).status_code == 200


def test_a_loopback_server_answers_only_loopback_names(server):
    """DNS rebinding: a page on evil.example that points its name at 127.0.0.1 sends that Host."""
    port = server.rsplit(":", 1)[1]
    r = httpx.get(server + "/health", headers={"Host": f"evil.example:{port}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        assert httpx.get(server + "/health", headers={"Host": host}, timeout=60).status_code == 200, host
    for host in ("[::1]evil.example", f"127.0.0.1:{port}, evil.example", "localhost:80:80", "[::1", "localhost evil"):
        r = httpx.get(server + "/health", headers={"Host": host}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host


def test_an_empty_api_key_is_refused(tiny_model_dir, capsys, monkeypatch):
    from tinyvllm.entrypoints.cli import main
    assert main(["serve", str(tiny_model_dir), "--api-key", ""]) == 2
    assert "empty" in capsys.readouterr().err
    monkeypatch.setenv("TINYVLLM_API_KEY", " ")
    assert main(["serve", str(tiny_model_dir)]) == 2
    assert "TINYVLLM_API_KEY" in capsys.readouterr().err
    assert "TINYVLLM_API_KEY" not in os.environ     # taken out before anything was started


def test_the_api_key_flag_says_that_ps_shows_it(capsys):
    """A flag's value is on the command line, which every user of the machine reads with `ps`: the
    help says so, and points at the variable."""
    from tinyvllm.entrypoints.cli import main
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "shows in `ps` to every user of this machine: prefer TINYVLLM_API_KEY" in text


def test_metrics_have_vllm_names(server):
    text = _get(server, "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count"):
        assert f"tinyvllm:{name}" in text, name
    state = _get(server, "/v1/engine/state").json()
    assert state["num_blocks"] >= state["num_free_blocks"] > 0


def test_schemathesis_finds_no_5xx(server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    schema = schemathesis.openapi.from_url(server + "/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"})
    failures = []
    for op in schema.get_all_operations():
        operation = op.ok()
        if operation.method.upper() != "POST":
            continue

        @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def check(case):
            if isinstance(case.body, dict) and "max_tokens" in case.body:
                case.body["max_tokens"] = min(case.body["max_tokens"] or 1, 4) if isinstance(
                    case.body["max_tokens"], int) else case.body["max_tokens"]
            r = case.call(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
            if r.status_code >= 500:
                failures.append((case.path, case.body, r.status_code, r.text[:200]))
        check()
    assert not failures, failures


def test_the_waiting_queue_is_bounded_by_default():
    import argparse

    from tinyvllm.entrypoints.server.cli import DEFAULT_MAX_NUM_WAITING, add_serve_parser
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve"]).max_num_waiting == DEFAULT_MAX_NUM_WAITING > 0


def test_queue_bound_and_sigterm(tiny_model_dir):
    proc, url = start_server(tiny_model_dir, "--max-num-waiting", "1", "--max-num-seqs", "1")
    try:
        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"prompt": "x", "max_tokens": 60, "ignore_eos": True}
                return await asyncio.gather(*(c.post(url + "/v1/completions", json=body) for _ in range(6)))
        responses = asyncio.run(main())
        codes = sorted(r.status_code for r in responses)
        assert 503 in codes and 200 in codes, codes
        assert all(c in (200, 503) for c in codes)
        assert all(r.headers.get("retry-after") == "1" for r in responses if r.status_code == 503)
    finally:
        proc.terminate()   # SIGTERM: stop accepting, finish, exit
        # uvicorn shuts down, then re-raises the signal it caught: exit status -SIGTERM
        assert proc.wait(30) in (0, -15)
        out = proc.stdout.read()
        assert "Traceback" not in out, out


def test_bench_serve_against_the_server(server, tiny_model_dir, tmp_path):
    from tinyvllm.entrypoints.cli import main
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", server, "--api-key", API_KEY, "--model", str(tiny_model_dir),
               "--num-prompts", "6", "--dataset", "random", "--input-len", "12", "--output-len", "5",
               "--request-rate", "50", "--goodput", "ttft:60000", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["total_output_tokens"] == 6 * 5
    assert report["goodput"] == pytest.approx(report["request_throughput"])   # a target all meet
    for k in ("ttft", "tpot", "itl", "e2e"):
        assert 0 < report[k]["median_ms"] <= report[k]["p99_ms"]
    assert report["ttft"]["mean_ms"] < report["e2e"]["mean_ms"]
    # the machine named, and the run as a row a page's table renders (scripts/bench_tables.py)
    from tinyvllm import platform
    assert report["machine"]["cpu_kind"] == platform.current().kind and report["machine"]["cores"] >= 1
    [row] = report["rows"]
    assert row["server"] == server and row["clients"] == 6 and row["failed"] == 0
    assert row["output_tok_s"] == round(report["output_throughput"], 1)
    assert row["itl_p99_ms"] == report["itl"]["p99_ms"]


def test_bench_serve_sends_long_prompts_beside_the_requests(server, tiny_model_dir, tmp_path):
    """--background-rate: long prompts keep arriving while the requests run, reported apart (the
    requests' own numbers do not count them); the row names them and the label."""
    from tinyvllm.entrypoints.cli import main
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", server, "--api-key", API_KEY, "--model", str(tiny_model_dir),
               "--num-prompts", "4", "--dataset", "random", "--input-len", "8", "--output-len", "24",
               "--request-rate", "8", "--background-rate", "20", "--background-input-len", "200",
               "--label", "one server", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    bg = report["background"]
    assert report["completed"] == 4 and report["total_output_tokens"] == 4 * 24
    assert report["total_input_tokens"] == 4 * 8
    assert bg["completed"] >= 1 and bg["total_input_tokens"] == 200 * bg["completed"] and bg["failed"] == 0
    assert (bg["input_len"], bg["output_len"], bg["request_rate"]) == (200, 1, 20)
    [row] = report["rows"]
    assert row["server"] == "one server" and row["background"] == "200-token prompts at 20/s"


@pytest.mark.parametrize("rate", ["-1", "inf", "nan"])
def test_bench_serve_refuses_a_bad_background_rate_by_name(tiny_model_dir, rate, capsys):
    from tinyvllm.entrypoints.cli import main
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--model", str(tiny_model_dir),
                 "--num-prompts", "1", "--background-rate", rate]) == 2
    assert "--background-rate must be a number of requests a second > 0" in capsys.readouterr().err


@pytest.mark.parametrize("phase", [1, 2])
def test_every_phase_can_be_served(tiny_model_dir, phase):
    """Every phase runs the one engine loop, so the server drives phases 1 and 2 as it does the
    others: two requests at once, each answered in full, and the live page's state."""
    from tinyvllm.entrypoints.server import AsyncEngine
    engine = LLM(str(tiny_model_dir), phase=phase).llm_engine
    ae = AsyncEngine(engine)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def one(rid):
        return [o async for o in ae.generate(rid, {"prompt_token_ids": [5, 6, 7]}, params)][-1]

    async def main():
        return await asyncio.gather(one("a"), one("b"))

    try:
        outs = asyncio.run(main())
        assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5] and outs[0].finished
        assert engine.snapshot()["phase"] == phase
    finally:
        ae.shutdown()
