"""kvtier hints for the OpenAI Agents SDK (``openai-agents``).

    from agents import Runner
    from kvtier.adapters.openai_agents import KVTierRunHooks
    from kvtier.sdk import HintClient

    hooks = KVTierRunHooks(HintClient("127.0.0.1:50071"))   # the connector's hint_server
    result = await Runner.run(agent, "fix the test", hooks=hooks)

Per run hook (:class:`agents.RunHooks`):

* ``on_agent_start``: the agent joins the session's graph (``agent_spawn``; an
  agent handed off to is a child of the agent that handed off), and its
  ``model_settings.extra_body`` gets ``kv_transfer_params`` with the session and
  agent ids (other keys there are kept), so the engine connector knows whose
  KV each request builds;
* ``on_tool_start`` / ``on_tool_end``: ``tool_call_start`` / ``tool_call_end``
  with the tool's name and the SDK's tool call id: the wait the hint server
  predicts and the connector keeps the agent's KV for;
* ``on_handoff``: the edge (the next agent's parent).

One hooks object is one session (``session_id``, random by default), over as
many runs as the conversation takes; :meth:`KVTierRunHooks.end_session` ends
its agents and the session. The tags stay on the ``Agent`` objects' settings:
give concurrent sessions their own ``Agent`` objects (``agent.clone()``).

Owns: that mapping. Must not: block (the client queues), or raise into the run.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from agents import RunHooks

from ..sdk.handles import AGENT_ID_PARAM, KV_TRANSFER_PARAMS, SESSION_ID_PARAM


class KVTierRunHooks(RunHooks):
    """Run hooks that send the run's agents and tool calls to kvtier (see the module docstring)."""

    def __init__(self, client: Any, session_id: str | None = None, *, model: str = "") -> None:
        super().__init__()
        self.client = client
        self.session_id = session_id or "agents-" + secrets.token_hex(6)
        self._started = False
        self._model = model
        self._agents: set[str] = set()
        self._parent: dict[str, str] = {}  # agent handed off to -> the agent that handed off
        self._calls: dict[int, str] = {}  # id(context) -> tool call id, for calls without the SDK's id
        self.events = 0

    def _emit(self, kind: str, **fields: Any) -> None:
        if not self._started:
            self._started = True
            self._emit("session_start", session_id=self.session_id, model=self._model)
        self.events += 1
        self.client.emit(kind, **fields)

    async def on_agent_start(self, context: Any, agent: Any) -> None:
        name = str(agent.name)
        if name not in self._agents:
            self._agents.add(name)
            self._emit("agent_spawn", session_id=self.session_id, agent_id=name,
                       parent_agent_id=self._parent.get(name, ""), agent_type=name)
        settings = agent.model_settings
        body = dict(settings.extra_body or {}) if isinstance(settings.extra_body, dict) or not settings.extra_body \
            else None
        if body is None:  # not a dict: leave the user's body alone
            return
        params = dict(body.get(KV_TRANSFER_PARAMS) or {})
        params.update({SESSION_ID_PARAM: self.session_id, AGENT_ID_PARAM: name})
        body[KV_TRANSFER_PARAMS] = params
        agent.model_settings = dataclasses.replace(settings, extra_body=body)

    async def on_handoff(self, context: Any, from_agent: Any, to_agent: Any) -> None:
        self._parent.setdefault(str(to_agent.name), str(from_agent.name))

    def _call_id(self, context: Any) -> str:
        cid = getattr(context, "tool_call_id", None)
        if isinstance(cid, str) and cid:
            return cid
        return self._calls.setdefault(id(context), "call-" + secrets.token_hex(6))

    async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
        self._emit("tool_call_start", session_id=self.session_id, agent_id=str(agent.name),
                   tool_call_id=self._call_id(context), tool_name=str(getattr(tool, "name", "tool")))

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: object) -> None:
        cid = self._call_id(context)
        self._calls.pop(id(context), None)
        self._emit("tool_call_end", session_id=self.session_id, agent_id=str(agent.name), tool_call_id=cid,
                   status="ok")

    def end_session(self) -> None:
        """The session is over: its agents end (their private KV may go first). An agent's final answer is
        not its end: the user may go on in another run with these hooks."""
        if not self._started:
            return
        for name in sorted(self._agents):
            self.client.emit("agent_end", session_id=self.session_id, agent_id=name, status="completed")
            self.events += 1
        self.client.emit("session_end", session_id=self.session_id)
        self.events += 1
        self._agents.clear()
        self._started = False
