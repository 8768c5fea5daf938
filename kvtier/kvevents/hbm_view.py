"""The engine's HBM, as a TierManager tier, kept from the engine's KV events.

Owns: turning engine block hashes into kvtier keys (chained exactly as the
vLLM connector does: ``foreign_key(namespace, parent key, engine hash)``) and
applying ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` of the
engine's device medium to the manager's ``hbm`` tier through its public
two-phase API. Must not open sockets or decide evictions: the engine already
did; give the manager's ``hbm`` tier the engine's number of GPU blocks so it
never has to evict on its own.

Keys match the connector's only when the events carry the engine's full hash
bytes: run vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (its default
publishes 64-bit truncations). A block whose parent hash was never seen is
counted in ``stats["orphan_blocks"]`` and not applied (no key is invented).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..keys import BlockKey, Namespace, foreign_key
from ..manager import TierManager
from .wire import MEDIUM_GPU, ExternalBlockHash, KVAllBlocksCleared, KVBlockRemoved, KVBlockStored, KVEventBatch


class EngineKeyMap:
    """Engine block hash → kvtier key, for the blocks currently known.

    O(1) per hash; holds one entry per block stored and not yet removed.
    """

    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self._keys: dict[ExternalBlockHash, BlockKey] = {}

    def chain(self, parent: ExternalBlockHash | None, hashes: Sequence[ExternalBlockHash]) -> list[BlockKey] | None:
        """Keys of ``hashes`` following ``parent`` (remembered); ``None`` when
        ``parent`` is not known."""
        if parent is None:
            prev = None
        else:
            prev = self._keys.get(parent)
            if prev is None:
                return None
        out = []
        for h in hashes:
            prev = self._keys.get(h) or foreign_key(self.namespace, prev, h)
            self._keys[h] = prev
            out.append(prev)
        return out

    def get(self, h: ExternalBlockHash) -> BlockKey | None:
        """The key of a known hash, or ``None``."""
        return self._keys.get(h)

    def pop(self, h: ExternalBlockHash) -> BlockKey | None:
        """Forget ``h``; its key, or ``None`` if unknown."""
        return self._keys.pop(h, None)

    def clear(self) -> list[BlockKey]:
        """Forget everything; the keys that were known."""
        keys = list(self._keys.values())
        self._keys.clear()
        return keys

    def __len__(self) -> int:
        return len(self._keys)


class HBMView:
    """Applies engine event batches to ``manager``'s ``tier`` (default ``hbm``).

    ``mediums``: the event mediums that describe the engine's device memory
    (vLLM 0.32 says ``"GPU"``; older versions ``None``). ``lock``: held around
    each batch, e.g. the lock that already guards the manager's owner.
    """

    def __init__(self, manager: TierManager, key_map: EngineKeyMap, *, tier: str = "hbm",
                 mediums: Sequence[str | None] = (MEDIUM_GPU, None), lock: contextlib.AbstractContextManager[Any] | None = None) -> None:
        if tier not in manager.tier_names:
            raise ValueError(f"tier {tier!r} is not enabled in the manager; enabled: {', '.join(manager.tier_names)}")
        self.manager = manager
        self.key_map = key_map
        self.tier = tier
        self._mediums = tuple(mediums)
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self.stats: Counter[str] = Counter()

    def apply(self, batch: KVEventBatch) -> None:
        """Apply every event of ``batch`` in order."""
        with self._lock:
            for event in batch.events:
                if isinstance(event, KVBlockStored) and event.medium in self._mediums:
                    self._stored(event)
                elif isinstance(event, KVBlockRemoved) and event.medium in self._mediums:
                    self._removed(event)
                elif isinstance(event, KVAllBlocksCleared):
                    self.stats["removed_blocks"] += self.manager.remove(self.key_map.clear(), self.tier)
                    self.stats["cleared"] += 1
                else:
                    self.stats["ignored_events"] += 1

    def _stored(self, event: KVBlockStored) -> None:
        keys = self.key_map.chain(event.parent_block_hash, event.block_hashes)
        if keys is None:
            self.stats["orphan_blocks"] += len(event.block_hashes)
            return
        parent = None if event.parent_block_hash is None else self.key_map.get(event.parent_block_hash)
        plan = self.manager.prepare_store(self.tier, keys, parent)
        if plan is None:
            self.stats["unplaced_blocks"] += len(keys)
            return
        self.manager.complete_store(plan, True)
        self.stats["stored_blocks"] += len(plan.keys)
        self.stats["unplaced_blocks"] += len(keys) - len(plan.keys) - len(plan.skipped)

    def _removed(self, event: KVBlockRemoved) -> None:
        keys = [k for k in map(self.key_map.pop, event.block_hashes) if k is not None]
        self.stats["unknown_removed"] += len(event.block_hashes) - len(keys)
        self.stats["removed_blocks"] += self.manager.remove(keys, self.tier)
