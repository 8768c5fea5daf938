"""vLLM's typed KV hints (``Request.kv_hints``) read as kvtier's hints: the actions
kvtier understands, what each payload must be, and the outcome of every action.

vLLM (0.32 on) carries an orchestrator's ``KvHintsEnvelope`` on a request
(``vllm/v1/kv_hints/protocol.py``: ``protocol_version``, ``message_id`` and
``actions``, each ``action_id``, ``action_type``, ``action_version`` and a JSON
``payload``), passed through ``AsyncLLM.generate(kv_hints=...)`` and
``LLMEngine.add_request(kv_hints=...)`` (its OpenAI server does not read one
from a request body). vLLM names no actions: the component that implements one
validates its payload. These are kvtier's, each at version ``"1"``, named after
the actions the Dynamo team's RFC for them asks for (vLLM issue #51428):

=============  ===========================================  =========================================
action_type    payload                                      what kvtier does
=============  ===========================================  =========================================
``identity``   ``session_id``, ``agent_id``; ``tenant``     names the request's session, agent and
               (optional): strings                          tenant (``kvtier_session_id`` ...), whole,
                                                            where the request's own tags name neither
``pin``        ``priority``: a number in [0, 1]             the agent's criticality
                                                            (``kvtier_criticality``): its KV is kept
                                                            over that of agents with less
``prefetch``   ``after_s``: seconds > 0                     the agent comes back ``after_s`` after
                                                            this request ends: its KV may leave HBM
                                                            meanwhile and is brought back before (a
                                                            tool wait: ``kvtier_tool_wait_s``)
``retain``     ``duration_s``: seconds > 0                  the agent is idle about ``duration_s``
                                                            after this request, no return promised:
                                                            a wait of that length that kvtier's
                                                            placement ranks as a user's (kept in its
                                                            tiers in next-use order, held in HBM only
                                                            as its policy holds any wait, never
                                                            brought back ahead of the agent)
``release``    none                                         the agent is done after this request:
                                                            its KV goes first
=============  ===========================================  =========================================

Every action gets one outcome (:data:`OUTCOMES`): ``accepted``; ``clipped`` (a
number outside its range, brought into it: a priority above 1, a wait above
:data:`~kvtier.sdk.params.MAX_TOOL_WAIT_S`); ``rejected`` (the payload is not
what the table says: a missing field, a wrong type, NaN, an id too long);
``unknown`` (an action type kvtier does not read: another component's, never
named in a counter); ``unknown_version``; ``overridden`` (the request's own
``kv_transfer_params`` already says it, or another action of this envelope
wins, whatever the order: ``release`` over ``prefetch`` and ``retain``,
``prefetch`` over ``retain``); ``duplicate`` (a second action of one type at
version 1: the first counts); ``dropped`` (one outcome for all the actions past
:data:`MAX_ACTIONS` in one envelope, which are not looked at). An envelope that
is not one (not an object, ``actions`` not a list) is one ``malformed`` outcome.
Nothing here raises on what a client sends.

Owns: the vocabulary above and reading an envelope (:func:`read_kv_hints`). Must
not import vLLM (it reads the envelope's fields by attribute, as vLLM's msgspec
struct has them, or by key, as its builtins dict has them), count or log (the
connector counts the outcomes and applies the hints, the same way it applies a
request's ``kv_transfer_params``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .params import (AGENT_ID_PARAM, CRITICALITY_PARAM, MAX_TOOL_WAIT_S, SESSION_ID_PARAM, TENANT_PARAM,
                     TOOL_WAIT_PARAM, VALIDATORS, read_param)

ACTIONS = ("identity", "pin", "prefetch", "retain", "release")
VERSION = "1"
OUTCOMES = ("accepted", "clipped", "rejected", "unknown", "unknown_version", "overridden", "duplicate", "dropped",
            "malformed")
MAX_ACTIONS = 16
"""Actions read from one envelope; all past it are one ``dropped`` outcome."""


@dataclass
class KvHints:
    """What one envelope says, as kvtier reads it."""

    params: dict[str, Any] = field(default_factory=dict)
    """kvtier keys the envelope sets (as :mod:`kvtier.sdk.params` names them), under the request's own."""
    retain_s: float | None = None
    """``retain``: how long to keep the agent's KV after the request (no return promised)."""
    release: bool = False
    """``release``: the agent is done after this request."""
    outcomes: list[tuple[str, str]] = field(default_factory=list)
    """``(action type, outcome)`` per action; the type is ``"other"`` for one kvtier does not read,
    ``"envelope"`` for a malformed envelope."""


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None) if not isinstance(obj, (str, bytes, int, float, list, tuple)) else None


def _read(key: str, value: Any, clip_below: bool) -> tuple[float | None, str]:
    """``value`` read by the validator of kvtier key ``key`` (:data:`~kvtier.sdk.params.VALIDATORS`,
    the same check a request's ``kv_transfer_params`` get), a finite number above its range (or,
    with ``clip_below``, below it) first brought into it: ``(value or None, outcome)``."""
    outcome = "accepted"
    finite = not isinstance(value, bool) and (isinstance(value, int) or (isinstance(value, float)
                                                                         and math.isfinite(value)))
    if finite:  # an int too large for a float is compared as an int, never converted first
        high = MAX_TOOL_WAIT_S if key == TOOL_WAIT_PARAM else 1
        if value > high:
            value, outcome = high, "clipped"
        elif clip_below and value < 0:
            value, outcome = 0, "clipped"
    got, why = VALIDATORS[key](value)
    return (None, "rejected") if why is not None else (float(got), outcome)


def _identity(payload: Mapping[str, Any]) -> dict[str, Any] | None:
    out = {}
    for name, key, required in (("session_id", SESSION_ID_PARAM, True), ("agent_id", AGENT_ID_PARAM, True),
                                ("tenant", TENANT_PARAM, False)):
        if name not in payload:
            if required:
                return None
            continue
        value, why = VALIDATORS[key](payload[name])
        if why is not None:
            return None
        out[key] = value
    return out


def read_kv_hints(envelope: Any, own_params: Mapping[str, Any] | None = None) -> KvHints | None:
    """kvtier's reading of ``envelope`` (``None`` for none), ``own_params`` being the request's
    ``kv_transfer_params``, whose kvtier keys win over the envelope's."""
    if envelope is None:
        return None
    hints = KvHints()
    actions = _field(envelope, "actions")
    if not isinstance(actions, (list, tuple)):
        hints.outcomes.append(("envelope", "malformed"))
        return hints
    seen: dict[str, int] = {}  # action type -> index of its outcome
    for action in actions[:MAX_ACTIONS]:
        kind, version, payload = (_field(action, n) for n in ("action_type", "action_version", "payload"))
        if not isinstance(kind, str) or kind not in ACTIONS:
            hints.outcomes.append(("other", "unknown"))
        elif version != VERSION:  # (a later action of the same type at version 1 still counts)
            hints.outcomes.append((kind, "unknown_version"))
        elif kind in seen:
            hints.outcomes.append((kind, "duplicate"))
        else:
            seen[kind] = len(hints.outcomes)
            payload = payload if isinstance(payload, Mapping) else None
            hints.outcomes.append((kind, _apply(hints, kind, payload, own_params)))
    if len(actions) > MAX_ACTIONS:  # one outcome for all the rest: a flood costs no more than MAX_ACTIONS
        hints.outcomes.append(("other", "dropped"))
    _settle(hints, seen)
    return hints


def _apply(hints: KvHints, kind: str, payload: Mapping[str, Any] | None, own: Mapping[str, Any] | None) -> str:
    """Read one action of a known type and version into ``hints``; its outcome."""
    if payload is None:
        return "rejected"
    if kind == "release":
        if read_param(own, TOOL_WAIT_PARAM) is not None:
            return "overridden"  # the request itself says its agent waits on a tool
        hints.release = True
        return "accepted"
    if kind == "identity":
        got = _identity(payload)
        if got is None:
            return "rejected"
        if read_param(own, SESSION_ID_PARAM) is not None or read_param(own, AGENT_ID_PARAM) is not None:
            return "overridden"  # the request's own tags name it: the identity is taken whole or not at all
        hints.params.update(got)
        return "accepted"
    name, key = {"pin": ("priority", CRITICALITY_PARAM), "prefetch": ("after_s", TOOL_WAIT_PARAM),
                 "retain": ("duration_s", TOOL_WAIT_PARAM)}[kind]
    value, outcome = _read(key, payload.get(name), clip_below=kind == "pin")
    if value is None:
        return outcome
    if kind == "retain":
        if read_param(own, TOOL_WAIT_PARAM) is not None:
            return "overridden"  # the request itself says its agent waits on a tool
        hints.retain_s = value
    elif read_param(own, key) is not None:
        return "overridden"
    else:
        hints.params[key] = value
    return outcome


def _settle(hints: KvHints, seen: dict[str, int]) -> None:
    """Contradictions inside one envelope: ``release`` over a wait, ``prefetch`` over ``retain``."""
    def drop(kind: str) -> None:
        i = seen[kind]
        if hints.outcomes[i][1] in ("accepted", "clipped"):
            hints.outcomes[i] = (kind, "overridden")
            if kind == "retain":
                hints.retain_s = None
            else:
                hints.params.pop(TOOL_WAIT_PARAM, None)

    if hints.release:
        for kind in ("prefetch", "retain"):
            if kind in seen:
                drop(kind)
    elif "retain" in seen and TOOL_WAIT_PARAM in hints.params:
        drop("retain")


def merged_params(own: Mapping[str, Any] | None, hints: KvHints | None) -> Mapping[str, Any] | None:
    """The request's ``kv_transfer_params`` with the envelope's kvtier keys where its own
    say nothing (or something refused, which reads as nothing)."""
    if hints is None or not hints.params:
        return own
    out = dict(own) if isinstance(own, Mapping) else {}
    for key, value in hints.params.items():
        if read_param(own, key) is None:  # absent there, or refused (it reads as absent)
            out[key] = value
    return out
