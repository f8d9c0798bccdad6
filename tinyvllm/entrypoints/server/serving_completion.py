"""POST /v1/completions (OpenAI's legacy completions: a prompt, or several, as text or token ids),
answered whole or streamed as server-sent events, with OpenAI's logprobs objects and usage counts.

As vLLM, the chat route is in `serving_chat.py`; the two share a request's life
(`OpenAIServing.run`, `outputs_of`, `close`) and the helpers at the end of this file. Every
request is checked before it reaches the engine, and one whose client goes away is aborted,
streaming or not.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tinyvllm.outputs import RequestOutput
from tinyvllm.entrypoints.server.protocol import CompletionRequest
from tinyvllm.entrypoints.server.serving_engine import (
    APIError,
    ClientWatch,
    OpenAIServing,
    bad_value,
    check_text,
    error_body,
)


def add_completion_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """Add to `app` the route that completes prompts: /v1/completions."""
    tokenizer = serving.tokenizer
    completion_fields = set(CompletionRequest.model_fields)

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
                "choices": choices, "usage": usage_of(prompt_tokens, completion_tokens)}


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


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_text(tokenizer, tid: int, lp) -> str:
    """A token's text, as its logprob entry decoded it or decoded alone."""
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid], skip_special_tokens=False)


def finite(x: float) -> float:
    """A logprob JSON can carry."""
    return x if math.isfinite(x) else -9999.0   # JSON has no -inf (vLLM writes -9999.0 too)


def _completion_logprobs(token_ids, logprobs, tokenizer, k: int, offset: int = 0) -> dict:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    pos = offset
    for tid, step in zip(token_ids, logprobs or []):
        text = token_text(tokenizer, tid, step.get(tid))
        res["tokens"].append(text)
        res["token_logprobs"].append(finite(step[tid].logprob))
        top = sorted(step.items(), key=lambda kv: kv[1].rank or 0)[:k]
        res["top_logprobs"].append({token_text(tokenizer, t, o): finite(o.logprob) for t, o in top} if k else None)
        res["text_offset"].append(pos)
        pos += len(text)
    return res


def sse(obj) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj)}\n\n"


class Deltas:
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
            deltas = Deltas()
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
                    yield sse({"id": rid, "object": "text_completion", "created": created,
                                "model": name, "choices": [choice], "usage": None})
                if out.finished:
                    prompt_tokens += len(out.prompt_token_ids)
                    completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        if req.stream_options and req.stream_options.include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                        "choices": [], "usage": usage_of(prompt_tokens, completion_tokens)})
        yield "data: [DONE]\n\n"
    except APIError as e:  # the engine failed mid-stream: say so, and end the stream properly
        yield sse(error_body(e))
        yield "data: [DONE]\n\n"
    finally:
        await serving.close(started)
