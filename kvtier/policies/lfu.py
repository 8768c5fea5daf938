"""Least-frequently-used eviction (SGLang's LFU order).

Owns: the hit count of each resident block since it became resident, and the
order ``(hits, last access)``: fewest hits first, ties broken by the least
recent insert-or-hit. Blocks sit in one bucket per hit count; each bucket is
ordered by last access, because a block always enters a bucket as its most
recent member. A sorted list holds the non-empty hit counts.

Complexity, with ``B`` the number of distinct hit counts among resident
blocks (small in practice): ``on_insert`` / ``on_access`` / ``on_remove``
are O(log B) plus an O(B) list shift when a bucket appears or empties;
``pop_victim`` is O(skipped + 1) plus one step per bucket passed.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from typing import Iterable

from ..keys import BlockKey
from .base import IsEvictable, Parking
from .registry import register_policy


@register_policy("lfu")
class LFUPolicy(Parking):
    """Evicts the block with the fewest hits, the least recently used among equals."""

    name = "lfu"

    def __init__(self, capacity_blocks: int) -> None:
        self._key_to_hits: dict[BlockKey, int] = {}
        self._hits_to_bucket: dict[int, OrderedDict[BlockKey, None]] = {}  # each oldest access first
        self._levels: list[int] = []  # sorted keys of _hits_to_bucket
        self._parked: dict[BlockKey, int] = {}  # held key -> its hit count

    def _detach(self, key: BlockKey) -> int:
        return self._leave(key)

    def _attach(self, key: BlockKey, hits: int, front: bool) -> None:
        self._enter(key, hits)
        if front:
            self._hits_to_bucket[hits].move_to_end(key, last=False)

    adapts_before_insert = False  # before_insert is a no-op: the manager skips the call

    def before_insert(self, key: BlockKey) -> None:
        """No history to adapt."""

    def on_insert(self, key: BlockKey) -> None:
        """Enter ``key`` with zero hits, as the most recent block."""
        self._enter(key, 0)

    def on_access(self, key: BlockKey) -> None:
        """Count a hit: move ``key`` to the next bucket, as its most recent member."""
        if key in self._parked:
            self._parked[key] += 1
            return
        hits = self._leave(key)
        self._enter(key, hits + 1)

    def on_access_many(self, keys: Iterable[BlockKey]) -> None:
        """``on_access`` for each of ``keys`` in order."""
        for key in keys:
            self.on_access(key)

    def on_remove(self, key: BlockKey) -> None:
        """Forget ``key``."""
        if not self._forget_parked(key):
            self._leave(key)

    def pop_victim(self, is_evictable: IsEvictable, incoming: BlockKey | None = None) -> BlockKey | None:
        """Forget and return the first evictable key in ``(hits, last access)`` order, or ``None``."""
        for hits in list(self._levels):
            bucket = self._hits_to_bucket[hits]
            for _ in range(len(bucket)):
                key = next(iter(bucket))
                if is_evictable(key):
                    self._leave(key)
                    return key
                bucket.move_to_end(key)  # in use: counts as most recent of its level
        return None

    def __len__(self) -> int:
        return len(self._key_to_hits) + len(self._parked)

    def check_invariants(self) -> None:
        """Buckets, levels and the hit map describe the same blocks."""
        assert self._levels == sorted(self._hits_to_bucket), self._levels
        assert all(self._hits_to_bucket.values()), "empty bucket kept"
        total = sum(len(bucket) for bucket in self._hits_to_bucket.values())
        assert total == len(self._key_to_hits), (total, len(self._key_to_hits))
        for key, hits in self._key_to_hits.items():
            assert key in self._hits_to_bucket[hits], (key, hits)
        assert not (self._parked.keys() & self._key_to_hits.keys()), "a key is both parked and idle"

    def _enter(self, key: BlockKey, hits: int) -> None:
        bucket = self._hits_to_bucket.get(hits)
        if bucket is None:
            bucket = self._hits_to_bucket[hits] = OrderedDict()
            self._levels.insert(bisect_left(self._levels, hits), hits)
        bucket[key] = None
        self._key_to_hits[key] = hits

    def _leave(self, key: BlockKey) -> int:
        hits = self._key_to_hits.pop(key)
        bucket = self._hits_to_bucket[hits]
        del bucket[key]
        if not bucket:
            del self._hits_to_bucket[hits]
            del self._levels[bisect_left(self._levels, hits)]
        return hits
