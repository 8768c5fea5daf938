"""The replay simulator: closed-loop agent sessions on a modelled continuous-batching engine.

Owns: simulated time and its event queue, the batch steps (chunked prefill
with a token budget per step, decode steps fast-forwarded between events),
the dependency rules of agent sessions (see :mod:`kvtier.replay.model`), the
hint plane's graph as a framework would feed it, write-through of computed
blocks, and the per-request measurements. Its parts, one job each, hold a
reference back to it:

* :mod:`kvtier.replay.admit` -- admission (which waiting request gets HBM, with which loads);
* :mod:`kvtier.replay.mover` -- the modelled mover (links with bandwidth and
  latency, FIFO per link; with a cold codec, :mod:`kvtier.replay.codec`,
  compressed bytes on the links of the compressed tiers and its encode /
  decode as more FIFO stages);
* :mod:`kvtier.replay.victims` -- exclusive DRAM (HBM's victims written down);
* :mod:`kvtier.replay.prefetches` -- prefetches for waiting agents and SSD staging;
* :mod:`kvtier.replay.context` -- the :class:`~kvtier.placement.PlacementContext`
  policies are given (``Simulator.ctx``).

Block residency is the unchanged :class:`~kvtier.manager.TierManager` with
the unchanged eviction policies; placement decisions come from a
:class:`~kvtier.placement.PlacementPolicy`.
Must not read files or print (progress goes through a callback). Closed-loop
workloads keep ``conc`` session trees live; open-loop ones (Mooncake) start
every single-request session at its recorded arrival time.

Engine model, per request:

1. *Ready* when its dependencies finished plus its gap; it joins a FCFS queue.
2. *Admission*: the longest cached prefix is looked up; blocks in DRAM / SSD
   are loaded (modelled transfer) or recomputed, as the policy chooses; HBM
   slots are reserved for the loaded, the computed and the decode blocks
   (evicting as the HBM policy chooses). If HBM cannot hold it beside what
   runs (running requests' blocks and reserves, held prefetches: shared
   blocks once), it waits without evicting anything, as an engine checks its
   free plus evictable blocks before it allocates.
   With exclusive DRAM (a policy's ``write_back_dram``, on a surface with a
   victim write):

   * the blocks HBM evicted are copied down to DRAM first, and the request
     waits for that copy too;
   * loads out of DRAM move the block (no DRAM copy stays behind);
   * the victims take their DRAM slots once the copy and the request's loads
     are done: victims and loads swap places, as a mover does through a
     staging buffer (not bounded in the model);
   * a request that wants victims still on their way lands them at once and
     loads them after the copy (``victims_landed_early``).
3. *Prefill* in chunks sharing each step's token budget with decodes, after
   its loads arrived; the first token comes at the end of the last chunk.
4. *Decode* one token per step; then its blocks are released (they stay
   cached), the blocks its output filled are cached for the next turn, and
   the agent's wait (tool, user, sub-agents) begins.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..agents import AgentGraph, GraphLimits
from ..errors import ConfigError
from ..keys import BlockKey
from ..manager import TierManager, TierSpec
from ..policies import make_policy
from .admission import admission_order
from .admit import Admission
from .codec import ColdCodec
from .context import SimContext
from .belady import BeladyPolicy, DriftOracle, NextUseOracle
from .model import Agent, Request, Workload
from .mover import ModelledMover
from .prefetches import SimPrefetches
from .runs import Run, SessionRun
from .victims import VictimCache
from ..placement import PlacementPolicy, ToolWait
from ..placement.base import TURN_END_GAP_S, UNPREDICTED_GAP_S
from ..placement.nextuse import REQUEUE_MAX_BLOCKS, requeue_order
from ..placement.surface import surface

TOOL_WAITS = ("predicted", "predicted-stream", "announced")  # SimConfig.tool_waits
SCHEDULERS = ("plain", "vllm")  # SimConfig.scheduler


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One replay point. Capacities are in engine blocks of ``workload.block_size`` tokens."""

    hbm_blocks: int
    dram_blocks: int = 0
    ssd_blocks: int = 0
    conc: int = 8
    max_batch_tokens: int = 8192
    max_running: int = 256
    warmup_s: float = 0.0
    gap_cap_s: float | None = None
    pin_budget_fraction: float = 0.5
    max_sessions: int | None = None
    time_scale: float = 1.0  # open loop: arrival times are multiplied by this (< 1 raises the rate)
    # Requests (session index, agent id, request index) skipped: "served" at once
    # without touching the engine or the cache, and left out of every figure
    # (oversized requests under --skip-oversized; the same set for every run).
    skip_requests: frozenset[tuple[int, str, int]] = frozenset()
    admission: str = "fcfs"  # the engine's admission order (kvtier.replay.admission), alike for every policy
    # References (floor, bound) cache in one large tier but run requests as an engine with the policies'
    # HBM would: a request is admitted only while the running requests' blocks, its own included, fit here.
    running_limit_blocks: int | None = None
    # What the engine lets placement do (kvtier.placement.surface): "full" (every decision, modelled only
    # where an engine does not allow it), "vllm" (what the live vLLM connector carries out, recommended setup) or
    # "vllm-write-through" (the connector without exclusive_dram), with additions (BASE+ADDITION, modelled only).
    surface: str = "full"
    # The codec of the cold tiers (kvtier.replay.codec); None (or raw): stored as is. dram_blocks and
    # ssd_blocks stay byte budgets in raw blocks; tier_blocks() is what a compressed tier holds.
    cold_codec: ColdCodec | None = None
    # Whether the policy learns when an agent or a session is done (``on_agent_end``,
    # ``on_session_end``), as live from the SDK's agent ends through a hint server (live, the
    # request's end starts a ``turn_end`` wait first, which the reported end then ends). False:
    # hints in kv_transfer_params only, or from the request-stream middleware (no ends reported): a
    # turn without a tool call, a user's turn or the agent's last, starts a ``turn_end`` wait of
    # TURN_END_GAP_S, as the live connector does, and nothing ends.
    agent_ends: bool = True
    # What a policy is told of a tool wait: "predicted" (the hint plane's prediction from the tool waits seen
    # so far, per agent type as an SDK announces it, then per tool), "predicted-stream" (the chain the
    # request-stream middleware's hints get, where nothing names an agent type: per (session, tool), then per
    # tool, then over all tools, as the connector's hosted hint server has it) or "announced" (the trace's true
    # gap, as the sim applies it: an agent that announces exactly how long its tool will take, as
    # kv_transfer_params' kvtier_tool_wait_s does in the engine tests).
    tool_waits: str = "predicted"
    # How the engine admits requests each step (SCHEDULERS): "vllm" (the default: vLLM 0.32's scheduler: a
    # request is admitted only while the step has tokens left, a block counts as a prefix hit for the requests
    # admitted after the request that schedules it, in that step or later, as vLLM caches a block when it
    # allocates it, and a request admitted with a load from a lower tier takes no running slot until the
    # load is done) or "plain" (up to max_running, whatever the step's token budget; a block is a prefix
    # hit once computed).
    scheduler: str = "vllm"
    # Load or recompute a lower-tier hit (kvtier.placement.loadrule.LOAD_RULES): "surface" (the policy's
    # should_load where the surface lets it choose, else load), "always", "never", "cost" or "llm-d".
    load_rule: str = "surface"
    # Closed loop: start every session at its recorded start (``Session.recorded_at_s``, which kvtier's
    # recorder writes), offset from the earliest and times ``time_scale``, instead of ``conc`` at once: a
    # recording replayed as it was served (``conc`` then plays no part). Every session must carry a recorded
    # start. Open loop already starts every session at its arrival: there it changes nothing.
    recorded_starts: bool = False

    def tier_blocks(self, tier: str) -> int:
        """Blocks ``tier`` holds: its capacity, times the cold codec's ratio where it compresses ``tier``."""
        raw = {"hbm": self.hbm_blocks, "dram": self.dram_blocks, "ssd": self.ssd_blocks}[tier]
        return self.cold_codec.capacity_blocks(tier, raw) if self.cold_codec is not None else raw


@dataclass(slots=True)
class RequestRecord:
    """What one served request measured."""

    session: int
    agent_id: str
    index: int
    first_turn: bool
    ready_s: float
    first_token_s: float
    finish_s: float
    input_tokens: int
    output_tokens: int
    hit_hbm_tokens: int
    hit_dram_tokens: int
    hit_ssd_tokens: int
    computed_tokens: int
    measured: bool

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.ready_s

    @property
    def interactivity_tok_s(self) -> float | None:
        """Decode tokens per second seen by this user (None for a 1-token answer)."""
        dt = self.finish_s - self.first_token_s
        return (self.output_tokens - 1) / dt if self.output_tokens > 1 and dt > 0 else None


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    session_latency_s: list[float]
    makespan_s: float
    measure_start_s: float
    bytes_moved: dict[str, int]
    block_touches: int
    counters: dict[str, int] = field(default_factory=dict)


class _WaitQueue:
    """Requests waiting for admission: FCFS, or by the policy's admission
    priority (lower first, FCFS among equals) when it defines one."""

    def __init__(self, priority: Callable[[Run], float] | None) -> None:
        self._priority = priority
        self._heap: list[tuple[float, int, Run]] = []
        self._fifo: deque[Run] = deque()
        self._seq = itertools.count()

    def append(self, run: Run) -> None:
        if self._priority is None:
            self._fifo.append(run)
        else:
            heapq.heappush(self._heap, (self._priority(run), next(self._seq), run))

    def head(self) -> Run:
        return self._fifo[0] if self._priority is None else self._heap[0][2]

    def pop(self) -> Run:
        return self._fifo.popleft() if self._priority is None else heapq.heappop(self._heap)[2]

    def pop_entry(self) -> Any:
        """The head, in a form :meth:`put_back` returns to its place."""
        return self._fifo.popleft() if self._priority is None else heapq.heappop(self._heap)

    def put_back(self, entries: list[Any]) -> None:
        """Return entries :meth:`pop_entry` took (in the order taken) to their places."""
        if self._priority is None:
            self._fifo.extendleft(reversed(entries))
        else:
            for e in entries:
                heapq.heappush(self._heap, e)

    def __len__(self) -> int:
        return len(self._fifo) + len(self._heap)

    def __iter__(self):
        return iter(self._fifo) if self._priority is None else (e[2] for e in sorted(self._heap))


class Simulator:
    """Replays ``workload`` under ``policy`` on ``profile``; :meth:`run` returns a :class:`SimResult`.

    ``order_log``: when a list is given, the block keys of every admitted
    request are appended in admission order (used to build Belady's oracle).
    """

    def __init__(
        self,
        workload: Workload,
        config: SimConfig,
        policy: PlacementPolicy,
        profile: Any,
        *,
        oracle: NextUseOracle | DriftOracle | None = None,
        order_log: list[tuple[tuple[int, str, int], tuple[BlockKey, ...], float]] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        if profile.window_share is None:  # a sliding-window hybrid's block bytes follow this workload's windows
            profile = profile.fitted_to(workload)
        self.w, self.cfg, self.policy, self.profile = workload, config, policy, profile
        self.block_size = workload.block_size
        self.hbm_capacity_blocks = config.hbm_blocks
        self.surface = surface(config.surface)
        if config.tool_waits not in TOOL_WAITS:
            raise ConfigError("--tool-waits", config.tool_waits, f"valid: {', '.join(TOOL_WAITS)}")
        if config.scheduler not in SCHEDULERS:
            raise ConfigError("--scheduler", config.scheduler, f"valid: {', '.join(SCHEDULERS)}")
        self.bytes_per_block = profile.kv_bytes_per_block(self.block_size)
        codec = config.cold_codec
        self.codec = codec if codec is not None and not codec.identity else None  # None: blocks stored raw
        self.oracle = oracle
        self.order_log = order_log
        self.progress = progress
        # Exclusive DRAM (a victim cache): blocks go down to DRAM as HBM evicts them, and
        # DRAM copies of what HBM holds are the first to go there (holds protect the HBM
        # copy only), where the policy asks for it and the engine surface allows it.
        self.victims = VictimCache(self, policy.write_back_dram == "evict" and self.surface.hbm_victim_write
                                   and "dram" in policy.lower_tiers and config.tier_blocks("dram") > 0)
        self.mgr = TierManager(self._tier_specs(), pin_budget_blocks=config.hbm_blocks,
                               clock=lambda: self.now, record_events=False,
                               hold_tiers=("hbm",) if self.victims.on else None)
        self.lower = [t for t in self.mgr.tier_names if t != "hbm"]
        # write computed blocks through to the lower tiers (the vLLM connector writing through does; with
        # exclusive_dram, to SSD only)
        self.write_through_on = policy.write_through or (self.surface.write_through_always and bool(self.lower))
        self.now = 0.0
        self._seq = itertools.count()
        self.event_queue: list[tuple[float, int, Callable[..., None], tuple]] = []
        # the time the event being run was due (None between events): a request that arrives during a step
        # is ready from then, not from the step's end, when the engine next looks (it waits out the step)
        self._due_s: float | None = None
        self.ctx = SimContext(self, int(config.hbm_blocks * config.pin_budget_fraction))
        prio = admission_order(config.admission)
        self.waiting = _WaitQueue((lambda run: prio(self.ctx, run.sess.idx, run.agent.agent_id, run.sess.start_s))
                                  if prio is not None else None)
        self.prefilling: list[Run] = []
        self.decoding: list[Run] = []
        self.admission = Admission(self, config.scheduler == "vllm")
        self.prefetches = SimPrefetches(self)
        self.records: list[RequestRecord] = []
        self.session_latency_s: list[float] = []
        self._sessions = list(workload.sessions[: config.max_sessions] if config.max_sessions else workload.sessions)
        self._next_session = 0
        self.admission_blocked = False
        self.tool_history: deque[float] = deque(maxlen=512)
        self.total_requests = sum(s.num_requests() for s in self._sessions)
        self.block_touches = 0
        self.counters: dict[str, int] = {"admission_waits": 0, "oversized_requests": 0, "pins_refused": 0,
                                         "offloaded_blocks": 0, "discarded_blocks": 0, "dropped_blocks": 0,
                                         "prefetches": 0, "prefetch_on_time": 0, "prefetch_late": 0,
                                         "prefetch_wasted": 0, "prefetched_blocks": 0, "skipped_requests": 0,
                                         "victims_landed_early": 0, "staged_blocks": 0}
        # The hint plane as the agent framework would feed it (tenant "replay"):
        # policies read criticality and predicted tool returns from it, as live.
        big = 1 << 40
        self.graph = AgentGraph(GraphLimits(max_sessions=big, max_sessions_per_tenant=big,
                                            max_sessions_per_client=big, max_agents=big, max_agents_per_session=big,
                                            max_tool_calls=big, max_tool_calls_per_session=big,
                                            max_edges_per_session=big, max_shared_rounds_per_session=big,
                                            max_stored_block_key_bytes=big, session_ttl_s=float(big)),
                                global_fallback=config.tool_waits == "predicted-stream")
        self.mover = ModelledMover(profile, self.codec, self.bytes_per_block, self.counters)
        self.bytes_moved = self.mover.bytes_moved  # per link, for the result
        # agent -> its context while it waits, in the order the waits started (the surface's hbm_requeue)
        self._waiting_ctx: dict[tuple[int, str], tuple[BlockKey, ...]] = {}

    # ------------------------------------------------------------------ setup

    def _tier_specs(self) -> list[TierSpec]:
        hbm_policy = self._eviction("hbm")
        if self.victims.on:
            hbm_policy = self.victims.logging(make_policy(hbm_policy, self.cfg.hbm_blocks)
                                              if isinstance(hbm_policy, str) else hbm_policy)
        specs = [TierSpec("hbm", self.cfg.hbm_blocks, hbm_policy)]
        for tier in ("dram", "ssd"):
            capacity = self.cfg.tier_blocks(tier)
            if tier in self.policy.lower_tiers and capacity > 0:
                specs.append(TierSpec(tier, capacity, self._eviction(tier)))
        return specs

    def _eviction(self, tier: str) -> Any:
        name = self.policy.eviction_for(tier, lambda: self.now)
        if tier == "hbm" and not isinstance(name, str) and not self.surface.hbm_demote:
            return "lru"  # the engine keeps its own HBM order: no hint reorders it
        if name == "belady":
            if self.oracle is None:
                raise ValueError("the belady policy needs a next-use oracle (run via replay.run_point)")
            return BeladyPolicy(self.oracle)
        return name

    # ------------------------------------------------------------------ events

    def schedule_at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self.event_queue, (t, next(self._seq), fn, args))

    def run(self) -> SimResult:
        self.start_sessions()
        while True:
            if self.advance():
                continue
            if self.event_queue:
                self.now = max(self.now, self.event_queue[0][0])
            else:
                break
        served = len(self.records) + self.counters["skipped_requests"]
        if served != self.total_requests:
            raise RuntimeError(f"replay stalled at {self.now:.1f}s with {self.total_requests - served} "
                               f"requests unserved ({len(self.waiting)} waiting for HBM, policy "
                               f"{self.policy.name!r}, HBM used {self.mgr.used_blocks('hbm')} of "
                               f"{self.hbm_capacity_blocks}, {self.mgr.num_pinned()} pinned); "
                               f"a policy holds HBM nobody can free")
        # the makespan ends with the last request, not with the policy timers that fire after it (a prefetch
        # or reserve timer left over would stretch a short trace's span and cut its tok/s/chip)
        makespan = max((r.finish_s for r in self.records), default=self.now)
        return SimResult(self.records, self.session_latency_s, makespan, self.cfg.warmup_s,
                         dict(self.bytes_moved), self.block_touches, dict(self.counters))

    def start_sessions(self) -> None:
        """The first sessions: every one at its arrival (open loop) or its recorded start
        (``recorded_starts``), else ``conc`` of them."""
        if self.w.open_loop:  # every session (one request each) starts at its recorded arrival
            self._next_session = len(self._sessions)
            for idx, session in enumerate(self._sessions):
                arrival = session.root.requests[0].arrival_s if session.root.requests else 0.0
                self.schedule_at(arrival * self.cfg.time_scale, self._start_session, idx)
        elif self.cfg.recorded_starts:
            starts = [s.recorded_at_s for s in self._sessions]
            if any(t is None for t in starts):
                missing = next(s.session_id for s in self._sessions if s.recorded_at_s is None)
                raise ConfigError("recorded_starts", True, f"session {missing!r} has no recorded start "
                                  "(start_unix_s, written by kvtier's recorder); replay it with conc instead")
            first = min(starts, default=0.0)
            self._next_session = len(self._sessions)
            for idx, t in enumerate(starts):
                self.schedule_at((t - first) * self.cfg.time_scale, self._start_session, idx)
        else:
            for _ in range(min(self.cfg.conc, len(self._sessions))):
                self._start_next_session()

    def advance(self) -> bool:
        """One pass of the engine at ``self.now``: the events due, admission, queue
        staging, then one batch step when requests run. Returns whether it stepped
        (when not, the caller moves the clock to the next event). Called by
        :meth:`run` in a loop, and by a fleet (:mod:`kvtier.replay.fleet`) per engine."""
        self._pop_due()
        self.admission.admit_waiting()
        if self.prefetches.to_stage:
            self.prefetches.stage_queued()
        if self.victims.pending:
            self.victims.write()
        if self.prefilling or self.decoding:
            self._step()
            if self.victims.pending:
                self.victims.write()
            return True
        return False

    def _pop_due(self) -> None:
        """Run every event due by ``self.now``, in (time, sequence) order."""
        while self.event_queue and self.event_queue[0][0] <= self.now:
            due, _, fn, args = heapq.heappop(self.event_queue)
            self._due_s = due
            try:
                fn(*args)
            finally:
                self._due_s = None
            if self.victims.pending:
                self.victims.write()

    def _next_event_s(self) -> float | None:
        """When the next event is due (``None``: none); a decode-only step fast-forwards no further."""
        return self.event_queue[0][0] if self.event_queue else None

    # --------------------------------------------------------------- sessions

    def _start_next_session(self) -> None:
        if self._next_session >= len(self._sessions):
            return
        self._next_session += 1
        self._start_session(self._next_session - 1)

    def _start_session(self, idx: int) -> None:
        sr = SessionRun(idx, self._sessions[idx], self._arrived_s())
        root = sr.session.root
        self.graph.start_session("replay", sr.sid, self.now)
        self.graph.spawn_agent("replay", sr.sid, root.agent_id, self.now, agent_type=self._agent_type(sr, root),
                               expected_num_requests=self._declared_requests(root))
        if not root.requests:
            self.end_session(sr)
            return
        self.issue_request(sr, root, 0)
        for child in sr.children_of.get(root.agent_id, []):
            if child.spawn_after is None:
                self.issue_request(sr, child, 0)

    def _declared_requests(self, agent: Agent) -> int:
        """What the framework tells the hint plane about the agent's request
        count: known for a declared application DAG, unknown (0) for traces."""
        return len(agent.requests) if self.w.declared_dag else 0

    def end_session(self, sr: SessionRun) -> None:
        self.session_latency_s.append(self.now - sr.start_s)
        self.graph.end_session("replay", sr.sid, self.now)
        if self.cfg.agent_ends:
            self.policy.on_session_end(self.ctx, sr.idx)
        self._start_next_session()

    def issue_request(self, sr: SessionRun, agent: Agent, index: int) -> None:
        """Schedule request ``index`` of ``agent`` if its dependencies allow it."""
        if not agent.requests or index >= len(agent.requests):
            return
        req = agent.requests[index]
        if agent.agent_id in sr.running or sr.next_index[agent.agent_id] != index:
            return
        if any(not sr.finished[d] for d in req.depends_on):
            return
        if index == 0 and agent.parent_id is not None:  # the framework announces the sub-agent
            join = f"{agent.parent_id}@{agent.join_before}" if agent.join_before is not None else ""
            self.graph.spawn_agent("replay", sr.sid, agent.agent_id, self.now, parent_id=agent.parent_id,
                                   agent_type=self._agent_type(sr, agent), join_group=join,
                                   expected_num_requests=self._declared_requests(agent))
            if agent.join_before is not None:
                self.graph.add_dependency("replay", sr.sid, agent.agent_id, agent.parent_id, self.now)
        gap = req.gap_s if index > 0 or agent.parent_id is not None else 0.0
        if self.cfg.gap_cap_s is not None:
            gap = min(gap, self.cfg.gap_cap_s)
        sr.running.add(agent.agent_id)
        self.schedule_at(self._arrived_s() + gap, self._on_ready, sr, agent, req, gap)

    def _arrived_s(self) -> float:
        """When what is being handled happened: the due time of the event being run (a step may have
        passed it), else now."""
        return self.now if self._due_s is None else min(self.now, self._due_s)

    def _on_ready(self, sr: SessionRun, agent: Agent, req: Request, waited_s: float) -> None:
        agent_key = (sr.idx, agent.agent_id)
        if req.gap_cause == "tool":  # a tool's duration is known once it returned
            self.tool_history.append(waited_s)
            self.graph.end_tool_call("replay", sr.sid, agent.agent_id, f"{agent.agent_id}#{req.index}", self.now)
        self.ctx.waiting_agents.pop(agent_key, None)
        self._waiting_ctx.pop(agent_key, None)
        self.graph.start_request("replay", sr.sid, agent.agent_id, str(req.index), self.now)
        run = Run(sr, agent, req, self._arrived_s())
        self.policy.on_wait_end(self.ctx, agent_key, run.keys)
        skipped = (sr.idx, agent.agent_id, req.index) in self.cfg.skip_requests
        if self.prefetches.on_ready(run, agent_key, skipped):
            self.waiting.append(run)
        elif skipped:
            self._skip(run)

    def _skip(self, run: Run) -> None:
        """A request in ``skip_requests`` ends the moment it is ready: no engine
        time, no cache change, no record; its agent goes on as if it was served."""
        self.counters["skipped_requests"] += 1
        run.uncached = run.skipped = True
        run.first_token_s = self.now
        self._due_s = None  # what waits for it goes on from now: another it waits for may have ended since
        self._finish(run)

    # ------------------------------------------------------------------ mover

    def transfer_s(self, src: str, dst: str, num_blocks: int, num_encode: int | None = None) -> float:
        """Queue a modelled copy now (see :meth:`ModelledMover.transfer`); returns its finish time."""
        return self.mover.transfer(self.now, src, dst, num_blocks, num_encode)

    def load_beyond(self, run: Run, n_used: int, n_cached: int) -> None:
        """Admission uses ``run.keys[:n_used]`` of the ``n_cached`` blocks this engine's
        tiers hold (fewer when the policy recomputes rather than loads); the rest is
        computed. A fleet engine loads what a shared remote tier holds after a full
        local prefix (adds its tokens to ``run.hit``); one engine alone has nothing beyond."""

    def _write_through(self, keys: Sequence[BlockKey], parent: BlockKey | None,
                       agent_key: tuple[int, str] | None = None) -> None:
        """Copy freshly computed HBM blocks down to the lower tiers the policy admits them to
        (modelled, async); with exclusive DRAM, not to DRAM (HBM's victims go there)."""
        if not self.write_through_on or not keys:
            return
        for tier in self.lower:
            n = 0 if tier == "dram" and self.victims.on else len(keys)  # exclusive DRAM: HBM's victims go there
            if not (n := n and min(n, self.policy.admit_lower(self.ctx, tier, agent_key, n))):
                continue
            plan = self.mgr.prepare_store(tier, keys[:n], parent)
            if plan is None or not plan.keys:
                if plan is not None:
                    self.mgr.complete_store(plan, True)
                continue
            done = self.transfer_s("hbm", tier, len(plan.keys),
                                  self.mover.num_to_encode(self.mgr, self.lower, plan.keys, tier))
            self.schedule_at(done, self.mgr.complete_store, plan, True)

    # ------------------------------------------------------------------ steps

    def _step(self) -> None:
        budget = self.cfg.max_batch_tokens - len(self.decoding)
        chunks: list[tuple[Run, int]] = []
        prefill_tokens = 0
        weighted_ctx = 0
        for run in self.prefilling:
            if budget <= 0:
                break
            if run.loads_pending or run.holding:
                continue
            take = min(run.prefill_left, budget)
            chunks.append((run, take))
            budget -= take
            prefill_tokens += take
            weighted_ctx += take * run.ctx_tokens
        batch = len(self.decoding)
        decode_ctx = sum(r.ctx_tokens for r in self.decoding)
        stepping = [r for r in self.prefilling if r.step_wait]  # loads this step carries out ("vllm")
        if not chunks and not batch:  # only prefills waiting for their loads (or, "vllm", for a running slot)
            self._idle_step(stepping)
            return
        dt = self.profile.step_time_s(prefill_tokens, weighted_ctx / prefill_tokens if prefill_tokens else 0,
                                      batch, decode_ctx)
        steps = 1
        if not chunks and not stepping:  # decode only: fast-forward to the next finish or event
            steps = min(r.decode_left for r in self.decoding)
            next_s = self._next_event_s()
            if next_s is not None:
                steps = min(steps, max(1, math.ceil((next_s - self.now) / dt)))
            steps = max(1, steps)
        self.now += dt * steps
        self._loads_stepped(stepping)
        for run in self.decoding:
            run.decode_left -= steps
            run.ctx_tokens += steps
        finished = [r for r in self.decoding if r.decode_left <= 0]
        if finished:
            self.decoding = [r for r in self.decoding if r.decode_left > 0]
        for run, take in chunks:
            run.prefill_left -= take
            run.ctx_tokens += take
            if run.prefill_left == 0:
                self._prefill_done(run)
                if run.decode_left <= 0:
                    finished.append(run)
                else:
                    self.decoding.append(run)
        if any(r.prefill_left == 0 for r, _ in chunks):
            self.prefilling = [r for r in self.prefilling if r.prefill_left > 0]
        for run in finished:
            self._finish(run)

    def _idle_step(self, stepping: list[Run]) -> None:
        """Nothing to compute: an engine with loads to carry out still steps, at its fixed cost; else the
        clock moves to the first load that lands."""
        if stepping:
            self.now += self.profile.hardware.step_overhead_s
            self._loads_stepped(stepping)
            return
        pending = [r.load_ready_s for r in self.prefilling if r.loads_pending]
        if pending:
            self.now = max(self.now, min(pending))

    @staticmethod
    def _loads_stepped(runs: list[Run]) -> None:
        """The step that carried out ``runs``' loads ended: they are done once their transfers are."""
        for run in runs:
            run.step_wait = False
            run.loads_pending -= 1

    def _prefill_done(self, run: Run) -> None:
        run.first_token_s = self.now
        run.decode_left = run.req.output_tokens - 1
        if run.store_plan is not None:
            self.admission.computed(run)
            self.mgr.complete_store(run.store_plan, True)
            self.admission.retail(run)
            first = run.keys.index(run.computed_keys[0]) if run.computed_keys else 0
            self._write_through(run.computed_keys, run.keys[first - 1] if first else None,
                                (run.sess.idx, run.agent.agent_id))
            run.store_plan = None

    def _finish(self, run: Run) -> None:
        mgr, req, sr, agent = self.mgr, run.req, run.sess, run.agent
        if not run.uncached:
            if run.held is not None:
                mgr.release((run.held,))
            if run.reserved:
                mgr.unreserve("hbm", run.reserved)
        ctx_keys = self._cache_output_blocks(run) if not run.uncached else run.keys
        self.admission_blocked = False
        if not run.skipped:
            self._record(run)
        sr.running.discard(agent.agent_id)
        index = req.index
        self.graph.end_request("replay", sr.sid, agent.agent_id, str(index), self.now)
        sr.next_index[agent.agent_id] = index + 1
        last = index + 1 >= len(agent.requests)
        if last:
            sr.finished[agent.agent_id] = True
            sr.agents_left -= 1
            self._waiting_ctx.pop((sr.idx, agent.agent_id), None)
        for child in sr.children_of.get(agent.agent_id, []):
            if child.spawn_after == index:
                self.issue_request(sr, child, 0)
        if last:
            self.graph.end_agent("replay", sr.sid, agent.agent_id, self.now)
            if self.cfg.agent_ends:
                self.policy.on_agent_end(self.ctx, (sr.idx, agent.agent_id), tuple(ctx_keys))
            else:  # to the policy, as any turn without a tool call: it may come back
                self._wait_starts(sr, agent, ctx_keys, "turn_end", TURN_END_GAP_S)
        if not last:
            nxt = agent.requests[index + 1]
            if nxt.gap_cause == "tool":
                self.graph.start_tool_call("replay", sr.sid, agent.agent_id, f"{agent.agent_id}#{index + 1}",
                                           "tool", expected_s=None, now_s=self.now)
            if nxt.gap_cause == "user" and not self.cfg.agent_ends:
                self._wait_starts(sr, agent, ctx_keys, "turn_end", TURN_END_GAP_S)
            else:
                self._wait_starts(sr, agent, ctx_keys, nxt.gap_cause, self._predict_gap(sr, agent, nxt))
            self.issue_request(sr, agent, index + 1)
        elif agent.parent_id is not None:
            parent = sr.session.agent(agent.parent_id)
            self.issue_request(sr, parent, sr.next_index[parent.agent_id])
        if sr.agents_left == 0:
            self.end_session(sr)
        if self.progress is not None and not run.skipped and len(self.records) % 500 == 0:
            self.progress(len(self.records), self.total_requests)

    def _wait_starts(self, sr: SessionRun, agent: Agent, ctx_keys: Sequence[BlockKey], cause: str,
                     predicted: float) -> None:
        """``agent`` stopped with the context ``ctx_keys``; the policy is told to expect it
        back in ``predicted`` s (a prediction; the true gap only where tool waits are announced)."""
        key = (sr.idx, agent.agent_id)
        self.ctx.waiting_agents[key] = self.now + predicted
        self.policy.on_wait_start(self.ctx, ToolWait(key, tuple(ctx_keys), cause, predicted))
        if self.surface.hbm_requeue:
            self._requeue(key, tuple(ctx_keys))

    def _requeue(self, agent_key: tuple[int, str], keys: tuple[BlockKey, ...]) -> None:
        """``hbm_requeue``: ``agent_key`` started waiting with the context ``keys``: its HBM
        blocks and those of every waiting agent due no later go to the LRU tail in the
        policy's next-use order (:func:`~kvtier.placement.nextuse.requeue_order`), as the
        live connector re-queues vLLM's free queue."""
        self._waiting_ctx.pop(agent_key, None)
        self._waiting_ctx[agent_key] = keys
        ranks = {}
        for a, ctx in self._waiting_ctx.items():
            r = self.policy.next_use_rank(ctx[-1]) if ctx else None
            if r is not None:
                ranks[a] = r
        if agent_key not in ranks:
            return
        chosen, n = [], 0
        for a in requeue_order(ranks, ranks[agent_key]):
            if n >= REQUEUE_MAX_BLOCKS:
                break
            present = self.mgr.present(self._waiting_ctx[a], "hbm")
            chosen.append(present)
            n += len(present)
        for present in reversed(chosen):
            self.mgr.touch(present, "hbm")
        self.counters["hbm_requeued_blocks"] = self.counters.get("hbm_requeued_blocks", 0) + n

    def _cache_output_blocks(self, run: Run) -> tuple[BlockKey, ...]:
        """Blocks the answer filled become cacheable: those the recording names
        (``Request.answer_block_ids``), else the next request of the same agent's
        up to the answer's end (its prompt extends this one, the answer as generated).
        Returns the agent's context keys."""
        agent, req = run.agent, run.req
        if req.answer_block_ids is not None:
            return self._cache_recorded_answer(run, req.answer_block_ids)
        if req.index + 1 >= len(agent.requests):
            return run.keys
        nxt = agent.requests[req.index + 1].block_ids
        n = len(run.keys)
        if nxt[:n] != run.keys:
            return run.keys
        # vLLM computed (and cached) every token but the last one sampled, which it never fed back
        upto = min(len(nxt), (req.input_tokens + req.output_tokens - 1) // self.block_size)
        out_keys = nxt[n:upto]
        if out_keys:
            plan = self.mgr.prepare_store("hbm", out_keys, run.keys[-1] if n else None)
            if plan is not None:
                self.mgr.complete_store(plan, True)
                self._write_through(plan.keys, run.keys[-1] if n else None, (run.sess.idx, agent.agent_id))
        return nxt[:upto]

    def _cache_recorded_answer(self, run: Run, answer: tuple[BlockKey, ...]) -> tuple[BlockKey, ...]:
        """Cache the blocks the recording says the answer filled, as the engine did; the agent's context
        is the prompt and, where the next prompt goes on with them, those blocks."""
        keys, agent = run.keys, run.agent
        if answer:
            plan = self.mgr.prepare_store("hbm", answer, keys[-1] if keys else None)
            if plan is not None:
                self.mgr.complete_store(plan, True)
                self._write_through(plan.keys, keys[-1] if keys else None, (run.sess.idx, agent.agent_id))
        nxt = agent.requests[run.req.index + 1].block_ids if run.req.index + 1 < len(agent.requests) else ()
        n = len(keys)
        return keys + answer if answer and nxt[:n + len(answer)] == keys + answer else keys

    def _agent_type(self, sr: SessionRun, agent: Agent) -> str:
        """The agent type the hint plane keys tool-wait history by: the trace's, as an SDK announces it; the
        session with ``predicted-stream``, as :class:`~kvtier.hints.stream.StreamHints` derives it."""
        return sr.sid if self.cfg.tool_waits == "predicted-stream" else agent.agent_type

    def _predict_gap(self, sr: SessionRun, agent: Agent, nxt: Request) -> float:
        """The wait a policy is told to expect: for a tool, the hint plane's
        prediction (history blended per agent type), or the true gap where the
        tool waits are ``announced``; otherwise, or before any history,
        :data:`UNPREDICTED_GAP_S`. Else the true gap is never revealed."""
        if nxt.gap_cause == "tool" and self.cfg.tool_waits == "announced":
            return nxt.gap_s if self.cfg.gap_cap_s is None else min(nxt.gap_s, self.cfg.gap_cap_s)
        if nxt.gap_cause == "tool":
            s = self.graph.session("replay", sr.sid)
            call = s.agents[agent.agent_id].tool_calls.get(f"{agent.agent_id}#{nxt.index}") if s else None
            if call is not None and call.predicted_s is not None:
                return call.predicted_s
        return UNPREDICTED_GAP_S

    def _record(self, run: Run) -> None:
        req = run.req
        self.records.append(RequestRecord(
            session=run.sess.idx, agent_id=run.agent.agent_id, index=req.index,
            first_turn=run.agent.parent_id is None and req.index == 0,
            # a client sent the request its API overhead before the engine saw it (0 unless the profile was
            # fitted to a served engine): TTFT as the client measures it
            ready_s=run.ready_s - self.profile.hardware.request_overhead_s, first_token_s=run.first_token_s,
            finish_s=self.now,
            input_tokens=req.input_tokens, output_tokens=req.output_tokens,
            hit_hbm_tokens=run.hit["hbm"], hit_dram_tokens=run.hit["dram"], hit_ssd_tokens=run.hit["ssd"],
            computed_tokens=run.computed_tokens, measured=run.ready_s >= self.cfg.warmup_s,
        ))

    def running_blocks(self) -> int:
        """HBM blocks the running requests hold: their prompts and decode reserves."""
        return sum(len(r.keys) + r.reserved for r in itertools.chain(self.prefilling, self.decoding))
