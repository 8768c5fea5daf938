"""The prefetch ledger: which moved blocks were prefetched, and how each prefetch ended.

Owns: per block, a prefetch (a move into a faster tier ahead of a read) in
flight, overtaken by a read of its keys, landed and not yet read; and the
counters of how each ended -- ``prefetch_on_time_blocks`` (landed before any
read of them started), ``prefetch_late_blocks`` (a read started first, or the
caller's deadline passed: discarded, its blocks never published in the faster
tier), ``prefetch_failed_blocks``, then ``prefetch_used_blocks`` (read from the
tier they landed in) or ``prefetch_wasted_blocks`` (left it unread). Must not
move bytes or take a lock: :class:`~kvtier.store.TieredStore` calls it under its own.

>>> from collections import Counter
>>> ledger = PrefetchLedger(Counter())
>>> ledger.started([1, 2], plan_id=7)
>>> ledger.settle(7, [1, 2], "dram", [True, True], late=False)
[True, True]
>>> ledger.read([1], ["dram"]); ledger.removed(2, "dram")
>>> sorted((k, n) for k, n in ledger.counters.items() if n)
[('prefetch_on_time_blocks', 2), ('prefetch_used_blocks', 1), ('prefetch_wasted_blocks', 1)]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ..keys import BlockKey


class PrefetchLedger:
    """Prefetched blocks and their outcomes (see the module doc); ``counters`` is the owner's."""

    def __init__(self, counters: Counter[str]) -> None:
        self.counters = counters
        self._in_flight: dict[BlockKey, int] = {}  # key -> plan id of its prefetch in flight
        self._overtaken: set[int] = set()  # prefetch plans a read overtook (discarded on completion)
        self._landed: dict[BlockKey, str] = {}  # prefetched, not yet read: key -> tier

    def started(self, keys: Sequence[BlockKey], plan_id: int) -> None:
        for k in keys:
            self._in_flight[k] = plan_id

    def overtaken(self, keys: Sequence[BlockKey]) -> None:
        """A read of ``keys`` started: prefetches of them still in flight are late."""
        if self._in_flight:
            for k in keys:
                pid = self._in_flight.get(k)
                if pid is not None:
                    self._overtaken.add(pid)

    def settle(self, plan_id: int, keys: Sequence[BlockKey], tier: str, oks: list[bool], late: bool) -> list[bool]:
        """Plan ``plan_id`` (``keys`` into ``tier``) finished with ``oks``; ``late``: past the
        caller's deadline. Returns what the plan completes with: all failed when late."""
        late = late or plan_id in self._overtaken
        self._overtaken.discard(plan_id)
        for k in keys:
            if self._in_flight.get(k) == plan_id:
                del self._in_flight[k]
        if late:
            self.counters["prefetch_late_blocks"] += len(keys)
            return [False] * len(keys)
        self.counters["prefetch_on_time_blocks"] += oks.count(True)
        self.counters["prefetch_failed_blocks"] += oks.count(False)
        for k, ok in zip(keys, oks):
            if ok:
                self._landed[k] = tier
        return oks

    def any_landed(self) -> bool:
        """Whether a prefetched block waits to be read (when not, :meth:`read` has nothing to do)."""
        return bool(self._landed)

    def read(self, keys: Sequence[BlockKey], tiers: Sequence[str]) -> None:
        """``keys[i]`` was read from ``tiers[i]``: a prefetched one was used."""
        if self._landed:
            for k, t in zip(keys, tiers):
                if self._landed.get(k) == t:
                    del self._landed[k]
                    self.counters["prefetch_used_blocks"] += 1

    def removed(self, key: BlockKey, tier: str) -> None:
        """``key`` left ``tier``: wasted if it was prefetched there and never read."""
        if self._landed.get(key) == tier:
            del self._landed[key]
            self.counters["prefetch_wasted_blocks"] += 1
