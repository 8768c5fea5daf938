"""kvtier: an agent-aware, tiered (HBM / DRAM / SSD) KV-cache manager.

``import kvtier`` is cheap: it never imports torch, vllm, sglang or grpc.
The data plane (``kvtier.tiers``, ``kvtier.transfer``, ``kvtier.store``)
imports torch lazily when used.
"""

from .errors import ConfigError, KVTierError, ProtocolError, StorageError, UnknownPolicyError
from .keys import BlockKey, Namespace, block_key, chain_foreign_keys, chain_keys, foreign_key
from .layout import KVLayout

__version__ = "0.1.0"

__all__ = [
    "BlockKey",
    "ConfigError",
    "KVLayout",
    "KVTierError",
    "Namespace",
    "ProtocolError",
    "StorageError",
    "UnknownPolicyError",
    "__version__",
    "block_key",
    "chain_foreign_keys",
    "chain_keys",
    "foreign_key",
]
