"""A worker rank: a process that holds one share of the model and the KV cache, and runs what the
driver sends, step after step.

The driver (rank 0) starts one process per worker (`start_workers`: `python -m
phases.p08_tensor_parallel`, as vLLM's multiprocessing executor starts its workers). Each
builds the same parts as the driver, from phase 8's recipe with its own rank (`build`, handed in
by `__main__`), so its weights are cut, quantized and fused exactly as the driver's are, and its
KV cache has the driver's number of blocks (the block tables are the driver's, shared by every
rank); it says "ready" through the rendezvous store and joins the group with the token the driver
put in its environment. From there it loops, receiving a message and running it, until "stop":

    ("forward", input_ids, positions, meta)          the model's forward on this shard
    ("decode_forward", input_ids, positions, meta)   phase 7's decode forward on this shard
    ("logits", hidden)                               this shard's columns of the logits
    ("stop",)

Every message is one the driver runs at the same moment, so all ranks meet at the same
all-reduces in the same order. A worker never schedules or samples; it returns nothing but its
columns of the logits. A message that is not signed with the token stops the worker, unread.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from phases.p07_cuda_graphs import decode_forward

from .parallel import TOKEN_ENV, TensorParallelGroup, available_cores, take_token

STARTUP_TIMEOUT_S = 600
REPO = Path(__file__).resolve().parents[2]


def threads_per_rank(world: int) -> int:
    """PyTorch threads for each rank: the machine's cores shared out."""
    return max(1, available_cores() // world)


def _ready_key(rank: int) -> str:
    return f"tinyvllm/rank{rank}/ready"


def worker_main(rank: int, world: int, store_path: str, build) -> int:
    """The body of worker process `rank`: take its token, build its parts (`build()`: phase 8's
    recipe with this rank), report ("ready" or the error), serve."""
    torch.set_num_threads(threads_per_rank(world))
    store = TensorParallelGroup(rank, world).store(store_path)
    try:
        token = take_token()
        parts = build()
    except BaseException:
        store.set(_ready_key(rank), traceback.format_exc())
        return 1
    store.set(_ready_key(rank), "ready")
    parts.model_loader.group.connect(store, token)
    code = 0
    try:
        serve(parts)
    except Exception:   # a message it cannot run, or one not signed with the token: this rank stops
        traceback.print_exc()
        code = 1
    # the driver removes the rendezvous directory at shutdown; this covers a driver that died first
    shutil.rmtree(os.path.dirname(store_path), ignore_errors=True)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)  # at once: the process group's threads would abort an ordinary exit


@torch.inference_mode()
def serve(parts) -> None:
    """Run the driver's messages on this rank's shard until it says "stop"."""
    group, model, attention = parts.model_loader.group, parts.model, parts.attention
    while True:
        try:
            kind, *args = group.broadcast_object()
        except RuntimeError:    # the driver is gone (its process ended): nothing left to serve
            return
        if kind == "stop":
            return
        if kind == "forward":
            input_ids, positions, meta = args
            model.model(input_ids, positions, attention(meta))
        elif kind == "decode_forward":
            input_ids, positions, meta = args
            decode_forward(model, input_ids, positions, attention(meta))
        elif kind == "logits":
            model.compute_logits(args[0])
        else:
            raise ValueError(f"unknown message {kind!r} from the driver")


def worker_env(token: bytes) -> dict:
    """A worker's environment: this one, this repository on its path, and the group's token (in
    the environment, which only this user can read, as the command line is anyone's to read)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **{TOKEN_ENV: token.hex()})


def start_workers(store, world: int, store_path: str, token: bytes, model_path: str,
                  engine_args: dict) -> list[subprocess.Popen]:
    """Start ranks 1 .. world-1 and wait until each has built its shard. A rank that fails raises
    here with its traceback, and every rank already started is stopped."""
    env = worker_env(token)
    procs = []
    try:
        for rank in range(1, world):
            cmd = [sys.executable, "-m", "phases.p08_tensor_parallel", str(rank), str(world), store_path,
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


