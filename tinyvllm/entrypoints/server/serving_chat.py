"""POST /v1/chat/completions (vLLM's `serving_chat.py`): messages (and tools) through the model's
chat template, answered whole or streamed as server-sent events.

A request's life is a completion's (`serving_completion.py`) with two steps more:

    tools, tool_choice --tool_mode--> "none" | "auto" | "named" | "required"   (400s here)
        named / required --forced_constraint--> a JSON schema for structured outputs
    messages + tools --chat template--> prompt --engine--> text of each choice
    text --ChoiceParser (reasoning parser, tool parser)--> reasoning_content, content, tool_calls

`chat_tools.py` holds those steps; the parsers are `tool_parsers.py` and `reasoning_parsers.py`.
Without tools and without --reasoning-parser the text is the content, as it comes.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tinyvllm.entrypoints.server.chat_tools import ChoiceParser, forced_constraint, template_messages, tool_mode
from tinyvllm.entrypoints.server.protocol import ChatCompletionRequest
from tinyvllm.entrypoints.server.serving_completion import Deltas, finite, sse, token_text, usage_of
from tinyvllm.entrypoints.server.serving_engine import (
    APIError,
    ClientWatch,
    OpenAIServing,
    bad_value,
    chat_chars,
    check_text,
    error_body,
)


def add_chat_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """Add to `app` the chat route: /v1/chat/completions."""
    tokenizer = serving.tokenizer
    chat_fields = set(ChatCompletionRequest.model_fields)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        serving.check_model(req.model)
        check_text(req)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}",
                           param="top_logprobs")
        serving.check_chars(chat_chars(req), "messages")   # tools count: before their schemas are read
        mode = tool_mode(req, serving.enable_auto_tool_choice)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        try:
            params = req.sampling_params(max_tokens, logprobs, structured=forced_constraint(req, mode))
        except (ValueError, TypeError) as e:
            raise bad_value(e, chat_fields, "messages", req) from None
        serving.check_request(params)
        # vLLM passes the tools to the template whatever tool_choice is ("none" included)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None

        def render_and_encode():   # off the event loop: a long chat takes a while
            text = serving.render_chat(template_messages(req.messages), req.add_generation_prompt,
                                       req.chat_template_kwargs, tools)
            return text, tokenizer.encode(text, add_special_tokens=False)

        text, ids = await asyncio.to_thread(render_and_encode)
        if params.max_tokens is None:  # as vLLM: what the context leaves
            params.max_tokens = max(1, serving.max_model_len - len(ids))
        prompt = {"prompt": text, "prompt_token_ids": ids}
        function = req.tool_choice.function.name if mode == "named" else None
        parsers = [ChoiceParser(mode, serving.tool_call_parser, serving.reasoning_parser, text, function)
                   for _ in range(params.n)]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        watch = ClientWatch(raw)
        try:
            first, gen = await serving.run(rid, prompt, params, chat_fields, "messages", watch, req)
            name = req.model or serving.model_name
            if req.stream:  # from here the streaming response listens for a disconnect itself
                return StreamingResponse(_stream_chat(rid, name, first, gen, req, raw, serving, parsers),
                                         media_type="text/event-stream")
            last = first
            async for out in serving.outputs_of(first, gen, watch):
                last = out
        finally:
            watch.close()
        choices = []
        for c in last.outputs:
            parser = parsers[c.index]
            message = parser.message(c.text) if parser.active else {"role": "assistant", "content": c.text}
            choices.append({"index": c.index, "message": message,
                            "logprobs": {"content": _chat_logprobs(c.token_ids, c.logprobs, tokenizer,
                                                                   req.top_logprobs or 0)}
                            if req.logprobs else None,
                            "finish_reason": parser.finish_reason(c.finish_reason), "stop_reason": c.stop_reason})
        n_out = sum(len(c.token_ids) for c in last.outputs)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": name,
                "choices": choices, "usage": usage_of(len(last.prompt_token_ids), n_out)}


def _chat_logprobs(token_ids, logprobs, tokenizer, k: int) -> list[dict]:
    out = []
    for tid, step in zip(token_ids, logprobs or []):
        text = token_text(tokenizer, tid, step.get(tid))
        top = sorted(step.items(), key=lambda kv: kv[1].rank or 0)[:k]
        out.append({"token": text, "logprob": finite(step[tid].logprob), "bytes": list(text.encode()),
                    "top_logprobs": [{"token": (t2 := token_text(tokenizer, t, o)),
                                      "logprob": finite(o.logprob), "bytes": list(t2.encode())}
                                     for t, o in top]})
    return out


async def _stream_chat(rid, name, first, gen, req, raw: Request, serving: OpenAIServing,
                       parsers: list[ChoiceParser]):
    created = int(time.time())
    tokenizer = serving.tokenizer
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices, usage=None):
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                "choices": choices}
        if include_usage:
            body["usage"] = usage
        return sse(body)

    try:
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(req.n)])
        deltas = Deltas()
        last = first
        async for out in serving.outputs_of(first, gen):
            if await raw.is_disconnected():
                return
            last = out
            for c in out.outputs:
                text, ids, lps = deltas.of(c)
                if not ids and c.finish_reason is None:
                    continue
                parser = parsers[c.index]
                if parser.active:   # what the parsers make of the new text (maybe nothing yet)
                    delta = parser.feed(text)
                    if c.finish_reason is not None:
                        delta = _merge(delta, parser.finish())
                    if not delta and not req.logprobs and c.finish_reason is None:
                        continue
                else:
                    delta = {"content": text}
                yield chunk([{"index": c.index, "delta": delta,
                              "logprobs": {"content": _chat_logprobs(ids, lps, tokenizer, req.top_logprobs or 0)}
                              if req.logprobs else None,
                              "finish_reason": parser.finish_reason(c.finish_reason),
                              "stop_reason": c.stop_reason}])
        if include_usage:
            yield chunk([], usage_of(len(last.prompt_token_ids), sum(len(c.token_ids) for c in last.outputs)))
        yield "data: [DONE]\n\n"
    except APIError as e:  # the engine failed mid-stream: say so, and end the stream properly
        yield sse(error_body(e))
        yield "data: [DONE]\n\n"
    finally:
        await serving.close([(first, gen)])


def _merge(a: dict, b: dict) -> dict:
    """Two deltas of one chunk as one: texts joined, tool calls listed in order."""
    out = dict(a)
    for key, value in b.items():
        out[key] = out.get(key, [] if key == "tool_calls" else "") + value
    return out
