"""Hints from the request stream: what an unmodified agent already sends.

Claude Code, Codex, Qwen Code and apps on the OpenAI or Anthropic clients do not
call kvtier's SDK, yet every request says who it belongs to (a session header,
Dynamo's ``nvext.agent_context``, vLLM's ``session_id``, ``prompt_cache_key``, ``user`` or ``metadata``; else the
conversation's first messages) and the protocol itself says when the agent waits on a tool: a
response that ends in a tool call starts the wait, and the same agent's next
request, carrying the tool result, ends it. :class:`StreamHints` turns a
request / response pair into

* the ``kv_transfer_params`` tags :func:`kvtier.sdk.tag_request` would have
  written (``kvtier_session_id``, ``kvtier_agent_id``), and
* hint events for a hint server (``session_start``, ``agent_spawn``,
  ``tool_call_start``, ``tool_call_end``), the same events the SDK sends; the
  server's :class:`~kvtier.agents.predictor.DurationHistory` predicts each
  wait per (session, tool), then per tool, then over all tools. A session and
  its agents reach the server with their first tool call (plain chat never
  takes a slot there); a session or agent pushed out of the bounds below ends
  there too, its calls ``cancelled``.

A request that forces a tool call (OpenAI ``tool_choice`` ``"required"`` or a
named function; Anthropic ``{"type": "any"}`` or ``{"type": "tool"}``) says its
wait before the engine runs it: its tags also carry ``kvtier_tool_wait_s``, the
agent's last tool wait (else its session's, else
:attr:`StreamLimits.forced_call_wait_s`), so the connector starts a tool wait
when the request finishes. The ``tool_call_start`` the response brings reaches
the hint server only after that, and a connector that sees it on no engine step
before the tool returns (an engine idle while every agent runs a tool) would
otherwise have waited on the agent's user (``turn_end``) the whole time.

Identifiers are correlation metadata, never authorization: an id is used only
when it is a string of at most :attr:`StreamLimits.max_id_bytes` bytes with no
control characters (else the request falls back to its fingerprint, counted),
and it is scoped to the caller's tenant (a digest of the ``Authorization`` and
``x-api-key`` headers) before it reaches the engine, so two tenants' equal ids
never meet.
Agents: one per (session, agent header or system prompt + first message), so a
client that reuses a session id for unrelated conversations gets one agent per
conversation. An agent with another system prompt than the session's first
agent, or named by an agent header, is its sub-agent (a child in the graph);
one with the same system prompt is a peer (a root of its own). NVIDIA Dynamo's
clients name both (:meth:`StreamHints._dynamo`): ``nvext.agent_context`` names the
run (the session), the trajectory (the agent) and its parent; the
``X-Dynamo-Session-ID`` header names a chain (the agent) and
``X-Dynamo-Parent-Session-ID`` its parent, the tree of chains one session.

Owns: parsing request and response bodies of the OpenAI chat completions and
Anthropic messages APIs (JSON and server-sent events), the bounded per-session
state (sessions, agents, tool calls in flight, Dynamo chains' roots) and its counters.
Must not: do I/O, read a clock (callers pass ``now``), import an engine, or
trust a field's type: every body here comes from a client.

>>> h = StreamHints()
>>> d = h.request("openai", {"x-session-id": "s1"}, {"messages": [
...     {"role": "system", "content": "planner"}, {"role": "user", "content": "go"}]}, now=0.0)
>>> sorted(d.params), d.events
(['kvtier_agent_id', 'kvtier_session_id'], [])
>>> [e[0] for e in h.response(d, [("call_1", "bash")], now=1.0)]
['session_start', 'agent_spawn', 'tool_call_start']
>>> d2 = h.request("openai", {"x-session-id": "s1"}, {"messages": [
...     {"role": "system", "content": "planner"}, {"role": "user", "content": "go"},
...     {"role": "assistant", "tool_calls": []}, {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]}, now=4.0)
>>> [(e[0], e[1]["status"]) for e in d2.events]
[('tool_call_end', 'ok')]
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..sdk.handles import AGENT_ID_PARAM, KV_TRANSFER_PARAMS, SESSION_ID_PARAM
from ..sdk.params import MAX_TOOL_WAIT_S, TOOL_WAIT_PARAM

SESSION_HEADERS = ("x-claude-code-session-id", "x-qwen-code-session-id", "x-session-id", "session-id",
                   "x-codex-session-id", "x-opencode-session-id")
"""Request headers that name a session, first found wins (lower case, as ASGI gives them)."""
DYNAMO_CHAIN_HEADER, DYNAMO_PARENT_HEADER = "x-dynamo-session-id", "x-dynamo-parent-session-id"
"""NVIDIA Dynamo's headers: one reasoning / tool chain (a kvtier agent) and its parent chain."""
AGENT_HEADERS = ("x-agent-id", "x-claude-code-agent-id")
"""Request headers that name an agent within its session."""
APIS = ("openai", "anthropic")


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """Bounds on what the request stream may make kvtier remember."""

    max_id_bytes: int = 256
    max_sessions: int = 10_000
    max_agents_per_session: int = 64
    max_calls_per_agent: int = 32
    max_calls: int = 100_000  # in flight over all sessions (the hint server's own bound)
    call_ttl_s: float = 500.0  # a tool call with no result after this long is ended (status timeout); under
    # the hint server's session TTL (600 s), so a call never outlives its session there
    fingerprint_chars: int = 4096  # of the system prompt and first message, hashed for a fingerprint
    forced_call_wait_s: float = 10.0  # a forced tool call's wait before any wait of its session was seen (the
    # connector's wait for a call the hint server has no prediction for)

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if not getattr(self, name) > 0:
                raise ValueError(f"StreamLimits.{name}={getattr(self, name)!r}: must be > 0")


@dataclass(slots=True)
class _Agent:
    parent: str  # "" for a root
    announced: bool = False  # agent_spawn sent (with its first tool call)
    calls: dict[str, tuple[str, float]] = field(default_factory=dict)  # call id -> (tool name, started)
    last_wait_s: float | None = None  # its last tool wait, response to the request with the result


@dataclass(slots=True)
class _Session:
    root: str
    root_system: str  # digest of the first agent's system prompt
    announced: bool = False  # session_start sent (with its first tool call)
    agents: OrderedDict[str, _Agent] = field(default_factory=OrderedDict)
    last_wait_s: float | None = None  # the last tool wait of any of its agents


@dataclass(frozen=True, slots=True)
class Derived:
    """What one request told: its tags (``params``, for ``kv_transfer_params``) and hint events."""

    session_id: str
    agent_id: str
    params: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]


def _digest(*parts: str, n: int = 16) -> str:
    h = hashlib.blake2b(digest_size=n // 2)
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def _text(content: Any) -> str:
    """A message's content as text (a string, or the text of its parts); anything else as JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) and isinstance(p.get("text"), str)
                       else json.dumps(p, sort_keys=True, default=str) for p in content)
    return "" if content is None else json.dumps(content, sort_keys=True, default=str)


class StreamHints:
    """Request-stream hints, one instance per server process. Not thread-safe:
    call from one event loop. Memory: at most ``max_sessions`` sessions of at
    most ``max_agents_per_session`` agents of at most ``max_calls_per_agent``
    calls in flight, least recently used forgotten first."""

    def __init__(self, limits: StreamLimits | None = None) -> None:
        self.limits = limits or StreamLimits()
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._deadlines: list[tuple[float, str, str, str]] = []  # (expires, session, agent, call id)
        self._live_calls = 0  # calls in flight, over all sessions
        self._chain_roots: OrderedDict[tuple[str, str], str] = OrderedDict()  # (tenant, Dynamo chain) -> root chain
        self.counters: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._sessions)

    # ------------------------------------------------------------ requests

    def request(self, api: str, headers: Mapping[str, str], body: Any, now: float) -> Derived | None:
        """Tags and events for one request body of ``api`` (``openai``: chat
        completions; ``anthropic``: messages). ``None`` when the body is not a
        JSON object with messages, or already carries the SDK's tags (an SDK hint wins)."""
        if api not in APIS:
            raise ValueError(f"StreamHints.request: api={api!r}; valid: {', '.join(APIS)}")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            self.counters["requests_unparsed"] += 1
            return None
        params = body.get(KV_TRANSFER_PARAMS)
        if isinstance(params, dict) and (SESSION_ID_PARAM in params or AGENT_ID_PARAM in params):
            self.counters["requests_sdk_tagged"] += 1
            return None
        self.counters["requests"] += 1
        events: list[tuple[str, dict[str, Any]]] = self._expire(now)
        tenant = _digest(headers.get("authorization", ""), headers.get("x-api-key", ""), n=32)
        system, first, results = self._read(api, body)
        convo = _digest(system[: self.limits.fingerprint_chars], first[: self.limits.fingerprint_chars])
        dynamo = self._dynamo(tenant, headers, body)
        if dynamo is not None:
            raw, agent_hdr, parent_name = dynamo
        else:
            raw, parent_name = self._session_id(headers, body), None
            agent_hdr = next((v for v in (self._valid(headers.get(h)) for h in AGENT_HEADERS) if v is not None), None)
        if raw is None:
            self.counters["sessions_fingerprinted"] += 1
        sid = "s-" + _digest(tenant, "h" if raw is not None else "f", raw if raw is not None else convo)
        aid = "a-" + _digest(agent_hdr, n=12) if agent_hdr is not None else "a-" + convo[:12]
        sys_digest = _digest(system[: self.limits.fingerprint_chars])
        sess = self._sessions.get(sid)
        if sess is None:
            sess = self._sessions[sid] = _Session(root=aid, root_system=sys_digest)
            while len(self._sessions) > self.limits.max_sessions:
                old_sid, old = self._sessions.popitem(last=False)
                events += self._forget_session(old_sid, old)
        self._sessions.move_to_end(sid)
        agent = sess.agents.get(aid)
        if agent is None:
            agent = self._new_agent(sid, sess, aid, agent_hdr is not None, parent_name, sys_digest, events)
        sess.agents.move_to_end(aid)
        matched = bool(results & agent.calls.keys())  # (before any is removed)
        for cid in list(agent.calls):  # the agent is back: its calls are over
            status = "ok" if cid in results or (results and not matched) else "cancelled"
            if status == "ok":
                agent.last_wait_s = sess.last_wait_s = max(0.001, now - agent.calls[cid][1])
            events.append(self._end_call(sid, aid, agent, cid, status))
        tags: dict[str, Any] = {SESSION_ID_PARAM: sid, AGENT_ID_PARAM: aid}
        if _forces_tool_call(api, body):
            self.counters["requests_forcing_tool_calls"] += 1
            tags[TOOL_WAIT_PARAM] = min(MAX_TOOL_WAIT_S, next(
                w for w in (agent.last_wait_s, sess.last_wait_s, self.limits.forced_call_wait_s) if w is not None))
        return Derived(sid, aid, tags, events)

    def _new_agent(self, sid: str, sess: _Session, aid: str, named: bool, parent_name: str | None, sys_digest: str,
                   events: list[tuple[str, dict[str, Any]]]) -> _Agent:
        """A session's new agent, the least recently seen pushed out past the bound (its events onto ``events``).
        Another system prompt (or an agent header, ``named``): a sub-agent of the session's first agent; the same
        system prompt with another first message: a peer conversation, a root of its own; a parent the client
        named (Dynamo): that agent, or a root while it was not seen."""
        sub = aid != sess.root and (named or sys_digest != sess.root_system)
        parent = sess.root if sub else ""
        if parent_name is not None:  # named by the client (Dynamo; "": a root): kept only if seen and no loop
            parent = "a-" + _digest(parent_name, n=12) if parent_name else ""
            up, steps = parent, 0
            while up and up != aid and up in sess.agents and steps <= self.limits.max_agents_per_session:
                up, steps = sess.agents[up].parent, steps + 1
            parent = parent if parent in sess.agents and up != aid else ""
        agent = sess.agents[aid] = _Agent(parent=parent)
        while len(sess.agents) > self.limits.max_agents_per_session:
            old_aid, old = next(iter(sess.agents.items()))
            if old_aid == aid:
                break
            del sess.agents[old_aid]
            events += self._forget_agent(sid, old_aid, old)
        self.counters["agents"] += 1
        return agent

    def _end_call(self, sid: str, aid: str, agent: _Agent, cid: str, status: str) -> tuple[str, dict[str, Any]]:
        del agent.calls[cid]
        self._live_calls -= 1
        self.counters[f"tool_calls_ended_{status}"] += 1
        return ("tool_call_end", {"session_id": sid, "agent_id": aid, "tool_call_id": cid, "status": status})

    def _forget_agent(self, sid: str, aid: str, agent: _Agent) -> list[tuple[str, dict[str, Any]]]:
        """An agent pushed out of its session's bound: its calls end (``cancelled``), and it ends on the server."""
        self.counters["agents_forgotten"] += 1
        events = [self._end_call(sid, aid, agent, cid, "cancelled") for cid in list(agent.calls)]
        if agent.announced:
            events.append(("agent_end", {"session_id": sid, "agent_id": aid, "status": "cancelled"}))
        return events

    def _forget_session(self, sid: str, sess: _Session) -> list[tuple[str, dict[str, Any]]]:
        """A session pushed out by newer ones: its calls end and the server forgets it too."""
        self.counters["sessions_forgotten"] += 1
        events = [e for aid, agent in sess.agents.items()
                  for e in [self._end_call(sid, aid, agent, cid, "cancelled") for cid in list(agent.calls)]]
        if sess.announced:
            events.append(("session_end", {"session_id": sid}))
        return events

    def _valid(self, value: Any) -> str | None:
        """``value`` when it may serve as an id: a non-empty string of at most
        ``max_id_bytes`` UTF-8 bytes without control characters; else ``None`` (counted)."""
        if value is None:
            return None
        if (not isinstance(value, str) or not value or len(value) > self.limits.max_id_bytes
                or len(value.encode("utf-8", "surrogatepass")) > self.limits.max_id_bytes
                or any(ord(c) < 32 or ord(c) == 127 for c in value)):
            self.counters["ids_refused"] += 1
            return None
        return value

    def _dynamo(self, tenant: str, headers: Mapping[str, str], body: dict[str, Any]
                ) -> tuple[str, str, str] | None:
        """(session, agent, parent agent or ``""``) as NVIDIA Dynamo's clients name them, else ``None``.
        ``nvext.agent_context`` first, in either of its forms: a run (``session_id``, or ``workflow_id``) with
        one trajectory per agent (``trajectory_id`` / ``program_id``, under ``parent_trajectory_id`` /
        ``parent_program_id``); or, without a trajectory, ``session_id`` naming one chain (the agent) under
        ``parent_session_id``. Then the headers: ``X-Dynamo-Session-ID`` names a chain and
        ``X-Dynamo-Parent-Session-ID`` its parent chain. Chains without a run are one session per tree, keyed
        by the tree's root chain (a chain whose parent was not seen: that parent's). ``nvext.agent_hints``
        are counted, not used."""
        nvext = body.get("nvext")
        chain = parent = None
        if isinstance(nvext, dict):
            if isinstance(nvext.get("agent_hints"), dict):
                self.counters["dynamo_agent_hints"] += 1
            ctx = nvext.get("agent_context")
            if isinstance(ctx, dict):
                def first(*keys: str) -> str | None:
                    return next((v for v in (self._valid(ctx.get(k)) for k in keys) if v is not None), None)

                trajectory = first("trajectory_id", "program_id")
                run = first("session_id", "workflow_id")
                if trajectory is not None and run is not None:
                    self.counters["dynamo_agent_context"] += 1
                    return "nvext:" + run, trajectory, first("parent_trajectory_id", "parent_program_id") or ""
                if run is not None and "session_id" in ctx and "trajectory_id" not in ctx and "program_id" not in ctx:
                    self.counters["dynamo_agent_context"] += 1
                    chain, parent = run, first("parent_session_id")
        if chain is None:
            chain = self._valid(headers.get(DYNAMO_CHAIN_HEADER))
            if chain is None:
                return None
            self.counters["dynamo_session_headers"] += 1
            parent = self._valid(headers.get(DYNAMO_PARENT_HEADER))
        root = chain
        if parent is not None:
            root = self._chain_roots.get((tenant, parent), parent)
            self._chain_roots[(tenant, parent)] = root  # (refreshed: a live parent is not pushed out first)
            self._chain_roots.move_to_end((tenant, parent))
        root = self._chain_roots.setdefault((tenant, chain), root)  # a chain keeps the tree it first joined
        self._chain_roots.move_to_end((tenant, chain))
        while len(self._chain_roots) > self.limits.max_sessions:
            self._chain_roots.popitem(last=False)
        return "dynamo:" + root, chain, parent or ""

    def _session_id(self, headers: Mapping[str, str], body: dict[str, Any]) -> str | None:
        for h in SESSION_HEADERS:
            if h in headers:
                v = self._valid(headers[h])
                if v is not None:
                    return "hdr:" + v
        for key in ("session_id", "prompt_cache_key", "user"):  # session_id: vLLM's own field
            if key in body:
                v = self._valid(body[key])
                if v is not None:
                    return f"{key}:{v}"
        meta = body.get("metadata")
        if isinstance(meta, dict):
            for key in ("session_id", "user_id"):
                if key in meta:
                    v = self._valid(meta[key])
                    if v is not None:
                        return f"metadata.{key}:{v}"
        return None

    def _read(self, api: str, body: dict[str, Any]) -> tuple[str, str, set[str]]:
        """(system prompt, first conversation message, ids of the tool results that end the body)."""
        msgs = [m for m in body["messages"] if isinstance(m, dict)]
        system = _text(body.get("system")) if api == "anthropic" else ""
        i = 0
        if api == "openai":
            while i < len(msgs) and msgs[i].get("role") in ("system", "developer"):
                system += _text(msgs[i].get("content"))
                i += 1
        first = _text(msgs[i].get("content")) if i < len(msgs) else ""
        results: set[str] = set()  # tool results after the last assistant message (a client may add a note)
        for m in reversed(msgs):
            if m.get("role") == "assistant":
                break
            if api == "openai" and m.get("role") == "tool":
                cid = m.get("tool_call_id")
                results.add(cid if isinstance(cid, str) else "")
            elif api == "anthropic" and m.get("role") == "user" and isinstance(m.get("content"), list):
                for part in m["content"]:
                    if isinstance(part, dict) and part.get("type") == "tool_result":
                        cid = part.get("tool_use_id")
                        results.add(cid if isinstance(cid, str) else "")
        return system, first, results

    # ------------------------------------------------------------ responses

    def response(self, derived: Derived, calls: Iterable[tuple[str, str]], now: float
                 ) -> list[tuple[str, dict[str, Any]]]:
        """The response to ``derived``'s request ended in these tool calls ``(id, name)``
        (none: the agent's turn is over): events that start their waits."""
        sid, aid = derived.session_id, derived.agent_id
        sess = self._sessions.get(sid)
        agent = sess.agents.get(aid) if sess is not None else None
        events: list[tuple[str, dict[str, Any]]] = []
        for cid, name in calls:
            if agent is None:
                self.counters["tool_calls_forgotten"] += 1
                break
            cid = self._valid(cid) or "call-" + _digest(aid, str(now), str(len(agent.calls)), n=12)
            name = self._valid(name) or "unknown"
            if cid in agent.calls:
                continue
            if len(agent.calls) >= self.limits.max_calls_per_agent or self._live_calls >= self.limits.max_calls:
                self.counters["tool_calls_refused"] += 1
                continue
            events += self._announce(sid, sess, aid, agent)  # the server learns of an agent at its first tool call
            agent.calls[cid] = (name, now)
            self._live_calls += 1
            heapq.heappush(self._deadlines, (now + self.limits.call_ttl_s, derived.session_id, derived.agent_id, cid))
            events.append(("tool_call_start", {"session_id": derived.session_id, "agent_id": derived.agent_id,
                                               "tool_call_id": cid, "tool_name": name}))
            self.counters["tool_calls"] += 1
        return events

    def _announce(self, sid: str, sess: _Session, aid: str, agent: _Agent) -> list[tuple[str, dict[str, Any]]]:
        """``session_start`` / ``agent_spawn`` not sent yet (a parent before its child). Only sessions whose agents
        call tools reach the hint server: plain chat never takes a slot there."""
        events: list[tuple[str, dict[str, Any]]] = []
        if not sess.announced:
            sess.announced = True
            events.append(("session_start", {"session_id": sid}))
        if agent.parent and agent.parent in sess.agents:  # (no loop: _new_agent cuts any at its one new edge)
            events += self._announce(sid, sess, agent.parent, sess.agents[agent.parent])
        elif agent.parent:
            agent.parent = ""  # its parent was forgotten: a root
        if not agent.announced:
            agent.announced = True
            # agent_type = the session: the hint server's history predicts waits per (session, tool)
            events.append(("agent_spawn", {"session_id": sid, "agent_id": aid, "parent_agent_id": agent.parent,
                                           "agent_type": sid}))
        return events

    def expire(self, now: float) -> list[tuple[str, dict[str, Any]]]:
        """End (status ``timeout``) every tool call whose result did not come within ``call_ttl_s``."""
        return self._expire(now)

    def _expire(self, now: float) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, sid, aid, cid = heapq.heappop(self._deadlines)
            sess = self._sessions.get(sid)
            agent = sess.agents.get(aid) if sess is not None else None
            if agent is None or cid not in agent.calls:
                continue
            events.append(self._end_call(sid, aid, agent, cid, "timeout"))
        if len(self._deadlines) > 2 * self._live_calls + 1024:  # calls answered long ago: drop their deadlines
            self._deadlines = [d for d in self._deadlines if d[1] in self._sessions
                               and d[3] in getattr(self._sessions[d[1]].agents.get(d[2]), "calls", ())]
            heapq.heapify(self._deadlines)
        return events


def _forces_tool_call(api: str, body: dict[str, Any]) -> bool:
    """Whether ``body`` makes the model's response a tool call: tools offered and ``tool_choice`` required
    (OpenAI ``"required"`` or ``{"type": "function", ...}``; Anthropic ``{"type": "any" | "tool"}``)."""
    if not isinstance(body.get("tools"), list) or not body["tools"]:
        return False
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    return kind in (("required", "function") if api == "openai" else ("any", "tool"))


def _list(value: Any) -> list[Any] | tuple[()]:
    return value if isinstance(value, list) else ()


def _scalar(value: Any) -> Any:
    return value if isinstance(value, (int, str)) or value is None else repr(value)[:64]


class ResponseCalls:
    """The tool calls ``(id, name)`` of one response, fed its body in chunks as they
    are sent: a JSON body (OpenAI chat completion or Anthropic message) or
    server-sent events (their ``data:`` lines). At most ``max_bytes`` are kept
    unparsed; beyond that the response is given up (``overflow``, no calls)."""

    def __init__(self, streaming: bool, max_bytes: int = 4 << 20) -> None:
        self.streaming, self.max_bytes = streaming, max_bytes
        self._buf = bytearray()
        self._calls: dict[Any, list[str]] = {}  # index or id -> [id, name]
        self.overflow = False

    def feed(self, chunk: bytes) -> None:
        if self.overflow:
            return
        self._buf += chunk
        if self.streaming:
            *lines, rest = self._buf.split(b"\n")
            self._buf = bytearray(rest)
            for line in lines:
                self._line(bytes(line))
        if len(self._buf) > self.max_bytes:
            self.overflow, self._buf = True, bytearray()

    def _line(self, line: bytes) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            return
        try:
            ev = json.loads(data)
        except ValueError:
            return
        if isinstance(ev, dict):
            self._event(ev)

    def _event(self, ev: dict[str, Any]) -> None:
        for choice in _list(ev.get("choices")):  # OpenAI chunk or completion
            if not isinstance(choice, dict):
                continue
            msg = choice.get("delta") if isinstance(choice.get("delta"), dict) else choice.get("message")
            for tc in _list(msg.get("tool_calls")) if isinstance(msg, dict) else ():
                if not isinstance(tc, dict):
                    continue
                fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
                index = tc.get("index", len(self._calls))
                key = ("i", _scalar(choice.get("index")), _scalar(index))
                slot = self._calls.setdefault(key, ["", ""])
                if isinstance(tc.get("id"), str) and not slot[0]:
                    slot[0] = tc["id"]
                if isinstance(fn.get("name"), str) and not slot[1]:
                    slot[1] = fn["name"]
        block = ev.get("content_block") if ev.get("type") == "content_block_start" else None
        blocks = [block] if isinstance(block, dict) else (_list(ev.get("content")) if ev.get("type") == "message" else ())
        for b in blocks:  # Anthropic message, or a stream's content_block_start
            if isinstance(b, dict) and b.get("type") == "tool_use":
                self._calls[("a", len(self._calls))] = [b.get("id") if isinstance(b.get("id"), str) else "",
                                                         b.get("name") if isinstance(b.get("name"), str) else ""]

    def calls(self) -> list[tuple[str, str]]:
        """The calls found, once the whole body was fed (none after an overflow)."""
        if self.overflow:
            return []
        if not self.streaming and not self.overflow and self._buf:
            try:
                body = json.loads(bytes(self._buf))
            except ValueError:
                body = None
            self._buf = bytearray()
            if isinstance(body, dict):
                self._event(body)
        elif self.streaming and self._buf:
            self._line(bytes(self._buf))
            self._buf = bytearray()
        return [(c[0], c[1]) for c in self._calls.values()]
