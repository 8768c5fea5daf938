"""kvtier hints for LangGraph / LangChain (``langgraph``, ``langchain-core``).

    from kvtier.adapters.langgraph import KVTierCallbackHandler
    from kvtier.sdk import HintClient

    hints = KVTierCallbackHandler(HintClient("127.0.0.1:50071"))   # the connector's hint_server
    llm = hints.tag(ChatOpenAI(base_url=...).bind_tools(tools), agent="agent")  # agent = the graph node's name
    graph.invoke(inputs, config={"callbacks": [hints]})

A LangChain callback handler:

* a graph node that calls a chat model is an agent (its name is the node's,
  ``langgraph_node``); the first is the root, later ones its children
  (``agent_spawn``);
* a tool run (``on_tool_start`` / ``on_tool_end`` / ``on_tool_error``) is a tool
  call of the agent whose model asked for it (the node that last called a
  chat model): ``tool_call_start`` with the tool's name, ``tool_call_end``;
* :meth:`KVTierCallbackHandler.tag` binds ``kv_transfer_params`` (session, agent)
  into a chat model's requests (``extra_body``), so the engine connector knows
  whose KV each request builds; use the node's name as ``agent``.

One handler is one session (``session_id``, random by default); call
:meth:`KVTierCallbackHandler.end_session` when it is over.

Owns: that mapping. Must not: block (the client queues), or raise into the graph.
"""

from __future__ import annotations

import secrets
from typing import Any
from uuid import UUID

try:
    from langchain_core.callbacks import BaseCallbackHandler
except ModuleNotFoundError as _err:
    from ..errors import MissingExtraError

    raise MissingExtraError("kvtier.adapters.langgraph", "agents", _err.name or "langchain_core") from None

from ._session import HintSession, tagged


class KVTierCallbackHandler(HintSession, BaseCallbackHandler):
    """Callbacks that send a graph's agents and tool calls to kvtier (see the module docstring)."""

    raise_error = False  # a hint problem never fails the graph

    def __init__(self, client: Any, session_id: str | None = None, *, model: str = "") -> None:
        BaseCallbackHandler.__init__(self)
        HintSession.__init__(self, client, session_id or "graph-" + secrets.token_hex(6), model)
        self._root: str | None = None
        self._last_agent: str | None = None
        self._calls: dict[UUID, tuple[str, str]] = {}  # tool run id -> (agent, call id)

    def tag(self, model: Any, agent: str) -> Any:
        """``model`` bound to send this session's and ``agent``'s ids in ``kv_transfer_params``; the model's own
        ``extra_body`` (a ``ChatOpenAI(extra_body=...)``, or one bound before) is kept, merged."""
        bound = getattr(model, "kwargs", None)
        inner = getattr(model, "bound", model)
        body = dict(getattr(inner, "extra_body", None) or {})
        body.update((bound or {}).get("extra_body") or {})
        return model.bind(extra_body=tagged(body, self.session_id, agent))

    def _agent(self, metadata: dict[str, Any] | None) -> str:
        name = str((metadata or {}).get("langgraph_node") or "agent")
        if self._root is None:
            self._root = name
        self._spawn(name, "" if name == self._root else self._root)
        return name

    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[Any]], *, run_id: UUID,
                            parent_run_id: UUID | None = None, tags: list[str] | None = None,
                            metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._last_agent = self._agent(metadata)

    def on_tool_start(self, serialized: dict[str, Any], input_str: str, *, run_id: UUID,
                      parent_run_id: UUID | None = None, tags: list[str] | None = None,
                      metadata: dict[str, Any] | None = None, inputs: dict[str, Any] | None = None,
                      **kwargs: Any) -> None:
        agent = self._last_agent or self._agent(metadata)
        cid = kwargs.get("tool_call_id")
        cid = cid if isinstance(cid, str) and cid else "call-" + run_id.hex[:16]
        self._calls[run_id] = (agent, cid)
        self._emit("tool_call_start", agent_id=agent, tool_call_id=cid,
                   tool_name=str((serialized or {}).get("name") or kwargs.get("name") or "tool"))

    def _end(self, run_id: UUID, status: str) -> None:
        call = self._calls.pop(run_id, None)
        if call is not None:
            self._emit("tool_call_end", agent_id=call[0], tool_call_id=call[1], status=status)

    def on_tool_end(self, output: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._end(run_id, "ok")

    def on_tool_error(self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None,
                      **kwargs: Any) -> None:
        self._end(run_id, "error")

    def end_session(self) -> None:
        """The session is over: its agents end (their private KV may go first)."""
        super().end_session()
        self._root = None
