"""Agent-aware placement: critical-path reserve, tool-wait offload, predictive prefetch.

Owns: the placement policies that read the hint plane (the
:class:`~kvtier.agents.AgentGraph`'s criticality and predicted tool returns)
and the transfer model through the :class:`PlacementContext`:

* ``tokencake`` — TokenCake (arXiv 2510.18586), following its public code
  where the paper gives no formula: a *space* scheduler reserving a share
  ``rho`` of HBM for critical agents (``rho`` starts at 0.05, +0.05 when HBM
  use is >= 0.75, -0.05 when <= 0.40, within [0.05, 0.30]), and a *time*
  scheduler that swaps an agent's KV to DRAM when its predicted stall ``D``
  beats the transfer time ``T`` (``D > T``, margin ``D - T >= max(0.05 s,
  2T)``, under memory pressure; critical agents only for long margins
  ``>= max(0.5 s, 8T)``), backs off 8 decisions after a refused offload, and
  uploads back ``max(0.1 s, 1.25 * T_h2d)`` before the predicted return.
  CPU tier only, no write-through (vLLM swap space).
* ``kvflow`` — KVFlow (arXiv 2507.07400): eviction by steps-to-execution
  over a write-through CPU tier: an agent that starts waiting goes to the
  front of the eviction order (its next step is furthest away), an agent due
  next is brought back (prefetched, or refreshed to most recent) one
  transfer time before its predicted return.
* ``kvtier`` — the project's default: everything above over all three tiers
  with write-through to SSD, plus
  - *exclusive DRAM*: a block goes down to DRAM when HBM evicts it (a victim
    cache), not as it is computed, and the DRAM copy of what HBM holds is
    the first to go (the simulator carries it out where the engine surface
    has a victim write: ``vllm`` has one, ``vllm-write-through`` none, so there it writes through);
  - *the order by predicted next use* in every tier it manages
    (:mod:`kvtier.placement.nextuse`): finished agents' blocks first,
    waiting agents' by when their wait started (plus ``next_use_trust`` x
    the predicted wait, tuned on the tuning half of the dev traces by
    ``bench/tune_kvtier.py``), busy agents' last. With it, the tool-wait
    offload and demote decisions need no reordering of their own;
  - dead-KV retirement (when the hint plane says an agent or a session
    ended, its private blocks become the next victims in every tier — still
    readable until the room is needed);
  - TokenCake's keep / offload rule on the fitted transfer model, and a
    prefetch lead proportional to the transfer estimate (``0.05 s + 1.5
    T``), for tool waits only. No discard decision: the lower tiers hold
    copies, and reloading beats recomputing.
  Earlier sessions tried, on all dev traces before the split existed, and
  left off: frequency-gated SSD admission (``gate_ssd``) and retiring the
  old tail when a prompt leaves an agent's context. ``demote_after_s`` (a
  long wait gives up the HBM and DRAM copies first) applies without the
  next-use order only.
* ablations of ``kvtier`` (:data:`KVTIER_ABLATIONS`), one mechanism off
  each: ``kvtier-space-only`` (no tool-wait offload and prefetch),
  ``kvtier-time-only`` (no critical-path reserve), ``kvtier-inclusive``
  (DRAM written through), ``kvtier-lru-order`` (LRU order, waiting agents'
  HBM copies first in line, as before the next-use order), ``kvtier-no-dead``.

Admission order (TokenCake's critical-first, kvtier's oldest-application-
first) is the engine scheduler's, not a placement decision: it is the
replay's ``--admission`` setting (:mod:`kvtier.replay.admission`), applied
alike to every policy and reported apart.

Policies decide; they never touch simulator or store state except through
the context, so the same objects drive a live store. Must not read the
future: only predicted returns from the hint plane.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

from ..agents.predictor import wait_pin_ttl_s
from ..keys import BlockKey
from .base import PlacementContext, PlacementPolicy, ToolWait
from .nextuse import AgentNextUse

AgentKey = tuple[int, str]


MAX_AGENTS = 4096
"""Agents whose state a live component keeps at once, least recently seen forgotten first: the agent-aware
policies' turn counts and last contexts (:attr:`AgentAware.max_agents`) and the vLLM connector's tables of
waiting agents. One bound, so that neither forgets an agent the other still acts on."""


class AgentAware(PlacementPolicy):
    """Shared machinery; subclasses set the switches and constants.

    Space: while a critical agent (criticality >= ``critical_at``) waits, its
    chain is pinned if the reserve (``rho`` of HBM, adapted to pressure
    within ``rho_bounds``) has room; unused reserve stays in the shared pool
    (lent). Time: an agent whose predicted wait pays for moving its KV out and
    back is offloaded (or, with write-through copies below, its HBM copy is
    given up first in line) and prefetched back ``lead`` before the predicted
    return; cancelled when it returns early.
    """

    space = True
    time = True
    drop_dead = False
    gate_ssd = False
    deprioritize_waiting = False
    swap_to = "dram"
    rho_bounds = (0.05, 0.30)
    rho_step = 0.05
    critical_at = 0.75
    backoff_decisions = 8
    prefetch_causes: tuple[str, ...] = ("tool", "user", "subagent_join")
    demote_after_s: float | None = None  # a wait predicted at least this long demotes (write-through to SSD only)
    next_use: bool = False  # order every tier it manages by predicted next use (kvtier.placement.nextuse)
    next_use_trust = 0.0  # weight of the predicted wait in the next-use rank (0: by wait start alone)
    user_wait_s = 60.0  # the wait the next-use order expects after a turn that called no tool (a user's turn)
    stage_queued = False  # promote a queued request's SSD blocks into DRAM when it arrives
    lead_factor = 1.25  # a prefetch starts this many transfer times before the predicted return
    # agents whose turn count, last context and prefetch timer are kept (least recently seen forgotten first):
    # live, sessions that never say they ended (abandoned, or named only by vLLM's session_id) otherwise kept
    # every context they ever had (the soak's RSS creep); the replay ends its sessions (agent_ends, its default),
    # so there it acts only past 4,096 agents with state at once. One bound for all tenants (the connector's
    # tables also bound each tenant's share: a tenant with thousands of new agents can push others' out here)
    max_agents = MAX_AGENTS

    def __init__(self) -> None:
        self.rho = self.rho_bounds[0]
        self._reserved: dict[AgentKey, tuple[int, tuple[BlockKey, ...]]] = {}  # agent -> (blocks pinned, its keys)
        self._timers: dict[AgentKey, int] = {}  # agent -> token of its scheduled prefetch
        self._token = 0
        self._backoff = 0
        self._turns: dict[AgentKey, int] = {}  # agent -> requests finished (SSD admission gate)
        self._last_ctx: dict[AgentKey, tuple[BlockKey, ...]] = {}  # agent -> its latest context keys
        self._est: AgentNextUse | None = None
        self._seen: OrderedDict[AgentKey, None] = OrderedDict()  # agents with state above, least recent first

    def eviction_for(self, tier: str, clock: Callable[[], float] | None = None) -> object:
        if not self.next_use or clock is None:
            return self.eviction
        if self._est is None:
            self._est = AgentNextUse(clock, trust=self.next_use_trust, user_wait_s=self.user_wait_s)
        return self._est.policy()

    def next_use_rank(self, key: BlockKey) -> float | None:
        return None if self._est is None else self._est.next_use(key)

    # ---------------------------------------------------------------- knobs

    def lead_s(self, t_back_s: float) -> float:
        """How long before the predicted return the prefetch starts."""
        return max(0.1, self.lead_factor * t_back_s)

    def worth_offloading(self, ctx: PlacementContext, wait_s: float, t_out_s: float, t_back_s: float,
                         critical: bool) -> str:
        """``"offload"`` or the reason to keep (TokenCake's rules)."""
        t = t_out_s
        margin = wait_s - t
        if wait_s <= t or margin < max(0.05, 2 * t):
            return "short_wait"
        if ctx.hbm_pressure() < 0.60 and not ctx.waiting_demand_blocks():
            return "low_pressure"
        if critical and margin < max(0.5, 8 * t):
            return "critical"
        return "offload"

    # ---------------------------------------------------------------- hooks

    def on_wait_start(self, ctx: PlacementContext, wait: ToolWait) -> None:
        agent = wait.agent_key
        # A wait started again before it ended is re-timed (live: the tool call a hint server announces after
        # the turn's end started a turn_end wait): the earlier decision's prefetch goes, and its reserve unless
        # this decision reserves again (a pin of the same context replaces the earlier one).
        self._timers.pop(agent, None)
        was_reserved = self._reserved.pop(agent, None)
        decision = self._decide_wait(ctx, wait)
        if was_reserved is not None and decision != "reserve":
            ctx.unpin(was_reserved[1])

    def _decide_wait(self, ctx: PlacementContext, wait: ToolWait) -> str | None:
        """What :meth:`on_wait_start` decides and carries out for ``wait`` (counted); ``None``: nothing to
        decide (no context, or none of it in HBM)."""
        agent = wait.agent_key
        self._saw(agent)
        self._turns[agent] = self._turns.get(agent, 0) + 1
        if self._est is not None:
            self._est.waiting(agent, wait.keys, None if wait.cause == "user" else wait.predicted_gap_s)
        if self.drop_dead or self._est is not None:
            self._last_ctx[agent] = wait.keys
        if not wait.keys:
            return None
        self._adapt_reserve(ctx)
        keys = wait.keys
        n_hbm = ctx.blocks_in(keys, "hbm")
        if not n_hbm:
            return None
        critical = self.space and ctx.criticality(agent) >= self.critical_at
        decision = "keep"
        if self.time:
            t_out = 0.0 if self._copied_below(ctx, keys) else ctx.transfer_time_s(n_hbm, f"hbm->{self.swap_to}")
            t_back = ctx.transfer_time_s(n_hbm, f"{self.swap_to}->hbm")
            decision = self.worth_offloading(ctx, wait.predicted_gap_s, max(t_out, t_back), t_back, critical)
            if decision == "offload" and self._backoff > 0:
                self._backoff -= 1
                decision = "backoff"
            if decision == "offload" and self._demotes(ctx, wait.predicted_gap_s):
                decision = "demote"
            if decision in ("offload", "demote"):
                if self._offload(ctx, keys, demote=decision == "demote"):
                    self._schedule_prefetch(ctx, agent, keys, wait, t_back)
                else:
                    self._backoff = self.backoff_decisions
                    decision = "refused"
        if decision not in ("offload", "demote"):
            if critical and self._reserve(ctx, agent, keys, n_hbm, wait.predicted_gap_s):
                decision = "reserve"
            elif self.deprioritize_waiting or self._est is not None:
                if self.deprioritize_waiting:
                    ctx.deprioritize(keys)
                if self.time:  # back in time for the predicted return, from wherever it is by then
                    self._schedule_prefetch(ctx, agent, keys, wait,
                                            ctx.transfer_time_s(n_hbm, f"{self.swap_to}->hbm"))
        ctx.count(f"decision_{decision}")
        return decision

    def on_wait_end(self, ctx: PlacementContext, agent_key: AgentKey, keys: Sequence[BlockKey]) -> None:
        # A prompt that leaves the agent's old context (compaction, a rewrite) does
        # not make the old tail dead: retiring it measured 0.9% more prefill
        # recomputed on the dev traces (agents come back to such branches).
        if self._est is not None:
            self._est.used(agent_key, keys)
        if self._timers.pop(agent_key, None) is not None:
            ctx.count("prefetch_cancelled")  # returned before the prefetch started: load on demand
        if self.stage_queued and self.time:  # queued now: its SSD blocks come up while others compute
            ctx.stage(keys)
        if self._reserved.pop(agent_key, None) is not None:
            ctx.unpin(keys)

    def on_agent_end(self, ctx: PlacementContext, agent_key: AgentKey, keys: Sequence[BlockKey]) -> None:
        self._turns.pop(agent_key, None)
        self._drop_wait(ctx, agent_key)
        self._seen.pop(agent_key, None)  # (the root's context comes back below, seen again)
        if not self.drop_dead and self._est is None:
            return
        parent = ctx.parent_of(agent_key)
        if parent is None:  # the root: its context dies with the session
            self._saw(agent_key)
            self._last_ctx[agent_key] = tuple(keys)
            if self._est is not None:  # what other chains branch from stays alive
                self._est.ended(agent_key, keys, ctx.private_start(keys))
            return
        # A sub-agent's own blocks start where its context left its parent's.
        inherited = self._last_ctx.get((agent_key[0], parent), ())
        fork = next((i for i, (a, b) in enumerate(zip(keys, inherited)) if a != b), min(len(keys), len(inherited)))
        start = max(fork, ctx.private_start(keys))
        if self._est is not None:
            self._est.ended(agent_key, keys, start, (agent_key[0], parent), fork)
        if self.drop_dead and start < len(keys):
            ctx.retire(keys[start:])
        self._last_ctx.pop(agent_key, None)

    def on_session_end(self, ctx: PlacementContext, session: int) -> None:
        for agent in [a for a in {**self._reserved, **self._timers} if a[0] == session]:
            self._drop_wait(ctx, agent)
        for agent in [a for a in self._last_ctx if a[0] == session]:
            keys = self._last_ctx.pop(agent)
            self._seen.pop(agent, None)
            if self.drop_dead and keys:
                ctx.retire(keys[ctx.private_start(keys):])

    def _saw(self, agent: AgentKey) -> None:
        """``agent`` is about to have state here: most recent; beyond ``max_agents``, the least recently
        seen agent's turn count, last context and prefetch timer are forgotten (a reserve is bounded by
        its budget and lapses on its own)."""
        seen = self._seen
        seen[agent] = None
        seen.move_to_end(agent)
        while len(seen) > self.max_agents:
            old, _ = seen.popitem(last=False)
            self._turns.pop(old, None)
            self._last_ctx.pop(old, None)
            self._timers.pop(old, None)

    def _drop_wait(self, ctx: PlacementContext, agent: AgentKey) -> None:
        """An agent that ended in a wait (live: a turn's end wait, started before the hint server reported the
        end) sends nothing more: its prefetch goes, and its reserve, which would keep its share of the budget."""
        self._timers.pop(agent, None)
        reserved = self._reserved.pop(agent, None)
        if reserved is not None:
            ctx.unpin(reserved[1])

    def admit_lower(self, ctx: PlacementContext, tier: str, agent_key: AgentKey | None, num_blocks: int) -> int:
        """Write-through admission: SSD only for contexts reused at least once."""
        if tier == "ssd" and self.gate_ssd and agent_key is not None and self._turns.get(agent_key, 0) < 1:
            return 0
        return num_blocks

    # ---------------------------------------------------------------- parts

    def _copied_below(self, ctx: PlacementContext, keys: Sequence[BlockKey]) -> bool:
        return self.write_through and ctx.blocks_in(keys, self.swap_to) >= len(keys)

    def _demotes(self, ctx: PlacementContext, wait_s: float) -> bool:
        """Demote (rather than offload) when the wait is long and the SSD holds copies
        (an SSD tier is enabled and written through; without one, demoting would
        only push the DRAM copy out)."""
        return (self.demote_after_s is not None and wait_s >= self.demote_after_s and self.write_through
                and "ssd" in self.lower_tiers and "ssd" in ctx.tiers_enabled())

    def _offload(self, ctx: PlacementContext, keys: Sequence[BlockKey], demote: bool = False) -> int:
        private = keys[ctx.private_start(keys):]
        if not private:
            return 0
        if self._est is not None:  # the order by predicted next use has it already
            return len(private)
        if demote:  # write-through copies are on SSD: first in line in HBM and in DRAM
            return ctx.deprioritize(private, ("hbm", "dram")) or 1
        if self.write_through:  # copies are below already: first in line for eviction
            return ctx.deprioritize(private) or ctx.offload(private, self.swap_to)
        return ctx.offload(private, self.swap_to)

    def _schedule_prefetch(self, ctx: PlacementContext, agent: AgentKey, keys: Sequence[BlockKey],
                           wait: ToolWait, t_back_s: float) -> None:
        if wait.cause not in self.prefetch_causes:
            return  # no prediction worth acting on (a human's think time)
        wait_s = wait.predicted_gap_s
        self._token += 1
        self._timers[agent] = self._token
        ctx.call_at(ctx.now + wait_s - self.lead_s(t_back_s), self._fire_prefetch, ctx, agent, tuple(keys),
                    self._token)

    def _fire_prefetch(self, ctx: PlacementContext, agent: AgentKey, keys: tuple[BlockKey, ...], token: int) -> None:
        if self._timers.get(agent) != token or not ctx.is_waiting(agent):
            return  # cancelled (returned early, or a newer wait)
        del self._timers[agent]
        ctx.touch(keys)  # what is still in HBM is due next: most recent
        ctx.prefetch(agent, keys)

    def _adapt_reserve(self, ctx: PlacementContext) -> None:
        u = ctx.hbm_pressure()
        lo, hi = self.rho_bounds
        if u >= 0.75:
            self.rho = min(hi, self.rho + self.rho_step)
        elif u <= 0.40:
            self.rho = max(lo, self.rho - self.rho_step)

    def _reserve(self, ctx: PlacementContext, agent: AgentKey, keys: Sequence[BlockKey], n: int,
                 wait_s: float) -> bool:
        budget = int(self.rho * ctx.hbm_capacity_blocks)
        if sum(r[0] for r in self._reserved.values()) + n > budget:
            return False
        if not ctx.pin(keys, wait_pin_ttl_s(wait_s)):
            return False
        self._reserved[agent] = (n, tuple(keys))
        return True


class TokenCake(AgentAware):
    name = "tokencake"
    write_through = False
    lower_tiers = ("dram",)


class KVFlow(AgentAware):
    """Steps-to-execution order and prefetch of the agents due next (no reserve,
    no swap decision: the CPU tier holds write-through copies)."""

    name = "kvflow"
    write_through = True
    lower_tiers = ("dram",)
    space = False
    deprioritize_waiting = True

    def worth_offloading(self, ctx: PlacementContext, wait_s: float, t_out_s: float, t_back_s: float,
                         critical: bool) -> str:
        return "offload" if wait_s > t_back_s else "short_wait"


class KVTier(AgentAware):
    name = "kvtier"
    write_through = True
    lower_tiers = ("dram", "ssd")
    drop_dead = True
    gate_ssd = False  # measured on the dev traces: gating first turns out of SSD cost recompute
    rho_bounds = (0.05, 0.30)
    # Exclusive DRAM and the order by predicted next use: kept for what they did on the tuning half
    # (conc 8 at --hbm-fraction 0.25, and conc 16 on that HBM: the ablation table, bench/RESULTS.md).
    write_back_dram = "evict"
    next_use = True
    # Chosen on the tuning half only by bench/tune_kvtier.py (bench/out/tune-kvtier.json; a test holds it).
    next_use_trust = 0.5
    deprioritize_waiting = False  # the next-use order ranks waiting agents already
    stage_queued = True

    prefetch_causes = ("tool",)  # user think time is not predictable: load on demand
    # Used only without the next-use order (kvtier-lru-order), which ranks a long wait itself. Chosen
    # when kvtier had no next-use order, on the tuning half: every value computed the same prefill, 5 s
    # the lowest TTFT p99 (the search was bench/tune_kvtier.py's before it tuned next_use_trust).
    demote_after_s = 5.0
    lead_factor = 1.5

    def lead_s(self, t_back_s: float) -> float:
        return 0.05 + self.lead_factor * t_back_s


def _ablation(name: str, doc: str, **switches: object) -> type[KVTier]:
    """``kvtier`` with one mechanism switched off (a policy of its own, for the ablation table)."""
    return type(name.title().replace("-", ""), (KVTier,), {"name": name, "__doc__": f"Ablation: {doc}.", **switches})


KVTIER_ABLATIONS = (
    _ablation("kvtier-space-only", "no tool-wait prefetch or offload decision", time=False),
    _ablation("kvtier-time-only", "no critical-path reserve", space=False),
    _ablation("kvtier-inclusive", "DRAM written through (inclusive of HBM), as before exclusive DRAM",
              write_back_dram=None),
    _ablation("kvtier-lru-order", "every tier in LRU order, a waiting agent's HBM copies first in line (as "
              "before the next-use order)", next_use=False, deprioritize_waiting=True),
    _ablation("kvtier-no-dead", "no dead-KV retirement", drop_dead=False),
)
AGENT_POLICIES = (TokenCake, KVFlow, KVTier, *KVTIER_ABLATIONS)
