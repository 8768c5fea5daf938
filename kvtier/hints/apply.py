"""HintApplier: validates published hint batches and applies them to an AgentGraph.

Owns: per-event validation (missing or over-long ids, unknown enum values,
bad block-key lengths, oversize batches, timestamps far in the future, bad
durations and TTLs), the per-tenant events-per-second limit (a
:class:`TokenBucket` per tenant), idempotency by ``(tenant, event_id)`` within a bounded
dedupe window, the per-tenant counters behind ``GetStats`` and Prometheus,
and applying commands (pin / unpin / prefetch) to a
:class:`~kvtier.store.TieredStore` when one is given (else refusing them,
reason ``no_store``, with a message that says why: never dropped silently).

Must not import grpc (the server maps a :class:`Rejected` to a status code)
and must not block: it runs on the server's event loop. Memory is bounded by
:class:`HintLimits` and the graph's :class:`~kvtier.agents.GraphLimits`.

Field names in rejections are paths into the ``PublishRequest``:
``signals[3].agent_spawn.agent_id``, ``commands[0].pin.ttl_s``.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..agents.graph import AgentGraph, Refusal
from ..keys import mix64
from ._gen import hints_pb2 as pb

KEY_BYTES = 16
NO_STORE = ("this hint server has no store for block-key commands (start it with `kvtier serve --store`, "
            "or host it with a TieredStore)")
"""Why pin / unpin / prefetch are refused by a hint server without a store (never dropped silently)."""


@dataclass(frozen=True, slots=True)
class HintLimits:
    """Bounds on what one batch may carry and on the server's own memory.

    ``max_tenants``: tenants ever seen (their counters are kept for metrics).
    With auth on, tenants come from the token file and stay few; without auth
    any caller can name a tenant, so the table can fill up and new tenants are
    refused (RESOURCE_EXHAUSTED) — run unauthenticated only for trusted,
    local callers.

    ``max_events_per_s_per_tenant``: each tenant's sustained event rate
    (signals plus commands, duplicates included), with bursts of up to one
    second's worth; ``None`` (the default): no limit. Tenants have separate
    budgets, so one tenant over its limit never slows another. Events over it
    are refused with reason ``rate_limited`` (see :meth:`HintApplier.apply`).

    ``max_pinned_blocks_per_tenant``: blocks one tenant may hold pinned in the
    store at once (over it a pin is refused, ``pin_refused_tenant_budget``),
    so one tenant cannot take the store's whole pin budget."""

    max_batch_events: int = 4_096
    max_block_keys_per_event: int = 65_536
    max_id_bytes: int = 256
    max_future_skew_s: float = 300.0
    max_expected_duration_s: float = 7 * 86_400.0
    max_pin_ttl_s: float = 3_600.0
    dedupe_window_events: int = 1 << 18
    max_tenants: int = 1_024
    max_events_per_s_per_tenant: float | None = None
    max_pinned_blocks_per_tenant: int = 65_536

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name == "max_events_per_s_per_tenant" and value is None:
                continue
            if not (isinstance(value, (int, float)) and value > 0 and value < float("inf")):
                raise ValueError(f"HintLimits.{name}={value!r}: must be a finite number > 0")


@dataclass(frozen=True, slots=True)
class Rejected:
    """One event not applied: ``field`` is its path in the request, ``reason``
    a short code (``missing``, ``too_long``, ``unknown_enum``, ``bad_value``,
    ``future``, ``oversize_batch``, ``limit``, ``rate_limited`` or a graph
    refusal reason). ``num_events``: how many events it stands for (1, or the
    whole refused tail of a batch for ``rate_limited``)."""

    event_id: int
    field: str
    reason: str
    message: str
    num_events: int = 1

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass(slots=True)
class BatchResult:
    """What one batch did. ``rejections``: the first 16, plus a ``rate_limited``
    one if any (``num_rejected`` counts all). ``stopped``: the rejection that
    ended a strict batch; a batch-level error (``batch_error`` True: oversize
    batch, too many tenants) that rejected every event whatever
    ``skip_invalid`` said; or the rate limit (reason ``rate_limited``), which
    refused the batch's last ``stopped.num_events`` events whatever
    ``skip_invalid`` said (the events before them were applied)."""

    num_accepted: int = 0
    num_duplicates: int = 0
    num_rejected: int = 0
    rejections: list[Rejected] = field(default_factory=list)
    stopped: Rejected | None = None
    batch_error: bool = False


@dataclass(slots=True)
class TenantStats:
    """Counters of one tenant (read by GetStats and the metrics collector)."""

    index: int
    events_by_type: Counter[str] = field(default_factory=Counter)
    rejections_by_reason: Counter[str] = field(default_factory=Counter)
    commands_by_outcome: Counter[str] = field(default_factory=Counter)
    num_duplicates: int = 0


class TokenBucket:
    """One tenant's event budget: refills at ``rate_per_s`` up to one second's
    worth (at least 1 event). Clock-free: callers pass a monotonic ``now_s``.
    O(1) per call.

    >>> bucket = TokenBucket(rate_per_s=10.0, now_s=0.0)
    >>> bucket.take(15, now_s=0.0), bucket.take(8, now_s=0.5), bucket.take(8, now_s=60.0)
    (10, 5, 8)
    """

    __slots__ = ("_last_s", "_tokens", "capacity", "rate_per_s")

    def __init__(self, rate_per_s: float, now_s: float) -> None:
        self.rate_per_s = rate_per_s
        self.capacity = max(1.0, rate_per_s)
        self._tokens = self.capacity
        self._last_s = now_s

    def take(self, num_events: int, now_s: float) -> int:
        """Spend up to ``num_events`` whole tokens; returns how many were granted."""
        if now_s > self._last_s:
            self._tokens = min(self.capacity, self._tokens + (now_s - self._last_s) * self.rate_per_s)
            self._last_s = now_s
        granted = min(num_events, int(self._tokens))
        self._tokens -= granted
        return granted

    def wait_s(self, num_events: int) -> float:
        """Seconds until ``num_events`` (at most ``capacity``) tokens are available."""
        return max(0.0, min(num_events, self.capacity) - self._tokens) / self.rate_per_s


class CommandSink(Protocol):
    """What commands need of a store (``TieredStore`` satisfies it)."""

    def pin(self, keys: list[Any], ttl_s: float | None = None) -> int | None: ...
    def unpin(self, keys: list[Any]) -> None: ...
    def prefetch(self, keys: list[Any], tier: str = "dram") -> Any: ...


class SignalListener(Protocol):
    """Sees every applied event (the recorder). Called on the event loop; must be quick."""

    def on_event(self, tenant: str, kind: str, event: Any, now_s: float) -> None: ...


def _dedupe_tenant_key(index: int) -> int:
    """The high bits of a tenant's dedupe keys (``key | event_id``, event ids
    below ``2**64``). Not ``index << 64``: Python hashes an int modulo
    ``2**61 - 1``, where ``2**64`` is 8, so tenant ``i``'s event ``e`` would
    collide with tenant ``i + 1``'s event ``e - 8`` and, with sequential event
    ids, every probe of the dedupe set would walk one entry per tenant.
    :func:`~kvtier.keys.mix64` is a bijection: tenants never share keys."""
    return mix64(index) << 64


_IMPORTANCE = frozenset(pb.Importance.values())
_PRIORITY = frozenset(pb.Priority.values()) - {pb.PRIORITY_UNSPECIFIED}
_TOOL_STATUS = frozenset(pb.ToolStatus.values())
_AGENT_STATUS = frozenset(pb.AgentStatus.values())
_STOP = frozenset(pb.StopReason.values())
_TIER_NAMES = {pb.TIER_UNSPECIFIED: "dram", pb.TIER_HBM: "hbm", pb.TIER_DRAM: "dram", pb.TIER_SSD: "ssd"}
SIGNAL_KINDS: tuple[str, ...] = tuple(f.name for f in pb.Signal.DESCRIPTOR.oneofs_by_name["kind"].fields)
COMMAND_KINDS: tuple[str, ...] = tuple(f.name for f in pb.Command.DESCRIPTOR.oneofs_by_name["kind"].fields)


def _missing(name: str) -> Refusal:
    return Refusal("missing", name, "missing (must be non-empty)")


def _bad_enum(name: str, value: int, enum: Any) -> Refusal:
    valid = ", ".join(f"{n}={v}" for n, v in enum.items())
    return Refusal("unknown_enum", name, f"unknown enum value {value}; valid: {valid}")


def keys_of(raw: bytes) -> list[int]:
    """Block keys (ints) of concatenated 16-byte big-endian keys."""
    return [int.from_bytes(raw[i : i + KEY_BYTES], "big") for i in range(0, len(raw), KEY_BYTES)]


class HintApplier:
    """Validate-and-apply of hint batches for many tenants over one graph.

    ``clock``-free: callers pass ``now_s`` (monotonic, for the graph) and
    ``now_unix_us`` (wall clock, to judge client timestamps). Not thread-safe.
    """

    def __init__(self, graph: AgentGraph | None = None, limits: HintLimits | None = None, *,
                 store: CommandSink | None = None, listener: SignalListener | None = None,
                 no_store: str = NO_STORE) -> None:
        self.graph = graph or AgentGraph()
        self.limits = limits or HintLimits()
        self.store = store
        self.no_store = no_store  # why pin / unpin / prefetch are refused without a store
        self.listener = listener
        self.tenants: dict[str, TenantStats] = {}
        self._buckets: dict[str, TokenBucket] = {}  # tenant -> budget, when rate-limited
        self._max_key_bytes = self.limits.max_block_keys_per_event * KEY_BYTES
        self._max_id = self.limits.max_id_bytes
        self._seen: set[int] = set()
        self._seen_order: deque[int] = deque()
        # Pins are owned: key -> {tenant: expiry (now_s clock)}, with a heap to lapse
        # them. An unpin releases only the caller's own pins, and the store's pin
        # only once no other tenant holds one (pins of a shared store must not let
        # one tenant expose another's blocks to eviction).
        self._pin_owners: dict[int, dict[str, float]] = {}
        self._pin_counts: dict[str, int] = {}
        self._pin_expiry: list[tuple[float, int, str]] = []
        self._signal: dict[str, Callable[[str, Any, float, str], Refusal | None]] = {
            kind: getattr(self, f"_s_{kind}") for kind in SIGNAL_KINDS
        }
        self._command: dict[str, Callable[[str, Any, float, TenantStats], Refusal | None]] = {
            kind: getattr(self, f"_c_{kind}") for kind in COMMAND_KINDS
        }

    # ----------------------------------------------------------------- batches

    def tenant_stats(self, tenant: str) -> TenantStats | None:
        """The tenant's counters; ``None`` when it is new and ``max_tenants`` is reached."""
        stats = self.tenants.get(tenant)
        if stats is None:
            if len(self.tenants) >= self.limits.max_tenants:
                return None
            stats = self.tenants[tenant] = TenantStats(len(self.tenants) + 1)
        return stats

    def apply(self, tenant: str, request: Any, *, skip_invalid: bool, now_s: float,
              now_unix_us: int) -> BatchResult:
        """Apply ``request`` (a ``PublishRequest``): signals in order, then commands.

        ``skip_invalid`` False: stop at the first rejection (``stopped``);
        events before it stay applied. True: skip bad events, list them all.
        A duplicate ``(tenant, event_id)`` is counted and not applied again;
        with ``request.announce`` (a client announcing its live state again
        after a reconnect) so is an event refused only because what it starts
        already exists.
        With ``HintLimits.max_events_per_s_per_tenant`` set, only as many
        events as the tenant's budget allows are looked at; the rest of the
        batch is refused as one ``rate_limited`` rejection (``stopped``).
        """
        result = BatchResult()
        signals, commands = request.signals, request.commands
        num_events = len(signals) + len(commands)
        stats = self.tenant_stats(tenant)
        if stats is None:
            rej = Rejected(0, "tenant", "limit", f"over HintLimits.max_tenants={self.limits.max_tenants}")
            return self._stop_all(result, rej)
        if num_events > self.limits.max_batch_events:
            rej = Rejected(0, "signals" if signals else "commands", "oversize_batch",
                           f"{num_events} events; HintLimits.max_batch_events={self.limits.max_batch_events}")
            stats.rejections_by_reason[rej.reason] += 1
            return self._stop_all(result, rej)
        num_granted = num_events
        if self.limits.max_events_per_s_per_tenant is not None:
            num_granted = self._bucket(tenant, now_s).take(num_events, now_s)
            if num_granted < num_events:
                all_signals, all_commands = signals, commands
                signals, commands = signals[:num_granted], commands[: max(0, num_granted - len(signals))]
        max_us = now_unix_us + int(self.limits.max_future_skew_s * 1e6)
        client_id = request.client_id
        self._run(stats, tenant, signals, "signals", self._signal, client_id, result, skip_invalid,
                  now_s, max_us, announce=bool(getattr(request, "announce", False)))
        if result.stopped is None:
            self._run(stats, tenant, commands, "commands", self._command, stats, result, skip_invalid,
                      now_s, max_us)
        if num_granted < num_events and result.stopped is None:
            self._refuse_tail(stats, tenant, all_signals, all_commands, num_granted, result)
        return result

    def _bucket(self, tenant: str, now_s: float) -> TokenBucket:
        """``tenant``'s budget (made full on first use; one per known tenant, so bounded)."""
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = TokenBucket(self.limits.max_events_per_s_per_tenant, now_s)
        return bucket

    def _refuse_tail(self, stats: TenantStats, tenant: str, signals: Any, commands: Any, num_granted: int,
                     result: BatchResult) -> None:
        """Refuse the events from ``num_granted`` on as one ``rate_limited`` rejection."""
        num_refused = len(signals) + len(commands) - num_granted
        where, i, events = "signals", num_granted, signals
        if num_granted >= len(signals):
            where, i, events = "commands", num_granted - len(signals), commands
        rate = self.limits.max_events_per_s_per_tenant
        wait_s = self._buckets[tenant].wait_s(num_refused)
        rej = Rejected(events[i].event_id, f"{where}[{i}]", "rate_limited",
                       f"tenant {tenant!r} is over HintLimits.max_events_per_s_per_tenant={rate:g} "
                       f"(kvtier serve --max-events-per-s-per-tenant): {num_refused} of "
                       f"{len(signals) + len(commands)} events refused; retry them in {wait_s:.2f} s",
                       num_refused)
        stats.rejections_by_reason[rej.reason] += num_refused
        result.num_rejected += num_refused
        result.rejections.append(rej)
        result.stopped = rej

    @staticmethod
    def _stop_all(result: BatchResult, rej: Rejected) -> BatchResult:
        result.rejections.append(rej)
        result.stopped = rej
        result.batch_error = True
        return result

    def _run(self, stats: TenantStats, tenant: str, events: Any, where: str, handlers: dict[str, Callable],
             extra: Any, result: BatchResult, skip_invalid: bool, now_s: float, max_us: int,
             announce: bool = False) -> None:
        seen, order, window = self._seen, self._seen_order, self.limits.dedupe_window_events
        seen_add, order_append = seen.add, order.append
        tkey = _dedupe_tenant_key(stats.index)
        by_type = stats.events_by_type
        listener = self.listener
        accepted = duplicates = 0
        try:
            for i, ev in enumerate(events):
                eid = ev.event_id
                dkey = tkey | eid
                if dkey in seen:
                    duplicates += 1
                    continue
                kind = ev.WhichOneof("kind")
                ts = ev.client_time_unix_us
                if eid and 0 < ts <= max_us and kind is not None:
                    refusal = handlers[kind](tenant, getattr(ev, kind), now_s, extra)
                    if refusal is None:
                        by_type[kind] += 1
                        accepted += 1
                        seen_add(dkey)
                        order_append(dkey)
                        if len(order) > window:
                            seen.discard(order.popleft())
                        if listener is not None:
                            listener.on_event(tenant, kind, ev, now_s)
                        continue
                    if announce and refusal.reason == "duplicate":  # already known: the announcement is a no-op
                        duplicates += 1
                        continue
                    refusal = Refusal(refusal.reason, f"{kind}.{refusal.field}", refusal.message)
                else:
                    refusal = self._envelope_refusal(eid, ts, max_us)
                rej = Rejected(eid, f"{where}[{i}].{refusal.field}", refusal.reason, refusal.message)
                stats.rejections_by_reason[rej.reason] += 1
                result.num_rejected += 1
                if len(result.rejections) < 16:
                    result.rejections.append(rej)
                if not skip_invalid:
                    result.stopped = rej
                    return
        finally:
            result.num_accepted += accepted
            result.num_duplicates += duplicates
            stats.num_duplicates += duplicates

    def _envelope_refusal(self, eid: int, ts: int, max_us: int) -> Refusal:
        if not eid:
            return Refusal("missing", "event_id", "missing (must be non-zero)")
        if ts <= 0:
            return Refusal("missing", "client_time_unix_us", "missing (must be > 0)")
        if ts > max_us:
            return Refusal("future", "client_time_unix_us",
                           f"{ts} is more than HintLimits.max_future_skew_s={self.limits.max_future_skew_s} "
                           "ahead of the server clock")
        return Refusal("missing", "kind", "no event set (or an event type this server does not know)")

    # ----------------------------------------------------------------- checks
    # Each handler tests the common case in one expression and only on failure
    # works out which field is at fault (the slow path names it).

    def _ids(self, *pairs: tuple[str, str]) -> Refusal | None:
        limit = self.limits.max_id_bytes
        for name, value in pairs:
            if not value:
                return _missing(name)
            if len(value) > limit:
                return Refusal("too_long", name, f"{len(value)} characters; HintLimits.max_id_bytes={limit}")
        return None

    def _keys(self, name: str, raw: bytes) -> Refusal | None:
        if len(raw) % KEY_BYTES:
            return Refusal("bad_value", name, f"{len(raw)} bytes is not a whole number of 16-byte block keys")
        if len(raw) > self.limits.max_block_keys_per_event * KEY_BYTES:
            return Refusal("oversize", name, f"{len(raw) // KEY_BYTES} keys; "
                           f"HintLimits.max_block_keys_per_event={self.limits.max_block_keys_per_event}")
        return None

    def _opt_id(self, name: str, value: str) -> Refusal | None:
        if len(value) > self.limits.max_id_bytes:
            return Refusal("too_long", name,
                           f"{len(value)} characters; HintLimits.max_id_bytes={self.limits.max_id_bytes}")
        return None

    # ----------------------------------------------------------------- signals

    def _s_session_start(self, tenant: str, m: Any, now_s: float, client_id: str) -> Refusal | None:
        sid, model = m.session_id, m.model
        bad = self._ids(("session_id", sid)) or self._opt_id("model", model)
        return bad or self.graph.start_session(tenant, sid, now_s, client_id=client_id, model=model)

    def _s_session_end(self, tenant: str, m: Any, now_s: float, client_id: str) -> Refusal | None:
        sid = m.session_id
        return self._ids(("session_id", sid)) or self.graph.end_session(tenant, sid, now_s)

    def _s_agent_spawn(self, tenant: str, m: Any, now_s: float, client_id: str) -> Refusal | None:
        sid, aid, parent, atype, group = m.session_id, m.agent_id, m.parent_agent_id, m.agent_type, m.join_group
        bad = (self._ids(("session_id", sid), ("agent_id", aid)) or self._opt_id("parent_agent_id", parent)
               or self._opt_id("agent_type", atype) or self._opt_id("join_group", group))
        if bad:
            return bad
        importance = m.importance
        if importance not in _IMPORTANCE:
            return _bad_enum("importance", importance, pb.Importance)
        return self.graph.spawn_agent(tenant, sid, aid, now_s, parent_id=parent or None, agent_type=atype,
                                      importance=importance, join_group=group,
                                      expected_num_requests=m.expected_num_requests)

    def _s_agent_end(self, tenant: str, m: Any, now_s: float, client_id: str) -> Refusal | None:
        sid, aid, status = m.session_id, m.agent_id, m.status
        bad = self._ids(("session_id", sid), ("agent_id", aid))
        if bad:
            return bad
        if status not in _AGENT_STATUS:
            return _bad_enum("status", status, pb.AgentStatus)
        return self.graph.end_agent(tenant, sid, aid, now_s, status=status)

    def _s_dependency(self, tenant: str, m: Any, now_s: float, client_id: str) -> Refusal | None:
        sid, src, dst = m.session_id, m.from_agent_id, m.to_agent_id
        bad = self._ids(("session_id", sid), ("from_agent_id", src), ("to_agent_id", dst))
        return bad or self.graph.add_dependency(tenant, sid, src, dst, now_s)

    def _s_request_start(self, tenant: str, m: Any, now_s: float, client_id: str) -> Refusal | None:
        sid, aid, rid, keys, model = m.session_id, m.agent_id, m.request_id, m.prompt_block_keys, m.model
        n = self._max_id
        if not (sid and aid and rid and len(sid) <= n and len(aid) <= n and len(rid) <= n and len(model) <= n
                and not len(keys) % KEY_BYTES and len(keys) <= self._max_key_bytes):
            return (self._ids(("session_id", sid), ("agent_id", aid), ("request_id", rid))
                    or self._keys("prompt_block_keys", keys) or self._opt_id("model", model))
        return self.graph.start_request(tenant, sid, aid, rid, now_s, prompt_keys=keys)

    def _s_request_end(self, tenant: str, m: Any, now_s: float, client_id: str) -> Refusal | None:
        sid, aid, rid, stop = m.session_id, m.agent_id, m.request_id, m.stop
        n = self._max_id
        if not (sid and aid and rid and len(sid) <= n and len(aid) <= n and len(rid) <= n and stop in _STOP):
            bad = self._ids(("session_id", sid), ("agent_id", aid), ("request_id", rid))
            return bad or _bad_enum("stop", stop, pb.StopReason)
        return self.graph.end_request(tenant, sid, aid, rid, now_s)

    def _s_tool_call_start(self, tenant: str, m: Any, now_s: float, client_id: str) -> Refusal | None:
        sid, aid, cid, name = m.session_id, m.agent_id, m.tool_call_id, m.tool_name
        n = self._max_id
        if not (sid and aid and cid and name and len(sid) <= n and len(aid) <= n and len(cid) <= n
                and len(name) <= n):
            return self._ids(("session_id", sid), ("agent_id", aid), ("tool_call_id", cid), ("tool_name", name))
        expected = None
        if m.HasField("expected_duration_s"):
            expected = m.expected_duration_s
            if not (0.0 <= expected <= self.limits.max_expected_duration_s):  # also rejects NaN
                return Refusal("bad_value", "expected_duration_s",
                               f"{expected!r}; must be in [0, HintLimits.max_expected_duration_s="
                               f"{self.limits.max_expected_duration_s}]")
        return self.graph.start_tool_call(tenant, sid, aid, cid, name, expected_s=expected, now_s=now_s)

    def _s_tool_call_end(self, tenant: str, m: Any, now_s: float, client_id: str) -> Refusal | None:
        sid, aid, cid, status = m.session_id, m.agent_id, m.tool_call_id, m.status
        n = self._max_id
        if not (sid and aid and cid and len(sid) <= n and len(aid) <= n and len(cid) <= n and status in _TOOL_STATUS):
            bad = self._ids(("session_id", sid), ("agent_id", aid), ("tool_call_id", cid))
            return bad or _bad_enum("status", status, pb.ToolStatus)
        ok = status in (pb.TOOL_STATUS_OK, pb.TOOL_STATUS_ERROR, pb.TOOL_STATUS_UNSPECIFIED)
        return self.graph.end_tool_call(tenant, sid, aid, cid, now_s, observed=ok)

    def _s_shared_round_start(self, tenant: str, m: Any, now_s: float, client_id: str) -> Refusal | None:
        sid, rid, keys = m.session_id, m.round_id, m.shared_block_keys
        bad = self._ids(("session_id", sid), ("round_id", rid)) or self._keys("shared_block_keys", keys)
        if bad:
            return bad
        agent_ids = tuple(m.agent_ids)
        if not agent_ids:
            return _missing("agent_ids")
        return self.graph.start_shared_round(tenant, sid, rid, agent_ids, keys, now_s)

    def _s_shared_round_end(self, tenant: str, m: Any, now_s: float, client_id: str) -> Refusal | None:
        sid, rid = m.session_id, m.round_id
        return self._ids(("session_id", sid), ("round_id", rid)) or self.graph.end_shared_round(tenant, sid, rid, now_s)

    # ----------------------------------------------------------------- commands

    def _command_session(self, tenant: str, m: Any, now_s: float) -> Refusal | None:
        """Checks shared by block commands. The session need not be live: commands
        run after the batch's signals, so a pin sent just before its session's end
        still applies (its TTL bounds it); a live session is kept alive."""
        sid = m.session_id
        bad = self._ids(("session_id", sid)) or self._keys("block_keys", m.block_keys)
        if bad:
            return bad
        if not m.block_keys:
            return _missing("block_keys")
        s = self.graph.session(tenant, sid)
        if s is not None:
            s.last_seen_s = now_s
        return None

    def _c_pin(self, tenant: str, m: Any, now_s: float, stats: TenantStats) -> Refusal | None:
        bad = self._command_session(tenant, m, now_s)
        if bad:
            return bad
        ttl = m.ttl_s
        if not (0.0 < ttl <= self.limits.max_pin_ttl_s):
            return Refusal("bad_value", "ttl_s", f"{ttl!r}; must be in (0, HintLimits.max_pin_ttl_s="
                           f"{self.limits.max_pin_ttl_s}]")
        if self.store is None:
            return Refusal("no_store", "block_keys", self.no_store)
        self._lapse_pins(now_s)
        keys = list(dict.fromkeys(keys_of(m.block_keys)))
        new = sum(1 for k in keys if tenant not in self._pin_owners.get(k, ()))
        if self._pin_counts.get(tenant, 0) + new > self.limits.max_pinned_blocks_per_tenant:
            stats.commands_by_outcome["pin_refused_tenant_budget"] += 1
            return None
        ok = self.store.pin(keys, ttl) is not None
        stats.commands_by_outcome["pin_applied" if ok else "pin_refused_budget"] += 1
        if ok:
            until = now_s + ttl
            for k in keys:
                owners = self._pin_owners.setdefault(k, {})
                if tenant not in owners:
                    self._pin_counts[tenant] = self._pin_counts.get(tenant, 0) + 1
                owners[tenant] = max(owners.get(tenant, 0.0), until)
                heapq.heappush(self._pin_expiry, (owners[tenant], k, tenant))
            if len(self._pin_expiry) > 4 * sum(self._pin_counts.values()) + 1024:  # re-pins left stale entries
                self._pin_expiry = [(u, k, t) for k, owners in self._pin_owners.items() for t, u in owners.items()]
                heapq.heapify(self._pin_expiry)
        return None

    def _lapse_pins(self, now_s: float) -> None:
        """Forget ownership of pins whose TTL has passed (the store lapses the pins)."""
        heap = self._pin_expiry
        while heap and heap[0][0] <= now_s:
            until, k, tenant = heapq.heappop(heap)
            owners = self._pin_owners.get(k)
            if owners is not None and owners.get(tenant) == until:  # not extended since
                self._drop_owner(k, owners, tenant)

    def _drop_owner(self, key: int, owners: dict[str, float], tenant: str) -> None:
        del owners[tenant]
        if not owners:
            del self._pin_owners[key]
        left = self._pin_counts[tenant] - 1
        if left:
            self._pin_counts[tenant] = left
        else:
            del self._pin_counts[tenant]

    def _c_unpin(self, tenant: str, m: Any, now_s: float, stats: TenantStats) -> Refusal | None:
        bad = self._command_session(tenant, m, now_s)
        if bad:
            return bad
        if self.store is None:
            return Refusal("no_store", "block_keys", self.no_store)
        self._lapse_pins(now_s)
        release = []
        for k in dict.fromkeys(keys_of(m.block_keys)):
            owners = self._pin_owners.get(k)
            if owners is None or tenant not in owners:
                stats.commands_by_outcome["unpin_not_owned"] += 1  # another tenant's pin, or none
                continue
            self._drop_owner(k, owners, tenant)
            if k not in self._pin_owners:  # no other tenant still holds it
                release.append(k)
        if release:
            self.store.unpin(release)
        stats.commands_by_outcome["unpin_applied"] += 1
        return None

    def _c_prefetch(self, tenant: str, m: Any, now_s: float, stats: TenantStats) -> Refusal | None:
        bad = self._command_session(tenant, m, now_s)
        if bad:
            return bad
        tier = _TIER_NAMES.get(m.tier)
        if tier is None:
            return _bad_enum("tier", m.tier, pb.Tier)
        if self.store is None:
            return Refusal("no_store", "block_keys", self.no_store)
        tiers = getattr(getattr(self.store, "manager", None), "tier_names", ())
        if tiers and tier not in tiers:
            stats.commands_by_outcome["prefetch_tier_disabled"] += 1
            return None
        self.store.prefetch(keys_of(m.block_keys), tier)
        stats.commands_by_outcome["prefetch_submitted"] += 1
        return None

    def _c_priority(self, tenant: str, m: Any, now_s: float, stats: TenantStats) -> Refusal | None:
        sid, aid = m.session_id, m.agent_id
        bad = self._ids(("session_id", sid), ("agent_id", aid))
        if bad:
            return bad
        if m.priority not in _PRIORITY:
            return (_missing("priority") if m.priority == 0 else _bad_enum("priority", m.priority, pb.Priority))
        refusal = self.graph.set_priority(tenant, sid, aid, m.priority, now_s)
        if refusal is None:
            stats.commands_by_outcome["priority_applied"] += 1
        return refusal

    # ----------------------------------------------------------------- upkeep

    def check_invariants(self) -> None:
        """The graph's invariants plus the dedupe window's bound."""
        self.graph.check_invariants()
        assert len(self._seen) <= len(self._seen_order) <= self.limits.dedupe_window_events
        assert len(self.tenants) <= self.limits.max_tenants
        assert self._buckets.keys() <= self.tenants.keys()

    @property
    def dedupe_size(self) -> int:
        return len(self._seen)
