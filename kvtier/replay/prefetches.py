"""Prefetch and staging in the replay: lower-tier blocks promoted ahead of the request that reads them.

Owns: the prefetch started per waiting agent (blocks promoted into HBM, or
into DRAM where the surface prefetches there, for its next request), the hold
an arrived HBM prefetch keeps until that request is admitted, how each ended
(``prefetch_on_time``, ``prefetch_late``, ``prefetch_wasted``), and the SSD ->
DRAM staging of contexts whose requests an admission pass left queued.
Must not admit or step requests: the simulator asks it when a request is
ready or admitted, and its arrivals run through the simulator's event queue.
"""

from __future__ import annotations

import itertools
from itertools import compress
from typing import TYPE_CHECKING, Any, Sequence

from ..keys import BlockKey
from ..placement.base import ssd_promotion

if TYPE_CHECKING:
    from .runs import Run
    from .state import SimState


class Prefetch:
    """A promotion started for an agent's next request."""

    __slots__ = ("plans", "done_s", "arrived", "hold", "keys", "cancelled")

    def __init__(self, plans: list[Any], done_s: float, keys: tuple[BlockKey, ...]) -> None:
        self.plans, self.done_s, self.keys = plans, done_s, keys
        self.arrived = False
        self.hold: BlockKey | None = None  # referenced HBM tail from arrival until admission
        self.cancelled = False  # its request was skipped: nothing to hold on arrival


class SimPrefetches:
    """The simulator's prefetches and staging (see the module doc)."""

    def __init__(self, sim: "SimState") -> None:
        self.sim = sim
        self.by_agent: dict[tuple[int, str], Prefetch] = {}
        self.to_stage: list[Sequence[BlockKey]] = []  # contexts of requests that arrived (see stage)

    def start(self, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> float | None:
        """Promote the lower-tier blocks of ``keys``' cached prefix into the surface's
        prefetch tier for the waiting agent's next request; returns when they will be
        there (``None`` when nothing needs to move or there is no room)."""
        sim = self.sim
        if agent_key in self.by_agent or not sim.ctx.is_waiting(agent_key):
            return None
        mgr = sim.mgr
        hit = mgr.lookup(keys)
        names, tiers = hit.tier_names, hit.tier_indices
        plans, done = [], sim.now
        dst = sim.surface.prefetch_to
        if dst not in names:
            return None
        for src_idx in range(names.index(dst) + 1, len(names)):
            src_keys = list(compress(keys, map(src_idx.__eq__, tiers)))
            if not src_keys:
                continue
            plan = mgr.prepare_move(src_keys, names[src_idx], dst,
                                    keep_source=sim.victims.keep_source(names[src_idx]))
            if plan is None:
                break
            plans.append(plan)
            done = max(done, sim.transfer_s(names[src_idx], dst, len(plan.keys)))
        if not plans:
            return None
        if sim.victims.pending:  # what made room in HBM lands in DRAM as the prefetch frees it
            sim.victims.write(done)
        pf = Prefetch(plans, done, tuple(keys[: hit.num_blocks]))
        self.by_agent[agent_key] = pf
        sim.counters["prefetches"] += 1
        sim.counters["prefetched_blocks"] += sum(len(p.keys) for p in plans)
        sim.schedule_at(done, self._arrived, agent_key, pf)
        return done

    def on_ready(self, run: "Run", agent_key: tuple[int, str], skipped: bool) -> bool:
        """The agent's request ``run`` is ready: it takes the prefetch made for it (a late one
        into HBM makes it wait for the blocks in flight). Returns whether it joins the queue now."""
        sim = self.sim
        pf = self.by_agent.pop(agent_key, None)
        if skipped:
            if pf is not None:
                pf.cancelled = True
                self.settle(pf, ())
            return False
        if pf is not None and not pf.arrived:  # late: the request waits for its blocks in flight
            sim.counters["prefetch_late"] += 1
            if sim.surface.prefetch_to == "hbm":
                sim.schedule_at(pf.done_s, self._enqueue_after, run, pf)
                return False
            pf.cancelled = True  # into DRAM: the request loads from wherever its blocks are now
            pf = None
        if pf is not None:
            sim.counters["prefetch_on_time"] += 1
            run.prefetch = pf
        return True

    def _enqueue_after(self, run: "Run", pf: Prefetch) -> None:
        run.prefetch = pf
        self.sim.waiting.append(run)

    def stage(self, keys: Sequence[BlockKey]) -> int:
        """Promote the SSD blocks of ``keys``' cached prefix into DRAM for a queued
        request (the SSD keeps its copy), once the engine's admission pass has
        left it queued (one admitted at once loads straight from SSD); its
        admission reads whatever has arrived by then from DRAM. Returns 0: the
        promotion is decided after the pass."""
        self.to_stage.append(keys)
        return 0

    def stage_queued(self) -> None:
        sim = self.sim
        to_stage, self.to_stage = self.to_stage, []
        queued = {id(r.keys) for r in sim.waiting}
        for keys in to_stage:
            plan = ssd_promotion(sim.mgr, keys) if id(keys) in queued else None
            if plan is not None:
                sim.schedule_at(sim.transfer_s("ssd", "dram", len(plan.keys)), self._staged_in, plan)
                sim.counters["staged_blocks"] += len(plan.keys)

    def _staged_in(self, plan: Any) -> None:
        mgr = self.sim.mgr
        mgr.complete_move(plan, True)
        if self.sim.victims.on:  # admitted before they arrived: HBM has them, DRAM need not
            mgr.deprioritize([k for k in plan.keys if mgr.contains(k, "hbm")], "dram")

    def _arrived(self, agent_key: tuple[int, str], pf: Prefetch) -> None:
        sim = self.sim
        for plan in pf.plans:
            sim.mgr.complete_move(plan, True)
        pf.arrived = True
        if pf.cancelled or sim.surface.prefetch_to != "hbm":
            return
        pf.hold = sim.admission.deepest_ready_hbm(pf.keys, len(pf.keys))
        if pf.hold is not None:
            sim.mgr.acquire((pf.hold,))
        sim.admission_blocked = False

    def release_holds(self) -> bool:
        """The queue's head does not fit: let go of the hold of every arrived prefetch,
        its own included (a prefetch of a context the new prompt left behind must
        not keep it out). The blocks stay cached but become evictable. True when
        one was released."""
        released = False
        for pf in self.held():
            self.sim.mgr.release((pf.hold,))
            pf.hold = None
            released = True
        if released:
            counters = self.sim.counters
            counters["prefetch_holds_released"] = counters.get("prefetch_holds_released", 0) + 1
        return released

    def held(self) -> list[Prefetch]:
        """Arrived prefetches still holding their blocks in HBM."""
        sim = self.sim
        waiting = [r.prefetch for r in itertools.chain(sim.waiting, (d[0] for d in sim.admission.deferred))
                   if r.prefetch is not None]
        return [pf for pf in itertools.chain(self.by_agent.values(), waiting) if pf.hold is not None]

    def settle(self, pf: Prefetch, used: Sequence[BlockKey]) -> None:
        """The request the prefetch was for was admitted: drop its hold; a prefetch
        none of whose blocks the request used was wasted."""
        if pf.hold is not None:
            self.sim.mgr.release((pf.hold,))
            pf.hold = None
        moved = {k for p in pf.plans for k in p.keys}
        if not moved.intersection(used):
            self.sim.counters["prefetch_wasted"] += 1
