"""A hint server restart mid-stream (issue: every later event was rejected
``unknown_session``): the SDK announces its live sessions, agents, requests
and tool calls again to the new server before anything else, and events after
the restart are accepted. Real server, real SDK, over gRPC on loopback."""

from __future__ import annotations


from hints_support import ServerThread

from kvtier.sdk import AsyncHintClient, HintClient


def _tool_calls(client, n: int) -> None:
    for _ in range(n):
        with client.tool_call("bash", expected_s=0.5):
            pass


def _server_rejections(srv: ServerThread) -> dict[str, int]:
    stats = srv.call(lambda: srv.server.stats("default"))
    return dict(stats.rejections_by_reason)


def _only_lost_state(rejections: dict[str, int]) -> bool:
    """What the new server may have refused: nothing, or one batch sent before the client
    saw the connection go (a loaded machine can reconnect before the channel reports it),
    refused for not knowing the session; the client then announced and sent it again
    (its own count of rejections stays 0, which the callers check)."""
    return set(rejections) <= {"unknown_session", "unknown_agent"}


def test_events_after_a_server_restart_are_accepted() -> None:
    srv = ServerThread()
    address = srv.address
    client = HintClient(address, backoff_initial_s=0.01, backoff_max_s=0.1, max_batch_attempts=2)
    try:
        with client.session("s1"), client.agent("lead") as lead, \
                client.agent("coder", parent_id=lead.agent_id) as coder:
            with client.request("r1"):
                _tool_calls(client, 20)
                assert client.flush(5.0)
                srv.stop()  # killed mid-session: the new server knows nothing of s1
                _tool_calls(client, 3)  # sent while it is down: dropped as unavailable
                client.flush(2.0)
                down = client.stats()
                srv = ServerThread(address)
                _tool_calls(client, 20)
                assert client.flush(5.0)
                after = client.stats()
            assert client.flush(5.0)
            # the new server knows the session, both agents and the parent edge
            agents = srv.call(lambda: {a: v.parent_id for a, v in
                                       srv.server.graph.session("default", "s1").agents.items()})
            assert agents == {lead.agent_id: None, coder.agent_id: lead.agent_id}
        assert client.flush(5.0)
        final = client.stats()
        assert after.rejected == down.rejected and final.rejected == down.rejected, final
        assert _only_lost_state(_server_rejections(srv))
        assert final.reannounced_sessions >= 1 and final.connected and final.last_error == ""
        assert sum(final.rejected_by_reason.values()) == final.rejected
    finally:
        client.close(timeout_s=1.0)
        srv.stop()


def test_the_async_client_announces_again_too() -> None:
    import asyncio

    srv = ServerThread()
    address = srv.address

    async def main() -> tuple:
        nonlocal srv
        async with AsyncHintClient(address, backoff_initial_s=0.01, backoff_max_s=0.1,
                                   max_batch_attempts=2) as client:
            with client.session("s2"), client.agent("solo"):
                _tool_calls(client, 5)
                assert await client.flush(5.0)
                srv.stop()
                srv = ServerThread(address)
                _tool_calls(client, 10)
                assert await client.flush(5.0)
                return client.stats()

    stats = asyncio.run(main())
    try:
        assert stats.rejected == 0 and _only_lost_state(_server_rejections(srv)), (stats, _server_rejections(srv))
        assert stats.reannounced_sessions >= 1
    finally:
        srv.stop()
