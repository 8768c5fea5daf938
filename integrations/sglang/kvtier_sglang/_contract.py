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
* ``get``/``set``/``exists`` for single pages; ``clear``; ``get_stats``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class HiCacheStorageContract(ABC):
    """The storage-backend interface SGLang's HiCache controller calls."""

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Called once, right after construction, with the host KV pool."""
        self.mem_pool_host = mem_pool_host

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
