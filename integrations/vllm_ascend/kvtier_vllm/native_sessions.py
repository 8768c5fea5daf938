"""Agents of requests that name only vLLM's own session: ``Request.session_id``.

vLLM (0.32) fills ``Request.session_id`` from the OpenAI body's ``session_id``, else the
``X-Session-ID`` header, else ``vllm_xargs["session_id"]``. A request with that and no
kvtier tags (``kv_transfer_params``, which the SDK and the request-stream middleware
write, and which win) is placed as an agent of that session, through the connector
alone. Which agent: the one whose last prompt the request continues. Keys are chained
(each names its whole prefix), so "request R continues agent A's last prompt of n full
blocks" is one comparison, R's n-th key against A's last; the longest such continuation
wins, and a request that continues none (another first message after a shared system
prompt) is a new agent of the session, ``vllm-<n>``. An agent whose prompt has no full
block is the session's ``vllm-0``.

Nothing says how long such an agent waits between its requests, so the gaps it was seen
to take predict it: from an agent's request end to its next request, observed per session
(``DurationHistory``, the hint server's predictor: per session once it has 3 gaps, else over
every session); with no history yet the wait is a turn end, as an untold tagged request's.

Owns: the per-session table of agents' last prompts (its length in blocks and last key)
and ends, the history of their gaps,
bounded (sessions least recently seen first, at most :data:`MAX_AGENTS_PER_SESSION`
agents each), and the counters ``native_session_requests``, ``native_session_agents``
and ``native_session_refused`` (an id the SDK's own check refuses: not a string, too
long). Must not: import vLLM, override a request's kvtier tags, or keep a request's keys.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier.agents.predictor import DurationHistory
from kvtier.keys import BlockKey
from kvtier.sdk.params import SESSION_ID_PARAM, VALIDATORS

MAX_AGENTS_PER_SESSION = 64
GAP = "gap"  # the history's one "tool": an agent's time between its requests


class NativeSessions:
    """The agent of each request named only by vLLM's ``session_id`` (see the module doc)."""

    def __init__(self, counters: Counter[str], max_sessions: int) -> None:
        self.counters = counters
        self.max_sessions = max_sessions
        # session -> agent id -> [blocks in its last prompt, the last of their keys, when its last request ended
        # (monotonic s) or None while one runs], least recent first
        self._sessions: OrderedDict[str, OrderedDict[str, list[Any]]] = OrderedDict()
        self._next_agent: dict[str, int] = {}
        self.gaps = DurationHistory(max_keys=max_sessions + 2, global_fallback=True)

    def tags(self, request: Any, keys: Sequence[BlockKey]) -> tuple[str | None, str | None]:
        """``(session, agent)`` for an untagged request from its ``session_id`` and prompt keys;
        ``(None, None)`` when it has no session id or the id is refused."""
        raw = getattr(request, "session_id", None)
        if raw is None or raw == "":
            return None, None
        session, why = VALIDATORS[SESSION_ID_PARAM](raw)
        if why is not None:
            self.counters["native_session_refused"] += 1
            return None, None
        self.counters["native_session_requests"] += 1
        agents = self._sessions.get(session)
        if agents is None:
            agents = self._sessions[session] = OrderedDict()
            self._next_agent[session] = 0
            while len(self._sessions) > self.max_sessions:
                old, _ = self._sessions.popitem(last=False)
                self._next_agent.pop(old, None)
        self._sessions.move_to_end(session)
        if not keys:  # nothing to place: the session's first agent
            return session, "vllm-0"
        agent = self._continued(agents, keys)
        if agent is None:
            agent = f"vllm-{self._next_agent[session]}"
            self._next_agent[session] += 1
            self.counters["native_session_agents"] += 1
        elif agents[agent][2] is not None:  # back after a wait: how long it took
            self.gaps.observe(session, GAP, time.monotonic() - agents[agent][2])
        agents[agent] = [len(keys), keys[-1], None]
        agents.move_to_end(agent)
        while len(agents) > MAX_AGENTS_PER_SESSION:
            agents.popitem(last=False)
        return session, agent

    def ended(self, session: str | None, agent: str | None) -> float | None:
        """A request of ``agent`` (named by :meth:`tags`) finished: its wait starts now. The predicted
        wait in seconds from the gaps seen (``None``: no history yet, or not an agent of this table)."""
        entry = self._sessions.get(session, {}).get(agent) if session is not None else None
        if entry is None:
            return None
        entry[2] = time.monotonic()
        return self.gaps.predict_s(session, GAP, None)

    @staticmethod
    def _continued(agents: OrderedDict[str, list[Any]], keys: Sequence[BlockKey]) -> str | None:
        """The agent whose last prompt ``keys`` extends (the longest), else ``None``."""
        best, best_n = None, 0
        for agent, (n, last, _) in agents.items():
            if best_n < n <= len(keys) and keys[n - 1] == last:
                best, best_n = agent, n
        return best
