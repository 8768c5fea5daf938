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

_PENDING = 0
_READY = 1
_PARENT = operator.attrgetter("parent")


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


class _Block:
    """Index node of one key: residency per tier, chain links, refs, pin."""

    __slots__ = ("key", "parent", "state", "slot", "children_in", "num_children", "ref_count", "hold_count",
                 "pin_until")

    def __init__(self, key: BlockKey, parent: BlockKey | None, num_tiers: int) -> None:
        self.key = key
        self.parent = parent
        self.state: list[int | None] = [None] * num_tiers  # None: absent
        self.slot: list[int] = [0] * num_tiers
        self.children_in = [0] * num_tiers  # children with any residency in that tier
        self.num_children = 0  # child nodes in the index
        self.ref_count = 0  # every reference: acquire() holds plus in-flight loads and moves
        self.hold_count = 0  # acquire() references only (parked while > 0)
        self.pin_until = 0.0

    def present_anywhere(self) -> bool:
        return self.state.count(None) != len(self.state)


class _Tier:
    """Slot pool and policy of one tier."""

    __slots__ = ("name", "index", "capacity", "policy", "free_slots", "next_slot", "num_used", "num_ready",
                 "num_reserved")

    def __init__(self, name: str, index: int, capacity: int, policy: EvictionPolicy) -> None:
        self.name = name
        self.index = index
        self.capacity = capacity
        self.policy = policy
        self.free_slots: list[int] = []
        self.next_slot = 0
        self.num_used = 0  # pending + ready residencies + reserved space
        self.num_ready = 0
        self.num_reserved = 0  # anonymous space (e.g. a running request's decode blocks)

    def take_slot(self) -> int:
        self.num_used += 1
        if self.free_slots:
            return self.free_slots.pop()
        self.next_slot += 1
        return self.next_slot - 1

    def give_slot(self, slot: int) -> None:
        self.num_used -= 1
        self.free_slots.append(slot)


class TierManager:
    """Metadata of the enabled tiers; see the module docstring for its rules.

    ``clock`` gives the time used for pins (wall clock live, simulated in
    replay). ``pin_budget_blocks`` caps how many blocks may be pinned at once.
    ``record_events=False`` records no events; ``record_block_events=False``
    leaves out only ``BlockStored`` and ``BlockLoaded`` (one per block of every
    completed store and load), for an owner that needs removals and failures
    (to free bytes) but publishes no per-block stream.
    """

    def __init__(
        self,
        tiers: Sequence[TierSpec],
        *,
        pin_budget_blocks: int = 0,
        clock: Callable[[], float] = time.monotonic,
        record_events: bool = True,
        record_block_events: bool = True,
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
        ordered = sorted(tiers, key=lambda s: TIER_ORDER.index(s.name))
        self._tiers = [
            _Tier(
                s.name, i, s.capacity_blocks,
                make_policy(s.policy, s.capacity_blocks, f"tiers.{s.name}.policy") if isinstance(s.policy, str)
                else s.policy,
            )
            for i, s in enumerate(ordered)
        ]
        self._tier_by_name = {t.name: t for t in self._tiers}
        self._blocks: dict[BlockKey, _Block] = {}
        self._plans: dict[int, StorePlan | LoadPlan | MovePlan] = {}
        self._plan_ids = itertools.count(1)
        self._events: list[Event] = []
        self._record = record_events
        # the per-block BlockStored / BlockLoaded, one per block of every completed
        # store and load: an owner that only frees bytes (removals) can go without
        self._record_blocks = record_events and record_block_events
        self._clock = clock
        self._pin_budget = pin_budget_blocks
        self._pinned: dict[BlockKey, float] = {}
        self._names = tuple(t.name for t in self._tiers)
        self._ready: list[set[BlockKey]] = [set() for _ in self._tiers]  # readable keys per tier
        self._fastest: dict[BlockKey, int] = {}  # readable key -> index of its fastest tier
        self._held: set[BlockKey] = set()  # referenced or pinned blocks
        # keys parked in each tier's policy: held, or with a child present in that tier
        self._parked: list[set[BlockKey]] = [set() for _ in self._tiers]
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
        node = self._blocks.get(key)
        if node is None:
            return ()
        return tuple(t.name for t in self._tiers if node.state[t.index] == _READY)

    def is_pending(self, key: BlockKey, tier: str) -> bool:
        """True while a store or move of ``key`` into ``tier`` is prepared but not completed."""
        node = self._blocks.get(key)
        return node is not None and node.state[self._tier(tier).index] == _PENDING

    def slot_of(self, key: BlockKey, tier: str) -> int | None:
        """Slot of a readable ``key`` in ``tier``, or ``None``."""
        node = self._blocks.get(key)
        t = self._tier(tier)
        if node is None or node.state[t.index] != _READY:
            return None
        return node.slot[t.index]

    def parent_of(self, key: BlockKey) -> BlockKey | None:
        node = self._blocks.get(key)
        return None if node is None else node.parent

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
        t = self._tier(tier)
        now = self._clock()
        self._expire_pins(now)
        reserved: list[BlockKey] = []
        slots: list[int] = []
        skipped: list[BlockKey] = []
        evicted: list[BlockKey] = []
        # hot loop (once per key of every put): attribute lookups hoisted
        idx, blocks, ntiers, free_slots, capacity = t.index, self._blocks, len(self._tiers), t.free_slots, t.capacity
        before_insert = t.policy.before_insert if getattr(t.policy, "adapts_before_insert", True) else None
        prev = parent if chain else None
        own = None  # the node of prev when this plan reserved it: pending, so never evicted meanwhile
        for key in keys:
            node = blocks.get(key)
            if node is not None and node.state[idx] is not None:
                skipped.append(key)
                if chain:
                    prev = key
                own = None
                continue
            if before_insert is not None:
                before_insert(key)
            if t.num_used >= capacity and not self._make_room(t, key, prev, now, evicted):
                break
            if node is None and prev is not None:
                pnode = own if own is not None else blocks.get(prev)
            else:
                pnode = None
            if pnode is not None and pnode.state[idx] != _READY:
                # the common case (a new key after a parent not readable in this tier,
                # e.g. the previous key of this very plan): _reserve_new_child inlined
                node = blocks[key] = _Block(key, prev, ntiers)
                pnode.num_children += 1
                pnode.children_in[idx] += 1
                t.num_used += 1  # take_slot, inlined
                if free_slots:
                    slot = free_slots.pop()
                else:
                    slot = t.next_slot
                    t.next_slot = slot + 1
                node.slot[idx] = slot
                node.state[idx] = _PENDING
            elif node is None and prev is not None:
                slot = self._reserve_new_child(key, prev, t)
                node = blocks[key]
            else:
                node = self._node(key, prev)
                slot = t.take_slot()
                self._set_residency(node, t, _PENDING, slot)
            reserved.append(key)
            slots.append(slot)
            if chain:
                prev, own = key, node
        if not reserved and not skipped:
            return None
        plan = StorePlan(next(self._plan_ids), t.name, tuple(reserved), tuple(slots), tuple(skipped), tuple(evicted))
        self._plans[plan.plan_id] = plan
        return plan

    def complete_store(self, plan: StorePlan, ok: bool | Sequence[bool]) -> None:
        """Finish ``plan``: keys with ok become readable, the others are dropped."""
        self._close_plan(plan)
        t = self._tier_by_name[plan.tier]
        oks = self._per_key(ok, len(plan.keys))
        if ok is True or all(oks):
            self._mark_ready_many(plan.keys, t)
            return
        # tail first, so the policy sees a chain's head as its most recent block
        for key, good in zip(reversed(plan.keys), reversed(oks)):
            node = self._blocks[key]
            if good:
                self._mark_ready(node, t)
            else:
                if self._record:
                    self._events.append(StoreFailed(key, t.name))
                self._drop_residency(node, t, None)

    # --------------------------------------------------------------- load

    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadPlan | None:
        """Plan reading the longest readable prefix of ``keys`` from its fastest
        tiers; references those blocks until ``complete_load``. ``None`` on a miss."""
        hit = self.lookup(keys)
        if hit.num_blocks == 0:
            return None
        found = tuple(keys[: hit.num_blocks])
        nodes = list(map(self._blocks.__getitem__, found))
        for node in nodes:
            node.ref_count += 1  # _ref, inlined: once per key of every get
        # tier_indices index self._tiers, whose positions are the tiers' indices
        slots = tuple(node.slot[i] for node, i in zip(nodes, hit.tier_indices))
        plan = LoadPlan(next(self._plan_ids), found, hit.tiers, slots)
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
            node = self._blocks[key]
            t = self._tier_by_name[tier]
            if self._record_blocks:
                self._events.append(BlockLoaded(key, tier, good))
            if node.state[t.index] == _READY:
                if good:
                    t.policy.on_access(key)
                else:
                    t.policy.on_remove(key)
                    self._drop_residency(node, t, "failed_verify")
            self._unref(node)

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
        now = self._clock()
        self._expire_pins(now)
        moving: list[BlockKey] = []
        src_slots: list[int] = []
        dst_slots: list[int] = []
        evicted: list[BlockKey] = []
        for key in keys:
            node = self._blocks.get(key)
            if node is None or node.state[s.index] != _READY or node.state[d.index] is not None:
                continue
            d.policy.before_insert(key)
            self._ref(node)  # protects the source copy from eviction while we make room
            if d.num_used >= d.capacity and not self._make_room(d, key, node.parent, now, evicted):
                self._unref(node)
                break
            self._set_residency(node, d, _PENDING, d.take_slot())
            moving.append(key)
            src_slots.append(node.slot[s.index])
            dst_slots.append(node.slot[d.index])
        if not moving:
            return None
        plan = MovePlan(
            next(self._plan_ids), s.name, d.name, tuple(moving), tuple(src_slots), tuple(dst_slots),
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
        for key, good in zip(reversed(plan.keys), reversed(oks)):
            node = self._blocks[key]
            if not good:
                if self._record:
                    self._events.append(StoreFailed(key, d.name))
                self._drop_residency(node, d, None)
            else:
                self._mark_ready(node, d)
                if node.state[s.index] == _READY:
                    if plan.keep_source:
                        s.policy.on_access(key)  # the source copy was read: a hit there
                    else:
                        s.policy.on_remove(key)
                        self._drop_residency(node, s, "moved")
            self._unref(node)

    # ---------------------------------------------------------- refs and pins

    def acquire(self, keys: Iterable[BlockKey]) -> None:
        """Reference known ``keys`` (e.g. held by a running request): unevictable
        until :meth:`release`. Unknown keys raise ``KeyError``."""
        for key in keys:
            node = self._blocks[key]
            node.ref_count += 1
            node.hold_count += 1
            if node.hold_count == 1:
                self._hold(node)

    def release(self, keys: Iterable[BlockKey]) -> None:
        """Drop one reference taken by :meth:`acquire` (tail first, so a chain's head
        becomes the most recent block)."""
        for key in reversed(keys) if isinstance(keys, Sequence) else keys:
            node = self._blocks[key]
            if node.hold_count <= 0:
                raise ProtocolError(f"release of block {key:#x} with no reference")
            node.hold_count -= 1
            if not node.hold_count:
                self._maybe_unhold(node)
            self._unref(node)

    def pin(self, keys: Sequence[BlockKey], ttl_s: float) -> int | None:
        """Pin the known ``keys`` for ``ttl_s`` seconds (extending earlier pins).
        All or nothing: ``None`` (and a :class:`PinRefused` event) when the pin
        budget would be exceeded. Returns the number of blocks pinned."""
        if ttl_s <= 0:
            raise ValueError(f"pin ttl_s={ttl_s!r}: must be > 0")
        now = self._clock()
        self._expire_pins(now)
        known = [k for k in dict.fromkeys(keys) if k in self._blocks]
        new = sum(1 for k in known if k not in self._pinned)
        if len(self._pinned) + new > self._pin_budget:
            if self._record:
                self._events.append(PinRefused(len(known), self._pin_budget))
            return None
        until = now + ttl_s
        for key in known:
            node = self._blocks[key]
            node.pin_until = max(node.pin_until, until)
            self._pinned[key] = node.pin_until
            heapq.heappush(self._pin_heap, (node.pin_until, key))
            self._hold(node)
            if self._record:
                self._events.append(BlockPinned(key, node.pin_until))
        return len(known)

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        """Remove pins of ``keys`` (pins also lapse at their TTL)."""
        for key in keys:
            if self._pinned.pop(key, None) is not None:
                node = self._blocks[key]
                node.pin_until = 0.0
                if self._record:
                    self._events.append(BlockUnpinned(key, "unpinned"))
                self._maybe_unhold(node)
                self._maybe_forget(node)

    def is_pinned(self, key: BlockKey) -> bool:
        """True while ``key`` holds an unexpired pin."""
        self._expire_pins(self._clock())
        return key in self._pinned

    def num_pinned(self) -> int:
        self._expire_pins(self._clock())
        return len(self._pinned)

    # ---------------------------------------------------------- reservations

    def reserve(self, tier: str, num_blocks: int) -> bool:
        """Reserve ``num_blocks`` of anonymous space in ``tier`` (e.g. the blocks a
        running request will fill while decoding), evicting as the policy
        chooses. All or nothing: ``False`` when that much cannot be freed (blocks
        evicted while trying stay evicted)."""
        t = self._tier(tier)
        now = self._clock()
        self._expire_pins(now)
        evicted: list[BlockKey] = []
        while t.num_used + num_blocks > t.capacity:
            if not self._evict_one(t, None, None, now, evicted):
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
        for key in reversed(keys):
            node = self._blocks.get(key)
            if node is None or node.ref_count:
                continue
            # a parent removed by this same call need not re-enter its order first
            parent = self._blocks.get(node.parent) if node.parent in doomed else None
            keep_parked = parent is not None and not parent.ref_count
            for t in tiers:
                if node.state[t.index] == _READY:
                    t.policy.on_remove(key)
                    self._drop_residency(node, t, "removed",
                                         unpark_parent=not (keep_parked and parent.state[t.index] == _READY))
                    dropped += 1
        return dropped

    def private_start(self, keys: Sequence[BlockKey]) -> int:
        """Index in the chain ``keys`` after its last branching block (a block with
        more than one child in the index): ``keys[i:]`` belong to this chain
        alone, ``keys[:i]`` are shared with other chains."""
        blocks = self._blocks
        for i in range(len(keys) - 2, -1, -1):
            node = blocks.get(keys[i])
            if node is not None and node.num_children > 1:
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
        now = self._clock()
        self._expire_pins(now)
        evicted: list[BlockKey] = []
        for _ in range(num_blocks):
            if not self._evict_one(t, None, None, now, evicted):
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
        for t in self._tiers:
            used = [n for n in self._blocks.values() if n.state[t.index] is not None]
            ready = [n for n in used if n.state[t.index] == _READY]
            slots = [n.slot[t.index] for n in used]
            assert len(used) + t.num_reserved == t.num_used <= t.capacity, (t.name, len(used), t.num_used)
            assert len(ready) == t.num_ready == len(t.policy), (t.name, len(ready), t.num_ready, len(t.policy))
            assert self._ready[t.index] == {n.key for n in ready}, f"{t.name}: ready set out of date"
            assert len(set(slots)) == len(slots), f"{t.name}: a slot is used twice"
            assert len(set(t.free_slots)) == len(t.free_slots) and not set(slots) & set(t.free_slots)
            assert len(slots) + len(t.free_slots) == t.next_slot, (t.name, "slot leak")
            t.policy.check_invariants()
        children_in: dict[BlockKey, list[int]] = {}
        num_children: dict[BlockKey, int] = {}
        for node in self._blocks.values():
            assert node.ref_count >= 0, f"negative ref count on {node.key:#x}"
            assert node.present_anywhere() or node.num_children or node.ref_count or node.key in self._pinned, (
                f"dangling index node {node.key:#x}"
            )
            if node.parent is not None:
                assert node.parent in self._blocks, f"parent of {node.key:#x} missing from index"
                num_children[node.parent] = num_children.get(node.parent, 0) + 1
                counts = children_in.setdefault(node.parent, [0] * len(self._tiers))
                for t in self._tiers:
                    counts[t.index] += node.state[t.index] is not None
        for node in self._blocks.values():
            assert node.num_children == num_children.get(node.key, 0), f"num_children of {node.key:#x}"
            assert node.children_in == children_in.get(node.key, [0] * len(self._tiers)), (
                f"children_in of {node.key:#x}"
            )
        for node in self._blocks.values():
            best = self._fastest_ready(node)
            assert self._fastest.get(node.key) == (None if best is None else best.index), "fastest index"
        assert set(self._fastest) <= set(self._blocks), "fastest index holds forgotten keys"
        assert len(self._pinned) <= self._pin_budget, "pin budget exceeded"
        held = {n.key for n in self._blocks.values() if n.hold_count or n.key in self._pinned}
        assert all(n.hold_count <= n.ref_count for n in self._blocks.values()), "holds exceed references"
        assert self._held == held, "held set out of date"
        for t in self._tiers:
            want = {n.key for n in self._blocks.values()
                    if n.state[t.index] == _READY and (n.key in held or n.children_in[t.index])}
            assert self._parked[t.index] == want, f"{t.name}: parked set out of date"
        for plan in self._plans.values():
            if isinstance(plan, StorePlan):
                idx = self._tier_by_name[plan.tier].index
                assert all(self._blocks[k].state[idx] == _PENDING for k in plan.keys), "store plan not pending"

    # ------------------------------------------------------------ internals

    def _tier(self, name: str) -> _Tier:
        try:
            return self._tier_by_name[name]
        except KeyError:
            raise ValueError(f"tier {name!r} is not enabled; enabled: {', '.join(self._tier_by_name)}") from None

    def _fastest_ready(self, node: _Block) -> _Tier | None:
        for t in self._tiers:
            if node.state[t.index] == _READY:
                return t
        return None

    def _node(self, key: BlockKey, parent: BlockKey | None) -> _Block:
        node = self._blocks.get(key)
        if node is not None:
            if node.parent is None and parent is not None and parent != key:
                node.parent = parent  # a stub learns its place in the chain
                self._link_child(node, parent)
            return node
        node = _Block(key, parent, len(self._tiers))
        self._blocks[key] = node
        if parent is not None:
            self._link_child(node, parent)
        return node

    def _reserve_new_child(self, key: BlockKey, parent: BlockKey, t: _Tier) -> int:
        """``_node`` + ``take_slot`` + ``_set_residency(PENDING)`` for a ``key`` not yet
        in the index whose parent is ``parent`` (once per key of most stores).
        Returns the slot taken in ``t``."""
        blocks, idx = self._blocks, t.index
        node = blocks[key] = _Block(key, parent, len(self._tiers))
        pnode = blocks.get(parent)
        if pnode is None:  # a stub keeps the chain link (and children counts) alive
            pnode = self._node(parent, None)
        pnode.num_children += 1
        slot = node.slot[idx] = t.take_slot()
        node.state[idx] = _PENDING
        pnode.children_in[idx] += 1
        if pnode.children_in[idx] == 1 and pnode.state[idx] == _READY:
            self._sync_park(pnode, t)
        return slot

    def _link_child(self, node: _Block, parent: BlockKey) -> None:
        pnode = self._blocks.get(parent)
        if pnode is None:  # a stub keeps the chain link (and children counts) alive
            pnode = self._node(parent, None)
        pnode.num_children += 1
        for t in self._tiers:
            if node.state[t.index] is not None:
                pnode.children_in[t.index] += 1
                self._sync_park(pnode, t)

    def _set_residency(self, node: _Block, t: _Tier, state: int, slot: int) -> None:
        node.state[t.index] = state
        node.slot[t.index] = slot
        if node.parent is not None:
            pnode = self._blocks[node.parent]
            pnode.children_in[t.index] += 1
            if pnode.children_in[t.index] == 1 and pnode.state[t.index] == _READY:
                self._sync_park(pnode, t)

    def _mark_ready(self, node: _Block, t: _Tier) -> None:
        node.state[t.index] = _READY
        t.num_ready += 1
        self._ready[t.index].add(node.key)
        best = self._fastest.get(node.key)
        if best is None or t.index < best:
            self._fastest[node.key] = t.index
        t.policy.on_insert(node.key)
        if node.children_in[t.index] or node.key in self._held:
            self._sync_park(node, t)
        if self._record_blocks:
            self._events.append(BlockStored(node.key, t.name, node.parent))

    def _mark_ready_many(self, keys: Sequence[BlockKey], t: _Tier) -> None:
        """:meth:`_mark_ready` for each of ``keys`` (pending in ``t``), tail first: the
        same policy calls and events in the same order, with the lookups hoisted
        out of the loop (it runs once per block of every completed store)."""
        idx, name, blocks = t.index, t.name, self._blocks
        ready, fastest, held, parked = self._ready[idx], self._fastest, self._held, self._parked[idx]
        on_insert, on_hold = t.policy.on_insert, t.policy.on_hold
        insert_held = getattr(t.policy, "on_insert_held", None)
        insert_held_many = getattr(t.policy, "on_insert_held_many", None)
        to_park: list[BlockKey] | None = [] if insert_held_many is not None else None
        rkeys = list(reversed(keys))
        nodes = list(map(blocks.__getitem__, rkeys))
        ready.update(rkeys)
        for key, node in zip(rkeys, nodes):
            node.state[idx] = _READY
            best = fastest.get(key)
            if best is None or idx < best:
                fastest[key] = idx
            if (node.children_in[idx] or key in held) and key not in parked:  # _sync_park of a ready block
                parked.add(key)
                if to_park is not None:
                    to_park.append(key)
                elif insert_held is not None:
                    insert_held(key)
                else:
                    on_insert(key)
                    on_hold(key)
            else:
                on_insert(key)
        if to_park:
            insert_held_many(to_park)
        if self._record_blocks:  # built at C speed: one BlockStored per key, tail first
            self._events.extend(map(BlockStored, rkeys, itertools.repeat(name), map(_PARENT, nodes)))
        t.num_ready += len(keys)

    def _complete_load_ok(self, plan: LoadPlan) -> None:
        """``complete_load`` of a plan whose every block verified: the same events and
        per-tier policy hits (tail first, one ``on_access_many`` per tier) as the
        per-key path, with the lookups hoisted (it runs once per block of every get)."""
        blocks, by_name = self._blocks, self._tier_by_name
        events = self._events if self._record_blocks else None
        hits: dict[str, list[BlockKey]] = {}
        for key, tier in zip(reversed(plan.keys), reversed(plan.tiers)):
            node = blocks[key]
            if events is not None:
                events.append(BlockLoaded(key, tier, True))
            node.ref_count -= 1
            if node.state[by_name[tier].index] == _READY:
                hits.setdefault(tier, []).append(key)  # still resident: nothing to forget
            elif not node.ref_count:
                self._maybe_forget(node)  # dropped from its tier (e.g. moved) while being read
        for tier, keys in hits.items():
            by_name[tier].policy.on_access_many(keys)

    def _drop_residency(self, node: _Block, t: _Tier, reason: RemoveReason | None, unpark_parent: bool = True) -> None:
        """Clear ``node``'s residency in ``t`` (the policy must already have forgotten it)."""
        if node.state[t.index] == _READY:
            t.num_ready -= 1
            self._ready[t.index].discard(node.key)
            self._parked[t.index].discard(node.key)
            if self._record:
                self._events.append(BlockRemoved(node.key, t.name, reason or "removed"))
        node.state[t.index] = None
        if self._fastest.get(node.key) == t.index:
            nxt = self._fastest_ready(node)
            if nxt is None:
                del self._fastest[node.key]
            else:
                self._fastest[node.key] = nxt.index
        t.give_slot(node.slot[t.index])
        if node.parent is not None:
            pnode = self._blocks[node.parent]
            pnode.children_in[t.index] -= 1
            if not pnode.children_in[t.index] and unpark_parent:  # the parent is the chain's tail now
                self._sync_park(pnode, t, front=True)
        self._maybe_forget(node)

    def _ref(self, node: _Block) -> None:
        """A transient reference (a load or move in flight): unevictable, not parked."""
        node.ref_count += 1

    def _unref(self, node: _Block) -> None:
        node.ref_count -= 1
        if not node.ref_count:
            self._maybe_forget(node)

    def _hold(self, node: _Block) -> None:
        """Park ``node`` in every tier's policy while it is in use."""
        if node.key in self._held:
            return
        self._held.add(node.key)
        for t in self._tiers:
            self._sync_park(node, t)

    def _maybe_unhold(self, node: _Block) -> None:
        """Back into the eviction orders (as most recent) once no reference and no pin hold it."""
        key = node.key
        if node.hold_count or key in self._pinned or key not in self._held:
            return
        self._held.discard(key)
        for t in self._tiers:
            self._sync_park(node, t)

    def _sync_park(self, node: _Block, t: _Tier, front: bool = False) -> None:
        """Park a ready block in ``t``'s policy while it is held or has a child in
        ``t``; unpark it otherwise (at the eviction end with ``front``)."""
        idx = t.index
        if node.state[idx] != _READY:
            return
        key = node.key
        parked = self._parked[idx]
        if key in self._held or node.children_in[idx]:
            if key not in parked:
                parked.add(key)
                t.policy.on_hold(key)
        elif key in parked:
            parked.discard(key)
            t.policy.on_unhold(key, front)

    def _maybe_forget(self, node: _Block) -> None:
        """Delete index nodes that hold nothing, walking up the chain."""
        while (
            not node.num_children
            and not node.ref_count
            and node.key not in self._pinned
            and not node.present_anywhere()
        ):
            del self._blocks[node.key]
            if node.parent is None:
                return
            node = self._blocks[node.parent]
            node.num_children -= 1

    def _make_room(
        self, t: _Tier, incoming: BlockKey, parent: BlockKey | None, now: float, evicted: list[BlockKey]
    ) -> bool:
        while t.num_used >= t.capacity:
            if not self._evict_one(t, incoming, parent, now, evicted):
                return False
        return True

    def _evict_one(
        self, t: _Tier, incoming: BlockKey | None, protect: BlockKey | None, now: float, evicted: list[BlockKey]
    ) -> bool:
        idx = t.index
        blocks = self._blocks

        def is_evictable(key: BlockKey) -> bool:  # held and interior blocks are parked: never offered
            node = blocks[key]
            return key != protect and not node.ref_count and not node.children_in[idx]

        victim = t.policy.pop_victim(is_evictable, incoming)
        if victim is None:
            return False
        evicted.append(victim)
        self._drop_residency(blocks[victim], t, "evicted")
        return True

    def _expire_pins(self, now: float) -> None:
        heap = self._pin_heap
        while heap and heap[0][0] <= now:
            until, key = heapq.heappop(heap)
            if self._pinned.get(key) == until:
                del self._pinned[key]
                node = self._blocks[key]
                node.pin_until = 0.0
                if self._record:
                    self._events.append(BlockUnpinned(key, "expired"))
                self._maybe_unhold(node)
                self._maybe_forget(node)

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

