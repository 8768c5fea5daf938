"""A fleet of modelled engines: agent sessions routed over N engines, with an optional remote tier they share.

Owns: the fleet's clock (it interleaves the engines' own loops in simulated
time), the routing of each ready request to an engine (:data:`ROUTINGS`), the
hand-over of an agent whose next request lands on another engine than its
last one, and the remote tier (:class:`RemoteTier`: one LRU block store all
engines write every computed block through to, and load a request's missing
prefix from, over each engine's own modelled link). Session bookkeeping
(closed-loop starts, dependencies between a session's agents, the hint
plane) is fleet-wide: one driver :class:`~kvtier.replay.sim.Simulator` owns it
and its event heap; each engine is a :class:`~kvtier.replay.sim.Simulator`
with its own tiers, queue, batch and copy of the placement policy, as live.
Must not read files or print, nor change what one engine does: a fleet of one
engine without a remote tier replays exactly as :class:`Simulator` does (closed
loop; ``tests/test_fleet.py``). Everything it reports is modelled.

Time: each engine keeps its own clock and steps its batch as one engine does;
the fleet always advances whichever engine (or fleet event) is earliest, and
an engine's decode fast-forward stops where another engine could act, so a
request routed to an engine is noticed after that engine's current step, as
one engine notices its own.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..keys import BlockKey
from ..placement import PlacementPolicy
from ..routing import DEFAULT_WEIGHTS, REMOTE
from .model import Agent, Request, Workload
from .runs import Run, SessionRun
from .sim import SimConfig, SimResult, Simulator

ROUTINGS = ("round-robin", "session", "kv-aware")
# the live router's weight of each tier's block (kvtier.routing scores vLLM media)
_TIER_WEIGHT = {"hbm": DEFAULT_WEIGHTS["GPU"], "dram": DEFAULT_WEIGHTS["CPU"], "ssd": DEFAULT_WEIGHTS["STORAGE"]}
DEFAULT_REMOTE_GBPS = 12.5  # one 100 Gb/s NIC per engine


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """How many engines, how requests reach them, and the remote tier they share.

    ``remote_blocks``: capacity of the shared remote tier (0: none).
    ``remote_gbps``: bandwidth of each engine's link to it, GB/s, each way.
    """

    engines: int = 1
    routing: str = "round-robin"
    remote_blocks: int = 0
    remote_gbps: float = DEFAULT_REMOTE_GBPS


class RemoteTier:
    """A block store shared by every engine, LRU over ``capacity_blocks``.
    Bookkeeping only: engines model the bytes on their own links.

    >>> r = RemoteTier(2)
    >>> r.store(["a", "b", "c"])  # "a" is the least recent: evicted
    3
    >>> r.prefix_from(["b", "c", "a"], 0)
    2
    """

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[BlockKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._lru

    def prefix_from(self, keys: Sequence[BlockKey], start: int) -> int:
        """How many of ``keys[start:]``, from ``start`` on, are held without a gap. Side-effect free."""
        n = 0
        for key in itertools.islice(keys, start, None):
            if key not in self._lru:
                break
            n += 1
        return n

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark ``keys`` (held ones) most recently used."""
        for key in keys:
            if key in self._lru:
                self._lru.move_to_end(key)

    def store(self, keys: Sequence[BlockKey]) -> int:
        """Insert or refresh ``keys`` as most recent, evicting the least recent
        beyond capacity. Returns how many were new."""
        new = 0
        for key in keys:
            if key in self._lru:
                self._lru.move_to_end(key)
            else:
                self._lru[key] = None
                new += 1
        while len(self._lru) > self.capacity_blocks:
            self._lru.popitem(last=False)
        return new


class _Driver(Simulator):
    """The fleet's session layer: starts sessions, issues requests when their
    dependencies allow, and hands each ready request to the engine routing picks.
    It never admits or steps a request itself."""

    fleet: "FleetSimulator"

    def _on_ready(self, sr: SessionRun, agent: Agent, req: Request, waited_s: float) -> None:
        fleet = self.fleet
        engine = fleet.route(sr, req)
        agent_key = (sr.idx, agent.agent_id)
        last = fleet.home.get(agent_key)
        if last is not None and last is not engine:
            fleet.hand_over(last, agent_key, req.block_ids)
        fleet.home[agent_key] = engine
        engine.now = max(engine.now, fleet.event_s)
        engine._due_s = self._due_s  # ready from the event's time, as in one Simulator
        try:
            engine._on_ready(sr, agent, req, waited_s)
        finally:
            engine._due_s = None

    def end_session(self, sr: SessionRun) -> None:
        self.session_latency_s.append(self.now - sr.start_s)
        self.graph.end_session("replay", sr.sid, self.now)
        for engine in self.fleet.engines:
            engine.policy.on_session_end(engine.ctx, sr.idx)
        self._start_next_session()


class _Engine(Simulator):
    """One engine of the fleet: its own tiers, queue and batch; session
    bookkeeping goes to the driver, fleet events are merged into its own."""

    fleet: "FleetSimulator"
    index: int

    # ---- the session layer is the driver's
    def issue_request(self, sr: SessionRun, agent: Agent, index: int) -> None:
        self.fleet.driver.now = self.now
        self.fleet.driver.issue_request(sr, agent, index)

    def end_session(self, sr: SessionRun) -> None:
        self.fleet.driver.now = self.now
        self.fleet.driver.end_session(sr)

    # ---- time
    def load(self) -> int:
        """Outstanding requests: running plus waiting."""
        return len(self.prefilling) + len(self.decoding) + len(self.waiting)

    def busy(self) -> bool:
        """Whether a pass at its own clock has work: requests running, admittable ones
        waiting, or staging / victim copies to start."""
        return bool(self.prefilling or self.decoding or self.prefetches.to_stage or self.victims.pending
                    or (self.waiting and not self.admission_blocked))

    def pending_s(self) -> float | None:
        """When this engine next has something to do (``None``: nothing until a request comes)."""
        own = self.event_queue[0][0] if self.event_queue else None
        if self.busy():
            return self.now if own is None else min(self.now, own)
        return own

    def _pop_due(self) -> None:
        """This engine's due events and the fleet's, merged in (time, sequence) order;
        fleet events only up to where no other engine could act first."""
        own, fleet_events = self.event_queue, self.fleet.driver.event_queue
        while True:
            own_due = bool(own) and own[0][0] <= self.now
            fleet_due = bool(fleet_events) and fleet_events[0][0] <= self.now \
                and fleet_events[0][0] <= self.fleet.others_pending_s(self)
            if not (own_due or fleet_due):
                return
            if own_due and (not fleet_due or own[0][:2] < fleet_events[0][:2]):
                due, _, fn, args = heapq.heappop(own)
                self._due_s = due
                try:
                    fn(*args)
                finally:
                    self._due_s = None
            else:
                self.fleet.run_fleet_event(self.now)
            if self.victims.pending:
                self.victims.write()

    def _next_event_s(self) -> float | None:
        times = [t for t in (self.event_queue[0][0] if self.event_queue else None,
                             self.fleet.driver.event_queue[0][0] if self.fleet.driver.event_queue else None,
                             self.fleet.others_pending_s(self)) if t is not None and t != math.inf]
        return min(times) if times else None

    # ---- the remote tier
    def load_beyond(self, run: Run, n_used: int, n_cached: int) -> None:
        remote = self.fleet.remote
        if remote is None or n_used < n_cached:  # the policy recomputes blocks this engine holds: no load beyond
            return
        n = remote.prefix_from(run.keys, n_used)
        if not n:
            return
        keys = run.keys[n_used:n_used + n]
        remote.touch(keys)
        run.hit["remote"] = n * self.block_size
        self.counters["remote_hit_blocks"] = self.counters.get("remote_hit_blocks", 0) + n
        done = self._remote_transfer("remote->hbm", n)
        run.loads_pending += 1
        run.load_ready_s = max(run.load_ready_s, done)
        self.schedule_at(done, self._remote_loaded, run)

    def _remote_loaded(self, run: Run) -> None:
        run.loads_pending -= 1

    def _write_through(self, keys: Sequence[BlockKey], parent: BlockKey | None,
                       agent_key: tuple[int, str] | None = None) -> None:
        super()._write_through(keys, parent, agent_key)
        remote = self.fleet.remote
        if remote is None or not keys:
            return
        new = [k for k in keys if k not in remote]
        remote.touch(keys)
        if new:  # written through; readable there once the copy landed (the request does not wait)
            self.schedule_at(self._remote_transfer("hbm->remote", len(new)), remote.store, new)

    def _remote_transfer(self, link: str, num_blocks: int) -> float:
        """Queue a copy on this engine's remote link (FIFO, bytes / bandwidth); returns its finish time."""
        return self.mover.link_copy(self.now, link, num_blocks * self.bytes_per_block, self.fleet.config.remote_gbps)


class FleetSimulator:
    """Replays ``workload`` on ``fleet.engines`` engines, each configured by
    ``config`` (capacities per engine; ``config.conc`` live sessions for the
    whole fleet) and running its own policy from ``make_policy()``; :meth:`run`
    returns one :class:`SimResult` over the fleet (records of every engine,
    bytes moved summed per link, counters summed)."""

    def __init__(self, workload: Workload, config: SimConfig, make_policy: Callable[[], PlacementPolicy],
                 profile: Any, fleet: FleetConfig) -> None:
        if fleet.engines < 1:
            raise ValueError(f"a fleet needs at least one engine, got {fleet.engines}")
        if fleet.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {fleet.routing!r}; valid: {', '.join(ROUTINGS)}")
        self.config = fleet
        self.remote = RemoteTier(fleet.remote_blocks) if fleet.remote_blocks > 0 else None
        self.driver = _Driver(workload, config, make_policy(), profile)
        self.driver.fleet = self
        if self.driver.policy.needs_oracle:
            raise ValueError(f"policy {self.driver.policy.name!r} needs one engine's recorded future")
        self.engines: list[_Engine] = []
        for i in range(fleet.engines):
            engine = _Engine(workload, config, make_policy(), profile)
            engine.fleet, engine.index = self, i
            # one sequence for every heap (equal times keep their order), one hint plane, one tool history
            engine._seq, engine.graph, engine.tool_history = self.driver._seq, self.driver.graph, \
                self.driver.tool_history
            self.engines.append(engine)
        self.home: dict[tuple[int, str], _Engine] = {}  # agent -> the engine of its last request
        self.event_s = 0.0  # the time of the fleet event being run
        self._next_rr = 0
        self._session_engine: dict[int, _Engine] = {}

    # ------------------------------------------------------------------ routing

    def route(self, sr: SessionRun, req: Request) -> _Engine:
        """The engine ``req`` goes to, per :attr:`FleetConfig.routing`."""
        routing = self.config.routing
        if routing == "session":
            if sr.idx not in self._session_engine:
                self._session_engine[sr.idx] = self._round_robin()
            return self._session_engine[sr.idx]
        if routing == "kv-aware":
            return min(self.engines, key=lambda e: (-self.route_score(e, req.block_ids), e.load(), e.index))
        return self._round_robin()

    def _round_robin(self) -> _Engine:
        engine = self.engines[self._next_rr % len(self.engines)]
        self._next_rr += 1
        return engine

    def route_score(self, engine: _Engine, keys: Sequence[BlockKey]) -> float:
        """``engine``'s score for a request of ``keys``, as the live router
        (:class:`kvtier.routing.RoutingIndex`) scores it from the engines' KV events:
        over the longest prefix the engine can read, each block weighs what its
        fastest tier does (HBM as ``GPU``, DRAM as ``CPU``, SSD as ``STORAGE``, the
        remote tier as ``REMOTE``), so an engine holding the prefix itself beats one
        that would read it from the shared store."""
        hit = engine.mgr.lookup(keys)
        score = sum(_TIER_WEIGHT[t] for t in hit.tiers)
        if self.remote is not None:
            score += DEFAULT_WEIGHTS[REMOTE] * self.remote.prefix_from(keys, hit.num_blocks)
        return round(score, 6)

    def cached_prefix_blocks(self, engine: _Engine, keys: Sequence[BlockKey]) -> int:
        """The longest prefix of ``keys`` ``engine`` could read: its own tiers, then the remote tier."""
        n = engine.mgr.lookup(keys).num_blocks
        return n + (self.remote.prefix_from(keys, n) if self.remote is not None else 0)

    def hand_over(self, last: _Engine, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> None:
        """The agent's next request goes elsewhere: its wait ends on the engine of its
        last request too (its policy lets go of pins and reserves there), and a
        prefetch made there for it is wasted (its hold released, or none taken on arrival)."""
        last.ctx.waiting_agents.pop(agent_key, None)
        pf = last.prefetches.by_agent.pop(agent_key, None)
        if pf is not None:
            pf.cancelled = True
            last.prefetches.settle(pf, ())
        last.policy.on_wait_end(last.ctx, agent_key, keys)
        last.ctx.count("handed_over")

    # --------------------------------------------------------------------- time

    def others_pending_s(self, engine: _Engine) -> float:
        """The earliest time another engine has something to do (``inf``: none)."""
        times = [t for e in self.engines if e is not engine and (t := e.pending_s()) is not None]
        return min(times) if times else math.inf

    def run_fleet_event(self, host_now_s: float | None = None) -> None:
        """Run the earliest fleet event (a session start or a ready request);
        ``host_now_s``: the clock of the engine whose pass runs it (the fleet's own loop: the event's time)."""
        t, _, fn, args = heapq.heappop(self.driver.event_queue)
        self.event_s = t
        self.driver.now = t if host_now_s is None else max(t, host_now_s)
        self.driver._due_s = t
        try:
            fn(*args)
        finally:
            self.driver._due_s = None

    def run(self) -> SimResult:
        """Replay every session; call once. Each turn of the loop runs the earliest of:
        a fleet event (when strictly earlier than every engine), or one pass
        (:meth:`Simulator.advance`) of the engine with the earliest work (lowest
        index on a tie). Raises ``RuntimeError`` when requests are left unserved."""
        driver = self.driver
        driver.start_sessions()
        while True:
            best, best_s = None, math.inf
            for engine in self.engines:
                t = engine.pending_s()
                if t is not None and t < best_s:
                    best, best_s = engine, t
            if driver.event_queue and driver.event_queue[0][0] < best_s:
                self.run_fleet_event()
                continue
            if best is None:
                break
            if not best.busy():  # idle: its clock moves to its next event
                best.now = max(best.now, best_s)
            best.advance()
        return self._result()

    def _result(self) -> SimResult:
        records = [r for e in self.engines for r in e.records]
        counters: dict[str, int] = {}
        bytes_moved: dict[str, int] = {}
        for e in self.engines:
            for k, v in e.counters.items():
                counters[k] = counters.get(k, 0) + v
            for k, v in e.bytes_moved.items():
                bytes_moved[k] = bytes_moved.get(k, 0) + v
        served = len(records) + counters.get("skipped_requests", 0)
        total = self.driver.total_requests
        if served != total:
            waiting = sum(len(e.waiting) for e in self.engines)
            raise RuntimeError(f"fleet replay stalled with {total - served} requests unserved ({waiting} waiting "
                               f"for HBM over {len(self.engines)} engines, policy {self.driver.policy.name!r})")
        now = max([self.driver.now, *(e.now for e in self.engines)])
        return SimResult(records, self.driver.session_latency_s, now, self.driver.cfg.warmup_s, bytes_moved,
                         sum(e.block_touches for e in self.engines), counters)
