"""Why a block was not served: the last thing that happened to each key, and the explanation.

Owns: :class:`MissReason` and :class:`MissLog`, which remembers (bounded, oldest
forgotten first) the last removal of each key from each tier, and turns a
miss into one readable line: never stored, evicted by a tier's policy, failed
verification, moved, removed by a caller, in flight, or readable but not read
before a deadline. Must not read or move bytes, or change the manager:
:class:`~kvtier.store.TieredStore` feeds it removals and asks it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .keys import BlockKey
from .manager import TierManager


@dataclass(frozen=True, slots=True)
class MissReason:
    """Why block ``index`` of a request (``key``) was not served.

    ``reason``: ``absent`` (not stored here, or forgotten long ago),
    ``evicted`` / ``failed_verify`` / ``moved`` / ``removed`` (the last thing
    that happened to it in ``tier``), ``in_flight`` (a store or move into
    ``tier`` has not completed), ``deadline`` (readable, but not read before
    the caller's deadline). ``detail`` is one human-readable line."""

    index: int
    key: BlockKey
    reason: str
    tier: str | None
    detail: str


class MissLog:
    """The last removal of up to ``max_keys`` keys, and the explanation of a miss.

    ``policy_of(tier)`` names a tier's eviction policy; ``ssd_failures()`` gives the
    SSD tier's verification counters as one line (both for the explanation only)."""

    def __init__(self, max_keys: int, policy_of: Callable[[str], str], ssd_failures: Callable[[], str]) -> None:
        self.max_keys = max_keys
        self._policy_of = policy_of
        self._ssd_failures = ssd_failures
        self._last: OrderedDict[BlockKey, tuple[str, str]] = OrderedDict()

    def removed(self, key: BlockKey, tier: str, reason: str) -> None:
        self._last[key] = (tier, reason)
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)

    def explain(self, manager: TierManager, keys: Sequence[BlockKey], index: int | None) -> MissReason | None:
        """Why block ``index`` of ``keys`` (default: the first not readable now) is not
        served, or ``None`` when every block is readable. O(len(keys))."""
        if index is None:
            index = manager.lookup(keys).num_blocks
            if index >= len(keys):
                return None
        key = keys[index]
        tiers = manager.tiers_of(key)
        if tiers:
            return MissReason(index, key, "deadline", tiers[0],
                              f"readable in {'/'.join(tiers)}; not read before the caller's deadline")
        pending = [t for t in manager.tier_names if manager.is_pending(key, t)]
        if pending:
            return MissReason(index, key, "in_flight", pending[0],
                              f"a store or move into {pending[0]} has not completed yet")
        last = self._last.get(key)
        if last is None:
            return MissReason(index, key, "absent", None, "never stored in this store's namespace, or removed long ago")
        tier, reason = last
        details = {
            "evicted": f"evicted from {tier} by its {self._policy_of(tier)} policy",
            "failed_verify": f"its {tier} copy failed verification (checksum, decode, namespace or key mismatch)"
                             + (f"; ssd counters: {self._ssd_failures()}" if tier == "ssd" else ""),
            "moved": f"moved out of {tier} and no longer readable elsewhere",
            "removed": f"removed from {tier} by a caller",
        }
        return MissReason(index, key, reason, tier, details.get(reason, f"{reason} in {tier}"))
