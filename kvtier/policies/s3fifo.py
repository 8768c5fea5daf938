"""S3-FIFO eviction (Yang et al., SOSP'23).

Owns: three FIFO queues over one tier: a small queue ``S`` (a share of
``c // 10`` blocks, at least 1) that filters one-hit wonders, a main queue
``M``, and a ghost queue ``G`` of keys recently evicted from ``S`` (as many as
``M``'s share, ``c - c // 10``), plus a 2-bit hit counter per resident block
(capped at 3).

A new key enters ``S``, or ``M`` if ``G`` still remembers it once room has
been made (the paper's order; libCacheSim looks ``G`` up first). To evict: when
``|S|`` has reached its share (or ``M`` is empty), take the tail of ``S``: a
key hit more than once moves to ``M`` with its counter reset, the next one
is tried; else it is evicted into ``G``. Otherwise take the tail of ``M``: a
key with hits is reinserted at the head with one hit less; else it is
evicted. A key that ``is_evictable`` refuses gets the same second chance
(reinserted at the head of its queue); once a whole queue has been refused
the other queue is tried, and ``None`` is returned when both are.

As in libCacheSim's S3FIFO (and unlike the paper's pseudo-code), moving a
key from ``S`` to ``M`` never evicts from ``M`` within the same call; ``M``
gives the room back at the next eviction.

O(1) hooks; ``pop_victim`` is O(moved + reinserted + skipped + 1), amortised
O(skipped + 1): every move to ``M`` and reinsertion in ``M`` spends hits
counted earlier.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from ..keys import BlockKey
from .base import IsEvictable, Parking
from .registry import register_policy

MAX_FREQ = 3
SMALL_RATIO = 0.1

_Queue = OrderedDict[BlockKey, None]  # a FIFO queue, tail (oldest) first


@register_policy("s3fifo")
class S3FIFOPolicy(Parking):
    """Quick demotion through a small FIFO, lazy promotion in a main FIFO."""

    name = "s3fifo"

    def __init__(self, capacity_blocks: int) -> None:
        self._small_capacity_blocks = max(1, capacity_blocks // 10)
        self._ghost_capacity_blocks = max(0, capacity_blocks - self._small_capacity_blocks)
        self._small: _Queue = OrderedDict()
        self._main: _Queue = OrderedDict()
        self._ghost: _Queue = OrderedDict()
        self._key_to_freq: dict[BlockKey, int] = {}
        self._parked: dict[BlockKey, tuple[bool, int]] = {}  # held key -> (in M, freq)

    def _detach(self, key: BlockKey) -> tuple[bool, int]:
        in_main = key in self._main
        del (self._main if in_main else self._small)[key]
        return in_main, self._key_to_freq.pop(key)

    def _attach(self, key: BlockKey, state: tuple[bool, int], front: bool) -> None:
        in_main, freq = state
        queue = self._main if in_main else self._small
        queue[key] = None
        if front:
            queue.move_to_end(key, last=False)
        self._key_to_freq[key] = freq

    def before_insert(self, key: BlockKey) -> None:
        """Nothing: the ghost is consulted at ``on_insert``, after eviction (as in the paper)."""

    def on_insert(self, key: BlockKey) -> None:
        """Enter ``key`` into ``M`` if the ghost remembers it, else into ``S``."""
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._key_to_freq[key] = 0

    def on_access(self, key: BlockKey) -> None:
        """Count a hit, saturating at 3."""
        if key in self._parked:
            in_main, freq = self._parked[key]
            self._parked[key] = (in_main, min(freq + 1, MAX_FREQ))
            return
        self._key_to_freq[key] = min(self._key_to_freq[key] + 1, MAX_FREQ)

    def on_access_many(self, keys: Iterable[BlockKey]) -> None:
        """``on_access`` for each of ``keys`` in order."""
        freq = self._key_to_freq
        for key in keys:
            if key in freq:
                freq[key] = min(freq[key] + 1, MAX_FREQ)
            else:
                self.on_access(key)

    def on_remove(self, key: BlockKey) -> None:
        """Forget ``key`` without remembering it in the ghost."""
        if self._forget_parked(key):
            return
        del self._key_to_freq[key]
        if key in self._small:
            del self._small[key]
        else:
            del self._main[key]

    def pop_victim(self, is_evictable: IsEvictable, incoming: BlockKey | None = None) -> BlockKey | None:
        """Forget and return the next victim of S3-FIFO's eviction, or ``None``."""
        if len(self._small) >= self._small_capacity_blocks or not self._main:
            victim = self._evict_small(is_evictable)
            return victim if victim is not None else self._evict_main(is_evictable)
        victim = self._evict_main(is_evictable)
        return victim if victim is not None else self._evict_small(is_evictable)

    def __len__(self) -> int:
        return len(self._small) + len(self._main) + len(self._parked)

    def check_invariants(self) -> None:
        """Queues are disjoint, counters cover exactly the residents, the ghost is bounded."""
        resident = self._small.keys() | self._main.keys()
        assert len(resident) + len(self._parked) == len(self), "S and M overlap"
        assert not (resident & self._parked.keys()), "a key is both parked and queued"
        assert resident == self._key_to_freq.keys(), "freq map != residents"
        assert not (resident & self._ghost.keys()), "resident key in ghost"
        assert len(self._ghost) <= self._ghost_capacity_blocks, len(self._ghost)
        assert all(0 <= f <= MAX_FREQ for f in self._key_to_freq.values())

    def _evict_small(self, is_evictable: IsEvictable) -> BlockKey | None:
        refused = 0
        while refused < len(self._small):
            key = next(iter(self._small))
            if self._key_to_freq[key] > 1:
                del self._small[key]
                self._main[key] = None
                self._key_to_freq[key] = 0
            elif is_evictable(key):
                del self._small[key]
                del self._key_to_freq[key]
                self._remember(key)
                return key
            else:
                self._small.move_to_end(key)
                refused += 1
        return None

    def _evict_main(self, is_evictable: IsEvictable) -> BlockKey | None:
        refused = 0
        while refused < len(self._main):
            key = next(iter(self._main))
            freq = self._key_to_freq[key]
            self._main.move_to_end(key)
            if freq > 0:
                self._key_to_freq[key] = freq - 1
                refused = 0
            elif is_evictable(key):
                del self._main[key]
                del self._key_to_freq[key]
                return key
            else:
                refused += 1
        return None

    def _remember(self, key: BlockKey) -> None:
        self._ghost[key] = None
        if len(self._ghost) > self._ghost_capacity_blocks:
            self._ghost.popitem(last=False)
