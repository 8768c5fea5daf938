"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03).

Owns: the four LRU lists of the paper (resident ``T1`` seen once, ``T2`` seen
at least twice; ghost ``B1`` / ``B2`` remembering keys evicted from each),
and the adaptive target ``p`` for the size of ``T1``. Ghosts are bounded as
in the paper: ``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <= 2c``.

The paper's cases map onto the hooks:

* hit in ``T1`` / ``T2`` (case I) -> ``on_access``: move to the MRU end of ``T2``.
* miss: ``before_insert`` adapts ``p`` on a ghost hit (cases II / III) or
  trims the ghosts (case IV); ``pop_victim(..., incoming)`` runs REPLACE,
  or in case IV-A with ``|T1| = c`` drops the LRU of ``T1`` without ghosting
  it; ``on_insert`` puts the key at the MRU end of ``T2`` after a ghost hit,
  otherwise of ``T1``.

When ``is_evictable`` refuses REPLACE's candidate, it moves to the MRU end of
its list (it is in use) and the next key of the same list is tried, then the
other list. ``on_remove`` forgets a key without
ghosting it. Because the manager may prepare several stores before any
completes, ``on_insert`` trims the ghosts again to keep the bounds.

O(1) hooks; ``pop_victim`` is O(skipped + 1).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from ..keys import BlockKey
from .base import IsEvictable, Parking
from .registry import register_policy

_List = OrderedDict[BlockKey, None]  # an LRU list, least recent first


@register_policy("arc")
class ARCPolicy(Parking):
    """Balances recency (``T1``) against frequency (``T2``) by ghost hits."""

    name = "arc"

    def __init__(self, capacity_blocks: int) -> None:
        self._capacity = capacity_blocks
        self._p = 0.0  # target size of T1
        self._t1: _List = OrderedDict()
        self._t2: _List = OrderedDict()
        self._b1: _List = OrderedDict()
        self._b2: _List = OrderedDict()
        self._parked: dict[BlockKey, bool] = {}  # held key -> was it in T2

    def _detach(self, key: BlockKey) -> bool:
        if key in self._t1:
            del self._t1[key]
            return False
        del self._t2[key]
        return True

    def _attach(self, key: BlockKey, in_t2: bool, front: bool) -> None:
        lst = self._t2 if in_t2 else self._t1
        lst[key] = None
        if front:
            lst.move_to_end(key, last=False)
        self._trim_ghosts()

    @property
    def target_t1_blocks(self) -> float:
        """The adaptive target ``p`` for ``|T1|`` (for tests and reports)."""
        return self._p

    def before_insert(self, key: BlockKey) -> None:
        """Adapt ``p`` on a ghost hit (cases II / III), else trim ghosts (case IV)."""
        b1, b2 = len(self._b1), len(self._b2)
        if key in self._b1:
            self._p = min(float(self._capacity), self._p + (1.0 if b1 >= b2 else b2 / b1))
        elif key in self._b2:
            self._p = max(0.0, self._p - (1.0 if b2 >= b1 else b1 / b2))
        elif len(self._t1) + b1 >= self._capacity:
            if self._b1:  # case IV-A, |T1| < c
                self._b1.popitem(last=False)
        elif self._num_tracked() >= 2 * self._capacity and self._b2:  # case IV-B
            self._b2.popitem(last=False)

    def on_insert(self, key: BlockKey) -> None:
        """Put ``key`` at the MRU end of ``T2`` after a ghost hit, else of ``T1``."""
        if key in self._b1:
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def on_access(self, key: BlockKey) -> None:
        """Case I: move ``key`` to the MRU end of ``T2``."""
        if key in self._parked:
            self._parked[key] = True  # re-enters T2
            return
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def on_access_many(self, keys: Iterable[BlockKey]) -> None:
        """``on_access`` for each of ``keys`` in order."""
        for key in keys:
            self.on_access(key)

    def on_remove(self, key: BlockKey) -> None:
        """Forget ``key`` without remembering it in a ghost list."""
        if self._forget_parked(key):
            return
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]

    def pop_victim(self, is_evictable: IsEvictable, incoming: BlockKey | None = None) -> BlockKey | None:
        """Forget and return REPLACE's victim (or the next evictable one), or ``None``."""
        if incoming is not None and self._is_new(incoming) and len(self._t1) >= self._capacity:
            victim = _first_evictable(self._t1, is_evictable)  # case IV-A: no ghost
            if victim is not None:
                del self._t1[victim]
                return victim
        if self._replace_prefers_t1(incoming):
            order = ((self._t1, self._b1), (self._t2, self._b2))
        else:
            order = ((self._t2, self._b2), (self._t1, self._b1))
        for resident, ghost in order:
            victim = _first_evictable(resident, is_evictable)
            if victim is not None:
                del resident[victim]
                ghost[victim] = None
                self._trim_ghosts()
                return victim
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._parked)

    def check_invariants(self) -> None:
        """Lists are disjoint, ``0 <= p <= c`` and the ghost bounds hold."""
        lists = (self._t1, self._t2, self._b1, self._b2, self._parked)
        union = set().union(*lists)
        assert len(union) == sum(map(len, lists)), "ARC lists overlap"
        assert 0.0 <= self._p <= self._capacity, self._p
        if len(self) <= self._capacity:
            assert len(self._t1) + len(self._b1) <= self._capacity, (len(self._t1), len(self._b1))
            assert self._num_tracked() <= 2 * self._capacity, self._num_tracked()

    def _replace_prefers_t1(self, incoming: BlockKey | None) -> bool:
        t1 = len(self._t1)
        return t1 >= 1 and (t1 > self._p or (t1 == self._p and incoming in self._b2))

    def _is_new(self, key: BlockKey) -> bool:
        return key not in self._b1 and key not in self._b2

    def _num_tracked(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2)

    def _trim_ghosts(self) -> None:
        while self._b1 and len(self._t1) + len(self._b1) > self._capacity:
            self._b1.popitem(last=False)
        while (self._b1 or self._b2) and self._num_tracked() > 2 * self._capacity:
            (self._b2 or self._b1).popitem(last=False)


def _first_evictable(lru_list: _List, is_evictable: IsEvictable) -> BlockKey | None:
    """First evictable key (left in place for the caller); refused keys rotate to MRU."""
    for _ in range(len(lru_list)):
        key = next(iter(lru_list))
        if is_evictable(key):
            return key
        lru_list.move_to_end(key)
    return None
