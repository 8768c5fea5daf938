"""``HintService.Watch`` and the SDK's :class:`AgentsWatcher`: an engine connector
follows a hint server that runs in another process (here: another thread,
over real gRPC on loopback), per tenant, through server restarts."""

from __future__ import annotations

import time

from kvtier.sdk import HintClient
from kvtier.sdk.watch import AgentsWatcher

from hints_support import ServerThread


def _wait(pred, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_a_watcher_sees_agents_tool_calls_criticality_and_ends() -> None:
    srv = ServerThread()
    watcher = AgentsWatcher(srv.address, interval_s=0.02)
    client = HintClient(srv.address)
    try:
        with client.session("s1"):
            with client.agent("lead") as lead:
                with client.agent("helper", parent_id=lead.agent_id) as helper:
                    with helper.tool_call("grep", expected_s=30.0):
                        key = ("s1", helper.agent_id)
                        snap = _wait(lambda: (lambda s: s if s and key in s.agents and
                                              s.agents[key].tool_in_flight else None)(watcher.latest()))
                        h = snap.agents[key]
                        assert h.parent_id == lead.agent_id and h.returns_at_s is not None
                        assert 25.0 < h.returns_at_s - time.monotonic() <= 30.5  # on this host's clock
                        # the helper's 30 s tool call is the longest expected remaining path
                        assert h.criticality == 1.0 > snap.agents[("s1", lead.agent_id)].criticality
                        assert snap.agents[("s1", lead.agent_id)].parent_id is None
                    _wait(lambda: (lambda s: s and not s.agents[key].tool_in_flight)(watcher.latest()))
                _wait(lambda: (lambda s: s and s.agents[key].ended)(watcher.latest()))
        _wait(lambda: (lambda s: s is not None and not any(k[0] == "s1" for k in s.agents))(watcher.latest()))
    finally:
        client.close()
        watcher.close()
        srv.stop()


def test_a_watcher_sees_shared_rounds_while_they_are_in_progress() -> None:
    srv = ServerThread()
    watcher = AgentsWatcher(srv.address, interval_s=0.02)
    client = HintClient(srv.address)
    try:
        with client.session("s1") as session, session.agent("a", agent_id="a0"), session.agent("b", agent_id="a1"):
            with session.shared_round("r1", ["a0", "a1"]):
                snap = _wait(lambda: (lambda s: s if s and s.rounds else None)(watcher.latest()))
                assert snap.rounds == {("s1", "r1"): ("a0", "a1")}
            _wait(lambda: (lambda s: s is not None and not s.rounds)(watcher.latest()))
    finally:
        client.close()
        watcher.close()
        srv.stop()


def test_a_watcher_sees_only_its_tenant_and_needs_a_token_when_auth_is_on() -> None:
    srv = ServerThread(tokens={"tok-a": "a", "tok-b": "b"})
    good = AgentsWatcher(srv.address, token="tok-a", interval_s=0.02)
    bad = AgentsWatcher(srv.address, token="wrong", interval_s=0.02, reconnect_s=0.05)
    client_b = HintClient(srv.address, token="tok-b")
    client_a = HintClient(srv.address, token="tok-a")
    try:
        with client_b.session("sb"), client_b.agent("x"), client_a.session("sa"), client_a.agent("y"):
            snap = _wait(lambda: (lambda s: s if s and s.agents else None)(good.latest()))
            assert {k[0] for k in snap.agents} == {"sa"}
            _wait(lambda: bad.last_error)
            assert "UNAUTHENTICATED" in bad.last_error and bad.latest() is None
    finally:
        client_a.close()
        client_b.close()
        good.close()
        bad.close()
        srv.stop()


def test_a_watcher_reconnects_after_the_server_restarts() -> None:
    srv = ServerThread()
    address = srv.address
    watcher = AgentsWatcher(address, interval_s=0.02, reconnect_s=0.05, stale_after_s=0.5)
    try:
        _wait(lambda: watcher.views)
        srv.stop()
        _wait(lambda: watcher.latest() is None)  # a stalled stream goes stale, never stays current
        srv = ServerThread(address)
        client = HintClient(address)
        with client.session("again"), client.agent("a") as agent:
            _wait(lambda: (lambda s: s and ("again", agent.agent_id) in s.agents)(watcher.latest()))
        client.close()
        assert watcher.reconnects >= 1
    finally:
        watcher.close()
        srv.stop()
