"""Brute-force reference caches, written plainly from the papers.

Each class models a cache of ``capacity`` blocks in which every block is
evictable: ``access(key)`` returns whether it was a hit and applies the
policy. Plain lists (least recent / oldest first) and O(n) scans; nothing is
shared with ``kvtier.policies``, so a differential test compares two
independent readings of each algorithm.
"""

from __future__ import annotations

from collections.abc import Hashable

Key = Hashable


class RefLRU:
    """Least recently used: a hit moves the key to the young end."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: list[Key] = []  # least recent first

    def access(self, key: Key) -> bool:
        """Return whether ``key`` hits; update the order."""
        hit = key in self.order
        if hit:
            self.order.remove(key)
        elif len(self.order) >= self.capacity:
            self.order.pop(0)
        self.order.append(key)
        return hit


class RefFIFO:
    """First in, first out: hits change nothing."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: list[Key] = []  # oldest first

    def access(self, key: Key) -> bool:
        """Return whether ``key`` hits; insert it on a miss."""
        if key in self.order:
            return True
        if len(self.order) >= self.capacity:
            self.order.pop(0)
        self.order.append(key)
        return False


class RefLFU:
    """Fewest hits since insertion first; ties go to the least recent access."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.hits: dict[Key, int] = {}
        self.last_access: dict[Key, int] = {}
        self.clock = 0

    def access(self, key: Key) -> bool:
        """Return whether ``key`` hits; count the hit or insert with zero hits."""
        self.clock += 1
        hit = key in self.hits
        if hit:
            self.hits[key] += 1
        else:
            if len(self.hits) >= self.capacity:
                victim = min(self.hits, key=lambda k: (self.hits[k], self.last_access[k]))
                del self.hits[victim]
                del self.last_access[victim]
            self.hits[key] = 0
        self.last_access[key] = self.clock
        return hit


class RefARC:
    """ARC(c) exactly as the pseudo-code of Megiddo & Modha, FAST'03, Fig. 4."""

    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.p = 0.0
        self.t1: list[Key] = []  # LRU first, MRU last
        self.t2: list[Key] = []
        self.b1: list[Key] = []
        self.b2: list[Key] = []

    def access(self, x: Key) -> bool:
        """Return whether ``x`` hits; run the paper's case I-IV."""
        if x in self.t1 or x in self.t2:  # case I
            (self.t1 if x in self.t1 else self.t2).remove(x)
            self.t2.append(x)
            return True
        if x in self.b1:  # case II
            delta = 1.0 if len(self.b1) >= len(self.b2) else len(self.b2) / len(self.b1)
            self.p = min(float(self.c), self.p + delta)
            self.replace(x)
            self.b1.remove(x)
            self.t2.append(x)
            return False
        if x in self.b2:  # case III
            delta = 1.0 if len(self.b2) >= len(self.b1) else len(self.b1) / len(self.b2)
            self.p = max(0.0, self.p - delta)
            self.replace(x)
            self.b2.remove(x)
            self.t2.append(x)
            return False
        self.make_room_case_iv(x)
        self.t1.append(x)
        return False

    def make_room_case_iv(self, x: Key) -> None:
        """Case IV (a complete miss): trim the directory, then REPLACE."""
        l1 = len(self.t1) + len(self.b1)
        total = l1 + len(self.t2) + len(self.b2)
        if l1 == self.c:  # case A
            if len(self.t1) < self.c:
                self.b1.pop(0)
                self.replace(x)
            else:
                self.t1.pop(0)
        elif total >= self.c:  # case B
            if total == 2 * self.c:
                self.b2.pop(0)
            self.replace(x)

    def replace(self, x: Key) -> None:
        """REPLACE(x, p): demote the LRU of T1 or T2 into its ghost list."""
        t1 = len(self.t1)
        if t1 >= 1 and ((x in self.b2 and t1 == self.p) or t1 > self.p):
            self.b1.append(self.t1.pop(0))
        else:
            self.b2.append(self.t2.pop(0))


class RefS3FIFO:
    """S3-FIFO (Yang et al., SOSP'23, Algorithm 1) under one shared capacity.

    ``S`` holds 10% of the capacity (at least one block), ghost ``G`` as many
    keys as ``M``'s share. Eviction takes from ``S`` once it has its share
    (or when ``M`` is empty), otherwise from ``M``; moving a key from ``S``
    to ``M`` resets its counter and does not itself evict from ``M``.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.small_capacity = max(1, capacity // 10)
        self.ghost_capacity = max(0, capacity - self.small_capacity)
        self.small: list[Key] = []  # tail (oldest) first
        self.main: list[Key] = []
        self.ghost: list[Key] = []
        self.freq: dict[Key, int] = {}

    def access(self, x: Key) -> bool:
        """Return whether ``x`` hits; count the hit or insert after evicting."""
        if x in self.freq:
            self.freq[x] = min(self.freq[x] + 1, 3)
            return True
        while len(self.small) + len(self.main) >= self.capacity:
            self.evict()
        if x in self.ghost:
            self.ghost.remove(x)
            self.main.append(x)
        else:
            self.small.append(x)
        self.freq[x] = 0
        return False

    def evict(self) -> None:
        """Evict one key, from ``S`` or from ``M``."""
        if len(self.small) >= self.small_capacity or not self.main:
            self.evict_small()
        else:
            self.evict_main()

    def evict_small(self) -> None:
        """Promote hit keys from the tail of ``S``; evict the first other one into ``G``."""
        while self.small:
            t = self.small.pop(0)
            if self.freq[t] > 1:
                self.main.append(t)
                self.freq[t] = 0
                continue
            del self.freq[t]
            self.ghost.append(t)
            if len(self.ghost) > self.ghost_capacity:
                self.ghost.pop(0)
            return
        self.evict_main()

    def evict_main(self) -> None:
        """Reinsert hit keys from the tail of ``M`` one hit poorer; evict the first other one."""
        while True:
            t = self.main.pop(0)
            if self.freq[t] > 0:
                self.freq[t] -= 1
                self.main.append(t)
                continue
            del self.freq[t]
            return


REFERENCES: dict[str, type] = {
    "lru": RefLRU,
    "fifo": RefFIFO,
    "lfu": RefLFU,
    "arc": RefARC,
    "s3fifo": RefS3FIFO,
}
"""Reference class of each kvtier policy name."""
