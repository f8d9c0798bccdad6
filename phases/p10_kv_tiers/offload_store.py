"""The offload tier: K/V blocks in a memory-mapped file, bounded in bytes, least recently used out.

    file:  | header (4 KiB)      | slot 0                     | slot 1 | ... | slot N-1 |
             magic, version,      | slot header (64 B) | block |
             the engine's identity  magic, digest, crc32   (layers, 2, block_size, KV heads, head_dim)

One slot holds one block of the pool, every layer's K and V, as the pool's dtype. A block is found
by its *digest*: sha256 over the digest of the block before it and this block's token ids, the
prefix cache's chained key made stable across processes (Python's `hash` of a tuple holding None
is not). The file is `cpu_bytes_to_use` bytes at most (vLLM's OffloadingConnector's name for its
tier's size), header included, and is written through a memory map: the operating system keeps
the recently used pages in memory and the rest on disk, so the tier may be far larger than the KV
pool, and than this machine's memory.

Integrity: the header names the model (a fingerprint of its config and weights), the block size,
the dtype and the block's shape; a file whose header differs, or that is shorter than its header
says, is refused with a warning naming why, and started empty. Each slot's header keeps the
block's digest and a CRC-32 of its bytes, checked before a block is loaded: a slot that fails is
dropped, and its tokens are recomputed (a lookup reads the headers only; the bytes of a block are
checked when a step takes it). A file that cannot be made (an unwritable folder, a full disk)
turns the tier off with a warning: every request is recomputed, none fails.

The split follows vLLM's offloading (vllm/v1/kv_offload/): the scheduler's side keeps the index
and its LRU (`lookup`, `verify`, `allocate`, `touch`, `pin`: its `LRUOffloadingManager`), the
worker's side moves the bytes (`block`, `commit`: its CPU<->GPU transfer handlers).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import mmap
import os
import struct
import tempfile
import zlib
from collections import OrderedDict

import torch

logger = logging.getLogger("tinyvllm.kv_offload")

MAGIC, VERSION = b"TVKVTIER", 1
FILE_HEADER = 4096
SLOT_HEADER = 64
SLOT_MAGIC = b"BLK1"
_SLOT = struct.Struct("<4s32sIQ")   # magic, digest, crc32 of the block's bytes, the block's bytes
# a block one engine writes for another may lie in any of WAYS slots from the one its digest names
# (set-associative): a long prompt's blocks that name one slot no longer replace each other
WAYS = 8


# what a header's fields are called in a warning, in the order they are compared
_NAMES = {"model": "model", "block_size": "block size", "dtype": "dtype", "block_shape": "block shape",
          "num_slots": "size (cpu_bytes_to_use)"}


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class OffloadStore:
    """A file of `cpu_bytes_to_use` bytes at most holding K/V blocks by digest, LRU first out.

    Args:
        capacity_bytes: the file's largest size (`cpu_bytes_to_use`).
        block_shape: one block's K/V, (layers, 2, block_size, KV heads, head_dim).
        dtype: the pool's dtype.
        identity: what must match for a block to be reused (model fingerprint, block size, ...).
        path: the file, kept between runs; None: a temporary file in `directory` (default
            /dev/shm, memory, where it exists), gone at exit.
        role: "kv_both" (this engine's own tier, an LRU), or "kv_producer" / "kv_consumer": one
            engine writes the file, another reads it, each block in one of the `WAYS` slots from
            the one its digest names (set-associative: the reader needs no index, it reads those
            slots' headers; a new block takes a free one of them, else replaces the one written
            longest ago).
    """

    def __init__(self, capacity_bytes: int, block_shape: tuple[int, ...], dtype: torch.dtype, identity: dict,
                 path: str | None = None, directory: str | None = None, role: str = "kv_both"):
        self.block_shape, self.dtype = tuple(block_shape), dtype
        self.block_bytes = math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()
        self.slot_bytes = SLOT_HEADER + _round_up(self.block_bytes, 64)
        self.num_slots = (capacity_bytes - FILE_HEADER) // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(f"kv_transfer_config: cpu_bytes_to_use={capacity_bytes} holds no KV block "
                             f"({self.slot_bytes} bytes each, after a {FILE_HEADER}-byte header)")
        self.capacity_bytes = capacity_bytes
        self.identity = {**identity, "block_shape": list(self.block_shape), "dtype": str(dtype),
                         "num_slots": self.num_slots, "slot_bytes": self.slot_bytes}
        self.path, self.directory, self.role = path, directory, role
        self.owner: dict[int, bytes] = {}   # a producer's slot -> the digest it holds
        self.written: dict[int, int] = {}   # a producer's slot -> when it was last written (a count)
        self.writes = 0
        self.index: OrderedDict[bytes, int] = OrderedDict()   # digest -> slot, least recently used first
        self.free_slots = list(reversed(range(self.num_slots)))
        self.pinned: set[int] = set()     # slots a step loads from: not evicted until it has run
        self.usable: bool | None = None   # None: not opened yet (opened at first use)
        self.num_evicted = self.num_refused = 0

    # -- the file ------------------------------------------------------------------------------
    def open(self) -> bool:
        """Open (or make) the file at first use; False, with a warning, where it cannot be."""
        if self.usable is not None:
            return self.usable
        try:
            self._open()
            self.usable = True
        except OSError as e:
            if self.role == "kv_consumer":
                raise ValueError(f"kv_consumer: cannot open the producer's tier file {self.path} ({e}); start the "
                                 f"kv_producer first, with the same path and cpu_bytes_to_use") from e
            logger.warning("the KV offload tier is off (every request is recomputed): %s", e)
            self.usable = False
        return self.usable

    def _open(self) -> None:
        size = FILE_HEADER + self.num_slots * self.slot_bytes
        if self.path is None:   # by default in memory (/dev/shm): a disk throttles a writer to its own speed
            folder = self.directory or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
            fd, name = tempfile.mkstemp(prefix="tinyvllm-kv-tier-", dir=folder)
            os.unlink(name)   # private to this engine, gone when it closes
        elif self.role == "kv_consumer":   # the producer's file, read only where it writes
            fd = os.open(self.path, os.O_RDWR)
            problem = self._mismatch(fd, size)
            if problem:
                os.close(fd)
                raise ValueError(f"kv_consumer: {problem}; start both with the same model, block_size and "
                                 f"cpu_bytes_to_use")
        else:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if self.role != "kv_consumer":
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # one engine writes a file
        except OSError as e:
            os.close(fd)
            raise OSError(f"{self.path}: another engine writes this tier file") from e
        reuse = self.path is not None and (self.role == "kv_consumer" or self._header_matches(fd, size))
        if not reuse:
            os.ftruncate(fd, 0)
            os.posix_fallocate(fd, 0, size)   # the disk space now: a full disk fails here, not in a write
        self.fd = fd
        self.mm = mmap.mmap(fd, size)
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8)
        if reuse and self.role != "kv_consumer":
            self._read_index()
        elif not reuse:
            header = MAGIC + struct.pack("<I", VERSION) + json.dumps(self.identity, sort_keys=True).encode()
            self.mm[:len(header)] = header

    def _header_matches(self, fd: int, size: int) -> bool:
        """Whether the file at `self.path` is a tier of this engine's identity and whole; a warning
        naming the difference where it is not (then it is started empty)."""
        problem = self._mismatch(fd, size) if os.fstat(fd).st_size else "empty"
        if problem and problem != "empty":
            logger.warning("%s; refused, started empty", problem)
        return problem is None

    def _mismatch(self, fd: int, size: int) -> str | None:
        """What keeps the file at `self.path` from being this engine's tier (None: nothing)."""
        have = os.fstat(fd).st_size
        head = os.pread(fd, FILE_HEADER, 0)
        if head[:8] != MAGIC or struct.unpack("<I", head[8:12])[0] != VERSION:
            return f"KV tier file {self.path}: not a tier file of this version"
        try:
            theirs = json.loads(head[12:].rstrip(b"\0"))
        except ValueError:
            return f"KV tier file {self.path}: its header does not parse"
        for key in sorted(self.identity, key=lambda k: (k not in _NAMES, list(_NAMES).index(k) if k in _NAMES else k)):
            if theirs.get(key) != self.identity[key]:
                return (f"KV tier file {self.path} is from another {_NAMES.get(key, key)} ({theirs.get(key)!r}, "
                        f"this engine's {self.identity[key]!r})")
        if have < size:
            return f"KV tier file {self.path} is truncated ({have} bytes, its header says {size})"
        return None

    def _read_index(self) -> None:
        for slot in range(self.num_slots):
            magic, digest, _, nbytes = _SLOT.unpack_from(self.mm, self._offset(slot) - SLOT_HEADER)
            if magic == SLOT_MAGIC and nbytes == self.block_bytes:
                self.index[digest] = slot
                if self.role == "kv_producer":
                    self.owner[slot], self.written[slot] = digest, 0
        self.free_slots = [s for s in reversed(range(self.num_slots)) if s not in set(self.index.values())]

    def _offset(self, slot: int) -> int:
        return FILE_HEADER + slot * self.slot_bytes + SLOT_HEADER

    def close(self) -> None:
        if self.usable:
            self.data = None
            self.mm.flush()
            self.mm.close()
            os.close(self.fd)
        self.usable = False

    @property
    def num_bytes(self) -> int:
        """The file's size on disk (0 before it is opened)."""
        return os.fstat(self.fd).st_size if self.usable else 0

    # -- the scheduler's side: the index and its LRU --------------------------------------------
    def ways(self, digest: bytes) -> list[int]:
        """The slots block `digest` may lie in, in a file one engine writes for another."""
        first = int.from_bytes(digest[:8], "little") % self.num_slots
        return [(first + i) % self.num_slots for i in range(min(WAYS, self.num_slots))]

    def slot_of(self, digest: bytes) -> int | None:
        """Where block `digest` is: this engine's index, or for a consumer the one of its `ways`
        whose header names it (None: not there)."""
        if self.role != "kv_consumer":
            return self.index.get(digest)
        for slot in self.ways(digest):
            magic, saved, _, _ = _SLOT.unpack_from(self.mm, self._offset(slot) - SLOT_HEADER)
            if magic == SLOT_MAGIC and saved == digest:
                return slot
        return None

    def lookup(self, digest: bytes) -> int | None:
        """The slot holding `digest` by its header (None if absent); its bytes are checked when a
        step takes it (`verify`)."""
        slot = self.slot_of(digest)
        if slot is None:
            return None
        magic, saved, _, nbytes = _SLOT.unpack_from(self.mm, self._offset(slot) - SLOT_HEADER)
        return slot if magic == SLOT_MAGIC and saved == digest and nbytes == self.block_bytes else None

    def verify(self, digest: bytes, slot: int | None) -> bool:
        """Whether `slot` holds block `digest` whole: its bytes against the CRC-32 saved with them.
        A slot that fails is dropped (with a warning), and its tokens are recomputed."""
        if slot is None:
            return False
        off = self._offset(slot)
        magic, saved, crc, nbytes = _SLOT.unpack_from(self.mm, off - SLOT_HEADER)
        if magic == SLOT_MAGIC and saved == digest and nbytes == self.block_bytes and \
                zlib.crc32(memoryview(self.mm)[off:off + nbytes]) == crc:
            return True
        logger.warning("KV tier: slot %d does not hold the block saved there (damaged or overwritten); "
                       "its tokens are recomputed", slot)
        self.num_refused += 1
        if self.role != "kv_consumer" and self.index.get(digest) == slot:
            del self.index[digest]
            self.mm[off - SLOT_HEADER:off] = bytes(SLOT_HEADER)
            self.free_slots.append(slot)
        return False

    def touch(self, digest: bytes) -> None:
        """`digest` was used: it leaves the tier last."""
        if digest in self.index:
            self.index.move_to_end(digest)

    def discard(self, digest: bytes, slot: int) -> None:
        """Forget a block whose save did not finish; its slot is free again."""
        if self.index.get(digest) == slot:
            del self.index[digest]
            self.free_slots.append(slot)

    def pin(self, slot: int) -> None:
        self.pinned.add(slot)

    def allocate(self, digest: bytes) -> int | None:
        """A slot for a new block `digest`: a free one, else the least recently used entry's that no
        step is loading from (pinned); None when every slot is pinned. A producer's block goes to
        one of its `ways`: its own slot if it is there already, else a free one, else the one
        written longest ago, replacing what was there (not one a step loads from: None if all are)."""
        if self.role != "kv_both":
            slot = self.index.get(digest)
            if slot is None:
                ways = [w for w in self.ways(digest) if w not in self.pinned]   # (a consumer's loads this step)
                slot = next((w for w in ways if w not in self.owner), None)
                if slot is None:
                    if not ways:
                        return None
                    slot = min(ways, key=self.written.__getitem__)
                    self.index.pop(self.owner.pop(slot), None)
                    self.num_evicted += 1
            self.index[digest], self.owner[slot] = slot, digest
            self.writes += 1
            self.written[slot] = self.writes
            return slot
        # >>> exercise tier_lru (2 stars): A slot for a new block: a free slot if there is one, else the slot of the least recently used entry that is not pinned, that entry forgotten.
        # hint: self.index is an OrderedDict, least recently used first; skip pinned slots; the new digest goes in at the most recent end; count evictions in self.num_evicted.
        # checked by: test_the_tier_evicts_its_least_recently_used_block, test_the_tier_never_grows_past_its_bound
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((d for d, s in self.index.items() if s not in self.pinned), None)
            if victim is None:
                return None
            slot = self.index.pop(victim)
            self.num_evicted += 1
        self.index[digest] = slot
        return slot
        # <<< exercise tier_lru

    # -- the worker's side: the bytes -----------------------------------------------------------
    def block(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s block in place, (layers, 2, block_size, KV heads, head_dim)."""
        off = self._offset(slot)
        return self.data[off:off + self.block_bytes].view(self.dtype).view(self.block_shape)

    def read(self, digest: bytes) -> tuple[int, bytes] | None:
        """Block `digest`'s CRC-32 and a copy of its bytes, for another engine (kv_remote.py); None
        where this tier lacks it whole: absent, its bytes not their CRC's, or its slot's header
        changed while they were copied (the engine replaced it). Reads only: safe beside the engine."""
        slot = self.slot_of(digest) if self.usable else None
        if slot is None:
            return None
        off = self._offset(slot)
        before = _SLOT.unpack_from(self.mm, off - SLOT_HEADER)
        data = bytes(self.mm[off:off + self.block_bytes])
        magic, saved, crc, nbytes = after = _SLOT.unpack_from(self.mm, off - SLOT_HEADER)
        if before != after or magic != SLOT_MAGIC or saved != digest or nbytes != self.block_bytes \
                or zlib.crc32(data) != crc:
            return None
        return crc, data

    def write(self, slot: int, digest: bytes, data, crc: int) -> None:
        """Slot `slot` takes block `digest`'s bytes as another engine sent them (kv_remote.py),
        with the CRC-32 they were checked against."""
        off = self._offset(slot)
        self.mm[off:off + self.block_bytes] = data
        self.commit(slot, digest, crc)

    def commit(self, slot: int, digest: bytes, crc: int | None = None) -> None:
        """Slot `slot` now holds block `digest` in full: its header, with the bytes' CRC-32 (made
        here unless given)."""
        off = self._offset(slot)
        if crc is None:
            crc = zlib.crc32(memoryview(self.mm)[off:off + self.block_bytes])
        _SLOT.pack_into(self.mm, off - SLOT_HEADER, SLOT_MAGIC, digest, crc, self.block_bytes)
