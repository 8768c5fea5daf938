"""Where the variable-size diff values of mirrors live, per tier.

Owns: keeping diff values by key — in host memory for the ``hbm`` / ``dram``
tiers (a dict of immutable ``bytes``; the index budgets their size) and in
an LMDB environment for ``ssd`` (one value per key, one transaction per
call). Must not decode, verify or decide anything: values are opaque here,
and a missing value is ``None``.
"""

from __future__ import annotations

import os
from hashlib import blake2b
from typing import Protocol

import lmdb

from ..errors import StorageError
from ..keys import KEY_BYTES, BlockKey, key_to_bytes
from .segments import SegmentKey


def diff_key(seg: SegmentKey, agent: str) -> bytes:
    """Storage key of ``agent``'s mirror diff of segment ``seg`` (16 bytes)."""
    return blake2b(b"kvtier.diff.v1" + key_to_bytes(BlockKey(seg)) + agent.encode(), digest_size=KEY_BYTES).digest()


class DiffValues(Protocol):
    def get(self, key: bytes) -> bytes | None: ...
    def put(self, key: bytes, value: bytes) -> bool: ...
    def delete(self, key: bytes) -> None: ...
    def close(self) -> None: ...


class MemoryDiffValues:
    """Diff values in host memory (``dram`` and ``hbm`` tiers)."""

    def __init__(self) -> None:
        self._values: dict[bytes, bytes] = {}

    def get(self, key: bytes) -> bytes | None:
        return self._values.get(key)

    def put(self, key: bytes, value: bytes) -> bool:
        self._values[key] = bytes(value)
        return True

    def delete(self, key: bytes) -> None:
        self._values.pop(key, None)

    def close(self) -> None:
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)


class LmdbDiffValues:
    """Diff values in an LMDB environment (``ssd`` tier). A full map makes ``put``
    return ``False`` (the mirror is then not stored); a directory that cannot be
    opened raises ``StorageError`` naming ``shared.ssd_path``."""

    def __init__(self, path: str, map_size_bytes: int = 4 << 30, sync: bool = False) -> None:
        try:
            os.makedirs(path, exist_ok=True)
            self._env = lmdb.open(path, map_size=map_size_bytes, subdir=True, sync=sync, metasync=sync)
        except (lmdb.Error, OSError) as exc:
            raise StorageError(f"shared.ssd_path={path!r}: cannot open the diff LMDB: {exc}") from exc

    def get(self, key: bytes) -> bytes | None:
        with self._env.begin() as txn:
            return txn.get(key)

    def put(self, key: bytes, value: bytes) -> bool:
        try:
            with self._env.begin(write=True) as txn:
                txn.put(key, value)
        except lmdb.MapFullError:
            return False
        return True

    def delete(self, key: bytes) -> None:
        with self._env.begin(write=True) as txn:
            txn.delete(key)

    def close(self) -> None:
        self._env.close()
