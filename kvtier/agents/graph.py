"""AgentGraph: what agent frameworks told kvtier, as plain data that policies read.

Owns: sessions (each owned by one tenant), their agents (spawn tree and a
dependency DAG with cycle detection), requests and tool calls in flight with
a predicted return time, shared rounds, a bounded tool-duration history,
size limits, and TTL expiry of abandoned sessions.

Pure: no grpc, no I/O and no clock of its own — every mutating call takes
``now_s`` (the caller's monotonic seconds: wall clock live, simulated in
replay), so the live hints server and the replay simulator drive the same
code. Must not grow past :class:`GraphLimits`, and must not raise on bad
client input: a refused operation returns a :class:`Refusal` naming the
field; exceptions are for caller bugs (wrong types from the caller's code).

Time: client timestamps never enter the graph. A tool call's predicted
return is ``start + duration`` where the duration blends the client's
estimate with history (see :meth:`DurationHistory.predict_s`).

>>> g = AgentGraph(GraphLimits(session_ttl_s=60.0))
>>> g.start_session("acme", "s1", now_s=0.0)
>>> g.spawn_agent("acme", "s1", "root", now_s=0.0, agent_type="planner")
>>> g.start_tool_call("acme", "s1", "root", "t1", "bash", expected_s=3.0, now_s=1.0)
>>> g.session("acme", "s1").agents["root"].tool_calls["t1"].predicted_return_s
4.0
>>> g.spawn_agent("other-tenant", "s1", "x", now_s=0.0).reason  # tenants never see each other
'unknown_session'
>>> [s.session_id for s in g.expire(now_s=100.0)]
['s1']
>>> g.check_invariants()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from .critical import criticality, path_through_s
from .predictor import DurationHistory

@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the graph did not apply an operation.

    ``reason``: ``unknown_session``, ``unknown_agent``, ``unknown_request``,
    ``unknown_tool_call``, ``unknown_round``, ``duplicate``, ``cycle``,
    ``ended`` or ``limit``. ``field``: the input field at fault (relative to
    the operation, e.g. ``parent_agent_id``). ``message``: for humans; a
    ``limit`` message names the :class:`GraphLimits` setting and its value.
    """

    reason: str
    field: str
    message: str


@dataclass(frozen=True, slots=True)
class GraphLimits:
    """Upper bounds on everything the graph holds (memory stays bounded)."""

    max_sessions: int = 10_000
    max_sessions_per_tenant: int = 2_000
    max_sessions_per_client: int = 1_000
    max_agents: int = 100_000
    max_agents_per_session: int = 512
    max_tool_calls: int = 100_000
    max_tool_calls_per_session: int = 512
    max_requests_in_flight_per_agent: int = 64
    max_edges_per_session: int = 4_096
    max_shared_rounds_per_session: int = 64
    max_stored_block_key_bytes: int = 64 << 20
    max_history_keys: int = 4_096
    session_ttl_s: float = 600.0

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"GraphLimits.{name}={value!r}: must be > 0")


@dataclass(slots=True)
class ToolCall:
    """A tool call in flight. ``predicted_s``: blended duration, ``None`` when
    neither the client nor history gave one."""

    call_id: str
    agent_id: str
    tool_name: str
    started_s: float
    expected_s: float | None
    predicted_s: float | None

    @property
    def predicted_return_s(self) -> float | None:
        return None if self.predicted_s is None else self.started_s + self.predicted_s


@dataclass(slots=True)
class Agent:
    """One agent of a session. ``prompt_keys``: the latest request's block keys
    (16 bytes each). ``depends_on``: agents that must finish before this one
    continues; ``dependents`` the reverse."""

    agent_id: str
    parent_id: str | None
    agent_type: str
    importance: int
    join_group: str
    expected_num_requests: int
    spawned_s: float
    priority: int = 0
    ended_s: float | None = None
    status: int = 0
    num_requests: int = 0
    requests_in_flight: dict[str, float] = field(default_factory=dict)
    prompt_keys: bytes = b""
    tool_calls: dict[str, ToolCall] = field(default_factory=dict)
    depends_on: set[str] = field(default_factory=set)
    dependents: set[str] = field(default_factory=set)

    @property
    def ended(self) -> bool:
        return self.ended_s is not None


@dataclass(slots=True)
class SharedRound:
    """Agents that received the same context blocks (all-gather)."""

    round_id: str
    agent_ids: tuple[str, ...]
    block_keys: bytes
    started_s: float


@dataclass(slots=True)
class Session:
    """A session of one tenant: its agents, rounds and counters."""

    tenant: str
    session_id: str
    client_id: str
    started_s: float
    last_seen_s: float
    model: str = ""
    agents: dict[str, Agent] = field(default_factory=dict)
    rounds: dict[str, SharedRound] = field(default_factory=dict)
    num_tool_calls: int = 0
    num_edges: int = 0


def _unknown(what: str, field_name: str, ident: str) -> Refusal:
    return Refusal(f"unknown_{what}", field_name, f"unknown {what.replace('_', ' ')} {ident!r}")


def _limit(field_name: str, setting: str, value: int) -> Refusal:
    return Refusal("limit", field_name, f"over GraphLimits.{setting}={value}; raise it or end idle sessions")


class AgentGraph:
    """Sessions → agents → requests / tool calls / shared rounds, per tenant.

    Every mutating method takes ``now_s`` and returns ``None`` when applied or
    a :class:`Refusal`. Lookups are O(1); :meth:`expire` is O(sessions);
    :meth:`add_dependency` is O(agents of the session) (cycle check).
    Not thread-safe: one owner (the hints server's event loop, or replay).
    """

    def __init__(self, limits: GraphLimits | None = None, *, global_fallback: bool = False) -> None:
        """``global_fallback``: predict a tool never seen from the waits of all tools
        (:class:`DurationHistory`); on where the engine connector hosts the hint
        server, and in the replay's graph with ``--tool-waits predicted-stream``."""
        self.limits = limits or GraphLimits()
        self.history = DurationHistory(self.limits.max_history_keys, global_fallback=global_fallback)
        self._tenants: dict[str, dict[str, Session]] = {}
        self._client_sessions: dict[tuple[str, str], int] = {}
        self.num_sessions = 0
        self.num_agents = 0
        self.num_tool_calls = 0
        self.num_shared_rounds = 0
        self.stored_key_bytes = 0
        self.num_expired_sessions = 0

    # ----------------------------------------------------------- lookups

    def session(self, tenant: str, session_id: str) -> Session | None:
        """The tenant's session ``session_id``, or ``None`` (also for other tenants' ids)."""
        sessions = self._tenants.get(tenant)
        return None if sessions is None else sessions.get(session_id)

    def sessions(self, tenant: str | None = None) -> Iterator[Session]:
        """Every live session, or those of ``tenant``."""
        groups = self._tenants.values() if tenant is None else [self._tenants.get(tenant, {})]
        for sessions in groups:
            yield from sessions.values()

    def tenant_counts(self, tenant: str) -> tuple[int, int, int, int]:
        """``(sessions, agents, tool calls in flight, shared rounds)`` of ``tenant``."""
        ss = list(self.sessions(tenant))
        return (len(ss), sum(len(s.agents) for s in ss), sum(s.num_tool_calls for s in ss),
                sum(len(s.rounds) for s in ss))

    def tool_calls_in_flight(self, tenant: str | None = None) -> Iterator[tuple[Session, ToolCall]]:
        for s in self.sessions(tenant):
            if s.num_tool_calls:
                for agent in s.agents.values():
                    for call in agent.tool_calls.values():
                        yield s, call

    def _live(self, tenant: str, session_id: str, now_s: float) -> Session | Refusal:
        sessions = self._tenants.get(tenant)
        s = None if sessions is None else sessions.get(session_id)
        if s is None:
            return _unknown("session", "session_id", session_id)
        s.last_seen_s = now_s
        return s

    def _agent(self, tenant: str, session_id: str, agent_id: str, now_s: float,
               running: bool = True) -> tuple[Session, Agent] | Refusal:
        """The live session and its agent (touching the session), or why not."""
        sessions = self._tenants.get(tenant)
        s = None if sessions is None else sessions.get(session_id)
        if s is None:
            return _unknown("session", "session_id", session_id)
        s.last_seen_s = now_s
        agent = s.agents.get(agent_id)
        if agent is None:
            return _unknown("agent", "agent_id", agent_id)
        if running and agent.ended_s is not None:
            return Refusal("ended", "agent_id", f"agent {agent_id!r} already ended")
        return s, agent

    # ----------------------------------------------------------- sessions

    def start_session(self, tenant: str, session_id: str, now_s: float, *, client_id: str = "",
                      model: str = "") -> Refusal | None:
        """Open ``session_id`` for ``tenant`` (refused when it exists or a session limit is hit)."""
        sessions = self._tenants.get(tenant)
        if sessions is not None and session_id in sessions:
            return Refusal("duplicate", "session_id", f"session {session_id!r} already started")
        lim = self.limits
        if self.num_sessions >= lim.max_sessions:
            return _limit("session_id", "max_sessions", lim.max_sessions)
        if sessions is not None and len(sessions) >= lim.max_sessions_per_tenant:
            return _limit("session_id", "max_sessions_per_tenant", lim.max_sessions_per_tenant)
        ckey = (tenant, client_id)
        if self._client_sessions.get(ckey, 0) >= lim.max_sessions_per_client:
            return _limit("session_id", "max_sessions_per_client", lim.max_sessions_per_client)
        if sessions is None:
            sessions = self._tenants[tenant] = {}
        sessions[session_id] = Session(tenant, session_id, client_id, now_s, now_s, model)
        self._client_sessions[ckey] = self._client_sessions.get(ckey, 0) + 1
        self.num_sessions += 1
        return None

    def end_session(self, tenant: str, session_id: str, now_s: float) -> Refusal | None:
        """Forget the session and everything in it."""
        s = self._live(tenant, session_id, now_s)
        if type(s) is Refusal:
            return s
        self._remove(s)  # type: ignore[arg-type]
        return None

    def expire(self, now_s: float) -> list[Session]:
        """Remove sessions idle for more than ``session_ttl_s``; return them."""
        deadline = now_s - self.limits.session_ttl_s
        gone = [s for s in self.sessions() if s.last_seen_s < deadline]
        for s in gone:
            self._remove(s)
        self.num_expired_sessions += len(gone)
        return gone

    def _remove(self, s: Session) -> None:
        sessions = self._tenants[s.tenant]
        del sessions[s.session_id]
        if not sessions:
            del self._tenants[s.tenant]
        ckey = (s.tenant, s.client_id)
        left = self._client_sessions[ckey] - 1
        if left:
            self._client_sessions[ckey] = left
        else:
            del self._client_sessions[ckey]
        self.num_sessions -= 1
        self.num_agents -= len(s.agents)
        self.num_tool_calls -= s.num_tool_calls
        self.num_shared_rounds -= len(s.rounds)
        self.stored_key_bytes -= sum(len(a.prompt_keys) for a in s.agents.values())
        self.stored_key_bytes -= sum(len(r.block_keys) for r in s.rounds.values())

    # ----------------------------------------------------------- agents

    def spawn_agent(self, tenant: str, session_id: str, agent_id: str, now_s: float, *,
                    parent_id: str | None = None, agent_type: str = "", importance: int = 0,
                    join_group: str = "", expected_num_requests: int = 0) -> Refusal | None:
        """Add an agent; ``parent_id`` ``None`` makes a root agent."""
        s = self._live(tenant, session_id, now_s)
        if type(s) is Refusal:
            return s
        agents = s.agents  # type: ignore[union-attr]
        if agent_id in agents:
            return Refusal("duplicate", "agent_id", f"agent {agent_id!r} already spawned")
        if parent_id is not None and parent_id not in agents:
            return _unknown("agent", "parent_agent_id", parent_id)
        lim = self.limits
        if len(agents) >= lim.max_agents_per_session:
            return _limit("agent_id", "max_agents_per_session", lim.max_agents_per_session)
        if self.num_agents >= lim.max_agents:
            return _limit("agent_id", "max_agents", lim.max_agents)
        agents[agent_id] = Agent(agent_id, parent_id, agent_type, importance, join_group,
                                 expected_num_requests, now_s)
        self.num_agents += 1
        return None

    def end_agent(self, tenant: str, session_id: str, agent_id: str, now_s: float, *,
                  status: int = 0) -> Refusal | None:
        """Mark the agent finished; its requests and tool calls in flight are dropped."""
        found = self._agent(tenant, session_id, agent_id, now_s)
        if type(found) is Refusal:
            return found
        s, a = found  # type: ignore[misc]
        a.ended_s, a.status = now_s, status
        a.requests_in_flight.clear()
        s.num_tool_calls -= len(a.tool_calls)
        self.num_tool_calls -= len(a.tool_calls)
        a.tool_calls.clear()
        return None

    def add_dependency(self, tenant: str, session_id: str, from_agent: str, to_agent: str,
                       now_s: float) -> Refusal | None:
        """``to_agent`` waits for ``from_agent``. Refused when it would close a cycle."""
        s = self._live(tenant, session_id, now_s)
        if type(s) is Refusal:
            return s
        agents = s.agents  # type: ignore[union-attr]
        src, dst = agents.get(from_agent), agents.get(to_agent)
        if src is None:
            return _unknown("agent", "from_agent_id", from_agent)
        if dst is None:
            return _unknown("agent", "to_agent_id", to_agent)
        if from_agent in dst.depends_on:
            return None  # already known
        if from_agent == to_agent or self._reaches(agents, to_agent, from_agent):
            return Refusal("cycle", "to_agent_id",
                           f"edge {from_agent!r} -> {to_agent!r} would close a dependency cycle")
        if s.num_edges >= self.limits.max_edges_per_session:  # type: ignore[union-attr]
            return _limit("to_agent_id", "max_edges_per_session", self.limits.max_edges_per_session)
        dst.depends_on.add(from_agent)
        src.dependents.add(to_agent)
        s.num_edges += 1  # type: ignore[union-attr]
        return None

    @staticmethod
    def _reaches(agents: dict[str, Agent], start: str, goal: str) -> bool:
        """Whether ``goal`` is reachable from ``start`` along ``dependents`` edges."""
        stack, seen = [start], {start}
        while stack:
            for nxt in agents[stack.pop()].dependents:
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return False

    def set_priority(self, tenant: str, session_id: str, agent_id: str, priority: int,
                     now_s: float) -> Refusal | None:
        found = self._agent(tenant, session_id, agent_id, now_s, running=False)
        if type(found) is Refusal:
            return found
        found[1].priority = priority  # type: ignore[index]
        return None

    # ----------------------------------------------------------- requests

    def start_request(self, tenant: str, session_id: str, agent_id: str, request_id: str, now_s: float, *,
                      prompt_keys: bytes = b"") -> Refusal | None:
        """A request of the agent was sent; ``prompt_keys`` (16 bytes per key, may be
        empty) replace the agent's latest prompt keys."""
        found = self._agent(tenant, session_id, agent_id, now_s)
        if type(found) is Refusal:
            return found
        a = found[1]  # type: ignore[index]
        if request_id in a.requests_in_flight:
            return Refusal("duplicate", "request_id", f"request {request_id!r} already in flight")
        if len(a.requests_in_flight) >= self.limits.max_requests_in_flight_per_agent:
            lim = self.limits.max_requests_in_flight_per_agent
            return _limit("request_id", "max_requests_in_flight_per_agent", lim)
        if prompt_keys:
            grown = self.stored_key_bytes + len(prompt_keys) - len(a.prompt_keys)
            if grown > self.limits.max_stored_block_key_bytes:
                return _limit("prompt_block_keys", "max_stored_block_key_bytes",
                              self.limits.max_stored_block_key_bytes)
            self.stored_key_bytes = grown
            a.prompt_keys = prompt_keys
        a.requests_in_flight[request_id] = now_s
        return None

    def end_request(self, tenant: str, session_id: str, agent_id: str, request_id: str,
                    now_s: float) -> Refusal | None:
        """The request's response finished."""
        found = self._agent(tenant, session_id, agent_id, now_s)
        if type(found) is Refusal:
            return found
        a = found[1]  # type: ignore[index]
        if a.requests_in_flight.pop(request_id, None) is None:
            return _unknown("request", "request_id", request_id)
        a.num_requests += 1
        return None

    # ----------------------------------------------------------- tool calls

    def start_tool_call(self, tenant: str, session_id: str, agent_id: str, call_id: str, tool_name: str, *,
                        expected_s: float | None, now_s: float) -> Refusal | None:
        """A tool call began; its predicted return is ``now_s`` + the blended duration."""
        found = self._agent(tenant, session_id, agent_id, now_s)
        if type(found) is Refusal:
            return found
        s, a = found  # type: ignore[misc]
        if call_id in a.tool_calls:
            return Refusal("duplicate", "tool_call_id", f"tool call {call_id!r} already in flight")
        lim = self.limits
        if s.num_tool_calls >= lim.max_tool_calls_per_session:
            return _limit("tool_call_id", "max_tool_calls_per_session", lim.max_tool_calls_per_session)
        if self.num_tool_calls >= lim.max_tool_calls:
            return _limit("tool_call_id", "max_tool_calls", lim.max_tool_calls)
        predicted = self.history.predict_s(a.agent_type, tool_name, expected_s)
        a.tool_calls[call_id] = ToolCall(call_id, agent_id, tool_name, now_s, expected_s, predicted)
        s.num_tool_calls += 1
        self.num_tool_calls += 1
        return None

    def end_tool_call(self, tenant: str, session_id: str, agent_id: str, call_id: str,
                      now_s: float, observed: bool = True) -> Refusal | None:
        """The tool call returned; its duration feeds the history unless not ``observed``
        (a call timed out or cancelled: its end is not when the tool returned)."""
        found = self._agent(tenant, session_id, agent_id, now_s)
        if type(found) is Refusal:
            return found
        s, a = found  # type: ignore[misc]
        call = a.tool_calls.pop(call_id, None)
        if call is None:
            return _unknown("tool_call", "tool_call_id", call_id)
        s.num_tool_calls -= 1
        self.num_tool_calls -= 1
        if not observed:
            return None
        self.history.observe(a.agent_type, call.tool_name, now_s - call.started_s)
        if call.predicted_s is not None:
            self.history.observe_error(call.predicted_s, now_s - call.started_s)
        return None

    # ----------------------------------------------------------- shared rounds

    def start_shared_round(self, tenant: str, session_id: str, round_id: str, agent_ids: tuple[str, ...],
                           block_keys: bytes, now_s: float) -> Refusal | None:
        """``agent_ids`` all receive ``block_keys`` (16 bytes each)."""
        s = self._live(tenant, session_id, now_s)
        if type(s) is Refusal:
            return s
        ses: Session = s  # type: ignore[assignment]
        if round_id in ses.rounds:
            return Refusal("duplicate", "round_id", f"shared round {round_id!r} already started")
        for i, aid in enumerate(agent_ids):
            if aid not in ses.agents:
                return _unknown("agent", f"agent_ids[{i}]", aid)
        if len(ses.rounds) >= self.limits.max_shared_rounds_per_session:
            return _limit("round_id", "max_shared_rounds_per_session", self.limits.max_shared_rounds_per_session)
        if self.stored_key_bytes + len(block_keys) > self.limits.max_stored_block_key_bytes:
            return _limit("shared_block_keys", "max_stored_block_key_bytes", self.limits.max_stored_block_key_bytes)
        ses.rounds[round_id] = SharedRound(round_id, tuple(agent_ids), block_keys, now_s)
        self.stored_key_bytes += len(block_keys)
        self.num_shared_rounds += 1
        return None

    def end_shared_round(self, tenant: str, session_id: str, round_id: str, now_s: float) -> Refusal | None:
        s = self._live(tenant, session_id, now_s)
        if type(s) is Refusal:
            return s
        rnd = s.rounds.pop(round_id, None)  # type: ignore[union-attr]
        if rnd is None:
            return _unknown("round", "round_id", round_id)
        self.stored_key_bytes -= len(rnd.block_keys)
        self.num_shared_rounds -= 1
        return None

    # ----------------------------------------------------------- critical path

    def critical_path(self, tenant: str, session_id: str, now_s: float, *,
                      default_request_s: float = 1.0) -> list[str]:
        """Agent ids on the longest expected remaining path through the session's
        dependency DAG (unfinished agents only), first to last.

        An agent's expected remaining time: the latest predicted return of its
        tool calls in flight (0 when none or unknown) plus ``default_request_s``
        per request still expected (``expected_num_requests - num_requests``,
        at least one while it is running). O(agents + edges).
        """
        s = self.session(tenant, session_id)
        if s is None:
            return []
        live = {aid: a for aid, a in s.agents.items() if a.ended_s is None}
        preds = {aid: sorted(p for p in a.depends_on if p in live) for aid, a in live.items()}
        indegree = {aid: len(p) for aid, p in preds.items()}
        ready = sorted(aid for aid, n in indegree.items() if n == 0)
        best: dict[str, tuple[float, str | None]] = {}  # agent -> (longest path ending here, predecessor)
        while ready:  # Kahn's order: every predecessor is final before its dependents
            aid = ready.pop()
            pick = max(preds[aid], key=lambda p: best[p][0], default=None)
            base = best[pick][0] if pick is not None else 0.0
            best[aid] = (base + self._remaining_s(live[aid], now_s, default_request_s), pick)
            for nxt in sorted(live[aid].dependents):
                if nxt in indegree:
                    indegree[nxt] -= 1
                    if indegree[nxt] == 0:
                        ready.append(nxt)
        if not best:
            return []
        node: str | None = max(sorted(best), key=lambda a: best[a][0])
        path: list[str] = []
        while node is not None:
            path.append(node)
            node = best[node][1]
        return path[::-1]

    def criticalities(self, tenant: str, session_id: str, now_s: float, *,
                      default_request_s: float = 1.0) -> dict[str, float]:
        """Criticality in [0, 1] of each unfinished agent of the session (see
        :func:`kvtier.agents.critical.criticality`): 1.0 on the longest
        expected remaining path, sub-agents of one join group at the group's
        highest value. Remaining times as in :meth:`critical_path`. Empty for
        an unknown session. O(agents + edges)."""
        s = self.session(tenant, session_id)
        if s is None:
            return {}
        live = {aid: a for aid, a in s.agents.items() if a.ended_s is None}
        remaining = {aid: self._remaining_s(a, now_s, default_request_s) for aid, a in live.items()}
        deps = {aid: a.depends_on for aid, a in live.items()}
        return criticality(remaining, deps, join_group={aid: a.join_group for aid, a in live.items()})

    def remaining_path_s(self, tenant: str, session_id: str, now_s: float, *,
                         default_request_s: float = 1.0) -> float:
        """Expected remaining time of the session: the length of its critical
        path (remaining times as in :meth:`critical_path`); 0.0 for an unknown
        or finished session. O(agents + edges)."""
        s = self.session(tenant, session_id)
        if s is None:
            return 0.0
        live = {aid: a for aid, a in s.agents.items() if a.ended_s is None}
        remaining = {aid: self._remaining_s(a, now_s, default_request_s) for aid, a in live.items()}
        return max(path_through_s(remaining, {aid: a.depends_on for aid, a in live.items()}).values(), default=0.0)

    @staticmethod
    def _remaining_s(a: Agent, now_s: float, default_request_s: float) -> float:
        tool = max((c.predicted_return_s - now_s for c in a.tool_calls.values()
                    if c.predicted_return_s is not None), default=0.0)
        return max(0.0, tool) + max(1, a.expected_num_requests - a.num_requests) * default_request_s

    # ----------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Assert every count, link and limit (O(size); for tests and stress runs)."""
        lim = self.limits
        sessions = list(self.sessions())
        assert self.num_sessions == len(sessions) <= lim.max_sessions
        assert self.num_agents == sum(len(s.agents) for s in sessions) <= lim.max_agents
        assert self.num_tool_calls == sum(s.num_tool_calls for s in sessions) <= lim.max_tool_calls
        assert self.num_shared_rounds == sum(len(s.rounds) for s in sessions)
        key_bytes = sum(len(a.prompt_keys) for s in sessions for a in s.agents.values())
        key_bytes += sum(len(r.block_keys) for s in sessions for r in s.rounds.values())
        assert self.stored_key_bytes == key_bytes <= lim.max_stored_block_key_bytes
        assert len(self.history) <= lim.max_history_keys
        per_client: dict[tuple[str, str], int] = {}
        for tenant, group in self._tenants.items():
            assert group and len(group) <= lim.max_sessions_per_tenant
            for sid, s in group.items():
                assert s.tenant == tenant and s.session_id == sid
                per_client[(tenant, s.client_id)] = per_client.get((tenant, s.client_id), 0) + 1
                self._check_session(s)
        assert per_client == self._client_sessions
        assert all(n <= lim.max_sessions_per_client for n in per_client.values())

    def _check_session(self, s: Session) -> None:
        lim = self.limits
        assert len(s.agents) <= lim.max_agents_per_session
        assert len(s.rounds) <= lim.max_shared_rounds_per_session
        assert s.num_tool_calls == sum(len(a.tool_calls) for a in s.agents.values()) <= lim.max_tool_calls_per_session
        assert s.num_edges == sum(len(a.depends_on) for a in s.agents.values()) <= lim.max_edges_per_session
        for aid, a in s.agents.items():
            assert a.agent_id == aid
            assert a.parent_id is None or a.parent_id in s.agents
            assert len(a.requests_in_flight) <= lim.max_requests_in_flight_per_agent
            assert len(a.prompt_keys) % 16 == 0
            assert not a.ended or (not a.tool_calls and not a.requests_in_flight)
            for dep in a.depends_on:
                assert aid in s.agents[dep].dependents
            for dep in a.dependents:
                assert aid in s.agents[dep].depends_on
            assert not self._reaches(s.agents, aid, aid), f"dependency cycle through {aid!r}"
            for cid, call in a.tool_calls.items():
                assert call.call_id == cid and call.agent_id == aid
        for rid, rnd in s.rounds.items():
            assert rnd.round_id == rid and len(rnd.block_keys) % 16 == 0
            assert all(aid in s.agents for aid in rnd.agent_ids)
