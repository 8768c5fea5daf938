"""The replay simulator: closed-loop agent sessions on a modelled continuous-batching engine.

Owns: simulated time, the engine model (admission, chunked prefill with a
token budget per step, decode steps fast-forwarded between events), the
dependency rules of agent sessions (see :mod:`kvtier.replay.model`), the
modelled mover (links with bandwidth and latency, FIFO per link; with a
cold codec, :mod:`kvtier.replay.codec`, compressed bytes on the links of the
compressed tiers and its encode / decode as more FIFO stages) and the
per-request measurements. Block residency is the unchanged
:class:`~kvtier.manager.TierManager` with the unchanged eviction policies;
placement decisions come from a :class:`~kvtier.placement.PlacementPolicy`.
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
from itertools import compress
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..agents import AgentGraph, GraphLimits
from ..errors import ConfigError
from ..keys import BlockKey
from ..manager import TierManager, TierSpec
from ..policies import make_policy
from ..transfer.linkmodel import LinkModel
from .admission import admission_order
from .codec import CODEC_STAGES, ColdCodec, ENCODE, transfer_stages
from .belady import BeladyPolicy, DriftOracle, NextUseOracle
from .model import Agent, Request, Session, Workload
from ..placement import PlacementPolicy, ToolWait
from ..placement.base import TURN_END_GAP_S, UNPREDICTED_GAP_S, ssd_promotion
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
    # How the engine admits requests each step (SCHEDULERS): "plain" (up to max_running, whatever the step's
    # token budget; a block is a prefix hit once computed) or "vllm" (vLLM 0.32's scheduler: a request is
    # admitted only while the step has tokens left, a block counts as a prefix hit for the requests
    # admitted after the request that schedules it, in that step or later, as vLLM caches a block when it
    # allocates it, and a
    # request admitted with a load from a lower tier takes no running slot until the load is done).
    scheduler: str = "plain"

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


class _Run:
    """A request in flight."""

    __slots__ = (
        "sess", "agent", "req", "keys", "ready_s", "prefill_left", "ctx_tokens", "decode_left",
        "first_token_s", "held", "store_plan", "computed_keys", "loads_pending", "load_ready_s",
        "hit", "computed_tokens", "uncached", "reserved", "prefetch", "skipped", "take", "holding",
    )

    def __init__(self, sess: "_SessionRun", agent: Agent, req: Request, ready_s: float) -> None:
        self.sess, self.agent, self.req, self.ready_s = sess, agent, req, ready_s
        self.keys: tuple[BlockKey, ...] = req.block_ids  # trace ids are the replay's block keys
        self.prefill_left = 0
        self.ctx_tokens = 0
        self.decode_left = 0
        self.first_token_s = 0.0
        self.held: BlockKey | None = None  # the chain tail referenced in HBM (protects its prefix)
        self.store_plan: Any = None
        self.computed_keys: tuple[BlockKey, ...] = ()
        self.loads_pending = 0
        self.load_ready_s = 0.0
        self.hit = {"hbm": 0, "dram": 0, "ssd": 0}
        self.computed_tokens = 0
        self.uncached = False
        self.reserved = 0  # HBM blocks reserved for the decode
        self.prefetch: _Prefetch | None = None  # a prefetch for this request that arrived in time
        self.skipped = False  # in SimConfig.skip_requests: never admitted, never recorded
        self.take = 0  # scheduler "vllm": prompt tokens the pass being admitted schedules for it
        # scheduler "vllm": admitted with a load from a lower tier, not running yet (vLLM's
        # WAITING_FOR_REMOTE_KVS): it takes no running slot until the load is done and a slot is free
        self.holding = False


class _Prefetch:
    """A promotion into HBM started for an agent's next request."""

    __slots__ = ("plans", "done_s", "arrived", "hold", "keys", "cancelled")

    def __init__(self, plans: list[Any], done_s: float, keys: tuple[BlockKey, ...]) -> None:
        self.plans, self.done_s, self.keys = plans, done_s, keys
        self.arrived = False
        self.hold: BlockKey | None = None  # referenced HBM tail from arrival until admission
        self.cancelled = False  # its request was skipped: nothing to hold on arrival


class _WaitQueue:
    """Requests waiting for admission: FCFS, or by the policy's admission
    priority (lower first, FCFS among equals) when it defines one."""

    def __init__(self, priority: Callable[[_Run], float] | None) -> None:
        self._priority = priority
        self._heap: list[tuple[float, int, _Run]] = []
        self._fifo: deque[_Run] = deque()
        self._seq = itertools.count()

    def append(self, run: _Run) -> None:
        if self._priority is None:
            self._fifo.append(run)
        else:
            heapq.heappush(self._heap, (self._priority(run), next(self._seq), run))

    def head(self) -> _Run:
        return self._fifo[0] if self._priority is None else self._heap[0][2]

    def pop(self) -> _Run:
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


class _SessionRun:
    __slots__ = ("idx", "session", "start_s", "next_index", "finished", "running", "agents_left", "children_of",
                 "sid")

    def __init__(self, idx: int, session: Session, start_s: float) -> None:
        self.idx, self.session, self.start_s = idx, session, start_s
        self.next_index = {a.agent_id: 0 for a in session.agents}  # next request to issue
        self.finished = {a.agent_id: not a.requests for a in session.agents}
        self.running: set[str] = set()
        self.agents_left = sum(1 for a in session.agents if a.requests)
        self.children_of: dict[str, list[Agent]] = {}
        self.sid = str(idx)  # the session id the hint plane knows it by
        for a in session.agents[1:]:
            self.children_of.setdefault(a.parent_id or "", []).append(a)


class _VictimLog:
    """An HBM eviction policy that also tells the simulator what it evicted (the
    victim cache writes those blocks down to DRAM)."""

    def __init__(self, inner: Any, sim: "Simulator") -> None:
        self._inner, self._sim = inner, sim
        self.name = inner.name

    def pop_victim(self, is_evictable: Any, incoming: BlockKey | None = None) -> BlockKey | None:
        key = self._inner.pop_victim(is_evictable, incoming)
        if key is not None:
            self._sim._victims.append((key, self._sim.mgr.parent_of(key)))
        return key

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)


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
        self._vllm_sched = config.scheduler == "vllm"
        # scheduler "vllm": the blocks prefilling runs store in HBM, by key: (run, position in its keys)
        self._prefill_owner: dict[BlockKey, tuple[_Run, int]] = {}
        self._num_holding = 0  # scheduler "vllm": runs in self.prefilling that are ``holding``
        self.bytes_per_block = profile.kv_bytes_per_block(self.block_size)
        codec = config.cold_codec
        self.codec = codec if codec is not None and not codec.identity else None  # None: blocks stored raw
        self.oracle = oracle
        self.order_log = order_log
        self.progress = progress
        # Exclusive DRAM (a victim cache): blocks go down to DRAM as HBM evicts them, and
        # DRAM copies of what HBM holds are the first to go there (holds protect the HBM
        # copy only), where the policy asks for it and the engine surface allows it.
        self._victim_cache = (policy.write_back_dram == "evict" and self.surface.hbm_victim_write
                              and "dram" in policy.lower_tiers and config.tier_blocks("dram") > 0)
        self._victims: list[tuple[BlockKey, BlockKey | None]] = []  # HBM victims to write down
        # copying down: parent, lands at, and its DRAM store (the slot it claimed; None: claimed when it lands)
        self._victims_on_way: dict[BlockKey, tuple[BlockKey | None, float, Any]] = {}
        self._to_stage: list[Sequence[BlockKey]] = []  # contexts of requests that arrived (see stage)
        self._deferred: list[tuple[_Run, Any]] = []  # taken off the queue's head during one admission pass
        self.mgr = TierManager(self._tier_specs(), pin_budget_blocks=config.hbm_blocks,
                               clock=lambda: self.now, record_events=False,
                               hold_tiers=("hbm",) if self._victim_cache else None)
        self._pin_budget_blocks = int(config.hbm_blocks * config.pin_budget_fraction)
        self._pinned_blocks = 0
        self._pin_sizes: dict[BlockKey, int] = {}  # pinned chain tail -> blocks it protects
        self.lower = [t for t in self.mgr.tier_names if t != "hbm"]
        # write computed blocks through to the lower tiers (the vLLM connector as it comes does; with
        # exclusive_dram, to SSD only)
        self._write_through_on = policy.write_through or (self.surface.write_through_always and bool(self.lower))
        self.now = 0.0
        self._seq = itertools.count()
        self._events: list[tuple[float, int, Callable[..., None], tuple]] = []
        prio = admission_order(config.admission)
        self.waiting = _WaitQueue((lambda run: prio(self, run.sess.idx, run.agent.agent_id, run.sess.start_s))
                                  if prio is not None else None)
        self.prefilling: list[_Run] = []
        self.decoding: list[_Run] = []
        self.link_free_s: dict[str, float] = {}
        self.bytes_moved: dict[str, int] = {}
        self.records: list[RequestRecord] = []
        self.session_latency_s: list[float] = []
        self._sessions = list(workload.sessions[: config.max_sessions] if config.max_sessions else workload.sessions)
        self._next_session = 0
        self._admission_blocked = False
        self._tool_history: deque[float] = deque(maxlen=512)
        self._admitted = 0
        self._total_requests = sum(s.num_requests() for s in self._sessions)
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
        self.links = LinkModel(prior=dict(getattr(profile, "_link_to_cost", {})) |
                               (self.codec.prior() if self.codec is not None else {}))
        self._prefetches: dict[tuple[int, str], _Prefetch] = {}
        self._waiting_agents: dict[tuple[int, str], float] = {}  # agent -> predicted return (s)
        # agent -> its context while it waits, in the order the waits started (the surface's hbm_requeue)
        self._waiting_ctx: dict[tuple[int, str], tuple[BlockKey, ...]] = {}

    # ------------------------------------------------------------------ setup

    def _tier_specs(self) -> list[TierSpec]:
        hbm_policy = self._eviction("hbm")
        if self._victim_cache:
            hbm_policy = _VictimLog(make_policy(hbm_policy, self.cfg.hbm_blocks) if isinstance(hbm_policy, str)
                                    else hbm_policy, self)
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

    def _at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self) -> SimResult:
        self._start_sessions()
        while True:
            if self._advance():
                continue
            if self._events:
                self.now = max(self.now, self._events[0][0])
            else:
                break
        served = len(self.records) + self.counters["skipped_requests"]
        if served != self._total_requests:
            raise RuntimeError(f"replay stalled at {self.now:.1f}s with {self._total_requests - served} "
                               f"requests unserved ({len(self.waiting)} waiting for HBM, policy "
                               f"{self.policy.name!r}, HBM used {self.mgr.used_blocks('hbm')} of "
                               f"{self.hbm_capacity_blocks}, {self.mgr.num_pinned()} pinned); "
                               f"a policy holds HBM nobody can free")
        return SimResult(self.records, self.session_latency_s, self.now, self.cfg.warmup_s,
                         dict(self.bytes_moved), self.block_touches, dict(self.counters))

    def _start_sessions(self) -> None:
        """The first sessions: every one at its arrival (open loop), else ``conc`` of them."""
        if self.w.open_loop:  # every session (one request each) starts at its recorded arrival
            self._next_session = len(self._sessions)
            for idx, session in enumerate(self._sessions):
                arrival = session.root.requests[0].arrival_s if session.root.requests else 0.0
                self._at(arrival * self.cfg.time_scale, self._start_session, idx)
        else:
            for _ in range(min(self.cfg.conc, len(self._sessions))):
                self._start_next_session()

    def _advance(self) -> bool:
        """One pass of the engine at ``self.now``: the events due, admission, queue
        staging, then one batch step when requests run. Returns whether it stepped
        (when not, the caller moves the clock to the next event). Called by
        :meth:`run` in a loop, and by a fleet (:mod:`kvtier.replay.fleet`) per engine."""
        self._pop_due()
        self._admit_waiting()
        if self._to_stage:
            self._stage_queued()
        if self._victims:
            self._write_victims()
        if self.prefilling or self.decoding:
            self._step()
            if self._victims:
                self._write_victims()
            return True
        return False

    def _pop_due(self) -> None:
        """Run every event due by ``self.now``, in (time, sequence) order."""
        while self._events and self._events[0][0] <= self.now:
            _, _, fn, args = heapq.heappop(self._events)
            fn(*args)
            if self._victims:
                self._write_victims()

    def _next_event_s(self) -> float | None:
        """When the next event is due (``None``: none); a decode-only step fast-forwards no further."""
        return self._events[0][0] if self._events else None

    # --------------------------------------------------------------- sessions

    def _start_next_session(self) -> None:
        if self._next_session >= len(self._sessions):
            return
        self._next_session += 1
        self._start_session(self._next_session - 1)

    def _start_session(self, idx: int) -> None:
        sr = _SessionRun(idx, self._sessions[idx], self.now)
        root = sr.session.root
        self.graph.start_session("replay", sr.sid, self.now)
        self.graph.spawn_agent("replay", sr.sid, root.agent_id, self.now, agent_type=self._agent_type(sr, root),
                               expected_num_requests=self._declared_requests(root))
        if not root.requests:
            self._end_session(sr)
            return
        self._issue(sr, root, 0)
        for child in sr.children_of.get(root.agent_id, []):
            if child.spawn_after is None:
                self._issue(sr, child, 0)

    def _declared_requests(self, agent: Agent) -> int:
        """What the framework tells the hint plane about the agent's request
        count: known for a declared application DAG, unknown (0) for traces."""
        return len(agent.requests) if self.w.declared_dag else 0

    def _end_session(self, sr: _SessionRun) -> None:
        self.session_latency_s.append(self.now - sr.start_s)
        self.graph.end_session("replay", sr.sid, self.now)
        if self.cfg.agent_ends:
            self.policy.on_session_end(self, sr.idx)
        self._start_next_session()

    def _issue(self, sr: _SessionRun, agent: Agent, index: int) -> None:
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
        self._at(self.now + gap, self._on_ready, sr, agent, req, gap)

    def _on_ready(self, sr: _SessionRun, agent: Agent, req: Request, waited_s: float) -> None:
        agent_key = (sr.idx, agent.agent_id)
        if req.gap_cause == "tool":  # a tool's duration is known once it returned
            self._tool_history.append(waited_s)
            self.graph.end_tool_call("replay", sr.sid, agent.agent_id, f"{agent.agent_id}#{req.index}", self.now)
        self._waiting_agents.pop(agent_key, None)
        self._waiting_ctx.pop(agent_key, None)
        self.graph.start_request("replay", sr.sid, agent.agent_id, str(req.index), self.now)
        run = _Run(sr, agent, req, self.now)
        self.policy.on_wait_end(self, agent_key, run.keys)
        pf = self._prefetches.pop(agent_key, None)
        if (sr.idx, agent.agent_id, req.index) in self.cfg.skip_requests:
            if pf is not None:
                pf.cancelled = True
                self._settle_prefetch(pf, ())
            self._skip(run)
            return
        if pf is not None and not pf.arrived:  # late: the request waits for its blocks in flight
            self.counters["prefetch_late"] += 1
            if self.surface.prefetch_to == "hbm":
                self._at(pf.done_s, self._enqueue_after_prefetch, run, pf)
                return
            pf.cancelled = True  # into DRAM: the request loads from wherever its blocks are now
            pf = None
        if pf is not None:
            self.counters["prefetch_on_time"] += 1
            run.prefetch = pf
        self.waiting.append(run)

    def _skip(self, run: _Run) -> None:
        """A request in ``skip_requests`` ends the moment it is ready: no engine
        time, no cache change, no record; its agent goes on as if it was served."""
        self.counters["skipped_requests"] += 1
        run.uncached = run.skipped = True
        run.first_token_s = self.now
        self._finish(run)

    def _enqueue_after_prefetch(self, run: _Run, pf: _Prefetch) -> None:
        run.prefetch = pf
        self.waiting.append(run)

    # ---------------------------------------------------------------- admission

    def _admit_waiting(self) -> None:
        budget = self._plan_running() if self._vllm_sched else 1
        if self._admission_blocked:
            return
        deferred = self._deferred  # skipped this pass, keeping their places (a surface's defer_loads)
        while self.waiting and self._num_running() < self.cfg.max_running and budget > 0:
            run = self.waiting.head()
            if self._load_not_ready(run):
                deferred.append((run, self.waiting.pop_entry()))
                continue
            if not self._admit(run):
                if self._release_prefetch_holds(run):
                    continue  # blocks prefetched for later requests must not keep the head out
                self._admission_blocked = True
                self.counters["admission_waits"] += 1
                break
            self.waiting.pop()
            self.prefilling.append(run)
            if self._vllm_sched and run.loads_pending:
                run.holding = True
                self._num_holding += 1
            if self._victims:  # the slots it takes are reused once their old blocks are copied out
                done = self._write_victims(run.load_ready_s if run.loads_pending else None)
                if done is not None:
                    run.loads_pending += 1
                    run.load_ready_s = max(run.load_ready_s, done)
                    self._at(done, self._victims_out, run)
            if self._vllm_sched and not run.loads_pending and not run.holding:
                run.take = min(run.prefill_left, budget)
                budget -= run.take
        if deferred:
            self.waiting.put_back([entry for _, entry in deferred])
            deferred.clear()

    def _plan_running(self) -> int:
        """Scheduler "vllm": the prompt tokens this pass's step gives the running
        prefills (each run's ``take``, in the order :meth:`_step` serves them);
        returns the tokens left for new requests, as vLLM schedules its running
        requests before it admits any waiting one."""
        budget = self.cfg.max_batch_tokens - len(self.decoding)
        for run in self.prefilling:
            run.take = 0 if run.loads_pending or run.holding or budget <= 0 else min(run.prefill_left, budget)
            budget -= run.take
        # then, first of the waiting ones, those whose load is done (vLLM's kv_holding_waiting), in order:
        # each runs, at the end of the running list, while a slot and tokens are left
        ready = [r for r in self.prefilling if r.holding and not r.loads_pending]
        running = self._num_running()
        for run in ready:
            if running >= self.cfg.max_running or budget <= 0:
                break
            run.holding = False
            self._num_holding -= 1
            running += 1
            self.prefilling.remove(run)
            self.prefilling.append(run)
            run.take = min(run.prefill_left, budget)
            budget -= run.take
        return budget

    def _num_running(self) -> int:
        """Requests holding a running slot (``max_running``): under scheduler "vllm", not
        those admitted with a load that have not run yet (``holding``)."""
        return len(self.prefilling) + len(self.decoding) - self._num_holding

    def _scheduled_in_hbm(self, keys: Sequence[BlockKey], n: int) -> int:
        """Scheduler "vllm": how many of ``keys[n:]`` (not readable in any tier) a prefilling
        request has already been scheduled to compute, by this pass or an earlier one:
        vLLM caches a block when it allocates it, so a request admitted after that
        finds it as a prefix hit in HBM (and the forward pass computes it once)."""
        owner, bs = self._prefill_owner, self.block_size
        m = n
        while m < len(keys):
            entry = owner.get(keys[m])
            if entry is None:
                break
            run, pos = entry
            if run.holding:  # (vLLM caches a loading request's blocks only once its load is done)
                break
            done = sum(run.hit.values()) + run.computed_tokens - run.prefill_left + run.take
            if (pos + 1) * bs > done:
                break
            m += 1
        return m - n

    def _load_not_ready(self, run: _Run) -> bool:
        """Whether ``run`` is deferred: on a surface with ``defer_loads``, its cached
        prefix goes on in HBM victims still being copied down to DRAM. It stays
        queued without HBM and those behind it may be admitted, as vLLM's
        scheduler does when a connector's ``get_num_new_matched_tokens`` answers
        ``None``; it is tried again once they have landed (:meth:`_store_victims`)."""
        if not (self.surface.defer_loads and self._victims_on_way):
            return False
        keys = run.keys
        n = self.mgr.lookup(keys).num_blocks
        if n < len(keys) and keys[n] in self._victims_on_way:
            self.counters["deferred_admissions"] = self.counters.get("deferred_admissions", 0) + 1
            return True
        return False

    def _admit(self, run: _Run) -> bool:
        mgr, keys, bs = self.mgr, run.keys, self.block_size
        req = run.req
        need = math.ceil((req.input_tokens + req.output_tokens) / bs)
        request_id = (run.sess.idx, run.agent.agent_id, req.index)
        if self.oracle is not None:
            self.oracle.advance(request_id, self.now)
        if need > self.cfg.hbm_blocks:  # can never fit: served without caching
            self.counters["oversized_requests"] += 1
            run.uncached = True
            if run.prefetch is not None:  # its hold must not outlive the request
                self._settle_prefetch(run.prefetch, ())
                run.prefetch = None
            run.prefill_left = run.computed_tokens = req.input_tokens
            self._admitted += 1
            self.block_touches += len(keys)
            if self.order_log is not None:
                self.order_log.append((request_id, keys, self.now))
            return True
        limit = self.cfg.running_limit_blocks
        if limit is not None and (self.prefilling or self.decoding) and self.running_blocks() + need > limit:
            return False
        if (self.prefilling or self.decoding) and not self._may_fit(run, need):
            return False
        hit = mgr.lookup(keys)
        lands = 0.0
        if self._victims_on_way and hit.num_blocks < len(keys) and keys[hit.num_blocks] in self._victims_on_way:
            lands = self._land_victims(keys, hit.num_blocks)
            hit = mgr.lookup(keys)
        names = hit.tier_names
        tiers = hit.tier_indices
        n_used = hit.num_blocks
        hbm_idx = 0
        if any(t != hbm_idx for t in tiers):
            by_tier: dict[str, int] = {}
            for t in tiers:
                if t != hbm_idx:
                    by_tier[names[t]] = by_tier.get(names[t], 0) + 1
            if self.surface.choose_load and not self.policy.should_load(self, by_tier, 0):
                n_used = tiers.index(next(t for t in tiers if t != hbm_idx))
        used_tiers = tiers[:n_used]
        all_hbm = used_tiers.count(hbm_idx) == n_used
        moves = []
        ok = True
        for src_idx in range(1, len(names) if not all_hbm else 1):
            src_keys = list(compress(keys, map(src_idx.__eq__, used_tiers)))
            if not src_keys:
                continue
            plan = mgr.prepare_move(src_keys, names[src_idx], "hbm", keep_source=self._keep_source(names[src_idx]))
            if plan is not None:
                moves.append(plan)
            if plan is None or len(plan.keys) < len(src_keys):
                ok = False
                break
        # One reference on the deepest ready HBM block protects its whole prefix
        # in HBM (a block with a resident child is never a victim): O(1) per request.
        tail = self._deepest_ready_hbm(keys, n_used)
        if tail is not None:
            mgr.acquire((tail,))
        n_sched = self._scheduled_in_hbm(keys, n_used) if self._vllm_sched and n_used == hit.num_blocks else 0
        n_own = n_used + n_sched  # the rest this request computes
        store_plan = None
        if ok and n_own < len(keys):
            store_plan = mgr.prepare_store("hbm", keys[n_own:], keys[n_own - 1] if n_own else None)
            if store_plan is None or len(store_plan.keys) + len(store_plan.skipped) < len(keys) - n_own:
                ok = False
        reserve = need - len(keys)
        if ok and reserve > 0 and not mgr.reserve("hbm", reserve):
            ok = False
        if not ok:  # roll back; the request waits for memory
            for plan in moves:
                mgr.complete_move(plan, False)
            if store_plan is not None:
                mgr.complete_store(store_plan, False)
            if tail is not None:
                mgr.release((tail,))
            return False
        self._admitted += 1
        self.block_touches += len(keys)
        if self.order_log is not None:
            self.order_log.append((request_id, keys, self.now))
        if run.prefetch is not None:
            self._settle_prefetch(run.prefetch, keys[:n_used])
            run.prefetch = None
        mgr.touch(keys[:n_used], "hbm")
        if store_plan is not None and store_plan.skipped:
            mgr.touch(store_plan.skipped, "hbm")
        if self._write_through_on:
            # A write-through store of this prompt refreshes the copies already
            # below (so a chain's head stays at least as recent as its tail);
            # exclusive DRAM: the DRAM copies of what now runs in HBM go first.
            for tier in self.lower:
                if tier == "dram" and self._victim_cache:
                    mgr.deprioritize(keys, tier)
                else:
                    mgr.touch(keys, tier)
        run.held, run.reserved, run.store_plan = tail, max(0, reserve), store_plan
        run.computed_keys = store_plan.keys if store_plan is not None else ()
        run.hit["hbm"] = (used_tiers.count(hbm_idx) + n_sched) * bs
        if self._vllm_sched and store_plan is not None and store_plan.keys:
            owner, computes = self._prefill_owner, set(store_plan.keys)
            owner.update((key, (run, i)) for i, key in enumerate(keys[n_own:], n_own) if key in computes)
        for plan in moves:
            run.hit[plan.src] += len(plan.keys) * bs
            done = self._transfer(plan.src, "hbm", len(plan.keys))
            if plan.src == "dram" and lands > self.now:  # some of them are still on their way down
                done = max(done, lands + self._path_s("dram", "hbm", len(plan.keys)))
            run.loads_pending += 1
            run.load_ready_s = max(run.load_ready_s, done)
            self._at(done, self._on_load_done, run, plan)
        self._load_beyond(run, n_used + n_sched, hit.num_blocks + n_sched)
        hit_tokens = sum(run.hit.values())
        # vLLM recomputes at least the last token of a fully cached prompt
        run.computed_tokens = max(1, req.input_tokens - hit_tokens)
        run.prefill_left = run.computed_tokens
        run.ctx_tokens = req.input_tokens - run.computed_tokens
        return True

    def _load_beyond(self, run: _Run, n_used: int, n_cached: int) -> None:
        """Admission uses ``run.keys[:n_used]`` of the ``n_cached`` blocks this engine's
        tiers hold (fewer when the policy recomputes rather than loads); the rest is
        computed. A fleet engine loads what a shared remote tier holds after a full
        local prefix (adds its tokens to ``run.hit``); one engine alone has nothing beyond."""

    def _may_fit(self, run: _Run, need: int) -> bool:
        """Whether ``run`` fits in HBM beside what cannot be evicted there: the
        running requests' blocks and reserves, and arrived prefetches' holds.
        An engine checks its free plus evictable blocks before it allocates, so
        a request that cannot fit waits without evicting anything (trying would
        push out blocks and then roll back). Shared blocks count once."""
        others = [pf for pf in self._held_prefetches() if pf is not run.prefetch]
        busy = self.running_blocks() + sum(len(pf.keys) for pf in others)
        if busy + need <= self.cfg.hbm_blocks:  # fits even if nothing were shared (most calls)
            return True
        held = set(run.keys)
        reserved = need - len(run.keys)
        for r in itertools.chain(self.prefilling, self.decoding):
            if not r.uncached:  # (served without caching: holds no HBM)
                held.update(r.keys)
                reserved += r.reserved
        for pf in others:
            held.update(pf.keys)
        return len(held) + reserved <= self.cfg.hbm_blocks

    def _deepest_ready_hbm(self, keys: Sequence[BlockKey], n_used: int) -> BlockKey | None:
        if keys and self.mgr.contains(keys[-1], "hbm"):
            return keys[-1]
        return self.mgr.last_present(keys[:n_used], "hbm")

    def _retail(self, run: _Run) -> None:
        """Move the run's reference to its prompt's last block once it is ready in HBM."""
        last = run.keys[-1] if run.keys else None
        if last is None or last == run.held or not self.mgr.contains(last, "hbm"):
            return
        self.mgr.acquire((last,))
        if run.held is not None:
            self.mgr.release((run.held,))
        run.held = last

    def _on_load_done(self, run: _Run, plan: Any) -> None:
        self.mgr.complete_move(plan, True)
        if plan.keep_source and plan.src == "dram" and self._victim_cache:  # in HBM now: first to go below
            self.mgr.deprioritize(plan.keys, plan.src)
        run.loads_pending -= 1
        self._retail(run)

    # ------------------------------------------------------------------ mover

    def _keep_source(self, src: str) -> bool:
        """Whether a promotion out of ``src`` keeps its copy there. Exclusive DRAM
        moves (a DRAM copy of what HBM holds would only fill DRAM, parked under
        the suffix HBM writes back later); any other tier keeps its copy."""
        return not (self._victim_cache and src == "dram")

    def _transfer(self, src: str, dst: str, num_blocks: int, num_encode: int | None = None) -> float:
        """Queue a modelled copy from ``src`` to ``dst`` on its stages (the link(s), and
        the codec's encode / decode where a compressed tier is entered / left: see
        :mod:`kvtier.replay.codec`), each a FIFO; returns its finish time.
        ``num_encode``: blocks to encode (default all; see :meth:`_num_to_encode`)."""
        t = self.now
        for stage, nbytes in transfer_stages(self.codec, src, dst, num_blocks, self.bytes_per_block, num_encode):
            start = max(t, self.link_free_s.get(stage, 0.0))
            service_s = self._service_s(stage, nbytes)
            self.links.observe(stage, nbytes, service_s)  # what a live mover reports on completion
            t = start + service_s
            self.link_free_s[stage] = t
            if stage in CODEC_STAGES:
                name = "codec_encoded_blocks" if stage == ENCODE else "codec_decoded_blocks"
                self.counters[name] = self.counters.get(name, 0) + nbytes // self.bytes_per_block
            else:
                self.bytes_moved[stage] = self.bytes_moved.get(stage, 0) + nbytes
        return t

    def _service_s(self, stage: str, nbytes: int) -> float:
        """Service time of one stage of a transfer (a link, or the codec's CPU)."""
        if stage in CODEC_STAGES:
            assert self.codec is not None
            return self.codec.service_s(stage, nbytes)
        return self.profile.transfer_time_s(nbytes, stage)

    def _path_s(self, src: str, dst: str, num_blocks: int) -> float:
        """Service time of a copy from ``src`` to ``dst`` on idle stages (no queueing)."""
        return sum(self._service_s(stage, nbytes)
                   for stage, nbytes in transfer_stages(self.codec, src, dst, num_blocks, self.bytes_per_block))

    def _num_to_encode(self, keys: Sequence[BlockKey], dst: str) -> int | None:
        """How many of ``keys``, written down from HBM to ``dst``, the codec encodes: those
        without a compressed copy, held or arriving, in another compressed tier (a block
        is never compressed twice: its compressed bytes are what goes down). ``None``
        (all) without a codec."""
        if self.codec is None:
            return None
        mgr = self.mgr
        others = [t for t in self.lower if t != dst and self.codec.compresses(t)]
        if not others:
            return None
        return sum(1 for k in keys if not any(mgr.contains(k, t) or mgr.is_pending(k, t) for t in others))

    def _victims_out(self, run: _Run) -> None:
        run.loads_pending -= 1

    def _write_victims(self, after: float | None = None) -> float | None:
        """Victim cache: HBM victims without a DRAM copy are written down (the engine
        copies them out before it reuses their slots), those with one are refreshed
        there. Returns when the copy is done (``None``: nothing to copy).

        A victim takes its DRAM slot when its copy lands, or at ``after`` (when
        the loads that made room for it in HBM have freed their DRAM slots): the
        victims and the loads of one admission swap places, as a mover does
        through its staging buffer, instead of evicting from a DRAM that the
        loads are about to empty. Until it lands a victim is readable nowhere."""
        victims, self._victims = self._victims, []
        mgr = self.mgr
        todo = []
        for key, parent in victims:
            if mgr.contains(key, "hbm"):
                continue
            if mgr.contains(key, "dram"):
                mgr.touch((key,), "dram")
                continue
            todo.append((key, parent))
        plans: list[Any] = [None] * len(todo)
        if not self.surface.victim_swap:  # each claims its DRAM slot now (the live write-back)
            kept = []
            for key, parent in todo:
                if mgr.is_pending(key, "dram"):  # on its way there already
                    continue
                plan = mgr.prepare_store("dram", (key,), parent)
                if plan is None or not plan.keys:
                    self.counters["write_back_no_room"] = self.counters.get("write_back_no_room", 0) + 1
                    continue
                kept.append(((key, parent), plan))
            todo, plans = [k for k, _ in kept], [p for _, p in kept]
            after = None
        if not todo:
            return None
        done = self._transfer("hbm", "dram", len(todo),  # one copy for the lot
                              self._num_to_encode([key for key, _ in todo], "dram"))
        lands = done if after is None else max(done, after)
        self._victims_on_way.update((key, (parent, lands, plan)) for (key, parent), plan in zip(todo, plans))
        self._at(lands, self._store_victims, todo)
        return done

    def _store_victims(self, todo: list[tuple[BlockKey, BlockKey | None]]) -> None:
        on_way = self._victims_on_way
        for key, parent in todo:
            entry = on_way.pop(key, None)
            if entry is None:
                continue  # landed early (:meth:`_land_victims`)
            self._store_victim(key, parent, entry[2])
        if self.surface.defer_loads:  # a deferred request may find its blocks now
            self._admission_blocked = False

    def _land_victims(self, keys: Sequence[BlockKey], n: int) -> float:
        """A request wants victims still on their way down (``keys[n]``, the first
        block its cached prefix lacks, is one): they take their DRAM slots now,
        so the request finds them, and it loads them once they have landed.
        Returns when the last of them lands (``0.0``: none were on their way)."""
        mgr, on_way = self.mgr, self._victims_on_way
        lands = 0.0
        for key in keys[n:]:
            entry = on_way.pop(key, None)
            if entry is None:
                if not mgr.contains(key):
                    break
                continue
            lands = max(lands, entry[1])
            self._store_victim(key, entry[0], entry[2])
            self.counters["victims_landed_early"] += 1
        return lands

    def _store_victim(self, key: BlockKey, parent: BlockKey | None, plan: Any = None) -> None:
        mgr = self.mgr
        if plan is not None:  # its slot was claimed when it left HBM
            mgr.complete_store(plan, True)
            return
        if mgr.contains(key, "hbm") or mgr.contains(key, "dram") or mgr.is_pending(key, "dram"):
            return  # back in HBM, or stored again meanwhile
        plan = mgr.prepare_store("dram", (key,), parent)
        if plan is not None:
            mgr.complete_store(plan, True)

    def _write_through(self, keys: Sequence[BlockKey], parent: BlockKey | None,
                       agent_key: tuple[int, str] | None = None) -> None:
        """Copy freshly computed HBM blocks down to the lower tiers the policy admits them to
        (modelled, async); with exclusive DRAM, not to DRAM (HBM's victims go there)."""
        if not self._write_through_on or not keys:
            return
        for tier in self.lower:
            if (tier == "dram" and self._victim_cache) or not self.policy.admit_lower(self, tier, agent_key):
                continue
            plan = self.mgr.prepare_store(tier, keys, parent)
            if plan is None or not plan.keys:
                if plan is not None:
                    self.mgr.complete_store(plan, True)
                continue
            done = self._transfer("hbm", tier, len(plan.keys), self._num_to_encode(plan.keys, tier))
            self._at(done, self.mgr.complete_store, plan, True)

    # ------------------------------------------------------------------ steps

    def _step(self) -> None:
        budget = self.cfg.max_batch_tokens - len(self.decoding)
        chunks: list[tuple[_Run, int]] = []
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
        if not chunks and not batch:  # only prefills waiting for their loads (or, "vllm", for a running slot)
            pending = [r.load_ready_s for r in self.prefilling if r.loads_pending]
            if pending:
                self.now = max(self.now, min(pending))
            return
        dt = self.profile.step_time_s(prefill_tokens, weighted_ctx / prefill_tokens if prefill_tokens else 0,
                                      batch, decode_ctx)
        steps = 1
        if not chunks:  # decode only: fast-forward to the next finish or event
            steps = min(r.decode_left for r in self.decoding)
            next_s = self._next_event_s()
            if next_s is not None:
                steps = min(steps, max(1, math.ceil((next_s - self.now) / dt)))
            steps = max(1, steps)
        self.now += dt * steps
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

    def _prefill_done(self, run: _Run) -> None:
        run.first_token_s = self.now
        run.decode_left = run.req.output_tokens - 1
        if run.store_plan is not None:
            if self._vllm_sched:
                owner = self._prefill_owner
                for key in run.computed_keys:
                    del owner[key]
            self.mgr.complete_store(run.store_plan, True)
            self._retail(run)
            first = run.keys.index(run.computed_keys[0]) if run.computed_keys else 0
            self._write_through(run.computed_keys, run.keys[first - 1] if first else None,
                                (run.sess.idx, run.agent.agent_id))
            run.store_plan = None

    def _finish(self, run: _Run) -> None:
        mgr, req, sr, agent = self.mgr, run.req, run.sess, run.agent
        if not run.uncached:
            if run.held is not None:
                mgr.release((run.held,))
            if run.reserved:
                mgr.unreserve("hbm", run.reserved)
        ctx_keys = self._cache_output_blocks(run) if not run.uncached else run.keys
        self._admission_blocked = False
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
                self._issue(sr, child, 0)
        if last:
            self.graph.end_agent("replay", sr.sid, agent.agent_id, self.now)
            if self.cfg.agent_ends:
                self.policy.on_agent_end(self, (sr.idx, agent.agent_id), tuple(ctx_keys))
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
            self._issue(sr, agent, index + 1)
        elif agent.parent_id is not None:
            parent = sr.session.agent(agent.parent_id)
            self._issue(sr, parent, sr.next_index[parent.agent_id])
        if sr.agents_left == 0:
            self._end_session(sr)
        if self.progress is not None and not run.skipped and len(self.records) % 500 == 0:
            self.progress(len(self.records), self._total_requests)

    def _wait_starts(self, sr: _SessionRun, agent: Agent, ctx_keys: Sequence[BlockKey], cause: str,
                     predicted: float) -> None:
        """``agent`` stopped with the context ``ctx_keys``; the policy is told to expect it
        back in ``predicted`` s (a prediction; the true gap only where tool waits are announced)."""
        key = (sr.idx, agent.agent_id)
        self._waiting_agents[key] = self.now + predicted
        self.policy.on_wait_start(self, ToolWait(key, tuple(ctx_keys), cause, predicted))
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

    def _cache_output_blocks(self, run: _Run) -> tuple[BlockKey, ...]:
        """Blocks the answer filled become cacheable: the next request of the same
        agent names them (its prompt extends this one). Returns the agent's context keys."""
        agent, req = run.agent, run.req
        if req.index + 1 >= len(agent.requests):
            return run.keys
        nxt = agent.requests[req.index + 1].block_ids
        n = len(run.keys)
        if nxt[:n] != run.keys:
            return run.keys
        upto = min(len(nxt), (req.input_tokens + req.output_tokens) // self.block_size)
        out_keys = nxt[n:upto]
        if out_keys:
            plan = self.mgr.prepare_store("hbm", out_keys, run.keys[-1] if n else None)
            if plan is not None:
                self.mgr.complete_store(plan, True)
                self._write_through(plan.keys, run.keys[-1] if n else None, (run.sess.idx, agent.agent_id))
        return nxt[:upto]

    def _agent_type(self, sr: _SessionRun, agent: Agent) -> str:
        """The agent type the hint plane keys tool-wait history by: the trace's, as an SDK announces it; the
        session with ``predicted-stream``, as :class:`~kvtier.hints.stream.StreamHints` derives it."""
        return sr.sid if self.cfg.tool_waits == "predicted-stream" else agent.agent_type

    def _predict_gap(self, sr: _SessionRun, agent: Agent, nxt: Request) -> float:
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

    def _record(self, run: _Run) -> None:
        req = run.req
        self.records.append(RequestRecord(
            session=run.sess.idx, agent_id=run.agent.agent_id, index=req.index,
            first_turn=run.agent.parent_id is None and req.index == 0,
            ready_s=run.ready_s, first_token_s=run.first_token_s, finish_s=self.now,
            input_tokens=req.input_tokens, output_tokens=req.output_tokens,
            hit_hbm_tokens=run.hit["hbm"], hit_dram_tokens=run.hit["dram"], hit_ssd_tokens=run.hit["ssd"],
            computed_tokens=run.computed_tokens, measured=run.ready_s >= self.cfg.warmup_s,
        ))

    # ------------------------------------------------------- PlacementContext

    def pin(self, keys: Sequence[BlockKey], ttl_s: float) -> bool:
        """Pin a chain by its deepest HBM block (tail-first eviction keeps its prefix).
        The budget counts the chain's blocks."""
        tail = self._deepest_ready_hbm(keys, len(keys))
        if ttl_s <= 0 or tail is None or not self.surface.hbm_hold:
            return False
        n = keys.index(tail) + 1
        if self._pinned_blocks + n - self._pin_sizes.get(tail, 0) > self._pin_budget_blocks:
            self.counters["pins_refused"] += 1
            return False
        self.mgr.pin((tail,), ttl_s)
        self._pinned_blocks += n - self._pin_sizes.get(tail, 0)
        self._pin_sizes[tail] = n
        self._at(self.now + ttl_s, self._pin_lapsed, tail)
        return True

    def _pin_lapsed(self, tail: BlockKey) -> None:
        if tail in self._pin_sizes and not self.mgr.is_pinned(tail):
            self._pinned_blocks -= self._pin_sizes.pop(tail)
        self._admission_blocked = False

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        tails = [k for k in keys if k in self._pin_sizes]
        if tails:
            self.mgr.unpin(tails)
            for tail in tails:
                self._pinned_blocks -= self._pin_sizes.pop(tail)
            self._admission_blocked = False

    def offload(self, keys: Sequence[BlockKey], dst: str) -> int:
        """Swap the HBM copies of ``keys`` out to ``dst``: blocks already there just
        drop their HBM copy; the rest move over the link (modelled)."""
        if dst not in self.mgr.tier_names:
            return 0
        mgr = self.mgr
        if not self.surface.hbm_drop:  # the HBM copy stays until the engine evicts it; the copy below counts
            return len(mgr.present(mgr.present(keys, "hbm"), dst))
        in_hbm = mgr.present(keys, "hbm")
        already = mgr.present(in_hbm, dst)
        dropped = mgr.remove(already, "hbm") if already else 0
        plan = mgr.prepare_move(in_hbm if not already else mgr.present(in_hbm, "hbm"), "hbm", dst,
                                keep_source=False)
        self.counters["offloaded_blocks"] += dropped
        if plan is None:
            self._admission_blocked = False
            return dropped
        self.counters["offloaded_blocks"] += len(plan.keys)
        self._at(self._transfer("hbm", dst, len(plan.keys), self._num_to_encode(plan.keys, dst)),
                 self._complete_offload, plan)
        return dropped + len(plan.keys)

    def _complete_offload(self, plan: Any) -> None:
        self.mgr.complete_move(plan, True)
        self._admission_blocked = False

    def discard(self, keys: Sequence[BlockKey]) -> int:
        if not self.surface.hbm_drop:
            return 0
        n = self.mgr.remove(keys, "hbm")
        self.counters["discarded_blocks"] += n
        self._admission_blocked = False
        return n

    def transfer_time_s(self, num_blocks: int, link: str) -> float:
        """Expected time to move ``num_blocks`` over ``link`` (``ssd->hbm``: both
        hops; with a cold codec, its encode / decode too), from the transfer
        model fitted to completed transfers."""
        src, dst = link.split("->")
        return sum(self.links.predict_s(stage, nbytes)
                   for stage, nbytes in transfer_stages(self.codec, src, dst, num_blocks, self.bytes_per_block))

    def recompute_time_s(self, num_tokens: int) -> float:
        return self.profile.recompute_time_s(num_tokens, 0)

    def running_blocks(self) -> int:
        return sum(len(r.keys) + r.reserved for r in itertools.chain(self.prefilling, self.decoding))

    def tool_history_s(self) -> Sequence[float]:
        return self._tool_history

    def private_start(self, keys: Sequence[BlockKey]) -> int:
        return self.mgr.private_start(keys)

    # ------------------------------------- PlacementContext: agent-aware part

    def call_at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)`` at simulated time ``t`` (now if ``t`` is past)."""
        self._at(max(t, self.now), fn, *args)

    def prefetch(self, agent_key: tuple[int, str], keys: Sequence[BlockKey]) -> float | None:
        """Promote the lower-tier blocks of ``keys``' cached prefix into HBM for the
        agent's next request; returns when they will be there (``None`` when
        nothing needs to move or HBM has no room). The blocks are held from
        arrival until that request is admitted."""
        if agent_key in self._prefetches or agent_key not in self._waiting_agents:
            return None
        mgr = self.mgr
        hit = mgr.lookup(keys)
        names, tiers = hit.tier_names, hit.tier_indices
        plans, done = [], self.now
        dst = self.surface.prefetch_to
        if dst not in names:
            return None
        for src_idx in range(names.index(dst) + 1, len(names)):
            src_keys = list(compress(keys, map(src_idx.__eq__, tiers)))
            if not src_keys:
                continue
            plan = mgr.prepare_move(src_keys, names[src_idx], dst, keep_source=self._keep_source(names[src_idx]))
            if plan is None:
                break
            plans.append(plan)
            done = max(done, self._transfer(names[src_idx], dst, len(plan.keys)))
        if not plans:
            return None
        if self._victims:  # what made room in HBM lands in DRAM as the prefetch frees it
            self._write_victims(done)
        pf = _Prefetch(plans, done, tuple(keys[: hit.num_blocks]))
        self._prefetches[agent_key] = pf
        self.counters["prefetches"] += 1
        self.counters["prefetched_blocks"] += sum(len(p.keys) for p in plans)
        self._at(done, self._prefetch_arrived, agent_key, pf)
        return done

    def stage(self, keys: Sequence[BlockKey]) -> int:
        """Promote the SSD blocks of ``keys``' cached prefix into DRAM for a queued
        request (the SSD keeps its copy), once the engine's admission pass has
        left it queued (one admitted at once loads straight from SSD); its
        admission reads whatever has arrived by then from DRAM. Returns 0: the
        promotion is decided after the pass."""
        self._to_stage.append(keys)
        return 0

    def _stage_queued(self) -> None:
        to_stage, self._to_stage = self._to_stage, []
        queued = {id(r.keys) for r in self.waiting}
        for keys in to_stage:
            plan = ssd_promotion(self.mgr, keys) if id(keys) in queued else None
            if plan is not None:
                self._at(self._transfer("ssd", "dram", len(plan.keys)), self._staged_in, plan)
                self.counters["staged_blocks"] += len(plan.keys)

    def _staged_in(self, plan: Any) -> None:
        self.mgr.complete_move(plan, True)
        if self._victim_cache:  # admitted before they arrived: HBM has them, DRAM need not
            self.mgr.deprioritize([k for k in plan.keys if self.mgr.contains(k, "hbm")], "dram")

    def _prefetch_arrived(self, agent_key: tuple[int, str], pf: _Prefetch) -> None:
        for plan in pf.plans:
            self.mgr.complete_move(plan, True)
        pf.arrived = True
        if pf.cancelled or self.surface.prefetch_to != "hbm":
            return
        pf.hold = self._deepest_ready_hbm(pf.keys, len(pf.keys))
        if pf.hold is not None:
            self.mgr.acquire((pf.hold,))
        self._admission_blocked = False

    def _release_prefetch_holds(self, head: _Run) -> bool:
        """``head`` does not fit: let go of the hold of every arrived prefetch, its
        own included (a prefetch of a context the new prompt left behind must
        not keep it out). The blocks stay cached but become evictable. True
        when one was released."""
        released = False
        for pf in self._held_prefetches():
            self.mgr.release((pf.hold,))
            pf.hold = None
            released = True
        if released:
            self.counters["prefetch_holds_released"] = self.counters.get("prefetch_holds_released", 0) + 1
        return released

    def _held_prefetches(self) -> list[_Prefetch]:
        waiting = [r.prefetch for r in itertools.chain(self.waiting, (d[0] for d in self._deferred))
                   if r.prefetch is not None]
        return [pf for pf in itertools.chain(self._prefetches.values(), waiting) if pf.hold is not None]

    def _settle_prefetch(self, pf: _Prefetch, used: Sequence[BlockKey]) -> None:
        """The request the prefetch was for was admitted: drop its hold; a prefetch
        none of whose blocks the request used was wasted."""
        if pf.hold is not None:
            self.mgr.release((pf.hold,))
            pf.hold = None
        moved = {k for p in pf.plans for k in p.keys}
        if not moved.intersection(used):
            self.counters["prefetch_wasted"] += 1

    def drop(self, keys: Sequence[BlockKey]) -> int:
        """Remove ``keys`` from every tier (dead KV: nobody will read it again)."""
        if self.surface.hbm_drop:
            n = self.mgr.remove(keys)
        else:
            n = sum(self.mgr.remove(keys, t) for t in self.lower)
        self.counters["dropped_blocks"] += n
        self._admission_blocked = False
        return n

    def deprioritize(self, keys: Sequence[BlockKey], tiers: Sequence[str] = ("hbm",)) -> int:
        """Make ``keys``' idle copies in ``tiers`` the next victims there."""
        n = sum(self.mgr.deprioritize(keys, t) for t in tiers
                if t in self.mgr.tier_names and (t != "hbm" or self.surface.hbm_demote))
        return n

    def retire(self, keys: Sequence[BlockKey]) -> int:
        """Dead KV (its agent ended): next victims in every tier, but still
        readable until the room is needed. On a surface that can free an HBM
        block but not reorder HBM (``hbm_drop`` without ``hbm_demote``), its idle
        HBM copies are freed at once instead."""
        n = self.deprioritize(keys, self.mgr.tier_names)
        self.counters["retired_blocks"] = self.counters.get("retired_blocks", 0) + n
        if self.surface.hbm_drop and not self.surface.hbm_demote:
            dropped = self.mgr.remove(keys, "hbm")
            self.counters["dropped_blocks"] += dropped
            self._admission_blocked = False
            n += dropped
        return n

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the replay counter ``name`` (decisions by reason, ...)."""
        self.counters[name] = self.counters.get(name, 0) + n

    def criticality(self, agent_key: tuple[int, str]) -> float:
        """The agent's criticality from the hint plane's DAG (1.0 on the critical path)."""
        crit = self.graph.criticalities("replay", str(agent_key[0]), self.now)
        return crit.get(agent_key[1], 0.0)

    def hbm_pressure(self) -> float:
        """HBM in use (cached + reserved) over capacity, plus the demand of the
        requests waiting for admission, as a fraction of capacity."""
        if self.surface.pressure_counts_idle:
            used = self.mgr.used_blocks("hbm")
        else:  # what vLLM reports as KV usage: blocks referenced by running requests and holds
            used = min(self.hbm_capacity_blocks, self.running_blocks() + self._pinned_blocks)
        waiting = sum(math.ceil((r.req.input_tokens + r.req.output_tokens) / self.block_size)
                      for r in itertools.islice(self.waiting, 16))
        return (used + waiting) / max(1, self.hbm_capacity_blocks)

    def waiting_demand_blocks(self) -> int:
        """HBM blocks the (first 16) requests waiting for admission need."""
        return sum(math.ceil((r.req.input_tokens + r.req.output_tokens) / self.block_size)
                   for r in itertools.islice(self.waiting, 16))

    def tiers_enabled(self) -> tuple[str, ...]:
        return self.mgr.tier_names

    def blocks_in(self, keys: Sequence[BlockKey], tier: str) -> int:
        """How many of ``keys`` are readable in ``tier`` (0 for a tier not enabled)."""
        return len(self.mgr.present(keys, tier)) if tier in self.mgr.tier_names else 0

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Refresh ``keys``' HBM copies to most recent (they are due next)."""
        if self.surface.hbm_refresh:
            self.mgr.touch(self.mgr.present(keys, "hbm"), "hbm")

    def remaining_path_s(self, session: int) -> float:
        """The session's expected remaining time (its critical path) per the hint plane."""
        return self.graph.remaining_path_s("replay", str(session), self.now)

    def parent_of(self, agent_key: tuple[int, str]) -> str | None:
        """The agent's parent id as the hint plane knows it (``None`` for a root)."""
        s = self.graph.session("replay", str(agent_key[0]))
        a = s.agents.get(agent_key[1]) if s is not None else None
        return a.parent_id if a is not None else None

    def is_waiting(self, agent_key: tuple[int, str]) -> bool:
        """True while the agent waits (tool, user, sub-agents) for its next request."""
        return agent_key in self._waiting_agents
