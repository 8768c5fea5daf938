"""The replay's :class:`~kvtier.placement.PlacementContext`: what a policy may ask and do in the simulator.

Owns: the policy-facing surface of one :class:`~kvtier.replay.sim.Simulator`
(pins and their budget, offload, discard, drop, retire, deprioritize, touch,
prefetch and stage, the hint plane's facts, the transfer model's estimates,
the replay counters), each gated by the engine surface
(:mod:`kvtier.placement.surface`) exactly as the live context,
``kvtier_vllm.placement.EnginePlacement``, is by what vLLM exposes. The
conformance suite (``tests/engine/test_placement_context_conformance.py``)
holds the two to the same contract. Must not admit, step or schedule
requests; it changes residency only through the simulator's ``TierManager``
and its own timers.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..keys import BlockKey

if TYPE_CHECKING:
    from .state import SimState


class SimContext:
    """The simulator's placement context; policies get it wherever live they get ``EnginePlacement``."""

    def __init__(self, sim: "SimState", pin_budget_blocks: int) -> None:
        self.sim = sim
        self.block_size = sim.block_size
        self.hbm_capacity_blocks = sim.hbm_capacity_blocks
        self._pin_budget_blocks = pin_budget_blocks
        self.pinned_blocks = 0
        self._pin_sizes: dict[BlockKey, int] = {}  # pinned chain tail -> blocks it protects
        self.waiting_agents: dict[tuple[int, str], float] = {}  # agent -> predicted return (s)

    @property
    def now(self) -> float:
        return self.sim.now

    @property
    def counters(self) -> dict[str, int]:
        """The replay's counters (as the live context's ``counters``)."""
        return self.sim.counters

    # ------------------------------------------------------------ HBM holds

    def pin(self, keys: Sequence[BlockKey], ttl_s: float) -> bool:
        """Pin a chain by its deepest HBM block (tail-first eviction keeps its prefix).
        The budget counts the chain's blocks."""
        sim = self.sim
        tail = sim.admission.deepest_ready_hbm(keys, len(keys))
        if ttl_s <= 0 or tail is None or not sim.surface.hbm_hold:
            return False
        n = keys.index(tail) + 1
        if self.pinned_blocks + n - self._pin_sizes.get(tail, 0) > self._pin_budget_blocks:
            sim.counters["pins_refused"] += 1
            return False
        sim.mgr.pin((tail,), ttl_s)
        self.pinned_blocks += n - self._pin_sizes.get(tail, 0)
        self._pin_sizes[tail] = n
        sim.schedule_at(sim.now + ttl_s, self._pin_lapsed, tail)
        return True

    def _pin_lapsed(self, tail: BlockKey) -> None:
        if tail in self._pin_sizes and not self.sim.mgr.is_pinned(tail):
            self.pinned_blocks -= self._pin_sizes.pop(tail)
        self.sim.admission_blocked = False

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        tails = [k for k in keys if k in self._pin_sizes]
        if tails:
            self.sim.mgr.unpin(tails)
            for tail in tails:
                self.pinned_blocks -= self._pin_sizes.pop(tail)
            self.sim.admission_blocked = False

    # ------------------------------------------------------------ residency

    def offload(self, keys: Sequence[BlockKey], dst: str) -> int:
        """Swap the HBM copies of ``keys`` out to ``dst``: blocks already there just
        drop their HBM copy; the rest move over the link (modelled)."""
        sim, mgr = self.sim, self.sim.mgr
        if dst not in mgr.tier_names:
            return 0
        if not sim.surface.hbm_drop:  # the HBM copy stays until the engine evicts it; the copy below counts
            return len(mgr.present(mgr.present(keys, "hbm"), dst))
        in_hbm = mgr.present(keys, "hbm")
        already = mgr.present(in_hbm, dst)
        dropped = mgr.remove(already, "hbm") if already else 0
        plan = mgr.prepare_move(in_hbm if not already else mgr.present(in_hbm, "hbm"), "hbm", dst,
                                keep_source=False)
        sim.counters["offloaded_blocks"] += dropped
        if plan is None:
            sim.admission_blocked = False
            return dropped
        sim.counters["offloaded_blocks"] += len(plan.keys)
        num_encode = sim.mover.num_to_encode(mgr, sim.lower, plan.keys, dst)
        sim.schedule_at(sim.transfer_s("hbm", dst, len(plan.keys), num_encode), self._complete_offload, plan)
        return dropped + len(plan.keys)

    def _complete_offload(self, plan: Any) -> None:
        self.sim.mgr.complete_move(plan, True)
        self.sim.admission_blocked = False

    def discard(self, keys: Sequence[BlockKey]) -> int:
        sim = self.sim
        if not sim.surface.hbm_drop:
            return 0
        n = sim.mgr.remove(keys, "hbm")
        sim.counters["discarded_blocks"] += n
        sim.admission_blocked = False
        return n

    def drop(self, keys: Sequence[BlockKey]) -> int:
        """Remove ``keys`` from every tier (dead KV: nobody will read it again)."""
        sim = self.sim
        if sim.surface.hbm_drop:
            n = sim.mgr.remove(keys)
        else:
            n = sum(sim.mgr.remove(keys, t) for t in sim.lower)
        sim.counters["dropped_blocks"] += n
        sim.admission_blocked = False
        return n

    def deprioritize(self, keys: Sequence[BlockKey], tiers: Sequence[str] = ("hbm",)) -> int:
        """Make ``keys``' idle copies in ``tiers`` the next victims there."""
        mgr = self.sim.mgr
        return sum(mgr.deprioritize(keys, t) for t in tiers
                   if t in mgr.tier_names and (t != "hbm" or self.sim.surface.hbm_demote))

    def retire(self, keys: Sequence[BlockKey]) -> int:
        """Dead KV (its agent ended): next victims in every tier, but still
        readable until the room is needed. On a surface that can free an HBM
        block but not reorder HBM (``hbm_drop`` without ``hbm_demote``), its idle
        HBM copies are freed at once instead."""
        sim = self.sim
        n = self.deprioritize(keys, sim.mgr.tier_names)
        self.count("retired_blocks", n)
        if sim.surface.hbm_drop and not sim.surface.hbm_demote:
            dropped = sim.mgr.remove(keys, "hbm")
            sim.counters["dropped_blocks"] += dropped
            sim.admission_blocked = False
            n += dropped
        return n

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Refresh ``keys``' HBM copies to most recent (they are due next)."""
        if self.sim.surface.hbm_refresh:
            self.sim.mgr.touch(self.sim.mgr.present(keys, "hbm"), "hbm")

    def prefetch(self, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> float | None:
        """Promote the lower-tier blocks of ``keys``' cached prefix into HBM for the
        agent's next request; returns when they will be there (``None`` when
        nothing needs to move or HBM has no room). The blocks are held from
        arrival until that request is admitted."""
        return self.sim.prefetches.start(agent_key, keys)

    def stage(self, keys: Sequence[BlockKey]) -> int:
        """Promote the SSD blocks of a queued request's cached prefix into DRAM
        (see :meth:`~kvtier.replay.prefetches.SimPrefetches.stage`); returns 0."""
        return self.sim.prefetches.stage(keys)

    # ------------------------------------------------------------ estimates and facts

    def transfer_time_s(self, num_blocks: int, link: str) -> float:
        """Expected time to move ``num_blocks`` over ``link`` (``ssd->hbm``: both
        hops; with a cold codec, its encode / decode too), from the transfer
        model fitted to completed transfers."""
        return self.sim.mover.predict_s(num_blocks, link)

    def queued_transfer_s(self, link: str) -> float:
        return self.sim.mover.queued_s(link, self.sim.now)

    def recompute_time_s(self, num_tokens: int) -> float:
        return self.sim.profile.recompute_time_s(num_tokens, 0)

    def load_wait_s(self) -> float:
        """A step like the one running now (its fixed cost alone while the engine idles) under
        ``--scheduler vllm``, where a load is done at the end of the step after its admission at the
        earliest, as the live context fits it; 0.0 under ``plain``, whose loads land when their
        transfers do."""
        sim = self.sim
        if sim.cfg.scheduler != "vllm":
            return 0.0
        budget = max(0, sim.cfg.max_batch_tokens - len(sim.decoding))
        prefill = min(budget, sum(r.prefill_left for r in sim.prefilling if not (r.loads_pending or r.holding)))
        step_s = sim.profile.step_time_s(prefill, 0, len(sim.decoding), sum(r.ctx_tokens for r in sim.decoding))
        return step_s or sim.profile.hardware.step_overhead_s  # an idle engine still steps, at its fixed cost

    def prefill_ahead_s(self) -> float:
        """The prefill the admitted requests have still to run (their chunks come first), each against
        its own context."""
        prefill_s = self.sim.profile.prefill_time_s
        return sum(prefill_s(r.prefill_left, r.ctx_tokens) for r in self.sim.prefilling if r.prefill_left)

    def running_blocks(self) -> int:
        return self.sim.running_blocks()

    def tool_history_s(self) -> Sequence[float]:
        return self.sim.tool_history

    def private_start(self, keys: Sequence[BlockKey]) -> int:
        return self.sim.mgr.private_start(keys)

    def call_at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)`` at simulated time ``t`` (now if ``t`` is past)."""
        self.sim.schedule_at(max(t, self.sim.now), fn, *args)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the replay counter ``name`` (decisions by reason, ...)."""
        counters = self.sim.counters
        counters[name] = counters.get(name, 0) + n

    def criticality(self, agent_key: tuple[int, str]) -> float:
        """The agent's criticality from the hint plane's DAG (1.0 on the critical path)."""
        crit = self.sim.graph.criticalities("replay", str(agent_key[0]), self.sim.now)
        return crit.get(agent_key[1], 0.0)

    def hbm_pressure(self) -> float:
        """HBM in use (cached + reserved) over capacity, plus the demand of the
        requests waiting for admission, as a fraction of capacity."""
        sim = self.sim
        if sim.surface.pressure_counts_idle:
            used = sim.mgr.used_blocks("hbm")
        else:  # what vLLM reports as KV usage: blocks referenced by running requests and holds
            used = min(self.hbm_capacity_blocks, sim.running_blocks() + self.pinned_blocks)
        return (used + self.waiting_demand_blocks()) / max(1, self.hbm_capacity_blocks)

    def waiting_demand_blocks(self) -> int:
        """HBM blocks the (first 16) requests waiting for admission need."""
        return sum(math.ceil((r.req.input_tokens + r.req.output_tokens) / self.block_size)
                   for r in itertools.islice(self.sim.waiting, 16))

    def tiers_enabled(self) -> tuple[str, ...]:
        return self.sim.mgr.tier_names

    def blocks_in(self, keys: Sequence[BlockKey], tier: str) -> int:
        """How many of ``keys`` are readable in ``tier`` (0 for a tier not enabled)."""
        mgr = self.sim.mgr
        return len(mgr.present(keys, tier)) if tier in mgr.tier_names else 0

    def remaining_path_s(self, session: int) -> float:
        """The session's expected remaining time (its critical path) per the hint plane."""
        return self.sim.graph.remaining_path_s("replay", str(session), self.sim.now)

    def parent_of(self, agent_key: tuple[int, str]) -> str | None:
        """The agent's parent id as the hint plane knows it (``None`` for a root)."""
        s = self.sim.graph.session("replay", str(agent_key[0]))
        a = s.agents.get(agent_key[1]) if s is not None else None
        return a.parent_id if a is not None else None

    def is_waiting(self, agent_key: tuple[int, str]) -> bool:
        """True while the agent waits (tool, user, sub-agents) for its next request."""
        return agent_key in self.waiting_agents
