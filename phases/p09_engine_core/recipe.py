"""Phase 9's recipe: phase 8's parts, the same engine loop, run in a process of its own, and
stepped one step ahead of the model there.

    front_end   `make_front_end`: an `EngineCoreClient` (core_client.py) whose child process builds
                phase 8's engine and runs its loop (core.py), token ids only; the front keeps the
                tokenizer, the checks that need no part, the text and its stop strings
                (output_processor.py), and the caller (LLM, the CLI, the server)
    scheduler   with `async_scheduling` (the platform's default: on a GPU; on a CPU, where it
                measured as a loss, off): `AsyncScheduler` (async_scheduler.py),
                phase 8's scheduler that can also plan step N+1 while step N runs, with
                placeholders for N's tokens; the core steps it through a `BatchQueue`
                (batch_queue.py), two batches in flight

Every other part is phase 8's: what changes is where the loop runs, how requests reach it, and
when the next step is planned, not what a step runs. Phase 8 rather than phase 7 because the
newest phase is the one users run: tensor parallelism keeps working (the core starts the worker
ranks, and they end with it). With $TINYVLLM_ENABLE_MULTIPROCESSING=0 (`platform.engine_core_process`)
phase 9 is phase 8 in the caller's process, as vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0 is: the
caller's thread steps it, one step at a time (the batch queue is the core loop's; in one process
its model thread would share the interpreter with the caller's own work).
"""

from __future__ import annotations

from phases.p01_naive_attention import Engine, EngineSetup, Parts, Recipe
from phases.p08_tensor_parallel import RECIPE as PHASE8
from tinyvllm import platform

from .async_scheduler import AsyncScheduler
from .core_client import EngineCoreClient


def make_front_end(model, engine_args: dict, recipe: Recipe):
    """The engine core's client, or (with the split switched off) the engine itself."""
    if not platform.engine_core_process():
        setup = EngineSetup.create(model, engine_args)
        return Engine(setup, recipe.build(setup))
    return EngineCoreClient(model, engine_args, recipe.phase)


def make_scheduler(setup: EngineSetup, parts: Parts):
    inner = PHASE8.scheduler(setup, parts)
    if not platform.async_scheduling_default(setup.config.async_scheduling, setup.device.type):
        return inner
    return AsyncScheduler(inner)


RECIPE = PHASE8.extend(phase=9, engine_args={"async_scheduling"}, front_end=make_front_end,
                       scheduler=make_scheduler)
