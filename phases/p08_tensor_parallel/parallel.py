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

A signature alone would let a value recorded once be sent again: a "stop" read off the network
today stops tomorrow's engine, if the token is the same. So every signed value carries a `Stamp`
inside its signature: the slot it was written for (a store key, or the step), the run (a random
id node 0 draws for each engine), the rank that sent it, and a counter (the driver's n-th step
is its n-th message). A receiver that expects another stamp refuses the value before it reads
it, as it refuses one whose signature fails.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import os
import pickle
import socket
import struct
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from tinyvllm.secret_env import take_secret

# Joining is bounded (`rendezvous_timeout`); after the first collective a collective may wait much
# longer, as a worker waits for the driver's next step for as long as the engine is idle (a rank
# that dies closes its sockets, which fails the others' collectives at once).
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)
LOOPBACK = "127.0.0.1"            # where the ranks of one host listen
LOOPBACK_INTERFACE = "lo"         # NCCL's sockets on one host (NCCL_SOCKET_IFNAME)
TOKEN_ENV = "TINYVLLM_TP_TOKEN"   # how a worker gets its token: its environment, not its command line
HOST_IP_ENV = "TINYVLLM_HOST_IP"  # this host's address for the other hosts (vLLM's VLLM_HOST_IP)
RENDEZVOUS_TIMEOUT_ENV = "TINYVLLM_RENDEZVOUS_TIMEOUT_S"
LOAD_TIMEOUT_ENV = "TINYVLLM_LOAD_TIMEOUT_S"
SIGNATURE_BYTES = 32              # HMAC-SHA256
RUN_ID_BYTES = 16
STAMP = struct.Struct("<16sIQ")   # a value's run id, its sender's rank, its counter
LENGTH = struct.Struct("<Q")      # a step's length, sent (signed) before its bytes


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
    """How long ranks wait for each other to join, each wait of it: a host for node 0's store and
    its engine, node 0 for each host's hello, gloo's connect between every two ranks, and the
    first collective. TINYVLLM_RENDEZVOUS_TIMEOUT_S, or 120 s."""
    return datetime.timedelta(seconds=_seconds(RENDEZVOUS_TIMEOUT_ENV, 120))


def load_timeout() -> float:
    """How long a rank has to build its shard (load its share of the checkpoint) once it starts:
    TINYVLLM_LOAD_TIMEOUT_S, or 600 s."""
    return _seconds(LOAD_TIMEOUT_ENV, 600)


def _seconds(name: str, default: float) -> float:
    value = os.environ.get(name) or str(default)
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < 1e9:    # NaN too
        raise ValueError(f"{name} must be a number of seconds above 0, got {value!r}")
    return seconds


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


def shared_token(name: str = TOKEN_ENV, needed_by: str = "nnodes > 1", signers: str = "ranks") -> bytes:
    """The token of an engine over several hosts: no host can hand it to another, so the user
    sets the same secret in variable `name` (TINYVLLM_TP_TOKEN) on every host (hex, at least 16
    bytes). It is taken out of this process's environment (`take_secret`): only the workers get
    it, on purpose. (Phase 10's KV producer and consumer take theirs the same way.)"""
    value = take_secret(name) or ""
    try:
        token = bytes.fromhex(value)
    except ValueError:
        token = b""
    if len(token) < 16:
        raise ValueError(f"{needed_by}: set {name} to the same secret on every host, at least 16 "
                         f"bytes in hex (python -c 'import secrets; print(secrets.token_hex(32))'); the "
                         f"{signers} sign and check every message with it")
    return token


def nccl_env(host: str) -> dict[str, str]:
    """NCCL's environment for ranks that listen on `host`: on loopback (one host), its sockets on
    the loopback interface too. NCCL otherwise picks the first other interface, and its bootstrap
    listens there, reachable from the network, though every rank is on this machine."""
    return {"NCCL_SOCKET_IFNAME": LOOPBACK_INTERFACE} if host == LOOPBACK else {}


@dataclass(frozen=True)
class Stamp:
    """What a signed value says about itself, inside its signature: the slot it was written for
    (`key`: a store key, or "step"), the run it belongs to (`run_id`: node 0's random id for one
    engine), the rank that sent it, and its place among that rank's values for the slot
    (`counter`: 0 for a slot written once)."""

    key: str
    run_id: bytes
    rank: int
    counter: int = 0


class RefusedValue(ValueError):
    """A value refused before it was read. `sender` is the rank that signed it, where the signature
    holds and only its stamp is wrong (a replay, a host of another run); None where it does not
    (a process without the token made it)."""

    def __init__(self, message: str, sender: int | None = None):
        super().__init__(message)
        self.sender = sender


def _signature(token: bytes, *parts) -> bytes:
    """HMAC-SHA256 under `token` of the parts one after another, each hashed in place (not copied)."""
    if len(token) < 16:
        raise ValueError(f"token must be at least 16 random bytes, got {len(token)}")
    mac = hmac.new(token, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


def sign_parts(parts: list, token: bytes, stamp: Stamp) -> list:
    """`sign_bytes` in pieces to send one after another (large data not copied): [signature, stamp, *parts]."""
    header = STAMP.pack(stamp.run_id, stamp.rank, stamp.counter)
    return [_signature(token, stamp.key.encode() + b"\0", header, *parts), header, *parts]


def sign_bytes(data: bytes, token: bytes, stamp: Stamp) -> bytes:
    """`data` behind its stamp and their HMAC-SHA256 under `token` (which covers the key too):
    bytes only a holder of the token can make, for one slot, run, sender and counter."""
    return b"".join(sign_parts([data], token, stamp))


def open_bytes(value: bytes, token: bytes, key: str) -> tuple[Stamp, bytes]:
    """The stamp and the data `sign_bytes` made for the slot `key`, once the signature checks out
    (RefusedValue otherwise): the data, unread (a view into `value` where that is a memoryview)."""
    if len(value) < SIGNATURE_BYTES + STAMP.size:
        raise RefusedValue(f"{key}: {len(value)} bytes, too short to be signed with this engine's token: "
                           f"refused unread")
    signature, header, data = (value[:SIGNATURE_BYTES], value[SIGNATURE_BYTES:SIGNATURE_BYTES + STAMP.size],
                               value[SIGNATURE_BYTES + STAMP.size:])
    if not hmac.compare_digest(bytes(signature), _signature(token, key.encode() + b"\0", header, data)):
        raise RefusedValue(f"{key}: not signed with this engine's token: refused unread")
    run_id, rank, counter = STAMP.unpack(header)
    return Stamp(key, bytes(run_id), rank, counter), data


def check_stamp(stamp: Stamp, expected: Stamp) -> None:
    """RefusedValue, naming its sender, if a signed value's stamp is not the one expected."""
    if stamp.run_id != expected.run_id:
        why = "belongs to another run (a value recorded before, sent again, or a host of an earlier engine)"
    elif stamp.rank != expected.rank:
        why = f"was sent by rank {stamp.rank} where rank {expected.rank}'s is expected"
    elif stamp.counter != expected.counter:
        why = f"is number {stamp.counter} where number {expected.counter} is expected (a value sent again)"
    else:
        return
    raise RefusedValue(f"{stamp.key}: a value signed by rank {stamp.rank} {why}: refused unread", sender=stamp.rank)


def open_signed(value: bytes, token: bytes, expected: Stamp) -> bytes:
    """The data of a signed value whose signature and whole stamp are `expected`'s, unread."""
    stamp, data = open_bytes(value, token, expected.key)
    check_stamp(stamp, expected)
    return data


def dumps_signed(obj, token: bytes, stamp: Stamp) -> bytes:
    """`obj` pickled and signed with its stamp (`sign_bytes`)."""
    return sign_bytes(pickle.dumps(obj), token, stamp)


def loads_signed(value: bytes, token: bytes, expected: Stamp):
    """The object `dumps_signed` made, unpickled only once its signature and its stamp check out:
    unpickling runs code the bytes name, so bytes from anyone else, or from another run, slot,
    sender or counter, raise a RefusedValue (a ValueError), unread."""
    return pickle.loads(open_signed(value, token, expected))


@dataclass
class TensorParallelGroup:
    """This process's place in the group: `rank` of `world`, the process group (None until
    `connect`, and for a group of one), the token its messages are signed with and the run they
    belong to."""

    rank: int = 0
    world: int = 1
    pg: object = None           # the control plane: gloo, CPU tensors
    data_pg: object = None      # the data plane: the all-reduces (pg on a CPU, NCCL on CUDA)
    token: bytes = field(default=b"", repr=False)
    run_id: bytes = b""
    num_steps: int = 0          # the driver's messages sent (on a worker: received): the next one's counter
    # True while every rank runs the same call at once (phase 7's decode step, each rank on its
    # own static buffers): the model then sends the workers nothing of its own
    lockstep: bool = False
    # on the driver: says which ranks or hosts are gone, when a collective fails (the executor's)
    who_is_gone: Callable[[], str] | None = field(default=None, repr=False)
    # on the driver: this host's workers that have exited, in words ('' while all run): asked
    # before each broadcast, whose sends gloo may leave waiting on a rank that is gone
    exited_here: Callable[[], str] | None = field(default=None, repr=False)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def connect(self, store: dist.Store, token: bytes, run_id: bytes, host: str = LOOPBACK,
                device: torch.device = torch.device("cpu")) -> None:
        """Join the group, its gloo sockets bound to `host`, its messages signed with `token` for
        the run `run_id`, its all-reduces on `device`'s backend (`backend_for`); returns once every
        rank has, and has met the others in a first collective. Both waits are bounded by the
        rendezvous timeout (TimeoutError after it)."""
        self.token, self.run_id, self.num_steps = token, run_id, 0
        bound = rendezvous_timeout()
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        # gloo's connect waits this long for every other rank's address in the store (a step's
        # send and receive keep it too: gloo fixes theirs here; the collectives are given theirs)
        options._timeout = bound
        try:
            self.pg = self.data_pg = dist.ProcessGroupGloo(store, self.rank, self.world, options)
        except RuntimeError as e:   # gloo's store wait: DistStoreError
            raise TimeoutError(f"tensor parallel: rank {self.rank} could not connect to every other rank "
                               f"within {bound.total_seconds():g} s ({RENDEZVOUS_TIMEOUT_ENV}; "
                               f"{self._gone(e)})") from None
        if backend_for(device) == "nccl":
            device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
            for name, value in nccl_env(host).items():   # read when NCCL first connects, below
                os.environ.setdefault(name, value)
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = COLLECTIVE_TIMEOUT
            self.data_pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), self.rank, self.world, nccl)
        self._first_collective(bound, device)

    def _first_collective(self, bound: datetime.timedelta, device: torch.device) -> None:
        """Every rank adds 1, within the rendezvous timeout: each is in the group and running (and
        NCCL, which connects at its first collective, has connected)."""
        groups = [(self.pg, torch.device("cpu"))]
        if self.data_pg is not self.pg:
            groups.append((self.data_pg, device))
        for pg, on in groups:
            ones = torch.ones(1, device=on)
            options = dist.AllreduceOptions()
            options.timeout = bound
            try:
                pg.allreduce([ones], options).wait(bound)   # NCCL: the CPU waits too, bounded
            except RuntimeError as e:
                raise TimeoutError(f"tensor parallel: rank {self.rank}: the first collective did not complete "
                                   f"within {bound.total_seconds():g} s ({RENDEZVOUS_TIMEOUT_ENV}; "
                                   f"{self._gone(e)})") from None
            if int(ones.item()) != self.world:
                raise RuntimeError(f"tensor parallel: the first collective counted {int(ones.item())} ranks, "
                                   f"not {self.world}")

    @contextlib.contextmanager
    def in_lockstep(self):
        """Every rank runs this same block now: the model sends the workers nothing of its own."""
        self.lockstep = True
        try:
            yield
        finally:
            self.lockstep = False

    def _gone(self, e: Exception) -> str:
        """What the driver knows of the ranks that are gone, else gloo's message."""
        return self.who_is_gone() if self.who_is_gone is not None else str(e)

    def _wait(self, work, what: str) -> None:
        """Wait for a collective; a rank that is gone (its process or its host) fails it with an
        error that says so, and on the driver which (`who_is_gone`), instead of gloo's socket
        message alone."""
        try:
            work.wait()
        except RuntimeError as e:
            raise RuntimeError(f"tensor parallel: {what} failed on rank {self.rank}: another rank of "
                               f"this engine is gone ({self._gone(e)}). The engine cannot run another "
                               f"step; start every host again") from None

    @staticmethod
    def _long(options):
        """`options` with the long timeout: past the first collective, a collective waits as long
        as the engine idles."""
        options.timeout = COLLECTIVE_TIMEOUT
        return options

    # -- the collectives --------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x, on every rank (in place)."""
        if self.world > 1:
            self._wait(self.data_pg.allreduce([x], self._long(dist.AllreduceOptions())), "an all-reduce")
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

    def _broadcast(self, data: torch.Tensor, what: str) -> None:
        if self.is_driver and self.exited_here is not None and (gone := self.exited_here()):
            # a root's send to a rank that died between two steps may wait for it forever (gloo
            # fails a receive whose peer closed, not always a send): refused here, named
            raise RuntimeError(f"tensor parallel: {what} failed on rank 0: another rank of this engine is "
                               f"gone ({gone}). The engine cannot run another step; start every host again")
        options = self._long(dist.BroadcastOptions())
        options.rootRank = 0
        self._wait(self.pg.broadcast([data], options), what)

    def broadcast_object(self, obj=None):
        """The driver's `obj`, on every rank: its length first, signed (a fixed number of bytes),
        then its bytes, pickled and signed, both stamped with the run and the step's number. A
        worker checks the length's signature before it makes room for the bytes, and the bytes'
        before it unpickles them (`loads_signed`): a message from anyone else, or from another
        run, or one sent twice, is refused unread."""
        step, self.num_steps = self.num_steps, self.num_steps + 1
        stamp = Stamp("step", self.run_id, 0, step)
        length = Stamp("step/length", self.run_id, 0, step)
        if self.is_driver:
            body = dumps_signed(obj, self.token, stamp)
            prefix = sign_bytes(LENGTH.pack(len(body)), self.token, length)
            self._broadcast(torch.frombuffer(bytearray(prefix), dtype=torch.uint8), "sending the step")
            self._broadcast(torch.frombuffer(bytearray(body), dtype=torch.uint8), "sending the step")
            return obj
        prefix = torch.zeros(SIGNATURE_BYTES + STAMP.size + LENGTH.size, dtype=torch.uint8)
        self._broadcast(prefix, "receiving the step")
        (size,) = LENGTH.unpack(open_signed(prefix.numpy().tobytes(), self.token, length))
        body = torch.empty(size, dtype=torch.uint8)
        self._broadcast(body, "receiving the step")
        return loads_signed(body.numpy().tobytes(), self.token, stamp)
