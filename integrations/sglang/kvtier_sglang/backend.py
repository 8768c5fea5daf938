"""kvtier as SGLang's HiCache L3 storage (the ``dynamic`` storage backend).

Owns: the translation between SGLang's storage calls and one
:class:`~kvtier.store.TieredStore` per scheduler rank: page keys (SGLang's
chained page hashes, strings) to kvtier keys, host-pool pages to byte blocks,
and the kvtier configuration read from SGLang's extra config. Must not make
tiering decisions (the store's manager and policies do), must not import
sglang beyond its base class, and must never hand SGLang bytes that did not
verify: a missing, corrupt or foreign value is a miss (``None`` / ``False``).

Keys. Each SGLang page key already hashes its whole prefix, so the kvtier key
of a page is ``foreign_key(namespace, None, page_key)``: computable from the
page key alone (``get``/``exists`` have no prefix). The chain structure
(``extra_info.prefix_keys`` and the order within a batch) is still handed to
the manager as parent links, so eviction stays tail-first.

Namespace. Model name, TP/PP rank and size from ``HiCacheStorageConfig``,
layout from the host pool, and the host pool's memory layout (pages of
``layer_first`` and ``page_first`` pools order the same KV differently).

Configuration (``--hicache-storage-backend-extra-config`` JSON), besides the
factory's ``backend_name``/``module_path``/``class_name`` and SGLang's
``interface_v1``:

* ``kvtier_config``: path of a kvtier YAML/TOML file (optional);
* ``kvtier``: nested kvtier settings overriding the file (optional).

Defaults under SGLang: ``tiers.hbm.enabled=false`` (SGLang owns device and
host memory; kvtier is its L3), ``put_tier=dram``, and ``write_through=true``
when the SSD tier is enabled, so every page also lands on disk and survives a
restart. Each rank uses its own subdirectory of ``tiers.ssd.path``.

Shared by engines: with ``tiers.remote`` on (a Mooncake Store), every page is
also written there, and ``batch_exists`` / the gets continue past the local
tiers into it, so an engine finds pages another engine wrote.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvtier.config import KVTierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey, foreign_key
from kvtier.store import TieredStore

from .pages import PagePointers, PoolGeometry, gather, pool_geometry, scatter

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _HiCacheStorageBase

    SGLANG_BASE_CLASS = True
    """True when this class subclasses sglang's own ``HiCacheStorage``."""
except ModuleNotFoundError as _err:  # sglang absent: the contract stand-in (tests without sglang)
    if _err.name is None or _err.name.split(".")[0] != "sglang":
        raise  # sglang is installed but broken: say so
    from ._contract import HiCacheStorageContract as _HiCacheStorageBase

    SGLANG_BASE_CLASS = False

logger = logging.getLogger(__name__)

EXTRA_CONFIG_KEYS: tuple[str, ...] = ("kvtier_config", "kvtier")
"""The extra-config keys this backend reads (others belong to SGLang)."""

_SGLANG_DEFAULTS: dict[str, Any] = {"tiers": {"hbm": {"enabled": False}}, "put_tier": "dram"}


class KVTierHiCacheStorage(_HiCacheStorageBase):
    """HiCache storage backed by kvtier's DRAM and SSD tiers.

    Thread-safe: SGLang calls it from its prefetch and write-back threads at
    once; the store serialises bookkeeping and copies run outside its lock.
    """

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        """Called once by SGLang's backend factory (``cls(storage_config, kwargs)``).
        Reads and validates the extra config; opens no store yet (that waits for
        :meth:`register_mem_pool_host`, which gives the page geometry). Raises
        :class:`~kvtier.errors.ConfigError` naming ``extra_config.<key>``."""
        self.storage_config = storage_config
        self.factory_kwargs = dict(kwargs or {})
        extra = getattr(storage_config, "extra_config", None) or {}
        if not isinstance(extra, Mapping):
            raise ConfigError("extra_config", extra, "must be a JSON object")
        self._config_path = extra.get("kvtier_config")
        if self._config_path is not None and not isinstance(self._config_path, str):
            raise ConfigError("extra_config.kvtier_config", self._config_path, "must be a path string")
        overrides = extra.get("kvtier", {})
        if not isinstance(overrides, Mapping):
            raise ConfigError("extra_config.kvtier", overrides, "must be an object of kvtier settings")
        self._overrides: Mapping[str, Any] = overrides
        self.store: TieredStore | None = None
        self._geometry: PoolGeometry | None = None
        self._pointers: PagePointers | None = None
        self.mem_pool_host: Any = None

    # ------------------------------------------------------------ lifecycle

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Called once by SGLang right after construction. Derives the page layout
        from the host pool and opens the store (warm restart: re-indexes the SSD
        directory). Raises ``ValueError`` for a pool kvtier cannot describe."""
        super().register_mem_pool_host(mem_pool_host)
        self._geometry = pool_geometry(mem_pool_host)
        if self.store is not None:
            raise RuntimeError("register_mem_pool_host called twice (or after I/O opened the store)")
        self._open(self._geometry)
        if hasattr(mem_pool_host, "get_page_buffer_meta"):
            self._pointers = PagePointers(mem_pool_host, self.store.layout.bytes_per_block)

    def close(self) -> None:
        """Close the store (syncs the SSD tier). Idempotent."""
        if self.store is not None:
            self.store.close()
            self.store = None

    def resolved_config(self, geometry: PoolGeometry | None = None) -> KVTierConfig:
        """The kvtier configuration this backend runs with (see the module docstring)."""
        sc = self.storage_config
        merged = _deep_merge(_SGLANG_DEFAULTS, self._overrides)
        if geometry is not None:
            lay = geometry.layout
            pool_layout = {"num_layers": lay.num_layers, "num_kv_heads": lay.num_kv_heads, "head_dim": lay.head_dim,
                           "dtype": lay.dtype, "block_size": lay.block_size, "arrangement": lay.arrangement}
            for name, value in (merged.get("layout") or {}).items():
                if pool_layout.get(name, value) != value:
                    raise ConfigError(f"extra_config.kvtier.layout.{name}", value,
                                      f"the SGLang host pool has {pool_layout[name]!r}; leave layout unset")
            merged = _deep_merge(merged, {"layout": pool_layout})
        model = getattr(sc, "model_name", None) or "default"
        pool_layout_name = geometry.pool_layout if geometry is not None else "unregistered"
        merged = _deep_merge(merged, {"namespace": {
            "model": f"{model}#sglang.{pool_layout_name}",
            "tp_rank": int(getattr(sc, "tp_rank", 0)), "tp_size": int(getattr(sc, "tp_size", 1)),
            "pp_rank": int(getattr(sc, "pp_rank", 0)),
        }})
        cfg = load_config(self._config_path, overrides=merged)
        if not cfg.ssd.enabled:
            return cfg
        rank_dir = (f"tp{getattr(sc, 'tp_rank', 0)}of{getattr(sc, 'tp_size', 1)}"
                    f"-pp{getattr(sc, 'pp_rank', 0)}of{getattr(sc, 'pp_size', 1)}-dp{getattr(sc, 'dp_rank', 0)}")
        ssd = {"path": os.path.join(cfg.ssd.path, rank_dir)}
        extra: dict[str, Any] = {"tiers": {"ssd": ssd}}
        if "write_through" not in self._overrides:
            extra["write_through"] = True
        return load_config(self._config_path, overrides=_deep_merge(merged, extra))

    def _open(self, geometry: PoolGeometry | None) -> TieredStore:
        self.store = TieredStore(self.resolved_config(geometry))
        logger.info("kvtier HiCache storage: %s, tiers %s", self.store.layout.describe(),
                    ", ".join(self.store.manager.tier_names))
        return self.store

    def _require_store(self) -> TieredStore:
        if self.store is None:  # I/O before registration: layout from the kvtier config alone
            return self._open(None)
        return self.store

    # ------------------------------------------------------------ keys

    def kvtier_key(self, page_key: str) -> BlockKey:
        """The kvtier key of one SGLang page key (namespace-scoped, parent-free)."""
        return foreign_key(self._require_store().namespace, None, page_key)

    def _keys(self, page_keys: Sequence[str]) -> list[BlockKey]:
        ns = self._require_store().namespace
        return [foreign_key(ns, None, k) for k in page_keys]

    def _parent(self, extra_info: Any) -> BlockKey | None:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        return self.kvtier_key(prefix[-1]) if prefix else None

    # ------------------------------------------------------------ exists

    def exists(self, key: str) -> bool:
        """Whether page ``key`` is readable in some tier. Side-effect free."""
        store = self._require_store()
        return store.readable_prefix([self.kvtier_key(key)]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading ``keys`` readable in some tier, the remote tier shared
        by engines included (SGLang's hit query, called on the prefetch thread).
        Side-effect free."""
        return self._require_store().readable_prefix(self._keys(keys))

    # ------------------------------------------------------------ generic path

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Read page ``key`` into ``target_location`` (a contiguous tensor of one
        page, e.g. the host pool's dummy flat page) or a new uint8 tensor.
        Returns the tensor, or ``None`` on a miss or a value that did not verify."""
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        """One tensor (``target_locations[i]`` filled, or a new uint8 page) or
        ``None`` per key. Keys after a miss are still tried one by one."""
        store = self._require_store()
        bpb = store.layout.bytes_per_block
        outs = list(target_locations) if target_locations is not None else [None] * len(keys)
        outs = [o if o is not None else torch.empty(bpb, dtype=torch.uint8) for o in outs]
        oks = self._load_each(store, self._keys(keys), outs)
        return [o if ok else None for o, ok in zip(outs, oks)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one page (``value``: a contiguous tensor of one page). ``True``
        when the page is stored or was already there."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store pages ``values[i]`` under ``keys[i]`` (a chain, in order). ``True``
        only when every page is now readable."""
        if values is None or len(values) != len(keys):
            raise ValueError(f"batch_set: {len(keys)} keys but {0 if values is None else len(values)} values")
        return all(self._store_pages(keys, list(values), None))

    # ------------------------------------------------------------ zero-copy path

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read pages straight into the host pool at ``host_indices``
        (``page_size`` slots per key). One bool per key; a page whose value is
        missing or does not verify is ``False`` and its host slots hold nothing
        meaningful."""
        store, pages = self._pages(keys, host_indices)
        if not keys:
            return []
        direct = [regions[0] if len(regions) == 1 else None for regions in pages]
        outs = [d if d is not None else torch.empty(store.layout.bytes_per_block, dtype=torch.uint8) for d in direct]
        oks = self._load_each(store, self._keys(keys), outs)
        for ok, d, out, regions in zip(oks, direct, outs, pages):
            if ok and d is None:
                scatter(out, regions)
        return oks

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Write the host pool's pages at ``host_indices`` under ``keys`` (a chain
        that follows ``extra_info.prefix_keys``). One bool per key: readable now."""
        store, pages = self._pages(keys, host_indices)
        if not keys:
            return []
        bpb = store.layout.bytes_per_block
        blocks = [regions[0] if len(regions) == 1 else gather(regions, torch.empty(bpb, dtype=torch.uint8))
                  for regions in pages]
        return self._store_pages(keys, blocks, self._parent(extra_info))

    # ------------------------------------------------------------ stats

    def kvtier_stats(self) -> dict[str, Any]:
        """The store's tiers, hit/miss counters and SSD counters."""
        return self._require_store().stats()

    # ------------------------------------------------------------ internals

    def _pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> tuple[TieredStore, list[list[torch.Tensor]]]:
        store = self._require_store()
        if self._pointers is None:
            raise RuntimeError("the zero-copy interface needs register_mem_pool_host() with a host pool first")
        page_size = store.layout.block_size
        if host_indices.numel() != len(keys) * page_size:
            raise ValueError(f"host_indices has {host_indices.numel()} slots for {len(keys)} keys "
                             f"of page_size {page_size}")
        return store, (self._pointers.pages(host_indices, len(keys)) if keys else [])

    def _store_pages(self, keys: Sequence[str], blocks: list[Any], parent: BlockKey | None) -> list[bool]:
        store = self._require_store()
        kkeys = self._keys(keys)
        store.put(kkeys, blocks, parent)
        return [store.contains_prefix([k]).num_blocks == 1 for k in kkeys]

    @staticmethod
    def _load_each(store: TieredStore, kkeys: list[BlockKey], outs: list[Any]) -> list[bool]:
        """Load every key it can: the readable run, then past each miss."""
        oks = [False] * len(kkeys)
        i = 0
        while i < len(kkeys):
            n = store.get(kkeys[i:], outs[i:])
            for j in range(i, i + n):
                oks[j] = True
            i += n + 1  # skip the miss
        return oks


def _deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
