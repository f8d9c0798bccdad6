"""A producer's tier read from another host: its blocks over a socket, signed as phase 8 signs.

    consumer (the decode host)                              producer (the prefill host)
    a waiting request: the digests of the                   KVBlockServer, a thread beside its
    prompt's blocks its own tier lacks     --- kv-fetch -->   engine, listening on kv_ip:kv_port:
                                                              each digest's slot in its tier, the
    in the background (the request waits,                     bytes copied and their CRC-32 checked
    the others decode); then each block     <-- kv-blocks --  the leading blocks it holds, in order
    lands in its own tier file, CRC checked,
    and loads as any tier block

On one host the two engines share the tier file (offload_store.py). Between hosts the consumer
keeps a tier file of its own (private, in /dev/shm) and asks the producer, over one TCP
connection, for the blocks of each request's prompt it does not hold; vLLM's P2P connectors name
the producer's address `kv_ip` and `kv_port` too. The consumer pulls: a producer never sends a
block it was not asked for, and the blocks of a request no one asks for are never sent.

Every frame but the first is phase 8's `sign_bytes` under the token in TINYVLLM_KV_TOKEN (the
same secret on both hosts, hex, at least 16 bytes), stamped with the connection's nonce (sent by
the server in the clear, first), the sender (0: producer, 1: consumer) and a counter: a frame
from a process without the token, from another connection, or sent again, is refused unread and
the connection dropped, with a log line. The two engines compare their identities (model, block
size, dtype, block shape) when the consumer starts: another model or block size is refused
there, naming both.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import struct
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

from phases.p08_tensor_parallel.parallel import RefusedValue, Stamp, open_signed, shared_token, sign_bytes, sign_parts

from .offload_store import OffloadStore

logger = logging.getLogger("tinyvllm.kv_offload")

TOKEN_ENV = "TINYVLLM_KV_TOKEN"
PRODUCER, CONSUMER = 0, 1
HELLO = b"TVKVHELO"
NONCE_BYTES = 16
DIGEST_BYTES = 32
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
MAX_REQUEST = 1 << 20          # bytes of a request frame at most (32,768 digests)
HELLO_TIMEOUT_S = 30.0
# what must be equal for one engine's blocks to be another's (not the tier's size: each has its own)
SAME = ("model", "block_size", "dtype", "block_shape")


def kv_token() -> bytes:
    """The secret both engines sign with (`TOKEN_ENV`), taken out of this process's environment."""
    return shared_token(TOKEN_ENV, "kv_transfer_config with kv_port", "producer and its consumers")


def send_frame(conn: socket.socket, *parts) -> None:
    """One frame: its length, then its parts one after another (a block's bytes are not joined)."""
    conn.sendall(_LENGTH.pack(sum(len(p) for p in parts)))
    for part in parts:
        conn.sendall(part)


def read_frame(conn: socket.socket, limit: int) -> memoryview:
    """One frame of at most `limit` bytes (a ConnectionError past it, or at the connection's end),
    received in place: a view of its buffer."""
    n = _LENGTH.unpack(_read(conn, _LENGTH.size))[0]
    if n > limit:
        raise ConnectionError(f"a frame of {n} bytes, more than the {limit} expected")
    return _read(conn, n)


def _read(conn: socket.socket, n: int) -> memoryview:
    view, got = memoryview(bytearray(n)), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if not k:
            raise ConnectionError("the other engine closed the connection")
        got += k
    return view


def same_blocks(mine: dict, theirs: dict) -> str | None:
    """What makes the other engine's blocks not this one's (None: nothing), naming both."""
    for key in SAME:
        if theirs.get(key) != mine.get(key):
            return f"the producer's {key} is {theirs.get(key)!r}, the consumer's {mine.get(key)!r}"
    return None


class KVBlockServer:
    """The producer's side: serves the blocks of its tier (`store`) to consumers that hold the
    token, on `host:port`, one thread per connection, until `close`."""

    def __init__(self, store: OffloadStore, host: str, port: int, token: bytes):
        self.store, self.token = store, token
        self.sock = socket.create_server((host, port))
        self.address = self.sock.getsockname()[:2]
        self.num_served_blocks = 0
        self.closed = False
        threading.Thread(target=self._accept, name="kv-block-server", daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.sock.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, peer), name="kv-block-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        nonce = secrets.token_bytes(NONCE_BYTES)
        with conn:
            try:
                conn.settimeout(HELLO_TIMEOUT_S)   # a connection that never says hello ends
                send_frame(conn, HELLO + nonce)
                theirs = json.loads(bytes(open_signed(read_frame(conn, MAX_REQUEST), self.token,
                                                      Stamp("kv-hello", nonce, CONSUMER, 0))))
                problem = same_blocks(theirs if isinstance(theirs, dict) else {}, self.store.identity)
                answer = {"refused": problem} if problem else {"identity": self.store.identity}
                send_frame(conn, sign_bytes(json.dumps(answer).encode(), self.token,
                                            Stamp("kv-hello", nonce, PRODUCER, 0)))
                if problem:
                    logger.warning("KV block server: refused a consumer at %s: %s", peer[0], problem)
                    return
                conn.settimeout(None)
                counter = 1
                while True:
                    request = open_signed(read_frame(conn, MAX_REQUEST), self.token,
                                          Stamp("kv-fetch", nonce, CONSUMER, counter))
                    digests = [bytes(request[i:i + DIGEST_BYTES]) for i in range(0, len(request), DIGEST_BYTES)]
                    send_frame(conn, *sign_parts(self.blocks(digests), self.token,
                                                 Stamp("kv-blocks", nonce, PRODUCER, counter)))
                    counter += 1
            except RefusedValue as e:
                logger.warning("KV block server: a frame from %s refused, connection dropped: %s", peer[0], e)
            except (ConnectionError, OSError, ValueError):
                pass   # the consumer went away (or sent what is not a hello): its connection ends

    def blocks(self, digests: list[bytes]) -> list[bytes]:
        """The leading blocks of `digests` this tier holds whole (`OffloadStore.read`), in order,
        as the parts of a frame: how many, then each block's CRC-32 and bytes."""
        out = []
        for digest in digests:
            block = self.store.read(digest)
            if block is None:
                break
            out += [_CRC.pack(block[0]), block[1]]
        self.num_served_blocks += len(out) // 2
        return [struct.pack("<I", len(out) // 2), *out]


class KVBlockClient:
    """The consumer's side: one connection to the producer at `host:port`, the identities
    compared at once (a ValueError naming both where they differ, or where it cannot be
    reached); `submit(digests)` fetches in the background (a Future of [(digest, CRC-32,
    bytes)], the leading blocks the producer holds, each checked against its CRC; the bytes a
    view of the received frame)."""

    def __init__(self, host: str, port: int, token: bytes, identity: dict, block_bytes: int, timeout: float = 30.0):
        self.token, self.block_bytes, self.address = token, block_bytes, f"{host}:{port}"
        try:
            self.conn = socket.create_connection((host, port), timeout=timeout)
            hello = read_frame(self.conn, len(HELLO) + NONCE_BYTES)
            if hello[:len(HELLO)] != HELLO:
                raise ConnectionError("not a tinyvllm KV producer")
            self.nonce = bytes(hello[len(HELLO):])
            send_frame(self.conn, sign_bytes(json.dumps(identity).encode(), token,
                                             Stamp("kv-hello", self.nonce, CONSUMER, 0)))
            answer = json.loads(bytes(open_signed(read_frame(self.conn, MAX_REQUEST), token,
                                                  Stamp("kv-hello", self.nonce, PRODUCER, 0))))
        except (OSError, ConnectionError, RefusedValue) as e:
            raise ValueError(f"kv_consumer: the kv_producer at {self.address} cannot be reached or refused this "
                             f"engine ({e}); start the producer first, with kv_port and the same "
                             f"{TOKEN_ENV}") from e
        problem = answer.get("refused") or same_blocks(identity, answer.get("identity", {}))
        if problem:
            self.conn.close()
            raise ValueError(f"kv_consumer: the kv_producer at {self.address} holds other blocks: {problem}; "
                             f"start both with the same model and block_size")
        self.conn.settimeout(None)
        self.counter = 1
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kv-block-client")
        self.num_fetched_blocks = 0

    def submit(self, digests: list[bytes]) -> Future:
        return self.pool.submit(self.fetch, digests)

    def fetch(self, digests: list[bytes]) -> list[tuple[bytes, int, memoryview]]:
        """The leading blocks of `digests` the producer holds, each with its CRC and its bytes
        (checked against that CRC). A frame not the producer's answer raises RefusedValue."""
        counter, self.counter = self.counter, self.counter + 1
        send_frame(self.conn, sign_bytes(b"".join(digests), self.token, Stamp("kv-fetch", self.nonce, CONSUMER, counter)))
        limit = 4 + len(digests) * (_CRC.size + self.block_bytes) + 256
        data = open_signed(read_frame(self.conn, limit), self.token, Stamp("kv-blocks", self.nonce, PRODUCER, counter))
        n, at, out = struct.unpack_from("<I", data)[0], 4, []
        for digest in digests[:n]:
            crc = _CRC.unpack_from(data, at)[0]
            block = data[at + _CRC.size: at + _CRC.size + self.block_bytes]
            if len(block) != self.block_bytes or zlib.crc32(block) != crc:
                break
            out.append((digest, crc, block))
            at += _CRC.size + self.block_bytes
        self.num_fetched_blocks += len(out)
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.conn.close()
