"""`python -m phases.p08_tensor_parallel RANK WORLD PORT MODEL ENGINE_ARGS_JSON`: one worker rank,
as the driver starts it (worker.start_workers)."""

import json
import sys

from .worker import worker_main

if __name__ == "__main__":
    rank, world, port = (int(a) for a in sys.argv[1:4])
    sys.exit(worker_main(rank, world, port, sys.argv[4], json.loads(sys.argv[5])))
