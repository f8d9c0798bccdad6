"""Phase 10: a KV connector (vLLM's scheduler and worker sides) and an offload tier past the pool."""

from .connector import KVConnectorMetadata, OffloadingConnectorScheduler, OffloadingConnectorWorker, block_digest
from .connector_parts import ConnectorAttention, ConnectorModelRunner, ConnectorScheduler
from .kv_transfer import KVTransferConfig
from .offload_store import OffloadStore
from .recipe import RECIPE

__all__ = ["ConnectorAttention", "ConnectorModelRunner", "ConnectorScheduler", "KVConnectorMetadata",
           "KVTransferConfig", "OffloadStore", "OffloadingConnectorScheduler", "OffloadingConnectorWorker",
           "RECIPE", "block_digest"]
