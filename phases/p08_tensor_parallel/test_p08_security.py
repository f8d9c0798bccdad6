"""Phase 8's security model: the ranks listen on loopback only, their token never reaches a command
line, and a worker unpickles nothing that is not signed with its engine's token."""

from __future__ import annotations

import ipaddress
import os
import pickle
import socket
import stat
from pathlib import Path

import pytest
from phases.p08_tensor_parallel.parallel import dumps_signed, loads_signed
from tinyvllm import LLM

TOKEN = bytes(range(32))


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
    signed = dumps_signed(CreatesAFile(str(target)), TOKEN)

    def flip(data: bytes, i: int) -> bytes:
        return data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]

    bad = [dumps_signed(CreatesAFile(str(target)), bytes(32)),   # another engine's token
           pickle.dumps(CreatesAFile(str(target))),               # not signed at all
           flip(signed, 0), flip(signed, len(signed) - 2),        # its signature, its pickle changed
           b"short"]
    for data in bad:
        with pytest.raises(ValueError, match="token"):
            loads_signed(data, TOKEN)
        assert not target.exists()
    assert loads_signed(dumps_signed(("forward", [1, 2]), TOKEN), TOKEN) == ("forward", [1, 2])
    loads_signed(dumps_signed(CreatesAFile(str(target)), TOKEN), TOKEN)    # the right token: unpickled
    assert target.exists()
    with pytest.raises(ValueError, match="token"):
        dumps_signed("x", b"")                                            # no token, no message


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


def test_a_worker_stops_on_a_forged_message(tiny_model_dir, capfd):
    """A message signed with another token makes the worker stop, without running it; the
    rendezvous directory is this user's alone, and goes with the engine."""
    llm = LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, kv_cache_memory=1 << 22)
    runner = llm.llm_engine.runner
    worker, group = runner.workers[0], runner.group
    directory = runner.rendezvous_dir
    try:
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        real, group.token = group.token, bytes(32)
        group.broadcast_object(("stop",))
        assert worker.wait(timeout=30) == 1            # a signed "stop" exits with 0
        group.token = real
    finally:
        llm.llm_engine.shutdown()
    assert "not signed with this engine's token" in capfd.readouterr().err
    assert not os.path.exists(directory)
