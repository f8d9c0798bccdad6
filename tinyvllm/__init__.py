"""tinyvllm: a vLLM-style inference engine, built in phases to learn from.

    from tinyvllm import LLM, SamplingParams

`LLM`, the front door (`tinyvllm.entrypoints.llm`), builds engines through the phase registry,
so it imports the phases; it is imported when first asked for, as vLLM's `vllm/__init__.py`
does, and importing the foundation (`tinyvllm.model`, `tinyvllm.sampler`, ...) imports no phase.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from tinyvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # what type checkers and IDEs read; at run time, __getattr__ below
    from tinyvllm.entrypoints.llm import LLM

if os.environ.get("TINYVLLM_WORKSPACE"):
    # a learner's copy of phase 1 holds a foundation module (the sampler): the registry puts the
    # learner's copies in place before any such module is imported (phases/workspace.py)
    import phases  # noqa: F401

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics"]

# a name of the front door -> its module, imported on first access
_LAZY = {"LLM": "tinyvllm.entrypoints.llm"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next access finds it here
        return value
    raise AttributeError(f"module 'tinyvllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
