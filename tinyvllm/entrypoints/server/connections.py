"""The bounds of one connection to `tinyvllm serve`: how long a client may take to send a request
header and a request body, and how many connections and requests the server holds at once.

A connection costs the server a socket, a file descriptor and some memory before it has sent a
single byte, so a client that connects and then says nothing (or trickles a byte now and then:
"slowloris") holds them for free. uvicorn bounds only the wait between two requests on a
kept-alive connection (`timeout_keep_alive`); the rest is here:

- `BoundedH11Protocol`: uvicorn's h11 protocol (one object per connection) with a header clock:
  a new connection has `header_timeout` seconds to send a complete request header, or it is
  closed; the rest of a body answered before it was read must come within the keep-alive
  timeout; and past a cap on the connections and requests at once, a request is answered 503
  with OpenAI's error object.
- `BodyTimeout`: ASGI middleware; once a header has come, the whole body must come within
  `seconds`, or the request is answered 408.
"""

from __future__ import annotations

import asyncio
import functools
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tinyvllm.entrypoints.server.serving_engine import APIError, error_body


async def send_error(send, e: APIError) -> None:
    """Answer `e` as OpenAI's error object, and close the connection after it: the rest of what
    the client sends (a body nobody reads) cannot start a next request."""
    body = json.dumps(error_body(e)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    headers += [(k.lower().encode(), v.encode()) for k, v in (e.headers or {}).items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (h11) with three bounds more.

    **The header clock.** h11 tracks the client's side of the connection as a state: IDLE until a
    complete request header has come, then SEND_BODY, then DONE. A timer of `header_timeout`
    seconds starts when the connection opens, and again when the first bytes of a next request
    come on a kept-alive connection (between requests, uvicorn's keep-alive timer is the bound);
    it stops when the state leaves IDLE. If it fires, the connection is closed without a word:
    there is no request to answer. One deadline for the whole header, not one per read, so a
    header trickled a byte at a time is cut at the same moment as a silent connection.

    **The leftover body.** A request answered before its body was read (a 413 on its declared
    length, a 401, a 404) leaves the client sending the rest. uvicorn restarts its keep-alive
    timer on every byte that comes, so a trickle would hold the connection forever; here the
    leftover bytes do not restart it: the client has `timeout_keep_alive` seconds after the
    answer to finish.

    **The concurrency cap.** uvicorn's own `limit_concurrency` answers 503 in plain text when
    the connections, or the requests in flight, reach the limit (counting the new one, so a
    limit of 4 lets 3 through). Here a request is answered 503 with OpenAI's error object and
    Retry-After when they exceed `limit_concurrency`: a limit of 4 lets 4 through.

    uvicorn builds one object per connection: `bounded_h11(...)` gives it our settings.
    """

    def __init__(self, config, server_state, app_state, _loop=None, *, header_timeout: float,
                 limit_concurrency: int | None = None):
        super().__init__(config, server_state, app_state, _loop)
        self.header_timeout = header_timeout
        self.header_timer: asyncio.TimerHandle | None = None
        self.max_concurrent = limit_concurrency
        if limit_concurrency is not None:
            self.app = self._app_within_limit   # uvicorn runs self.app for each request

    # -- the header clock ----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch_header()

    def data_received(self, data: bytes) -> None:
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY:
            # the rest of an answered request's body: read it, leave the keep-alive timer running
            self.conn.receive_data(data)
            self.handle_events()
        else:
            super().data_received(data)
        self._watch_header()

    def connection_lost(self, exc) -> None:
        self._stop_header_clock()
        super().connection_lost(exc)

    def _watch_header(self) -> None:
        """Run the header clock while the client owes a request header, stop it once one came."""
        if self.conn.their_state is h11.IDLE:
            if self.header_timer is None and not self.transport.is_closing():
                self.header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)
        else:
            self._stop_header_clock()

    def _stop_header_clock(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timed_out(self) -> None:
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.debug("closed a connection that sent no complete request header in %s s",
                              self.header_timeout)
            self.transport.close()

    # -- the concurrency cap -------------------------------------------------------------------
    async def _app_within_limit(self, scope, receive, send) -> None:
        """The app, unless the server holds more connections or requests than the cap. This
        request's own connection and task are counted: each set holds them already."""
        limit = self.max_concurrent
        if len(self.connections) > limit or len(self.tasks) > limit:
            self.logger.warning("a request was refused: over --limit-concurrency %d", limit)
            await send_error(send, APIError(
                503, f"the server holds its limit of {limit} connections or requests at once "
                     f"(--limit-concurrency); retry later", type="service_unavailable",
                code="too_many_connections", headers={"Retry-After": "1"}))
            return
        await self.config.loaded_app(scope, receive, send)


def bounded_h11(header_timeout: float, limit_concurrency: int | None):
    """What to pass as `uvicorn.Config(http=...)`: it builds a `BoundedH11Protocol` with these
    settings for each connection. h11 whether or not httptools is installed (with it, uvicorn's
    "auto" would pick httptools, whose parser states this class does not read)."""
    return functools.partial(BoundedH11Protocol, header_timeout=header_timeout,
                             limit_concurrency=limit_concurrency)


class BodyTimeout:
    """ASGI middleware: a request body must arrive whole within `seconds` of its header, or the
    request is answered 408 with OpenAI's error object and the connection closed.

    The app reads a body by calling `receive` until a message says `more_body: False`. Each of
    those calls here waits only for what is left of one deadline, set when the request reached
    the app (its header had just come), so a body trickled a byte at a time is cut as surely as
    one that stops. At the deadline the 408 goes out at once, and the app's `receive` returns
    `http.disconnect`: to the app the client has gone (its connection is closing), so it stops as
    for any client that hangs up, and what it sends afterwards is dropped. Nothing is raised
    through the app's middleware. After the body (or once the app's answer has started),
    `receive` is passed through: the app then waits on it for the client's disconnect, which may
    come at any time.
    """

    def __init__(self, app, seconds: float):
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        body_done = answered = timed_out = False

        async def timed_receive():
            nonlocal body_done, timed_out
            if body_done or answered or timed_out:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                timed_out = True
                await send_error(send, APIError(
                    408, f"the request body did not arrive within {self.seconds:g} s of its header "
                         f"(--body-timeout)", code="request_timeout"))
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def watched_send(message):
            nonlocal answered
            if timed_out:
                return          # the 408 was the answer
            if message["type"] == "http.response.start":
                answered = True
            await send(message)

        await self.app(scope, timed_receive, watched_send)
