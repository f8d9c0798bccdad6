"""Phase 9's recipe: phase 8's parts, the same engine loop, run in a process of its own.

    front_end   `make_front_end`: an `EngineCoreClient` (core_client.py) whose child process builds
                phase 8's engine and runs its loop (core.py), token ids only; the front keeps the
                tokenizer, the checks that need no part, the text and its stop strings
                (output_processor.py), and the caller (LLM, the CLI, the server)

Every part is phase 8's: what changes is where the loop runs and how requests reach it, not what
it runs. Phase 8 rather than phase 7 because the newest phase is the one users run: tensor
parallelism keeps working (the core starts the worker ranks, and they end with it). With
$TINYVLLM_ENABLE_MULTIPROCESSING=0 (`platform.engine_core_process`) phase 9 is phase 8 in the
caller's process, as vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0 is.
"""

from __future__ import annotations

from phases.p01_naive_attention import Engine, EngineSetup, Recipe
from phases.p08_tensor_parallel import RECIPE as PHASE8
from tinyvllm import platform

from .core_client import EngineCoreClient


def make_front_end(model, engine_args: dict, recipe: Recipe):
    """The engine core's client, or (with the split switched off) the engine itself."""
    if not platform.engine_core_process():
        setup = EngineSetup.create(model, engine_args)
        return Engine(setup, recipe.build(setup))
    return EngineCoreClient(model, engine_args, recipe.phase)


RECIPE = PHASE8.extend(phase=9, front_end=make_front_end)
