"""Phase 8's security model: the ranks listen on loopback only, their token never reaches a command
line, and a worker unpickles nothing that is not signed with its engine's token and stamped with
its run, its sender and its place in the run; nor makes room for a message before its length is
known to be the driver's."""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import os
import pickle
import socket
import stat
import struct
from pathlib import Path

import pytest
import torch

from phases.p08_tensor_parallel.parallel import (RefusedValue, Stamp, TensorParallelGroup, dumps_signed,
                                                 loads_signed)
from phases.p08_tensor_parallel.worker import worker_env
from tinyvllm import LLM, SamplingParams

TOKEN = bytes(range(32))
RUN = bytes(16)


class CreatesAFile:
    """A pickle that creates `path` when it is unpickled: what a hostile peer would send."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_wrong_signature_is_refused_unread(tmp_path):
    """Another token, a flipped byte, a message too short to hold a signature: refused before
    `pickle.loads`, so the pickle's side effect never happens."""
    target = tmp_path / "pwned"
    stamp = Stamp("step", RUN, 0, 7)
    signed = dumps_signed(CreatesAFile(str(target)), TOKEN, stamp)

    def flip(data: bytes, i: int) -> bytes:
        return data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]

    bad = [dumps_signed(CreatesAFile(str(target)), bytes(32), stamp),   # another engine's token
           pickle.dumps(CreatesAFile(str(target))),                      # not signed at all
           flip(signed, 0), flip(signed, len(signed) - 2),               # its signature, its pickle changed
           flip(signed, 40),                                             # its stamp changed
           b"short"]
    for data in bad:
        with pytest.raises(RefusedValue, match="token") as e:
            loads_signed(data, TOKEN, stamp)
        assert e.value.sender is None
        assert not target.exists()
    assert loads_signed(dumps_signed(("forward", [1, 2]), TOKEN, stamp), TOKEN, stamp) == ("forward", [1, 2])
    loads_signed(signed, TOKEN, stamp)                                 # the right token and stamp: unpickled
    assert target.exists()
    with pytest.raises(ValueError, match="token"):
        dumps_signed("x", b"", stamp)                                  # no token, no message


def test_a_recorded_value_is_refused_unread(tmp_path):
    """A value signed with the token but recorded elsewhere: from another run, for another slot,
    from another sender, or at another place in the run (sent twice). Refused before `pickle.loads`,
    naming the rank that signed it."""
    target = tmp_path / "pwned"
    expected = Stamp("tinyvllm/rank2/ready", RUN, 2, 0)
    recorded = [(Stamp(expected.key, bytes([1]) * 16, 2, 0), "another run"),
                (Stamp("tinyvllm/rank3/ready", RUN, 2, 0), "token"),      # the key is inside the signature
                (Stamp(expected.key, RUN, 3, 0), "sent by rank 3 where rank 2's is expected"),
                (Stamp(expected.key, RUN, 2, 5), "number 5 where number 0 is expected")]
    for stamp, match in recorded:
        with pytest.raises(RefusedValue, match=match) as e:
            loads_signed(dumps_signed(CreatesAFile(str(target)), TOKEN, stamp), TOKEN, expected)
        assert e.value.sender == (None if match == "token" else stamp.rank)
    assert not target.exists()


class ForgedControlPlane:
    """A control plane whose every broadcast delivers the next bytes of `stream`: what a process
    between the ranks could send. It counts the bytes a worker made room for."""

    def __init__(self, stream: bytes):
        self.stream, self.received = stream, []

    def broadcast(self, tensors, *args):
        t = tensors[0] if isinstance(tensors, list) else tensors
        self.received.append(t.numel() * t.element_size())
        raw = t.view(torch.uint8).view(-1)
        chunk, self.stream = self.stream[:raw.numel()], self.stream[raw.numel():]
        raw[:len(chunk)] = torch.frombuffer(bytearray(chunk), dtype=torch.uint8) if chunk else raw[:0]
        return self

    def wait(self, *args):
        return True


def test_a_forged_length_is_refused_before_room_is_made():
    """The length of a step comes first: a worker checks its signature before it makes room for
    the step's bytes, so a forged length of a terabyte allocates nothing."""
    forged = struct.pack("<q", 1 << 40) + bytes(64)
    pg = ForgedControlPlane(forged)
    group = TensorParallelGroup(rank=1, world=2, pg=pg, data_pg=pg, token=TOKEN, run_id=RUN)
    with pytest.raises(RefusedValue, match="not signed with this engine's token"):
        group.broadcast_object()
    assert len(pg.received) == 1 and pg.received[0] < 100       # only the signed length's room


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp{,6}: 32-bit words in the host's (little-endian) byte order."""
    raw = b"".join(bytes.fromhex(hex_addr[i:i + 8])[::-1] for i in range(0, len(hex_addr), 8))
    return ipaddress.ip_address(raw)


def listening_addresses(pid: int) -> list[str]:
    """Every address:port a TCP socket of process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:       # 0A: LISTEN
                host, port = local.split(":")
                found.append(f"{_address(host)}:{int(port, 16)}")
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, kv_cache_memory=1 << 22)
    yield llm
    llm.llm_engine.shutdown()


def test_no_rank_listens_beyond_loopback(two_ranks):
    """No socket of the driver or of a worker accepts connections from another machine."""
    gc.collect()   # an earlier test's exception, kept in a cycle with its frames, may hold its engine's store
    pids = [os.getpid()] + [p.pid for p in two_ranks.llm_engine.runner.workers]
    for pid in pids:
        outside = [a for a in listening_addresses(pid) if not is_loopback(a)]
        assert not outside, f"process {pid} listens on {outside}"
    with socket.socket() as s:      # the scan sees a listener on every interface
        s.bind(("0.0.0.0", 0))
        s.listen()
        assert f"0.0.0.0:{s.getsockname()[1]}" in listening_addresses(os.getpid())


def test_the_token_stays_off_command_lines(two_ranks):
    """The driver hands each worker the token in its environment: `ps` does not show it, and the
    driver's own environment does not hold it."""
    runner = two_ranks.llm_engine.runner
    token = runner.group.token
    assert len(token) == 32
    for p in runner.workers:
        cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes()
        assert token not in cmdline and token.hex().encode() not in cmdline.lower()
    assert not any(token.hex() in v.lower() for v in os.environ.values())


def test_a_worker_gets_the_token_and_no_other_secret(tiny_model_dir, monkeypatch):
    """A worker's environment holds its engine's token and nothing else secret: not the server's
    key, not another token this process was given (`worker_env`, and a live worker's own
    /proc/PID/environ); on one host, NCCL's sockets are pinned to loopback (a user's own
    NCCL_SOCKET_IFNAME stays)."""
    monkeypatch.setenv("TINYVLLM_API_KEY", "sk-do-not-leak")
    monkeypatch.setenv("TINYVLLM_TP_TOKEN", "cd" * 32)
    env = worker_env(TOKEN)
    assert env["TINYVLLM_TP_TOKEN"] == TOKEN.hex() and "TINYVLLM_API_KEY" not in env
    assert env["NCCL_SOCKET_IFNAME"] == "lo"
    assert "NCCL_SOCKET_IFNAME" not in worker_env(TOKEN, "10.0.0.2")         # another host's ranks
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert worker_env(TOKEN)["NCCL_SOCKET_IFNAME"] == "ib0"
    llm = LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, kv_cache_memory=1 << 22)
    try:
        (worker,) = llm.llm_engine.runner.workers
        environ = Path(f"/proc/{worker.pid}/environ").read_bytes()
        assert b"sk-do-not-leak" not in environ and b"TINYVLLM_API_KEY" not in environ
        assert b"cd" * 32 not in environ                        # its own engine's token only
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("forgery", ["another token", "another run", "a step sent again"])
def test_a_worker_stops_on_a_forged_message(tiny_model_dir, capfd, forgery):
    """A "stop" signed with another token, or recorded from another run, or sent again at another
    step's place, makes the worker stop without running it (a signed "stop" exits with 0); the
    rendezvous directory is this user's alone, and goes with the engine."""
    llm = LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, kv_cache_memory=1 << 22)
    runner = llm.llm_engine.runner
    worker, group = runner.workers[0], runner.group
    directory = runner.rendezvous_dir
    try:
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)
        real = group.token, group.run_id, group.num_steps
        if forgery == "another token":
            group.token = bytes(32)
        elif forgery == "another run":
            group.run_id = bytes([7]) * 16
        else:
            group.num_steps -= 1
        with contextlib.suppress(RuntimeError):    # the worker may hang up before the message's bytes
            group.broadcast_object(("stop",))
        assert worker.wait(timeout=30) == 1
        group.token, group.run_id, group.num_steps = real
    finally:
        llm.llm_engine.shutdown()
    err = capfd.readouterr().err
    assert "refused unread" in err
    assert {"another token": "not signed with this engine's token", "another run": "belongs to another run",
            "a step sent again": "where number"}[forgery] in err
    assert not os.path.exists(directory)
