"""The hints server: ``kvtier.v1.HintService`` over grpc.aio, feeding an AgentGraph.

Owns: the gRPC surface (Publish, PublishStream, GetStats and the standard
``grpc.health.v1`` service), authentication (optional bearer tokens, each
naming a tenant), TLS, binding (127.0.0.1 or a unix socket by default; a
non-loopback address needs a token or an explicit opt-in), the expiry task
for abandoned sessions, the Prometheus endpoint (hint-plane metrics, plus the
store's tier metrics from :mod:`kvtier.metrics` when a TieredStore is given)
and the recorder hook.
Validation and application live in :mod:`kvtier.hints.apply`; this module
must not interpret events itself.

Tenants: with tokens configured, the tenant is the one the presented token
names (``authorization: Bearer <token>``); a missing or wrong token is
UNAUTHENTICATED. Without tokens the tenant comes from the ``x-kvtier-tenant``
metadata (default ``default``). A tenant only ever sees its own sessions.
The health service answers without a token (load balancers probe it).

Status codes: a bad event → INVALID_ARGUMENT naming the field (unary,
``skip_invalid=false``); a limit → RESOURCE_EXHAUSTED naming the setting;
inside a stream both are counted rejections and the stream goes on. The
per-tenant rate limit (``HintLimits.max_events_per_s_per_tenant``) is a
limit: a unary batch whose tail it refuses is RESOURCE_EXHAUSTED whatever
``skip_invalid`` says (the events before the tail were applied); in a stream
the refused events are counted under ``rate_limited``.

>>> import asyncio
>>> async def demo():
...     server = HintServer()
...     address = await server.start("127.0.0.1:0")
...     await server.stop()
...     return address.startswith("127.0.0.1:")
>>> asyncio.run(demo())
True
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from ..agents.graph import AgentGraph, GraphLimits
from ..sdk.params import DEFAULT_TENANT
from . import DEFAULT_ADDRESS
from ._gen import hints_pb2 as pb
from .apply import NO_STORE, BatchResult, CommandSink, HintApplier, HintLimits, Rejected

SERVICE_NAME = "kvtier.v1.HintService"
TENANT_METADATA = "x-kvtier-tenant"
MAX_MESSAGE_BYTES = 16 << 20
_UNAUTHENTICATED = "missing or wrong bearer token (send metadata 'authorization: Bearer <token>')"
_EXHAUSTED_REASONS = frozenset({"limit", "rate_limited"})  # RESOURCE_EXHAUSTED; other reasons: INVALID_ARGUMENT


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM bytes of the server certificate chain and its private key."""

    cert_chain: bytes
    private_key: bytes


def is_local_address(address: str) -> bool:
    """Whether ``address`` (``host:port``, ``[v6]:port`` or ``unix:PATH``) is only reachable locally."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_tokens(path: str) -> dict[str, str]:
    """``token -> tenant`` from a file of lines ``TENANT TOKEN`` (or a bare ``TOKEN``
    for tenant ``default``); blank lines and ``#`` comments are skipped."""
    tokens: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split("#", 1)[0].split()
            if not parts:
                continue
            if len(parts) > 2:
                raise ValueError(f"{path}:{lineno}: expected 'TENANT TOKEN' or 'TOKEN', got {len(parts)} words")
            tenant, token = (DEFAULT_TENANT, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
            tokens[token] = tenant
    return tokens


class _Servicer:
    def __init__(self, server: HintServer) -> None:
        self.s = server

    async def Publish(self, request: Any, context: Any) -> Any:
        tenant = await self.s.tenant_of(context, "Publish")
        if type(request) is _Undecodable:
            self.s.rpcs[("Publish", "INVALID_ARGUMENT")] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
        result = self.s.apply(tenant, request, skip_invalid=request.skip_invalid)
        stop = result.stopped
        if stop is not None and (result.batch_error or not request.skip_invalid or stop.reason == "rate_limited"):
            exhausted = stop.reason in _EXHAUSTED_REASONS
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if exhausted else grpc.StatusCode.INVALID_ARGUMENT
            self.s.rpcs[("Publish", code.name)] += 1
            applied = f"; {result.num_accepted} earlier events were applied" if result.num_accepted else ""
            await context.abort(code, f"{stop.field}: {stop.message} [{stop.reason}]{applied}")
        self.s.rpcs[("Publish", "OK")] += 1
        return pb.PublishResponse(num_accepted=result.num_accepted, num_duplicates=result.num_duplicates,
                                  num_rejected=result.num_rejected,
                                  rejections=[_rejection(r) for r in result.rejections])

    async def PublishStream(self, request_iterator: Any, context: Any) -> Any:
        tenant = await self.s.tenant_of(context, "PublishStream")
        summary = pb.PublishSummary()
        by_reason: Counter[str] = Counter()
        async for request in request_iterator:
            summary.num_messages += 1
            if type(request) is _Undecodable:
                summary.num_rejected += 1
                by_reason["undecodable"] += 1
                if len(summary.first_rejections) < 16:
                    summary.first_rejections.add(field="request", reason="undecodable", message=request.message())
                continue
            result = self.s.apply(tenant, request, skip_invalid=True)
            summary.num_accepted += result.num_accepted
            summary.num_duplicates += result.num_duplicates
            rejected = result.num_rejected
            if result.batch_error:
                rejected = len(request.signals) + len(request.commands)
            summary.num_rejected += rejected
            for rej in result.rejections:
                by_reason[rej.reason] += rejected if result.batch_error else rej.num_events
                if len(summary.first_rejections) < 16:
                    summary.first_rejections.append(_rejection(rej))
            num_listed = sum(rej.num_events for rej in result.rejections)
            if result.num_rejected > num_listed:
                by_reason["unlisted"] += result.num_rejected - num_listed
        summary.rejected_by_reason.update(by_reason)
        self.s.rpcs[("PublishStream", "OK")] += 1
        return summary

    async def GetStats(self, request: Any, context: Any) -> Any:
        tenant = await self.s.tenant_of(context, "GetStats")
        if type(request) is _Undecodable:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
        stats = self.s.stats(tenant, request.session_id)
        if stats is None:
            self.s.rpcs[("GetStats", "NOT_FOUND")] += 1
            await context.abort(grpc.StatusCode.NOT_FOUND, f"session_id: unknown session {request.session_id!r}")
        self.s.rpcs[("GetStats", "OK")] += 1
        return stats

    async def Watch(self, request: Any, context: Any) -> Any:
        tenant = await self.s.tenant_of(context, "Watch")
        if type(request) is _Undecodable:
            self.s.rpcs[("Watch", "INVALID_ARGUMENT")] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
        interval_s = max(0.01, (request.interval_ms or 50) / 1000)
        self.s.rpcs[("Watch", "OK")] += 1
        try:
            while True:
                yield self.s.agents_view(tenant)
                await asyncio.sleep(interval_s)
        except asyncio.CancelledError:  # the client went away or the server stops: the stream just ends
            return


class _Undecodable:
    """What the deserializer hands the servicer for bytes that are not the message."""

    __slots__ = ("type_name", "error")

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name, self.error = type_name, error

    def message(self) -> str:
        return f"request: cannot decode a {self.type_name} ({self.error})"


def _decoder(cls: Any) -> Any:
    """A deserializer that never raises: undecodable bytes become :class:`_Undecodable`,
    which the servicer answers with INVALID_ARGUMENT (grpc would log a traceback and
    answer UNKNOWN)."""
    from google.protobuf.message import DecodeError

    name = cls.DESCRIPTOR.full_name

    def decode(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError as err:
            return _Undecodable(name, str(err))

    return decode


def _add_service(servicer: _Servicer, server: Any) -> None:
    """Register the HintService like the generated ``add_HintServiceServicer_to_server``,
    with :func:`_decoder` deserializers."""
    handlers = {
        "Publish": grpc.unary_unary_rpc_method_handler(
            servicer.Publish, request_deserializer=_decoder(pb.PublishRequest),
            response_serializer=pb.PublishResponse.SerializeToString),
        "PublishStream": grpc.stream_unary_rpc_method_handler(
            servicer.PublishStream, request_deserializer=_decoder(pb.PublishRequest),
            response_serializer=pb.PublishSummary.SerializeToString),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetStats, request_deserializer=_decoder(pb.GetStatsRequest),
            response_serializer=pb.Stats.SerializeToString),
        "Watch": grpc.unary_stream_rpc_method_handler(
            servicer.Watch, request_deserializer=_decoder(pb.WatchRequest),
            response_serializer=pb.AgentsView.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _rejection(r: Rejected) -> Any:
    return pb.Rejection(event_id=r.event_id, field=r.field, reason=r.reason, message=r.message)


class HintServer:
    """One grpc.aio server with the HintService and health service.

    ``tokens``: ``token -> tenant``; empty/None disables auth. ``store``:
    pin / unpin / prefetch commands go to it (else they are refused, reason
    ``no_store``, with ``no_store`` as the message: why, and what to do).
    ``recorder``: a :class:`~kvtier.recording.hints.HintRecorder` (or any
    object with ``on_event`` / ``on_session_gone``). ``metrics_port``:
    ``None`` for no endpoint, ``0`` for any free port (see
    :attr:`metrics_port` after :meth:`start`).

    Use from one event loop: ``address = await server.start(...)``, then
    ``await server.stop()``.
    """

    def __init__(self, *, graph: AgentGraph | None = None, graph_limits: GraphLimits | None = None,
                 limits: HintLimits | None = None, store: CommandSink | None = None, recorder: Any = None,
                 tokens: Mapping[str, str] | None = None, tls: TLSFiles | None = None,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 expire_interval_s: float = 1.0, allow_unauthenticated_remote: bool = False,
                 no_store: str = NO_STORE) -> None:
        self.graph = graph or AgentGraph(graph_limits)
        self.applier = HintApplier(self.graph, limits, store=store, listener=recorder, no_store=no_store)
        self.recorder = recorder
        self._tokens = {hashlib.sha256(t.encode()).digest(): tenant for t, tenant in (tokens or {}).items()}
        self.tls = tls
        self.rpcs: Counter[tuple[str, str]] = Counter()
        self._metrics_request = metrics_port
        self._metrics_host = metrics_host
        self.metrics_port: int | None = None
        self.metrics: Any = None
        self._expire_interval_s = expire_interval_s
        self._allow_remote = allow_unauthenticated_remote
        self._server: Any = None
        self._health: Any = None
        self._expiry_task: asyncio.Task[None] | None = None
        self.address: str | None = None

    @property
    def auth_enabled(self) -> bool:
        return bool(self._tokens)

    # ----------------------------------------------------------- lifecycle

    async def start(self, address: str = DEFAULT_ADDRESS) -> str:
        """Bind ``address`` (``host:port``, port 0 for any, or ``unix:PATH``) and
        serve. Returns the bound address (with the real port). Raises
        ``ValueError`` for a non-local address without tokens (unless
        ``allow_unauthenticated_remote``) and ``RuntimeError`` when binding fails."""
        if not is_local_address(address) and not self._tokens and not self._allow_remote:
            raise ValueError(f"refusing to serve unauthenticated hints on non-local address {address!r}: "
                             "configure a token (--token-file) or allow it explicitly "
                             "(--allow-unauthenticated-remote)")
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)]
        self._server = grpc.aio.server(options=options)
        _add_service(_Servicer(self), self._server)
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        if self.tls is not None:
            creds = grpc.ssl_server_credentials([(self.tls.private_key, self.tls.cert_chain)])
            port = self._server.add_secure_port(address, creds)
        else:
            port = self._server.add_insecure_port(address)
        if not port:
            raise RuntimeError(f"could not bind hints server to {address!r}")
        await self._server.start()
        for service in (SERVICE_NAME, ""):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self._metrics_request is not None:
            from .metrics import HintMetrics  # prometheus-client only when asked for

            self.metrics = HintMetrics(self.applier, self.rpcs)
            store = self.applier.store
            if store is not None and hasattr(store, "stats") and hasattr(store, "layout"):  # a TieredStore
                from ..metrics import register_store_metrics

                register_store_metrics(store, self.metrics.registry)
            self.metrics_port = self.metrics.serve_http(self._metrics_request, self._metrics_host)
        self._expiry_task = asyncio.get_running_loop().create_task(self._expire_loop())
        self.address = address if address.startswith("unix") else f"{address.rsplit(':', 1)[0]}:{port}"
        return self.address

    async def stop(self, grace_s: float | None = 0.5) -> None:
        """Stop serving (in-flight RPCs get ``grace_s``), the expiry task and the metrics endpoint."""
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            self._expiry_task = None
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self.metrics is not None:
            self.metrics.stop_http()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self._expire_interval_s)
            self.expire_now()

    def expire_now(self) -> int:
        """Expire idle sessions now (the server also does it every ``expire_interval_s``)."""
        gone = self.graph.expire(time.monotonic())
        if self.recorder is not None:
            for s in gone:
                self.recorder.on_session_gone(s.tenant, s.session_id)
        return len(gone)

    # ----------------------------------------------------------- requests

    async def tenant_of(self, context: Any, method: str) -> str:
        """The caller's tenant; aborts UNAUTHENTICATED (auth on) or INVALID_ARGUMENT (bad tenant)."""
        metadata = context.invocation_metadata() or ()
        if self._tokens:
            tenant = None
            for key, value in metadata:
                if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
                    tenant = self._tokens.get(hashlib.sha256(value[7:].strip().encode()).digest())
            if tenant is None:
                self.rpcs[(method, "UNAUTHENTICATED")] += 1
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)
            return tenant  # type: ignore[return-value]
        tenant = DEFAULT_TENANT
        for key, value in metadata:
            if key == TENANT_METADATA and value:
                tenant = value
        if not isinstance(tenant, str) or len(tenant) > self.applier.limits.max_id_bytes:
            self.rpcs[(method, "INVALID_ARGUMENT")] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"metadata {TENANT_METADATA}: must be text of at most "
                                f"HintLimits.max_id_bytes={self.applier.limits.max_id_bytes} characters")
        return tenant

    def apply(self, tenant: str, request: Any, *, skip_invalid: bool) -> BatchResult:
        return self.applier.apply(tenant, request, skip_invalid=skip_invalid, now_s=time.monotonic(),
                                  now_unix_us=time.time_ns() // 1000)

    MAX_VIEW_AGENTS = 65_536
    MAX_VIEW_ROUNDS = 4096

    def agents_view(self, tenant: str) -> Any:
        """The ``AgentsView`` of ``tenant`` now (what ``Watch`` streams). O(its agents)."""
        now = time.monotonic()
        view = pb.AgentsView()
        n = 0
        for s in self.graph.sessions(tenant):
            crit = self.graph.criticalities(tenant, s.session_id, now)
            for aid, a in s.agents.items():
                n += 1
                if n > self.MAX_VIEW_AGENTS:
                    continue
                av = view.agents.add(session_id=s.session_id, agent_id=aid, parent_agent_id=a.parent_id or "",
                                     criticality=float(crit.get(aid, 0.0)), ended=a.ended_s is not None)
                returns = [c.predicted_return_s for c in a.tool_calls.values()]
                if returns:
                    av.tool_call_in_flight = True
                    known = [r for r in returns if r is not None]
                    if known:
                        av.has_prediction = True
                        av.tool_returns_in_s = max(known) - now
        view.num_left_out = max(0, n - self.MAX_VIEW_AGENTS)
        rounds = 0
        for s in self.graph.sessions(tenant):
            for rid, rnd in s.rounds.items():
                rounds += 1
                if rounds <= self.MAX_VIEW_ROUNDS:
                    view.rounds.add(session_id=s.session_id, round_id=rid, agent_ids=rnd.agent_ids)
        return view

    def stats(self, tenant: str, session_id: str = "") -> Any:
        """The ``Stats`` message of ``tenant`` (``None`` when ``session_id`` is unknown to it)."""
        n_sessions, n_agents, n_calls, n_rounds = self.graph.tenant_counts(tenant)
        out = pb.Stats(tenant=tenant, num_sessions=n_sessions, num_agents=n_agents,
                       num_tool_calls_in_flight=n_calls, num_shared_rounds=n_rounds,
                       num_expired_sessions=self.graph.num_expired_sessions)
        t = self.applier.tenants.get(tenant)
        if t is not None:
            out.events_by_type.update(t.events_by_type)
            out.rejections_by_reason.update(t.rejections_by_reason)
            out.commands_by_outcome.update(t.commands_by_outcome)
            out.num_duplicates = t.num_duplicates
        if session_id:
            info = self._session_info(tenant, session_id)
            if info is None:
                return None
            out.session.CopyFrom(info)
        return out

    def _session_info(self, tenant: str, session_id: str) -> Any:
        s = self.graph.session(tenant, session_id)
        if s is None:
            return None
        now = time.monotonic()
        info = pb.SessionInfo(session_id=session_id, age_s=now - s.started_s)
        for a in s.agents.values():
            info.agents.add(agent_id=a.agent_id, parent_agent_id=a.parent_id or "", agent_type=a.agent_type,
                            importance=a.importance, join_group=a.join_group,
                            expected_num_requests=a.expected_num_requests, priority=a.priority, ended=a.ended,
                            num_requests=a.num_requests, num_requests_in_flight=len(a.requests_in_flight),
                            depends_on=sorted(a.depends_on), num_prompt_blocks=len(a.prompt_keys) // 16)
            for c in a.tool_calls.values():
                call = info.tool_calls.add(agent_id=a.agent_id, tool_call_id=c.call_id, tool_name=c.tool_name,
                                           elapsed_s=now - c.started_s)
                if c.predicted_return_s is not None:
                    call.predicted_remaining_s = c.predicted_return_s - now
        for r in s.rounds.values():
            info.shared_rounds.add(round_id=r.round_id, agent_ids=r.agent_ids, num_block_keys=len(r.block_keys) // 16)
        info.critical_path.extend(self.graph.critical_path(tenant, session_id, now))
        return info


class BackgroundHintServer:
    """A :class:`HintServer` on its own thread and event loop, for hosting it inside
    a process that has other work on its main thread (an engine's scheduler).

    ``start(address)`` binds and returns the bound address; :meth:`call` runs a
    function on the server's loop and returns its result (the only safe way to
    read the :class:`AgentGraph` from another thread); :meth:`stop` ends it.
    Keyword arguments go to :class:`HintServer`.
    """

    def __init__(self, **kwargs: Any) -> None:
        self.server = HintServer(**kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: Any = None
        self._stop: asyncio.Event | None = None

    def start(self, address: str = DEFAULT_ADDRESS, timeout_s: float = 30.0) -> str:
        import threading

        started = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                await self.server.start(address)
            except BaseException as err:  # surfaced to start()
                failure.append(err)
                started.set()
                return
            started.set()
            await self._stop.wait()
            await self.server.stop(0.2)

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), name="kvtier-hints", daemon=True)
        self._thread.start()
        if not started.wait(timeout_s):
            raise RuntimeError(f"hint server on {address!r} did not start within {timeout_s} s")
        if failure:
            raise failure[0]
        return str(self.server.address)

    def call(self, fn: Callable[[], Any], timeout_s: float = 5.0) -> Any:
        """``fn()`` run on the server's event loop (between RPCs); its result."""
        if self._loop is None:
            raise RuntimeError("BackgroundHintServer is not started")

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout_s)


def tune_gc_for_serving() -> None:
    """Process-wide GC settings for a process whose main job is the hints server:
    objects alive at start-up are frozen out of collections and young
    collections run every 20,000 net allocations instead of 700, so the cyclic
    collector does not rescan the graph every few batches. Only process entry
    points (``kvtier serve``, the benchmark's server) call it; a library
    embedding :class:`HintServer` keeps its own settings."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


async def serve_forever(server: HintServer, address: str, *, ready: Any = None) -> None:
    """Start ``server`` on ``address`` and serve until cancelled or SIGINT/SIGTERM.

    ``ready``: called with the bound address once serving (the CLI prints it).
    """
    import signal

    bound = await server.start(address)
    if ready is not None:
        ready(bound)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform without signals
            pass
    try:
        await stop.wait()
    finally:
        await server.stop()
        if server.recorder is not None:
            server.recorder.close()
