"""Following a hint server's agents from an engine: the client of ``HintService.Watch``.

Owns: one background thread that keeps a ``Watch`` stream open to a hint
server (``kvtier serve``, or one hosted elsewhere), reconnecting after a
failure, and the newest view it received, converted to this host's
monotonic clock (:class:`AgentsSnapshot`). What an engine connector reads when
the hint server is not in its own process (several engines, one hint plane).

Must not block its reader: :meth:`AgentsWatcher.latest` only returns the
newest snapshot, never waits for the network; a snapshot older than
``stale_after_s`` is not returned (a stalled server must not keep agents
waiting forever).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from ..hints._gen import hints_pb2 as pb
from ..hints._gen import hints_pb2_grpc as pb_grpc
from .client import open_channel
from .params import MAX_TOOL_WAIT_S

AgentKey = tuple[str, str]


@dataclass(frozen=True, slots=True)
class AgentState:
    """One agent as the hint server saw it. ``returns_at_s``: predicted return of
    its tool call in flight on this host's ``time.monotonic`` clock (``None``: no
    call, or no prediction)."""

    criticality: float
    parent_id: str | None
    ended: bool
    tool_in_flight: bool
    returns_at_s: float | None


@dataclass(frozen=True, slots=True)
class AgentsSnapshot:
    received_s: float
    agents: dict[AgentKey, AgentState] = field(default_factory=dict)
    rounds: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)  # (session, round) -> agents


def snapshot_of(view: Any, received_s: float) -> AgentsSnapshot:
    """An ``AgentsView`` message as an :class:`AgentsSnapshot` received at ``received_s``.
    What a server (or anything in its place) sends is bounded here, for the connector
    acts on it: a criticality outside [0, 1] is clamped (NaN reads as 0), a predicted
    return is clamped to :data:`~kvtier.sdk.params.MAX_TOOL_WAIT_S` either way (negative:
    overdue), and a NaN one reads as no prediction."""
    agents = {}
    for a in view.agents:
        returns = None
        if a.tool_call_in_flight and a.has_prediction and a.tool_returns_in_s == a.tool_returns_in_s:  # not NaN
            returns = received_s + min(MAX_TOOL_WAIT_S, max(-MAX_TOOL_WAIT_S, a.tool_returns_in_s))
        crit = min(1.0, a.criticality) if a.criticality >= 0.0 else 0.0  # NaN: 0
        agents[(a.session_id, a.agent_id)] = AgentState(crit, a.parent_agent_id or None, a.ended,
                                                        a.tool_call_in_flight, returns)
    rounds = {(r.session_id, r.round_id): tuple(r.agent_ids) for r in view.rounds}
    return AgentsSnapshot(received_s, agents, rounds)


class AgentsWatcher:
    """Keeps ``HintService.Watch`` open to ``target`` on a daemon thread.

    ``token`` / ``tenant``: as for :class:`~kvtier.sdk.HintClient` (the view is
    of the caller's tenant). ``interval_s``: how often the server sends a view.
    """

    def __init__(self, target: str, *, token: str | None = None, tenant: str | None = None, interval_s: float = 0.05,
                 tls: bool = False, root_certificates: bytes | None = None, reconnect_s: float = 1.0,
                 stale_after_s: float = 5.0, start: bool = True) -> None:
        self.target = target
        self.interval_s = interval_s
        self.reconnect_s = reconnect_s
        self.stale_after_s = stale_after_s
        md = []
        if token:
            md.append(("authorization", f"Bearer {token}"))
        if tenant:
            md.append(("x-kvtier-tenant", tenant))
        self._md = tuple(md)
        self._tls = (tls or root_certificates is not None, root_certificates)
        self._latest: AgentsSnapshot | None = None
        self._stop = threading.Event()
        self._call: Any = None
        self._lock = threading.Lock()
        self.views = 0
        self.reconnects = 0
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvtier-hints-watch", daemon=True)
            self._thread.start()

    def latest(self) -> AgentsSnapshot | None:
        """The newest snapshot, or ``None`` (none yet, or older than ``stale_after_s``)."""
        snap = self._latest
        if snap is None or time.monotonic() - snap.received_s > self.stale_after_s:
            return None
        return snap

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        request = pb.WatchRequest(interval_ms=max(10, int(self.interval_s * 1000)))
        while not self._stop.is_set():
            channel = open_channel(self.target, self._tls[0], self._tls[1], None, aio=False)
            try:
                call = pb_grpc.HintServiceStub(channel).Watch(request, metadata=self._md)
                with self._lock:
                    self._call = call
                if self._stop.is_set():
                    call.cancel()
                for view in call:
                    self._latest = snapshot_of(view, time.monotonic())
                    self.views += 1
            except grpc.RpcError as err:
                if self._stop.is_set():
                    break
                code = err.code() if hasattr(err, "code") else None
                self.last_error = f"{code}: {err.details() if hasattr(err, 'details') else err}"
            finally:
                with self._lock:
                    self._call = None
                channel.close()
            if self._stop.wait(self.reconnect_s):
                break
            self.reconnects += 1
