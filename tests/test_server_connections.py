"""The bounds of a connection, on a real `tinyvllm serve` driven over raw sockets: a connection that
sends no complete header, or a body too slowly, is cut off; past --limit-concurrency a request is
answered 503; a kept-alive connection serves request after request. One server for the module,
with timeouts of a second or two."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from test_server import start_server

pytestmark = [pytest.mark.server, pytest.mark.timing]

HEADER_TIMEOUT, BODY_TIMEOUT, KEEP_ALIVE, LIMIT = 1.0, 2.0, 1.0, 4
SLACK = 1.5          # seconds a bound may be late on a loaded machine
GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """(host, port) of the server; on teardown, its output must hold no traceback."""
    proc, url = start_server(tiny_model_dir, "--header-timeout", str(HEADER_TIMEOUT),
                             "--body-timeout", str(BODY_TIMEOUT), "--timeout-keep-alive", str(KEEP_ALIVE),
                             "--limit-concurrency", str(LIMIT), "--max-num-seqs", "4")
    host, port = url.removeprefix("http://").split(":")
    yield url, (host, int(port))
    proc.terminate()
    proc.wait(30)
    out = proc.stdout.read()
    assert "Traceback" not in out and "Exception in ASGI application" not in out, out


def _connect(addr) -> socket.socket:
    return socket.create_connection(addr, timeout=10)


def _until_closed(sock: socket.socket, limit: float, trickle: bytes = b"", every: float = 0.5):
    """Read until the server closes `sock` (or `limit` seconds pass), sending `trickle` one byte
    every `every` seconds meanwhile. (seconds it took or None if still open, bytes read)."""
    t0 = time.monotonic()
    got, next_send, i = b"", t0, 0
    sock.settimeout(0.05)
    while time.monotonic() - t0 < limit:
        if i < len(trickle) and time.monotonic() >= next_send:
            try:
                sock.sendall(trickle[i:i + 1])
            except OSError:                 # reset: the server has closed it
                return time.monotonic() - t0, got
            i, next_send = i + 1, next_send + every
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - t0, got
        if not chunk:
            return time.monotonic() - t0, got
        got += chunk
    return None, got


def _response(data: bytes) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one HTTP response."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One whole response (its body by Content-Length) from a connection that stays open."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    status, headers, body = _response(data)
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return status, headers, body


def _error(body: bytes) -> dict:
    """OpenAI's error object: exactly its four fields."""
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def test_each_flag_is_checked(tiny_model_dir, capsys):
    from tinyvllm.entrypoints.cli import main
    for flag, bad in (("--header-timeout", "0"), ("--body-timeout", "-1"), ("--timeout-keep-alive", "nan"),
                      ("--limit-concurrency", "0")):
        assert main(["serve", str(tiny_model_dir), flag, bad]) == 2, flag
        assert flag in capsys.readouterr().err, flag


def test_an_idle_connection_is_closed_after_the_header_timeout(server):
    _, addr = server
    with _connect(addr) as s:
        took, got = _until_closed(s, HEADER_TIMEOUT + SLACK)
    assert took is not None, "an idle connection was still open"
    assert HEADER_TIMEOUT - 0.2 <= took and got == b""


def test_a_header_sent_a_byte_at_a_time_is_cut_at_the_same_deadline(server):
    _, addr = server
    with _connect(addr) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
        took, got = _until_closed(s, HEADER_TIMEOUT + SLACK, trickle=b"X-Slow: " + b"a" * 40, every=0.2)
    assert took is not None, "a connection trickling its header was still open"
    assert HEADER_TIMEOUT - 0.2 <= took and got == b""
    # on a kept-alive connection the clock starts again with the next request's first bytes
    with _connect(addr) as s:
        s.sendall(GET_HEALTH)
        assert _read_response(s)[0] == 200
        took, got = _until_closed(s, HEADER_TIMEOUT + SLACK, trickle=GET_HEALTH[:-2], every=0.1)
    assert took is not None, "a half-sent second header was still open"
    assert got == b""


def test_a_body_trickled_a_byte_at_a_time_is_answered_408(server):
    _, addr = server
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    with _connect(addr) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        took, got = _until_closed(s, BODY_TIMEOUT + SLACK, trickle=body, every=0.5)
    assert took is not None, f"a trickled body's connection was still open; read {got!r}"
    assert BODY_TIMEOUT - 0.2 <= took
    status, headers, payload = _response(got)
    assert status == 408 and headers["connection"] == "close"
    err = _error(payload)
    assert err["code"] == "request_timeout" and "--body-timeout" in err["message"]


def test_the_rest_of_an_answered_body_does_not_keep_the_connection(server):
    """A body over --max-request-bytes is answered 413 from its declared length, unread; the
    client then has --timeout-keep-alive seconds to finish sending it, not one more per byte."""
    _, addr = server
    with _connect(addr) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n{")
        took, got = _until_closed(s, KEEP_ALIVE + SLACK, trickle=b'"prompt": "' + b"a" * 40, every=0.2)
    assert took is not None, f"a connection still sending an answered body was still open; read {got!r}"
    assert _response(got)[0] == 413


def _served(addr) -> socket.socket:
    """A connection that has had an answer (so the server holds it) and stays open."""
    s = _connect(addr)
    s.sendall(GET_HEALTH)
    assert _read_response(s)[0] == 200
    return s


def test_past_the_concurrency_limit_a_request_is_answered_503(server):
    url, addr = server
    holders = []
    try:
        for _ in range(LIMIT):              # connections 1..LIMIT are served (and kept alive)
            holders.append(_served(addr))
        with _connect(addr) as s:           # connection LIMIT + 1 is not
            s.sendall(GET_HEALTH)
            status, headers, body = _read_response(s)
            assert _until_closed(s, SLACK)[0] is not None
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
        err = _error(body)
        assert err["code"] == "too_many_connections" and "--limit-concurrency" in err["message"]
    finally:
        for h in holders:
            h.close()
    deadline = time.monotonic() + 5         # the server sees the closes at once; allow for load
    while (status := httpx.get(url + "/health", timeout=10).status_code) == 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status == 200


def test_a_kept_alive_connection_serves_requests_past_the_header_timeout(server):
    """The header clock runs per request, not per connection."""
    _, addr = server
    with _connect(addr) as s:
        for i in range(3):
            if i:
                time.sleep(0.6 * HEADER_TIMEOUT)    # the third request comes past the header timeout
            s.sendall(GET_HEALTH)
            assert _read_response(s)[0] == 200


def test_a_completion_still_works_after_all_this(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
