"""kvtier SDK for agent frameworks: tell kvtier what the agent is doing.

Two lines to integrate::

    from kvtier.sdk import HintClient
    client = HintClient("127.0.0.1:50051")          # never blocks, never raises on server loss

    with client.session("s1"), client.agent("planner") as planner:
        with client.tool_call("bash", expected_s=3.0):
            run_tool()
        body = planner.tag({"model": "m", "messages": msgs})   # kv_transfer_params carry the ids
        with planner.agent("coder") as coder:                  # a child agent
            ...

Owns the public names only; the clients live in :mod:`kvtier.sdk.client`,
the ``with`` handles in :mod:`kvtier.sdk.handles`. Imports grpc (``import
kvtier`` does not import this package).
"""

from .client import AsyncHintClient, ClientStats, HintClient, pack_keys
from .handles import (
    AGENT_ID_PARAM,
    APPROXIMATE_SEGMENTS_PARAM,
    KV_TRANSFER_PARAMS,
    SESSION_ID_PARAM,
    TOOL_WAIT_PARAM,
    AgentHandle,
    RequestHandle,
    SessionHandle,
    SharedRoundHandle,
    ToolCallHandle,
    approximate_segments,
    request_approximate_segments,
    request_round,
    request_tags,
    request_criticality,
    request_tool_wait_s,
    tag_request,
    tag_round,
)

__all__ = [
    "AGENT_ID_PARAM",
    "APPROXIMATE_SEGMENTS_PARAM",
    "KV_TRANSFER_PARAMS",
    "SESSION_ID_PARAM",
    "TOOL_WAIT_PARAM",
    "AgentHandle",
    "AsyncHintClient",
    "ClientStats",
    "HintClient",
    "RequestHandle",
    "SessionHandle",
    "SharedRoundHandle",
    "ToolCallHandle",
    "approximate_segments",
    "pack_keys",
    "request_approximate_segments",
    "request_round",
    "request_tags",
    "request_criticality",
    "request_tool_wait_s",
    "tag_request",
    "tag_round",
]
