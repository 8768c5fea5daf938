"""Hint clients for agent frameworks: :class:`HintClient` (a background thread)
and :class:`AsyncHintClient` (an asyncio task).

Owns: the bounded event queue, batching, the wire conversion (protobuf
messages are built on the sender, never in :meth:`emit`), sending with
reconnect and exponential backoff, and the drop accounting. Must never block
the agent beyond one bounded enqueue, and never raise because the server is
slow, down or rejecting: such events are *dropped and counted*
(:attr:`_Emitter.drops`). Caller bugs (an unknown event kind) raise.

A restarted server knows none of the client's sessions. The sender keeps
what it told the server is live (:class:`_LiveState`: sessions, agents,
dependencies, requests and tool calls not yet ended, as of the batches
already taken from the queue) and announces it again, with new event ids,
before its next batch whenever the server may have lost it: after a failed
call, or when a batch comes back with events refused ``unknown_*`` (a
restart between two batches), in which case that batch is sent once more
(event ids make the repeat safe: what was applied is deduplicated).

``emit(kind, **fields)`` is the whole hot path: a dict lookup, an id, a
timestamp and a ``deque.append`` (p99 well under 20 us on the caller thread).
``kind`` is a field name of the ``Signal`` / ``Command`` oneof in
``proto/kvtier/v1/hints.proto`` (``session_start``, ``tool_call_start``,
``pin``, ...); ``fields`` are that message's fields. Block keys may be given
as packed bytes (16 per key), as ints or as 16-byte strings; enum fields
accept the proto name (``"TOOL_STATUS_OK"``), its short form (``"ok"``) or
the number.

>>> client = HintClient("127.0.0.1:1", start=False)   # nothing listens there
>>> client.emit("session_start", session_id="s1")
True
>>> client.stats().queued
1
>>> client.close(timeout_s=0.2)   # cannot deliver: dropped and counted, never raised
>>> client.drops["closed"] + client.drops["unavailable"]
1
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Generator, Iterable, Mapping

import grpc

from ..hints._gen import hints_pb2 as pb
from ..hints._gen import hints_pb2_grpc as pb_grpc
from .handles import AgentHandle, RequestHandle, SessionHandle, ToolCallHandle, current_scope

_log = logging.getLogger("kvtier.sdk")

SIGNAL_KINDS = frozenset(f.name for f in pb.Signal.DESCRIPTOR.oneofs_by_name["kind"].fields)
COMMAND_KINDS = frozenset(f.name for f in pb.Command.DESCRIPTOR.oneofs_by_name["kind"].fields)
_KINDS = SIGNAL_KINDS | COMMAND_KINDS
_KEY_FIELDS = ("prompt_block_keys", "shared_block_keys", "block_keys")
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                        grpc.StatusCode.INTERNAL})
_DROP_REASONS = ("queue_full", "unavailable", "invalid", "unauthenticated", "rejected_batch", "closed")


def _enum_prefixes() -> dict[str, dict[str, str]]:
    """kind -> {enum field -> NAME_PREFIX_} for short enum names ("ok" -> "TOOL_STATUS_OK")."""
    out: dict[str, dict[str, str]] = {}
    for holder in (pb.Signal, pb.Command):
        for f in holder.DESCRIPTOR.oneofs_by_name["kind"].fields:
            for sub in f.message_type.fields:
                if sub.enum_type is not None:
                    first = sub.enum_type.values[0].name  # e.g. TOOL_STATUS_UNSPECIFIED
                    out.setdefault(f.name, {})[sub.name] = first[: -len("UNSPECIFIED")]
    return out


_ENUM_PREFIX = _enum_prefixes()


def _field_types() -> dict[str, dict[str, tuple[type, ...]]]:
    """kind -> {field name -> Python types emit accepts for it} (from the proto)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    numeric = {F.TYPE_DOUBLE, F.TYPE_FLOAT}
    integer = {F.TYPE_INT32, F.TYPE_INT64, F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_SINT32, F.TYPE_SINT64,
               F.TYPE_FIXED32, F.TYPE_FIXED64, F.TYPE_SFIXED32, F.TYPE_SFIXED64}
    out: dict[str, dict[str, tuple[type, ...]]] = {}
    for holder in (pb.Signal, pb.Command):
        for f in holder.DESCRIPTOR.oneofs_by_name["kind"].fields:
            fields: dict[str, tuple[type, ...]] = {}
            for sub in f.message_type.fields:
                repeated = getattr(sub, "is_repeated", None)
                if repeated is None:  # older protobuf
                    repeated = sub.label == F.LABEL_REPEATED
                if sub.name in _KEY_FIELDS:
                    fields[sub.name] = (bytes, bytearray, memoryview, list, tuple)
                elif repeated:  # e.g. a shared round's agent_ids
                    fields[sub.name] = (list, tuple)
                elif sub.enum_type is not None:
                    fields[sub.name] = (str, int)
                elif sub.type in numeric:
                    fields[sub.name] = (int, float)
                elif sub.type in integer:
                    fields[sub.name] = (int,)
                elif sub.type == F.TYPE_BOOL:
                    fields[sub.name] = (bool,)
                elif sub.type == F.TYPE_STRING:
                    fields[sub.name] = (str,)
                elif sub.type == F.TYPE_BYTES:
                    fields[sub.name] = (bytes, bytearray)
                else:
                    fields[sub.name] = (object,)
            out[f.name] = fields
    return out


_FIELD_TYPES = _field_types()


def _check_fields(kind: str, fields: dict[str, Any]) -> None:
    """Raise ``TypeError`` for a field ``kind`` does not have or a value of the wrong type
    (a caller bug: such an event would only be dropped later)."""
    spec = _FIELD_TYPES[kind]
    for name, value in fields.items():
        types = spec.get(name)
        if types is None:
            raise TypeError(f"hint event {kind!r} has no field {name!r}; its fields: {', '.join(spec)}")
        if value is None:  # not given (protobuf leaves the field unset)
            continue
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise TypeError(f"hint event {kind!r}: field {name!r} takes {' or '.join(t.__name__ for t in types)}, "
                            f"got {type(value).__name__} {value!r}")


def pack_keys(keys: bytes | Iterable[int | bytes]) -> bytes:
    """Block keys as the wire wants them: 16 big-endian bytes each, concatenated."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        return bytes(keys)
    return b"".join(k if isinstance(k, (bytes, bytearray)) else int(k).to_bytes(16, "big") for k in keys)


def _normalise(kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    for name in _KEY_FIELDS:
        value = fields.get(name)
        if value is not None and not isinstance(value, bytes):
            fields[name] = pack_keys(value)
    prefixes = _ENUM_PREFIX.get(kind)
    if prefixes:
        for name, prefix in prefixes.items():
            value = fields.get(name)
            if isinstance(value, str) and not value.startswith(prefix):
                fields[name] = prefix + value.upper()
    return fields


@dataclass(frozen=True, slots=True)
class ClientStats:
    """A snapshot of a client's counters.

    ``emitted``: events accepted by :meth:`emit`; ``accepted`` /
    ``duplicates`` / ``rejected``: what the server said about delivered
    events; ``dropped``: by reason (``queue_full``, ``unavailable`` after
    retries, ``invalid`` (could not be encoded), ``unauthenticated``,
    ``rejected_batch``, ``closed``); ``queued``: waiting to be sent.
    """

    emitted: int
    accepted: int
    duplicates: int
    rejected: int
    dropped: Mapping[str, int]
    queued: int
    batches_sent: int
    reconnects: int
    connected: bool
    last_error: str
    rejected_by_reason: Mapping[str, int] = None  # type: ignore[assignment]
    reannounced_sessions: int = 0  # sessions announced again to a server that had lost them
    failed_calls: int = 0  # Publish calls that failed (each retry counts)

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())


_LOST_STATE = ("unknown_session", "unknown_agent", "unknown_request", "unknown_tool_call")
_OPENS = {"request_start": ("requests", "request_id"), "tool_call_start": ("calls", "tool_call_id")}
_CLOSES = {"request_end": ("requests", "request_id"), "tool_call_end": ("calls", "tool_call_id")}


class _LiveState:
    """What the client has told the server is live, by session, in announcement
    order: its start, agents (parents before children), dependencies, requests
    and tool calls in flight. At most ``max_sessions`` sessions, the most
    recently started (a server limits sessions per client too); events the
    server refused are left out."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def apply(self, items: list[tuple[str, int, int, dict[str, Any]]], refused: set[int] = frozenset()) -> None:
        for kind, eid, ts, fields in items:
            sid = fields.get("session_id")
            if not isinstance(sid, str) or eid in refused:
                continue
            if kind == "session_start":
                self.sessions[sid] = {"start": (ts, dict(fields)), "agents": {}, "deps": [], "requests": {},
                                      "calls": {}}
                self.sessions.move_to_end(sid)
                while len(self.sessions) > self.max_sessions:
                    self.sessions.popitem(last=False)
                continue
            s = self.sessions.get(sid)
            if s is None:
                continue
            if kind == "session_end":
                del self.sessions[sid]
            elif kind == "agent_spawn":
                s["agents"][fields.get("agent_id")] = (ts, dict(fields))
            elif kind == "agent_end":
                aid = fields.get("agent_id")
                s["agents"].pop(aid, None)
                for group in ("requests", "calls"):
                    s[group] = {k: v for k, v in s[group].items() if v[1].get("agent_id") != aid}
            elif kind == "dependency":
                s["deps"].append((ts, dict(fields)))
            elif kind in _OPENS:
                group, key = _OPENS[kind]
                s[group][fields.get(key)] = (ts, dict(fields))
            elif kind in _CLOSES:
                group, key = _CLOSES[kind]
                s[group].pop(fields.get(key), None)

    def announcements(self) -> list[tuple[str, int, dict[str, Any]]]:
        """(kind, original client time, fields) that rebuild every live session."""
        out = []
        for s in self.sessions.values():
            out.append(("session_start", *s["start"]))
            live = s["agents"]
            out += [("agent_spawn", ts, f) for ts, f in live.values()]
            out += [("dependency", ts, f) for ts, f in s["deps"]
                    if f.get("from_agent_id") in live and f.get("to_agent_id") in live]
            out += [("request_start", ts, f) for ts, f in s["requests"].values()]
            out += [("tool_call_start", ts, f) for ts, f in s["calls"].values()]
        return out


class _Emitter:
    """The queue, ``emit``, the connection settings and the helpers shared by both clients
    (the arguments are :class:`HintClient`'s; a client sets up its transport in ``_init_transport``)."""

    MAX_ANNOUNCED_SESSIONS = 256
    """Live sessions a client announces again to a restarted server (the most recent)."""

    def __init__(self, target: str = "127.0.0.1:50051", *, token: str | None = None, tenant: str | None = None,
                 tls: bool = False, root_certificates: bytes | None = None, tls_server_name: str | None = None,
                 client_id: str | None = None, max_queue_events: int = 65_536, batch_max_events: int = 512,
                 flush_interval_s: float = 0.005, rpc_timeout_s: float = 5.0, backoff_initial_s: float = 0.05,
                 backoff_max_s: float = 2.0, max_batch_attempts: int = 3) -> None:
        if max_queue_events <= 0 or batch_max_events <= 0 or flush_interval_s <= 0:
            raise ValueError("max_queue_events, batch_max_events and flush_interval_s must be > 0")
        self.client_id = client_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._queue: deque[tuple[str, int, int, dict[str, Any]]] = deque()
        self._max_queue = max_queue_events
        self._batch_max = batch_max_events
        self._flush_interval_s = flush_interval_s
        self._first_id = secrets.randbits(62) + 1
        self._ids = itertools.count(self._first_id)
        self._counts_lock = threading.Lock()
        self.drops: Counter[str] = Counter({reason: 0 for reason in _DROP_REASONS})
        self._accepted = self._duplicates = self._rejected = self._batches = self._reconnects = 0
        self._connected = False
        self._last_error = ""
        self._in_flight = 0
        self.last_rejections: deque[Any] = deque(maxlen=16)
        self._rejected_by_reason: Counter[str] = Counter()
        self._live = _LiveState(self.MAX_ANNOUNCED_SESSIONS)  # sender side only
        self._refused: set[int] = set()  # event ids of the batch in flight that the server refused
        self._announce_needed = False  # the server may have lost the live state (a failed call, a new connection)
        self._reannounced = 0
        self._failed_calls = 0
        self._was_ready = False
        self.target = target
        self._md = self._metadata(token, tenant)
        self._tls = (tls or root_certificates is not None, root_certificates, tls_server_name)
        self._rpc_timeout_s = rpc_timeout_s
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._next_backoff_s = backoff_initial_s
        self._max_attempts = max(1, max_batch_attempts)
        self._channel: Any = None
        self._init_transport()

    def _init_transport(self) -> None:
        """The client's own sending state (a thread's, or a task's)."""
        raise NotImplementedError

    # ----------------------------------------------------------- hot path

    def emit(self, kind: str, **fields: Any) -> bool:
        """Queue one event; ``False`` (and counted in ``drops["queue_full"]``) when
        the queue is full. Never blocks, never raises for server trouble;
        raises ``ValueError`` for an unknown ``kind`` and ``TypeError`` for a
        field that ``kind`` does not have or a value of the wrong type."""
        if kind not in _KINDS:
            raise ValueError(f"unknown hint event kind {kind!r}; valid: {', '.join(sorted(_KINDS))}")
        _check_fields(kind, fields)
        queue = self._queue
        if len(queue) >= self._max_queue:
            self._count_drop("queue_full", 1)
            return False
        queue.append((kind, next(self._ids), time.time_ns() // 1000, fields))
        if len(queue) == self._batch_max:
            self._wake()
        return True

    def _wake(self) -> None:
        raise NotImplementedError

    # ----------------------------------------------------------- accounting

    def _count_drop(self, reason: str, n: int, error: str = "") -> None:
        with self._counts_lock:
            first = self.drops[reason] == 0
            self.drops[reason] += n
            if error:
                self._last_error = error
        if first and reason not in ("closed",):
            _log.warning("kvtier hints to %s: dropping events (%s)%s; counted in stats().dropped, further drops of "
                         "this reason are not logged", self.target, reason, f": {error}" if error else "")

    def stats(self) -> ClientStats:
        """Counters now (see :class:`ClientStats`)."""
        with self._counts_lock:
            emitted = next(self._ids) - self._first_id  # the probe id is never used
            self._first_id += 1
            return ClientStats(emitted, self._accepted, self._duplicates, self._rejected, dict(self.drops),
                               len(self._queue), self._batches, self._reconnects, self._connected,
                               self._last_error, dict(self._rejected_by_reason), self._reannounced,
                               self._failed_calls)

    # ----------------------------------------------------------- batches

    def _take_batch(self) -> list[tuple[str, int, int, dict[str, Any]]]:
        """Pop up to one batch. ``_in_flight`` is raised *before* popping, so a
        concurrent ``flush`` never sees an empty queue and nothing in flight
        while a batch is on its way."""
        queue, items = self._queue, []
        n = min(self._batch_max, len(queue))
        self._in_flight = n
        popleft = queue.popleft
        for _ in range(n):
            items.append(popleft())
        return items

    def _build(self, items: list[tuple[str, int, int, dict[str, Any]]]) -> tuple[Any, int]:
        """The ``PublishRequest`` of ``items`` and how many of them it holds (bad ones are dropped)."""
        req = pb.PublishRequest(client_id=self.client_id, skip_invalid=True)
        add_signal, add_command = req.signals.add, req.commands.add
        n = 0
        for kind, eid, ts, fields in items:
            container = req.commands if kind in COMMAND_KINDS else req.signals
            before = len(container)
            try:
                (add_command if kind in COMMAND_KINDS else add_signal)(
                    event_id=eid, client_time_unix_us=ts, **{kind: _normalise(kind, fields)})
                n += 1
            except (TypeError, ValueError, AttributeError) as err:  # protobuf's errors for bad fields
                del container[before:]  # a half-built entry, if any
                self._count_drop("invalid", 1, f"{kind}: {err}")
        return req, n

    def _on_response(self, resp: Any) -> None:
        with self._counts_lock:
            if not self._connected and self._batches:
                self._reconnects += 1
            self._connected = True
            self._last_error = ""
            self._batches += 1
            self._accepted += resp.num_accepted
            self._duplicates += resp.num_duplicates
            self._rejected += resp.num_rejected
            self.last_rejections.extend(resp.rejections)
            listed = 0
            for rej in resp.rejections:
                self._rejected_by_reason[rej.reason] += 1
                self._refused.add(rej.event_id)
                listed += 1
            if resp.num_rejected > listed:
                self._rejected_by_reason["unlisted"] += resp.num_rejected - listed

    def _lost_state(self, resp: Any) -> bool:
        """Did the server refuse events for not knowing a live session (a restart)?"""
        return bool(self._live.sessions) and any(r.reason in _LOST_STATE for r in resp.rejections)

    def _announcements(self) -> list[Any]:
        """Batches that announce every live session again (new event ids, original
        times; ``announce``: what the server still has counts as a duplicate)."""
        items = [(kind, next(self._ids), ts, dict(fields)) for kind, ts, fields in self._live.announcements()]
        out = []
        for i in range(0, len(items), self._batch_max):
            req, n = self._build(items[i: i + self._batch_max])
            if n:
                req.announce = True
                out.append(req)
        return out

    def _track(self, items: list[tuple[str, int, int, dict[str, Any]]]) -> None:
        """After a batch was sent or dropped: what the caller said is live now
        (less what the server refused)."""
        self._live.apply(items, self._refused)
        self._refused = set()

    def _on_channel_state(self, state: Any) -> None:
        """Channel connectivity (grpc's thread): once connected, any later state but
        READY means the connection went away; the server behind the next one may
        have restarted, so the live state is announced before the next batch."""
        if state == grpc.ChannelConnectivity.READY:
            self._was_ready = True
        elif self._was_ready:
            self._was_ready = False
            self._announce_needed = True

    def _classify_failure(self, err: Any) -> str | None:
        """``None`` when the batch should be retried, else the drop reason."""
        code = err.code() if hasattr(err, "code") else None
        self._failed_calls += 1
        with self._counts_lock:
            self._last_error = f"{code}: {err.details() if hasattr(err, 'details') else err}"
        if code in _RETRYABLE:
            self._connected = False
            return None
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return "unauthenticated"
        return "rejected_batch"

    def _closing_soon(self) -> bool:
        """The client is closing: a failed batch is not retried (each client says how)."""
        raise NotImplementedError

    def _send_steps(self, req: Any, n: int) -> Generator[Any, Any, None]:
        """The delivery of one batch of ``n`` events, free of I/O, for both clients.

        Yields a message to publish (the driver sends back the response, or the
        ``grpc.RpcError`` the call raised) or a float, seconds to back off before the
        next try (the driver sends back ``None``). The live state is announced first
        when the server may have lost it; a failure is retried ``max_batch_attempts``
        times with jittered exponential backoff unless it is final or the client is
        closing; a server found restarted between two batches gets the announcement
        and this batch once more, without using up an attempt."""
        announced_for_it = False
        attempt = 0
        while attempt < self._max_attempts:
            attempt += 1
            out: Any = None
            if self._announce_needed and self._live.sessions:
                for ann in self._announcements():
                    out = yield ann
                    if isinstance(out, grpc.RpcError):
                        break
                else:
                    self._reannounced += len(self._live.sessions)
                    self._announce_needed = False
            if not isinstance(out, grpc.RpcError):
                out = yield req
            if isinstance(out, grpc.RpcError):
                reason = self._classify_failure(out)
                if reason is not None:
                    self._count_drop(reason, n)
                    return
                last = attempt == self._max_attempts or self._closing_soon()
                if last:
                    self._count_drop("unavailable", n)
                yield self._backoff_s()
                if last:
                    return
                continue
            if not announced_for_it and self._lost_state(out):  # restarted between two batches
                announced_for_it = self._announce_needed = True
                attempt -= 1
                continue  # announce, then this batch once more (applied events are deduplicated)
            self._on_response(out)
            self._next_backoff_s = self._backoff[0]
            return

    def _backoff_s(self) -> float:
        """The next backoff: the current one with jitter 0.5x..1.5x; the one after it doubles."""
        delay = self._next_backoff_s * (0.5 + secrets.randbelow(1000) / 1000)
        self._next_backoff_s = min(self._backoff[1], self._next_backoff_s * 2)
        return delay

    def _metadata(self, token: str | None, tenant: str | None) -> tuple[tuple[str, str], ...]:
        md = []
        if token:
            md.append(("authorization", f"Bearer {token}"))
        if tenant:
            md.append(("x-kvtier-tenant", tenant))
        return tuple(md)

    # ----------------------------------------------------------- helpers

    def session(self, session_id: str | None = None, *, model: str = "") -> SessionHandle:
        """A session handle; ``with`` starts and ends it and makes it current."""
        return SessionHandle(self, session_id or secrets.token_hex(8), model)

    def agent(self, agent_type: str = "", *, agent_id: str | None = None, session_id: str | None = None,
              parent_id: str | None = "", importance: str | int = 0, join_group: str = "",
              expected_num_requests: int = 0) -> AgentHandle:
        """An agent of the current (or given) session; its parent defaults to the
        current agent (``parent_id=None`` forces a root). ``with`` spawns it,
        makes it current and ends it (``failed`` on an exception)."""
        scope = current_scope(self)
        sid = session_id or (scope.session_id if scope else None)
        if not sid:
            raise RuntimeError("no current session: use `with client.session(...)` or pass session_id=")
        if parent_id == "":
            parent_id = scope.agent_id if scope and scope.session_id == sid else None
        return AgentHandle(self, sid, agent_id or f"{agent_type or 'agent'}-{secrets.token_hex(4)}", parent_id,
                           agent_type, importance, join_group, expected_num_requests)

    def tool_call(self, tool_name: str, *, expected_s: float | None = None,
                  tool_call_id: str | None = None) -> ToolCallHandle:
        """``with client.tool_call("bash", expected_s=3.0): ...`` on the current agent."""
        return self._current_agent("tool_call").tool_call(tool_name, expected_s=expected_s, tool_call_id=tool_call_id)

    def request(self, request_id: str | None = None, **kwargs: Any) -> RequestHandle:
        """``with client.request(prompt_block_keys=keys) as r: ...`` on the current agent."""
        return self._current_agent("request").request(request_id, **kwargs)

    def _current_agent(self, what: str) -> AgentHandle:
        scope = current_scope(self)
        if scope is None or scope.agent is None:
            raise RuntimeError(f"client.{what}() needs a current agent: use `with client.agent(...)`")
        return scope.agent


class HintClient(_Emitter):
    """Sends hints from a daemon thread. ``target``: ``host:port`` or ``unix:PATH``.

    ``token``: bearer token (auth on the server); ``tenant``: tenant metadata
    (auth off). ``tls``/``root_certificates``: TLS (PEM roots; ``None`` for
    the system roots). Batches of up to ``batch_max_events`` leave at least
    every ``flush_interval_s``; a failed batch is retried up to
    ``max_batch_attempts`` times with exponential backoff
    (``backoff_initial_s`` doubling to ``backoff_max_s``), then dropped.
    """

    def __init__(self, target: str = "127.0.0.1:50051", *, start: bool = True, **settings: Any) -> None:
        """``settings``: the keywords above (``token`` ... ``max_batch_attempts``); ``start=False``
        leaves the sender thread to :meth:`start`."""
        super().__init__(target, **settings)
        if start:
            self.start()

    def _init_transport(self) -> None:
        self._wake_event = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self._closing_now = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Open the channel and start the sender thread (done by the constructor unless ``start=False``)."""
        if self._thread is not None:
            return
        self._channel = open_channel(self.target, *self._tls, aio=False)
        self._channel.subscribe(self._on_channel_state, try_to_connect=False)
        self._publish = pb_grpc.HintServiceStub(self._channel).Publish
        self._thread = threading.Thread(target=self._run, name=f"kvtier-hints-{self.client_id}", daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        self._wake_event.set()

    def _run(self) -> None:
        while True:
            self._wake_event.wait(self._flush_interval_s)
            self._wake_event.clear()
            while self._queue and not self._closing_now:
                items = self._take_batch()
                req, n = self._build(items)
                if n:
                    self._send(req, n)
                self._track(items)
                with self._idle:
                    self._in_flight = 0
                    self._idle.notify_all()
            if self._stop.is_set():
                return

    def _call(self, req: Any) -> Any:
        """One Publish; ``None`` after a failure that was counted for retrying."""
        try:
            return self._publish(req, timeout=self._rpc_timeout_s, metadata=self._md)
        except grpc.RpcError as err:
            if (err.code() if hasattr(err, "code") else None) in _RETRYABLE:  # the server may be new after it
                self._announce_needed = True
            raise

    def _closing_soon(self) -> bool:
        return self._closing_now

    def _send(self, req: Any, n: int) -> None:
        steps = self._send_steps(req, n)
        out: Any = None
        while True:
            try:
                step = steps.send(out)
            except StopIteration:
                return
            if isinstance(step, float):
                self._stop.wait(step)
                out = None
                continue
            try:
                out = self._call(step)
            except grpc.RpcError as err:
                out = err

    def _server_down(self) -> bool:
        """The last call failed and none succeeded since (waiting for it would only wait out retries)."""
        return not self._connected and bool(self._last_error)

    def flush(self, timeout_s: float = 5.0, *, give_up_when_down: bool = False) -> bool:
        """Wait until everything queued so far was sent (or dropped); ``False`` on timeout
        (or, with ``give_up_when_down``, as soon as the server is found down)."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._queue or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                if give_up_when_down and self._server_down():
                    return False
                self._wake_event.set()
                self._idle.wait(min(left, 0.05))
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush for up to ``timeout_s`` (not waiting out retries when the server is
        down), stop the thread, close the channel. Events still queued are dropped
        as ``closed``."""
        if self._thread is not None:
            self.flush(timeout_s, give_up_when_down=True)
            self._closing_now = True
            self._stop.set()
            self._wake_event.set()
            self._thread.join(timeout=max(1.0, timeout_s))
            self._thread = None
        left = len(self._queue)
        self._queue.clear()
        if left:
            self._count_drop("closed", left)
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def __enter__(self) -> HintClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncHintClient(_Emitter):
    """The asyncio twin of :class:`HintClient` (same arguments and helpers).

    ``emit`` stays synchronous and non-blocking; sending runs in a task on
    the loop that called :meth:`start` (``async with`` starts it). ``emit``
    may also be called from other threads.
    """

    def _init_transport(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_event: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._closing = False

    async def start(self) -> None:
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wake_event = asyncio.Event()
        self._channel = open_channel(self.target, *self._tls, aio=True)
        self._publish = pb_grpc.HintServiceStub(self._channel).Publish
        self._task = self._loop.create_task(self._run())
        self._watch_task = self._loop.create_task(self._watch_channel())

    async def _watch_channel(self) -> None:
        channel = self._channel
        state = channel.get_state(try_to_connect=False)
        while not self._closing and channel is self._channel:
            self._on_channel_state(state)
            await channel.wait_for_state_change(state)
            state = channel.get_state(try_to_connect=False)

    def _wake(self) -> None:
        loop, event = self._loop, self._wake_event
        if loop is None or event is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
        else:
            loop.call_soon_threadsafe(event.set)

    async def _run(self) -> None:
        assert self._wake_event is not None
        while True:
            try:
                await asyncio.wait_for(self._wake_event.wait(), self._flush_interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake_event.clear()
            while self._queue:
                items = self._take_batch()
                req, n = self._build(items)
                if n:
                    await self._send(req, n)
                self._track(items)
                self._in_flight = 0
            if self._closing:
                return

    async def _call(self, req: Any) -> Any:
        try:
            return await self._publish(req, timeout=self._rpc_timeout_s, metadata=self._md)
        except grpc.RpcError as err:
            if (err.code() if hasattr(err, "code") else None) in _RETRYABLE:  # the server may be new after it
                self._announce_needed = True
            raise

    def _closing_soon(self) -> bool:
        return self._closing

    async def _send(self, req: Any, n: int) -> None:
        steps = self._send_steps(req, n)
        out: Any = None
        while True:
            try:
                step = steps.send(out)
            except StopIteration:
                return
            if isinstance(step, float):
                if not self._closing:
                    await asyncio.sleep(step)
                out = None
                continue
            try:
                out = await self._call(step)
            except grpc.RpcError as err:
                out = err

    async def flush(self, timeout_s: float = 5.0, *, give_up_when_down: bool = False) -> bool:
        """Wait until everything queued so far was sent (or dropped); ``False`` on timeout
        (or, with ``give_up_when_down``, as soon as the server is found down)."""
        deadline = time.monotonic() + timeout_s
        while self._queue or self._in_flight:
            if time.monotonic() >= deadline or self._task is None or self._task.done():
                return False
            if give_up_when_down and not self._connected and self._last_error:
                return False
            self._wake()
            await asyncio.sleep(0.002)
        return True

    async def close(self, timeout_s: float = 5.0) -> None:
        """Flush for up to ``timeout_s`` (not waiting out retries when the server is down),
        stop the task, close the channel; leftovers drop as ``closed``."""
        if self._task is not None:
            await self.flush(timeout_s, give_up_when_down=True)
            self._closing = True
            self._wake()
            try:
                await asyncio.wait_for(self._task, max(1.0, timeout_s))
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            self._task = None
        if self._watch_task is not None:
            self._watch_task.cancel()
            self._watch_task = None
        left = len(self._queue)
        self._queue.clear()
        if left:
            self._count_drop("closed", left)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> AsyncHintClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
    ("grpc.max_send_message_length", 16 << 20),
)


def open_channel(target: str, tls: bool, roots: bytes | None, server_name: str | None, *, aio: bool) -> Any:
    options = list(_CHANNEL_OPTIONS)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    mod: Any = grpc.aio if aio else grpc
    if tls:
        return mod.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=roots), options=options)
    return mod.insecure_channel(target, options=options)
