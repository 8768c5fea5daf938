"""First-in-first-out eviction.

Owns: insertion order of one tier's resident blocks; hits do not reorder.
O(1) hooks; ``pop_victim`` is O(skipped + 1) (:class:`~kvtier.policies.base.OrderParking`,
shared with LRU).
"""

from __future__ import annotations

from typing import Iterable

from ..keys import BlockKey
from .base import OrderParking
from .registry import register_policy


@register_policy("fifo")
class FIFOPolicy(OrderParking):
    """Evicts the block inserted (or released by its last user) longest ago,
    however often it was hit."""

    name = "fifo"

    def on_access(self, key: BlockKey) -> None:
        """A hit does not change the order."""

    def on_access_many(self, keys: Iterable[BlockKey]) -> None:
        """Hits do not change the order."""
