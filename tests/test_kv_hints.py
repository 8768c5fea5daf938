"""vLLM's kv_hints envelopes read as kvtier's hints (kvtier.sdk.kv_hints): each action of
kvtier's vocabulary, its outcome, precedence under kv_transfer_params, and hostile envelopes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.sdk.kv_hints import ACTIONS, MAX_ACTIONS, OUTCOMES, merged_params, read_kv_hints
from kvtier.sdk.params import MAX_TOOL_WAIT_S, request_criticality, request_tags, request_tenant, request_tool_wait_s


@dataclass(frozen=True)
class Action:  # the fields of vLLM's KvHintAction (a msgspec struct, read by attribute)
    action_id: str
    action_type: str
    action_version: str
    payload: Any


@dataclass(frozen=True)
class Envelope:  # vLLM's KvHintsEnvelope
    protocol_version: str
    message_id: str
    actions: list


def env(*actions: tuple[str, dict]) -> Envelope:
    return Envelope("0.1", "m", [Action(str(i), kind, "1", payload) for i, (kind, payload) in enumerate(actions)])


def test_each_action_becomes_the_hint_it_names() -> None:
    hints = read_kv_hints(env(("identity", {"session_id": "s", "agent_id": "a", "tenant": "t"}),
                              ("pin", {"priority": 0.9}), ("prefetch", {"after_s": 2.5})))
    assert hints.outcomes == [("identity", "accepted"), ("pin", "accepted"), ("prefetch", "accepted")]
    params = merged_params(None, hints)
    assert request_tags(params) == ("s", "a") and request_tenant(params) == "t"
    assert request_criticality(params) == 0.9 and request_tool_wait_s(params) == 2.5
    retain = read_kv_hints(env(("retain", {"duration_s": 30})))
    assert retain.retain_s == 30.0 and not retain.params and retain.outcomes == [("retain", "accepted")]
    release = read_kv_hints(env(("release", {})))
    assert release.release and release.outcomes == [("release", "accepted")]


def test_the_same_hints_read_from_builtins_as_from_the_struct() -> None:
    as_dict = {"protocol_version": "0.1", "message_id": "m",
               "actions": [{"action_id": "0", "action_type": "pin", "action_version": "1", "payload": {"priority": 1}}]}
    assert read_kv_hints(as_dict) == read_kv_hints(env(("pin", {"priority": 1})))


def test_numbers_out_of_range_are_clipped_and_bad_payloads_rejected() -> None:
    hints = read_kv_hints(env(("pin", {"priority": 7}), ("prefetch", {"after_s": 10 * MAX_TOOL_WAIT_S})))
    assert hints.outcomes == [("pin", "clipped"), ("prefetch", "clipped")]
    assert hints.params["kvtier_criticality"] == 1.0 and hints.params["kvtier_tool_wait_s"] == MAX_TOOL_WAIT_S
    bad = read_kv_hints(env(("pin", {"priority": math.nan}), ("prefetch", {"after_s": -1}),
                            ("retain", {"duration_s": "10"}), ("identity", {"agent_id": "a"}), ("release", [])))
    assert [o for _, o in bad.outcomes] == ["rejected"] * 5
    assert not bad.params and bad.retain_s is None and not bad.release
    long_id = read_kv_hints(env(("identity", {"session_id": "x" * 300, "agent_id": "a"})))
    assert long_id.outcomes == [("identity", "rejected")]
    # ints too large for a float are compared as ints, never converted first
    huge = read_kv_hints(env(("pin", {"priority": 10**400}), ("prefetch", {"after_s": 10**400}),
                             ("retain", {"duration_s": -10**400})))
    assert huge.outcomes == [("pin", "clipped"), ("prefetch", "clipped"), ("retain", "rejected")]
    assert huge.params == {"kvtier_criticality": 1.0, "kvtier_tool_wait_s": MAX_TOOL_WAIT_S}


def test_the_requests_own_kv_transfer_params_win() -> None:
    own = {"kvtier_session_id": "mine", "kvtier_agent_id": "me", "kvtier_criticality": 0.1}
    hints = read_kv_hints(env(("identity", {"session_id": "s", "agent_id": "a"}), ("pin", {"priority": 0.9}),
                              ("prefetch", {"after_s": 3})), own)
    assert hints.outcomes == [("identity", "overridden"), ("pin", "overridden"), ("prefetch", "accepted")]
    merged = merged_params(own, hints)
    assert request_tags(merged) == ("mine", "me") and request_criticality(merged) == 0.1
    assert request_tool_wait_s(merged) == 3.0
    # a refused value of its own reads as absent: the envelope's stands
    merged = merged_params({"kvtier_criticality": "high"}, read_kv_hints(env(("pin", {"priority": 0.5}))))
    assert request_criticality(merged) == 0.5
    # a tool wait the request states outranks a release and a retain
    assert read_kv_hints(env(("release", {})), {"kvtier_tool_wait_s": 4}).outcomes == [("release", "overridden")]
    kept = read_kv_hints(env(("retain", {"duration_s": 9})), {"kvtier_tool_wait_s": 4})
    assert kept.outcomes == [("retain", "overridden")] and kept.retain_s is None
    # an identity is taken whole or not at all: the request's own agent id alone overrides it
    half = read_kv_hints(env(("identity", {"session_id": "s", "agent_id": "a"})), {"kvtier_agent_id": "me"})
    assert half.outcomes == [("identity", "overridden")] and not half.params
    # an identity needs both ids (a session alone names no agent: vLLM's own session_id is for that)
    assert read_kv_hints(env(("identity", {"session_id": "s"}))).outcomes == [("identity", "rejected")]


def test_contradictions_inside_one_envelope_are_settled_and_counted() -> None:
    hints = read_kv_hints(env(("retain", {"duration_s": 60}), ("prefetch", {"after_s": 5}), ("release", {})))
    assert hints.release and hints.retain_s is None and "kvtier_tool_wait_s" not in hints.params
    assert hints.outcomes == [("retain", "overridden"), ("prefetch", "overridden"), ("release", "accepted")]
    both = read_kv_hints(env(("retain", {"duration_s": 60}), ("prefetch", {"after_s": 5})))
    assert both.retain_s is None and both.params["kvtier_tool_wait_s"] == 5.0
    twice = read_kv_hints(env(("pin", {"priority": 0.2}), ("pin", {"priority": 0.8})))
    assert twice.outcomes == [("pin", "accepted"), ("pin", "duplicate")] and twice.params["kvtier_criticality"] == 0.2


def test_other_components_actions_versions_and_floods_are_counted_not_read() -> None:
    hints = read_kv_hints(Envelope("0.1", "m", [Action("0", "vllm.set_priority", "1.0", {"ttl_seconds": 5}),
                                                Action("1", "pin", "2", {"priority": 1})]))
    assert hints.outcomes == [("other", "unknown"), ("pin", "unknown_version")] and not hints.params
    flood = read_kv_hints(Envelope("0.1", "m", [Action(str(i), "x", "1", {}) for i in range(MAX_ACTIONS + 10**5)]))
    assert len(flood.outcomes) == MAX_ACTIONS + 1 and flood.outcomes[-1] == ("other", "dropped")
    # a type at an unknown version does not hide the same type at version 1 after it
    fallback = read_kv_hints(Envelope("0.1", "m", [Action("0", "pin", "2", {"priority": 1}),
                                                   Action("1", "pin", "1", {"priority": 0.5})]))
    assert fallback.outcomes == [("pin", "unknown_version"), ("pin", "accepted")]
    assert read_kv_hints(None) is None
    for odd in ("text", 5, {"actions": "all"}, Envelope("0.1", "m", None)):  # type: ignore[arg-type]
        assert read_kv_hints(odd).outcomes == [("envelope", "malformed")]


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
                           | st.sampled_from([10**400, -10**400, 2**63, float("inf")]),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                         max_size=4), max_leaves=12)
actions = st.fixed_dictionaries({"action_id": json_values, "action_type": st.sampled_from(ACTIONS) | json_values,
                                 "action_version": st.sampled_from(["1", "2"]) | json_values,
                                 "payload": st.dictionaries(st.sampled_from(["session_id", "agent_id", "tenant",
                                                                             "priority", "after_s", "duration_s"]),
                                                            json_values, max_size=4) | json_values})


@settings(max_examples=300, deadline=None)
@given(envelope=st.fixed_dictionaries({"actions": st.lists(actions | json_values, max_size=MAX_ACTIONS + 3)})
       | json_values, own=st.none() | st.dictionaries(st.sampled_from(["kvtier_session_id", "kvtier_criticality",
                                                                        "kvtier_tool_wait_s"]), json_values))
def test_hostile_envelopes_never_raise_and_every_action_gets_one_bounded_outcome(envelope: Any, own: Any) -> None:
    hints = read_kv_hints(envelope, own)
    if envelope is None:
        return
    actions_in = envelope.get("actions") if isinstance(envelope, dict) else None
    expected = min(len(actions_in), MAX_ACTIONS) + (len(actions_in) > MAX_ACTIONS) if isinstance(actions_in, list) \
        else 1
    assert len(hints.outcomes) == expected
    for kind, outcome in hints.outcomes:  # counter names stay bounded whatever a client sends
        assert kind in ACTIONS + ("other", "envelope") and outcome in OUTCOMES
    merged = merged_params(own, hints)
    wait = request_tool_wait_s(merged)
    assert wait is None or 0 < wait <= MAX_TOOL_WAIT_S
    assert hints.retain_s is None or 0 < hints.retain_s <= MAX_TOOL_WAIT_S
