"""The eviction-policy protocol.

Owns: the contract between :class:`~kvtier.manager.TierManager` and an
eviction policy (the name → factory registry is :mod:`.registry`). A policy is pure decision:
it orders the blocks resident in *one* tier and never allocates, copies or
frees anything; the manager owns residency and calls the hooks below.

Call order, per tier, as the manager guarantees it:

* ``before_insert(key)`` — a store of ``key`` into this tier is being
  prepared (a miss). Called before any eviction made for it. Policies with
  ghost history (ARC, S3-FIFO) adapt here. Side effects only on history.
* ``pop_victim(is_evictable, incoming)`` — choose the next block to evict.
  Return the first resident key, in the policy's eviction order, for which
  ``is_evictable(key)`` is true, and forget it (it is gone from the tier).
  Return ``None`` when no resident block is evictable. Skipped keys stay
  resident; list-based policies move a refused key to the most-recent end of
  its list (it is in use: referenced, pinned or the parent of a resident
  block), as vLLM re-queues freed blocks, so the next scan does not revisit
  it and eviction stays O(1) amortised. ``incoming`` is the key the room is
  made for (or ``None``).
* ``on_insert(key)`` — ``key`` became resident (called once per residency).
* ``on_access(key)`` — a resident ``key`` was hit.
* ``on_access_many(keys)`` — the same for each of ``keys`` in order (a chain
  touched tail first); policies make this a C-speed loop where they can.
* ``on_remove(key)`` — ``key`` left the tier *not* through ``pop_victim``
  (explicit delete, failed verification, demotion by a move). ``key`` may
  be held (see below).
* ``on_hold(key)`` / ``on_unhold(key, front)`` — ``key`` cannot be evicted
  for now (referenced by a running request or a transfer, pinned, or the
  parent of a block present in this tier) / can again. A held key is parked
  outside the eviction order, as vLLM keeps referenced blocks out of its
  free-block queue: it is never offered to ``pop_victim`` and costs no scan,
  but keeps its history, and ``on_access`` still counts for it.
  ``on_unhold`` puts it back as the most recent of its list, or with
  ``front`` as the next to evict (its child, the chain's old tail, was just
  evicted).

Optional: ``on_insert_held(key)`` — exactly ``on_insert(key)`` then
``on_hold(key)`` in one call (a block stored with its children already
present, as every block but a new chain's tail is): policies whose
``on_insert`` only enters the eviction order provide it to skip the
enter-then-leave round trip; the manager falls back to the two calls.
``on_insert_held_many(keys)`` does the same for many keys at once; a policy
provides it only where parked keys keep no order among themselves or with
idle ones (the manager then calls it after the batch's ``on_insert`` calls).

Optional: ``adapts_before_insert = False`` (class attribute) — the policy's
``before_insert`` does nothing, so the manager may skip calling it (once per
stored block).

Optional: ``parked_keys()`` — the keys held now (``on_hold`` without
``on_unhold`` or removal since); the manager's ``check_invariants`` compares
them with the blocks it holds, as it keeps no such set itself.

Optional: ``to_front(key)`` — make an idle resident ``key`` the next victim
(an agent-aware placement knows it will not be used soon). Policies without
an order to reorder omit it and the manager ignores the request.

``len(policy)`` is the number of resident keys it tracks, and
``check_invariants()`` asserts its internal consistency.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Protocol, runtime_checkable

from ..keys import BlockKey

IsEvictable = Callable[[BlockKey], bool]


@runtime_checkable
class EvictionPolicy(Protocol):
    """See the module docstring for the call contract."""

    name: str

    def before_insert(self, key: BlockKey) -> None: ...

    def on_insert(self, key: BlockKey) -> None: ...

    def on_access(self, key: BlockKey) -> None: ...

    def on_access_many(self, keys: Iterable[BlockKey]) -> None: ...

    def on_remove(self, key: BlockKey) -> None: ...

    def on_hold(self, key: BlockKey) -> None: ...

    def on_unhold(self, key: BlockKey, front: bool = False) -> None: ...

    def pop_victim(self, is_evictable: IsEvictable, incoming: BlockKey | None = None) -> BlockKey | None: ...

    def __len__(self) -> int: ...

    def check_invariants(self) -> None: ...


_ABSENT = object()


class Parking:
    """Mixin implementing ``on_hold`` / ``on_unhold`` from two primitives of the policy:
    ``_detach(key) -> state`` (leave the eviction order, return what to restore)
    and ``_attach(key, state, front)`` (re-enter as the most recent of its list,
    or the next to evict with ``front``).
    Policies call :meth:`_forget_parked` first in ``on_remove``."""

    _parked: dict

    def on_hold(self, key: BlockKey) -> None:
        self._parked[key] = self._detach(key)  # type: ignore[attr-defined]

    def on_unhold(self, key: BlockKey, front: bool = False) -> None:
        self._attach(key, self._parked.pop(key), front)  # type: ignore[attr-defined]

    def parked_keys(self) -> Iterable[BlockKey]:
        """The held keys (for the manager's invariant check)."""
        return self._parked.keys()

    def _forget_parked(self, key: BlockKey) -> bool:
        """True (and forgotten) when ``key`` was parked."""
        return self._parked.pop(key, _ABSENT) is not _ABSENT


class OrderParking(Parking):
    """A policy that keeps its idle keys in one ``OrderedDict`` ``_order`` (oldest
    first) and evicts from its old end: LRU and FIFO, which differ only in what a
    hit does (``on_access``). A key inserts at the young end; a held key leaves the
    order and comes back at the young end, or the old end with ``front``."""

    _order: "OrderedDict[BlockKey, None]"

    def __init__(self, capacity_blocks: int) -> None:
        self._order = OrderedDict()  # idle keys, oldest first
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

    def on_remove(self, key: BlockKey) -> None:
        """Forget ``key``."""
        self._forget(key)

    def pop_victim(self, is_evictable: IsEvictable, incoming: BlockKey | None = None) -> BlockKey | None:
        """Forget and return the oldest evictable key, or ``None``."""
        return pop_first_evictable(self._order, is_evictable)

    def _detach(self, key: BlockKey) -> None:
        del self._order[key]

    def _attach(self, key: BlockKey, state: None, front: bool) -> None:
        self._order[key] = None
        if front:
            self._order.move_to_end(key, last=False)

    def to_front(self, key: BlockKey) -> None:
        """Make an idle ``key`` the next victim (a parked key is left alone)."""
        if key in self._order:
            self._order.move_to_end(key, last=False)

    def _forget(self, key: BlockKey) -> None:
        """``on_remove`` for parked and idle keys alike."""
        if not self._forget_parked(key):
            del self._order[key]

    def __len__(self) -> int:
        return len(self._order) + len(self._parked)

    def check_invariants(self) -> None:
        assert not (self._parked.keys() & self._order.keys()), "a key is both parked and idle"


def pop_first_evictable(order: "OrderedDict[BlockKey, None]", is_evictable: IsEvictable) -> BlockKey | None:
    """Remove and return the first key of ``order`` that ``is_evictable``; refused
    keys rotate to the end. ``None`` (order unchanged as a set) when all refuse."""
    for _ in range(len(order)):
        key = next(iter(order))
        if is_evictable(key):
            del order[key]
            return key
        order.move_to_end(key)
    return None
