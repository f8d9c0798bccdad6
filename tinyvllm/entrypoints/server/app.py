"""The FastAPI app: OpenAI's endpoints over an `AsyncEngine`, errors as OpenAI's error object,
Prometheus metrics with vLLM's names under `tinyvllm:`, and the live page at GET /.

Every request is bounded before it costs anything (`Limits`): its body's bytes (413), the
characters of its prompt (checked before tokenizing, which runs off the event loop), `n`, the
prompts of one request, and the stop strings. A request whose client goes away is aborted, its
KV blocks freed, whether it streams or not and whether or not its first token has come.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import re
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyvllm.errors import StepError
from tinyvllm.outputs import RequestOutput
from tinyvllm.tokenizer import check_chat_template_kwargs
from tinyvllm.entrypoints.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from tinyvllm.entrypoints.server.limits import CHARS_PER_TOKEN, Limits
from tinyvllm.entrypoints.server.metrics import ServerMetrics
from tinyvllm.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

STATIC = Path(__file__).parent / "static"
OPEN_PATHS = frozenset({"/", "/health"})  # the only paths served without the API key


class APIError(Exception):
    """An error answered as OpenAI's {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers


def error_body(e: APIError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


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


class ClientWatch:
    """Notices a client that goes away while its request waits: a background task reads the
    connection (the request's body is read already, so the next message can only be
    `http.disconnect`). A streaming response listens for itself once it starts, so a stream's
    watch is closed after its first output."""

    def __init__(self, raw: Request):
        self.gone = asyncio.ensure_future(self._listen(raw))

    @staticmethod
    async def _listen(raw: Request) -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    async def until(self, awaitable):
        """`await awaitable`, unless the client goes away first: then it is cancelled (the
        request's generator, closed, aborts the request) and ConnectionError raised."""
        task = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait({task, self.gone}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            raise ConnectionError("the client went away")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})   # let the request's generator unwind (and abort)

    def close(self) -> None:
        self.gone.cancel()


def engine_failure(e: Exception) -> APIError:
    """A request the engine could not finish: its step failed (500; the engine goes on), or the
    engine has stopped (503)."""
    if isinstance(e, StepError):
        return APIError(500, str(e), type="server_error", code="step_failed")
    return APIError(503, str(e), type="server_error", code="engine_dead")


def bad_value(e: Exception, fields: set[str], default_param: str, req=None) -> APIError:
    """A ValueError/TypeError from SamplingParams or the engine -> 400 naming the field. Their
    messages start with (or mention) the argument's name, e.g. 'max_tokens: ...'. A grammar error
    of a request that sent response_format names response_format."""
    message = str(e)
    words = re.findall(r"[a-z_]+", message)
    param = next((w for w in words if w in fields), default_param)
    if param == "structured_outputs" and getattr(req, "response_format", None) is not None:
        param = "response_format"
    return APIError(400, message, param=param)


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


def bad_text(value, param: str) -> None:
    """A 400 naming `param` if any string in `value` (a string, or lists and dicts of them) is
    not valid Unicode: JSON's escapes can carry a lone surrogate (\\ud800), which no tokenizer
    and no UTF-8 encoder takes."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(400, f"{param}: the text is not valid Unicode ({e.reason} at character "
                                    f"{e.start}); send UTF-8 text", param=param) from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def check_text(req) -> None:
    """`bad_text` on every field of a request body, naming the field."""
    for name, value in req.model_dump(exclude_none=True).items():
        bad_text(value, name)


def message_chars(messages) -> int:
    """The characters of a chat's messages, every field of each (a role or an extra field counts
    as much as the content): what the prompt cap is checked against, before any tokenizing."""
    return sum(len(json.dumps(m.model_dump(exclude_none=True))) for m in messages)


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_model_len: int | None = None, limits: Limits = Limits(),
              allowed_hosts: frozenset[str] | None = None, health_step_timeout: float = 60.0) -> FastAPI:
    """The app serving `engine` under the name `model_name` (what /v1/models lists).
    `allowed_hosts`: the Host names it answers (None: any); `health_step_timeout`: /health says
    503 while one engine step has run longer than this many seconds."""
    metrics = ServerMetrics(engine)
    max_model_len = max_model_len or engine.engine.max_model_len
    max_prompt_chars = limits.max_prompt_chars or max_model_len * CHARS_PER_TOKEN
    tokenizer = engine.tokenizer
    created = int(time.time())

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
    async def _unexpected(request: Request, e: Exception):  # never a plain-text 500
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

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

    def render_chat(messages, add_generation_prompt: bool, chat_template_kwargs: dict | None) -> str:
        """The chat template on the messages; any failure (a template error on odd content) is
        the request's fault: a 400 naming `messages`."""
        try:
            extra = check_chat_template_kwargs(chat_template_kwargs)
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), param="chat_template_kwargs") from None
        try:
            return tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in messages],
                                                 add_generation_prompt, **extra)
        except Exception as e:  # noqa: BLE001 -- jinja raises many kinds
            raise APIError(400, f"messages: the chat template failed on them: {e}", param="messages") from None

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"model: the model {name!r} does not exist; this server serves "
                                f"{model_name!r}", param="model", code="model_not_found")

    def check_request(params, num_prompts: int = 1) -> None:
        """The caps of `limits`, each a 400 naming its field."""
        if params.n > limits.max_n:
            raise APIError(400, f"n must be <= {limits.max_n} (--max-n), got {params.n}", param="n")
        if num_prompts > limits.max_prompts:
            raise APIError(400, f"prompt: at most {limits.max_prompts} prompts a request (--max-prompts), "
                                f"got {num_prompts}", param="prompt")
        stops = params.stop_strings
        if len(stops) > limits.max_stop or any(len(x) > limits.max_stop_chars for x in stops):
            raise APIError(400, f"stop: at most {limits.max_stop} strings (--max-stop) of at most "
                                f"{limits.max_stop_chars} characters each", param="stop")

    def check_chars(num_chars: int, param: str) -> None:
        if num_chars > max_prompt_chars:
            raise APIError(400, f"{param}: {num_chars} characters cannot fit in max_model_len ({max_model_len}) "
                                f"tokens; at most {max_prompt_chars} characters are taken", param=param,
                           code="context_length_exceeded")

    async def run(request_id: str, prompt: Any, params, fields: set[str], prompt_param: str,
                  watch: ClientWatch, req=None):
        """Start a request; return its output iterator after its first output, so bad input and
        a full queue are answered before any response header is sent. A client that goes away
        before the first output aborts the request."""
        metrics.on_start(request_id)
        gen = engine.generate(request_id, prompt, params)
        try:
            first = await watch.until(gen.__anext__())
        except (ValueError, TypeError) as e:
            metrics.forget(request_id)
            raise bad_value(e, fields, prompt_param, req) from None
        except QueueFullError as e:
            metrics.forget(request_id)
            raise APIError(503, str(e), type="service_unavailable", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except (StepError, EngineDeadError) as e:
            metrics.on_abort(request_id)
            raise engine_failure(e) from None
        except BaseException as e:
            await gen.aclose()         # the client went away (or the server stops): abort
            metrics.on_abort(request_id)
            if isinstance(e, ConnectionError):   # nobody reads the answer: nginx's 499
                raise APIError(499, "the client closed the request") from None
            raise
        metrics.on_output(first)
        return first, gen

    async def close(started) -> None:
        """End every request a handler started (each `(first output, generator)`): a generator
        closed unfinished aborts its request, and the metrics forget it."""
        for first, gen in started:
            await gen.aclose()
            metrics.on_abort(first.request_id)

    async def outputs_of(first: RequestOutput, gen, watch: ClientWatch | None = None):
        """The request's outputs; an engine failure on the way becomes an APIError (a JSON error
        for a plain response, an error event for a stream). With `watch`, a client that goes
        away between two outputs ends it (the generator, closed, aborts the request)."""
        yield first
        finished = first.finished
        try:
            while not finished:
                nxt = gen.__anext__()
                out = await (watch.until(nxt) if watch is not None else nxt)
                metrics.on_output(out)
                finished = out.finished
                yield out
        except StopAsyncIteration:
            pass
        except (StepError, EngineDeadError) as e:
            raise engine_failure(e) from None
        except ConnectionError:            # nobody reads the answer: nginx's 499
            raise APIError(499, "the client closed the request") from None
        finally:
            if not finished:
                await gen.aclose()
                metrics.on_abort(first.request_id)

    # -- info ------------------------------------------------------------------------------------
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

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "tinyvllm",
            "root": model_name, "max_model_len": max_model_len}]}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/engine/state")
    async def engine_state():
        """The engine as it runs (for the live page): requests, their blocks, counters."""
        return engine.state

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index():
        page = STATIC / "index.html"
        if not page.exists():
            return HTMLResponse("<p>tinyvllm server: see /docs</p>")
        return HTMLResponse(page.read_text(encoding="utf-8"))

    # -- tokens ----------------------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        check_text(req)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give one of prompt or messages", param="prompt")
        if req.messages is not None:
            check_chars(message_chars(req.messages), "messages")
            ids = await asyncio.to_thread(lambda: tokenizer.encode(render_chat(
                req.messages, req.add_generation_prompt, req.chat_template_kwargs), add_special_tokens=False))
        else:
            check_chars(len(req.prompt), "prompt")
            ids = await asyncio.to_thread(tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        if len(req.tokens) > max_model_len:   # no sequence of this model is longer
            raise APIError(400, f"tokens: at most max_model_len ({max_model_len}) ids, got {len(req.tokens)}",
                           param="tokens")
        vocab = engine.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: ids must be in [0, {vocab}), got {bad[0]}", param="tokens")
        text = await asyncio.to_thread(tokenizer.decode, req.tokens, skip_special_tokens=False)
        return {"prompt": text}

    # -- completions -----------------------------------------------------------------------------
    completion_fields = set(CompletionRequest.model_fields)
    chat_fields = set(ChatCompletionRequest.model_fields)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        check_text(req)
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError(400, f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
        try:
            params = req.sampling_params(req.max_tokens, req.logprobs)
        except (ValueError, TypeError) as e:
            raise bad_value(e, completion_fields, "prompt", req) from None
        prompts = _completion_prompts(req.prompt)
        check_request(params, len(prompts))
        for p in prompts:
            check_chars(len(p) if isinstance(p, str) else 0, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        started = []
        watch = ClientWatch(raw)
        try:
            try:
                for i, p in enumerate(prompts):
                    started.append(await run(f"{rid}-{i}", p, params, completion_fields, "prompt", watch, req))
            except APIError:
                await close(started)
                raise
            name = req.model or model_name
            if req.stream:  # from here the streaming response listens for a disconnect itself
                return StreamingResponse(_stream_completions(rid, name, started, req, raw, tokenizer, outputs_of,
                                                             close), media_type="text/event-stream")
            finals = []
            try:
                for first, gen in started:
                    last = first
                    async for out in outputs_of(first, gen, watch):
                        last = out
                    finals.append(last)
            finally:  # a client gone, or a failed request: the others of this request end too
                await close(started)
        finally:
            watch.close()
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text = echoed_prompt(out, tokenizer) + c.text if req.echo else c.text
                choices.append({"index": i * params.n + c.index, "text": text,
                                "logprobs": _completion_logprobs(c.token_ids, c.logprobs, tokenizer, req.logprobs)
                                if req.logprobs is not None else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": name,
                "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        check_text(req)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}",
                           param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        try:
            params = req.sampling_params(max_tokens, logprobs)
        except (ValueError, TypeError) as e:
            raise bad_value(e, chat_fields, "messages", req) from None
        check_request(params)
        check_chars(message_chars(req.messages), "messages")

        def render_and_encode():   # off the event loop: a long chat takes a while
            text = render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
            return text, tokenizer.encode(text, add_special_tokens=False)

        text, ids = await asyncio.to_thread(render_and_encode)
        if params.max_tokens is None:  # as vLLM: what the context leaves
            params.max_tokens = max(1, max_model_len - len(ids))
        prompt = {"prompt": text, "prompt_token_ids": ids}
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        watch = ClientWatch(raw)
        try:
            first, gen = await run(rid, prompt, params, chat_fields, "messages", watch, req)
            name = req.model or model_name
            if req.stream:  # from here the streaming response listens for a disconnect itself
                return StreamingResponse(_stream_chat(rid, name, first, gen, req, raw, tokenizer, outputs_of,
                                                      close), media_type="text/event-stream")
            last = first
            async for out in outputs_of(first, gen, watch):
                last = out
        finally:
            watch.close()
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": {"content": _chat_logprobs(c.token_ids, c.logprobs, tokenizer, req.top_logprobs or 0)}
                    if req.logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in last.outputs]
        n_out = sum(len(c.token_ids) for c in last.outputs)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": name,
                "choices": choices, "usage": _usage(len(last.prompt_token_ids), n_out)}

    return app


# -- helpers ---------------------------------------------------------------------------------------
def _completion_prompts(prompt) -> list:
    """OpenAI's four prompt shapes -> a list of engine prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: the prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [{"prompt_token_ids": p} for p in prompt]
    raise APIError(400, "prompt: a string, a list of strings, a list of token ids, or a list of "
                        "lists of token ids", param="prompt")


def echoed_prompt(out: RequestOutput, tokenizer) -> str:
    """The prompt as `echo` returns it: its text, or its token ids decoded (vLLM's behaviour)."""
    if out.prompt is not None:
        return out.prompt
    return tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_text(tokenizer, tid: int, lp) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid], skip_special_tokens=False)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0   # JSON has no -inf (vLLM writes -9999.0 too)


def _completion_logprobs(token_ids, logprobs, tokenizer, k: int, offset: int = 0) -> dict:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    pos = offset
    for tid, step in zip(token_ids, logprobs or []):
        text = _token_text(tokenizer, tid, step.get(tid))
        res["tokens"].append(text)
        res["token_logprobs"].append(_finite(step[tid].logprob))
        top = sorted(step.items(), key=lambda kv: kv[1].rank or 0)[:k]
        res["top_logprobs"].append({_token_text(tokenizer, t, o): _finite(o.logprob) for t, o in top} if k else None)
        res["text_offset"].append(pos)
        pos += len(text)
    return res


def _chat_logprobs(token_ids, logprobs, tokenizer, k: int) -> list[dict]:
    out = []
    for tid, step in zip(token_ids, logprobs or []):
        text = _token_text(tokenizer, tid, step.get(tid))
        top = sorted(step.items(), key=lambda kv: kv[1].rank or 0)[:k]
        out.append({"token": text, "logprob": _finite(step[tid].logprob), "bytes": list(text.encode()),
                    "top_logprobs": [{"token": (t2 := _token_text(tokenizer, t, o)),
                                      "logprob": _finite(o.logprob), "bytes": list(t2.encode())}
                                     for t, o in top]})
    return out


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Deltas:
    """What each completion added since the last output: new text and new token ids."""

    def __init__(self):
        self.text: dict[int, int] = {}
        self.tokens: dict[int, int] = {}

    def of(self, c) -> tuple[str, list[int], Any]:
        t0, n0 = self.text.get(c.index, 0), self.tokens.get(c.index, 0)
        self.text[c.index], self.tokens[c.index] = len(c.text), len(c.token_ids)
        lps = c.logprobs[n0:] if c.logprobs is not None else None
        return c.text[t0:], c.token_ids[n0:], lps


async def _stream_completions(rid, name, started, req, raw: Request, tokenizer, outputs_of, close):
    created = int(time.time())
    n = req.n
    prompt_tokens = completion_tokens = 0
    try:
        for i, (first, gen) in enumerate(started):
            deltas = _Deltas()
            echo = {c: req.echo for c in range(n)}   # each completion's first chunk starts with the prompt
            async for out in outputs_of(first, gen):
                if await raw.is_disconnected():
                    return   # the finally of the generators aborts the requests
                for c in out.outputs:
                    text, ids, lps = deltas.of(c)
                    if not ids and c.finish_reason is None:
                        continue
                    if echo[c.index]:
                        text, echo[c.index] = echoed_prompt(out, tokenizer) + text, False
                    choice = {"index": i * n + c.index, "text": text,
                              "logprobs": _completion_logprobs(ids, lps, tokenizer, req.logprobs)
                              if req.logprobs is not None else None,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    yield _sse({"id": rid, "object": "text_completion", "created": created,
                                "model": name, "choices": [choice], "usage": None})
                if out.finished:
                    prompt_tokens += len(out.prompt_token_ids)
                    completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        if req.stream_options and req.stream_options.include_usage:
            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                        "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
        yield "data: [DONE]\n\n"
    except APIError as e:  # the engine failed mid-stream: say so, and end the stream properly
        yield _sse(error_body(e))
        yield "data: [DONE]\n\n"
    finally:
        await close(started)


async def _stream_chat(rid, name, first, gen, req, raw: Request, tokenizer, outputs_of, close):
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices, usage=None):
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                "choices": choices}
        if include_usage:
            body["usage"] = usage
        return _sse(body)

    try:
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(req.n)])
        deltas = _Deltas()
        last = first
        async for out in outputs_of(first, gen):
            if await raw.is_disconnected():
                return
            last = out
            for c in out.outputs:
                text, ids, lps = deltas.of(c)
                if not ids and c.finish_reason is None:
                    continue
                yield chunk([{"index": c.index, "delta": {"content": text},
                              "logprobs": {"content": _chat_logprobs(ids, lps, tokenizer, req.top_logprobs or 0)}
                              if req.logprobs else None,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
        if include_usage:
            yield chunk([], _usage(len(last.prompt_token_ids), sum(len(c.token_ids) for c in last.outputs)))
        yield "data: [DONE]\n\n"
    except APIError as e:  # the engine failed mid-stream: say so, and end the stream properly
        yield _sse(error_body(e))
        yield "data: [DONE]\n\n"
    finally:
        await close([(first, gen)])
