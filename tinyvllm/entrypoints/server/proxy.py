"""`tinyvllm proxy`: one endpoint in front of a prefill server and a decode server.

Phase 10's connector splits a request between two engines: a `kv_producer` computes the prompt's
blocks and saves each into the tier the two share, a `kv_consumer` finds them there by their
hashes, loads them instead of computing them, and decodes. Each is a `tinyvllm serve` of its own;
the proxy gives clients the one endpoint they expect:

    client --POST /v1/completions--> proxy --1. the request, max_tokens 1, not streamed--> prefill
                                           --2. the request as sent ----------------------> decode
           <--------------- the decode server's answer (or its stream), byte for byte -----

Nothing but requests passes through the proxy; the blocks go through the tier. An error from the
prefill server (a 400 naming a field, say) is the client's answer and the decode server never sees
the request; a server that cannot be reached is a 502 naming it. vLLM's benchmark proxy does the
same (`benchmarks/disagg_benchmarks/disagg_prefill_proxy_server.py`).
"""

# No `from __future__ import annotations` here: FastAPI reads the routes' annotations, and
# `Request` is imported where the app is built (the command line imports this module; only
# `tinyvllm proxy` needs FastAPI).
import json

ROUTES = ("/v1/completions", "/v1/chat/completions")
# what the prefill server's copy of a request must not carry: it generates one token, whole
_PREFILL_DROPS = ("stream_options", "max_completion_tokens", "min_tokens")


def prefill_request(body: dict) -> dict:
    """The request the prefill server gets: the same prompt and sampling, one token, not streamed."""
    first = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    return {**first, "max_tokens": 1, "stream": False, "n": 1}


def _error(status: int, message: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "BadGateway" if status == 502 else "BadRequestError",
                                   "param": None, "code": status}}, status_code=status)


def build_app(prefill: str, decode: str, timeout: float = 600.0):
    """The proxy's FastAPI app: `prefill` and `decode` are the two servers' base URLs."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse
    from starlette.background import BackgroundTask

    prefill, decode = prefill.rstrip("/"), decode.rstrip("/")
    client = httpx.AsyncClient(timeout=timeout)
    app = FastAPI(title="tinyvllm proxy", on_shutdown=[client.aclose])

    def passed(request: Request) -> dict:
        return {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}

    def answer(r) -> Response:
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    async def forward(request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = passed(request)
        try:
            first = await client.post(prefill + path, json=prefill_request(body), headers=headers)
        except httpx.HTTPError as e:
            return _error(502, f"the prefill server {prefill} cannot be reached: {type(e).__name__}")
        if first.status_code != 200:
            return answer(first)
        try:
            if body.get("stream"):
                r = await client.send(client.build_request("POST", decode + path, content=raw, headers=headers),
                                      stream=True)
                return StreamingResponse(r.aiter_raw(), r.status_code, media_type=r.headers.get("content-type"),
                                         background=BackgroundTask(r.aclose))
            return answer(await client.post(decode + path, content=raw, headers=headers))
        except httpx.HTTPError as e:
            return _error(502, f"the decode server {decode} cannot be reached: {type(e).__name__}")

    def route(path: str):
        async def endpoint(request: Request):
            return await forward(request, path)
        return endpoint

    for path in ROUTES:
        app.add_api_route(path, route(path), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            return answer(await client.get(decode + "/v1/models", headers=passed(request)))
        except httpx.HTTPError as e:
            return _error(502, f"the decode server {decode} cannot be reached: {type(e).__name__}")

    @app.get("/health")
    async def health():
        down = []
        for name, url in (("prefill", prefill), ("decode", decode)):
            try:
                if (await client.get(url + "/health")).status_code != 200:
                    down.append(f"{name} ({url})")
            except httpx.HTTPError:
                down.append(f"{name} ({url})")
        return Response(status_code=200) if not down else _error(502, f"not healthy: {', '.join(down)}")

    return app


def add_proxy_parser(subparsers):
    p = subparsers.add_parser(
        "proxy", help="one endpoint in front of a prefill server and a decode server (phase 10's kv_producer "
                      "and kv_consumer)",
        description="Send each request to the prefill server with max_tokens 1, then to the decode server, "
                    "and answer with the decode server's response (streamed if the request asks).")
    p.add_argument("--prefill", required=True, metavar="URL", help="the kv_producer's tinyvllm serve, e.g. "
                                                                   "http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, metavar="URL", help="the kv_consumer's tinyvllm serve")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for either server's answer (default 600)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    return p


def run_proxy(args) -> int:
    import uvicorn

    for name in ("prefill", "decode"):
        url = getattr(args, name)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--{name}: {url!r} is not an http:// or https:// URL")
    uvicorn.run(build_app(args.prefill, args.decode, args.timeout), host=args.host, port=args.port,
                log_level=args.log_level)
    return 0
