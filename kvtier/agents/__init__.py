"""Agent-side knowledge that policies read: the :class:`AgentGraph` of sessions,
agents, dependencies, tool calls in flight and shared rounds.

Owns nothing but re-exports. Pure Python: importing it never imports grpc,
torch or an engine, so the live server and the replay simulator share it.
"""

from .graph import AgentGraph, Agent, DurationHistory, GraphLimits, Refusal, Session, SharedRound, ToolCall
from .predictor import wait_pin_ttl_s

__all__ = ["Agent", "AgentGraph", "DurationHistory", "GraphLimits", "Refusal", "Session", "SharedRound", "ToolCall",
           "wait_pin_ttl_s"]
