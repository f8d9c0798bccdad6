"""`python -m phases.p09_engine_core IPC_DIR PARENT_PID PHASE MODEL ENGINE_ARGS_JSON`: an engine core,
as `EngineCoreClient` starts it: it builds phase PHASE's parts into the one engine (`Engine(setup,
RECIPE.build(setup))`, in this process), connects to the front's sockets in IPC_DIR and runs the
busy loop (core.core_main) until told to stop or PARENT_PID, the front, is gone."""

import dataclasses
import json
import sys

import phases
from phases.p01_naive_attention import Engine, EngineSetup

from .core import core_main


def build_engine(phase: int, model: str, engine_args: dict) -> Engine:
    """The engine, making token ids only: the front makes the text (core_client.py)."""
    setup = dataclasses.replace(EngineSetup.create(model, engine_args), detokenize=False)
    return Engine(setup, phases.get_recipe(phase).build(setup))


if __name__ == "__main__":
    ipc_dir, parent_pid, phase = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model, engine_args = sys.argv[4], json.loads(sys.argv[5])
    sys.exit(core_main(ipc_dir, parent_pid, lambda: build_engine(phase, model, engine_args)))
