"""First-in-first-out eviction.

Owns: insertion order of one tier's resident blocks; hits do not reorder.
O(1) hooks; ``pop_victim`` is O(skipped + 1).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from ..keys import BlockKey
from .base import IsEvictable, OrderParking, pop_first_evictable, register_policy


@register_policy("fifo")
class FIFOPolicy(OrderParking):
    """Evicts the block inserted (or released by its last user) longest ago,
    however often it was hit."""

    name = "fifo"

    def __init__(self, capacity_blocks: int) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()  # idle keys, oldest first
        self._parked: dict[BlockKey, None] = {}

    adapts_before_insert = False  # before_insert is a no-op: the manager skips the call

    def before_insert(self, key: BlockKey) -> None:
        """No history to adapt."""

    def on_insert(self, key: BlockKey) -> None:
        """Append ``key`` at the young end."""
        self._order[key] = None

    def on_insert_held(self, key: BlockKey) -> None:
        """``on_insert`` then ``on_hold``: straight to the parked set."""
        self._parked[key] = None

    def on_insert_held_many(self, keys: Iterable[BlockKey]) -> None:
        """``on_insert_held`` of each of ``keys`` (one C-speed update)."""
        self._parked.update(dict.fromkeys(keys))

    def on_access(self, key: BlockKey) -> None:
        """A hit does not change the order."""

    def on_access_many(self, keys: Iterable[BlockKey]) -> None:
        """Hits do not change the order."""

    def on_remove(self, key: BlockKey) -> None:
        """Forget ``key``."""
        self._forget(key)

    def pop_victim(self, is_evictable: IsEvictable, incoming: BlockKey | None = None) -> BlockKey | None:
        """Forget and return the oldest evictable key, or ``None``."""
        return pop_first_evictable(self._order, is_evictable)

