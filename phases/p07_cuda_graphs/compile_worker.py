"""Compile phase 7's decode step in a process of its own, for an engine that serves meanwhile.

    python phases/p07_cuda_graphs/compile_worker.py REQUEST

REQUEST (JSON) names the model, the phase and the engine arguments. This process builds the same
model with `compilation_mode=1`, which compiles both graphs and saves them to the cache of
compiled graphs (`$TINYVLLM_CACHE/compiled`), then exits; the engine's thread reads them there.
It runs as a file, not a module of its package, so that a learner's workspace (tinyvllm learn)
can stand in for the phases before any is imported: the worker compiles the engine's own code.

Why a process and not a thread: compiling is Python (TorchDynamo reads the forward's bytecode
operator by operator), so a thread beside the serving loop holds the interpreter's lock most of
the time; and while it traces, torch.fx patches `nn.Module.__call__` for the whole process, so
the serving thread's own modules would be traced. A process shares neither: only the cores,
at a lower priority than the engine's.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    request = json.loads((argv or sys.argv[1:])[0])
    os.nice(10)   # the serving engine first (its thread count stays: a graph's guards check it)
    # with $TINYVLLM_WORKSPACE set, a learner's copies of the phases stand in: theirs compile
    import phases.p07_cuda_graphs.compiled
    phases.p07_cuda_graphs.compiled.NATIVE.tried = True   # its C++ kernels serve the engine that asked: not built here
    phases.make_engine(request["phase"], request["model"], **request["engine_args"])  # compiles, saves
    return 0


if __name__ == "__main__":
    sys.exit(main())
