"""The OpenAI-compatible server (`tinyvllm serve`): FastAPI + uvicorn around any phase >= 3.

`AsyncEngine` steps the engine in one background thread and hands each request's outputs to its
own asyncio queue; `build_app` makes the FastAPI app (endpoints, errors, /metrics).

The names are imported on first use (PEP 562), so `tinyvllm generate` and `tinyvllm bench`, whose
parser lives beside this package's `cli.py`, never import FastAPI or uvicorn.
"""

from importlib import import_module

_EXPORTS = {"AsyncEngine": "async_engine", "EngineDeadError": "async_engine", "build_app": "app"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
