"""What every route of the server shares (vLLM's `serving_engine.py`, its `OpenAIServing` base):
OpenAI's error object (`APIError`), the checks a request passes before it costs anything, and
`OpenAIServing`, which starts a request on the engine, hands over its outputs, and aborts it when
its client goes away.

The routes themselves are in `serving_completion.py` and `serving_chat.py` (the generation
routes) and `serving_info.py` (the rest); `app.py` builds the app around them.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tinyvllm.errors import StepError
from tinyvllm.outputs import RequestOutput
from tinyvllm.tokenizer import check_chat_template_kwargs
from tinyvllm.entrypoints.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from tinyvllm.entrypoints.server.limits import CHARS_PER_TOKEN, Limits
from tinyvllm.entrypoints.server.metrics import ServerMetrics


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
    of a request that sent response_format names response_format; of a forced tool call, tools."""
    message = str(e)
    words = re.findall(r"[a-z_]+", message)
    param = next((w for w in words if w in fields), default_param)
    if param == "structured_outputs" and getattr(req, "response_format", None) is not None:
        param = "response_format"
    elif param == "structured_outputs" and getattr(req, "tool_choice", None) not in (None, "none", "auto"):
        param = "tools"    # a forced tool call's constraint is the server's, built from the tools
    return APIError(400, message, param=param)


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


def chat_chars(req) -> int:
    """The characters of a chat: every field of each message (a role or an extra field counts as
    much as the content), its `chat_template_kwargs` and its tools (the template may put any of
    them in the prompt): what the prompt cap is checked against, before any rendering or
    tokenizing."""
    kwargs, tools = req.chat_template_kwargs, getattr(req, "tools", None)
    return (sum(len(json.dumps(m.model_dump(exclude_none=True))) for m in req.messages)
            + (len(json.dumps(kwargs, default=str)) if kwargs else 0)
            + (len(json.dumps([t.model_dump(exclude_none=True) for t in tools])) if tools else 0))


class OpenAIServing:
    """What the routes of one app share: the engine, its metrics, the model's name and the
    request caps (`limits`), the chat's parsers (`tool_call_parser` for tool_choice "auto" with
    `enable_auto_tool_choice`, `reasoning_parser`: names in `tool_parsers.py` and
    `reasoning_parsers.py`), and the steps every request takes (check it, start it, read its
    outputs, close it). `max_model_len` None: the engine's."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, model_name: str,
                 max_model_len: int | None, limits: Limits, enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        self.engine, self.metrics, self.model_name, self.limits = engine, metrics, model_name, limits
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.max_model_len = max_model_len or engine.engine.max_model_len
        self.max_prompt_chars = limits.max_prompt_chars or self.max_model_len * CHARS_PER_TOKEN
        self.tokenizer = engine.tokenizer

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, chat_template_kwargs: dict | None,
                    tools: list[dict] | None = None) -> str:
        """The chat template on the messages (as `chat_tools.template_messages` gives them) and
        the tools (as transformers passes them: the template's `tools` variable); any failure (a
        template error on odd content) is the request's fault: a 400 naming `messages`."""
        try:
            extra = check_chat_template_kwargs(chat_template_kwargs)
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), param="chat_template_kwargs") from None
        if tools is not None:
            if "tools" in extra:
                raise APIError(400, "chat_template_kwargs: 'tools' is the request's own field; give the "
                                    "tools there", param="chat_template_kwargs")
            extra["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt, **extra)
        except Exception as e:  # noqa: BLE001 -- jinja raises many kinds
            raise APIError(400, f"messages: the chat template failed on them: {e}", param="messages") from None

    def check_model(self, name: str | None) -> None:
        """A request may name the model; a name other than the one served is a 404."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"model: the model {name!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")

    def check_request(self, params, num_prompts: int = 1) -> None:
        """The caps of `limits`, each a 400 naming its field."""
        limits = self.limits
        if params.n > limits.max_n:
            raise APIError(400, f"n must be <= {limits.max_n} (--max-n), got {params.n}", param="n")
        if num_prompts > limits.max_prompts:
            raise APIError(400, f"prompt: at most {limits.max_prompts} prompts a request (--max-prompts), "
                                f"got {num_prompts}", param="prompt")
        stops = params.stop_strings
        if len(stops) > limits.max_stop or any(len(x) > limits.max_stop_chars for x in stops):
            raise APIError(400, f"stop: at most {limits.max_stop} strings (--max-stop) of at most "
                                f"{limits.max_stop_chars} characters each", param="stop")

    def check_chars(self, num_chars: int, param: str) -> None:
        """A 400 naming `param` for a prompt too long to fit, counted in characters: checked
        before tokenizing, so an overlong prompt costs no tokenizer time."""
        if num_chars > self.max_prompt_chars:
            raise APIError(400, f"{param}: {num_chars} characters cannot fit in max_model_len "
                                f"({self.max_model_len}) tokens; at most {self.max_prompt_chars} "
                                f"characters are taken", param=param, code="context_length_exceeded")

    async def run(self, request_id: str, prompt: Any, params, fields: set[str], prompt_param: str,
                  watch: ClientWatch, req=None):
        """Start a request; return its output iterator after its first output, so bad input and
        a full queue are answered before any response header is sent. A client that goes away
        before the first output aborts the request."""
        metrics = self.metrics
        metrics.on_start(request_id)
        gen = self.engine.generate(request_id, prompt, params)
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

    async def close(self, started) -> None:
        """End every request a handler started (each `(first output, generator)`): a generator
        closed unfinished aborts its request, and the metrics forget it."""
        for first, gen in started:
            await gen.aclose()
            self.metrics.on_abort(first.request_id)

    async def outputs_of(self, first: RequestOutput, gen, watch: ClientWatch | None = None):
        """The request's outputs; an engine failure on the way becomes an APIError (a JSON error
        for a plain response, an error event for a stream). With `watch`, a client that goes
        away between two outputs ends it (the generator, closed, aborts the request)."""
        yield first
        finished = first.finished
        try:
            while not finished:
                nxt = gen.__anext__()
                out = await (watch.until(nxt) if watch is not None else nxt)
                self.metrics.on_output(out)
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
                self.metrics.on_abort(first.request_id)
