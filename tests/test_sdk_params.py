"""kvtier's keys in ``kv_transfer_params``: one validator per key, shared by the readers
the connector calls, by :func:`check_request_params` (what it counts and logs) and by
the SDK's :func:`tag_request` (a client cannot build what the connector refuses)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.sdk.handles import tag_request
from kvtier.sdk.params import (
    MAX_ID_BYTES,
    MAX_TOOL_WAIT_S,
    VALIDATORS,
    check_request_params,
    read_param,
    request_criticality,
    request_round,
    request_tags,
    request_tool_wait_s,
)

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("wait", [NAN, INF, -INF, 1e308, -5.0, 0, 0.0, "10", None, True, [3], MAX_TOOL_WAIT_S * 2])
def test_bad_tool_waits_read_as_absent_and_are_listed(wait) -> None:
    params = {"kvtier_tool_wait_s": wait}
    assert request_tool_wait_s(params) is None
    [problem] = check_request_params(params)
    assert problem.key == "kvtier_tool_wait_s" and "seconds in (0, 604800]" in problem.reason


@pytest.mark.parametrize("crit", [NAN, INF, 2.0, -1.0, -0.001, "high", None, False])
def test_bad_criticalities_read_as_absent_and_are_listed(crit) -> None:
    params = {"kvtier_criticality": crit}
    assert request_criticality(params) is None
    assert [p.key for p in check_request_params(params)] == ["kvtier_criticality"]


def test_ids_longer_than_the_hint_planes_limit_or_not_strings_are_refused() -> None:
    ok = "é" * (MAX_ID_BYTES // 2)  # 256 bytes in UTF-8
    assert request_tags({"kvtier_session_id": ok, "kvtier_agent_id": "a"}) == (ok, "a")
    long = ok + "x"
    assert request_tags({"kvtier_session_id": long, "kvtier_agent_id": 7}) == (None, None)
    problems = check_request_params({"kvtier_session_id": long, "kvtier_agent_id": 7})
    assert [(p.key, p.reason) for p in problems] == [
        ("kvtier_session_id", f"longer than {MAX_ID_BYTES} bytes"), ("kvtier_agent_id", "not a non-empty string")]
    assert len(problems[0].value) <= 40  # a huge value is not copied whole


def test_unknown_kvtier_keys_are_listed_and_other_connectors_keys_are_not_looked_at() -> None:
    params = {"kvtier_tool_wiat_s": 3.0, "do_remote_prefill": True, "remote_block_ids": [1, 2], 7: "x"}
    assert [(p.key, p.reason) for p in check_request_params(params)] == [("kvtier_tool_wiat_s", "unknown kvtier key")]


def test_half_a_round_is_refused_and_reads_as_no_round() -> None:
    assert request_round({"kvtier_round_id": "r"}) is None
    assert [p.reason for p in check_request_params({"kvtier_round_id": "r"})] == [
        "given without kvtier_shared_tokens"]
    assert [p.reason for p in check_request_params({"kvtier_shared_tokens": 64})] == ["given without kvtier_round_id"]
    assert request_round({"kvtier_round_id": "r", "kvtier_shared_tokens": 64}) == ("r", 64)
    assert [p.key for p in check_request_params({"kvtier_round_id": "r", "kvtier_shared_tokens": -3})] == [
        "kvtier_shared_tokens"]


def test_params_that_are_not_an_object_are_one_problem() -> None:
    assert check_request_params(None) == []
    [problem] = check_request_params(["kvtier_session_id", "s"])
    assert (problem.key, problem.reason) == ("kv_transfer_params", "not an object")


def test_what_tag_request_builds_is_never_refused_and_what_would_be_is_a_value_error() -> None:
    params = tag_request({}, "s", "a", 12.5, criticality=0.25)["kv_transfer_params"]
    assert check_request_params(params) == []
    for bad in ({"tool_wait_s": 1e308}, {"tool_wait_s": NAN}, {"criticality": 1.5}):
        with pytest.raises(ValueError, match="tag_request: kvtier_"):
            tag_request({}, "s", "a", **bad)
    with pytest.raises(ValueError, match="longer than 256 bytes"):
        tag_request({}, "s" * 300, "a")


@given(st.dictionaries(st.sampled_from(sorted(VALIDATORS) + ["kvtier_x", "other"]),
                       st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=300),
                                 st.lists(st.lists(st.integers(), max_size=3), max_size=3)), max_size=8))
def test_a_key_is_listed_exactly_when_it_reads_as_absent(params) -> None:
    listed = {p.key for p in check_request_params(params)}
    for key in VALIDATORS:
        if key in params:
            value = read_param(params, key)
            refused = value is None
            assert refused == (key in listed) or key in ("kvtier_round_id", "kvtier_shared_tokens")
            if isinstance(value, float):
                assert math.isfinite(value)
    assert ("kvtier_x" in params) == ("kvtier_x" in listed)
    assert "other" not in listed


def test_module_doctests_and_tenant_sessions_never_collide() -> None:
    """``tenant_session`` keys the connector's agents: the default tenant's ids stay bare, and no
    session id of one tenant (separator included) names another tenant's session."""
    import doctest

    import kvtier.sdk.params as params

    assert doctest.testmod(params).failed == 0
    sep = params.TENANT_SEP
    tenants = ["", "default", "acme", "ac", "me", f"a{sep}b", "4:acme"]
    sessions = ["s", f"acme{sep}s", f"4:acme{sep}s", f"{sep}", "me"]
    keys = {}
    for t in tenants:
        for sid in sessions:
            key = params.tenant_session(t, sid)
            owner = keys.setdefault(key, (t or "default", sid))
            assert owner == (t or "default", sid), f"{(t, sid)} and {owner} share the key {key!r}"
    assert params.tenant_session("", "s") == params.tenant_session("default", "s") == "s"
