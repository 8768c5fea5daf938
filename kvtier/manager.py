"""TierManager: the bookkeeping of which block lives in which tier.

Owns: block residency per tier (``hbm``, ``dram``, ``ssd``; any subset), slot
allocation, chain structure (parent links), ref counts, pins, in-flight
two-phase operations, and the event log. Asks one eviction policy per tier
which block to evict. Must not touch bytes, import torch or do I/O: movers
execute the plans it hands out and report back with ``complete_*``.

Not thread-safe: one owner (the :class:`~kvtier.store.TieredStore` facade,
the engine connector's scheduler, or the replay simulator) serialises calls.

Rules it enforces:

* A block is readable in a tier only after its store or move *completed ok*.
* Pinned, referenced and in-flight blocks are never victims: they are parked
  outside every policy's eviction order while held (``on_hold`` /
  ``on_unhold``), as vLLM keeps referenced blocks out of its free queue.
  With ``hold_tiers`` the holds of :meth:`acquire` and :meth:`pin` protect
  only the copies in those tiers (a running request needs its HBM copy; its
  DRAM copy may go, making room for what HBM does not hold); in-flight loads
  and moves protect their source in every tier.
* Eviction is tail-first within a chain: a block with a child present (or
  pending) in the same tier is parked in that tier's policy too, so shared
  prefixes outlive the branches that use them and policies never scan past
  interior blocks. When a chain's tail is evicted its parent re-enters the
  order at the eviction end, so a cold chain is evicted tail to head in a row.
  Touches walk a chain tail → head.
* A failed store, move or load leaves the block unreadable where it failed.

>>> m = TierManager([TierSpec("dram", 2)])
>>> plan = m.prepare_store("dram", [BlockKey(1), BlockKey(2), BlockKey(3)])
>>> plan.keys  # only two fit; a chain stores its longest prefix that fits
(1, 2)
>>> m.complete_store(plan, ok=True)
>>> m.lookup([BlockKey(1), BlockKey(2), BlockKey(3)]).tiers
('dram', 'dram')
"""

from __future__ import annotations

import collections
import heapq
import itertools
import operator
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .errors import ConfigError, ProtocolError
from .events import (
    BlockLoaded,
    BlockPinned,
    BlockRemoved,
    BlockStored,
    BlockUnpinned,
    Event,
    PinRefused,
    RemoveReason,
    StoreFailed,
)
from .keys import BlockKey
from .policies import EvictionPolicy, make_policy

TIER_ORDER: tuple[str, ...] = ("hbm", "dram", "ssd")
"""Tiers from fastest to slowest; a lookup reports the fastest ready copy."""



@dataclass(frozen=True, slots=True)
class TierSpec:
    """One enabled tier: its name (one of :data:`TIER_ORDER`), capacity and policy
    (a registered policy name, or a ready policy object such as replay's offline
    ``belady``, which needs an oracle no registry factory has)."""

    name: str
    capacity_blocks: int
    policy: str | EvictionPolicy = "lru"


@dataclass(slots=True, unsafe_hash=True)  # a value; not frozen: made on every put and get (see events)
class PrefixHit:
    """Longest readable prefix of a lookup: block ``i`` is fastest in ``tiers[i]``.

    ``tier_indices[i]`` indexes ``tier_names`` (the manager's enabled tiers,
    fastest first); ``tiers`` spells them out (built on access)."""

    num_blocks: int
    tier_indices: tuple[int, ...]
    tier_names: tuple[str, ...]

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(map(self.tier_names.__getitem__, self.tier_indices))

    def count(self, tier: str) -> int:
        """Blocks of the prefix whose fastest copy is in ``tier``."""
        return self.tier_indices.count(self.tier_names.index(tier)) if tier in self.tier_names else 0


@dataclass(slots=True, unsafe_hash=True)  # a value; not frozen: made on every put and get (see events)
class StorePlan:
    """Slots reserved for ``keys`` in ``tier``; write the bytes, then ``complete_store``.

    ``skipped`` were already present (ready or pending) and need no write;
    ``evicted`` were evicted from ``tier`` to make room.
    """

    plan_id: int
    tier: str
    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]
    skipped: tuple[BlockKey, ...]
    evicted: tuple[BlockKey, ...]


@dataclass(slots=True, unsafe_hash=True)  # a value; not frozen: made on every put and get (see events)
class LoadPlan:
    """Read ``keys`` from ``tiers[i]`` / ``slots[i]``, then ``complete_load``.
    The blocks are referenced (unevictable) until then."""

    plan_id: int
    keys: tuple[BlockKey, ...]
    tiers: tuple[str, ...]
    slots: tuple[int, ...]


@dataclass(slots=True, unsafe_hash=True)  # a value; not frozen: made on every put and get (see events)
class MovePlan:
    """Copy ``keys`` from ``src`` slots to ``dst`` slots, then ``complete_move``.
    With ``keep_source`` False the source copy is dropped on success (a demotion)."""

    plan_id: int
    src: str
    dst: str
    keys: tuple[BlockKey, ...]
    src_slots: tuple[int, ...]
    dst_slots: tuple[int, ...]
    keep_source: bool
    evicted: tuple[BlockKey, ...]


class _Tier:
    """Slot pool, policy and residency of one tier."""

    __slots__ = ("name", "index", "capacity", "policy", "free_slots", "next_slot", "num_used", "num_ready",
                 "num_reserved", "slots", "children", "before_insert", "insert_held", "insert_held_many", "holds")

    def __init__(self, name: str, index: int, capacity: int, policy: EvictionPolicy, holds: bool = True) -> None:
        self.name = name
        self.holds = holds  # acquire() and pin() protect this tier's copies
        self.index = index
        self.capacity = capacity
        self.policy = policy
        self.free_slots: list[int] = []
        self.next_slot = 0
        self.num_used = 0  # pending + ready residencies + reserved space
        self.num_ready = 0
        self.num_reserved = 0  # anonymous space (e.g. a running request's decode blocks)
        self.slots: dict[BlockKey, int] = {}  # resident key (pending or ready) -> its slot
        self.children: dict[BlockKey, int] = {}  # key -> children resident here (pending or ready); > 0 only
        # the policy's hooks the manager calls per stored block, looked up once (see kvtier.policies.base):
        # None where the policy's before_insert is a no-op or it lacks the optional batch hooks
        self.before_insert = policy.before_insert if getattr(policy, "adapts_before_insert", True) else None
        self.insert_held = getattr(policy, "on_insert_held", None)
        self.insert_held_many = getattr(policy, "on_insert_held_many", None)

    def take_slot(self) -> int:
        self.num_used += 1
        if self.free_slots:
            return self.free_slots.pop()
        self.next_slot += 1
        return self.next_slot - 1

    def take_slots(self, n: int) -> list[int]:
        """``take_slot()`` ``n`` times, in one go (the same slots in the same order)."""
        self.num_used += n
        free = self.free_slots
        if not free:  # a pool still filling up
            self.next_slot += n
            return list(range(self.next_slot - n, self.next_slot))
        k = min(n, len(free))
        taken = free[len(free) - k :]
        del free[len(free) - k :]
        taken.reverse()  # pop() order
        if k < n:
            taken.extend(range(self.next_slot, self.next_slot + n - k))
            self.next_slot += n - k
        return taken

    def give_slot(self, slot: int) -> None:
        self.num_used -= 1
        self.free_slots.append(slot)


def _is_descending_run(slots: list[int]) -> bool:
    """True for several adjacent slots in descending order. A chain stored into a
    full tier takes the slots of the blocks it evicts, tail first, and so gets
    such a run; reserving them ascending instead lets a run of source blocks be
    copied into them as one (see :mod:`kvtier.tiers.pool`). Both store paths
    apply it, so they reserve the same slots in the same order."""
    n = len(slots)
    return n > 1 and slots[0] == slots[-1] + n - 1 and slots == list(range(slots[0], slots[-1] - 1, -1))


class TierManager:
    """Metadata of the enabled tiers; see the module docstring for its rules.

    ``clock`` gives the time used for pins (wall clock live, simulated in
    replay). ``pin_budget_blocks`` caps how many blocks may be pinned at once.
    ``record_events=False`` records no events; ``record_block_events=False``
    leaves out only ``BlockStored`` and ``BlockLoaded`` (one per block of every
    completed store and load), for an owner that needs removals and failures
    (to free bytes) but publishes no per-block stream. ``hold_tiers`` (default:
    every tier) names the tiers whose copies :meth:`acquire` and :meth:`pin`
    protect; elsewhere a held block's copy is evicted like an idle one.

    The index is a set of dicts keyed by block key (one field each: parent,
    child count, references, holds; per tier: slot, children resident there),
    not one object per block: storing a fresh chain then updates each dict
    once, at C speed, instead of building an object per block.
    """

    def __init__(
        self,
        tiers: Sequence[TierSpec],
        *,
        pin_budget_blocks: int = 0,
        clock: Callable[[], float] = time.monotonic,
        record_events: bool = True,
        record_block_events: bool = True,
        hold_tiers: Sequence[str] | None = None,
    ) -> None:
        if not tiers:
            raise ConfigError("tiers", [], "enable at least one tier")
        names = [t.name for t in tiers]
        for spec in tiers:
            if spec.name not in TIER_ORDER:
                raise ConfigError("tiers", spec.name, f"unknown tier; valid: {', '.join(TIER_ORDER)}")
            if names.count(spec.name) > 1:
                raise ConfigError("tiers", spec.name, "tier listed twice")
            if not isinstance(spec.capacity_blocks, int) or spec.capacity_blocks < 0:
                raise ConfigError(f"tiers.{spec.name}.capacity_blocks", spec.capacity_blocks, "must be an int >= 0")
        if pin_budget_blocks < 0:
            raise ConfigError("pin_budget_blocks", pin_budget_blocks, "must be >= 0")
        if hold_tiers is not None:
            for name in hold_tiers:
                if name not in names:
                    raise ConfigError("hold_tiers", name, f"not an enabled tier; enabled: {', '.join(names)}")
        ordered = sorted(tiers, key=lambda s: TIER_ORDER.index(s.name))
        self._tiers = [
            _Tier(
                s.name, i, s.capacity_blocks,
                make_policy(s.policy, s.capacity_blocks, f"tiers.{s.name}.policy") if isinstance(s.policy, str)
                else s.policy,
                hold_tiers is None or s.name in hold_tiers,
            )
            for i, s in enumerate(ordered)
        ]
        self._tier_by_name = {t.name: t for t in self._tiers}
        # the index: every known key -> its parent (None for a root or a stub whose
        # parent is unknown). A key stays while it is resident somewhere, has a
        # child in the index, is referenced or is pinned.
        self._parent: dict[BlockKey, BlockKey | None] = {}
        self._num_children: dict[BlockKey, int] = {}  # child keys in the index; > 0 only
        self._refs: dict[BlockKey, int] = {}  # acquire() holds + in-flight loads and moves; > 0 only
        self._holds: dict[BlockKey, int] = {}  # acquire() references only (parked while > 0); > 0 only
        self._plans: dict[int, StorePlan | LoadPlan | MovePlan] = {}
        self._last_plan_id = 0  # plan ids count up from 1
        # the newest plan, when prepare_store reserved it as a fresh chain: completed
        # before any later plan, its keys are as prepared (see _mark_ready_many)
        self._fresh_plan_id = 0
        self._events: list[Event] = []
        self._record = record_events
        # the per-block BlockStored / BlockLoaded, one per block of every completed
        # store and load: an owner that only frees bytes (removals) can go without
        self._record_blocks = record_events and record_block_events
        self._clock = clock
        self._pin_budget = pin_budget_blocks
        self._pinned: dict[BlockKey, float] = {}  # pinned key -> pinned until
        self._names = tuple(t.name for t in self._tiers)
        self._ready: list[set[BlockKey]] = [set() for _ in self._tiers]  # readable keys per tier
        self._fastest: dict[BlockKey, int] = {}  # readable key -> index of its fastest tier
        # referenced or pinned blocks. A block ready in a tier is parked in that
        # tier's policy while it is held or has a child resident there; the
        # manager keeps no set of parked keys (one more cache miss per stored
        # block): each change of those two facts parks or unparks it
        self._held: set[BlockKey] = set()
        self._pin_heap: list[tuple[float, BlockKey]] = []

    # ------------------------------------------------------------------ queries

    @property
    def tier_names(self) -> tuple[str, ...]:
        """Enabled tiers, fastest first."""
        return tuple(t.name for t in self._tiers)

    def capacity_blocks(self, tier: str) -> int:
        return self._tier(tier).capacity

    def used_blocks(self, tier: str) -> int:
        """Slots in use in ``tier`` (ready + pending)."""
        return self._tier(tier).num_used

    def ready_blocks(self, tier: str) -> int:
        return self._tier(tier).num_ready

    def num_indexed(self) -> int:
        """Keys in the index (resident, or kept for a chain link, a reference or a pin)."""
        return len(self._parent)

    def lookup(self, keys: Sequence[BlockKey]) -> PrefixHit:
        """Longest prefix of ``keys`` readable in some tier, with the fastest tier of
        each block. Side-effect free (no policy touch). O(len(keys)) at C speed:
        one dict probe per key, no Python-level loop."""
        found = list(map(self._fastest.get, keys))
        try:
            n = found.index(None)
        except ValueError:
            n = len(found)
        return PrefixHit(n, tuple(found[:n]), self._names)

    def contains(self, key: BlockKey, tier: str | None = None) -> bool:
        """True when ``key`` is readable (in ``tier``, or anywhere)."""
        if tier is None:
            return key in self._fastest
        return key in self._ready[self._tier(tier).index]

    def tiers_of(self, key: BlockKey) -> tuple[str, ...]:
        """Every tier where ``key`` is readable, fastest first."""
        return tuple(t.name for t in self._tiers if key in self._ready[t.index])

    def is_pending(self, key: BlockKey, tier: str) -> bool:
        """True while a store or move of ``key`` into ``tier`` is prepared but not completed."""
        t = self._tier(tier)
        return key in t.slots and key not in self._ready[t.index]

    def slot_of(self, key: BlockKey, tier: str) -> int | None:
        """Slot of a readable ``key`` in ``tier``, or ``None``."""
        t = self._tier(tier)
        return t.slots[key] if key in self._ready[t.index] else None

    def parent_of(self, key: BlockKey) -> BlockKey | None:
        return self._parent.get(key)

    def touch(self, keys: Sequence[BlockKey], tier: str) -> int:
        """Record a hit on every ``keys[i]`` readable in ``tier``, tail first (so a
        prefix ends up at least as recent as its descendants). Returns the number
        touched."""
        t = self._tier(tier)
        ready_set = self._ready[t.index]
        ready = [k for k in reversed(keys) if k in ready_set]
        t.policy.on_access_many(ready)
        return len(ready)

    # -------------------------------------------------------------- store

    def prepare_store(
        self, tier: str, keys: Sequence[BlockKey], parent: BlockKey | None = None, *, chain: bool = True
    ) -> StorePlan | None:
        """Reserve slots for ``keys`` in ``tier``, evicting as its policy chooses.

        With ``chain`` (default) ``keys`` form a chain: ``keys[0]`` follows
        ``parent`` and each key follows the previous one; otherwise every key is
        an independent root. Keys already present are skipped. When room runs
        out the plan covers the keys that fit before that point. Returns
        ``None`` when nothing could be reserved and nothing was present.
        """
        t = self._tier_by_name.get(tier) or self._tier(tier)  # (the latter raises the error)
        if self._pin_heap:
            self._expire_pins(self._clock())
        before_insert = t.before_insert
        if chain and self._is_fresh_chain(t, keys, parent):
            if before_insert is not None:
                for key in keys:
                    before_insert(key)
            keys = tuple(keys)
            self._fresh_plan_id = plan_id = self._new_plan_id()
            plan = StorePlan(plan_id, t.name, keys, tuple(self._reserve_fresh_chain(t, keys, parent)), (), ())
            self._plans[plan.plan_id] = plan
            return plan
        reserved: list[BlockKey] = []
        slots: list[int] = []
        skipped: list[BlockKey] = []
        evicted: list[BlockKey] = []
        resident = t.slots
        prev = parent if chain else None
        for key in keys:
            if key in resident:  # pending or ready here already
                skipped.append(key)
                if chain:
                    prev = key
                continue
            if before_insert is not None:
                before_insert(key)
            if t.num_used >= t.capacity and not self._make_room(t, key, prev, evicted):
                break
            self._index(key, prev)
            slot = t.take_slot()
            self._set_pending(key, t, slot)
            reserved.append(key)
            slots.append(slot)
            if chain:
                prev = key
        if not reserved and not skipped:
            return None
        if _is_descending_run(slots):  # (none is written yet: any order of them will do)
            slots.reverse()
            t.slots.update(zip(reserved, slots))
        plan = StorePlan(self._new_plan_id(), t.name, tuple(reserved), tuple(slots), tuple(skipped), tuple(evicted))
        self._plans[plan.plan_id] = plan
        return plan

    def complete_store(self, plan: StorePlan, ok: bool | Sequence[bool]) -> None:
        """Finish ``plan``: keys with ok become readable, the others are dropped."""
        self._close_plan(plan)
        t = self._tier_by_name[plan.tier]
        if ok is True:
            self._mark_ready_many(plan.keys, t, plan.plan_id == self._fresh_plan_id == self._last_plan_id)
            return
        oks = self._per_key(ok, len(plan.keys))
        if all(oks):
            self._mark_ready_many(plan.keys, t)
            return
        # tail first, so the policy sees a chain's head as its most recent block
        for key, good in zip(reversed(plan.keys), reversed(oks)):
            if good:
                self._mark_ready(key, t)
            else:
                if self._record:
                    self._events.append(StoreFailed(key, t.name))
                self._drop_residency(key, t, None)

    # --------------------------------------------------------------- load

    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadPlan | None:
        """Plan reading the longest readable prefix of ``keys`` from its fastest
        tiers; references those blocks until ``complete_load``. ``None`` on a miss."""
        hit = self.lookup(keys)
        if hit.num_blocks == 0:
            return None
        found = tuple(keys[: hit.num_blocks])
        refs = self._refs
        if refs.keys().isdisjoint(found) and len(set(found)) == len(found):  # none referenced yet: at C speed
            refs.update(dict.fromkeys(found, 1))
        else:
            for key in found:
                refs[key] = refs.get(key, 0) + 1
        # tier_indices index self._tiers, whose positions are the tiers' indices
        first = hit.tier_indices[0]
        if hit.tier_indices.count(first) == len(found):  # one tier (the common case)
            slots = tuple(map(self._tiers[first].slots.__getitem__, found))
        else:
            slots = tuple(self._tiers[i].slots[key] for key, i in zip(found, hit.tier_indices))
        plan = LoadPlan(self._new_plan_id(), found, hit.tiers, slots)
        self._plans[plan.plan_id] = plan
        return plan

    def complete_load(self, plan: LoadPlan, ok: bool | Sequence[bool]) -> None:
        """Finish ``plan``: verified blocks count as hits; a block that failed to
        load or verify is dropped from the tier it was read from."""
        self._close_plan(plan)
        oks = self._per_key(ok, len(plan.keys))
        if ok is True or all(oks):
            self._complete_load_ok(plan)
            return
        for key, tier, good in zip(reversed(plan.keys), reversed(plan.tiers), reversed(oks)):
            t = self._tier_by_name[tier]
            if self._record_blocks:
                self._events.append(BlockLoaded(key, tier, good))
            if key in self._ready[t.index]:
                if good:
                    t.policy.on_access(key)
                else:
                    t.policy.on_remove(key)
                    self._drop_residency(key, t, "failed_verify")
            self._unref(key)

    # --------------------------------------------------------------- move

    def prepare_move(
        self, keys: Sequence[BlockKey], src: str, dst: str, *, keep_source: bool | None = None
    ) -> MovePlan | None:
        """Plan copying the readable-in-``src`` ``keys`` into ``dst`` (promotion or
        demotion). ``keep_source`` defaults to True for promotions (towards hbm)
        and False for demotions. Keys already in ``dst`` or not ready in ``src``
        are skipped; ``None`` when nothing is to move."""
        s, d = self._tier(src), self._tier(dst)
        if s is d:
            raise ProtocolError(f"prepare_move: src and dst are both {src!r}")
        if keep_source is None:
            keep_source = d.index < s.index
        self._expire_pins(self._clock())
        moving: list[BlockKey] = []
        src_slots: list[int] = []
        dst_slots: list[int] = []
        evicted: list[BlockKey] = []
        src_ready = self._ready[s.index]
        for key in keys:
            if key not in src_ready or key in d.slots:
                continue
            d.policy.before_insert(key)
            self._ref(key)  # protects the source copy from eviction while we make room
            if d.num_used >= d.capacity and not self._make_room(d, key, self._parent[key], evicted):
                self._unref(key)
                break
            slot = d.take_slot()
            self._set_pending(key, d, slot)
            moving.append(key)
            src_slots.append(s.slots[key])
            dst_slots.append(slot)
        if not moving:
            return None
        plan = MovePlan(
            self._new_plan_id(), s.name, d.name, tuple(moving), tuple(src_slots), tuple(dst_slots),
            keep_source, tuple(evicted),
        )
        self._plans[plan.plan_id] = plan
        return plan

    def complete_move(self, plan: MovePlan, ok: bool | Sequence[bool]) -> None:
        """Finish ``plan``: moved keys become readable in ``dst`` (and leave ``src``
        unless ``keep_source``); failed ones are dropped from ``dst`` only."""
        self._close_plan(plan)
        s, d = self._tier_by_name[plan.src], self._tier_by_name[plan.dst]
        oks = self._per_key(ok, len(plan.keys))
        src_ready = self._ready[s.index]
        for key, good in zip(reversed(plan.keys), reversed(oks)):
            if not good:
                if self._record:
                    self._events.append(StoreFailed(key, d.name))
                self._drop_residency(key, d, None)
            else:
                self._mark_ready(key, d)
                if key in src_ready:
                    if plan.keep_source:
                        s.policy.on_access(key)  # the source copy was read: a hit there
                    else:
                        s.policy.on_remove(key)
                        self._drop_residency(key, s, "moved")
            self._unref(key)

    # ---------------------------------------------------------- refs and pins

    def acquire(self, keys: Iterable[BlockKey]) -> None:
        """Reference known ``keys`` (e.g. held by a running request): unevictable
        until :meth:`release`. Unknown keys raise ``KeyError``."""
        refs, holds = self._refs, self._holds
        for key in keys:
            if key not in self._parent:
                raise KeyError(key)
            refs[key] = refs.get(key, 0) + 1
            holds[key] = holds.get(key, 0) + 1
            if holds[key] == 1:
                self._hold(key)

    def release(self, keys: Iterable[BlockKey]) -> None:
        """Drop one reference taken by :meth:`acquire` (tail first, so a chain's head
        becomes the most recent block)."""
        holds = self._holds
        for key in reversed(keys) if isinstance(keys, Sequence) else keys:
            if key not in self._parent:
                raise KeyError(key)
            count = holds.get(key, 0)
            if count <= 0:
                raise ProtocolError(f"release of block {key:#x} with no reference")
            if count > 1:
                holds[key] = count - 1
            else:
                del holds[key]
                self._maybe_unhold(key)
            self._unref(key)

    def pin(self, keys: Sequence[BlockKey], ttl_s: float) -> int | None:
        """Pin the known ``keys`` for ``ttl_s`` seconds (extending earlier pins).
        All or nothing: ``None`` (and a :class:`PinRefused` event) when the pin
        budget would be exceeded. Returns the number of blocks pinned."""
        if ttl_s <= 0:
            raise ValueError(f"pin ttl_s={ttl_s!r}: must be > 0")
        now = self._clock()
        self._expire_pins(now)
        known = [k for k in dict.fromkeys(keys) if k in self._parent]
        new = sum(1 for k in known if k not in self._pinned)
        if len(self._pinned) + new > self._pin_budget:
            if self._record:
                self._events.append(PinRefused(len(known), self._pin_budget))
            return None
        until = now + ttl_s
        for key in known:
            pinned_until = self._pinned[key] = max(self._pinned.get(key, 0.0), until)
            heapq.heappush(self._pin_heap, (pinned_until, key))
            self._hold(key)
            if self._record:
                self._events.append(BlockPinned(key, pinned_until))
        return len(known)

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        """Remove pins of ``keys`` (pins also lapse at their TTL)."""
        for key in keys:
            if self._pinned.pop(key, None) is not None:
                if self._record:
                    self._events.append(BlockUnpinned(key, "unpinned"))
                self._maybe_unhold(key)
                self._maybe_forget(key)

    def is_pinned(self, key: BlockKey) -> bool:
        """True while ``key`` holds an unexpired pin."""
        self._expire_pins(self._clock())
        return key in self._pinned

    def num_pinned(self) -> int:
        self._expire_pins(self._clock())
        return len(self._pinned)

    def num_open_plans(self) -> int:
        """Plans prepared and not yet completed (stores, loads, moves): 0 when nothing is in flight."""
        return len(self._plans)

    # ---------------------------------------------------------- reservations

    def reserve(self, tier: str, num_blocks: int) -> bool:
        """Reserve ``num_blocks`` of anonymous space in ``tier`` (e.g. the blocks a
        running request will fill while decoding), evicting as the policy
        chooses. All or nothing: ``False`` when that much cannot be freed (blocks
        evicted while trying stay evicted)."""
        t = self._tier(tier)
        self._expire_pins(self._clock())
        evicted: list[BlockKey] = []
        while t.num_used + num_blocks > t.capacity:
            if not self._evict_one(t, None, None, evicted):
                return False
        t.num_used += num_blocks
        t.num_reserved += num_blocks
        return True

    def unreserve(self, tier: str, num_blocks: int) -> None:
        """Give back space taken by :meth:`reserve`."""
        t = self._tier(tier)
        if num_blocks > t.num_reserved:
            raise ProtocolError(f"unreserve of {num_blocks} blocks in {tier}; only {t.num_reserved} reserved")
        t.num_used -= num_blocks
        t.num_reserved -= num_blocks

    # ------------------------------------------------------------ removal

    def remove(self, keys: Iterable[BlockKey], tier: str | None = None) -> int:
        """Drop ready, unreferenced copies of ``keys`` (in ``tier`` or everywhere),
        children before parents. Returns the number of copies dropped."""
        tiers = self._tiers if tier is None else [self._tier(tier)]
        keys = list(keys)
        doomed = set(keys)
        dropped = 0
        index, refs = self._parent, self._refs
        for key in reversed(keys):
            if key not in index or key in refs:
                continue
            # a parent removed by this same call need not re-enter its order first
            parent = index[key]
            keep_parked = parent in doomed and parent in index and parent not in refs
            for t in tiers:
                ready = self._ready[t.index]
                if key in ready:
                    t.policy.on_remove(key)
                    self._drop_residency(key, t, "removed", unpark_parent=not (keep_parked and parent in ready))
                    dropped += 1
        return dropped

    def private_start(self, keys: Sequence[BlockKey]) -> int:
        """Index in the chain ``keys`` after its last branching block (a block with
        more than one child in the index): ``keys[i:]`` belong to this chain
        alone, ``keys[:i]`` are shared with other chains."""
        num_children = self._num_children
        for i in range(len(keys) - 2, -1, -1):
            if num_children.get(keys[i], 0) > 1:
                return i + 1
        return 0

    def last_present(self, keys: Sequence[BlockKey], tier: str) -> BlockKey | None:
        """The last of ``keys`` readable in ``tier`` (e.g. the tail of a cached prefix)."""
        ready = self._ready[self._tier(tier).index]
        for key in reversed(keys):
            if key in ready:
                return key
        return None

    def present(self, keys: Iterable[BlockKey], tier: str) -> list[BlockKey]:
        """The ``keys`` readable in ``tier``, in order (one set probe each, at C speed)."""
        return list(filter(self._ready[self._tier(tier).index].__contains__, keys))

    def deprioritize(self, keys: Iterable[BlockKey], tier: str) -> int:
        """Make the idle ``keys`` resident in ``tier`` the next victims of its policy
        (last key first, so a chain still goes tail first). Held keys are left
        alone; a policy without a ``to_front`` hook ignores the request.
        Returns the number of keys offered. O(len(keys))."""
        t = self._tier(tier)
        to_front = getattr(t.policy, "to_front", None)
        if to_front is None:
            return 0
        ready = self._ready[t.index]
        offered = [k for k in keys if k in ready]
        for key in offered:  # the tail ends up first in line
            to_front(key)
        return len(offered)

    def evict(self, tier: str, num_blocks: int) -> tuple[BlockKey, ...]:
        """Evict up to ``num_blocks`` from ``tier`` in policy order (e.g. to free
        engine memory). Returns the evicted keys."""
        t = self._tier(tier)
        self._expire_pins(self._clock())
        evicted: list[BlockKey] = []
        for _ in range(num_blocks):
            if not self._evict_one(t, None, None, evicted):
                break
        return tuple(evicted)

    # ------------------------------------------------------------ events

    def take_events(self) -> list[Event]:
        """Return and clear the events recorded since the last call."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Assert every structural invariant (O(blocks)); for tests."""
        index = self._parent
        for t in self._tiers:
            ready = self._ready[t.index]
            slots = list(t.slots.values())
            assert t.slots.keys() <= index.keys(), f"{t.name}: a resident key is missing from the index"
            assert ready <= t.slots.keys(), f"{t.name}: a ready key holds no slot"
            assert len(t.slots) + t.num_reserved == t.num_used <= t.capacity, (t.name, len(t.slots), t.num_used)
            assert len(ready) == t.num_ready == len(t.policy), (t.name, len(ready), t.num_ready, len(t.policy))
            assert len(set(slots)) == len(slots), f"{t.name}: a slot is used twice"
            assert len(set(t.free_slots)) == len(t.free_slots) and not set(slots) & set(t.free_slots)
            assert len(slots) + len(t.free_slots) == t.next_slot, (t.name, "slot leak")
            t.policy.check_invariants()
        num_children: dict[BlockKey, int] = {}
        children = [dict[BlockKey, int]() for _ in self._tiers]
        for key, parent in index.items():
            if parent is not None:
                assert parent in index, f"parent of {key:#x} missing from index"
                num_children[parent] = num_children.get(parent, 0) + 1
                for t in self._tiers:
                    if key in t.slots:
                        children[t.index][parent] = children[t.index].get(parent, 0) + 1
        assert self._num_children == num_children, "child counts out of date"
        for t in self._tiers:
            assert t.children == children[t.index], f"{t.name}: counts of children resident there out of date"
        for counts, what in ((self._refs, "reference"), (self._holds, "hold")):
            assert all(c > 0 for c in counts.values()), f"a {what} count <= 0 is kept"
            assert counts.keys() <= index.keys(), f"a {what} count of a key missing from the index"
        assert all(c <= self._refs.get(k, 0) for k, c in self._holds.items()), "holds exceed references"
        assert self._pinned.keys() <= index.keys(), "a pinned key is missing from the index"
        for key in index:
            assert (self._present_anywhere(key) or key in self._num_children or key in self._refs
                    or key in self._pinned), f"dangling index key {key:#x}"
            best = self._fastest_ready(key)
            assert self._fastest.get(key) == (None if best is None else best.index), "fastest index"
        assert self._fastest.keys() <= index.keys(), "fastest index holds forgotten keys"
        assert len(self._pinned) <= self._pin_budget, "pin budget exceeded"
        held = {k for k in index if k in self._holds or k in self._pinned}
        assert self._held == held, "held set out of date"
        for t in self._tiers:
            parked_keys = getattr(t.policy, "parked_keys", None)
            if parked_keys is not None:
                want = {k for k in self._ready[t.index] if (t.holds and k in held) or k in t.children}
                assert set(parked_keys()) == want, f"{t.name}: the policy's parked keys are out of date"
        for plan in self._plans.values():
            if isinstance(plan, StorePlan):
                t = self._tier_by_name[plan.tier]
                assert all(k in t.slots and k not in self._ready[t.index] for k in plan.keys), (
                    "store plan not pending"
                )

    # ------------------------------------------------------------ internals

    def _tier(self, name: str) -> _Tier:
        try:
            return self._tier_by_name[name]
        except KeyError:
            raise ValueError(f"tier {name!r} is not enabled; enabled: {', '.join(self._tier_by_name)}") from None

    def _fastest_ready(self, key: BlockKey) -> _Tier | None:
        for t in self._tiers:
            if key in self._ready[t.index]:
                return t
        return None

    def _present_anywhere(self, key: BlockKey) -> bool:
        for t in self._tiers:
            if key in t.slots:
                return True
        return False

    def _is_fresh_chain(self, t: _Tier, keys: Sequence[BlockKey], parent: BlockKey | None) -> bool:
        """True when the chain ``keys`` (after ``parent``) fits ``t`` without eviction
        and none of them is in the index: the case :meth:`_reserve_fresh_chain`
        handles (most stores of new tokens). C-speed checks only."""
        n = len(keys)
        if not n or t.num_used + n > t.capacity or not self._parent.keys().isdisjoint(keys):
            return False
        distinct = set(keys)
        return len(distinct) == n and parent not in distinct

    def _reserve_fresh_chain(self, t: _Tier, keys: tuple[BlockKey, ...], parent: BlockKey | None) -> list[int]:
        """The per-key reservation loop of :meth:`prepare_store` for a fresh chain
        (see :meth:`_is_fresh_chain`), with one C-speed update per structure:
        the same index entries, slots (in the same order) and counts. Returns
        the slots taken."""
        index = self._parent
        if parent is not None and parent not in index:
            index[parent] = None  # a stub keeps the chain link (and children counts) alive
        index.update(zip(keys, itertools.chain((parent,), keys)))  # keys[i] follows keys[i - 1]
        interior = dict.fromkeys(keys[:-1], 1)  # each key but the tail has one child, resident here
        self._num_children.update(interior)
        t.children.update(interior)
        slots = t.take_slots(len(keys))
        if _is_descending_run(slots):
            slots.reverse()
        t.slots.update(zip(keys, slots))
        if parent is not None:
            self._num_children[parent] = self._num_children.get(parent, 0) + 1
            self._count_child_in(parent, t)
        return slots

    def _index(self, key: BlockKey, parent: BlockKey | None) -> None:
        """Put ``key`` in the index after ``parent`` (a stub already there learns its parent)."""
        index = self._parent
        if key in index:
            if index[key] is None and parent is not None and parent != key:
                index[key] = parent  # a stub learns its place in the chain
                self._link_child(key, parent)
            return
        index[key] = parent
        if parent is not None:
            self._link_child(key, parent)

    def _link_child(self, key: BlockKey, parent: BlockKey) -> None:
        if parent not in self._parent:
            self._index(parent, None)  # a stub keeps the chain link (and children counts) alive
        self._num_children[parent] = self._num_children.get(parent, 0) + 1
        for t in self._tiers:
            if key in t.slots:
                self._count_child_in(parent, t)

    def _count_child_in(self, parent: BlockKey, t: _Tier) -> None:
        """One more child of ``parent`` is resident in ``t``: the first one parks it there
        (unless a hold parked it already)."""
        count = t.children[parent] = t.children.get(parent, 0) + 1
        if count == 1 and not (t.holds and parent in self._held) and parent in self._ready[t.index]:
            t.policy.on_hold(parent)

    def _set_pending(self, key: BlockKey, t: _Tier, slot: int) -> None:
        """``key`` (in the index) now holds ``slot`` in ``t``, not yet readable."""
        t.slots[key] = slot
        parent = self._parent[key]
        if parent is not None:
            self._count_child_in(parent, t)

    def _mark_ready(self, key: BlockKey, t: _Tier) -> None:
        idx = t.index
        t.num_ready += 1
        self._ready[idx].add(key)
        best = self._fastest.get(key)
        if best is None or idx < best:
            self._fastest[key] = idx
        t.policy.on_insert(key)
        if key in t.children or (t.holds and key in self._held):
            t.policy.on_hold(key)
        if self._record_blocks:
            self._events.append(BlockStored(key, t.name, self._parent[key]))

    def _mark_ready_many(self, keys: Sequence[BlockKey], t: _Tier, fresh: bool = False) -> None:
        """:meth:`_mark_ready` for each of ``keys`` (pending in ``t``), tail first: the
        same policy calls and events in the same order, with C-speed updates of
        the index (it runs once per block of every completed store).

        ``fresh``: ``keys`` are a chain :meth:`_reserve_fresh_chain` reserved, and no
        plan was prepared since. Then none of them is readable in another tier
        and each has the children it was given (its successor, none for the
        tail): nothing to look up for them. Those lookups cost a cache miss per
        key once a large copy ran between prepare and complete."""
        idx, fastest = t.index, self._fastest
        rkeys = list(reversed(keys))
        self._ready[idx].update(rkeys)
        if fresh or fastest.keys().isdisjoint(rkeys):  # readable nowhere else yet (most stores)
            fastest.update(dict.fromkeys(rkeys, idx))
        else:
            for key in rkeys:
                best = fastest.get(key)
                if best is None or idx < best:
                    fastest[key] = idx
        # a pending key is never parked: park each that has a child here or is held
        insert_held_many = t.insert_held_many
        if fresh and insert_held_many is not None and not (t.holds and rkeys[0] in self._held):  # (most stores)
            t.policy.on_insert(rkeys[0])  # the tail, idle
            insert_held_many(rkeys[1:])  # the others, parked under their child
        else:
            self._insert_parking(t, rkeys, fresh)
        if self._record_blocks:  # built at C speed: one BlockStored per key, tail first
            self._events.extend(map(BlockStored, rkeys, itertools.repeat(t.name),
                                    map(self._parent.__getitem__, rkeys)))
        t.num_ready += len(keys)

    def _insert_parking(self, t: _Tier, rkeys: list[BlockKey], fresh: bool) -> None:
        """The policy calls of :meth:`_mark_ready_many` for ``rkeys`` (tail first):
        ``on_insert`` of each, parked at once where it is held or has a child in ``t``."""
        held, children, policy = self._held if t.holds else set(), t.children, t.policy
        if fresh:  # every key but the tail (rkeys[0]) has its child here
            to_park = [rkeys[0] in held]
            to_park += itertools.repeat(True, len(rkeys) - 1)
        elif held:
            to_park = [key in children or key in held for key in rkeys]
        else:
            to_park = list(map(children.__contains__, rkeys))
        insert_held_many = t.insert_held_many
        if insert_held_many is not None:
            parked_keys = list(itertools.compress(rkeys, to_park))
            for key in itertools.compress(rkeys, map(operator.not_, to_park)):
                policy.on_insert(key)
            if parked_keys:
                insert_held_many(parked_keys)
            return
        insert_held = t.insert_held
        for key, park in zip(rkeys, to_park):
            if not park:
                policy.on_insert(key)
            elif insert_held is not None:
                insert_held(key)
            else:
                policy.on_insert(key)
                policy.on_hold(key)

    def _complete_load_ok(self, plan: LoadPlan) -> None:
        """``complete_load`` of a plan whose every block verified: the same events and
        per-tier policy hits (tail first, one ``on_access_many`` per tier) as the
        per-key path. A plan read from one tier whose blocks are all still
        resident and referenced by it alone (most gets) is finished with C-speed
        maps (it runs once per block of every get)."""
        by_name, refs = self._tier_by_name, self._refs
        rkeys = list(reversed(plan.keys))
        if self._record_blocks:
            self._events.extend(map(BlockLoaded, rkeys, reversed(plan.tiers), itertools.repeat(True)))
        first = plan.tiers[0]
        if plan.tiers.count(first) == len(rkeys):
            t = by_name[first]
            if list(map(refs.__getitem__, rkeys)).count(1) == len(rkeys) and self._ready[t.index].issuperset(rkeys):
                collections.deque(map(refs.__delitem__, rkeys), maxlen=0)
                t.policy.on_access_many(rkeys)
                return
        hits: dict[str, list[BlockKey]] = {}
        for key, tier in zip(rkeys, reversed(plan.tiers)):
            count = refs[key] - 1
            if count:
                refs[key] = count
            else:
                del refs[key]
            if key in self._ready[by_name[tier].index]:
                hits.setdefault(tier, []).append(key)  # still resident: nothing to forget
            elif not count:
                self._maybe_forget(key)  # dropped from its tier (e.g. moved) while being read
        for tier, keys in hits.items():
            by_name[tier].policy.on_access_many(keys)

    def _drop_residency(self, key: BlockKey, t: _Tier, reason: RemoveReason | None, unpark_parent: bool = True) -> None:
        """Clear ``key``'s residency in ``t`` (the policy must already have forgotten it)."""
        idx = t.index
        ready = self._ready[idx]
        if key in ready:
            t.num_ready -= 1
            ready.discard(key)
            if self._record:
                self._events.append(BlockRemoved(key, t.name, reason or "removed"))
        t.give_slot(t.slots.pop(key))
        if self._fastest.get(key) == idx:
            nxt = self._fastest_ready(key)
            if nxt is None:
                del self._fastest[key]
            else:
                self._fastest[key] = nxt.index
        parent = self._parent[key]
        if parent is not None:
            count = t.children[parent] - 1
            if count:
                t.children[parent] = count
            else:
                del t.children[parent]
                # the parent is the chain's tail now: unparked, as the next to evict
                if unpark_parent and not (t.holds and parent in self._held) and parent in self._ready[idx]:
                    t.policy.on_unhold(parent, True)
        self._maybe_forget(key)

    def _ref(self, key: BlockKey) -> None:
        """A transient reference (a load or move in flight): unevictable, not parked."""
        self._refs[key] = self._refs.get(key, 0) + 1

    def _unref(self, key: BlockKey) -> None:
        count = self._refs[key] - 1
        if count:
            self._refs[key] = count
        else:
            del self._refs[key]
            self._maybe_forget(key)

    def _hold(self, key: BlockKey) -> None:
        """Park ``key`` in every tier's policy while it is in use (where no child
        there parked it already)."""
        if key in self._held:
            return
        self._held.add(key)
        for t in self._tiers:
            if t.holds and key in self._ready[t.index] and key not in t.children:
                t.policy.on_hold(key)

    def _maybe_unhold(self, key: BlockKey) -> None:
        """Back into the eviction orders (as most recent) once no reference and no pin hold it."""
        if key in self._holds or key in self._pinned or key not in self._held:
            return
        self._held.discard(key)
        for t in self._tiers:
            if t.holds and key in self._ready[t.index] and key not in t.children:  # (a child there keeps it parked)
                t.policy.on_unhold(key)

    def _maybe_forget(self, key: BlockKey) -> None:
        """Delete index keys that hold nothing, walking up the chain."""
        index, num_children = self._parent, self._num_children
        while (
            key not in num_children
            and key not in self._refs
            and key not in self._pinned
            and not self._present_anywhere(key)
        ):
            parent = index.pop(key)
            if parent is None:
                return
            key = parent
            count = num_children[key] - 1
            if count:
                num_children[key] = count
            else:
                del num_children[key]

    def _make_room(self, t: _Tier, incoming: BlockKey, parent: BlockKey | None, evicted: list[BlockKey]) -> bool:
        while t.num_used >= t.capacity:
            if not self._evict_one(t, incoming, parent, evicted):
                return False
        return True

    def _evict_one(
        self, t: _Tier, incoming: BlockKey | None, protect: BlockKey | None, evicted: list[BlockKey]
    ) -> bool:
        refs, children = self._refs, t.children

        if t.holds:
            def is_evictable(key: BlockKey) -> bool:  # held and interior blocks are parked: never offered
                return key != protect and key not in refs and key not in children
        else:  # acquire() references do not protect this tier's copies; loads and moves do
            holds = self._holds

            def is_evictable(key: BlockKey) -> bool:
                return key != protect and refs.get(key, 0) == holds.get(key, 0) and key not in children

        victim = t.policy.pop_victim(is_evictable, incoming)
        if victim is None:
            return False
        evicted.append(victim)
        self._drop_residency(victim, t, "evicted")
        return True

    def _expire_pins(self, now: float) -> None:
        heap = self._pin_heap
        while heap and heap[0][0] <= now:
            until, key = heapq.heappop(heap)
            if self._pinned.get(key) == until:
                del self._pinned[key]
                if self._record:
                    self._events.append(BlockUnpinned(key, "expired"))
                self._maybe_unhold(key)
                self._maybe_forget(key)

    def _new_plan_id(self) -> int:
        self._last_plan_id += 1
        return self._last_plan_id

    def _close_plan(self, plan: StorePlan | LoadPlan | MovePlan) -> None:
        if self._plans.pop(plan.plan_id, None) is None:
            raise ProtocolError(f"plan {plan.plan_id} is not open (completed twice, or not from this manager)")

    @staticmethod
    def _per_key(ok: bool | Sequence[bool], n: int) -> Sequence[bool]:
        if isinstance(ok, bool):
            return [ok] * n
        if len(ok) != n:
            raise ProtocolError(f"ok has {len(ok)} entries for a plan of {n} keys")
        return ok
