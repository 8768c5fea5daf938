"""Belady's offline-optimal eviction for replay: evict the block used farthest in the future.

Owns: the next-use oracle built from a recorded order of requests, and an
eviction policy over it (the bound no online policy can beat on the same
request order). Offline only: it needs the future, so it is never registered
for live use. Ties (same next use) evict the deeper block of a chain first,
so prefixes outlive their tails, as the manager's tail-first rule expects.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Hashable, Sequence

from ..keys import BlockKey
from ..policies.nextuse import NEVER, NextUsePolicy


class NextUseOracle:
    """Positions at which every block is used, in a recorded request order.

    ``order`` lists ``(request id, block keys, time served)`` in the order
    requests were served by a first pass; :meth:`advance` moves the clock to a
    request's position in it. When the replay serves requests in the recorded
    order (one session at a time) the oracle is exact.
    """

    def __init__(self, order: Sequence[tuple[Hashable, Sequence[BlockKey], float]]) -> None:
        uses: dict[BlockKey, list[int]] = {}
        depth: dict[BlockKey, int] = {}
        self._position: dict[Hashable, int] = {}
        for pos, (request_id, keys, _) in enumerate(order):
            self._position[request_id] = pos
            for d, key in enumerate(keys):
                lst = uses.get(key)
                if lst is None:
                    uses[key] = [pos]
                    depth[key] = d
                elif lst[-1] != pos:
                    lst.append(pos)
        self._uses = uses
        self._depth = depth
        self.clock = -1

    def advance(self, request_id: Hashable, now_s: float) -> None:
        """``request_id`` is being served now (unknown ids leave the clock as it is)."""
        self.clock = self._position.get(request_id, self.clock)

    def next_use(self, key: BlockKey, unknown: float | None = None) -> float:
        """First position after the clock at which ``key`` is used (``inf``: never;
        the oracle knows every key, so ``unknown`` is not used)."""
        lst = self._uses.get(key)
        if lst is None:
            return NEVER
        i = bisect_right(lst, self.clock)
        return lst[i] if i < len(lst) else NEVER

    def depth(self, key: BlockKey) -> int:
        return self._depth.get(key, 0)


class DriftOracle:
    """Next use as an estimated *time*, for replays whose order moves with timing.

    With several live sessions each policy serves requests in its own order,
    so a recorded order goes stale. This oracle keeps the first pass's time of
    every use and shifts each session's future by how far that session now
    runs ahead of or behind its recorded self (its drift, updated at every
    request it serves). ``request_id[0]`` names the session. An estimate, not
    a bound.
    """

    def __init__(self, order: Sequence[tuple[Hashable, Sequence[BlockKey], float]]) -> None:
        uses: dict[BlockKey, dict[Hashable, list[float]]] = {}
        depth: dict[BlockKey, int] = {}
        self._t1: dict[Hashable, float] = {}
        for request_id, keys, t1 in order:
            self._t1[request_id] = t1
            session = request_id[0]  # type: ignore[index]
            for d, key in enumerate(keys):
                per = uses.get(key)
                if per is None:
                    uses[key] = {session: [t1]}
                    depth[key] = d
                else:
                    lst = per.setdefault(session, [])
                    if not lst or lst[-1] != t1:
                        lst.append(t1)
        self._uses = uses
        self._depth = depth
        self._offset: dict[Hashable, float] = {}  # session -> now - recorded time
        self._progress: dict[Hashable, float] = {}  # session -> recorded time of its last served request
        self._drift = 0.0
        self.clock = 0.0

    def advance(self, request_id: Hashable, now_s: float) -> None:
        t1 = self._t1.get(request_id)
        self.clock = now_s
        if t1 is None:
            return
        session = request_id[0]  # type: ignore[index]
        self._offset[session] = self._drift = now_s - t1
        self._progress[session] = t1

    def next_use(self, key: BlockKey, unknown: float | None = None) -> float:
        per = self._uses.get(key)
        if per is None:
            return NEVER
        best = NEVER
        for session, times in per.items():
            i = bisect_right(times, self._progress.get(session, -1.0))
            if i < len(times):
                best = min(best, times[i] + self._offset.get(session, self._drift))
        return best

    def depth(self, key: BlockKey) -> int:
        return self._depth.get(key, 0)


class BeladyPolicy(NextUsePolicy):
    """Evicts the resident block with the farthest next use in the oracle's future."""

    name = "belady"
    to_front = None  # the oracle knows the future: no placement hint reorders it
