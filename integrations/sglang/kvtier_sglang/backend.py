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

Pools (SGLang's v2 interface, hybrid and DeepSeek caches). The KV pool is the
host pool of ``register_mem_pool_host``; every side pool registered through
``register_mem_host_pool_v2`` (``swa``, ``mamba``, ``indexer``, ...) gets a
store of its own (its page size, its namespace ``<model>#sglang.<layout>.<pool>``,
its SSD subdirectory ``<rank dir>.<pool>``), and its pages are its host pool's
flat data pages, keyed by the KV page key they belong to.

One writer (MLA). Under a rank-replicated model (``is_mla_model``) SGLang lets
one rank write the replicated pools (:func:`~kvtier_sglang.pools.is_storage_writer`);
this backend keys those pools without the TP rank (the DCP shard stays in),
so every rank computes the same keys, and on a non-writer rank it stores
nothing (sets return ``False``) and opens no SSD directory: it reads what the
writer stored through a store the ranks share (``tiers.remote``). TP-sharded
pools (``mamba``, head-sharded MHA pools) stay per rank.
"""

from __future__ import annotations

import functools
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
from .pools import (
    HIT_POLICIES,
    KV_POOL,
    PoolHits,
    flat_page_geometry,
    fold_pool_hits,
    is_storage_writer,
    pool_id,
    rank_replicated,
)

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _HiCacheStorageBase
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

    SGLANG_BASE_CLASS = True
    """True when this class subclasses sglang's own ``HiCacheStorage``."""
except ModuleNotFoundError as _err:  # sglang absent: the contract stand-in (tests without sglang)
    if _err.name is None or _err.name.split(".")[0] != "sglang":
        raise  # sglang is installed but broken: say so
    from ._contract import HiCacheStorageContract as _HiCacheStorageBase
    from ._contract import PoolName, PoolTransferResult

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
        self.is_mla_model = bool(getattr(storage_config, "is_mla_model", False))
        self.is_storage_writer = is_storage_writer(storage_config)
        """This rank writes the rank-replicated pools (SGLang's MLA one-writer rule)."""
        self._side_pools: dict[str, Any] = {}  # pool -> host pool (register_mem_host_pool_v2)
        self._side_stores: dict[str, TieredStore] = {}  # pool -> its store

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
        self._warn_unshared_reader(KV_POOL, self.store)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Called by SGLang's hybrid controller once per side pool (``swa``,
        ``mamba``, ``indexer``, ...; sidecars added later come the same way).
        Opens the pool's store. The ``kv`` entry is the pool of
        :meth:`register_mem_pool_host` and is served by its store. Raises
        ``ValueError`` naming the pool when its host pool has no flat data
        pages, or when a name comes back with another page size."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = pool_id(host_pool_name)
        if name == KV_POOL:
            return
        geometry = flat_page_geometry(name, host_pool, str(getattr(host_pool, "layout", "flat")))
        old = self._side_stores.get(name)
        if old is not None:
            if old.layout != geometry.layout:
                raise ValueError(f"host pool {name!r} registered again with {geometry.layout.describe()} pages; "
                                 f"its store holds {old.layout.describe()}")
            self._side_pools[name] = host_pool
            return
        store = TieredStore(self.resolved_config(geometry, pool=name, host_pool=host_pool))
        self._side_pools[name], self._side_stores[name] = host_pool, store
        logger.info("kvtier HiCache storage, pool %s: %s, tiers %s", name, store.layout.describe(),
                    ", ".join(store.manager.tier_names))
        self._warn_unshared_reader(name, store)

    def close(self) -> None:
        """Close every pool's store (syncs the SSD tiers). Idempotent."""
        if self.store is not None:
            self.store.close()
            self.store = None
        for store in self._side_stores.values():
            store.close()
        self._side_stores.clear()

    def writes_pool(self, pool: str = KV_POOL) -> bool:
        """Whether this rank stores pool ``pool``'s pages: always, except a
        rank-replicated pool on a rank that is not SGLang's storage writer."""
        return self.is_storage_writer or not self._replicated(pool)

    def _replicated(self, pool: str, host_pool: Any = None) -> bool:
        if host_pool is None:
            host_pool = self.mem_pool_host if pool == KV_POOL else self._side_pools.get(pool)
        return rank_replicated(pool, host_pool, self.is_mla_model)

    def _warn_unshared_reader(self, pool: str, store: TieredStore) -> None:
        if not self.writes_pool(pool) and not store.config.remote.enabled:
            logger.warning("kvtier HiCache storage, pool %s: this rank is not SGLang's storage writer "
                           "(is_mla_model, tp_rank=%s) and stores nothing; without tiers.remote (a store the "
                           "ranks share) it finds no pages of this pool", pool,
                           getattr(self.storage_config, "tp_rank", 0))

    def resolved_config(self, geometry: PoolGeometry | None = None, pool: str = KV_POOL,
                        host_pool: Any = None) -> KVTierConfig:
        """The kvtier configuration of pool ``pool``'s store (see the module docstring)."""
        sc = self.storage_config
        replicated = self._replicated(pool, host_pool)
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
        shard, rank_dir = _shard_identity(sc, replicated)
        merged = _deep_merge(merged, {"namespace": {
            "model": f"{model}#sglang.{pool_layout_name}{shard}",
            "tp_rank": int(getattr(sc, "dcp_rank", 0)) if replicated else int(getattr(sc, "tp_rank", 0)),
            "tp_size": int(getattr(sc, "dcp_size", 1)) if replicated else int(getattr(sc, "tp_size", 1)),
            "pp_rank": int(getattr(sc, "pp_rank", 0)),
        }})
        if replicated and not self.is_storage_writer:  # reads only: no SSD directory of its own
            merged = _deep_merge(merged, {"tiers": {"ssd": {"enabled": False}}})
        cfg = load_config(self._config_path, overrides=merged)
        if not cfg.ssd.enabled:
            return cfg
        if pool != KV_POOL:
            rank_dir += f".{pool}"
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

    def _parent(self, extra_info: Any, store: TieredStore | None = None) -> BlockKey | None:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        if not prefix:
            return None
        return foreign_key((store or self._require_store()).namespace, None, prefix[-1])

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
        when the page is stored or was already there; ``False`` on a rank that
        does not write this pool (:meth:`writes_pool`)."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store pages ``values[i]`` under ``keys[i]`` (a chain, in order). ``True``
        only when every page is now readable."""
        if values is None or len(values) != len(keys):
            raise ValueError(f"batch_set: {len(keys)} keys but {0 if values is None else len(values)} values")
        if not self.writes_pool(KV_POOL):
            return False
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
        that follows ``extra_info.prefix_keys``). One bool per key: readable now
        (all ``False`` on a rank that does not write this pool: :meth:`writes_pool`)."""
        store, pages = self._pages(keys, host_indices)
        if not keys:
            return []
        if not self.writes_pool(KV_POOL):
            return [False] * len(keys)
        bpb = store.layout.bytes_per_block
        blocks = [regions[0] if len(regions) == 1 else gather(regions, torch.empty(bpb, dtype=torch.uint8))
                  for regions in pages]
        return self._store_pages(keys, blocks, self._parent(extra_info))

    # ------------------------------------------------------------ v2 pools

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """The usable prefix of ``keys`` across the KV pool and each transfer's
        pool (SGLang's hybrid hit query, prefetch thread). A side pool's pages
        share the KV page keys; its ``hit_policy`` says which must exist:
        ``all_pages`` every page of the prefix, ``trailing_pages`` the last
        ``len(transfer.keys)``. Returns SGLang's ``PoolTransferResult``
        (usable prefix, each pool's own boundary, every restorable prefix
        length). Side-effect free. Raises ``ValueError`` naming a pool that
        was never registered or whose hit policy is not folded here."""
        transfers = list(pool_transfers or [])
        for t in transfers:
            policy = pool_id(t.hit_policy)
            if policy not in HIT_POLICIES:
                raise ValueError(f"batch_exists_v2: pool {pool_id(t.name)!r} has hit_policy {policy!r}; "
                                 f"kvtier folds {list(HIT_POLICIES)}")
            self._pool_store(t.name, "batch_exists_v2")
        kv_pages = self.batch_exists(keys, extra_info)
        hits = [PoolHits(t.name, pool_id(t.hit_policy), len(t.keys) if t.keys else 1,
                         self._present(self._pool_store(t.name, "batch_exists_v2"), keys[:kv_pages]))
                for t in transfers]
        folded = fold_pool_hits(PoolName.KV, kv_pages, hits)
        return PoolTransferResult(folded.kv_hit_pages, folded.pool_hit_pages, folded.restorable_prefix_pages)

    def batch_get_v2(self, transfers: list, extra_info: Any = None) -> dict:
        """Read each transfer's pages (``keys[i]`` into slots
        ``host_indices[i*page_size:(i+1)*page_size]`` of that pool's host pool).
        Returns ``{transfer.name: [bool per key]}``; a page that is missing or
        did not verify is ``False`` and its host slots are left untouched.
        Raises ``ValueError`` naming the pool for an unregistered pool or
        ``host_indices`` that do not hold ``page_size`` slots per key."""
        return {t.name: self._pool_io(t, extra_info, load=True) for t in transfers}

    def batch_set_v2(self, transfers: list, extra_info: Any = None) -> dict:
        """Write each transfer's pages from its pool's host pool under ``keys``
        (a chain after ``extra_info.prefix_keys``). Returns ``{transfer.name:
        [bool per key: readable now]}``; all ``False`` for a pool this rank
        does not write (:meth:`writes_pool`). Raises like :meth:`batch_get_v2`."""
        return {t.name: self._pool_io(t, extra_info, load=False) for t in transfers}

    def _pool_store(self, name: Any, call: str) -> TieredStore:
        pool = pool_id(name)
        if pool == KV_POOL:
            return self._require_store()
        store = self._side_stores.get(pool)
        if store is None:
            raise ValueError(f"{call}: pool {pool!r} was never registered (register_mem_host_pool_v2); "
                             f"registered: {[KV_POOL, *self._side_stores]}")
        return store

    def _pool_io(self, transfer: Any, extra_info: Any, load: bool) -> list[bool]:
        call = "batch_get_v2" if load else "batch_set_v2"
        pool = pool_id(transfer.name)
        store = self._pool_store(pool, call)
        keys = list(transfer.keys or [])
        host_pool = self.mem_pool_host if pool == KV_POOL else self._side_pools[pool]
        page_size = int(getattr(host_pool, "page_size", 1) or 1)
        indices = transfer.host_indices
        if indices is None or indices.numel() != len(keys) * page_size:
            got = "None" if indices is None else f"{indices.numel()} slots"
            raise ValueError(f"{call}: pool {pool!r}: host_indices has {got} for {len(keys)} keys of "
                             f"page_size {page_size}")
        if not keys:
            return []
        if pool == KV_POOL and self._pointers is not None:  # the same bytes and keys as v1
            return (self.batch_get_v1 if load else self.batch_set_v1)(keys, indices, extra_info)
        firsts = [int(i) for i in indices[::page_size].tolist()]
        if load:
            dummies = [host_pool.get_dummy_flat_data_page() for _ in keys]
            oks = self._load_each(store, self._pool_keys(store, keys), [_bytes_of(d) for d in dummies])
            for ok, first, dummy in zip(oks, firsts, dummies):
                if ok:
                    host_pool.set_from_flat_data_page(first, dummy)
            return oks
        if not self.writes_pool(pool):
            return [False] * len(keys)
        blocks = [_bytes_of(host_pool.get_data_page(first, flat=True)) for first in firsts]
        kkeys = self._pool_keys(store, keys)
        store.put(kkeys, blocks, self._parent(extra_info, store))
        return [store.contains_prefix([k]).num_blocks == 1 for k in kkeys]

    @staticmethod
    def _pool_keys(store: TieredStore, page_keys: Sequence[str]) -> list[BlockKey]:
        return [foreign_key(store.namespace, None, k) for k in page_keys]

    def _present(self, store: TieredStore, page_keys: Sequence[str]) -> list[bool]:
        """Whether each page is readable (side-effect free)."""
        return [store.readable_prefix([k]) == 1 for k in self._pool_keys(store, page_keys)]

    # ------------------------------------------------------------ stats

    def kvtier_stats(self, pool: str = KV_POOL) -> dict[str, Any]:
        """Pool ``pool``'s store: tiers, hit/miss counters and SSD counters."""
        return self._pool_store(pool, "kvtier_stats").stats()

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


def _shard_identity(sc: Any, replicated: bool) -> tuple[str, str]:
    """The namespace suffix and SSD directory of this rank's shard of a pool.

    A per-rank pool: ``tp<r>of<n>-pp<r>of<n>-dp<r>`` (TP rank in the
    namespace's own fields). A rank-replicated pool: no TP rank, so every rank
    has the same keys; under DCP the DCP shard, TP size and logical page size
    are part of it (SGLang's HiCacheFile keys the same fields). Under NSA
    context parallelism each CP rank holds its own slice: always in."""
    get = functools.partial(getattr, sc)
    pp = f"pp{get('pp_rank', 0)}of{get('pp_size', 1)}"
    suffix, cp = "", ""
    if int(get("attn_cp_size", 1) or 1) > 1:
        cp = f"-cp{get('attn_cp_rank', 0)}of{get('attn_cp_size', 1)}"
        suffix += f".cp{get('attn_cp_rank', 0)}of{get('attn_cp_size', 1)}"
    if not replicated:
        return suffix, f"tp{get('tp_rank', 0)}of{get('tp_size', 1)}-{pp}-dp{get('dp_rank', 0)}{cp}"
    dcp = int(get("dcp_size", 1) or 1)
    if dcp > 1:
        suffix += f".tp{get('tp_size', 1)}.page{get('logical_page_size', None)}"
    return ".replicated" + suffix, (f"replicated-dcp{get('dcp_rank', 0)}of{dcp}-{pp}-dp{get('dp_rank', 0)}{cp}")


def _bytes_of(page: torch.Tensor) -> torch.Tensor:
    """A flat data page as its bytes (a view when it is contiguous)."""
    return page.contiguous().reshape(-1).view(torch.uint8)


def _deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
