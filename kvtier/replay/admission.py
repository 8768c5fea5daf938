"""Admission order of the modelled engine: which waiting request is admitted first.

Owns: the named admission orders ``kvtier replay --admission`` offers. The
order is the engine scheduler's decision, not the KV cache's: a KV connector
cannot reorder vLLM's queue (vLLM's own knob is ``--scheduling-policy
priority`` with a request ``priority``). So it is one setting of the replay,
applied alike to every placement policy, and reported next to the results
apart from them. Must not touch KV placement or the simulator's state; an
order only returns a sort key (lower first, FCFS among equals).

* ``fcfs`` (default) — first come, first served: vLLM's default.
* ``critical-first`` — agents on their application's critical path first
  (the dominant term of TokenCake's request score, arXiv 2510.18586).
* ``oldest-app`` — the oldest application (session) first, critical agents
  of an application ``SENIORITY_S`` ahead: an application finishes instead of
  every application crawling, and unlike shortest-remaining-first nothing
  starves.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import ConfigError

SENIORITY_S = 10.0

AdmissionKey = Callable[[Any, int, str, float], float]
"""``(ctx, session index, agent id, session start s) -> key``; ``ctx`` gives ``criticality``."""


def _critical_first(ctx: Any, session: int, agent_id: str, session_start_s: float) -> float:
    return -ctx.criticality((session, agent_id))


def _oldest_app(ctx: Any, session: int, agent_id: str, session_start_s: float) -> float:
    return session_start_s - SENIORITY_S * ctx.criticality((session, agent_id))


ADMISSION_ORDERS: dict[str, AdmissionKey | None] = {
    "fcfs": None,
    "critical-first": _critical_first,
    "oldest-app": _oldest_app,
}


def admission_order(name: str) -> AdmissionKey | None:
    """The sort key of admission order ``name`` (``None``: FCFS)."""
    try:
        return ADMISSION_ORDERS[name]
    except KeyError:
        raise ConfigError("--admission", name, f"unknown admission order; valid: {', '.join(ADMISSION_ORDERS)}") \
            from None
