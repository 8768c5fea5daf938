"""kvtier's keys in a request's ``kv_transfer_params``: their names, what a valid
value is, reading them, and listing what a request got wrong.

Owns: the key names (``kvtier_session_id`` ... ``kvtier_tenant``), one
validator per key (the readers below and :func:`check_request_params` use the
same one, so what is refused and what is read never disagree), and the
bounds (:data:`MAX_ID_BYTES`, :data:`MAX_TOOL_WAIT_S`, :data:`MAX_SHARED_TOKENS`).
A value a validator refuses reads as absent: the request is served as one
without that hint, never failed. Must not import an engine, log or count: the
engine connector counts and logs what :func:`check_request_params` lists.

Any client can put anything into ``kv_transfer_params``. Keys that do not start
with ``kvtier_`` belong to other connectors (vLLM's P/D connectors, a
MultiConnector's others) and are not looked at; an unknown ``kvtier_`` key is
listed (a typo would otherwise be a hint silently lost).

>>> check_request_params({"kvtier_session_id": "s", "kvtier_tool_wait_s": float("nan"), "kvtier_tool": 1})
[ParamProblem(key='kvtier_tool_wait_s', value='nan', reason='not a finite number of seconds in (0, 604800]'), \
ParamProblem(key='kvtier_tool', value='1', reason='unknown kvtier key')]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

KV_TRANSFER_PARAMS = "kv_transfer_params"
SESSION_ID_PARAM = "kvtier_session_id"
AGENT_ID_PARAM = "kvtier_agent_id"
TOOL_WAIT_PARAM = "kvtier_tool_wait_s"
CRITICALITY_PARAM = "kvtier_criticality"
APPROXIMATE_SEGMENTS_PARAM = "kvtier_approximate_segments"
ROUND_ID_PARAM = "kvtier_round_id"
SHARED_TOKENS_PARAM = "kvtier_shared_tokens"
TENANT_PARAM = "kvtier_tenant"
KVTIER_PREFIX = "kvtier_"
MAX_LOAD_TOKENS_PARAM = "max_load_tokens"  # vLLM's (not kvtier's): its offloading connector reads it too

DEFAULT_TENANT = "default"
"""The hint server's tenant for a caller that names none (no token file); in the connector, also the
tenant of a request without ``kvtier_tenant`` (see :func:`tenant_session`)."""
TENANT_SEP = "\x1f"
"""Between a tenant and a session id in :func:`tenant_session`."""

MAX_ID_BYTES = 256
"""Longest session, agent or round id (UTF-8 bytes); the hint server's ``HintLimits.max_id_bytes`` default."""
MAX_TOOL_WAIT_S = 7 * 86_400.0
"""Longest tool wait a request may announce; the hint server's ``HintLimits.max_expected_duration_s`` default."""
MAX_SHARED_TOKENS = 1 << 24
"""Most shared-context tokens a round request may declare (far above any model's context)."""
MAX_APPROXIMATE_SPANS = 64
MAX_VALUE_CHARS = 40  # how much of a refused value a ParamProblem keeps


class ParamProblem(NamedTuple):
    """One refused key: its name, its value (``repr``, at most 40 characters) and why."""

    key: str
    value: str
    reason: str


Checked = tuple[Any, str | None]  # (the value read, or None; why it was refused, or None)


def _id(value: Any) -> Checked:
    if not isinstance(value, str) or not value:
        return None, "not a non-empty string"
    if len(value.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        return None, f"longer than {MAX_ID_BYTES} bytes"
    return value, None


def _tool_wait(value: Any) -> Checked:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TOOL_WAIT_S:
        return None, f"not a finite number of seconds in (0, {MAX_TOOL_WAIT_S:g}]"
    return float(value), None


def _criticality(value: Any) -> Checked:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        return None, "not a number in [0, 1]"
    return float(value), None


def _shared_tokens(value: Any) -> Checked:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SHARED_TOKENS:
        return None, f"not an int in [0, {MAX_SHARED_TOKENS}]"
    return value, None


def _spans(value: Any) -> Checked:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_APPROXIMATE_SPANS:
        return None, f"not a list of at most {MAX_APPROXIMATE_SPANS} [start, length] spans"
    out = []
    for span in value:
        if not isinstance(span, (list, tuple)) or len(span) != 2 or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in span) or span[0] < 0 or span[1] <= 0:
            return None, "a span is not [start >= 0, length > 0]"
        out.append((int(span[0]), int(span[1])))
    return out, None


VALIDATORS: dict[str, Callable[[Any], Checked]] = {
    SESSION_ID_PARAM: _id,
    AGENT_ID_PARAM: _id,
    TOOL_WAIT_PARAM: _tool_wait,
    CRITICALITY_PARAM: _criticality,
    APPROXIMATE_SEGMENTS_PARAM: _spans,
    ROUND_ID_PARAM: _id,
    SHARED_TOKENS_PARAM: _shared_tokens,
    TENANT_PARAM: _id,
}


def read_param(kv_transfer_params: Mapping[str, Any] | None, key: str) -> Any:
    """The value of kvtier key ``key``, or ``None`` when absent or refused by its validator."""
    if not isinstance(kv_transfer_params, Mapping) or key not in kv_transfer_params:
        return None
    return VALIDATORS[key](kv_transfer_params[key])[0]


def check_request_params(kv_transfer_params: Any) -> list[ParamProblem]:
    """Every kvtier key of a request's ``kv_transfer_params`` that is refused (its value
    reads as absent), with why; ``[]`` when all are good. Keys without the ``kvtier_``
    prefix are other connectors' and are not checked."""
    if kv_transfer_params is None:
        return []
    if not isinstance(kv_transfer_params, Mapping):
        return [ParamProblem(KV_TRANSFER_PARAMS, _show(kv_transfer_params), "not an object")]
    out = []
    for key, value in kv_transfer_params.items():
        if not isinstance(key, str) or not key.startswith(KVTIER_PREFIX):
            continue
        check = VALIDATORS.get(key)
        reason = "unknown kvtier key" if check is None else check(value)[1]
        if reason is not None:
            out.append(ParamProblem(_show(key, bare=True), _show(value), reason))
    if (ROUND_ID_PARAM in kv_transfer_params) != (SHARED_TOKENS_PARAM in kv_transfer_params):
        given, missing = ((ROUND_ID_PARAM, SHARED_TOKENS_PARAM) if ROUND_ID_PARAM in kv_transfer_params
                          else (SHARED_TOKENS_PARAM, ROUND_ID_PARAM))
        out.append(ParamProblem(given, _show(kv_transfer_params[given]), f"given without {missing}"))
    return out


def _show(value: Any, bare: bool = False) -> str:
    text = value if bare else repr(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def request_tags(kv_transfer_params: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """``(session_id, agent_id)`` that :func:`~kvtier.sdk.handles.tag_request` put into
    ``kv_transfer_params`` (``None`` for a missing or refused one); what an engine connector calls."""
    return read_param(kv_transfer_params, SESSION_ID_PARAM), read_param(kv_transfer_params, AGENT_ID_PARAM)


def request_tenant(kv_transfer_params: Mapping[str, Any] | None) -> str:
    """The request's tenant for the connector's per-tenant bounds (``kvtier_tenant``; ``""``
    when absent or refused: requests without one are one tenant). Not a namespace: blocks
    are shared across tenants unless vLLM's ``cache_salt`` keeps them apart. Set it where
    the caller is known (a gateway, an authenticating proxy), not from the client's body."""
    return read_param(kv_transfer_params, TENANT_PARAM) or ""


def tenant_session(tenant: str, session_id: str) -> str:
    """One string for a session of a tenant, for keys that hold a session id (the connector's
    agents are ``(tenant_session(...), agent id)``), so that two tenants' sessions of one id stay
    apart. The default tenant's (and ``""``'s, a request naming none) is the bare id, unless the id
    holds :data:`TENANT_SEP`; any other is ``"<len(tenant)>:<tenant>"``, the separator, then the id.
    The map is one-to-one: no session id of one tenant, whatever it holds, names another's session.

    >>> tenant_session("", "s"), tenant_session("default", "s"), tenant_session("acme", "s")
    ('s', 's', '4:acme\\x1fs')
    >>> tenant_session("default", "4:acme\x1fs") == tenant_session("acme", "s")
    False
    """
    if (not tenant or tenant == DEFAULT_TENANT) and TENANT_SEP not in session_id:
        return session_id
    tenant = tenant or DEFAULT_TENANT
    return f"{len(tenant)}:{tenant}{TENANT_SEP}{session_id}"


def request_tool_wait_s(kv_transfer_params: Mapping[str, Any] | None) -> float | None:
    """The expected tool wait (``None`` when absent, or not a number of seconds in
    (0, :data:`MAX_TOOL_WAIT_S`])."""
    return read_param(kv_transfer_params, TOOL_WAIT_PARAM)


def request_max_load_tokens(kv_transfer_params: Mapping[str, Any] | None) -> int | None:
    """vLLM's own ``max_load_tokens`` (its offloading connector's, which a router such as llm-d's sets
    to 0 to have a request recompute rather than load): the most tokens to load past what the engine
    has cached itself; ``None`` when absent or not an integer >= 0 (ignored, as vLLM does)."""
    raw = kv_transfer_params.get(MAX_LOAD_TOKENS_PARAM) if isinstance(kv_transfer_params, Mapping) else None
    return raw if type(raw) is int and raw >= 0 else None


def request_criticality(kv_transfer_params: Mapping[str, Any] | None) -> float | None:
    """The criticality (``None`` when absent or not a number in [0, 1])."""
    return read_param(kv_transfer_params, CRITICALITY_PARAM)


def request_round(kv_transfer_params: Mapping[str, Any] | None) -> tuple[str, int] | None:
    """``(round_id, shared_tokens)`` that :func:`~kvtier.sdk.handles.tag_round` put into
    ``kv_transfer_params``; ``None`` when either is absent or refused."""
    rid, shared = read_param(kv_transfer_params, ROUND_ID_PARAM), read_param(kv_transfer_params, SHARED_TOKENS_PARAM)
    return None if rid is None or shared is None else (rid, shared)


def request_approximate_segments(kv_transfer_params: Mapping[str, Any] | None) -> list[tuple[int, int]] | None:
    """The spans :func:`~kvtier.sdk.handles.approximate_segments` put into ``kv_transfer_params``
    (an empty list: an approximate-mode request with no segment); ``None`` when absent or
    malformed (a malformed list, or more than :data:`MAX_APPROXIMATE_SPANS` spans, is no
    request for approximation)."""
    return read_param(kv_transfer_params, APPROXIMATE_SEGMENTS_PARAM)
