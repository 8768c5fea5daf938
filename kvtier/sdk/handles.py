"""Context-manager handles of the SDK: sessions, agents, requests, tool calls.

Owns: turning ``with`` blocks into start / end event pairs, the *current*
session and agent (a :mod:`contextvars` variable, so threads and asyncio
tasks each see their own), and :func:`tag_request`. Every handle only calls
its client's ``emit``; it must not talk to the network or block. Handles
work with ``with`` and ``async with`` alike.

>>> tag_request({"model": "m", "messages": []}, "s1", "planner-1")["kv_transfer_params"]
{'kvtier_session_id': 's1', 'kvtier_agent_id': 'planner-1'}
"""

from __future__ import annotations

import contextvars
import secrets
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .params import (  # the keys' names and readers live in params; re-exported here
    AGENT_ID_PARAM,
    APPROXIMATE_SEGMENTS_PARAM,
    CRITICALITY_PARAM,
    KV_TRANSFER_PARAMS,
    MAX_APPROXIMATE_SPANS,
    ROUND_ID_PARAM,
    SESSION_ID_PARAM,
    SHARED_TOKENS_PARAM,
    TOOL_WAIT_PARAM,
    VALIDATORS,
    request_approximate_segments,
    request_criticality,
    request_round,
    request_tags,
    request_tool_wait_s,
)

PRIORITY_FIELD = "priority"  # vLLM's own request priority (lower first under --scheduling-policy priority)
CACHE_SALT_FIELD = "cache_salt"  # vLLM's own: requests with different salts share no prefix-cache block
APPROXIMATE_SALT_MARKER = "kvtier-approximate"  # the last part of an approximate request's cache_salt


def tag_request(body: Mapping[str, Any], session_id: str, agent_id: str,
                tool_wait_s: float | None = None, *, criticality: float | None = None,
                critical_path_rank: int | None = None) -> dict[str, Any]:
    """A copy of an OpenAI-compatible request ``body`` whose ``kv_transfer_params``
    also carry ``kvtier_session_id`` and ``kvtier_agent_id`` (existing params are
    kept; ``body`` is not modified). With the ``openai`` client, pass
    ``extra_body={"kv_transfer_params": tagged["kv_transfer_params"]}``.

    ``tool_wait_s``: when the agent will call a tool with this response and
    expects to come back after about that long, the engine connector keeps the
    request's KV for that wait as its placement policy decides (``kvtier_tool_wait_s``;
    with the ``kvtier`` policy a critical agent's HBM blocks are held). Where the
    connector hosts or follows a hint server, the tool call announced there re-times
    that wait once with the server's prediction (``expected_s``, else its history).

    ``criticality`` (0..1, 1 = on the session's critical path) tells the
    connector how critical the agent is when no hint server says so
    (``kvtier_criticality``). ``critical_path_rank`` (0 = on the critical path,
    larger = further off it) becomes vLLM's own request ``priority``, which
    vLLM's scheduler admits lowest first only when started with
    ``--scheduling-policy priority``: admission order, reported apart from KV
    placement."""
    params = dict(body.get(KV_TRANSFER_PARAMS) or {})
    given = {SESSION_ID_PARAM: session_id, AGENT_ID_PARAM: agent_id, TOOL_WAIT_PARAM: tool_wait_s,
             CRITICALITY_PARAM: criticality}
    for key, value in given.items():  # what the connector would refuse is refused here, by the same rule
        if value is not None or key in (SESSION_ID_PARAM, AGENT_ID_PARAM):
            params[key], why = VALIDATORS[key](value)
            if why is not None:
                raise ValueError(f"tag_request: {key}={value!r}: {why}")
    tagged = dict(body)
    tagged[KV_TRANSFER_PARAMS] = params
    if critical_path_rank is not None:
        if isinstance(critical_path_rank, bool) or not isinstance(critical_path_rank, int) or critical_path_rank < 0:
            raise ValueError(f"tag_request: critical_path_rank={critical_path_rank!r} must be an int >= 0")
        tagged[PRIORITY_FIELD] = critical_path_rank
    return tagged


def approximate_segments(body: Mapping[str, Any], spans: Iterable[tuple[int, int]],
                         cache_salt: str | None = None) -> dict[str, Any]:
    """A copy of ``body`` asking for APPROXIMATE reuse of shared segments: each span
    ``(start, length)`` (prompt token offsets) holds text that other requests also
    contain, at other offsets. With the connector's ``approximate_shifted_segments``
    on, the whole blocks of a span are served from the first copy the connector
    saw (its keys re-rotated to this offset), not recomputed: faster, and not the
    KV this prompt would produce (see docs/shared.md, approximate reuse, for
    the measured quality). Spans must start on a block boundary to be reused.

    An agent's earlier turns should be sent the same way (``spans`` may be
    empty): the approximate request finds only blocks keyed like its own, and
    its private prefix must be cached for the segment after it to be reused
    (an engine reuses a prefix, never a block after a miss).

    The request also gets vLLM's ``cache_salt``, ending in
    :data:`APPROXIMATE_SALT_MARKER` (after ``cache_salt``, or the body's own
    salt, when there is one: a tenant's salt is kept): its blocks, approximate
    from the first span on, then never serve a request without that salt from
    vLLM's prefix cache; the connector keys every request so salted in a
    namespace of its own, and serves a request that declares spans without it
    exact. At most :data:`MAX_APPROXIMATE_SPANS` spans."""
    out: list[list[int]] = []
    for span in spans:
        start, length = span
        if isinstance(start, bool) or isinstance(length, bool) or not isinstance(start, int) \
                or not isinstance(length, int) or start < 0 or length <= 0:
            raise ValueError(f"approximate_segments: span {span!r} must be (start >= 0, length > 0) token counts")
        out.append([start, length])
    if len(out) > MAX_APPROXIMATE_SPANS:
        raise ValueError(f"approximate_segments: {len(out)} spans; at most {MAX_APPROXIMATE_SPANS}")
    base = body.get(CACHE_SALT_FIELD) if cache_salt is None else cache_salt
    if base is not None and (not isinstance(base, str) or not base):
        raise ValueError(f"approximate_segments: cache_salt={base!r} must be a non-empty string")
    params = dict(body.get(KV_TRANSFER_PARAMS) or {})
    params[APPROXIMATE_SEGMENTS_PARAM] = out
    tagged = dict(body)
    tagged[KV_TRANSFER_PARAMS] = params
    tagged[CACHE_SALT_FIELD] = base if is_approximate_salt(base) else (
        APPROXIMATE_SALT_MARKER if base is None else f"{base}\x1f{APPROXIMATE_SALT_MARKER}")
    return tagged


def is_approximate_salt(salt: Any) -> bool:
    """Whether a request's vLLM ``cache_salt`` marks it approximate (ends in the marker)."""
    return isinstance(salt, str) and salt.rsplit("\x1f", 1)[-1] == APPROXIMATE_SALT_MARKER


def tag_round(body: Mapping[str, Any], round_id: str, shared_tokens: int) -> dict[str, Any]:
    """A copy of ``body`` saying that its prompt's first ``shared_tokens`` tokens are the
    shared context of all-gather round ``round_id`` (what
    :class:`kvtier.sdk.rounds.RoundLayout` lays out; ``RoundPrompt.shared_tokens``).
    With the round announced on the hint plane (``SessionHandle.shared_round``),
    the engine connector keeps those blocks, in HBM and in its tiers, until every
    announced agent of the round has been served. Tag the session and agent too
    (:func:`tag_request`): the connector counts agents by their ids."""
    if not isinstance(round_id, str) or not round_id:
        raise ValueError(f"tag_round: round_id={round_id!r} must be a non-empty string")
    if isinstance(shared_tokens, bool) or not isinstance(shared_tokens, int) or shared_tokens < 0:
        raise ValueError(f"tag_round: shared_tokens={shared_tokens!r} must be an int >= 0")
    params = dict(body.get(KV_TRANSFER_PARAMS) or {})
    params[ROUND_ID_PARAM] = round_id
    params[SHARED_TOKENS_PARAM] = shared_tokens
    tagged = dict(body)
    tagged[KV_TRANSFER_PARAMS] = params
    return tagged


@dataclass(frozen=True, slots=True)
class _Scope:
    client: Any
    session_id: str
    agent: AgentHandle | None

    @property
    def agent_id(self) -> str | None:
        return None if self.agent is None else self.agent.agent_id


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("kvtier_sdk_scope", default=None)


def current_scope(client: Any) -> _Scope | None:
    """The innermost session/agent of ``client`` entered in this thread or task."""
    scope = _SCOPE.get()
    return scope if scope is not None and scope.client is client else None


class _Handle:
    """Start on enter, end on exit (``failed`` when the block raised); sync or async."""

    _token: contextvars.Token[_Scope | None] | None = None

    def start(self) -> Any:
        raise NotImplementedError

    def end(self, failed: bool = False) -> None:
        raise NotImplementedError

    def _scope(self) -> _Scope | None:
        return None

    def __enter__(self) -> Any:
        self.start()
        scope = self._scope()
        if scope is not None:
            self._token = _SCOPE.set(scope)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._token is not None:
            _SCOPE.reset(self._token)
            self._token = None
        self.end(failed=exc_type is not None)

    async def __aenter__(self) -> Any:
        return self.__enter__()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)


class SessionHandle(_Handle):
    """``with client.session("s1") as s:`` emits ``session_start`` / ``session_end``."""

    def __init__(self, client: Any, session_id: str, model: str = "") -> None:
        self.client, self.session_id, self.model = client, session_id, model

    def start(self) -> SessionHandle:
        self.client.emit("session_start", session_id=self.session_id, model=self.model)
        return self

    def end(self, failed: bool = False) -> None:
        self.client.emit("session_end", session_id=self.session_id)

    def _scope(self) -> _Scope:
        return _Scope(self.client, self.session_id, None)

    def agent(self, agent_type: str = "", **kwargs: Any) -> AgentHandle:
        """A root agent of this session (``parent_id=`` to attach it elsewhere)."""
        kwargs.setdefault("parent_id", None)
        return self.client.agent(agent_type, session_id=self.session_id, **kwargs)

    def shared_round(self, round_id: str, agent_ids: Iterable[str]) -> SharedRoundHandle:
        """``with session.shared_round("r3", agents):`` announces an all-gather round whose
        agents all read the same shared context (``shared_round_start``; ``shared_round_end``
        on exit). Requests of the round carry :func:`tag_round`."""
        return SharedRoundHandle(self.client, self.session_id, round_id, tuple(agent_ids))


class AgentHandle(_Handle):
    """One agent; ``with`` spawns it and ends it. Children: :meth:`agent`."""

    def __init__(self, client: Any, session_id: str, agent_id: str, parent_id: str | None, agent_type: str,
                 importance: str | int, join_group: str, expected_num_requests: int) -> None:
        self.client, self.session_id, self.agent_id, self.parent_id = client, session_id, agent_id, parent_id
        self.agent_type, self.importance, self.join_group = agent_type, importance, join_group
        self.expected_num_requests = expected_num_requests

    def start(self) -> AgentHandle:
        self.client.emit("agent_spawn", session_id=self.session_id, agent_id=self.agent_id,
                         parent_agent_id=self.parent_id or "", agent_type=self.agent_type,
                         importance=self.importance, join_group=self.join_group,
                         expected_num_requests=self.expected_num_requests)
        return self

    def end(self, failed: bool = False) -> None:
        self.client.emit("agent_end", session_id=self.session_id, agent_id=self.agent_id,
                         status="failed" if failed else "completed")

    def _scope(self) -> _Scope:
        return _Scope(self.client, self.session_id, self)

    def agent(self, agent_type: str = "", **kwargs: Any) -> AgentHandle:
        """A child agent of this one."""
        kwargs.setdefault("parent_id", self.agent_id)
        return self.client.agent(agent_type, session_id=self.session_id, **kwargs)

    def tool_call(self, tool_name: str, *, expected_s: float | None = None,
                  tool_call_id: str | None = None) -> ToolCallHandle:
        return ToolCallHandle(self, tool_call_id or f"{tool_name}-{secrets.token_hex(4)}", tool_name, expected_s)

    def request(self, request_id: str | None = None, *, prompt_block_keys: bytes | Iterable[Any] = b"",
                num_prompt_tokens: int = 0, model: str = "") -> RequestHandle:
        return RequestHandle(self, request_id or f"req-{secrets.token_hex(6)}", prompt_block_keys,
                             num_prompt_tokens, model)

    def depends_on(self, other: AgentHandle | str) -> None:
        """This agent waits for ``other`` (a dependency edge)."""
        other_id = other if isinstance(other, str) else other.agent_id
        self.client.emit("dependency", session_id=self.session_id, from_agent_id=other_id, to_agent_id=self.agent_id)

    def set_priority(self, priority: str | int) -> None:
        """Command: ``"low"``, ``"normal"`` or ``"high"``."""
        self.client.emit("priority", session_id=self.session_id, agent_id=self.agent_id, priority=priority)

    def pin(self, block_keys: bytes | Iterable[Any], ttl_s: float) -> None:
        self.client.emit("pin", session_id=self.session_id, block_keys=block_keys, ttl_s=ttl_s)

    def unpin(self, block_keys: bytes | Iterable[Any]) -> None:
        self.client.emit("unpin", session_id=self.session_id, block_keys=block_keys)

    def prefetch(self, block_keys: bytes | Iterable[Any], tier: str = "dram") -> None:
        self.client.emit("prefetch", session_id=self.session_id, block_keys=block_keys, tier=tier)

    def tag(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """:func:`tag_request` with this agent's ids."""
        return tag_request(body, self.session_id, self.agent_id)


class SharedRoundHandle(_Handle):
    """``shared_round_start`` on enter (the round's agents), ``shared_round_end`` on exit."""

    def __init__(self, client: Any, session_id: str, round_id: str, agent_ids: tuple[str, ...]) -> None:
        if not agent_ids or not all(isinstance(a, str) and a for a in agent_ids):
            raise ValueError(f"shared_round: agent_ids={agent_ids!r} must be non-empty agent id strings")
        self.client, self.session_id, self.round_id, self.agent_ids = client, session_id, round_id, agent_ids

    def start(self) -> SharedRoundHandle:
        self.client.emit("shared_round_start", session_id=self.session_id, round_id=self.round_id,
                         agent_ids=list(self.agent_ids), shared_block_keys=b"")
        return self

    def end(self, failed: bool = False) -> None:
        self.client.emit("shared_round_end", session_id=self.session_id, round_id=self.round_id)


class ToolCallHandle(_Handle):
    """``tool_call_start`` on enter; ``tool_call_end`` on exit (``error`` when the block raised)."""

    def __init__(self, agent: AgentHandle, tool_call_id: str, tool_name: str, expected_s: float | None) -> None:
        self.agent, self.tool_call_id, self.tool_name, self.expected_s = agent, tool_call_id, tool_name, expected_s

    def start(self) -> ToolCallHandle:
        fields: dict[str, Any] = {"session_id": self.agent.session_id, "agent_id": self.agent.agent_id,
                                  "tool_call_id": self.tool_call_id, "tool_name": self.tool_name}
        if self.expected_s is not None:
            fields["expected_duration_s"] = float(self.expected_s)
        self.agent.client.emit("tool_call_start", **fields)
        return self

    def end(self, failed: bool = False) -> None:
        self.agent.client.emit("tool_call_end", session_id=self.agent.session_id, agent_id=self.agent.agent_id,
                               tool_call_id=self.tool_call_id, status="error" if failed else "ok")


class RequestHandle(_Handle):
    """``request_start`` on enter; ``request_end`` on exit with :attr:`num_output_tokens`
    and :attr:`stop` (``"tool_use"``, ``"end_turn"``, ...; ``"error"`` when the block raised)."""

    def __init__(self, agent: AgentHandle, request_id: str, prompt_block_keys: bytes | Iterable[Any],
                 num_prompt_tokens: int, model: str) -> None:
        self.agent, self.request_id = agent, request_id
        self.prompt_block_keys, self.num_prompt_tokens, self.model = prompt_block_keys, num_prompt_tokens, model
        self.num_output_tokens = 0
        self.stop = ""

    def start(self) -> RequestHandle:
        self.agent.client.emit("request_start", session_id=self.agent.session_id, agent_id=self.agent.agent_id,
                               request_id=self.request_id, prompt_block_keys=self.prompt_block_keys,
                               num_prompt_tokens=self.num_prompt_tokens, model=self.model)
        return self

    def end(self, failed: bool = False) -> None:
        stop = "error" if failed else (self.stop or "unspecified")
        self.agent.client.emit("request_end", session_id=self.agent.session_id, agent_id=self.agent.agent_id,
                               request_id=self.request_id, num_output_tokens=self.num_output_tokens, stop=stop)

    def tag(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """:func:`tag_request` with this request's agent ids."""
        return self.agent.tag(body)
