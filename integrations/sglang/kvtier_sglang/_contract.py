"""Stand-in for SGLang's ``HiCacheStorage`` base class, used only when sglang
is not installed (unit tests on machines without it).

Owns: nothing but the method names and signatures that SGLang's HiCache
controller calls on a storage backend (sglang 0.5.x,
``sglang/srt/mem_cache/hicache_storage.py``), restated here in kvtier's own
words. Must not grow behaviour: when sglang is importable,
:mod:`kvtier_sglang.backend` subclasses the real class instead and this module
is never imported.

The contract, as the controller uses it:

* built by the ``dynamic`` backend factory as ``cls(storage_config, kwargs)``;
  ``storage_config.extra_config`` holds the parsed
  ``--hicache-storage-backend-extra-config`` JSON;
* then ``register_mem_pool_host(host_pool)`` once, before any I/O;
* the zero-copy path (``extra_config["interface_v1"]`` truthy):
  ``batch_set_v1(keys, host_indices, extra_info) -> list[bool]`` on the
  write-back thread and ``batch_get_v1(keys, host_indices, extra_info) ->
  list[bool]`` on the prefetch thread; ``host_indices`` holds
  ``page_size`` token slots per key and the controller uses the leading run of
  ``True``;
* the generic path: ``batch_set(keys, values) -> bool`` with flat data pages,
  ``batch_get(keys, target_locations) -> list[tensor | None]`` into dummy flat
  pages;
* ``batch_exists(keys, extra_info) -> int``: how many leading keys exist;
* ``get``/``set``/``exists`` for single pages; ``clear``; ``get_stats``;
* the v2 pool interface of hybrid and DeepSeek caches: side host pools come
  through ``register_mem_host_pool_v2(host_pool, name)`` (then
  ``on_host_pools_registered()`` once); ``batch_exists_v2(keys,
  pool_transfers, extra_info) -> PoolTransferResult``; ``batch_get_v2`` /
  ``batch_set_v2(transfers, extra_info) -> {transfer.name: [bool, ...]}``,
  where a ``PoolTransfer`` names its pool and carries ``keys`` (the KV page
  keys it shares) and ``host_indices`` (``page_size`` slots per key in that
  pool's host pool).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Any


class PoolName(str, Enum):
    """Pool names (the subset the tests use; SGLang has more)."""

    KV = "kv"
    MAMBA = "mamba"
    SWA = "swa"
    INDEXER = "indexer"

    def __str__(self) -> str:
        return self.value


class PoolHitPolicy(str, Enum):
    """How a side pool gates the hit of ``batch_exists_v2``."""

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"
    BLOCK_GROUPS = "block_groups"


@dataclass
class PoolTransfer:
    """One pool's part of a v2 call (the host <-> storage fields)."""

    name: Any
    host_indices: Any = None
    device_indices: Any = None
    keys: list[str] | None = None
    hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    nodes_to_load: Any = None
    indices_from_pool: Any = None
    block_pages: int = 0
    group_pages: int = 0


@dataclass
class PoolTransferResult:
    """``batch_exists_v2``'s answer: usable prefix, per-pool boundaries, restorable prefixes."""

    kv_hit_pages: int
    extra_pool_hit_pages: dict
    restorable_prefix_pages: list[int] | None = None


class HiCacheStorageContract(ABC):
    """The storage-backend interface SGLang's HiCache controller calls."""

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Called once, right after construction, with the host KV pool."""
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Called once per side pool (and for sidecars added later) with its host pool."""
        if not hasattr(self, "registered_pools"):
            self.registered_pools = {}
        self.registered_pools[host_pool_name] = host_pool

    def on_host_pools_registered(self) -> None:
        """Called once after the registration burst."""

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """Usable prefix of ``keys`` across the KV pool and ``pool_transfers``' pools."""
        raise NotImplementedError

    def batch_get_v2(self, transfers: list, extra_info: Any = None) -> dict:
        """Read each transfer's pages into its host pool; ``{transfer.name: [bool, ...]}``."""
        raise NotImplementedError

    def batch_set_v2(self, transfers: list, extra_info: Any = None) -> dict:
        """Write each transfer's pages from its host pool; ``{transfer.name: [bool, ...]}``."""
        raise NotImplementedError

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Read pages straight into the host pool at ``host_indices``; one bool per key."""
        raise NotImplementedError

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Write the host pool's pages at ``host_indices``; one bool per key."""
        raise NotImplementedError

    @abstractmethod
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """The page of ``key`` (into ``target_location`` when given), or ``None``."""

    @abstractmethod
    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        """One page or ``None`` per key."""

    @abstractmethod
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one page; ``True`` when stored (or already there)."""

    @abstractmethod
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store several pages; ``True`` only when all are stored."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the page of ``key`` can be read."""

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading ``keys`` that exist."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def clear(self) -> None:
        """Drop every stored page (optional)."""

    def get_stats(self) -> Any:
        """Backend metrics for SGLang's storage metrics, or ``None``."""
        return None
