"""Agent waits and the two hint readers of the scheduler: when an agent's context starts
waiting, from a request's end or from a hint server's announcements.

Owns: the hint server hosted in the scheduler process (``hint_server``) or the
watcher of a separate one (``hint_watch``), what was last read from it (the
agents' criticalities and parents, the agents that ended, its tool-call
predictions' error as counters), the latest finished context of each agent
(keys and vLLM hashes, at most ``MAX_TRACKED_AGENTS``, for tool calls announced
after the request ended), each request's tenant (:meth:`HintIntake.tenant`: agents are
keyed by their tenant's session, so two tenants' sessions of one id never share an
agent, a wait or a round), and the start of every wait: a tagged request's end
(``tool`` with ``kvtier_tool_wait_s``, else ``turn_end``) or a tool call the
server announces (re-timing a ``turn_end`` wait). The placement policy decides
what a wait does (holds, order, prefetch); the shared rounds get the server's
round announcements; the agents of requests that name only vLLM's session
(:class:`.native_sessions.NativeSessions`), prefix breaks (:class:`.prefix_breaks.PrefixBreaks`); and the check
of each new request's ``kv_transfer_params`` (refused keys counted, named in a rate-limited log line)
and of its vLLM ``kv_hints`` envelope (:mod:`kvtier.sdk.kv_hints`: every action's outcome counted;
``release`` ends the agent, ``retain`` starts a wait not brought back). The hosted server refuses block-key
commands, saying why (:data:`NO_BLOCK_COMMANDS`). Must not import vLLM, plan loads or stores, or wait on the
hint server on the scheduler's step (a read of the hosted one gives up after
1 s; a followed one is read from its latest snapshot).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from kvtier.keys import BlockKey
from kvtier.placement import ToolWait
from kvtier.placement.base import TURN_END_GAP_S
from kvtier.sdk.kv_hints import KvHints, read_kv_hints
from kvtier.sdk.params import (
    DEFAULT_TENANT,
    KV_TRANSFER_PARAMS,
    VALIDATORS,
    check_request_params,
    request_tenant,
    tenant_session,
)

from .native_sessions import NativeSessions
from .prefix_breaks import PrefixBreaks
from .placement import EnginePlacement, TenantShares
from .rounds import SharedRounds
from .settings import MAX_TRACKED_AGENTS, ConnectorSettings

log = logging.getLogger(__name__)

NO_BLOCK_COMMANDS = (
    "the kvtier vLLM connector hosts this hint server and refuses block-key pin / unpin / prefetch: its keys are "
    "vLLM's block hashes chained in the connector's namespace, which clients do not see; an agent's KV is held "
    "and brought back from its tool-call signals and its requests' kvtier_tool_wait_s (kv_transfer_params)")
"""Why the hosted hint server refuses Pin / Unpin / Prefetch (the Publish reply's rejection message)."""
PARAM_LOG_BURST = 50
"""Log lines a second naming refused ``kv_transfer_params`` (a hostile client cannot flood the log)."""
POLL_EVERY_S = 0.05

AgentKey = tuple[str, str]
Calls = list[tuple[str, str, float | None]]  # tool calls in flight: (session, agent, predicted return in monotonic s)
Facts = dict[AgentKey, tuple[float, str | None]]  # agent -> (criticality, parent id)
Rounds = dict[tuple[str, str], tuple[str, ...]]  # (session, round id) -> its agents
Read = tuple[Calls, Facts, set[AgentKey], Rounds | None]


class HintIntake:
    """Agent waits and hint reading (see the module doc). ``reqs``: the scheduler's live
    requests (an agent with one running does not wait); ``keys_of(st)``: a request's keys;
    ``pump()``: read the manager's events; ``counted()``: counters changed (stats to write)."""

    def __init__(self, settings: ConnectorSettings, placement: EnginePlacement, policy: Any, counters: Counter[str],
                 block_size: int, reqs: Mapping[str, Any], keys_of: Callable[[Any], list[BlockKey]],
                 pump: Callable[[], None], rounds: SharedRounds, counted: Callable[[], None]) -> None:
        self.placement = placement
        self.policy = policy
        self.counters = counters
        self.block_size = block_size
        self._reqs = reqs
        self._keys_of = keys_of
        self._pump = pump
        self._rounds = rounds
        self._counted = counted
        # agent -> its latest finished context (keys, vLLM hashes, whether the hint server has not timed its wait
        # yet), for tool calls the hint server announces
        self._last_ctx: OrderedDict[AgentKey, tuple[list[BlockKey], list[Any], bool]] = OrderedDict()
        self._ctx_shares = TenantShares(settings.tracked_agents_per_tenant)  # the agents in _last_ctx, per tenant
        self._graph_cache: Facts = {}
        self._ended_agents: set[AgentKey] = set()
        self._next_poll_s = 0.0
        self._param_log_s, self._param_logs = 0.0, 0  # refused kv_transfer_params: log lines this second
        self.native = NativeSessions(counters, MAX_TRACKED_AGENTS)  # requests named only by vLLM's session_id
        self.breaks = PrefixBreaks(counters, block_size)
        tenants = set((settings.hint_server_tokens or {}).values())
        self.default_tenant = next(iter(tenants)) if len(tenants) == 1 else DEFAULT_TENANT
        self.hosted: Any = None
        self.address: str | None = None
        self.watcher: Any = None
        if settings.hint_server:
            from kvtier.agents import AgentGraph
            from kvtier.hints.server import BackgroundHintServer

            # a tool never seen yet is predicted from all tools' waits (the request-stream hints' agents have no type)
            self.hosted = BackgroundHintServer(graph=AgentGraph(global_fallback=True), no_store=NO_BLOCK_COMMANDS,
                                               tokens=settings.hint_server_tokens)
            self.address = self.hosted.start(settings.hint_server)
            placement.graph_reader = self.graph_facts
            log.info("kvtier: hint server hosted in the scheduler process at %s", self.address)
        if settings.hint_watch:
            from kvtier.sdk.watch import AgentsWatcher

            self.watcher = AgentsWatcher(settings.hint_watch, token=settings.hint_watch_token)
            placement.graph_reader = self.graph_facts
            log.info("kvtier: following the hint server at %s", settings.hint_watch)

    def tenant(self, params: Any) -> str:
        """A new request's tenant, whose sessions its tags name: its ``kvtier_tenant`` (stamped by a
        gateway), else the hosted hint server's only tenant (a token file naming one), else
        :data:`~kvtier.sdk.params.DEFAULT_TENANT` (the hint server's callers that name none).
        Following a separate server (``hint_watch``, one tenant's view, whose name the token does not
        tell), every request is the default tenant's, so its sessions match the followed ones by id."""
        if self.watcher is not None and self.hosted is None:
            return DEFAULT_TENANT
        return request_tenant(params) or self.default_tenant

    @property
    def following(self) -> bool:
        """Whether a hint server is hosted here or followed (rounds are announced only then)."""
        return self.hosted is not None or self.watcher is not None

    def close(self) -> None:
        """Stop the watcher and the hosted hint server, if any."""
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
        if self.hosted is not None:
            self.hosted.stop()
            self.hosted = None

    def arrived(self, st: Any) -> None:
        """A new request: where kvtier's tags name no session, vLLM's own session id does
        (:class:`.native_sessions.NativeSessions`); then its agent's prefix is checked against
        the agent's previous prompt (:class:`.prefix_breaks.PrefixBreaks`)."""
        if st.session_id is None:
            st.session_id, st.agent_id = self.native.tags(st.request, self._keys_of(st))
        self.breaks.arrived(st.agent, getattr(st.request, "prompt_token_ids", None))

    def request_done(self, st: Any, wait_s: float | None) -> None:
        """A tagged request finished: its agent now waits, on a tool for ``wait_s``
        (``kvtier_tool_wait_s`` in its ``kv_transfer_params``) or else on its user or
        on nothing, for it may be done (cause ``turn_end``, predicted
        :data:`TURN_END_GAP_S`). With a hint server the framework (or the
        request-stream middleware) announces the turn's tool calls only after this:
        the ``turn_end`` wait starts all the same, and a tool call announced later
        re-times it (``_apply``, counted in ``waits_retimed``); so does a call's predicted
        return a tool wait the request stated (the middleware's guess for a forced call, or
        the client's own ``kvtier_tool_wait_s``: the server's prediction, from the announced
        ``expected_s`` or its history, wins), once. Without it the
        agent would stay busy in kvtier's next-use order until its session expired,
        its context kept behind every agent that does come back.
        The placement policy decides (hold its HBM blocks, order its host copies,
        schedule a prefetch). The context is remembered for tool calls a hint
        server announces. An agent named only by vLLM's session id waits as long as its gaps
        predict (:meth:`.native_sessions.NativeSessions.ended`)."""
        agent = st.agent
        hints: KvHints | None = st.kv_hints
        if agent is None:
            if hints is not None and (hints.release or hints.retain_s is not None):
                self.counters["kv_hints_no_agent"] += 1  # nothing names the agent to release or retain
            return
        if hints is not None and hints.release:  # vLLM's kv_hints: the agent is done, its KV goes first
            if any(o.agent == agent for o in self._reqs.values()):
                self.counters["kv_hints_release_busy"] += 1  # not while another request of it runs (n > 1 too)
                return
            self.counters["kv_hints_agents_released"] += 1
            self.policy.on_agent_end(self.placement, agent, tuple(self._keys_of(st)))
            self._pump()
            return
        retain = "turn_end"
        if wait_s is None and hints is not None and hints.retain_s is not None:
            wait_s, retain = hints.retain_s, "retain"  # kept that long, not brought back
        if wait_s is None:
            wait_s = self.native.ended(st.session_id, st.agent_id)
        keys = self._keys_of(st)
        hashes = list(st.request.block_hashes[: len(keys)])
        if self.following and keys:
            self._remember(agent, st.tenant, keys, hashes)
        if not keys:
            return
        if any(o.agent == agent for o in self._reqs.values()):
            self.counters["waits_not_started_busy"] += 1  # another request of the agent runs: it does not wait
            return
        finishing = -(-int(st.request.num_tokens) // self.block_size)
        if retain == "retain":
            self.counters["kv_hints_waits_retained"] += 1
            self._start_wait(agent, keys, hashes, wait_s, finishing, "turn_end")
        elif wait_s is not None:
            self._start_wait(agent, keys, hashes, wait_s, finishing)
        else:
            self._start_wait(agent, keys, hashes, TURN_END_GAP_S, finishing, "turn_end")

    def _remember(self, agent: AgentKey, tenant: str, keys: list[BlockKey], hashes: list[Any]) -> None:
        """``agent``'s latest finished context, for tool calls the hint server announces later: at most
        ``MAX_TRACKED_AGENTS`` in all and ``max_tracked_agents_per_tenant`` of one tenant, so a tenant
        that floods forgets its own oldest (``finished_contexts_forgotten_tenant``), not another's."""
        ctx = self._last_ctx
        ctx[agent] = (keys, hashes, True)
        ctx.move_to_end(agent)
        for old in self._ctx_shares.note(agent, tenant):
            self._forget(old)
            self.counters["finished_contexts_forgotten_tenant"] += 1
        while len(ctx) > MAX_TRACKED_AGENTS:
            self._forget(next(iter(ctx)))

    def _forget(self, agent: AgentKey) -> None:
        self._last_ctx.pop(agent, None)
        self._ctx_shares.discard(agent)

    def _start_wait(self, agent: AgentKey, keys: list[BlockKey], hashes: list[Any], wait_s: float,
                    finishing_blocks: int, cause: str = "tool", counted: bool = True) -> None:
        self.placement.waiting_starts(agent, keys, hashes, finishing_blocks, tool=cause == "tool")
        try:
            self.policy.on_wait_start(self.placement, ToolWait(agent, tuple(keys), cause, wait_s))
        finally:
            self.placement.waiting_started()
        if counted:  # (a tool wait re-timed is the same wait)
            self.counters["tool_waits" if cause == "tool" else "user_waits"] += 1
        self._pump()

    def graph_facts(self, agent: AgentKey) -> tuple[float, str | None] | None:
        """(criticality, parent id) of ``agent`` from the hint server's DAG, as
        last polled (:meth:`poll`); ``None`` for an agent it does not know."""
        return self._graph_cache.get(agent)

    def poll(self) -> None:
        """With a hint server (hosted here, or followed with ``hint_watch``): start the wait of every agent it has a
        tool call in flight for (its predicted return; 10 s without one), or re-time the wait its request's end
        started, once (``waits_retimed``: the call is announced after the response; a ``turn_end`` wait, or a
        tool wait as long as the request said, e.g. the middleware's guess for a forced call), refresh
        the agents' criticalities and parents, and tell the policy which agents and
        sessions ended (it retires their private blocks in DRAM / SSD). At most
        every 50 ms; called each step."""
        if self.hosted is None and self.watcher is None:  # the common case: no clock read on the scheduler step
            return
        now = time.monotonic()
        if now < self._next_poll_s:
            return
        self._next_poll_s = now + POLL_EVERY_S
        got = self._read_hosted(now) if self.hosted is not None else self._read_watched()
        if got is not None:
            self._apply(now, *got)

    def _read_watched(self) -> Read | None:
        """The newest view of a separate hint server (``hint_watch``); never waits."""
        snap = self.watcher.latest()
        if snap is None:
            return None
        calls = [(k[0], k[1], a.returns_at_s) for k, a in snap.agents.items() if a.tool_in_flight]
        facts = {k: (a.criticality, a.parent_id) for k, a in snap.agents.items()}
        ended = {k for k, a in snap.agents.items() if a.ended}
        return calls, facts, ended, snap.rounds

    def _read_hosted(self, now: float) -> Read | None:
        graph = self.hosted.server.graph

        def read() -> Read:
            calls = [(tenant_session(s.tenant, s.session_id), c.agent_id, c.predicted_return_s)
                     for s, c in graph.tool_calls_in_flight()]
            facts: Facts = {}
            ended: set[AgentKey] = set()
            rounds: Rounds = {}
            for s in graph.sessions():
                sid = tenant_session(s.tenant, s.session_id)  # as requests of that tenant name it (_Req.agent)
                for rid, rnd in s.rounds.items():
                    rounds[(sid, rid)] = rnd.agent_ids
                crit = graph.criticalities(s.tenant, s.session_id, now)
                for aid, a in s.agents.items():
                    facts[(sid, aid)] = (float(crit.get(aid, 0.0)), a.parent_id)
                    if a.ended_s is not None:
                        ended.add((sid, aid))
            scored.append(graph.history.error())
            return calls, facts, ended, rounds

        scored: list[Any] = []
        try:
            got = self.hosted.call(read, timeout_s=1.0)
            self._note_prediction_error(scored[0])
            return got
        except Exception as exc:  # a stuck hint loop must not stop the scheduler
            log.warning("kvtier: reading the hosted hint server failed: %s", exc)
            return None

    def _note_prediction_error(self, err: Any) -> None:
        """The hosted server's tool-wait predictions scored so far, as counters:
        ``tool_wait_predictions`` and ``tool_wait_abs_error_ms`` (their ratio is the mean
        absolute error) and ``tool_wait_under_predictions`` (the tool came back later)."""
        new = err.num_predictions - self.counters["tool_wait_predictions"]
        if new <= 0:
            return
        self.counters["tool_wait_predictions"] += new
        total_ms = round(err.mean_abs_error_s * err.num_predictions * 1000)
        self.counters["tool_wait_abs_error_ms"] += max(0, total_ms - self.counters["tool_wait_abs_error_ms"])
        under = round(err.under_fraction * err.num_predictions)
        self.counters["tool_wait_under_predictions"] += max(0, under - self.counters["tool_wait_under_predictions"])
        self._counted()

    def _apply(self, now: float, calls: Calls, facts: Facts, ended: set[AgentKey],
               rounds: Rounds | None = None) -> None:
        if rounds is not None:
            self._rounds.announce(rounds)
        before = self._graph_cache
        self._graph_cache = facts
        for agent in sorted(ended - self._ended_agents):
            known = self._last_ctx.get(agent)
            if known:
                self.policy.on_agent_end(self.placement, agent, tuple(known[0]))
                self.counters["agents_ended"] += 1
        self._ended_agents = ended
        for sid in sorted({a[0] for a in before} - {a[0] for a in facts}):
            self.policy.on_session_end(self.placement, sid)
            self.counters["sessions_ended"] += 1
        self._pump()
        # an agent with a request in the engine is not waiting, whatever the server says: its call's end may
        # not have reached the server yet (a wait started then would hold a running agent's blocks)
        busy = {st.agent for st in self._reqs.values()} if calls else set()
        for sid, aid, returns_s in calls:
            agent = (sid, aid)
            known = self._last_ctx.get(agent)
            if agent in busy or not known:
                continue
            keys, hashes, untimed = known
            on_tool = self.placement.is_waiting(agent, tool=True)
            if not on_tool or (untimed and returns_s is not None and returns_s > now):
                # a wait its request's end started (on the turn's end, or on a tool for as long as the request
                # said: the middleware's guess for a forced call) is re-timed by the server's prediction, once;
                # a call predicted back already is likely the agent's previous one, its end not yet at the server
                if self.placement.is_waiting(agent):
                    self.counters["waits_retimed"] += 1
                self._last_ctx[agent] = (keys, hashes, False)
                self._start_wait(agent, keys, hashes,
                                 max(0.01, returns_s - now) if returns_s is not None else 10.0, 0, counted=not on_tool)

    def read_kv_hints(self, request: Any, params: Any) -> KvHints | None:
        """A new request's vLLM ``kv_hints`` envelope read as kvtier's hints
        (:func:`~kvtier.sdk.kv_hints.read_kv_hints`; its ``kv_transfer_params`` win), every
        action's outcome counted (``kv_hints_<action>_<outcome>``, ``kv_hints_envelopes``)."""
        try:
            hints = read_kv_hints(getattr(request, "kv_hints", None), params)
        except Exception:  # (it never raises on what a client sends; if ever, the request is served unhinted)
            log.exception("kvtier: request %s: kv_hints could not be read", str(request.request_id)[:64])
            hints = KvHints(outcomes=[("envelope", "malformed")])
        if hints is not None:
            self.counters["kv_hints_envelopes"] += 1
            for kind, outcome in hints.outcomes:
                self.counters[f"kv_hints_{kind}_{outcome}"] += 1
        return hints

    def check_params(self, req_id: str, params: Any) -> None:
        """Check a new request's ``kv_transfer_params`` (:func:`~kvtier.sdk.params.check_request_params`).
        Its refused kvtier keys read as absent (it is served without those hints):
        counted (``kv_params_refused_<key>``, ``_unknown`` for a key kvtier does not have;
        ``kv_params_refused_requests``) and named in one log line per request, at most
        :data:`PARAM_LOG_BURST` lines a second (the rest counted in ``kv_params_log_suppressed``)."""
        problems = check_request_params(params)
        if not problems:
            return
        self.counters["kv_params_refused_requests"] += 1
        for p in problems:  # bounded names: a known key's, or one for all unknown keys
            name = p.key.removeprefix("kvtier_") if p.key in VALIDATORS else (
                "not_object" if p.key == KV_TRANSFER_PARAMS else "unknown")
            self.counters[f"kv_params_refused_{name}"] += 1
        now = time.monotonic()
        if now - self._param_log_s >= 1.0:
            self._param_log_s, self._param_logs = now, 0
        if self._param_logs >= PARAM_LOG_BURST:
            self.counters["kv_params_log_suppressed"] += 1
            return
        self._param_logs += 1
        shown = "; ".join(f"{p.key}={p.value} ({p.reason})" for p in problems[:8])
        more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        log.warning("kvtier: request %s: kv_transfer_params refused, served without them: %s%s",
                    req_id[:64], shown, more)
