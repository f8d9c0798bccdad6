"""`kv_transfer_config`, checked: which connector, in which role, with what store.

vLLM's KVTransferConfig (vllm/config/kv_transfer.py) as a dict, with its names:

    {"kv_connector": "OffloadingConnector",     the only connector built here
     "kv_role": "kv_both",                      this engine both saves and loads
     "kv_ip": "127.0.0.1", "kv_port": 14579,    a kv_producer serves its tier there, a kv_consumer
                                                reads it from there (another host: kv_remote.py)
     "kv_connector_extra_config": {
         "cpu_bytes_to_use": 1073741824,        the tier file's largest size (default 1 GiB)
         "path": "/data/kv-tier.bin",           a file kept between runs (default: a private
                                                temporary file, gone with the engine)
         "dir": "/tmp",                         where the temporary file goes (default /dev/shm,
                                                memory, where it exists: written at a few GB a
                                                minute, a tier on disk is throttled to the disk)
         "load_blocks_per_step": 16}}           while other requests run, a waiting one loads at
                                                most this many blocks a step (0: all at once), so
                                                a long prompt's load does not stall their tokens

kv_role "kv_producer" / "kv_consumer": prefill in one engine, decode in another. The producer
saves every block it computes into `path`, the consumer loads the prompt's blocks from there (on
one host, a file in /dev/shm is shared memory); both give the same `path` and `cpu_bytes_to_use`.
With `kv_port` the two need not share a file (nor a host): the producer serves its tier on
kv_ip:kv_port, the consumer asks it there for each prompt's blocks and keeps them in a tier of its
own (`path` is then the producer's own, optional, and no consumer's).

Anything else is refused, naming the key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

CONNECTORS = ("OffloadingConnector",)
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
DEFAULT_CPU_BYTES = 1 << 30
DEFAULT_LOAD_BLOCKS = 16
_KEYS = {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_ip", "kv_port"}
DEFAULT_KV_IP = "127.0.0.1"
_EXTRA_KEYS = {"cpu_bytes_to_use", "path", "dir", "load_blocks_per_step"}


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    cpu_bytes_to_use: int = DEFAULT_CPU_BYTES
    path: str | None = None
    directory: str | None = None
    load_blocks_per_step: int = DEFAULT_LOAD_BLOCKS
    kv_ip: str = DEFAULT_KV_IP
    kv_port: int | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> "KVTransferConfig | None":
        """The checked config (None: no connector). A ValueError or TypeError names the key."""
        if d is None:
            return None
        unknown = sorted(set(d) - _KEYS)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {unknown}; the keys are {sorted(_KEYS)}")
        connector, role = d.get("kv_connector"), d.get("kv_role", "kv_both")
        if connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config['kv_connector'] must be one of {CONNECTORS}, got {connector!r}")
        if role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config['kv_role'] must be one of {KV_ROLES}, got {role!r}")
        extra = d.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise TypeError(f"kv_transfer_config['kv_connector_extra_config'] must be a dict, got {extra!r}")
        unknown = sorted(set(extra) - _EXTRA_KEYS)
        if unknown:
            raise ValueError(f"kv_transfer_config['kv_connector_extra_config']: unknown key(s) {unknown}; "
                             f"the keys are {sorted(_EXTRA_KEYS)}")
        size = extra.get("cpu_bytes_to_use", DEFAULT_CPU_BYTES)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"kv_transfer_config['kv_connector_extra_config']['cpu_bytes_to_use'] must be an "
                             f"int >= 1 (bytes), got {size!r}")
        per_step = extra.get("load_blocks_per_step", DEFAULT_LOAD_BLOCKS)
        if isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 0:
            raise ValueError(f"kv_transfer_config['kv_connector_extra_config']['load_blocks_per_step'] must be an "
                             f"int >= 0 (0: every block at once), got {per_step!r}")
        for key in ("path", "dir"):
            if extra.get(key) is not None and not isinstance(extra[key], str):
                raise TypeError(f"kv_transfer_config['kv_connector_extra_config'][{key!r}] must be a str, "
                                f"got {extra[key]!r}")
        ip, port = d.get("kv_ip", DEFAULT_KV_IP), d.get("kv_port")
        if not isinstance(ip, str) or not ip:
            raise TypeError(f"kv_transfer_config['kv_ip'] must be a host name or address (a str), got {ip!r}")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
            raise ValueError(f"kv_transfer_config['kv_port'] must be an int from 0 to 65535 (0: any free port, "
                             f"a producer's), got {port!r}")
        if port is not None and role == "kv_both":
            raise ValueError("kv_transfer_config['kv_port'] is for kv_role 'kv_producer' (serves its tier there) or "
                             "'kv_consumer' (reads it from there), not 'kv_both'")
        if port is not None and role == "kv_consumer" and extra.get("path") is not None:
            raise ValueError("kv_transfer_config['kv_connector_extra_config']['path'] with kv_port: a consumer reads "
                             "the producer's blocks over the socket into a tier of its own; leave path unset")
        if role != "kv_both" and port is None and extra.get("path") is None:
            raise ValueError(f"kv_transfer_config['kv_connector_extra_config']['path'] is needed with kv_role={role!r}: "
                             f"the file the producer writes and the consumer reads (on one host, in /dev/shm); "
                             f"or kv_port, where the producer serves it")
        return cls(connector, role, size, extra.get("path"), extra.get("dir"), per_step, ip, port)


def model_fingerprint(folder: Path) -> str:
    """What tells this model's K/V from another's: its config and, per weight file, its name,
    size and first MiB (tiny random models share a config but not their weights)."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            h.update(f"{f.name}:{f.stat().st_size}:".encode() + fh.read(1 << 20))
    return h.hexdigest()[:32]
