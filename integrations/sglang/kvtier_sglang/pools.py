"""SGLang's v2 pool interface, the parts that need neither sglang nor a store.

Owns: the rules the backend applies to SGLang's ``PoolTransfer`` calls
(``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``), each a small pure
function so the main venv tests them without sglang:

* :func:`pool_id` — a pool's plain name (``PoolName.SWA`` -> ``"swa"``);
* :func:`is_storage_writer` — SGLang's one-writer rule for rank-replicated
  (MLA) caches, as ``HiCacheStorageConfig.is_storage_writer`` states it;
* :func:`rank_replicated` — whether a pool's pages are the same on every TP
  rank (then one rank writes them and every rank reads them under one key);
* :func:`flat_page_geometry` — a side pool's page as an opaque byte block;
* :func:`fold_pool_hits` — ``batch_exists_v2``'s per-pool hit policies folded
  into the usable prefix, with HiCacheFile's semantics.

Must not touch bytes or tiers (:mod:`kvtier_sglang.backend` does, through
:class:`~kvtier.store.TieredStore`), and must not import sglang.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from kvtier.layout import KVLayout

from .pages import PoolGeometry

KV_POOL = "kv"
"""The anchor pool (``PoolName.KV``): the host pool of ``register_mem_pool_host``."""

MAMBA_POOL = "mamba"
"""Mamba/KDA state: TP-sharded even when the model's MLA KV is replicated."""

HIT_POLICIES: tuple[str, ...] = ("all_pages", "trailing_pages")
"""The ``PoolHitPolicy`` values this backend folds (``block_groups`` is refused)."""

_FLAT_PAGE_METHODS = ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page")


def pool_id(name: Any) -> str:
    """The plain string of a pool name (``PoolName`` members are ``str`` enums)."""
    return str(name.value) if isinstance(name, Enum) else str(name)


def is_storage_writer(storage_config: Any) -> bool:
    """Whether this rank writes rank-replicated pages.

    SGLang 0.5.23 (``HiCacheStorageConfig.is_storage_writer``, read by the
    cache controller's ``backup_skip``): "MLA replicas share one writer per DCP
    shard, in the first DCP group" — ``not is_mla_model or tp_rank ==
    dcp_rank``; without DCP (``dcp_rank == 0``) that is TP rank 0. The real
    config's own property wins when it has one; a config without it (the
    tests' stand-in) gets the same formula."""
    own = getattr(type(storage_config), "is_storage_writer", None)
    if isinstance(own, property):
        return bool(storage_config.is_storage_writer)
    if not getattr(storage_config, "is_mla_model", False):
        return True
    return int(getattr(storage_config, "tp_rank", 0)) == int(getattr(storage_config, "dcp_rank", 0))


def rank_replicated(name: str, host_pool: Any, is_mla_model: bool) -> bool:
    """Whether pool ``name``'s pages are identical on every TP rank.

    Only under an MLA (rank-replicated) model, and then for every pool except
    the ones SGLang shards by rank: ``mamba`` (its controller backs it up on
    every rank: ``should_backup``) and any head-sharded MHA-style pool (it has
    ``head_num`` and no ``kv_lora_rank``). A replicated pool is written by the
    writer rank alone and keyed without the TP rank; a sharded one by every
    rank under its own key, so no rank can read another rank's shard."""
    if not is_mla_model or name == MAMBA_POOL:
        return False
    return not (hasattr(host_pool, "head_num") and not hasattr(host_pool, "kv_lora_rank"))


def flat_page_geometry(name: str, host_pool: Any, pool_layout: str) -> PoolGeometry:
    """A side pool's page as an opaque byte block: ``get_dummy_flat_data_page()``
    bytes, split into ``page_size`` tokens when they divide evenly. Raises
    ``ValueError`` naming the pool and the attribute it lacks."""
    for attr in ("page_size", *_FLAT_PAGE_METHODS):
        if not hasattr(host_pool, attr):
            raise ValueError(f"host pool {name!r} ({type(host_pool).__name__}) has no attribute {attr!r}; "
                             "kvtier stores side pools through their flat data pages")
    dummy = host_pool.get_dummy_flat_data_page()
    if not isinstance(dummy, torch.Tensor) or dummy.numel() == 0:
        raise ValueError(f"host pool {name!r}: get_dummy_flat_data_page() gave no bytes")
    page_bytes = dummy.numel() * dummy.element_size()
    page_size = int(host_pool.page_size) or 1
    tokens = page_size if page_bytes % page_size == 0 else 1
    # one opaque "latent" of page_bytes / tokens bytes per token: exactly page_bytes per block
    layout = KVLayout(1, 1, page_bytes // tokens, "uint8", tokens, arrangement="mla")
    return PoolGeometry(layout, f"{pool_layout}.{name}")


@dataclass(frozen=True, slots=True)
class PoolHits:
    """One side pool's presence for ``batch_exists_v2``: ``present[i]`` for KV
    page ``i`` of the KV hit (the pool's pages share the KV page keys)."""

    name: Any
    hit_policy: str
    trailing_pages: int
    present: Sequence[bool]


@dataclass(frozen=True, slots=True)
class FoldedHits:
    """``kv_hit_pages``: the usable prefix (every pool restorable there);
    ``pool_hit_pages``: each pool's own boundary, absent when 0;
    ``restorable_prefix_pages``: every prefix length all pools can restore."""

    kv_hit_pages: int
    pool_hit_pages: dict[Any, int]
    restorable_prefix_pages: list[int]


def fold_pool_hits(kv_name: Any, kv_pages: int, pools: Sequence[PoolHits]) -> FoldedHits:
    """Fold per-pool presence into the usable prefix (HiCacheFile's semantics).

    ``all_pages``: pool pages ``[0, n)`` must all exist for prefix ``n``;
    ``trailing_pages``: only the last ``trailing_pages`` pages before ``n``
    (SWA windows, Mamba states). A prefix is restorable when every pool can
    restore it; ``kv_hit_pages`` is the longest such prefix.

    >>> f = fold_pool_hits("kv", 4, [PoolHits("mamba", "trailing_pages", 1, [False, True, False, True])])
    >>> f.kv_hit_pages, f.restorable_prefix_pages, f.pool_hit_pages
    (4, [2, 4], {'kv': 4, 'mamba': 4})
    """
    hits: dict[Any, int] = {kv_name: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for pool in pools:
        if not restorable:
            break
        present = list(pool.present[:kv_pages])
        if pool.hit_policy == "all_pages":
            boundary = present.index(False) if False in present else kv_pages
            ok = set(range(1, boundary + 1))
        elif pool.hit_policy == "trailing_pages":
            window = max(1, pool.trailing_pages)
            ok = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - window):n])}
            boundary = max(ok, default=0)
        else:
            raise ValueError(f"batch_exists_v2: pool {pool_id(pool.name)!r} has hit_policy {pool.hit_policy!r}; "
                             f"kvtier folds {list(HIT_POLICIES)}")
        if boundary:
            hits[pool.name] = boundary
        restorable = [n for n in restorable if n in ok]
    return FoldedHits(restorable[-1] if restorable else 0, hits, restorable)
