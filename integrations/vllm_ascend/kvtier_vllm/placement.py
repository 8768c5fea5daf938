"""Live placement in vLLM: the connector's implementation of kvtier's :class:`~kvtier.placement.PlacementContext`.

Owns: what a placement policy (the same objects the replay drives) can do
through vLLM 0.32's public surface from the scheduler-side connector —

* **hold** an idle agent's HBM blocks across its tool wait: the block pool's
  public ``get_cached_block`` / ``touch`` (a reference, so vLLM cannot evict
  them) and ``free_blocks`` (the reference given back), within a bound
  (:class:`HBMHolds`);
* **refresh** idle HBM blocks to most recent (``touch`` then ``free_blocks``
  re-queues them at the tail of vLLM's free queue);
* **order** (with ``exclusive_dram``) waiting agents' idle HBM blocks by the
  policy's predicted next use, the same way: after an agent's wait starts,
  its blocks and those of agents due sooner are re-queued at the tail, the
  one due furthest first (:meth:`EnginePlacement.settle_order`);
* order, demote, retire and drop copies in kvtier's own DRAM and SSD tiers;
* **prefetch** a waiting agent's SSD blocks into DRAM ahead of its predicted
  return (the worker reads LMDB into the DRAM slab), counted on time, late
  or wasted (:class:`PrefetchTracker`); **stage** a queued request's SSD
  blocks into DRAM the moment it arrives, before vLLM schedules it;
* read pressure (vLLM's KV usage plus requests not yet scheduled), the
  agent's criticality (its ``kv_transfer_params`` or the hosted hint server)
  and timers (fired on scheduler steps).

What vLLM does not let a connector do is refused here in the way the
replay's ``vllm`` surfaces (:data:`kvtier.placement.surface.SURFACES`) model
it: no moving of an idle block towards the front of vLLM's free queue (the
order above only re-queues at the tail), no freeing of an idle HBM copy
sooner (``evict_blocks`` only forgets the hash; the block keeps its place in
the queue), no load into HBM without a request.

Must not touch tensors or do I/O (the worker moves the bytes), must not read
a private attribute of vLLM, and must give back every block reference it took.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.keys import BlockKey
from kvtier.manager import MovePlan, TierManager
from kvtier.placement.base import ssd_promotion
from kvtier.placement.nextuse import REQUEUE_MAX_BLOCKS, requeue_order
from kvtier.placement.surface import SURFACES
from kvtier.transfer.linkmodel import LinkModel

from .settings import MAX_TRACKED_AGENTS

AgentKey = tuple[str, str]

SURFACE = SURFACES["vllm-write-through"]
"""The replay's model of what this module can do without ``exclusive_dram`` (kept in step with it by the
fidelity test); the scheduler sets ``vllm`` with it."""

DEFAULT_LINKS: dict[str, tuple[float, float]] = {
    # (latency s, bytes/s) until the worker's own transfers are observed: host DRAM over PCIe 5
    # (H200: ~50 GB/s per direction, NVIDIA spec), a local NVMe SSD (~5 GB/s).
    "dram->hbm": (1e-5, 50e9), "hbm->dram": (1e-5, 50e9),
    "ssd->dram": (1e-4, 5e9), "dram->ssd": (1e-4, 5e9),
}


STEP_LINK = "engine:step"
"""The engine's step as a link of :attr:`EnginePlacement.links`: tokens for bytes (see ``step_started``)."""


class HBMHolds:
    """References on idle vLLM HBM blocks, by tag (an agent's context tail),
    bounded by ``budget_blocks`` in all and by ``tenant_budget_blocks`` per tenant
    (refusals for that counted in ``tenant_refusals``).

    ``pool`` is vLLM's ``BlockPool`` (only ``get_cached_block``, ``touch``,
    ``free_blocks`` are used). A hold takes the longest cached prefix of the
    given block hashes; blocks already held under another tag are not taken
    twice. Every reference taken is given back by :meth:`release`,
    :meth:`expire` or :meth:`release_all`.
    """

    def __init__(self, pool: Any, budget_blocks: int, primary_group: int = 0,
                 window_groups: Sequence[tuple[int, int]] = (), tenant_budget_blocks: int | None = None) -> None:
        self.pool = pool
        self.budget_blocks = max(0, budget_blocks)
        self.tenant_budget_blocks = self.budget_blocks if tenant_budget_blocks is None else max(0, tenant_budget_blocks)
        self.tenant_refusals = 0
        self._tenant_blocks: Counter[str] = Counter()
        self._tag_tenant: dict[BlockKey, str] = {}
        # hybrid models: the prefix is the primary (full-attention) KV cache group's; each other group
        # (group id, blocks its window reads, 0 for full attention) is held where a hit needs it
        self.primary_group = primary_group
        self.window_groups = tuple(window_groups)
        self._holds: dict[BlockKey, tuple[list[Any], float]] = {}  # tag -> (blocks, expiry)
        self._held_ids: set[int] = set()
        self.peak_blocks = 0

    @property
    def held_blocks(self) -> int:
        return len(self._held_ids)

    def cached_prefix(self, hashes: Sequence[Any]) -> list[Any]:
        """The blocks of the longest prefix of ``hashes`` cached in HBM (with a
        hybrid model's other groups: their cached blocks a hit at its end reads)."""
        out = []
        for h in hashes:
            blocks = self.pool.get_cached_block(h, [self.primary_group])
            if not blocks:
                break
            out.append(blocks[0])
        n = len(out)
        for group, window in self.window_groups:
            for h in hashes[max(0, n - window) if window else 0 : n]:
                blocks = self.pool.get_cached_block(h, [group])
                if blocks:
                    out.append(blocks[0])
        return out

    def hold(self, tag: BlockKey, hashes: Sequence[Any], until: float, tenant: str = "") -> int:
        """Hold the cached prefix of ``hashes`` until ``until`` (monotonic s) for
        ``tenant``; returns blocks newly held (0: nothing cached, or over a budget)."""
        if tag in self._holds:
            self.release(tag)
        blocks = [b for b in self.cached_prefix(hashes) if b.block_id not in self._held_ids]
        if not blocks or self.held_blocks + len(blocks) > self.budget_blocks:
            return 0
        if self._tenant_blocks[tenant] + len(blocks) > self.tenant_budget_blocks:
            self.tenant_refusals += 1
            return 0
        self.pool.touch(blocks)
        self._holds[tag] = (blocks, until)
        self._tag_tenant[tag] = tenant
        self._tenant_blocks[tenant] += len(blocks)
        self._held_ids.update(b.block_id for b in blocks)
        self.peak_blocks = max(self.peak_blocks, self.held_blocks)
        return len(blocks)

    def is_held(self, tag: BlockKey) -> bool:
        return tag in self._holds

    def tenant_blocks(self, tenant: str) -> int:
        """Blocks held for ``tenant``'s agents now."""
        return self._tenant_blocks.get(tenant, 0)

    def release(self, tag: BlockKey) -> int:
        """Give the hold's references back (tail first into vLLM's free queue)."""
        entry = self._holds.pop(tag, None)
        if entry is None:
            return 0
        blocks = entry[0]
        tenant = self._tag_tenant.pop(tag, "")
        self._tenant_blocks[tenant] -= len(blocks)
        if not self._tenant_blocks[tenant]:
            del self._tenant_blocks[tenant]
        self.pool.free_blocks(reversed(blocks))
        self._held_ids.difference_update(b.block_id for b in blocks)
        return len(blocks)

    def expire(self, now: float) -> int:
        """Release the holds whose time is up; returns blocks released."""
        return sum(self.release(tag) for tag, (_, until) in list(self._holds.items()) if until <= now)

    def release_all(self) -> int:
        return sum(self.release(tag) for tag in list(self._holds))


@dataclass(slots=True)
class _Promotion:
    agent: AgentKey
    plan: MovePlan
    started_s: float
    done_s: float | None = None  # when the worker reported it
    arrived_s: float | None = None  # when the agent's next request arrived


class TenantShares:
    """Agents remembered per tenant, oldest first, each counted under one tenant: the bound
    ``max_tracked_agents_per_tenant`` puts on a tenant's waiting agents (here) and on its
    finished contexts (:class:`~.hint_intake.HintIntake`), so one tenant that floods forgets
    its own oldest, not another's. Must not forget anything itself: :meth:`note` names the
    agents over the share, and the owner forgets them (and calls :meth:`discard`)."""

    def __init__(self, per_tenant: int) -> None:
        self.per_tenant = per_tenant
        self._of: dict[str, OrderedDict[AgentKey, None]] = {}  # tenant -> its agents, oldest first
        self._tenant: dict[AgentKey, str] = {}  # agent -> the tenant it is counted under

    def note(self, agent: AgentKey, tenant: str) -> list[AgentKey]:
        """``agent`` (of ``tenant``) is the newest now; returns its tenant's oldest over the share."""
        if self._tenant.get(agent, tenant) != tenant:
            self.discard(agent)
        self._tenant[agent] = tenant
        mine = self._of.setdefault(tenant, OrderedDict())
        mine[agent] = None
        mine.move_to_end(agent)
        return list(itertools.islice(mine, max(0, len(mine) - self.per_tenant)))

    def discard(self, agent: AgentKey) -> None:
        tenant = self._tenant.pop(agent, None)
        mine = self._of.get(tenant) if tenant is not None else None
        if mine is not None:
            mine.pop(agent, None)
            if not mine:
                del self._of[tenant]

    def count(self, tenant: str) -> int:
        """Agents of ``tenant`` remembered now."""
        return len(self._of.get(tenant, ()))


@dataclass(slots=True)
class PrefetchTracker:
    """SSD -> DRAM promotions started ahead of an agent's predicted return, and
    how each ended: ``on_time`` (in DRAM before the request arrived), ``late``
    (the request arrived first: it loads what is ready, the rest from SSD),
    ``wasted`` (in DRAM for ``EnginePlacement.PREFETCH_UNUSED_S`` with no request
    from its agent), ``cancelled`` (the tool returned before the
    prefetch started)."""

    counters: Counter[str] = field(default_factory=Counter)
    by_plan: dict[int, _Promotion] = field(default_factory=dict)
    by_agent: dict[AgentKey, _Promotion] = field(default_factory=dict)

    def started(self, agent: AgentKey, plan: MovePlan, now: float) -> None:
        p = _Promotion(agent, plan, now)
        self.by_plan[plan.plan_id] = p
        self.by_agent[agent] = p
        self.counters["prefetches"] += 1
        self.counters["prefetched_blocks"] += len(plan.keys)

    def completed(self, plan_id: int, now: float) -> _Promotion | None:
        p = self.by_plan.pop(plan_id, None)
        if p is None:
            return None
        p.done_s = now
        if p.arrived_s is not None:  # the request came first
            self.counters["prefetch_late"] += 1
            self.by_agent.pop(p.agent, None)
        return p

    def arrived(self, agent: AgentKey, now: float) -> str | None:
        """The agent's next request arrived; ``"on_time"`` / ``"late"`` for its prefetch, if any."""
        p = self.by_agent.get(agent)
        if p is None:
            return None
        p.arrived_s = now
        if p.done_s is None:
            return "late"  # counted when the worker reports it (it may still fail)
        self.by_agent.pop(agent, None)
        self.counters["prefetch_on_time"] += 1
        return "on_time"

    def abandoned(self, agent: AgentKey) -> None:
        """The agent did not come back for the prefetch."""
        p = self.by_agent.pop(agent, None)
        if p is not None and p.arrived_s is None:
            self.counters["prefetch_wasted"] += 1


class EnginePlacement:
    """The :class:`~kvtier.placement.PlacementContext` of the vLLM connector's scheduler side.

    ``manager``: kvtier's DRAM / SSD index (the scheduler's). ``counters``: the
    scheduler's (decisions and holds are counted there). ``hold_budget_fraction``
    bounds the HBM blocks held at once (the replay's pin budget);
    ``holds_enabled`` False refuses every hold (an ablation). The block pool
    comes later, from vLLM's ``bind_gpu_block_pool``.
    """

    surface = SURFACE

    def __init__(self, manager: TierManager, block_size: int, bytes_per_block: int, counters: Counter[str], *,
                 hold_budget_fraction: float = 0.5, holds_enabled: bool = True,
                 prefill_tokens_per_s: float = 20000.0, clock: Callable[[], float] = time.monotonic,
                 hold_tenant_fraction: float = 1.0, tracked_agents_per_tenant: int = MAX_TRACKED_AGENTS) -> None:
        self.manager = manager
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.counters = counters
        self.hold_budget_fraction = hold_budget_fraction
        self.hold_tenant_fraction = hold_tenant_fraction
        self.holds_enabled = holds_enabled
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.clock = clock
        self.holds: HBMHolds | None = None
        # (primary KV cache group, other groups with their windows): see HBMHolds; set before bind_block_pool
        self.hold_groups: tuple[int, tuple[tuple[int, int], ...]] = (0, ())
        self.links = LinkModel(prior=DEFAULT_LINKS)
        self._last_step: tuple[float, int, set[str]] | None = None  # (start, tokens, request ids): step_started
        self.prefetches = PrefetchTracker(counters)
        self.criticalities: dict[AgentKey, float] = {}
        # the agents requests named, least recent first (at most MAX_TRACKED_AGENTS): their tenant
        self.tenant_of: OrderedDict[AgentKey, str] = OrderedDict()
        self._waiting_shares = TenantShares(tracked_agents_per_tenant)  # tracked waiting agents, per tenant
        self._starting: AgentKey | None = None  # the agent whose wait the policy is deciding (for pin's tenant)
        self.graph_reader: Callable[[AgentKey], tuple[float, str | None] | None] | None = None
        self._hashes: dict[BlockKey, Any] = {}  # kvtier key -> vLLM block hash, for waiting agents' contexts
        self._agent_hashes: OrderedDict[AgentKey, list[BlockKey]] = OrderedDict()  # least recently waiting first
        self._waiting: dict[AgentKey, tuple[float, bool]] = {}  # agent -> (when its wait started, on a tool)
        self._tool_history: deque[float] = deque(maxlen=512)
        self._timers: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self._releases: list[BlockKey] = []  # holds to give back after the next allocation
        self._unscheduled: dict[str, int] = {}  # arrived, not yet scheduled: req id -> blocks it needs
        self._finishing_blocks = 0
        self._promotions: list[MovePlan] = []  # to send to the workers this step
        self._arriving: str | None = None  # the request on_new_request is handling
        self._to_stage: list[tuple[str, tuple[BlockKey, ...]]] = []  # arrived requests' contexts (see stage)
        # HBM order (exclusive DRAM): the policy's rank by predicted next use (higher: evicted sooner), and the
        # agents whose wait started, to be put in that order in vLLM's free queue once vLLM has freed their
        # blocks (-> checks left: kept due while the finished request's last block is still referenced)
        self.next_use: Callable[[BlockKey], float | None] | None = None
        self._order_due: dict[AgentKey, int] = {}

    # ------------------------------------------------------------ engine facts

    def bind_block_pool(self, pool: Any) -> None:
        capacity = max(0, int(pool.num_gpu_blocks) - 1)  # one is vLLM's null block
        budget = int(self.hold_budget_fraction * capacity)
        self.holds = HBMHolds(pool, budget, *self.hold_groups,
                              tenant_budget_blocks=int(self.hold_tenant_fraction * budget))

    @property
    def now(self) -> float:
        return self.clock()

    @property
    def hbm_capacity_blocks(self) -> int:
        return max(0, int(self.holds.pool.num_gpu_blocks) - 1) if self.holds is not None else 0

    # ------------------------------------------------------------ scheduler calls

    def note_agent(self, agent: AgentKey, tenant: str, criticality: float | None) -> None:
        """A request of ``agent`` (of ``tenant``) arrived, with the criticality its
        ``kv_transfer_params`` say, if any. At most :data:`MAX_TRACKED_AGENTS` agents are
        remembered (a flood of new ids forgets the least recent, never grows memory)."""
        self.tenant_of[agent] = tenant
        self.tenant_of.move_to_end(agent)
        if criticality is not None:
            self.criticalities[agent] = criticality
        while len(self.tenant_of) > MAX_TRACKED_AGENTS:
            old, _ = self.tenant_of.popitem(last=False)
            self.criticalities.pop(old, None)
        while len(self.criticalities) > MAX_TRACKED_AGENTS:  # (set by a hint server for agents never seen here)
            self.criticalities.pop(next(iter(self.criticalities)))

    def arrived(self, req_id: str, agent: AgentKey | None, num_blocks: int) -> bool:
        """A request arrived; True when it ends its agent's wait."""
        self._unscheduled[req_id] = num_blocks
        self._arriving = req_id  # (for stage, until wait_ended or the next arrival)
        if agent is None:
            return False
        wait = self._waiting.pop(agent, None)
        if wait is None:
            return False
        if wait[1]:  # a user's think time is no tool's history
            self._tool_history.append(self.now - wait[0])
        self.prefetches.arrived(agent, self.now)
        return True

    def waiting_starts(self, agent: AgentKey, keys: Sequence[BlockKey], hashes: Sequence[Any],
                       finishing_blocks: int, tool: bool = True) -> None:
        """Before the policy's ``on_wait_start``: remember the context's block hashes
        (to find its HBM blocks) and exclude the finishing request's own blocks
        (vLLM frees them right after) from the pressure the policy reads."""
        self._forget_context(agent)
        n = min(len(keys), len(hashes))
        self._hashes.update(zip(keys[:n], hashes[:n]))
        self._agent_hashes[agent] = list(keys[:n])
        self._starting = agent
        over_share = self._waiting_shares.note(agent, self.tenant_of.get(agent, ""))
        self._waiting[agent] = (self._waiting.get(agent, (self.now,))[0], tool)  # (re-timed: since it began)
        self._finishing_blocks = finishing_blocks
        if self.next_use is not None and self.holds is not None:
            self._order_due[agent] = self.ORDER_CHECKS
        # agents that never came back: the tenant's own longest waiting over its share, then anyone's
        # (a hold they have keeps its own block references and lapses at its TTL)
        for old in over_share:
            self._forget_waiting(old)
            self.counters["agents_forgotten_tenant"] += 1
        while len(self._agent_hashes) > MAX_TRACKED_AGENTS:
            self._forget_waiting(next(iter(self._agent_hashes)))

    def _forget_context(self, agent: AgentKey) -> None:
        for k in self._agent_hashes.pop(agent, ()):
            self._hashes.pop(k, None)
        self._waiting_shares.discard(agent)

    def _forget_waiting(self, agent: AgentKey) -> None:
        self._forget_context(agent)
        self._waiting.pop(agent, None)
        self.criticalities.pop(agent, None)

    @property
    def num_tracked_agents(self) -> int:
        """Waiting agents whose contexts are remembered now (all tenants)."""
        return len(self._agent_hashes)

    def tracked_waiting(self, tenant: str) -> int:
        """Waiting agents of ``tenant`` whose contexts are remembered now."""
        return self._waiting_shares.count(tenant)

    def waiting_started(self) -> None:
        self._finishing_blocks = 0
        self._starting = None

    ORDER_CHECKS = 4
    """Scheduler calls an agent waits to be ordered while its finished request's blocks are still referenced."""
    def settle_order(self) -> int:
        """HBM order by predicted next use, through vLLM's public ``touch`` / ``free_blocks``:
        for each agent whose wait started (once vLLM has freed its request's blocks), its idle
        cached HBM blocks and those of every waiting agent due no later (the policy's rank)
        go to the tail of vLLM's free queue, the furthest first, so vLLM's LRU reuse evicts
        in next-use order among waiting agents; each agent's tail block first, as vLLM frees
        them. Blocks of agents due later, of finished agents and of untagged requests keep
        their places ahead. A block two agents share goes with the one due sooner. Returns
        the blocks re-queued. O(waiting agents + blocks re-queued), those at most
        :data:`~kvtier.placement.nextuse.REQUEUE_MAX_BLOCKS`. The replay models it as ``+requeue``."""
        if not self._order_due or self.holds is None or self.next_use is None:
            return 0
        pool, rank, holds = self.holds.pool, self.next_use, self.holds
        due, self._order_due = self._order_due, {}
        ranks: dict[AgentKey, float] = {}  # (in the order their waits started)
        for agent, keys in self._agent_hashes.items():
            r = rank(keys[-1]) if keys and agent in self._waiting else None
            if r is not None:
                ranks[agent] = r
        blocks_of: dict[AgentKey, list[Any]] = {}

        def blocks(agent: AgentKey) -> list[Any]:
            if agent not in blocks_of:
                blocks_of[agent] = holds.cached_prefix([self._hashes[k] for k in self._agent_hashes[agent]])
            return blocks_of[agent]

        top = None
        for agent, checks in due.items():
            if agent not in ranks:
                continue
            own = blocks(agent)
            if own and own[-1].ref_cnt > 0 and checks > 1:  # its request's blocks are not freed yet
                self._order_due[agent] = checks - 1
                continue
            top = ranks[agent] if top is None else max(top, ranks[agent])
        if top is None:
            return 0
        chosen, n = [], 0
        for agent in requeue_order(ranks, top):
            if n >= REQUEUE_MAX_BLOCKS:
                break
            chosen.append(blocks(agent))
            n += len(chosen[-1])
        order: dict[int, Any] = {}  # block id -> block, in free-queue order (the last, the last evicted)
        for agent_blocks in reversed(chosen):
            for b in reversed(agent_blocks):
                if b.ref_cnt == 0:
                    order.pop(b.block_id, None)
                    order[b.block_id] = b
        if order:
            idle = list(order.values())
            pool.touch(idle)
            pool.free_blocks(idle)
            self.counters["hbm_ordered_blocks"] += len(idle)
        return len(order)

    def wait_ended(self, agent: AgentKey) -> None:
        """After the policy's ``on_wait_end``: the agent's hold (if any is left) goes
        back once its new request is allocated (the policy's own release, by key,
        misses a hold whose tail the new prompt does not repeat)."""
        self._arriving = None  # (a stage asked for later has no arrival to go with)
        if self.holds is not None:
            self._releases.extend(k for k in self._agent_hashes.get(agent, ()) if self.holds.is_held(k))

    def scheduled(self, scheduled: Mapping[str, int]) -> None:
        """After vLLM allocated this step's requests (``scheduled``: its request ids):
        they no longer wait for HBM, and holds let go of meanwhile can return to
        vLLM's free queue (a resumed agent's blocks are referenced by its request
        by now). O(requests still waiting), not O(running), on the scheduler step."""
        if self._unscheduled:
            for r in [r for r in self._unscheduled if r in scheduled]:
                del self._unscheduled[r]
        if self._to_stage:
            self._stage_unscheduled()
        if self._releases:
            self._settle()

    def finished(self, req_id: str) -> None:
        self._unscheduled.pop(req_id, None)

    def tick(self) -> None:
        """Each scheduler step: fire due timers, end holds whose time is up."""
        now = self.now
        while self._timers and self._timers[0][0] <= now:
            _, _, fn, args = heapq.heappop(self._timers)
            fn(*args)
        if self.holds is not None:
            n = self.holds.expire(now)
            if n:
                self.counters["hbm_hold_expired_blocks"] += n
        for agent, p in list(self.prefetches.by_agent.items()):
            if p.done_s is not None and p.arrived_s is None and now - p.done_s > self.PREFETCH_UNUSED_S:
                self.prefetches.abandoned(agent)
                self._waiting.pop(agent, None)

    PREFETCH_UNUSED_S = 120.0
    """A prefetch in DRAM this long with no request from its agent counts as wasted."""

    def take_promotions(self) -> list[MovePlan]:
        out, self._promotions = self._promotions, []
        return out

    def promotion_done(self, plan: MovePlan, oks: Sequence[bool], seconds: float | None) -> None:
        self.manager.complete_move(plan, list(oks))
        if not all(oks):
            # the worker read the source and it did not verify (absent, corrupt, foreign, an I/O
            # error): as after a failed load, that copy is offered no more until it is rewritten
            failed = [k for k, ok in zip(plan.keys, oks) if not ok]
            self.counters["promote_failed_blocks"] += len(failed)
            self.manager.remove(failed, plan.src)
        if seconds is not None and any(oks):
            self.links.observe("ssd->dram", sum(oks) * self.bytes_per_block, seconds)
        self.prefetches.completed(plan.plan_id, self.now)

    def release_all(self) -> None:
        if self.holds is not None:
            self.holds.release_all()
        self._releases.clear()

    def _settle(self) -> None:
        if self.holds is None:
            self._releases.clear()
            return
        for tag in self._releases:
            n = self.holds.release(tag)
            if n:
                self.counters["hbm_hold_released_blocks"] += n
        self._releases.clear()

    def _hashes_of(self, keys: Sequence[BlockKey]) -> list[Any]:
        """vLLM block hashes of the leading ``keys`` known from a waiting agent's context."""
        return [self._hashes[k] for k in itertools.takewhile(self._hashes.__contains__, keys)]

    # ------------------------------------------------------------ PlacementContext

    def pin(self, keys: Sequence[BlockKey], ttl_s: float) -> bool:
        """Hold the cached HBM prefix of ``keys`` for ``ttl_s`` (within the budget)."""
        if not keys or ttl_s <= 0 or self.holds is None:
            return False
        if not self.holds_enabled:
            self.counters["hbm_hold_disabled"] += 1
            return False
        hashes = self._hashes_of(keys)
        tenant_refusals = self.holds.tenant_refusals
        tenant = self.tenant_of.get(self._starting, "") if self._starting is not None else ""
        n = self.holds.hold(keys[-1], hashes, self.now + ttl_s, tenant)
        if not n:
            self.counters["hbm_hold_refused"] += 1
            if self.holds.tenant_refusals > tenant_refusals:
                self.counters["hbm_hold_refused_tenant"] += 1
            return False
        self.counters["hbm_held_blocks"] += n
        self.counters["hbm_hold_peak_blocks"] = max(self.counters["hbm_hold_peak_blocks"], self.holds.peak_blocks)
        return True

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        if self.holds is not None and keys:
            tags = [k for k in keys if self.holds.is_held(k)]
            self._releases.extend(tags)

    def offload(self, keys: Sequence[BlockKey], dst: str) -> int:
        """What ``dst`` holds counts: written through already, or (exclusive DRAM) to
        be copied down when vLLM reuses the HBM slot; the HBM copy stays until vLLM
        evicts it (nothing frees it sooner)."""
        return len(self.manager.present(keys, dst)) if dst in self.manager.tier_names else 0

    def discard(self, keys: Sequence[BlockKey]) -> int:
        return 0  # forgetting an idle HBM block's hash frees nothing sooner in vLLM

    def transfer_time_s(self, num_blocks: int, link: str) -> float:
        nbytes = num_blocks * self.bytes_per_block
        if link == "ssd->hbm":
            return self.links.predict_s("ssd->dram", nbytes) + self.links.predict_s("dram->hbm", nbytes)
        return self.links.predict_s(link, nbytes)

    def recompute_time_s(self, num_tokens: int) -> float:
        fit = self.links.params(STEP_LINK)
        return num_tokens / (fit[1] if fit is not None else self.prefill_tokens_per_s)

    def load_wait_s(self) -> float:
        """The step a request whose KV loads asynchronously waits through: the engine's fixed cost of a
        step (the round trip through the scheduler and the workers, paid even by an idle engine) plus,
        while requests run, the tokens of one like the last step (its forward); the running part is
        left out when the engine idles (its last step scheduled nothing, or ended over twice its
        predicted length ago). 0.0 until a step was fitted."""
        fit, last = self.links.params(STEP_LINK), self._last_step
        if fit is None:
            return 0.0
        if last is None:
            return fit[0]
        step_s = fit[0] + last[1] / fit[1]
        return step_s if self.now - last[0] <= 2.0 * step_s else fit[0]

    def queued_transfer_s(self, link: str) -> float:
        return 0.0  # the lanes report completions, not their queues (PlacementContext: modelled only)

    def prefill_ahead_s(self) -> float:
        return 0.0  # the steps are seen one at a time, not the prefill queued behind them (modelled only)

    def step_started(self, scheduled: Mapping[str, int]) -> None:
        """Each scheduler step (``scheduled``: request id -> tokens this step). The time since the
        previous step is that step's cost, observed on ``links``' ``engine:step`` link (its "bytes"
        are tokens: seconds = fixed cost + tokens / prefill rate) when a request of the previous step
        runs in this one too, so that the engine did not idle in between. O(requests this step)."""
        now = self.now
        prev = self._last_step
        if prev is not None and not prev[2].isdisjoint(scheduled):
            self.links.observe(STEP_LINK, prev[1], now - prev[0])
        self._last_step = (now, sum(scheduled.values()), set(scheduled)) if scheduled else None

    def running_blocks(self) -> int:
        """HBM blocks referenced (by requests and holds): vLLM's KV usage."""
        if self.holds is None:
            return 0
        pool = self.holds.pool
        return max(0, int(pool.num_gpu_blocks) - 1 - int(pool.get_num_free_blocks()))

    def tool_history_s(self) -> Sequence[float]:
        return self._tool_history

    def private_start(self, keys: Sequence[BlockKey]) -> int:
        return self.manager.private_start(keys)

    def blocks_in(self, keys: Sequence[BlockKey], tier: str) -> int:
        if tier == "hbm":
            if self.holds is None:
                return 0
            hashes = self._hashes_of(keys)
            return len(self.holds.cached_prefix(hashes))
        return len(self.manager.present(keys, tier)) if tier in self.manager.tier_names else 0

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Refresh the idle cached HBM blocks of ``keys`` to most recent (touch + free)."""
        if self.holds is None:
            return
        hashes = self._hashes_of(keys)
        idle = [b for b in self.holds.cached_prefix(hashes) if b.ref_cnt == 0]
        if idle:
            self.holds.pool.touch(idle)
            self.holds.pool.free_blocks(reversed(idle))

    def call_at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._timers, (t, next(self._seq), fn, args))

    def prefetch(self, agent_key: AgentKey, keys: Sequence[BlockKey]) -> float | None:
        """Promote the SSD blocks of ``keys``' cached prefix into DRAM (the worker
        copies them); returns when they should be there."""
        if agent_key in self.prefetches.by_agent:
            return None
        plan = ssd_promotion(self.manager, keys)
        if plan is None:
            return None
        self._promotions.append(plan)
        self.prefetches.started(agent_key, plan, self.now)
        return self.now + self.transfer_time_s(len(plan.keys), "ssd->dram")

    def stage(self, keys: Sequence[BlockKey]) -> int:
        """The request arriving now is queued: once vLLM's next scheduling pass
        has left it unscheduled, its SSD blocks go into DRAM, so the load vLLM
        asks for when it does schedule the request reads DRAM (whatever has not
        arrived by then still comes from SSD; one scheduled at once loads
        straight from SSD). Returns 0: the promotion is decided after the pass."""
        if self._arriving is not None:
            self._to_stage.append((self._arriving, tuple(keys)))
        return 0

    def _stage_unscheduled(self) -> None:
        to_stage, self._to_stage = self._to_stage, []
        for req_id, keys in to_stage:
            plan = ssd_promotion(self.manager, keys) if req_id in self._unscheduled else None
            if plan is not None:
                self._promotions.append(plan)
                self.counters["staged_blocks"] += len(plan.keys)

    def drop(self, keys: Sequence[BlockKey]) -> int:
        n = sum(self.manager.remove(keys, t) for t in self.manager.tier_names)
        self.counters["dropped_blocks"] += n
        return n

    def deprioritize(self, keys: Sequence[BlockKey], tiers: Sequence[str] = ("hbm",)) -> int:
        """Make ``keys``' idle copies the next victims in kvtier's tiers among ``tiers``
        (vLLM's own free queue cannot be reordered: HBM is skipped)."""
        return sum(self.manager.deprioritize(keys, t) for t in tiers if t in self.manager.tier_names)

    def retire(self, keys: Sequence[BlockKey]) -> int:
        n = self.deprioritize(keys, self.manager.tier_names)
        self.counters["retired_blocks"] += n
        return n

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def _graph_fact(self, agent_key: AgentKey) -> tuple[float, str | None] | None:
        return self.graph_reader(agent_key) if self.graph_reader is not None else None

    def criticality(self, agent_key: AgentKey) -> float:
        """From the request's ``kvtier_criticality``, else the hint server's DAG,
        else 1.0 (an agent nobody said more about is its own critical path)."""
        if agent_key in self.criticalities:
            return self.criticalities[agent_key]
        fact = self._graph_fact(agent_key)
        return 1.0 if fact is None else fact[0]

    def hbm_pressure(self) -> float:
        cap = self.hbm_capacity_blocks
        used = max(0, self.running_blocks() - self._finishing_blocks)
        return (used + self.waiting_demand_blocks()) / max(1, cap)

    def waiting_demand_blocks(self) -> int:
        return sum(itertools.islice(self._unscheduled.values(), 16))

    def tiers_enabled(self) -> tuple[str, ...]:
        return ("hbm", *self.manager.tier_names)

    def is_waiting(self, agent_key: AgentKey, tool: bool = False) -> bool:
        """The agent's wait has started and not ended (``tool``: a wait on a tool, not on its turn's end)."""
        wait = self._waiting.get(agent_key)
        return wait is not None and (wait[1] or not tool)

    def parent_of(self, agent_key: AgentKey) -> str | None:
        fact = self._graph_fact(agent_key)
        return None if fact is None else fact[1]

    def remaining_path_s(self, session: int) -> float:
        return 0.0

