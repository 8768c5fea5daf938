"""Drive a kvtier eviction policy the way ``TierManager`` does, without the manager.

For each requested key of a tier holding independent blocks (no chains, so
no block is protected by its children): a resident key is a hit
(``on_access``); otherwise ``before_insert``, then ``pop_victim`` while the
tier is full, then ``on_insert``. When every resident block is refused the
store gives up, as ``TierManager.prepare_store`` does. The harness keeps its
own resident set and asserts that the policy's answers agree with it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from kvtier.keys import BlockKey
from kvtier.policies import EvictionPolicy, IsEvictable


def always_evictable(key: BlockKey) -> bool:
    """The ``is_evictable`` of a tier with nothing pinned or in use."""
    return True


class DrivenTier:
    """One tier of ``capacity`` blocks whose only logic is ``policy``.

    >>> from kvtier.policies import make_policy
    >>> tier = DrivenTier(make_policy("fifo", 1), 1)
    >>> [tier.request(BlockKey(k)) for k in (1, 1, 2, 1)]
    [False, True, False, False]
    """

    def __init__(self, policy: EvictionPolicy, capacity: int, is_evictable: IsEvictable = always_evictable) -> None:
        self.policy = policy
        self.capacity = capacity
        self.is_evictable = is_evictable
        self.resident: set[BlockKey] = set()

    def request(self, key: BlockKey) -> bool | None:
        """Look ``key`` up: True on a hit, False on a stored miss, ``None`` when
        no room could be made (every resident block refused)."""
        if key in self.resident:
            self.policy.on_access(key)
            return True
        return False if self._store(key) else None

    def store_batch(self, keys: Iterable[BlockKey], ok: IsEvictable) -> list[BlockKey]:
        """Store ``keys`` as ``prepare_store`` then ``complete_store`` do: room is
        made for every key before any becomes resident (reserved slots count
        against the capacity), then the keys for which ``ok`` is false fail and
        never reach the policy. Stops at the first key no room can be made
        for. Returns the stored keys."""
        reserved: list[BlockKey] = []
        for key in keys:
            if key in self.resident or key in reserved:
                continue
            self.policy.before_insert(key)
            if not self._make_room(key, num_reserved=len(reserved)):
                break
            reserved.append(key)
        stored = [key for key in reserved if ok(key)]
        for key in stored:
            self.policy.on_insert(key)
            self.resident.add(key)
        return stored

    def touch_many(self, keys: Iterable[BlockKey]) -> None:
        """Hit the resident ones of ``keys`` in order, in one ``on_access_many``."""
        self.policy.on_access_many([key for key in keys if key in self.resident])

    def remove(self, key: BlockKey) -> bool:
        """Delete ``key`` outside eviction (``on_remove``); False if not resident."""
        if key not in self.resident:
            return False
        self.policy.on_remove(key)
        self.resident.remove(key)
        return True

    def evict_one(self) -> BlockKey | None:
        """Evict for no particular incoming key (``TierManager.evict``); the
        victim, or ``None`` when every resident block is refused."""
        victim = self.policy.pop_victim(self.is_evictable, incoming=None)
        if victim is None:
            self._assert_all_refused()
        else:
            self._forget_victim(victim)
        return victim

    def check(self) -> None:
        """Assert the policy's count and its own invariants."""
        assert len(self.policy) == len(self.resident), (self.policy.name, len(self.policy), len(self.resident))
        self.policy.check_invariants()

    def _store(self, key: BlockKey) -> bool:
        self.policy.before_insert(key)
        if not self._make_room(key):
            return False
        self.policy.on_insert(key)
        self.resident.add(key)
        return True

    def _make_room(self, incoming: BlockKey, num_reserved: int = 0) -> bool:
        while len(self.resident) + num_reserved >= self.capacity:
            victim = self.policy.pop_victim(self.is_evictable, incoming=incoming)
            if victim is None:
                self._assert_all_refused()
                return False
            self._forget_victim(victim)
        return True

    def _forget_victim(self, victim: BlockKey) -> None:
        assert victim in self.resident, f"{self.policy.name}: victim {victim} is not resident"
        assert self.is_evictable(victim), f"{self.policy.name}: victim {victim} was refused"
        self.resident.remove(victim)

    def _assert_all_refused(self) -> None:
        evictable = sorted(k for k in self.resident if self.is_evictable(k))
        assert not evictable, f"{self.policy.name}: None while {evictable} are evictable"


def simulate(
    policy: EvictionPolicy, capacity: int, keys: Iterable[int], *, check_invariants: bool = False
) -> list[bool]:
    """Replay ``keys`` with every block evictable; return hit (True) / miss per request.

    With ``check_invariants`` the policy's count and ``check_invariants()``
    are checked after every request. Raises ``AssertionError`` when the
    policy returns ``None`` or a non-resident key.
    """
    tier = DrivenTier(policy, capacity)
    hits: list[bool] = []
    for raw in keys:
        outcome = tier.request(BlockKey(raw))
        assert outcome is not None, f"{policy.name}: no victim among {len(tier.resident)} evictable blocks"
        hits.append(outcome)
        if check_invariants:
            tier.check()
    return hits


def seeded_refusals(seed: int, fraction: float) -> IsEvictable:
    """An ``is_evictable`` refusing a fixed pseudo-random ``fraction`` of keys
    (think pinned or in-use blocks); a key always gets the same answer."""

    def is_evictable(key: BlockKey) -> bool:
        return random.Random(f"{seed}:{key}").random() >= fraction

    return is_evictable


def simulate_with_refusals(
    policy: EvictionPolicy, capacity: int, keys: Iterable[int], is_evictable: Callable[[BlockKey], bool]
) -> list[bool | None]:
    """Replay ``keys`` while ``is_evictable`` refuses some blocks, checking
    invariants after every request.

    Returns per request True (hit), False (stored miss) or ``None`` (not
    stored: every resident block was refused). Asserts that no victim is
    refused or non-resident and that ``None`` comes only when all are refused.
    """
    tier = DrivenTier(policy, capacity, is_evictable)
    outcomes: list[bool | None] = []
    for raw in keys:
        outcomes.append(tier.request(BlockKey(raw)))
        tier.check()
    return outcomes
