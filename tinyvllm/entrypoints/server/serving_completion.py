"""The generation routes: POST /v1/completions (OpenAI's legacy completions: a prompt, or several,
as text or token ids) and POST /v1/chat/completions (messages through the chat template), each
answered whole or streamed as server-sent events, with OpenAI's logprobs objects and usage counts.

vLLM splits these into `serving_completion.py` and `serving_chat.py`; they share a request's
life here (`OpenAIServing.run`, `outputs_of`, `close`) and the helpers at the end of this file, so
they share the file. Every request is checked before it reaches the engine, and one whose client
goes away is aborted, streaming or not.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tinyvllm.outputs import RequestOutput
from tinyvllm.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest
from tinyvllm.entrypoints.server.serving_engine import (
    APIError,
    ClientWatch,
    OpenAIServing,
    bad_value,
    check_text,
    error_body,
    chat_chars,
)


def add_completion_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """Add to `app` the routes that generate: /v1/completions and /v1/chat/completions."""
    tokenizer = serving.tokenizer
    completion_fields = set(CompletionRequest.model_fields)
    chat_fields = set(ChatCompletionRequest.model_fields)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        serving.check_model(req.model)
        check_text(req)
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError(400, f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
        try:
            params = req.sampling_params(req.max_tokens, req.logprobs)
        except (ValueError, TypeError) as e:
            raise bad_value(e, completion_fields, "prompt", req) from None
        prompts = _completion_prompts(req.prompt)
        serving.check_request(params, len(prompts))
        for p in prompts:
            serving.check_chars(len(p) if isinstance(p, str) else 0, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        started = []
        watch = ClientWatch(raw)
        try:
            try:
                for i, p in enumerate(prompts):
                    started.append(await serving.run(f"{rid}-{i}", p, params, completion_fields, "prompt",
                                                     watch, req))
            except APIError:
                await serving.close(started)
                raise
            name = req.model or serving.model_name
            if req.stream:  # from here the streaming response listens for a disconnect itself
                return StreamingResponse(_stream_completions(rid, name, started, req, raw, serving),
                                         media_type="text/event-stream")
            finals = []
            try:
                for first, gen in started:
                    last = first
                    async for out in serving.outputs_of(first, gen, watch):
                        last = out
                    finals.append(last)
            finally:  # a client gone, or a failed request: the others of this request end too
                await serving.close(started)
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
        serving.check_model(req.model)
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
        serving.check_request(params)
        serving.check_chars(chat_chars(req), "messages")

        def render_and_encode():   # off the event loop: a long chat takes a while
            text = serving.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
            return text, tokenizer.encode(text, add_special_tokens=False)

        text, ids = await asyncio.to_thread(render_and_encode)
        if params.max_tokens is None:  # as vLLM: what the context leaves
            params.max_tokens = max(1, serving.max_model_len - len(ids))
        prompt = {"prompt": text, "prompt_token_ids": ids}
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        watch = ClientWatch(raw)
        try:
            first, gen = await serving.run(rid, prompt, params, chat_fields, "messages", watch, req)
            name = req.model or serving.model_name
            if req.stream:  # from here the streaming response listens for a disconnect itself
                return StreamingResponse(_stream_chat(rid, name, first, gen, req, raw, serving),
                                         media_type="text/event-stream")
            last = first
            async for out in serving.outputs_of(first, gen, watch):
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


async def _stream_completions(rid, name, started, req, raw: Request, serving: OpenAIServing):
    created = int(time.time())
    tokenizer = serving.tokenizer
    n = req.n
    prompt_tokens = completion_tokens = 0
    try:
        for i, (first, gen) in enumerate(started):
            deltas = _Deltas()
            echo = {c: req.echo for c in range(n)}   # each completion's first chunk starts with the prompt
            async for out in serving.outputs_of(first, gen):
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
        await serving.close(started)


async def _stream_chat(rid, name, first, gen, req, raw: Request, serving: OpenAIServing):
    created = int(time.time())
    tokenizer = serving.tokenizer
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
        async for out in serving.outputs_of(first, gen):
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
        await serving.close([(first, gen)])
