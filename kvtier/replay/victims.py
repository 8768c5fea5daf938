"""Exclusive DRAM in the replay: HBM's victims written down to DRAM as they are evicted.

Owns: the HBM victims waiting to be written down, those on their way (parent,
when they land, the DRAM slot they claimed), and the rules of a victim cache
on a surface with a victim write (``write_back_dram == "evict"``):

* a victim without a DRAM copy is copied down before its HBM slot is reused;
  one with a copy is refreshed there;
* a promotion out of DRAM moves the block (:meth:`VictimCache.keep_source`);
* with ``victim_swap``, victims take their DRAM slots once the copy and the
  loads that made room for them are done; without it each claims its slot
  when it leaves HBM (the live write-back);
* a request that wants victims still on their way lands them at once.

Must not decide admission or advance the clock: the simulator asks it, and
its events run through the simulator's queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..keys import BlockKey

if TYPE_CHECKING:
    from .state import SimState


class VictimCache:
    """The simulator's exclusive DRAM; ``on`` is False where the policy or surface has none."""

    def __init__(self, sim: "SimState", on: bool) -> None:
        self.sim, self.on = sim, on
        self.pending: list[tuple[BlockKey, BlockKey | None]] = []  # HBM victims to write down
        # copying down: parent, lands at, and its DRAM store (the slot it claimed; None: claimed when it lands)
        self.on_way: dict[BlockKey, tuple[BlockKey | None, float, Any]] = {}

    def logging(self, inner: Any) -> "_VictimLog":
        """``inner``, an HBM eviction policy, that also reports what it evicts here."""
        return _VictimLog(inner, self)

    def keep_source(self, src: str) -> bool:
        """Whether a promotion out of ``src`` keeps its copy there. Exclusive DRAM
        moves (a DRAM copy of what HBM holds would only fill DRAM, parked under
        the suffix HBM writes back later); any other tier keeps its copy."""
        return not (self.on and src == "dram")

    def write(self, after: float | None = None) -> float | None:
        """HBM victims without a DRAM copy are written down (the engine copies them
        out before it reuses their slots), those with one are refreshed there.
        Returns when the copy is done (``None``: nothing to copy).

        A victim takes its DRAM slot when its copy lands, or at ``after`` (when
        the loads that made room for it in HBM have freed their DRAM slots): the
        victims and the loads of one admission swap places, as a mover does
        through its staging buffer, instead of evicting from a DRAM that the
        loads are about to empty. Until it lands a victim is readable nowhere."""
        sim = self.sim
        victims, self.pending = self.pending, []
        mgr = sim.mgr
        todo = []
        for key, parent in victims:
            if mgr.contains(key, "hbm"):
                continue
            if mgr.contains(key, "dram"):
                mgr.touch((key,), "dram")
                continue
            todo.append((key, parent))
        plans: list[Any] = [None] * len(todo)
        if not sim.surface.victim_swap:  # each claims its DRAM slot now (the live write-back)
            kept = []
            for key, parent in todo:
                if mgr.is_pending(key, "dram"):  # on its way there already
                    continue
                plan = mgr.prepare_store("dram", (key,), parent)
                if plan is None or not plan.keys:
                    sim.counters["write_back_no_room"] = sim.counters.get("write_back_no_room", 0) + 1
                    continue
                kept.append(((key, parent), plan))
            todo, plans = [k for k, _ in kept], [p for _, p in kept]
            after = None
        if not todo:
            return None
        done = sim.transfer_s("hbm", "dram", len(todo),  # one copy for the lot
                             sim.mover.num_to_encode(mgr, sim.lower, [key for key, _ in todo], "dram"))
        lands = done if after is None else max(done, after)
        self.on_way.update((key, (parent, lands, plan)) for (key, parent), plan in zip(todo, plans))
        sim.schedule_at(lands, self._landed, todo)
        return done

    def _landed(self, todo: list[tuple[BlockKey, BlockKey | None]]) -> None:
        on_way = self.on_way
        for key, parent in todo:
            entry = on_way.pop(key, None)
            if entry is None:
                continue  # landed early (:meth:`land`)
            self._store(key, parent, entry[2])
        if self.sim.surface.defer_loads:  # a deferred request may find its blocks now
            self.sim.admission_blocked = False

    def wanted(self, keys: Sequence[BlockKey], n: int) -> bool:
        """Whether ``keys[n]``, the first block a request's cached prefix lacks, is on its way down."""
        return bool(self.on_way) and n < len(keys) and keys[n] in self.on_way

    def land(self, keys: Sequence[BlockKey], n: int) -> float:
        """A request wants victims still on their way down (``keys[n]``, the first
        block its cached prefix lacks, is one): they take their DRAM slots now,
        so the request finds them, and it loads them once they have landed.
        Returns when the last of them lands (``0.0``: none were on their way)."""
        mgr, on_way = self.sim.mgr, self.on_way
        lands = 0.0
        for key in keys[n:]:
            entry = on_way.pop(key, None)
            if entry is None:
                if not mgr.contains(key):
                    break
                continue
            lands = max(lands, entry[1])
            self._store(key, entry[0], entry[2])
            self.sim.counters["victims_landed_early"] += 1
        return lands

    def _store(self, key: BlockKey, parent: BlockKey | None, plan: Any = None) -> None:
        mgr = self.sim.mgr
        if plan is not None:  # its slot was claimed when it left HBM
            mgr.complete_store(plan, True)
            return
        if mgr.contains(key, "hbm") or mgr.contains(key, "dram") or mgr.is_pending(key, "dram"):
            return  # back in HBM, or stored again meanwhile
        plan = mgr.prepare_store("dram", (key,), parent)
        if plan is not None:
            mgr.complete_store(plan, True)


class _VictimLog:
    """An HBM eviction policy that also tells the victim cache what it evicted."""

    def __init__(self, inner: Any, cache: VictimCache) -> None:
        self._inner, self._cache = inner, cache
        self.name = inner.name

    def pop_victim(self, is_evictable: Any, incoming: BlockKey | None = None) -> BlockKey | None:
        key = self._inner.pop_victim(is_evictable, incoming)
        if key is not None:
            self._cache.pending.append((key, self._cache.sim.mgr.parent_of(key)))
        return key

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)
