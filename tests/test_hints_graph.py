"""AgentGraph scenarios (pure, no grpc) and a seeded random stress run that
checks every invariant after each operation."""

from __future__ import annotations

import random

import pytest

from kvtier.agents import AgentGraph, DurationHistory, GraphLimits


def _graph(**limits) -> AgentGraph:
    g = AgentGraph(GraphLimits(**limits))
    assert g.start_session("t", "s", now_s=0.0) is None
    return g


def test_tool_call_prediction_blends_estimate_and_history():
    g = _graph()
    g.spawn_agent("t", "s", "a", 0.0, agent_type="coder")
    # No history: the client's estimate, or nothing.
    g.start_tool_call("t", "s", "a", "c0", "bash", expected_s=3.0, now_s=10.0)
    g.start_tool_call("t", "s", "a", "c1", "grep", expected_s=None, now_s=10.0)
    calls = g.session("t", "s").agents["a"].tool_calls
    assert (calls["c0"].predicted_return_s, calls["c1"].predicted_return_s) == (13.0, None)
    # Three bash calls of 1 s each: the EWMA is 1.0; with 3 samples w = 3/6.
    for i in range(3):
        g.start_tool_call("t", "s", "a", f"h{i}", "bash", expected_s=None, now_s=20.0 + i)
        g.end_tool_call("t", "s", "a", f"h{i}", now_s=21.0 + i)
    g.start_tool_call("t", "s", "a", "c2", "bash", expected_s=5.0, now_s=30.0)
    assert calls["c2"].predicted_s == pytest.approx(0.5 * 1.0 + 0.5 * 5.0)
    # Another agent type has no own history: the tool's pooled entry answers.
    g.spawn_agent("t", "s", "b", 0.0, agent_type="planner")
    g.start_tool_call("t", "s", "b", "c3", "bash", expected_s=None, now_s=30.0)
    assert g.session("t", "s").agents["b"].tool_calls["c3"].predicted_s == pytest.approx(1.0)
    g.check_invariants()


def test_history_is_bounded():
    h = DurationHistory(max_keys=4)
    for i in range(10):
        h.observe("a", f"tool{i}", 1.0)
    assert len(h) == 4


def test_dependency_cycles_are_refused():
    g = _graph()
    for a in "abc":
        g.spawn_agent("t", "s", a, 0.0)
    assert g.add_dependency("t", "s", "a", "b", 0.0) is None
    assert g.add_dependency("t", "s", "b", "c", 0.0) is None
    assert g.add_dependency("t", "s", "c", "a", 0.0).reason == "cycle"
    assert g.add_dependency("t", "s", "a", "a", 0.0).reason == "cycle"
    assert g.add_dependency("t", "s", "a", "b", 0.0) is None  # repeating an edge is harmless
    assert g.session("t", "s").num_edges == 2
    g.check_invariants()


def test_critical_path_follows_the_longest_expected_remaining_work():
    g = _graph()
    for a in ("root", "fast", "slow"):
        g.spawn_agent("t", "s", a, 0.0)
    g.add_dependency("t", "s", "fast", "root", 0.0)
    g.add_dependency("t", "s", "slow", "root", 0.0)
    g.start_tool_call("t", "s", "slow", "x", "build", expected_s=60.0, now_s=0.0)
    assert g.critical_path("t", "s", now_s=1.0) == ["slow", "root"]
    g.end_agent("t", "s", "slow", now_s=2.0)  # finished agents leave the path
    assert g.critical_path("t", "s", now_s=2.0) == ["fast", "root"]


def test_limits_refuse_and_name_the_setting():
    g = _graph(max_sessions=2, max_agents_per_session=2, max_tool_calls_per_session=1,
               max_stored_block_key_bytes=32)
    assert g.start_session("t", "s2", 0.0) is None
    r = g.start_session("t", "s3", 0.0)
    assert (r.reason, r.field) == ("limit", "session_id") and "GraphLimits.max_sessions=2" in r.message
    g.spawn_agent("t", "s", "a", 0.0)
    g.spawn_agent("t", "s", "b", 0.0)
    assert "max_agents_per_session=2" in g.spawn_agent("t", "s", "c", 0.0).message
    g.start_tool_call("t", "s", "a", "x", "bash", expected_s=None, now_s=0.0)
    assert g.start_tool_call("t", "s", "b", "y", "bash", expected_s=None, now_s=0.0).reason == "limit"
    assert g.start_request("t", "s", "a", "r", 0.0, prompt_keys=bytes(48)).field == "prompt_block_keys"
    assert g.start_request("t", "s", "a", "r", 0.0, prompt_keys=bytes(32)) is None
    g.check_invariants()


def test_per_client_and_per_tenant_session_limits():
    g = AgentGraph(GraphLimits(max_sessions_per_client=1, max_sessions_per_tenant=2))
    assert g.start_session("t", "a", 0.0, client_id="c1") is None
    assert "max_sessions_per_client=1" in g.start_session("t", "b", 0.0, client_id="c1").message
    assert g.start_session("t", "b", 0.0, client_id="c2") is None
    assert "max_sessions_per_tenant=2" in g.start_session("t", "c", 0.0, client_id="c3").message
    assert g.start_session("u", "c", 0.0, client_id="c1") is None  # another tenant has its own budget
    g.end_session("t", "a", 1.0)
    assert g.start_session("t", "d", 1.0, client_id="c1") is None  # the slot came back
    g.check_invariants()


def test_expiry_frees_everything_of_idle_sessions():
    g = _graph(session_ttl_s=10.0)
    g.spawn_agent("t", "s", "a", 0.0)
    g.start_request("t", "s", "a", "r", 0.0, prompt_keys=bytes(64))
    g.start_session("t", "busy", 0.0)
    g.spawn_agent("t", "busy", "a", 9.0)  # touching a session keeps it alive
    assert [s.session_id for s in g.expire(now_s=15.0)] == ["s"]
    assert (g.num_sessions, g.num_agents, g.stored_key_bytes) == (1, 1, 0)
    g.check_invariants()


def test_ended_agents_refuse_new_work_and_drop_work_in_flight():
    g = _graph()
    g.spawn_agent("t", "s", "a", 0.0)
    g.start_tool_call("t", "s", "a", "x", "bash", expected_s=1.0, now_s=0.0)
    g.start_request("t", "s", "a", "r", 0.0)
    g.end_agent("t", "s", "a", 1.0)
    assert g.num_tool_calls == 0
    assert g.start_request("t", "s", "a", "r2", 2.0).reason == "ended"
    assert g.set_priority("t", "s", "a", 3, 2.0) is None  # a priority may still be recorded
    g.check_invariants()


def test_random_operations_keep_every_invariant():
    # Seeded stress: random valid and invalid operations over a tiny id space,
    # tight limits; invariants after every step, sizes never past the limits.
    rng = random.Random(7)
    limits = GraphLimits(max_sessions=6, max_sessions_per_tenant=4, max_sessions_per_client=3, max_agents=20,
                         max_agents_per_session=5, max_tool_calls=8, max_tool_calls_per_session=3,
                         max_requests_in_flight_per_agent=2, max_edges_per_session=6, max_shared_rounds_per_session=2,
                         max_stored_block_key_bytes=16 * 40, max_history_keys=5, session_ttl_s=30.0)
    g = AgentGraph(limits)
    pick = lambda xs: rng.choice(xs)  # noqa: E731
    tenants, sessions, agents = ["t1", "t2"], ["s1", "s2", "s3", "s4"], ["a", "b", "c", "d", "e", "f"]
    now = 0.0
    for _ in range(4000):
        now += rng.random()
        t, s, a, b = pick(tenants), pick(sessions), pick(agents), pick(agents)
        op = rng.randrange(12)
        if op == 0:
            g.start_session(t, s, now, client_id=pick(["c1", "c2"]))
        elif op == 1:
            g.end_session(t, s, now)
        elif op == 2:
            g.spawn_agent(t, s, a, now, parent_id=pick([None, b]), agent_type=pick(["x", "y"]))
        elif op == 3:
            g.end_agent(t, s, a, now)
        elif op == 4:
            g.add_dependency(t, s, a, b, now)
        elif op == 5:
            g.start_request(t, s, a, pick(["r1", "r2", "r3"]), now, prompt_keys=bytes(16 * rng.randrange(12)))
        elif op == 6:
            g.end_request(t, s, a, pick(["r1", "r2", "r3"]), now)
        elif op == 7:
            g.start_tool_call(t, s, a, pick(["x1", "x2"]), pick(["bash", "grep"]),
                              expected_s=pick([None, rng.random() * 5]), now_s=now)
        elif op == 8:
            g.end_tool_call(t, s, a, pick(["x1", "x2"]), now)
        elif op == 9:
            g.start_shared_round(t, s, pick(["r1", "r2", "r3"]), (a, b), bytes(16 * rng.randrange(8)), now)
        elif op == 10:
            g.end_shared_round(t, s, pick(["r1", "r2", "r3"]), now)
        else:
            now += pick([0.0, 0.0, 0.0, 40.0])  # sometimes everything idles past the TTL
            g.expire(now)
            g.critical_path(t, s, now)
        g.check_invariants()
    assert g.num_expired_sessions > 0
