"""A worker rank: a process that holds one share of the model and the KV cache, and runs what the
driver sends, step after step.

The driver (rank 0) starts one process per worker (`start_workers`: `python -m
phases.p08_tensor_parallel`, as vLLM's multiprocessing executor starts its workers). Each
builds the same engine as the driver with its own rank, so its weights are cut, quantized and
fused exactly as the driver's are, and its KV cache has the driver's number of blocks (the block
tables are the driver's, shared by every rank); it says "ready" through the rendezvous store and
joins the group. From there it loops, receiving a message and running it, until "stop":

    ("forward", input_ids, positions, meta)          the model's forward on this shard
    ("decode_forward", input_ids, positions, meta)   phase 7's decode forward on this shard
    ("logits", hidden)                               this shard's columns of the logits
    ("stop",)

Every message is one the driver runs at the same moment, so all ranks meet at the same
all-reduces in the same order. A worker never schedules or samples; it returns nothing but its
columns of the logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from .parallel import available_cores

STARTUP_TIMEOUT_S = 600
REPO = Path(__file__).resolve().parents[2]


def threads_per_rank(world: int) -> int:
    """PyTorch threads for each rank: the machine's cores shared out."""
    return max(1, available_cores() // world)


def _ready_key(rank: int) -> str:
    return f"tinyvllm/rank{rank}/ready"


def worker_main(rank: int, world: int, port: int, model_path: str, engine_args: dict) -> int:
    """The body of worker process `rank`: build the shard, report ("ready" or the error), serve."""
    from phases.p08_tensor_parallel.engine import Engine
    from phases.p08_tensor_parallel.parallel import TensorParallelGroup

    torch.set_num_threads(threads_per_rank(world))
    store = TensorParallelGroup(rank, world).store(port)
    try:
        engine = Engine(model_path, _tensor_parallel_rank=rank, **engine_args)
    except BaseException:
        store.set(_ready_key(rank), traceback.format_exc())
        return 1
    store.set(_ready_key(rank), "ready")
    engine.group.connect(store)
    serve(engine)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # at once: the process group's threads would abort an ordinary exit


@torch.inference_mode()
def serve(engine) -> None:
    """Run the driver's messages on this rank's shard until it says "stop"."""
    from phases.p07_cuda_graphs.fused import decode_forward

    group, model = engine.group, engine.model
    while True:
        try:
            kind, *args = group.broadcast_object()
        except RuntimeError:    # the driver is gone (its process ended): nothing left to serve
            return
        if kind == "stop":
            return
        if kind == "forward":
            input_ids, positions, meta = args
            model.model(input_ids, positions, engine.make_attention(meta))
        elif kind == "decode_forward":
            input_ids, positions, meta = args
            decode_forward(model, input_ids, positions, engine.make_attention(meta))
        elif kind == "logits":
            model.compute_logits(args[0])
        else:
            raise ValueError(f"unknown message {kind!r} from the driver")


def start_workers(store, world: int, port: int, model_path: str, engine_args: dict) -> list[subprocess.Popen]:
    """Start ranks 1 .. world-1 and wait until each has built its shard. A rank that fails raises
    here with its traceback, and every rank already started is stopped."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    procs = []
    try:
        for rank in range(1, world):
            cmd = [sys.executable, "-m", "phases.p08_tensor_parallel", str(rank), str(world), str(port),
                   model_path, json.dumps(engine_args)]
            procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
        for rank, p in enumerate(procs, start=1):
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not store.check([_ready_key(rank)]):
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited while starting (exit code {p.returncode})")
                time.sleep(0.05)
            msg = store.get(_ready_key(rank)).decode()
            if msg != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{msg}")
    except BaseException:
        stop_workers(procs)
        raise
    return procs


def stop_workers(procs: list[subprocess.Popen], group=None) -> None:
    """Ask the workers to stop (when the group still works), then make sure they have."""
    if group is not None and group.pg is not None and any(p.poll() is None for p in procs):
        try:
            group.broadcast_object(("stop",))
        except Exception:
            pass
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


