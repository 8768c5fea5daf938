"""Least-recently-used eviction (vLLM / SGLang prefix-cache order).

Owns: recency order of one tier's resident blocks. O(1) hooks; ``pop_victim``
is O(skipped + 1).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable

from ..keys import BlockKey
from .base import IsEvictable, register_policy


@register_policy("lru")
class LRUPolicy:
    """Evicts the least recently inserted-or-hit block first."""

    name = "lru"

    def __init__(self, capacity_blocks: int) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()  # oldest first

    def before_insert(self, key: BlockKey) -> None:
        pass

    def on_insert(self, key: BlockKey) -> None:
        self._order[key] = None

    def on_access(self, key: BlockKey) -> None:
        self._order.move_to_end(key)

    def on_access_many(self, keys: Iterable[BlockKey]) -> None:
        deque(map(self._order.move_to_end, keys), maxlen=0)  # C-speed loop

    def on_remove(self, key: BlockKey) -> None:
        del self._order[key]

    def pop_victim(self, is_evictable: IsEvictable, incoming: BlockKey | None = None) -> BlockKey | None:
        for key in self._order:
            if is_evictable(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def check_invariants(self) -> None:
        pass
