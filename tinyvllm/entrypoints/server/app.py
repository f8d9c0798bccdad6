"""The FastAPI app (vLLM's `api_server.py`): `build_app` puts OpenAI's endpoints over an
`AsyncEngine`, answers every error as OpenAI's error object, and guards the door: the request
body's size, the Host header, the API key. It serves /health itself, beside the key check; the
other routes are served by `serving_info.py` (models, Prometheus metrics with vLLM's names under
`tinyvllm:`, the engine's state, the live page at GET /, tokenize/detokenize) and
`serving_completion.py` and `serving_chat.py` (completions, and chat completions with tools and
reasoning), over what `serving_engine.py` shares.

Every request is bounded before it costs anything (`Limits`): its body's bytes (413), the
characters of its prompt (checked before tokenizing, which runs off the event loop), `n`, the
prompts of one request, and the stop strings. A request whose client goes away is aborted, its
KV blocks freed, whether it streams or not and whether or not its first token has come.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyvllm.entrypoints.server.async_engine import AsyncEngine
from tinyvllm.entrypoints.server.chat_tools import check_parsers
from tinyvllm.entrypoints.server.limits import Limits
from tinyvllm.entrypoints.server.metrics import ServerMetrics
from tinyvllm.entrypoints.server.serving_chat import add_chat_routes
from tinyvllm.entrypoints.server.serving_completion import add_completion_routes
from tinyvllm.entrypoints.server.serving_engine import APIError, OpenAIServing, error_body, error_response
from tinyvllm.entrypoints.server.serving_info import add_info_routes

OPEN_PATHS = frozenset({"/", "/health"})  # the only paths served without the API key
log = logging.getLogger("tinyvllm.server")


class _BodyTooLarge(BaseException):
    """Not an Exception: FastAPI turns any Exception met while reading a body into a 400."""


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 before any handler
    parses it, whether it declares its length or streams in chunks."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _BodyTooLarge:
            await self._refuse(send)

    async def _refuse(self, send):
        body = json.dumps(error_body(APIError(
            413, f"the request body is over {self.max_bytes} bytes (--max-request-bytes)",
            type="invalid_request_error", code="request_too_large"))).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


def bearer_matches(header: str | None, api_key: str) -> bool:
    """Does an Authorization header carry `api_key`? The scheme in any case, the key compared in
    constant time (no timing tells how much of a guess was right)."""
    scheme, _, token = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


# A Host header as RFC 9110 allows it: a name or IPv4 address, or an IPv6 address in brackets,
# then an optional port; nothing else (no second host after a comma, no text after "]").
_HOST = re.compile(r"(?:\[(?P<ip6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._-]+))(?::[0-9]{1,5})?")


def host_allowed(host: str | None, allowed: frozenset[str]) -> bool:
    """Is the Host header's name (its port left off) one of `allowed`? A header that is not one
    host (`[::1]evil.example`, `127.0.0.1:8000, evil.example`) is not. No Host header (HTTP/1.0)
    is let through: a browser always sends one."""
    if host is None or host == "":
        return True
    m = _HOST.fullmatch(host.lower())
    return m is not None and (m["ip6"] or m["name"]) in allowed


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_model_len: int | None = None, limits: Limits = Limits(),
              allowed_hosts: frozenset[str] | None = None, health_step_timeout: float = 60.0,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None) -> FastAPI:
    """The app serving `engine` under the name `model_name` (what /v1/models lists).
    `allowed_hosts`: the Host names it answers (None: any); `health_step_timeout`: /health says
    503 while one engine step has run longer than this many seconds; the last three are vLLM's
    flags for tool calls and reasoning (docs/serving.md)."""
    check_parsers(enable_auto_tool_choice, tool_call_parser, reasoning_parser)
    metrics = ServerMetrics(engine)
    serving = OpenAIServing(engine, metrics, model_name, max_model_len, limits, enable_auto_tool_choice,
                            tool_call_parser, reasoning_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()   # after uvicorn has stopped accepting and closed the connections

    app = FastAPI(title="tinyvllm", version="0.1", lifespan=lifespan,
                  description="An OpenAI-compatible server for tinyvllm's engine")
    app.state.engine, app.state.metrics = engine, metrics
    app.add_middleware(BodyLimit, max_bytes=limits.max_request_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        # never a plain-text 500, and never the exception's text: it can hold paths, another
        # request's content, the engine's internals. The client gets an id the log has beside it.
        error_id = f"err-{uuid.uuid4().hex[:16]}"
        log.error("internal error %s on %s %s", error_id, request.method, request.url.path,
                  exc_info=(type(e), e, e.__traceback__))
        return error_response(APIError(500, f"internal error (request id {error_id}): the server's log "
                                            f"has the details", type="server_error", code="internal_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        if first.get("type") == "json_invalid":
            return error_response(APIError(400, f"invalid JSON: {first.get('msg')}", param=None))
        msg = "; ".join(f"{'.'.join(str(p) for p in er.get('loc', ()) if p != 'body') or 'body'}: "
                        f"{er.get('msg')}" for er in errs[:3])
        return error_response(APIError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail), code=None,
                                       type="invalid_request_error" if e.status_code < 500 else "server_error"))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        # a server on a loopback address answers only to loopback names: a web page on another
        # site that points its own DNS name at 127.0.0.1 (DNS rebinding) gets a 400
        if allowed_hosts is not None and not host_allowed(request.headers.get("host"), allowed_hosts):
            return error_response(APIError(400, f"Host: {request.headers.get('host')!r} is not a name of "
                                                f"this server (a loopback server answers to localhost, "
                                                f"127.0.0.1 and [::1]; --allowed-host adds names)",
                                           code="invalid_host"))
        # as llama.cpp's server: with a key, everything but the live page and /health needs it
        if (api_key and request.method != "OPTIONS" and request.url.path not in OPEN_PATHS
                and not bearer_matches(request.headers.get("authorization"), api_key)):
            return error_response(APIError(401, "missing or wrong API key: send "
                                           "'Authorization: Bearer <key>'",
                                           type="authentication_error", code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health(raw: Request):
        """200 or 503. Why it is unhealthy is told only to a caller with the key (no key needed
        here; the engine's error text is not for everyone)."""
        problem = None
        running = engine.step_seconds()
        if engine.error is not None:
            problem = f"the engine has stopped: {engine.error}"
        elif running > health_step_timeout:
            problem = (f"the engine is stuck: one step has run for {running:.0f} s "
                       f"(--health-step-timeout {health_step_timeout:g})")
        if problem is None:
            return Response(status_code=200)
        if api_key and not bearer_matches(raw.headers.get("authorization"), api_key):
            problem = "unhealthy"
        raise APIError(503, problem, type="server_error")

    # after /health, in the order the routes are listed at /docs
    add_info_routes(app, serving)
    add_completion_routes(app, serving)
    add_chat_routes(app, serving)
    return app
