"""Load and abuse: one real `tinyvllm serve` on the tiny model, 32 concurrent clients.

Well-formed completions and chats (streamed and not, small max_tokens), a third of them hung up
at a random point (some while preempted: the KV pool holds two full contexts; about 170
preemptions a run), interleaved with abusive requests (values out of range, caps exceeded, bad
JSON, a wrong key or model). Every abusive request gets a 4xx with OpenAI's error object, no
response at all is a 5xx, every well-formed request that stayed gets its answer; afterwards every
KV block comes back and a greedy request answers as it did before the load. A second test
times the well-formed requests with and without the abusers beside them: the abusers may not
slow them by more than 2x at the 99th percentile.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
from test_server import API_KEY, _get, _post, _wait_all_free, start_server

pytestmark = [pytest.mark.server, pytest.mark.timing]

SEED = 20240611                 # which requests hang up, and when: the same each run
NUM_CLIENTS = 32
NUM_WELL_FORMED = 512
ABUSE_ROUNDS = 4               # each abusive request goes out this many times
MAX_REQUEST_BYTES = 2**20       # 1 MiB; the over-cap bodies are 2 MiB
MAX_PROMPT_CHARS = 20_000
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"prompt": "the load test says", "max_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def loaded_server(tiny_model_dir):
    """(process, url, its output lines so far). The output is drained by a thread: nobody
    reading a full pipe would block the server."""
    proc, url = start_server(tiny_model_dir, "--api-key", API_KEY, "--max-num-seqs", "8",
                             "--max-model-len", "128", "--num-kv-blocks", "16",   # a pool that preempts
                             "--max-request-bytes", str(MAX_REQUEST_BYTES),
                             "--max-prompt-chars", str(MAX_PROMPT_CHARS))
    lines: list[str] = []
    drain = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    drain.start()
    yield proc, url, lines
    proc.terminate()    # SIGTERM: uvicorn stops, then re-raises it (exit status -15)
    code = proc.wait(30)
    drain.join(5)
    assert code in (0, -15), f"the server exited {code} on SIGTERM:\n{''.join(lines)[-4000:]}"


# -- the requests ------------------------------------------------------------------------------
def _well_formed(rng: random.Random, i: int) -> dict:
    """One well-formed request, with whether (and when) its client hangs up."""
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    max_tokens = rng.randint(8, 24)
    body: dict = {"max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    if rng.random() < 0.5:
        body.update(temperature=0.8, seed=rng.randint(0, 2**31), top_p=0.9, top_k=40)
    else:
        body["temperature"] = 0
    if rng.random() < 0.2:
        body["n"] = 2
    if rng.random() < 0.2:
        body["stop"] = ["zz", "qq"]
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": f"client {i} asks" + " why" * rng.randint(0, 6)}]
        if rng.random() < 0.2:
            body.update(logprobs=True, top_logprobs=2)
    else:
        body["prompt"] = f"client {i} says" + " hi" * rng.randint(0, 6)
        if rng.random() < 0.2:
            body["logprobs"] = 2
    hang_up = rng.random() < 1 / 3
    return {"kind": f"well-formed {'chat' if chat else 'completion'}{' stream' if stream else ''} #{i}",
            "path": "/v1/chat/completions" if chat else "/v1/completions", "json": body, "expect": 200,
            "hang_up": hang_up,
            "after_events": rng.randint(0, 3),            # a stream: hang up after this many events
            "read_timeout": rng.uniform(0.02, 0.4)}       # not a stream: give up after this long


def _chunks_of(data: bytes):
    async def gen():
        for i in range(0, len(data), 2**16):
            yield data[i:i + 2**16]
    return gen


def _abusive() -> list[dict]:
    """(kind, what to send, the 4xx expected). Each goes out ABUSE_ROUNDS times, at different times."""
    msg = [{"role": "user", "content": "x"}]
    big = json.dumps({"prompt": "x", "user": "u" * (2 * MAX_REQUEST_BYTES)}).encode()
    cases = [
        ("n=10**7", "/v1/completions", {"prompt": "x", "n": 10**7}, 400),
        ("chat stream n=10**7", "/v1/chat/completions", {"messages": msg, "n": 10**7, "stream": True}, 400),
        ("seed=2**70", "/v1/completions", {"prompt": "x", "seed": 2**70}, 400),
        ("logprobs=1000", "/v1/completions", {"prompt": "x", "logprobs": 1000}, 400),
        ("chat top_logprobs=1000", "/v1/chat/completions",
         {"messages": msg, "logprobs": True, "top_logprobs": 1000}, 400),
        ("100 stop strings", "/v1/completions", {"prompt": "x", "stop": [f"s{k}" for k in range(100)]}, 400),
        ("prompt over --max-prompt-chars", "/v1/completions", {"prompt": "x" * (MAX_PROMPT_CHARS + 5000)}, 400),
        ("chat over --max-prompt-chars", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "y" * (MAX_PROMPT_CHARS + 5000)}]}, 400),
        ("max_tokens=-1", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400),
        ("chat max_tokens=-1", "/v1/chat/completions", {"messages": msg, "max_tokens": -1}, 400),
        ("wrong model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404),
        ("temperature=-1", "/v1/completions", {"prompt": "x", "temperature": -1}, 400),
        ("chat stream temperature=-1", "/v1/chat/completions",
         {"messages": msg, "temperature": -1, "stream": True}, 400),
        ("top_p=2", "/v1/completions", {"prompt": "x", "top_p": 2}, 400),
        ("chat top_p=2", "/v1/chat/completions", {"messages": msg, "top_p": 2}, 400),
    ]
    out = [{"kind": k, "path": p, "json": b, "expect": s} for k, p, b, s in cases]
    out += [
        {"kind": "2 MiB body (Content-Length)", "path": "/v1/completions", "content": big, "expect": 413,
         "headers": {"Content-Type": "application/json"}},
        {"kind": "2 MiB body (chunked)", "path": "/v1/completions", "content_gen": _chunks_of(big),
         "expect": 413, "headers": {"Content-Type": "application/json"}},
        {"kind": "malformed JSON", "path": "/v1/completions", "content": b'{"prompt": "x", "max_tokens": 4',
         "expect": 400, "headers": {"Content-Type": "application/json"}},
        {"kind": "wrong API key", "path": "/v1/completions", "json": {"prompt": "x", "max_tokens": 4},
         "expect": 401, "headers": {"Authorization": "Bearer not-the-key"}},
        {"kind": "no API key", "path": "/v1/chat/completions", "json": {"messages": msg, "max_tokens": 4},
         "expect": 401, "headers": {"Authorization": ""}},
    ]
    # extreme but in range (repetition_penalty > 0): the server must answer, not fail
    out += [
        {"kind": "repetition_penalty=1e-300", "path": "/v1/completions", "expect": "200 or 4xx",
         "json": {"prompt": "x y x y", "repetition_penalty": 1e-300, "temperature": 0.8, "max_tokens": 12,
                  "ignore_eos": True}},
        {"kind": "chat stream repetition_penalty=1e-300", "path": "/v1/chat/completions", "expect": "200 or 4xx",
         "json": {"messages": msg, "repetition_penalty": 1e-300, "temperature": 0.8, "max_tokens": 12,
                  "ignore_eos": True, "stream": True}},
    ]
    for case in out:
        case["hang_up"] = False
    return out + _costly_abuse()


def _costly_abuse() -> list[dict]:
    """Requests that once cost the server far more than they should, or reached into other
    requests' steps: values that overflowed a step's tensors, a long stop-id list, a grammar of
    millions of states, a giant role, text that is not Unicode, an uncapped /detokenize."""
    msg = [{"role": "user", "content": "x"}]
    cases = [
        ("top_k=2**70", "/v1/completions", {"prompt": "x", "top_k": 2**70, "top_p": 0.9, "max_tokens": 4}, 400),
        ("temperature=1e308", "/v1/completions", {"prompt": "x", "temperature": 1e308, "max_tokens": 4}, 400),
        ("chat stream temperature=1e308", "/v1/chat/completions",
         {"messages": msg, "temperature": 1e308, "stream": True}, 400),
        ("100,000 stop ids", "/v1/completions", {"prompt": "x", "stop_token_ids": list(range(100_000))}, 400),
        ("1,024 stop ids (the cap)", "/v1/completions", {"prompt": "x", "max_tokens": 8, "min_tokens": 4,
                                                         "stop_token_ids": [300 + k % 20 for k in range(1024)]}, 200),
        ("a role of 900,000 characters", "/v1/chat/completions",
         {"messages": [{"role": "u" * 900_000, "content": "x"}]}, 400),
        ("regex (a{1000}){1000}, n=6", "/v1/completions",
         {"prompt": "x", "n": 6, "max_tokens": 4, "structured_outputs": {"regex": "(a{1000}){1000}"}}, "200 or 4xx"),
        ("n=129, over --max-n", "/v1/completions", {"prompt": "x", "n": 129}, 400),
        ("/detokenize 100,000 ids", "/detokenize", {"tokens": [1] * 100_000}, 400),
    ]
    out = [{"kind": k, "path": p, "json": b, "expect": e, "hang_up": False} for k, p, b, e in cases]
    out += [{"kind": "a lone surrogate", "path": "/v1/completions", "content": b'{"prompt": "\\ud800"}',
             "expect": 400, "headers": {"Content-Type": "application/json"}, "hang_up": False},
            {"kind": "a Host of two hosts", "path": "/v1/completions", "json": {"prompt": "x", "max_tokens": 2},
             "expect": 400, "headers": {"Host": "127.0.0.1:80, evil.example"}, "hang_up": False}]
    return out


def _plan() -> list[dict]:
    rng = random.Random(SEED)
    plan = [_well_formed(rng, i) for i in range(NUM_WELL_FORMED)]
    for _ in range(ABUSE_ROUNDS):
        plan += _abusive()
    rng.shuffle(plan)
    return plan


# -- one request -------------------------------------------------------------------------------
def _is_error_object(body) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and isinstance(err.get("message"), str) and bool(err["message"])
            and isinstance(err.get("type"), str) and bool(err["type"]))


def _check_stream_events(kind: str, lines: list[str], finished: bool, usage: bool) -> list[str]:
    """A well-formed stream's `data:` lines: JSON events, no error event; a finished one ends
    with [DONE] and carries text (and, asked for, a usage with tokens)."""
    problems, text, tokens = [], "", None
    events = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    for ev in events:
        if ev == "[DONE]":
            continue
        obj = json.loads(ev)
        if "error" in obj:
            problems.append(f"{kind}: error event in a 200 stream: {ev[:500]}")
        for c in obj.get("choices") or []:
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
    if finished:
        if not events or events[-1] != "[DONE]":
            problems.append(f"{kind}: the stream did not end with 'data: [DONE]' (last: {events[-1:]})")
        if not text or (usage and not tokens):
            problems.append(f"{kind}: an empty stream (text {text!r}, completion_tokens {tokens})")
    return problems


def _check_plain(kind: str, r: httpx.Response) -> list[str]:
    try:
        body = r.json()
    except ValueError:
        return [f"{kind}: 200 with a body that is not JSON: {r.text[:500]}"]
    texts = [c.get("text") if "text" in c else (c.get("message") or {}).get("content")
             for c in body.get("choices") or []]
    if not texts or not all(texts) or not body.get("usage", {}).get("completion_tokens"):
        return [f"{kind}: 200 with an empty result: {r.text[:500]}"]
    return []


async def _send(client: httpx.AsyncClient, base: str, req: dict) -> dict:
    """Send one request of the plan; what happened: status, problems, whether it hung up."""
    kind, expect = req["kind"], req["expect"]
    headers = {**AUTH, **req.get("headers", {})}
    if not headers.get("Authorization"):
        headers.pop("Authorization")
    kw: dict = {"headers": headers}
    if "json" in req:
        kw["json"] = req["json"]
    elif "content" in req:
        kw["content"] = req["content"]
    else:
        kw["content"] = req["content_gen"]()
    stream = bool(req.get("json", {}).get("stream"))
    res = {"kind": kind, "status": None, "problems": [], "hung_up": False}
    started = time.perf_counter()
    try:
        if stream:
            async with client.stream("POST", base + req["path"], **kw) as r:
                res["status"] = r.status_code
                if r.status_code != 200:
                    await r.aread()
                    res["body"] = r.text
                else:
                    lines, events = [], 0
                    async for line in r.aiter_lines():
                        lines.append(line)
                        if line.startswith("data: "):
                            events += 1
                            if req["hang_up"] and events > req["after_events"]:
                                res["hung_up"] = True
                                break               # leaving the block closes the connection
                    res["problems"] += _check_stream_events(kind, lines, finished=not res["hung_up"],
                                                             usage="stream_options" in req["json"])
        else:
            if req["hang_up"]:
                kw["timeout"] = httpx.Timeout(60, read=req["read_timeout"])
            r = await client.post(base + req["path"], **kw)
            res["status"], res["body"] = r.status_code, r.text
            if r.status_code == 200:
                res["problems"] += _check_plain(kind, r)
    except httpx.TimeoutException as e:
        if not req["hang_up"]:
            res["problems"].append(f"{kind}: no answer in time ({type(e).__name__})")
        res["hung_up"] = True
    except httpx.HTTPError as e:
        res["problems"].append(f"{kind}: transport error {type(e).__name__}: {e}")
        return res
    res["seconds"] = time.perf_counter() - started

    status, body = res["status"], res.get("body", "")
    if status is None:
        return res
    if status >= 500:
        res["problems"].append(f"{kind}: got {status} (a 5xx): {body[:1000]}")
    elif expect == 200:
        if status != 200 and not res["hung_up"]:
            res["problems"].append(f"{kind}: well-formed, got {status}: {body[:500]}")
    elif expect == "200 or 4xx":
        if status != 200:
            try:
                ok = 400 <= status < 500 and _is_error_object(json.loads(body))
            except ValueError:
                ok = False
            if not ok:
                res["problems"].append(f"{kind}: got {status} without an OpenAI error object: {body[:500]}")
    else:
        if status != expect:
            res["problems"].append(f"{kind}: expected {expect}, got {status}: {body[:500]}")
        try:
            if not _is_error_object(json.loads(body)):
                res["problems"].append(f"{kind}: {status} without an OpenAI error object: {body[:500]}")
        except ValueError:
            res["problems"].append(f"{kind}: {status} with a body that is not JSON: {body[:500]}")
    return res


async def _load(base: str, plan: list[dict], num_clients: int = NUM_CLIENTS) -> list[dict]:
    queue: asyncio.Queue = asyncio.Queue()
    for req in plan:
        queue.put_nowait(req)
    results: list[dict] = []

    async def worker():
        async with httpx.AsyncClient(timeout=60) as client:
            while not queue.empty():
                results.append(await _send(client, base, queue.get_nowait()))

    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(num_clients))), timeout=180)
    return results


def _greedy(base: str) -> str:
    r = _post(base, "/v1/completions", GREEDY)
    assert r.status_code == 200, f"the greedy probe got {r.status_code}: {r.text}"
    return r.json()["choices"][0]["text"]


# -- the test ----------------------------------------------------------------------------------
def test_32_clients_hanging_up_and_abusing_leave_the_server_whole(loaded_server):
    proc, base, output = loaded_server
    num_blocks = _get(base, "/v1/engine/state").json()["num_blocks"]
    before = _greedy(base)
    assert before, "the greedy probe answered an empty text"

    plan = _plan()
    t0 = time.time()
    results = asyncio.run(_load(base, plan))
    load_s = time.time() - t0

    failures = [p for res in results for p in res["problems"]]
    assert len(results) == len(plan), f"{len(plan) - len(results)} requests never ran"
    hung_up = sum(r["hung_up"] for r in results)
    answered = sum(r["status"] == 200 and not r["hung_up"] for r in results)
    # the load did what it meant to: hang-ups and answers, both in numbers
    if not (0.2 * NUM_WELL_FORMED <= hung_up <= 0.45 * NUM_WELL_FORMED and answered >= 0.5 * NUM_WELL_FORMED):
        failures.append(f"the load was not the intended mix: {hung_up} hung up, {answered} answered 200")

    try:
        _wait_all_free(base, num_blocks, timeout=20)
    except AssertionError:
        state = _get(base, "/v1/engine/state").json()
        failures.append(f"KV blocks not all free 20 s after the load: {state['num_free_blocks']} of "
                        f"{state['num_blocks']} free; running {state['running']}, waiting {state['waiting']}")
    state = _get(base, "/v1/engine/state").json()
    if state["num_waiting"]:
        failures.append(f"{state['num_waiting']} requests still wait after the load: {state['waiting']}")

    after = _greedy(base)
    if after != before:
        failures.append(f"the greedy probe changed after the load: {before!r} then {after!r}")
    if proc.poll() is not None:
        failures.append(f"the server exited ({proc.returncode}) during the load")
    log = "".join(output)
    if "Traceback" in log:
        failures.append(f"the server logged a traceback:\n{log[-4000:]}")

    assert not failures, (f"{len(failures)} problems in {len(results)} requests ({load_s:.1f} s):\n"
                          + "\n".join(failures))


def _p99(seconds: list[float]) -> float:
    ordered = sorted(seconds)
    return ordered[max(0, int(0.99 * len(ordered) + 0.999) - 1)]


def test_abusers_leave_the_well_formed_requests_p99_within_2x(loaded_server):
    """The same 64 well-formed requests (none hangs up), 16 clients at a time: alone, then with
    the costly abusers mixed in (each four times), then alone again. The well-formed requests'
    p99 latency with the abusers stays within 2x of the slower run without them, and every
    abuser gets its 4xx (or, within the caps, an answer)."""
    _, base, _ = loaded_server
    rng = random.Random(SEED + 1)
    well = [{**_well_formed(rng, i), "hang_up": False} for i in range(64)]
    abuse = [dict(a) for _ in range(4) for a in _costly_abuse()]

    mixed = well + abuse
    random.Random(SEED + 2).shuffle(mixed)
    alone = asyncio.run(_load(base, well, num_clients=16))
    beside = asyncio.run(_load(base, mixed, num_clients=16))
    again = asyncio.run(_load(base, well, num_clients=16))
    problems = [p for res in alone + beside + again for p in res["problems"]]
    assert not problems, "\n".join(problems)
    p99 = {name: _p99([r["seconds"] for r in results if r["kind"].startswith("well-formed")])
           for name, results in (("alone", alone), ("beside", beside), ("again", again))}
    print(f"well-formed p99: {p99['alone']:.2f} s alone, {p99['beside']:.2f} s beside the abusers, "
          f"{p99['again']:.2f} s alone again")
    assert p99["beside"] <= 2 * max(p99["alone"], p99["again"]), (
        f"the abusers slowed the well-formed requests: p99 {p99['beside']:.2f} s beside them, "
        f"{p99['alone']:.2f} s and {p99['again']:.2f} s without")
