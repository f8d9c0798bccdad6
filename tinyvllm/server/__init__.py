"""The OpenAI-compatible server (`tinyvllm serve`): FastAPI + uvicorn around any phase >= 3.

`AsyncEngine` steps the engine in one background thread and hands each request's outputs to its
own asyncio queue; `build_app` makes the FastAPI app (endpoints, errors, /metrics).
"""

from tinyvllm.server.app import build_app
from tinyvllm.server.async_engine import AsyncEngine, EngineDeadError

__all__ = ["AsyncEngine", "EngineDeadError", "build_app"]
