"""Least-recently-used eviction (vLLM / SGLang prefix-cache order).

Owns: recency order of one tier's resident blocks. O(1) hooks; ``pop_victim``
is O(skipped + 1).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable

from ..keys import BlockKey
from .base import IsEvictable, OrderParking, pop_first_evictable, register_policy


@register_policy("lru")
class LRUPolicy(OrderParking):
    """Evicts the least recently inserted, hit or released block first."""

    name = "lru"

    def __init__(self, capacity_blocks: int) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()  # idle keys, oldest first
        self._parked: dict[BlockKey, None] = {}

    adapts_before_insert = False  # before_insert is a no-op: the manager skips the call

    def before_insert(self, key: BlockKey) -> None:
        pass

    def on_insert(self, key: BlockKey) -> None:
        self._order[key] = None

    def on_insert_held(self, key: BlockKey) -> None:
        """``on_insert`` then ``on_hold``: straight to the parked set."""
        self._parked[key] = None

    def on_insert_held_many(self, keys: Iterable[BlockKey]) -> None:
        """``on_insert_held`` of each of ``keys`` (one C-speed update)."""
        self._parked.update(dict.fromkeys(keys))

    def on_access(self, key: BlockKey) -> None:
        if key in self._order:  # a parked key re-enters as most recent anyway
            self._order.move_to_end(key)

    def on_access_many(self, keys: Iterable[BlockKey]) -> None:
        order = self._order
        deque(map(order.move_to_end, filter(order.__contains__, keys)), maxlen=0)  # C-speed loop

    def on_remove(self, key: BlockKey) -> None:
        """Forget ``key``."""
        self._forget(key)

    def pop_victim(self, is_evictable: IsEvictable, incoming: BlockKey | None = None) -> BlockKey | None:
        return pop_first_evictable(self._order, is_evictable)

