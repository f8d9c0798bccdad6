"""The tensor-parallel group: ranks, their collectives, and how the driver talks to its workers.

Rank 0 is the driver: the engine, its scheduler and sampler live there. Ranks 1 .. N-1 are
workers, each a process started by the driver (`start_workers`), each holding its share of every
weight and of the KV cache. They meet over `torch.distributed`: a `FileStore` in a directory only
this user can open for the rendezvous, then a gloo process group whose sockets listen on loopback
only (CPU tensors; the engine refuses more than one rank on a GPU, where NCCL would carry them).
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

import datetime
import hashlib
import hmac
import os
import pickle
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# The rendezvous must finish within this; a collective may wait much longer, as a worker waits
# for the driver's next step for as long as the engine is idle (a rank that dies closes its
# sockets, which fails the others' collectives at once).
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)
LOOPBACK = "127.0.0.1"            # the only address a rank listens on: every rank runs on one host
TOKEN_ENV = "TINYVLLM_TP_TOKEN"   # how a worker gets its token: its environment, not its command line
SIGNATURE_BYTES = 32              # HMAC-SHA256


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
    pg: object = None
    token: bytes = field(default=b"", repr=False)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def store(self, path: str) -> dist.FileStore:
        """The rendezvous: a key-value store in the file `path`, which every rank opens. It needs no
        port; keep it in a directory only this user can open (`tempfile.mkdtemp`)."""
        store = dist.FileStore(path, self.world)
        store.set_timeout(rendezvous_timeout())
        return store

    def connect(self, store: dist.Store, token: bytes) -> None:
        """Join the group, its sockets bound to loopback, its messages signed with `token`;
        returns once every rank has."""
        self.token = token
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        options._timeout = COLLECTIVE_TIMEOUT
        self.pg = dist.ProcessGroupGloo(store, self.rank, self.world, options)

    # -- the collectives --------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x, on every rank (in place)."""
        if self.world > 1:
            self.pg.allreduce([x]).wait()
        return x

    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor | None:
        """Rank r's columns (M, C_r) of an (M, total) tensor, split by `shard_range`: the whole on
        the driver, None on a worker."""
        if self.world == 1:
            return x
        if not self.is_driver:
            self.pg.send([x.contiguous()], 0, 0).wait()
            return None
        parts = [x]
        for r in range(1, self.world):
            start, stop = shard_range(total, r, self.world)
            part = torch.empty(x.shape[0], stop - start, dtype=x.dtype)
            self.pg.recv([part], r, 0).wait()
            parts.append(part)
        return torch.cat(parts, dim=1)

    def broadcast_object(self, obj=None):
        """The driver's `obj`, on every rank: pickled and signed, its length sent first, then its
        bytes; a worker checks the signature before it unpickles (`loads_signed`)."""
        if self.is_driver:
            data = torch.frombuffer(bytearray(dumps_signed(obj, self.token)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
            self.pg.broadcast(size, 0).wait()
            self.pg.broadcast(data, 0).wait()
            return obj
        size = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast(size, 0).wait()
        data = torch.empty(int(size), dtype=torch.uint8)
        self.pg.broadcast(data, 0).wait()
        return loads_signed(data.numpy().tobytes(), self.token)
