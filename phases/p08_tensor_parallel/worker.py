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
columns of the logits. A message that is not signed with the token, or not stamped with this run
and the next step's number, stops the worker, unread. A worker whose parent (the driver, or its
host's `run_node`) is gone exits too (`exit_with_parent`), removing the rendezvous directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from phases.workspace import REFERENCE
from tinyvllm.config import EngineConfig
from tinyvllm.platform import resolve_device
from tinyvllm.secret_env import child_env

from .parallel import (LOOPBACK, RUN_ID_BYTES, TOKEN_ENV, available_cores, host_ip, nccl_env, open_store,
                       rank_device, shared_token, take_token)
from .rendezvous import beat_until_done, join, write_ready

PARENT_POLL_S = 0.5   # how often a worker looks whether its parent is still there
REPO = REFERENCE.parent   # the repository (this file may be a learner's copy, elsewhere)


def threads_per_rank(world: int) -> int:
    """PyTorch threads for each rank: the machine's cores shared out."""
    return max(1, available_cores() // world)


def bind_address(config: EngineConfig) -> str:
    """Where this host's ranks listen: loopback when every rank runs on one host."""
    return LOOPBACK if config.nnodes == 1 else host_ip(config.master_addr)


def exit_with_parent(parent_pid: int, store_spec: str) -> None:
    """End this worker, from a thread of its own, once the process that started it is gone (it is
    then another process's child): a driver killed while this rank loads or waits leaves nothing
    running, and no rendezvous directory (the driver removes it at shutdown otherwise)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        remove_rendezvous(store_spec)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def remove_rendezvous(store_spec: str) -> None:
    """Remove a one-host rendezvous directory (the FileStore's)."""
    if store_spec.startswith("file:"):
        shutil.rmtree(os.path.dirname(store_spec.removeprefix("file:")), ignore_errors=True)


def worker_main(rank: int, world: int, store_spec: str, run_id: bytes, parent_pid: int, setup, build) -> int:
    """The body of worker process `rank`: take its token, build its parts (`build(setup())`: phase
    8's recipe with this rank), report (signed "ready", or the error), join the group, serve."""
    exit_with_parent(parent_pid, store_spec)
    store = open_store(store_spec, world, is_master=False)
    token = b""
    try:
        token = take_token()
        s = setup()
        torch.set_num_threads(threads_per_rank(world // s.config.nnodes))
        parts = build(s)
    except BaseException:
        error = traceback.format_exc()
        print(error, file=sys.stderr, flush=True)   # on this host, as node 0 shows it on its own
        if token:
            write_ready(store, token, run_id, rank, error=error)
        return 1
    address = bind_address(s.config)
    write_ready(store, token, run_id, rank, address)
    code = 0
    try:
        parts.model_loader.group.connect(store, token, run_id, address, s.device)
        serve(parts)
    except Exception:   # no group, a message it cannot run, or one refused: this rank stops
        traceback.print_exc()
        code = 1
    # the driver removes the rendezvous directory at shutdown; this covers a driver that died first
    remove_rendezvous(store_spec)
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


def worker_env(token: bytes, host: str = LOOPBACK) -> dict:
    """A worker's environment: this one without its secrets (`child_env`), this repository on its
    path, NCCL's sockets where this host's ranks listen (`nccl_env`), and the group's token (in
    the environment, which only this user can read, as the command line is anyone's to read)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    nccl = {k: v for k, v in nccl_env(host).items() if k not in os.environ}   # the user's own choice stays
    return child_env(PYTHONPATH=path, **nccl, **{TOKEN_ENV: token.hex()})


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


def start_workers(ranks: range, world: int, store_spec: str, token: bytes, run_id: bytes, model_path: str,
                  engine_args: dict, host: str = LOOPBACK, phase: int = 8) -> dict[int, subprocess.Popen]:
    """Start this host's worker ranks (`ranks`), each told the run and its parent (this process),
    and given the token in its environment; who waits for them to be ready is the rendezvous
    (`Rendezvous.wait_ready` on node 0). Each builds phase `phase`'s parts (phase 11's: its KV groups)."""
    env = worker_env(token, host)
    per_host = world // EngineConfig.from_kwargs(**engine_args).nnodes
    procs = {}
    try:
        for rank in ranks:
            cmd = [sys.executable, "-m", "phases.p08_tensor_parallel", str(rank), str(world), store_spec,
                   run_id.hex(), str(os.getpid()), model_path, json.dumps(worker_args(engine_args, rank, per_host)),
                   str(phase)]
            procs[rank] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
    except BaseException:
        stop_workers(list(procs.values()))
        raise
    return procs


def check_hosts(config: EngineConfig) -> None:
    """The hosts' arguments together: this host among them, and as many ranks on each."""
    if config.node_rank >= config.nnodes:
        raise ValueError(f"node_rank must be below nnodes ({config.nnodes}), got {config.node_rank}")
    if config.tensor_parallel_size % config.nnodes:
        raise ValueError(f"tensor_parallel_size ({config.tensor_parallel_size}) must be a multiple of "
                         f"nnodes ({config.nnodes}): every host runs as many ranks")


def run_node(model_path: str, engine_args: dict) -> int:
    """Host `node_rank` (>= 1) of an engine over `nnodes` hosts: say hello at node 0's rendezvous
    (master_addr:master_port), build from the engine node 0 answers with, start this host's ranks
    and beat (`beat_until_done`) until they stop (vLLM's `--headless`). The engine itself (its
    scheduler, sampler and server) runs on node 0."""
    config = EngineConfig.from_kwargs(**engine_args)
    check_hosts(config)
    if config.nnodes == 1 or config.node_rank == 0:
        raise ValueError("run_node is for hosts 1 .. nnodes-1 of an engine over several hosts "
                         f"(got nnodes={config.nnodes}, node_rank={config.node_rank})")
    token = shared_token()
    world = config.tensor_parallel_size
    first = config.node_rank * (world // config.nnodes)
    spec = f"tcp:{config.master_addr}:{config.master_port}"
    store = open_store(spec, world, is_master=False)
    address = host_ip(config.master_addr)
    run_id, (driver_args, digest) = join(store, token, config.node_rank, first, address,
                                         secrets.token_bytes(RUN_ID_BYTES))
    try:
        for name in ("tensor_parallel_size", "nnodes", "master_addr", "master_port"):
            theirs = driver_args.get(name, getattr(EngineConfig(), name))
            if theirs != getattr(config, name):
                raise ValueError(f"{name}={getattr(config, name)!r} on host {config.node_rank}, but node 0 runs "
                                 f"{theirs!r}: every host must be started with the same {name}")
        if model_digest(model_path) != digest:
            raise ValueError(f"model: {model_path} on host {config.node_rank} is not node 0's model (its "
                             f"config.json or weight files differ): every host needs the same checkpoint")
    except ValueError as e:   # node 0 says so too, at once, rather than after the load timeout
        write_ready(store, token, run_id, first, error=str(e))
        raise
    args = dict(driver_args, node_rank=config.node_rank)
    procs = start_workers(range(first, first + world // config.nnodes), world, spec, token, run_id, model_path,
                          args, address)
    try:
        return beat_until_done(store, token, run_id, config.node_rank, first, procs, stop_workers)
    finally:
        stop_workers(list(procs.values()))


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
        group.who_is_gone = None   # a failed "stop" needs no names (naming a host waits for its heartbeat)
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


