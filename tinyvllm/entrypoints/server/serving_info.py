"""The routes that read the server and generate nothing: GET /v1/models, /metrics (Prometheus),
/v1/engine/state and the live page at GET /, and POST /tokenize and /detokenize.

vLLM serves these from `serving_models.py`, `serving_tokenization.py` and `api_server.py`; here
they are short enough to share one file. /health is beside the API key check in `app.py`, the
generation routes are in `serving_completion.py` and `serving_chat.py`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from tinyvllm.entrypoints.server.chat_tools import template_messages
from tinyvllm.entrypoints.server.protocol import DetokenizeRequest, TokenizeRequest
from tinyvllm.entrypoints.server.serving_engine import APIError, OpenAIServing, check_text, chat_chars

STATIC = Path(__file__).parent / "static"


def add_info_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """Add to `app` the routes of its model, metrics, engine state, live page and tokenizer."""
    engine, metrics, tokenizer = serving.engine, serving.metrics, serving.tokenizer
    model_name, max_model_len = serving.model_name, serving.max_model_len
    created = int(time.time())

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
        serving.check_model(req.model)
        check_text(req)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give one of prompt or messages", param="prompt")
        if req.messages is not None:
            serving.check_chars(chat_chars(req), "messages")
            ids = await asyncio.to_thread(lambda: tokenizer.encode(serving.render_chat(
                template_messages(req.messages), req.add_generation_prompt, req.chat_template_kwargs,
                [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None),
                add_special_tokens=False))
        else:
            serving.check_chars(len(req.prompt), "prompt")
            ids = await asyncio.to_thread(tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        if len(req.tokens) > max_model_len:   # no sequence of this model is longer
            raise APIError(400, f"tokens: at most max_model_len ({max_model_len}) ids, got {len(req.tokens)}",
                           param="tokens")
        vocab = engine.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: ids must be in [0, {vocab}), got {bad[0]}", param="tokens")
        text = await asyncio.to_thread(tokenizer.decode, req.tokens, skip_special_tokens=False)
        return {"prompt": text}
