"""How the ranks of one engine meet, and how node 0 knows which of them are there: every value in
the rendezvous store signed for this run.

On one host the store is a file in a directory only this user can open. Over several hosts it is
node 0's TCPStore at master_addr:master_port, which anything that reaches that port can read and
write. So every value in it is signed with the token and stamped (`parallel.Stamp`): what a
process without the token writes is refused unread, and a signed value recorded from this run or
an earlier one and written again is refused for its stamp. The keys:

    tinyvllm/node{k}/hello    host k (k >= 1) -> node 0: its address, stamped with a random nonce
                              in place of the run (host k knows no run yet), written again each
                              second until it is answered
    tinyvllm/node{k}/engine   node 0 -> host k: host k's nonce, then the engine arguments and the
                              model's fingerprint, stamped with the run: host k takes only the
                              answer to its own hello, so no recorded answer starts it
    tinyvllm/rank{r}/ready    rank r -> node 0: its address once it has built its shard, or the
                              error it stopped with
    tinyvllm/node{k}/alive    host k -> node 0: a heartbeat every HEARTBEAT_S (counter 1, 2, ...),
                              with the ranks of host k that have exited

Node 0 reads each, logs a value it refuses (naming the host that signed it, where the signature
holds), and goes on waiting: a refused value changes nothing. Every wait is bounded: a host's
hello within the rendezvous timeout, each rank's "ready" within the load timeout, and a host
whose heartbeat stops for HOST_GONE_AFTER_S is named as gone.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import time

from .parallel import (LOAD_TIMEOUT_ENV, RENDEZVOUS_TIMEOUT_ENV, RefusedValue, Stamp, check_stamp, load_timeout,
                       open_bytes, open_signed, rendezvous_timeout, sign_bytes)

HEARTBEAT_S = 1.0          # how often a host says it is alive
HOST_GONE_AFTER_S = 3.0    # a host whose heartbeat has not moved for this long is gone
POLL_S = 0.05

log = logging.getLogger("tinyvllm.tensor_parallel")


def ready_key(rank: int) -> str:
    return f"tinyvllm/rank{rank}/ready"


def hello_key(node: int) -> str:
    return f"tinyvllm/node{node}/hello"


def engine_key(node: int) -> str:
    return f"tinyvllm/node{node}/engine"


def alive_key(node: int) -> str:
    return f"tinyvllm/node{node}/alive"


def _read(store, key: str) -> bytes | None:
    """The value at `key`, or None while there is none (a TCPStore's get would wait for it)."""
    return store.get(key) if store.check([key]) else None


def write_ready(store, token: bytes, run_id: bytes, rank: int, address: str | None = None,
                error: str | None = None) -> None:
    """Rank `rank`'s report, signed: ready (listening on `address`), or the error it stopped with."""
    report = {"address": address} if error is None else {"error": error}
    store.set(ready_key(rank), sign_bytes(pickle.dumps(report), token, Stamp(ready_key(rank), run_id, rank)))


class Rendezvous:
    """Node 0's side of the rendezvous: it answers each host's hello with the engine, waits until
    every rank is ready, and tells which ranks or hosts are gone.

    Args:
        store: the rendezvous store (node 0 serves it).
        token, run_id: what every value is signed with, and this engine's run.
        world, nnodes: the ranks, over this many hosts (as many on each; host 0 is this one).
        engine: what host k builds from, (engine arguments, model fingerprint); None on one host.
        late_hint: how to start a host that has not joined (appended to the error).
    """

    def __init__(self, store, token: bytes, run_id: bytes, world: int, nnodes: int, engine: tuple | None = None,
                 late_hint: str = ""):
        self.store, self.token, self.run_id = store, token, run_id
        self.world, self.nnodes, self.per_host = world, nnodes, world // nnodes
        self.engine, self.late_hint = engine, late_hint
        self.local: dict[int, subprocess.Popen] = {}   # this host's worker ranks
        self.addresses: dict[int, str] = {}            # host -> its address (from its hello)
        self.answered: dict[int, bytes] = {}           # host -> the hello answered last
        self.beats: dict[int, tuple[int, float]] = {}  # host -> (its last heartbeat's counter, when seen)
        self.exited: dict[int, int] = {}               # rank of another host -> its exit code
        self.refused: set[bytes] = set()               # values refused (logged once each)

    # -- who is where --------------------------------------------------------------------------
    def host_of(self, rank: int) -> int:
        return rank // self.per_host

    def describe_host(self, host: int) -> str:
        first = host * self.per_host
        ranks = f"rank {first}" if self.per_host == 1 else f"ranks {first}-{first + self.per_host - 1}"
        where = f"{self.addresses[host]}, " if host in self.addresses else ""
        return f"host {host} ({where}{ranks})"

    def _refuse(self, value: bytes, e: RefusedValue) -> None:
        """Log a refused value once: which host signed it, where its signature says."""
        if value in self.refused:
            return
        self.refused.add(value)
        who = (f"signed by {self.describe_host(self.host_of(e.sender))}" if e.sender is not None
               and e.sender < self.world else "from a process without this engine's token")
        log.warning("tensor parallel: refused a value %s: %s", who, str(e))   # not e: its frames hold the store

    # -- one look at the store -----------------------------------------------------------------
    def answer_hellos(self) -> None:
        """Answer each host whose hello is new: the engine, for its nonce and this run."""
        for host in range(1, self.nnodes if self.engine is not None else 1):
            key, value = hello_key(host), _read(self.store, hello_key(host))
            if value is None or value == self.answered.get(host):
                continue
            try:
                stamp, data = open_bytes(value, self.token, key)
                check_stamp(stamp, Stamp(key, stamp.run_id, host * self.per_host))   # any nonce, its first rank
            except RefusedValue as e:
                self._refuse(value, e)
                continue
            self.addresses[host] = pickle.loads(data)["address"]
            self.answered[host] = value
            answer = stamp.run_id + pickle.dumps(self.engine)
            self.store.set(engine_key(host), sign_bytes(answer, self.token, Stamp(engine_key(host), self.run_id, 0)))

    def read_beats(self) -> None:
        """Each host's heartbeat: a newer counter than the last one seen, and the ranks it says exited."""
        for host in range(1, self.nnodes):
            key, value = alive_key(host), _read(self.store, alive_key(host))
            if value is None:
                continue
            try:
                stamp, data = open_bytes(value, self.token, key)
                last = self.beats.get(host, (0, 0.0))[0]
                if stamp.counter <= last:
                    if stamp.counter < last:   # the same one again is only a host that has not beaten yet
                        raise RefusedValue(f"{key}: heartbeat {stamp.counter} after {last}: refused unread",
                                           sender=stamp.rank)
                    continue
                check_stamp(stamp, Stamp(key, self.run_id, host * self.per_host, stamp.counter))
            except RefusedValue as e:
                self._refuse(value, e)
                continue
            self.beats[host] = (stamp.counter, time.monotonic())
            self.exited.update(pickle.loads(data)["exited"])

    def read_ready(self, rank: int) -> bool:
        """Has rank `rank` said it is ready? Raises with its error if it failed."""
        key, value = ready_key(rank), _read(self.store, ready_key(rank))
        if value is None:
            return False
        try:
            report = pickle.loads(open_signed(value, self.token, Stamp(key, self.run_id, rank)))
        except RefusedValue as e:
            self._refuse(value, e)
            return False
        if "error" in report:
            raise RuntimeError(f"tensor-parallel rank {rank} ({self.describe_host(self.host_of(rank))}) failed "
                               f"to start:\n{report['error']}")
        return True

    # -- the waits -----------------------------------------------------------------------------
    def wait_ready(self) -> None:
        """Wait until every other rank is ready. Bounded: a host's hello within the rendezvous
        timeout, a rank's "ready" within the load timeout of its start (this host's) or of its
        host's hello; a host whose heartbeat stops, or a rank that exits, fails it at once."""
        start, hello_bound, load_bound = time.monotonic(), rendezvous_timeout().total_seconds(), load_timeout()
        hello_at: dict[int, float] = {0: start}
        waiting = set(range(1, self.world))
        while waiting:
            self.answer_hellos()
            self.read_beats()
            now = time.monotonic()
            for host in self.answered:
                hello_at.setdefault(host, now)
            waiting -= {r for r in sorted(waiting) if self.read_ready(r)}
            for rank, proc in self.local.items():
                if rank in waiting and proc.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited while starting (exit code {proc.returncode})")
            gone = self.silent_hosts(now)
            if gone:
                raise RuntimeError(f"tensor parallel: {self.describe_gone(gone)} while the ranks were starting")
            late_hosts = sorted({self.host_of(r) for r in waiting if self.host_of(r) not in hello_at
                                 and now - start > hello_bound})
            if late_hosts:
                raise TimeoutError(f"tensor parallel: {', '.join(self.describe_host(h) for h in late_hosts)} did "
                                   f"not join within {hello_bound:g} s ({RENDEZVOUS_TIMEOUT_ENV})"
                                   f"{self.late_hint}")
            slow = sorted(r for r in waiting if self.host_of(r) in hello_at
                          and now - hello_at[self.host_of(r)] > load_bound)
            if slow:
                raise TimeoutError(f"tensor-parallel rank(s) {', '.join(map(str, slow))} "
                                   f"({', '.join(sorted({self.describe_host(self.host_of(r)) for r in slow}))}) did "
                                   f"not build their shard within {load_bound:g} s ({LOAD_TIMEOUT_ENV})")
            time.sleep(POLL_S)

    def silent_hosts(self, now: float) -> list[int]:
        """The hosts whose heartbeat has not moved for HOST_GONE_AFTER_S, or that report a rank exited."""
        exited = {self.host_of(r) for r in self.exited}
        return sorted(h for h, (_, seen) in self.beats.items() if now - seen > HOST_GONE_AFTER_S or h in exited)

    def describe_gone(self, hosts: list[int]) -> str:
        """Each host of `hosts` named, with why it counts as gone."""
        parts = []
        for host in hosts:
            codes = sorted((r, c) for r, c in self.exited.items() if self.host_of(r) == host)
            why = (", ".join(f"rank {r} exited with code {c}" for r, c in codes) if codes
                   else f"its heartbeat stopped (none for {HOST_GONE_AFTER_S:g} s)")
            parts.append(f"{self.describe_host(host)} is gone: {why}")
        return "; ".join(parts)

    def exited_here(self) -> str:
        """This host's workers that have exited, in words ('' while every one runs): a poll each."""
        return "; ".join(f"rank {r} of this host exited with code {p.returncode}" for r, p in self.local.items()
                         if p.poll() is not None)

    def who_is_gone(self) -> str:
        """Which ranks and hosts are gone, once a collective has failed: this host's workers that
        have exited, and the other hosts whose heartbeat does not move within HOST_GONE_AFTER_S
        (or that say a rank of theirs exited)."""
        parts = [gone] if (gone := self.exited_here()) else []
        self.read_beats()
        last = {h: self.beats.get(h, (0, 0.0))[0] for h in range(1, self.nnodes)}

        def silent() -> list[int]:
            exited = {self.host_of(r) for r in self.exited}
            return sorted(h for h in last if self.beats.get(h, (0, 0.0))[0] == last[h] or h in exited)

        deadline = time.monotonic() + HOST_GONE_AFTER_S
        while time.monotonic() < deadline and set(silent()) - {self.host_of(r) for r in self.exited}:
            time.sleep(0.1)
            self.read_beats()
        if silent():
            parts.append(self.describe_gone(silent()))
        return "; ".join(parts) or "every rank of this host runs and every other host still beats: a network fault?"


# -- host k's side ---------------------------------------------------------------------------------
def join(store, token: bytes, node: int, first_rank: int, address: str, nonce: bytes) -> tuple[bytes, object]:
    """Host `node`'s hello, until node 0 answers it: (the run id, the engine node 0 sent). Values
    that are not node 0's answer to this hello (forged, or recorded) are logged and passed over;
    bounded by the rendezvous timeout."""
    bound = rendezvous_timeout().total_seconds()
    hello = sign_bytes(pickle.dumps({"address": address}), token, Stamp(hello_key(node), nonce, first_rank))
    key, refused = engine_key(node), set()
    deadline, said = time.monotonic() + bound, 0.0
    while time.monotonic() < deadline:
        if time.monotonic() - said > HEARTBEAT_S:   # again each second: a hello written over is said again
            store.set(hello_key(node), hello)
            said = time.monotonic()
        value = _read(store, key)
        if value is not None:
            try:
                stamp, data = open_bytes(value, token, key)
                check_stamp(stamp, Stamp(key, stamp.run_id, 0))
                if data[:len(nonce)] != nonce:
                    raise RefusedValue(f"{key}: node 0's answer to another hello (recorded before, or "
                                       f"written over this host's): refused unread", sender=0)
            except RefusedValue as e:
                if value not in refused:
                    refused.add(value)
                    log.warning("tensor parallel: refused a value: %s", str(e))
            else:
                return stamp.run_id, pickle.loads(data[len(nonce):])
        time.sleep(POLL_S)
    raise TimeoutError(f"tensor parallel: node 0 did not answer this host's hello within {bound:g} s "
                       f"({RENDEZVOUS_TIMEOUT_ENV})")


def beat_until_done(store, token: bytes, run_id: bytes, node: int, first_rank: int,
                    procs: dict[int, subprocess.Popen], stop) -> int:
    """Host `node`'s heartbeat while its ranks run, with the ones that have exited; the ranks' exit
    code once all have. If node 0's store is gone (its host died, or was cut off), the ranks are
    stopped (`stop(procs)`) and 1 returned."""
    counter = 0
    while True:
        exited = {r: p.poll() for r, p in procs.items() if p.poll() is not None}
        if len(exited) == len(procs):
            return max(exited.values())
        counter += 1
        stamp = Stamp(alive_key(node), run_id, first_rank, counter)
        try:
            store.set(alive_key(node), sign_bytes(pickle.dumps({"exited": exited}), token, stamp))
        except (RuntimeError, OSError) as e:   # the store's connection: node 0 is gone
            log.warning("tensor parallel: node 0's store is gone (%s): stopping this host's ranks", e)
            stop(list(procs.values()))
            return 1
        time.sleep(HEARTBEAT_S)
