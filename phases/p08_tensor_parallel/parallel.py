"""The tensor-parallel group: ranks, their collectives, and how the driver talks to its workers.

Rank 0 is the driver: the engine, its scheduler and sampler live there. Ranks 1 .. N-1 are
workers, each a process holding its share of every weight and of the KV cache: started by the
driver on its own host (`start_workers`), or by `tinyvllm serve ... --node-rank K --headless` on
host K of several (`worker.run_node`). They meet over `torch.distributed`:

- the rendezvous: on one host a `FileStore` in a directory only this user can open; over several
  hosts a `TCPStore` on node 0 at `master_addr:master_port` (`open_store`);
- the control plane, a gloo process group: the driver's step, pickled and signed, broadcast to
  every rank (CPU tensors, as vLLM keeps its control messages off NCCL); its sockets listen on
  loopback on one host, and on the address this host reaches node 0 from over several (`host_ip`);
- the data plane, where the all-reduces run: the same gloo group on a CPU, an NCCL group on CUDA
  (`backend_for`), each rank on its own GPU (`rank_device`).

The group is an object of its own (not the process-wide default group), so a process can hold
several engines one after another.

Three collectives are all a tensor-parallel forward needs:

- `all_reduce(x)`: every rank holds a partial sum of the same (N, D) tensor; afterwards every rank
  holds the total. Once after each row-parallel product (o_proj, down_proj) and the embedding.
- `gather_columns(x)`: every rank holds some columns of the logits; the driver gets them all.
- `broadcast_object(obj)`: the driver tells the workers what to run (a step's inputs), pickled and
  signed with the engine's token (`dumps_signed`): a worker unpickles only what the driver signed.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import os
import pickle
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# The rendezvous must finish within this; a collective may wait much longer, as a worker waits
# for the driver's next step for as long as the engine is idle (a rank that dies closes its
# sockets, which fails the others' collectives at once).
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)
LOOPBACK = "127.0.0.1"            # where the ranks of one host listen
TOKEN_ENV = "TINYVLLM_TP_TOKEN"   # how a worker gets its token: its environment, not its command line
HOST_IP_ENV = "TINYVLLM_HOST_IP"  # this host's address for the other hosts (vLLM's VLLM_HOST_IP)
SIGNATURE_BYTES = 32              # HMAC-SHA256


def backend_for(device: torch.device) -> str:
    """The data plane's backend: NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, local_rank: int, num_gpus: int) -> torch.device:
    """The device of the `local_rank`-th rank of a host: its own GPU (`cuda:local_rank`, among the
    ones CUDA_VISIBLE_DEVICES shows), or the CPU the host's ranks share."""
    if device.type != "cuda":
        return device
    if local_rank >= num_gpus:
        raise ValueError(f"tensor_parallel_size: rank {local_rank} of this host needs a GPU of its own, "
                         f"and this host shows {num_gpus} (CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", local_rank)


def host_ip(master_addr: str) -> str:
    """The address the other hosts reach this one at: TINYVLLM_HOST_IP, else the local address
    this host's route to `master_addr` leaves from (no packet is sent)."""
    if os.environ.get(HOST_IP_ENV):
        return os.environ[HOST_IP_ENV]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(master_addr), 9))
        return s.getsockname()[0]


def open_store(spec: str, world: int, is_master: bool) -> dist.Store:
    """The rendezvous store `spec` names: "file:PATH" (one host: a file only this user can open,
    no port) or "tcp:HOST:PORT" (several hosts: node 0 serves it, the others connect, retrying
    until the rendezvous timeout)."""
    kind, _, where = spec.partition(":")
    if kind == "file":
        store = dist.FileStore(where, world)
        store.set_timeout(rendezvous_timeout())
        return store
    if kind != "tcp":
        raise ValueError(f"rendezvous store {spec!r}: expected 'file:PATH' or 'tcp:HOST:PORT'")
    host, _, port = where.rpartition(":")
    try:
        return dist.TCPStore(host, int(port), None, is_master, timeout=rendezvous_timeout(),
                             wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        what = "serve the rendezvous on" if is_master else "reach node 0's rendezvous at"
        raise RuntimeError(f"tensor parallel: could not {what} {host}:{port} ({e}); check master_addr "
                           f"and master_port, and that node 0 runs") from None


def rendezvous_timeout() -> datetime.timedelta:
    """How long ranks wait for each other to join: TINYVLLM_RENDEZVOUS_TIMEOUT_S, or 120 s."""
    return datetime.timedelta(seconds=float(os.environ.get("TINYVLLM_RENDEZVOUS_TIMEOUT_S", 120)))


def available_cores() -> int:
    """The CPU cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def shard_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s part of n items split into `world` contiguous parts whose sizes differ by at
    most one (the first n % world parts get one more): (start, stop)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def take_token() -> bytes:
    """A worker's token, taken out of its environment (`TOKEN_ENV`, where the driver put it) so
    that no process it starts inherits it."""
    value = os.environ.pop(TOKEN_ENV, "")
    try:
        token = bytes.fromhex(value)
    except ValueError:
        token = b""
    if not token:
        raise RuntimeError(f"{TOKEN_ENV} must hold the token (in hex) that the driver sets when it "
                           f"starts a worker rank; got {len(value)} characters")
    return token


def shared_token() -> bytes:
    """The token of an engine over several hosts: no host can hand it to another, so the user
    sets the same secret in TINYVLLM_TP_TOKEN on every host (hex, at least 16 bytes)."""
    value = os.environ.get(TOKEN_ENV, "")
    try:
        token = bytes.fromhex(value)
    except ValueError:
        token = b""
    if len(token) < 16:
        raise ValueError(f"nnodes > 1: set {TOKEN_ENV} to the same secret on every host, at least 16 "
                         f"bytes in hex (python -c 'import secrets; print(secrets.token_hex(32))'); the "
                         f"ranks sign and check every message with it")
    return token


def signed_ready(rank: int, token: bytes) -> str:
    """What rank `rank` writes in the store once it has built its shard: only a holder of the
    token can write it."""
    return "ready " + _signature(f"ready/{rank}".encode(), token).hex()


def _signature(data: bytes, token: bytes) -> bytes:
    if len(token) < 16:
        raise ValueError(f"token must be at least 16 random bytes, got {len(token)}")
    return hmac.new(token, data, hashlib.sha256).digest()


def dumps_signed(obj, token: bytes) -> bytes:
    """`obj` pickled, behind its HMAC-SHA256 under `token`: bytes only a holder of the token can make."""
    data = pickle.dumps(obj)
    return _signature(data, token) + data


def loads_signed(signed: bytes, token: bytes):
    """The object `dumps_signed` made, unpickled only once its signature checks out: unpickling runs
    code the bytes name, so bytes from anyone else raise a ValueError, unread."""
    signature, data = signed[:SIGNATURE_BYTES], signed[SIGNATURE_BYTES:]
    if not hmac.compare_digest(signature, _signature(data, token)):
        raise ValueError("a tensor-parallel message is not signed with this engine's token: refused unread")
    return pickle.loads(data)


@dataclass
class TensorParallelGroup:
    """This process's place in the group: `rank` of `world`, the process group (None until
    `connect`, and for a group of one), and the token its messages are signed with."""

    rank: int = 0
    world: int = 1
    pg: object = None           # the control plane: gloo, CPU tensors
    data_pg: object = None      # the data plane: the all-reduces (pg on a CPU, NCCL on CUDA)
    token: bytes = field(default=b"", repr=False)
    # True while every rank runs the same call at once (phase 7's decode step, each rank on its
    # own static buffers): the model then sends the workers nothing of its own
    lockstep: bool = False

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def connect(self, store: dist.Store, token: bytes, host: str = LOOPBACK,
                device: torch.device = torch.device("cpu")) -> None:
        """Join the group, its gloo sockets bound to `host`, its messages signed with `token`, its
        all-reduces on `device`'s backend (`backend_for`); returns once every rank has."""
        self.token = token
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = COLLECTIVE_TIMEOUT
        self.pg = self.data_pg = dist.ProcessGroupGloo(store, self.rank, self.world, options)
        if backend_for(device) == "nccl":
            device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = COLLECTIVE_TIMEOUT
            self.data_pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), self.rank, self.world, nccl)

    @contextlib.contextmanager
    def in_lockstep(self):
        """Every rank runs this same block now: the model sends the workers nothing of its own."""
        self.lockstep = True
        try:
            yield
        finally:
            self.lockstep = False

    def _wait(self, work, what: str) -> None:
        """Wait for a collective; a rank that is gone (its process or its host) fails it with an
        error that says so, instead of gloo's socket message alone."""
        try:
            work.wait()
        except RuntimeError as e:
            raise RuntimeError(f"tensor parallel: {what} failed on rank {self.rank}: another rank of "
                               f"this engine is gone ({e}). The engine cannot run another step; "
                               f"start every host again") from None

    # -- the collectives --------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x, on every rank (in place)."""
        if self.world > 1:
            self._wait(self.data_pg.allreduce([x]), "an all-reduce")
        return x

    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor | None:
        """Rank r's columns (M, C_r) of an (M, total) tensor, split by `shard_range`: the whole on
        the driver, None on a worker."""
        if self.world == 1:
            return x
        if not self.is_driver:
            self._wait(self.data_pg.send([x.contiguous()], 0, 0), "sending the logits")
            return None
        parts = [x]
        for r in range(1, self.world):
            start, stop = shard_range(total, r, self.world)
            part = torch.empty(x.shape[0], stop - start, dtype=x.dtype, device=x.device)
            self._wait(self.data_pg.recv([part], r, 0), "gathering the logits")
            parts.append(part)
        return torch.cat(parts, dim=1)

    def broadcast_object(self, obj=None):
        """The driver's `obj`, on every rank: pickled and signed, its length sent first, then its
        bytes; a worker checks the signature before it unpickles (`loads_signed`)."""
        if self.is_driver:
            data = torch.frombuffer(bytearray(dumps_signed(obj, self.token)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
            self._wait(self.pg.broadcast(size, 0), "sending the step")
            self._wait(self.pg.broadcast(data, 0), "sending the step")
            return obj
        size = torch.zeros(1, dtype=torch.int64)
        self._wait(self.pg.broadcast(size, 0), "receiving the step")
        data = torch.empty(int(size), dtype=torch.uint8)
        self._wait(self.pg.broadcast(data, 0), "receiving the step")
        return loads_signed(data.numpy().tobytes(), self.token)
