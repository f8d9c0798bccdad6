"""`python -m phases.p08_tensor_parallel RANK WORLD STORE RUN_ID PARENT_PID MODEL ENGINE_ARGS_JSON [PHASE]`:
one worker rank, as its host starts it (worker.start_workers), with the group's token in its
environment (TINYVLLM_TP_TOKEN): it builds phase PHASE's parts (8 unless given) with its rank.
STORE is the rendezvous, "file:PATH" or "tcp:HOST:PORT" (parallel.open_store); RUN_ID (hex) the run every
signed value of this engine carries; PARENT_PID the process that started it, whose end ends this
one too."""

import json
import sys

from phases import get_recipe
from phases.p01_naive_attention import EngineSetup

from .worker import worker_main

if __name__ == "__main__":
    rank, world, store_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    run_id, parent_pid = bytes.fromhex(sys.argv[4]), int(sys.argv[5])
    model, engine_args = sys.argv[6], json.loads(sys.argv[7])
    phase = int(sys.argv[8]) if len(sys.argv) > 8 else 8
    sys.exit(worker_main(rank, world, store_path, run_id, parent_pid,
                         lambda: EngineSetup.create(model, engine_args, rank), get_recipe(phase).build))
