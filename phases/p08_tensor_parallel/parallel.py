"""The tensor-parallel group: ranks, their collectives, and how the driver talks to its workers.

Rank 0 is the driver: the engine, its scheduler and sampler live there. Ranks 1 .. N-1 are
workers, each a process started by the driver (`start_workers`), each holding its share of every
weight and of the KV cache. They meet over `torch.distributed`: a `TCPStore` on loopback for the
rendezvous, then a gloo process group (CPU tensors; the engine refuses more than one rank on a
GPU, where NCCL would carry them). The group is an object of its own
(not the process-wide default group), so a process can hold several engines one after another.

Three collectives are all a tensor-parallel forward needs:

- `all_reduce(x)`: every rank holds a partial sum of the same (N, D) tensor; afterwards every rank
  holds the total. Once after each row-parallel product (o_proj, down_proj) and the embedding.
- `gather_columns(x)`: every rank holds some columns of the logits; the driver gets them all.
- `broadcast_object(obj)`: the driver tells the workers what to run (a step's inputs).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

# The rendezvous must finish within this; a collective may wait much longer, as a worker waits
# for the driver's next step for as long as the engine is idle (a rank that dies closes its
# sockets, which fails the others' collectives at once).
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)


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


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port(port: int) -> None:
    """A clear error when `port` cannot be listened on by the driver's store."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise ValueError(f"MASTER_PORT={port} cannot be used for the tensor-parallel rendezvous "
                             f"({e.strerror}); unset it, or choose a free port") from None


@dataclass
class TensorParallelGroup:
    """This process's place in the group: `rank` of `world`, and the process group (None until
    `connect`, and for a group of one)."""

    rank: int = 0
    world: int = 1
    pg: object = None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def store(self, port: int) -> dist.TCPStore:
        """The rendezvous: a key-value store on loopback that rank 0 hosts on `port`."""
        return dist.TCPStore("127.0.0.1", port, self.world, self.rank == 0, timeout=rendezvous_timeout(),
                             wait_for_workers=False)

    def connect(self, store: dist.TCPStore) -> None:
        """Join the group; returns once every rank has."""
        self.pg = dist.ProcessGroupGloo(store, self.rank, self.world, COLLECTIVE_TIMEOUT)

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
        """The driver's `obj`, on every rank: pickled, its length sent first, then its bytes."""
        if self.is_driver:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
            self.pg.broadcast(size, 0).wait()
            self.pg.broadcast(data, 0).wait()
            return obj
        size = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast(size, 0).wait()
        data = torch.empty(int(size), dtype=torch.uint8)
        self.pg.broadcast(data, 0).wait()
        return pickle.loads(data.numpy().tobytes())


def rendezvous_port() -> int:
    """The port of the rendezvous: MASTER_PORT when set (as torchrun sets it), else a free one."""
    if os.environ.get("MASTER_PORT"):
        try:
            port = int(os.environ["MASTER_PORT"])
        except ValueError:
            raise ValueError(f"MASTER_PORT must be a port number, got {os.environ['MASTER_PORT']!r}") from None
        check_port(port)
        return port
    return free_port()
