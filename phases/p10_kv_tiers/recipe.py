"""Phase 10's recipe: phase 9's, with a KV connector where `kv_transfer_config` names one.

    attention   `ConnectorAttention`: phase 9's, each layer of a step that moves blocks between
                the connector worker side's `wait_for_layer_load` and `save_kv_layer`
    runner      `ConnectorModelRunner`: phase 9's, between `start_load_kv` and `wait_for_save`
    scheduler   `ConnectorScheduler`: phase 9's, the waiting requests' prefixes the tier holds
                made prefix-cache hits first, the step's transfers on its plan after

The connector is vLLM's OffloadingConnector: every block a step fills is saved to an offload tier
(offload_store.py: a memory-mapped file of `cpu_bytes_to_use` bytes, least recently used out), and
a request whose prefix the pool has evicted loads it from there instead of recomputing it. With
kv_role "kv_producer" one engine only saves into a file and another, "kv_consumer", only loads
from it: prefill in one engine, decode in the other; with `kv_port`, on two hosts (the producer
serves its tier on a socket, the consumer asks it for each prompt's blocks: kv_remote.py). With
`kv_transfer_config=None` (the default) every part is phase 9's.
"""

from __future__ import annotations

import logging

from phases.p01_naive_attention import EngineSetup, Parts
from phases.p09_engine_core import RECIPE as PHASE9
from tinyvllm import platform

from .connector import OffloadingConnectorScheduler, OffloadingConnectorWorker
from .connector_parts import ConnectorAttention, ConnectorModelRunner, ConnectorScheduler
from .kv_remote import KVBlockClient, KVBlockServer, kv_token
from .kv_transfer import KVTransferConfig, model_fingerprint
from .offload_store import OffloadStore

logger = logging.getLogger("tinyvllm.kv_offload")


def transfer_config(setup: EngineSetup) -> KVTransferConfig | None:
    """The checked `kv_transfer_config` (None: no connector)."""
    return KVTransferConfig.from_dict(setup.config.kv_transfer_config)


def check_transfer(setup: EngineSetup) -> None:
    if transfer_config(setup) is None:
        return
    c = setup.config
    if not c.enable_prefix_caching:
        raise ValueError("kv_transfer_config: the offload tier keeps the prefix cache's blocks; "
                         "leave enable_prefix_caching=True")
    if c.kv_cache_dtype != "auto":
        raise ValueError(f"kv_transfer_config with kv_cache_dtype={c.kv_cache_dtype!r}: the tier keeps "
                         f"float blocks only; leave kv_cache_dtype='auto'")
    if c.tensor_parallel_size > 1:
        raise ValueError(f"kv_transfer_config with tensor_parallel_size={c.tensor_parallel_size}: each rank "
                         f"would need its own tier; use one rank")
    if platform.async_scheduling_default(c.async_scheduling, setup.device.type):
        # the connector's record of a step assumes that step's transfers ended before the next is planned
        raise ValueError("kv_transfer_config with async_scheduling: a step's loads and saves must end before "
                         "the next step is scheduled; set async_scheduling=False")


def make_attention(setup: EngineSetup, parts: Parts):
    inner = PHASE9.attention(setup, parts)
    config = transfer_config(setup)
    if config is None:
        return inner
    kv = parts.kv_cache.kv    # (layers, 2, blocks, block_size, KV heads, head_dim)
    identity = {"model": model_fingerprint(setup.model_path), "block_size": setup.config.block_size}
    store = OffloadStore(config.cpu_bytes_to_use, (kv.shape[0], 2, *kv.shape[3:]), kv.dtype, identity,
                         config.path, config.directory, config.kv_role)
    if config.kv_role != "kv_both":
        store.open()   # at start: a consumer whose producer's file is missing or another's is refused now
    worker = OffloadingConnectorWorker(store, kv)
    if config.kv_port is not None:   # the producer and the consumer on two hosts: over a socket
        token = kv_token()
        if config.kv_role == "kv_producer":
            worker.remote = KVBlockServer(store, config.kv_ip, config.kv_port, token)
            logger.info("kv_producer: serving its KV tier on %s:%d", *worker.remote.address)
        else:   # refused now where the producer cannot be reached or holds another model's blocks
            worker.remote = KVBlockClient(config.kv_ip, config.kv_port, token, store.identity, store.block_bytes)
    return ConnectorAttention(inner, worker)


def make_runner(setup: EngineSetup, parts: Parts):
    inner = PHASE9.runner(setup, parts)
    if not isinstance(parts.attention, ConnectorAttention):
        return inner
    return ConnectorModelRunner(inner, parts.attention.worker)


def make_scheduler(setup: EngineSetup, parts: Parts):
    inner = PHASE9.scheduler(setup, parts)
    if not isinstance(parts.attention, ConnectorAttention):
        return inner
    worker = parts.attention.worker
    remote = worker.remote if isinstance(worker.remote, KVBlockClient) else None
    connector = OffloadingConnectorScheduler(worker.store, parts.allocator, transfer_config(setup).load_blocks_per_step,
                                             remote)
    return ConnectorScheduler(inner, connector, worker)


RECIPE = PHASE9.extend(
    phase=10, engine_args={"kv_transfer_config"}, checks=(check_transfer,),
    attention=make_attention, runner=make_runner, scheduler=make_scheduler,
)
