"""Eviction by next use: evict the resident block whose next use is farthest away.

Owns: the eviction order over an *estimate* of each block's next use (a lazy
max-heap). The estimate is the caller's: the offline oracle of a replay
(Belady, :mod:`kvtier.replay.belady`) or the hint plane's predictions of
when each agent comes back (:mod:`kvtier.placement.nextuse`). Must not
compute next uses itself. Not registered by name: it needs an estimate, which
no registry factory has; the owner passes the object in a ``TierSpec``.

The estimate provides ``next_use(key, unknown=None) -> float`` (``inf``:
never; ``unknown``: the value to give a block the estimate knows nothing
about, in place of its default: a held block coming back keeps its rank),
``depth(key) -> int`` (position in its chain; ties evict the deeper block
first, so prefixes outlive their tails) and ``clock`` (now, in the unit of
``next_use``). An entry whose next use has passed is refreshed once per
victim search: an overdue use is imminent, or the estimate moved it.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Protocol

from ..keys import BlockKey
from .base import IsEvictable

NEVER = float("inf")


class NextUseEstimate(Protocol):
    clock: float

    def next_use(self, key: BlockKey, unknown: float | None = None) -> float: ...

    def depth(self, key: BlockKey) -> int: ...


class NextUsePolicy:
    """Evicts the resident block with the farthest estimated next use."""

    name = "next-use"

    def __init__(self, estimate: NextUseEstimate) -> None:
        self._est = estimate
        self._next: dict[BlockKey, float] = {}  # resident idle key -> next use in its live heap entry
        self._heap: list[tuple[float, int, BlockKey]] = []  # (-next use, -depth, key)
        self._parked: dict[BlockKey, float] = {}  # held keys (out of the order) -> their next use when held
        self._front: set[BlockKey] = set()  # idle keys made next victims: no estimate refresh moves them back
        self._victim_was_front = False  # the last victim was one of them (its chain follows it)

    def _push(self, key: BlockKey, nu: float | None = None) -> None:
        if nu is None:
            nu = self._est.next_use(key)
        self._next[key] = nu
        heapq.heappush(self._heap, (-nu, -self._est.depth(key), key))

    def before_insert(self, key: BlockKey) -> None:
        pass

    def on_insert(self, key: BlockKey) -> None:
        self._push(key)

    def on_access(self, key: BlockKey) -> None:
        self._front.discard(key)
        if key not in self._parked:  # a parked key is re-pushed when it unparks
            self._push(key)

    def on_access_many(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            self.on_access(key)

    def refresh(self, keys: Iterable[BlockKey]) -> None:
        """The estimate of ``keys`` changed: re-order the idle ones among them (not
        those made next victims: a copy that a faster tier holds stays first in line)."""
        nxt, front = self._next, self._front
        for key in keys:
            if key in nxt and key not in front:
                self._push(key)

    def to_front(self, key: BlockKey) -> None:
        """Make an idle ``key`` the next victim until it is used again."""
        if key in self._next:
            self._front.add(key)
            self._push(key, NEVER)

    def on_remove(self, key: BlockKey) -> None:
        self._victim_was_front = False
        self._front.discard(key)
        if self._parked.pop(key, None) is None:
            del self._next[key]

    def on_hold(self, key: BlockKey) -> None:
        self._parked[key] = self._next.pop(key)  # its heap entry goes stale; its rank is kept

    def on_unhold(self, key: BlockKey, front: bool = False) -> None:
        """Back in the order. With ``front`` (its child, the chain's tail, was just
        evicted) a chain made next victims goes on being evicted tail to head;
        otherwise the key ranks by its own estimate, or, where the estimate knows
        nothing of it, by the rank it had when held (as a parked block keeps its
        place in LRU: an untagged chain's head must not become most recent
        because its tail was evicted)."""
        held_nu = self._parked.pop(key)
        if front and self._victim_was_front:
            self._front.add(key)
            self._push(key, NEVER)
        else:
            self._push(key, self._est.next_use(key, held_nu))

    def parked_keys(self) -> Iterable[BlockKey]:
        return self._parked.keys()

    def pop_victim(self, is_evictable: IsEvictable, incoming: BlockKey | None = None) -> BlockKey | None:
        heap, nxt, clock = self._heap, self._next, self._est.clock
        skipped: list[tuple[float, int, BlockKey]] = []
        refreshed: set[BlockKey] = set()
        victim = None
        while heap:
            entry = heapq.heappop(heap)
            neg_nu, _, key = entry
            if nxt.get(key) != -neg_nu:
                continue  # stale entry (re-pushed since, or removed)
            if -neg_nu <= clock and key not in refreshed:  # its next use has passed: refresh once, retry
                # Once only: an estimate can stay in the past (an overdue agent, a
                # session running behind its recorded self), and refreshing the heap's
                # top again and again would never end. The entry then competes with
                # the value it has: an overdue use is imminent.
                refreshed.add(key)
                self._push(key)
                continue
            if is_evictable(key):
                victim = key
                del nxt[key]
                self._victim_was_front = key in self._front
                self._front.discard(key)
                break
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(heap, entry)
        if len(heap) > 4 * len(nxt) + 64:  # drop stale entries now and then
            self._heap = [e for e in heap if nxt.get(e[2]) == -e[0]]
            heapq.heapify(self._heap)
        return victim

    def __len__(self) -> int:
        return len(self._next) + len(self._parked)

    def __contains__(self, key: object) -> bool:
        return key in self._next or key in self._parked

    def check_invariants(self) -> None:
        live = {e[2] for e in self._heap if self._next.get(e[2]) == -e[0]}
        assert live == set(self._next), "every resident key has a live heap entry"
