"""One :class:`~kvtier.tiers.ssd.SSDTier` per LMDB directory and process.

Owns: a process-wide, reference-counted table of open SSD tiers. LMDB allows
one environment per directory and process, and vLLM may run the scheduler
and a worker in the same process (in-process engine core, ``uni``
executor), where both halves of the connector need rank 0's directory: they
share the tier (reads are thread-safe, LMDB serializes writers). Must not
decide anything about the blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.keys import Namespace
from kvtier.layout import KVLayout

from .reftable import RefTable

_open = RefTable()  # resolved path -> tier


def acquire(path: Path, namespace: Namespace, layout: KVLayout, cfg: KVTierConfig) -> Any:
    """The SSD tier of ``path`` (opened on first use); pair with :func:`release`.
    Raises ``ValueError`` when the tier is already open for another namespace."""
    from kvtier.tiers.ssd import SSDTier

    def open_tier() -> Any:
        path.mkdir(parents=True, exist_ok=True)
        return SSDTier(path, namespace, layout, map_size_bytes=cfg.ssd.map_size_bytes, codec=cfg.ssd.codec,
                       zstd_level=cfg.ssd.zstd_level, sync=cfg.ssd.sync,
                       read_threads=cfg.ssd.read_threads, write_threads=cfg.ssd.write_threads)

    def same_namespace(tier: Any) -> None:
        if tier.namespace != namespace:
            raise ValueError(f"kvtier: SSD directory {str(path)!r} is already open for another namespace")

    return _open.acquire(path.resolve(), open_tier, same_namespace)


def release(tier: Any) -> None:
    """Drop one reference; the last one closes the tier."""
    _open.release(tier)
