"""What both framework adapters do alike: one session's hint events and request tags.

Owns: :class:`HintSession` (the session started before its first event, each
agent spawned once, every agent and the session ended by ``end_session``)
and :func:`tagged` (``kv_transfer_params`` merged into a request body). Must
not import an agent framework (the adapters that subclass it do) or raise
into the user's run (the client queues and drops, counting).
"""

from __future__ import annotations

from typing import Any

from ..sdk.handles import AGENT_ID_PARAM, KV_TRANSFER_PARAMS, SESSION_ID_PARAM


def tagged(body: dict[str, Any], session_id: str, agent_id: str) -> dict[str, Any]:
    """A copy of the request body ``body`` whose ``kv_transfer_params`` carry the session and agent ids (its
    other keys kept)."""
    out = dict(body)
    params = dict(out.get(KV_TRANSFER_PARAMS) or {})
    params.update({SESSION_ID_PARAM: session_id, AGENT_ID_PARAM: agent_id})
    out[KV_TRANSFER_PARAMS] = params
    return out


class HintSession:
    """One session's events through a :class:`kvtier.sdk.HintClient` (``events``: how many were sent)."""

    def __init__(self, client: Any, session_id: str, model: str = "") -> None:
        self.client = client
        self.session_id = session_id
        self._model = model
        self._started = False
        self._agents: set[str] = set()
        self.events = 0

    def _emit(self, kind: str, **fields: Any) -> None:
        """Send one event of this session (``session_start`` first, once)."""
        if not self._started:
            self._started = True
            self._emit("session_start", model=self._model)
        self.events += 1
        self.client.emit(kind, session_id=self.session_id, **fields)

    def _spawn(self, agent_id: str, parent_id: str = "") -> bool:
        """``agent_spawn`` the first time ``agent_id`` is seen (its name is its type); True then."""
        if agent_id in self._agents:
            return False
        self._agents.add(agent_id)
        self._emit("agent_spawn", agent_id=agent_id, parent_agent_id=parent_id, agent_type=agent_id)
        return True

    def end_session(self) -> None:
        """The session is over: its agents end (their private KV may go first), then the session. An agent's
        final answer is not its end: the user may go on with the same object."""
        if not self._started:
            return
        for name in sorted(self._agents):
            self.client.emit("agent_end", session_id=self.session_id, agent_id=name, status="completed")
            self.events += 1
        self.client.emit("session_end", session_id=self.session_id)
        self.events += 1
        self._agents.clear()
        self._started = False
