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

try:
    from agents import RunHooks
except ModuleNotFoundError as _err:
    from ..errors import MissingExtraError

    raise MissingExtraError("kvtier.adapters.openai_agents", "agents", _err.name or "agents") from None

from ._session import HintSession, tagged


class KVTierRunHooks(HintSession, RunHooks):
    """Run hooks that send the run's agents and tool calls to kvtier (see the module docstring)."""

    def __init__(self, client: Any, session_id: str | None = None, *, model: str = "") -> None:
        HintSession.__init__(self, client, session_id or "agents-" + secrets.token_hex(6), model)
        self._parent: dict[str, str] = {}  # agent handed off to -> the agent that handed off
        self._calls: dict[int, str] = {}  # id(context) -> tool call id, for calls without the SDK's id

    async def on_agent_start(self, context: Any, agent: Any) -> None:
        name = str(agent.name)
        self._spawn(name, self._parent.get(name, ""))
        settings = agent.model_settings
        if settings.extra_body and not isinstance(settings.extra_body, dict):
            return  # not a dict: leave the user's body alone
        agent.model_settings = dataclasses.replace(settings, extra_body=tagged(settings.extra_body or {},
                                                                               self.session_id, name))

    async def on_handoff(self, context: Any, from_agent: Any, to_agent: Any) -> None:
        self._parent.setdefault(str(to_agent.name), str(from_agent.name))

    def _call_id(self, context: Any) -> str:
        cid = getattr(context, "tool_call_id", None)
        if isinstance(cid, str) and cid:
            return cid
        return self._calls.setdefault(id(context), "call-" + secrets.token_hex(6))

    async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
        self._emit("tool_call_start", agent_id=str(agent.name), tool_call_id=self._call_id(context),
                   tool_name=str(getattr(tool, "name", "tool")))

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: object) -> None:
        cid = self._call_id(context)
        self._calls.pop(id(context), None)
        self._emit("tool_call_end", agent_id=str(agent.name), tool_call_id=cid, status="ok")
