"""Least-recently-used eviction (vLLM / SGLang prefix-cache order).

Owns: recency order of one tier's resident blocks. O(1) hooks; ``pop_victim``
is O(skipped + 1) (:class:`~kvtier.policies.base.OrderParking`, shared with FIFO).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from ..keys import BlockKey
from .base import OrderParking
from .registry import register_policy


@register_policy("lru")
class LRUPolicy(OrderParking):
    """Evicts the least recently inserted, hit or released block first."""

    name = "lru"

    def on_access(self, key: BlockKey) -> None:
        if key in self._order:  # a parked key re-enters as most recent anyway
            self._order.move_to_end(key)

    def on_access_many(self, keys: Iterable[BlockKey]) -> None:
        order = self._order
        deque(map(order.move_to_end, filter(order.__contains__, keys)), maxlen=0)  # C-speed loop
