"""A worker rank: a process that holds one share of the model and the KV cache, and runs what the
driver sends, step after step.

The driver (rank 0) starts one process per worker of its host (`start_workers`: `python -m
phases.p08_tensor_parallel`, as vLLM's multiprocessing executor starts its workers); on host K
of several, `tinyvllm serve ... --node-rank K --headless` starts that host's (`run_node`). Each
builds the same parts as the driver, from phase 8's recipe with its own rank, so its weights are
cut, quantized and fused exactly as the driver's are, and its KV cache has the driver's number of
blocks (the block tables are the driver's, shared by every rank); it writes "ready", signed with
the token, in the rendezvous store and joins the group. From there it loops, receiving a message
and running it, until "stop":

    ("forward", input_ids, positions, meta)    the model's forward on this shard
    ("logits", hidden)                         this shard's columns of the logits
    ("decode_run", bucket, rows)               phase 7's decode step: the driver's static rows
                                               copied into this rank's buffers, then this rank's
                                               own decode runner on them (its graph, on a GPU)
    ("stop",)

Every message is one the driver runs at the same moment, so all ranks meet at the same
all-reduces in the same order. A worker never schedules or samples; it returns nothing but its
columns of the logits. A message that is not signed with the token stops the worker, unread.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from tinyvllm.config import EngineConfig
from phases.workspace import REFERENCE
from tinyvllm.platform import resolve_device

from .parallel import (LOOPBACK, TOKEN_ENV, available_cores, host_ip, loads_signed, open_store, rank_device,
                       shared_token, signed_ready, take_token)

STARTUP_TIMEOUT_S = 600
REPO = REFERENCE.parent   # the repository (this file may be a learner's copy, elsewhere)


def threads_per_rank(world: int) -> int:
    """PyTorch threads for each rank: the machine's cores shared out."""
    return max(1, available_cores() // world)


def _ready_key(rank: int) -> str:
    return f"tinyvllm/rank{rank}/ready"


def bind_address(config: EngineConfig) -> str:
    """Where this host's ranks listen: loopback when every rank runs on one host."""
    return LOOPBACK if config.nnodes == 1 else host_ip(config.master_addr)


def worker_main(rank: int, world: int, store_spec: str, setup, build) -> int:
    """The body of worker process `rank`: take its token, build its parts (`build(setup())`: phase
    8's recipe with this rank), report (signed "ready", or the error), serve."""
    store = open_store(store_spec, world, is_master=False)
    try:
        token = take_token()
        s = setup()
        torch.set_num_threads(threads_per_rank(world // s.config.nnodes))
        parts = build(s)
    except BaseException:
        store.set(_ready_key(rank), "error " + traceback.format_exc())
        return 1
    store.set(_ready_key(rank), signed_ready(rank, token))
    parts.model_loader.group.connect(store, token, bind_address(s.config), s.device)
    code = 0
    try:
        serve(parts)
    except Exception:   # a message it cannot run, or one not signed with the token: this rank stops
        traceback.print_exc()
        code = 1
    # the driver removes the rendezvous directory at shutdown; this covers a driver that died first
    if store_spec.startswith("file:"):
        shutil.rmtree(os.path.dirname(store_spec.removeprefix("file:")), ignore_errors=True)
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
        elif kind == "decode_run":
            bucket, rows = args
            decode_runner = parts.runner.decode_runner
            load_decode_rows(decode_runner.buf, bucket, rows)
            with group.in_lockstep():
                decode_runner.run(bucket)
        elif kind == "logits":
            model.compute_logits(args[0])
        else:
            raise ValueError(f"unknown message {kind!r} from the driver")


def worker_env(token: bytes) -> dict:
    """A worker's environment: this one, this repository on its path, and the group's token (in
    the environment, which only this user can read, as the command line is anyone's to read)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **{TOKEN_ENV: token.hex()})


def decode_rows(buf, bucket: int) -> dict:
    """The first `bucket` rows of phase 7's static decode buffers, as the driver filled them."""
    m = buf.num_blocks_used
    return {"input_ids": buf.input_ids[:bucket].cpu(), "positions": buf.positions[:bucket].cpu(),
            "slot_mapping": buf.slot_mapping[:bucket].cpu(), "seq_lens": buf.seq_lens[:bucket].cpu(),
            "block_tables": buf.block_tables[:bucket, :m].cpu(), "num_blocks_used": m,
            "max_seq_len": buf.max_seq_len}


def load_decode_rows(buf, bucket: int, rows: dict) -> None:
    """Copy the driver's rows (`decode_rows`) into this rank's own static buffers."""
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        getattr(buf, name)[:bucket].copy_(rows[name])
    m = rows["num_blocks_used"]
    buf.block_tables[:bucket, :m].copy_(rows["block_tables"])
    buf.num_blocks_used, buf.max_seq_len = m, rows["max_seq_len"]


def worker_args(engine_args: dict, rank: int, ranks_per_host: int) -> dict:
    """Rank `rank`'s engine arguments: the driver's, on its own GPU where the ranks run on GPUs."""
    device = resolve_device(EngineConfig.from_kwargs(**engine_args).device)
    local = rank % ranks_per_host
    if device.type != "cuda":
        return engine_args
    return dict(engine_args, device=str(rank_device(device, local, torch.cuda.device_count())))


def start_workers(store, ranks: range, world: int, store_spec: str, token: bytes, model_path: str,
                  engine_args: dict) -> list[subprocess.Popen]:
    """Start this host's worker ranks (`ranks`) and wait until each has built its shard. A rank
    that fails raises here with its traceback, and every rank already started is stopped."""
    env = worker_env(token)
    per_host = world // EngineConfig.from_kwargs(**engine_args).nnodes
    procs = []
    try:
        for rank in ranks:
            cmd = [sys.executable, "-m", "phases.p08_tensor_parallel", str(rank), str(world), store_spec,
                   model_path, json.dumps(worker_args(engine_args, rank, per_host))]
            procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
        wait_ready(store, dict(zip(ranks, procs)), token, STARTUP_TIMEOUT_S)
    except BaseException:
        stop_workers(procs)
        raise
    return procs


def wait_ready(store, ranks: dict, token: bytes, timeout_s: float, late_hint: str = "") -> None:
    """Wait until every rank of `ranks` (rank -> its process here, or None for a rank of another
    host) has written its signed "ready". A rank that fails raises with its traceback; one that is
    late raises after `timeout_s`, naming it (`late_hint`: how to start it)."""
    deadline = time.monotonic() + timeout_s
    for rank, proc in ranks.items():
        while not store.check([_ready_key(rank)]):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited while starting (exit code {proc.returncode})")
            if time.monotonic() > deadline:
                waiting = [r for r in ranks if not store.check([_ready_key(r)])]
                raise RuntimeError(f"tensor-parallel rank(s) {', '.join(map(str, waiting))} did not join within "
                                   f"{timeout_s:.0f} s{late_hint}")
            time.sleep(0.05)
        msg = store.get(_ready_key(rank)).decode()
        if msg.startswith("error "):
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{msg.removeprefix('error ')}")
        if msg != signed_ready(rank, token):
            raise RuntimeError(f"tensor-parallel rank {rank}: its 'ready' is not signed with this engine's "
                               f"token (another engine, or a host with another {TOKEN_ENV}?)")


def check_hosts(config: EngineConfig) -> None:
    """The hosts' arguments together: this host among them, and as many ranks on each."""
    if config.node_rank >= config.nnodes:
        raise ValueError(f"node_rank must be below nnodes ({config.nnodes}), got {config.node_rank}")
    if config.tensor_parallel_size % config.nnodes:
        raise ValueError(f"tensor_parallel_size ({config.tensor_parallel_size}) must be a multiple of "
                         f"nnodes ({config.nnodes}): every host runs as many ranks")


def run_node(model_path: str, engine_args: dict) -> int:
    """Host `node_rank` (>= 1) of an engine over `nnodes` hosts: start this host's ranks, which
    join node 0's rendezvous at master_addr:master_port, and wait until they stop (vLLM's
    `--headless`). The engine itself (its scheduler, sampler and server) runs on node 0."""
    config = EngineConfig.from_kwargs(**engine_args)
    check_hosts(config)
    if config.nnodes == 1 or config.node_rank == 0:
        raise ValueError("run_node is for hosts 1 .. nnodes-1 of an engine over several hosts "
                         f"(got nnodes={config.nnodes}, node_rank={config.node_rank})")
    token = shared_token()
    world = config.tensor_parallel_size
    per_host = world // config.nnodes
    spec = f"tcp:{config.master_addr}:{config.master_port}"
    store = open_store(spec, world, is_master=False)
    try:
        driver_args, digest = loads_signed(store.get(ENGINE_KEY), token)   # waits for node 0
    except RuntimeError:
        raise RuntimeError(f"tensor parallel: node 0 at {config.master_addr}:{config.master_port} did not "
                           f"publish its engine within the rendezvous timeout") from None
    for name in ("tensor_parallel_size", "nnodes", "master_addr", "master_port"):
        theirs = driver_args.get(name, getattr(EngineConfig(), name))
        if theirs != getattr(config, name):
            raise ValueError(f"{name}={getattr(config, name)!r} on this host, but node 0 runs {theirs!r}: "
                             f"every host must be started with the same {name}")
    if model_digest(model_path) != digest:
        raise ValueError(f"model: {model_path} is not node 0's model (its config.json or weight files "
                         f"differ): every host needs the same checkpoint")
    first = config.node_rank * per_host
    args = dict(driver_args, node_rank=config.node_rank)
    procs = start_workers(store, range(first, first + per_host), world, spec, token, model_path, args)
    codes = [p.wait() for p in procs]
    return max(codes)


# Where node 0 publishes the engine arguments (signed) that the other hosts' ranks build from
ENGINE_KEY = "tinyvllm/engine"


def model_digest(model_path) -> str:
    """A fingerprint of a checkpoint: its config.json, and its weight files' names and sizes."""
    folder = Path(model_path)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()


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


