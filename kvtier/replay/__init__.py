"""Offline replay of agent traces: readers, the workload model and a synthetic generator.

Owns: turning traces (AgentX / Weka JSON, Mooncake JSONL, directories and
tarballs of them) and generated sessions into one in-memory
:class:`~kvtier.replay.model.Workload` that the replay simulator consumes.
Importing this package is cheap (numpy is imported only by the generator).

>>> from kvtier.replay import default_workload
>>> w = default_workload(seed=0, num_sessions=2, max_requests_per_agent=4)
>>> w.block_size, len(w.sessions), w.open_loop
(64, 2, False)
"""

from .model import (
    GAP_CAUSES,
    ROOT_AGENT_ID,
    Agent,
    BlockId,
    GapCause,
    Request,
    Session,
    Workload,
    reblock,
)
from .readers import (
    LoadReport,
    SkippedTrace,
    TraceError,
    load_trace,
    load_trace_objects,
    load_trace_with_report,
)


def __getattr__(name: str):  # lazy: the generator imports numpy
    if name in ("GeneratorConfig", "default_workload", "generate_coding_sessions", "write_traces"):
        from . import generator

        return getattr(generator, name)
    raise AttributeError(f"module 'kvtier.replay' has no attribute {name!r}")


__all__ = [
    "GAP_CAUSES",
    "ROOT_AGENT_ID",
    "Agent",
    "BlockId",
    "GapCause",
    "GeneratorConfig",
    "LoadReport",
    "Request",
    "Session",
    "SkippedTrace",
    "TraceError",
    "Workload",
    "default_workload",
    "generate_coding_sessions",
    "load_trace",
    "load_trace_objects",
    "load_trace_with_report",
    "reblock",
    "write_traces",
]
