"""What the scheduler's tier manager reports after each change: SSD deletions for the
workers and KV cache events for vLLM's publisher.

Owns: the SSD keys evicted since the last step's metadata (the workers delete their
values; the lossy record forgets them), and, with KV events on, what a
``BlockStored`` says of each planned block (vLLM hash, parent vLLM hash, token ids;
kept while a tier holds it or is storing it) and the events not yet taken:
``("stored", tier, hash, parent hash, token ids)``, parents first, or
``("removed", tier, hash)``. Must not plan, load or store anything, nor import
vLLM: the scheduler pumps it after each change to the manager and hands the
events on (:meth:`~.scheduler.KVTierScheduler.take_kv_events`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvtier.events import BlockRemoved, BlockStored, StoreFailed
from kvtier.keys import BlockKey
from kvtier.manager import TierManager
from kvtier.tiers.lossy import LossyCopies

EventMeta = tuple[Any, Any, list[int]]
"""What a block's ``BlockStored`` event says: (vLLM hash, parent vLLM hash, token ids)."""


class TierEvents:
    """The manager's events read (see the module doc). ``enabled``: KV cache events
    are kept for vLLM (SSD deletions are read either way)."""

    def __init__(self, manager: TierManager, lossy: LossyCopies, counters: Counter[str], block_size: int,
                 enabled: bool) -> None:
        self.manager = manager
        self.lossy = lossy
        self.counters = counters
        self.block_size = block_size
        self.enabled = enabled
        self.meta: dict[BlockKey, EventMeta] = {}
        self._events: list[tuple[Any, ...]] = []
        self._ssd_deletes: list[int] = []

    def pump(self) -> None:
        """Read the manager's events since the last call."""
        stored: list[tuple[Any, ...]] = []
        for event in self.manager.take_events():
            if isinstance(event, BlockRemoved) and event.tier == "ssd":
                self._ssd_deletes.append(int(event.key))
                self.lossy.forget_value(event.key, "ssd")  # gone: a later computation of it may be stored
                self.lossy.forget_copy(event.key)
                self.counters["ssd_deleted_blocks"] += 1
            if self.enabled and isinstance(event, (BlockStored, BlockRemoved)):
                self._kv_event(event, stored)
            elif self.enabled and isinstance(event, StoreFailed):
                self.forget_if_gone(event.key)
        if stored:
            self._events += parents_first(stored)

    def take_ssd_deletes(self) -> list[int]:
        """The SSD keys evicted since the last call (the workers delete their values)."""
        out, self._ssd_deletes = self._ssd_deletes, []
        return out

    def take(self) -> list[tuple[Any, ...]]:
        """KV cache events since the last call (see :meth:`_kv_event`); empty unless ``enabled``."""
        self.pump()
        events, self._events = self._events, []
        return events

    def note_meta(self, request: Any, keys: list[BlockKey], start: int, upto: int) -> None:
        """Remember what a KV event of blocks ``start:upto`` of ``request`` says (no prompt
        text leaves the engine: vLLM's own events carry these token ids too)."""
        hashes, tokens, bs = request.block_hashes, request.all_token_ids, self.block_size
        for i in range(start, upto):
            if keys[i] not in self.meta:
                self.meta[keys[i]] = (hashes[i], hashes[i - 1] if i else None, list(tokens[i * bs : (i + 1) * bs]))

    def meta_of(self, keys: Sequence[BlockKey]) -> list[EventMeta | None]:
        """The event metadata of ``keys`` (a remote write's); empty unless ``enabled``."""
        return [self.meta.get(k) for k in keys] if self.enabled else []

    def remote_stored(self, meta: list[EventMeta | None], oks: list[bool]) -> None:
        """A remote write's blocks every worker stored, as events (medium STORAGE, locality REMOTE)."""
        if self.enabled:
            stored = [("stored", "remote", *m) for m, ok in zip(meta, oks) if ok and m is not None]
            self._events += parents_first(stored)

    def _kv_event(self, event: BlockStored | BlockRemoved, stored: list[tuple[Any, ...]]) -> None:
        """One manager event of the DRAM or SSD tier as a KV cache event for vLLM:
        ``("stored", tier, hash, parent hash, token ids)`` (into ``stored``, ordered
        parents first by the caller) or ``("removed", tier, hash)``. Blocks without
        a vLLM hash (re-indexed from an earlier run's SSD) have none."""
        meta = self.meta.get(event.key)
        if meta is None or event.tier not in ("dram", "ssd"):
            return
        if isinstance(event, BlockStored):
            stored.append(("stored", event.tier, *meta))
            return
        self._events.append(("removed", event.tier, meta[0]))
        self.forget_if_gone(event.key)

    def forget_if_gone(self, key: BlockKey) -> None:
        """Drop a block's event metadata once no tier holds it or is storing it."""
        m = self.manager
        if not m.tiers_of(key) and not any(m.is_pending(key, t) for t in m.tier_names):
            self.meta.pop(key, None)


def parents_first(stored: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``("stored", tier, hash, parent, ...)`` events reordered so that a block comes
    after its parent when both are in the list (the manager reports a chain tail
    first; a router indexing by parent needs the parent first). O(n)."""
    present = {(e[1], e[2]) for e in stored}
    children: dict[tuple[str, Any], list[tuple[Any, ...]]] = {}
    roots = []
    for e in stored:
        if (e[1], e[3]) in present:
            children.setdefault((e[1], e[3]), []).append(e)
        else:
            roots.append(e)
    out, todo = [], roots[::-1]
    while todo:
        e = todo.pop()
        out.append(e)
        todo.extend(children.pop((e[1], e[2]), [])[::-1])
    return out + [e for kids in children.values() for e in kids]  # a cycle cannot happen; kept, not lost
