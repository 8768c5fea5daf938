"""The agent SDK against a real server: helpers, asyncio twin, drops, and
surviving a server killed (SIGKILL) and restarted mid-stream."""

from __future__ import annotations

import asyncio
import os
import signal as os_signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from hints_support import ServerThread, free_port, stub

from kvtier.hints._gen import hints_pb2 as pb
from kvtier.sdk import AsyncHintClient, HintClient, request_criticality, request_tags, request_tool_wait_s, tag_request

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def srv():
    with ServerThread() as s:
        yield s


def _session_info(address: str, sid: str):
    channel, st = stub(address)
    try:
        return st.GetStats(pb.GetStatsRequest(session_id=sid)).session
    finally:
        channel.close()


def test_helpers_build_the_agent_tree(srv):
    with HintClient(srv.address, flush_interval_s=0.001) as client:
        with client.session("sdk-1"):
            with client.agent("planner", agent_id="planner") as planner:
                with client.request("r1", prompt_block_keys=[1, 2, 3], num_prompt_tokens=50) as req:
                    req.num_output_tokens, req.stop = 12, "tool_use"
                with client.tool_call("bash", expected_s=3.0, tool_call_id="done"):
                    pass
                client.tool_call("grep", expected_s=9.0, tool_call_id="open").start()  # still running
                with client.agent("coder", agent_id="coder") as coder:  # parent: the current agent
                    planner.depends_on(coder)  # the planner waits for its coder
                coder_failed = planner.agent("coder", agent_id="coder2")
                try:
                    with coder_failed:
                        raise ValueError("boom")
                except ValueError:
                    pass
                planner.set_priority("high")
                assert client.flush(10)
                info = _session_info(srv.address, "sdk-1")
        assert client.flush(10)
        stats = client.stats()
    agents = {a.agent_id: a for a in info.agents}
    assert set(agents) == {"planner", "coder", "coder2"}
    assert agents["coder"].parent_agent_id == "planner" and agents["coder2"].parent_agent_id == "planner"
    assert agents["coder"].ended and agents["coder2"].ended and not agents["planner"].ended
    assert list(agents["planner"].depends_on) == ["coder"] and agents["planner"].num_requests == 1
    assert agents["planner"].num_prompt_blocks == 3 and agents["planner"].priority == pb.PRIORITY_HIGH
    assert [(c.tool_call_id, c.tool_name) for c in info.tool_calls] == [("open", "grep")]
    assert stats.rejected == 0 and stats.num_dropped == 0 and stats.accepted == stats.emitted


def test_tool_call_needs_a_current_agent(srv):
    client = HintClient(srv.address, start=False)
    with pytest.raises(RuntimeError, match="current agent"):
        client.tool_call("bash")
    with pytest.raises(RuntimeError, match="current session"):
        client.agent("x")
    with pytest.raises(ValueError, match="unknown hint event kind"):
        client.emit("not_an_event")
    client.close(0.1)


def test_tag_request_adds_ids_without_touching_the_body():
    body = {"model": "m", "kv_transfer_params": {"do_remote_decode": True}}
    tagged = tag_request(body, "s", "a")
    assert body == {"model": "m", "kv_transfer_params": {"do_remote_decode": True}}
    assert tagged["kv_transfer_params"] == {"do_remote_decode": True, "kvtier_session_id": "s",
                                            "kvtier_agent_id": "a"}
    assert request_tags(tagged["kv_transfer_params"]) == ("s", "a")
    assert request_tags(None) == (None, None)


def test_tag_request_carries_an_expected_tool_wait():
    params = tag_request({}, "s", "a", tool_wait_s=12)["kv_transfer_params"]
    assert params["kvtier_tool_wait_s"] == 12.0 and request_tool_wait_s(params) == 12.0
    assert request_tool_wait_s(tag_request({}, "s", "a")["kv_transfer_params"]) is None
    for junk in ("3", -1, float("inf"), True, None):
        assert request_tool_wait_s({"kvtier_tool_wait_s": junk}) is None
    with pytest.raises(ValueError, match="tool_wait_s"):
        tag_request({}, "s", "a", tool_wait_s=0)


def test_tag_request_carries_criticality_and_sets_vllm_priority():
    tagged = tag_request({"model": "m"}, "s", "a", criticality=0.25, critical_path_rank=2)
    assert request_criticality(tagged["kv_transfer_params"]) == 0.25
    assert tagged["priority"] == 2  # vLLM's own request field (honoured with --scheduling-policy priority)
    plain = tag_request({}, "s", "a")
    assert "priority" not in plain and request_criticality(plain["kv_transfer_params"]) is None
    for junk in ("1", -0.1, 1.5, True, None):
        assert request_criticality({"kvtier_criticality": junk}) is None
    with pytest.raises(ValueError, match="criticality"):
        tag_request({}, "s", "a", criticality=2)
    with pytest.raises(ValueError, match="critical_path_rank"):
        tag_request({}, "s", "a", critical_path_rank=-1)


def test_full_queue_and_bad_fields_are_dropped_and_counted(srv):
    client = HintClient(srv.address, max_queue_events=3, start=False)
    results = [client.emit("session_start", session_id=f"q{i}") for i in range(5)]
    assert results == [True, True, True, False, False]
    client.start()
    assert client.flush(10)
    client.emit("agent_spawn", session_id="q9", agent_id="a", importance="bogus")  # an enum name it lacks
    assert client.flush(10)
    client.close()
    stats = client.stats()
    assert stats.dropped["queue_full"] == 2 and stats.dropped["invalid"] == 1 and stats.accepted == 3
    assert "BOGUS" in stats.last_error


@pytest.mark.parametrize("fields, says", [
    (dict(expected_s=3), "'tool_call_start' has no field 'expected_s'; its fields: "),  # a real miss: 2,738 lost
    (dict(expected_duration_s="3"), "field 'expected_duration_s' takes int or float, got str '3'"),
    (dict(tool_name=5), "field 'tool_name' takes str, got int 5"),
])
def test_misspelled_or_mistyped_fields_raise_at_emit(fields: dict, says: str, caplog) -> None:
    client = HintClient("127.0.0.1:1", start=False)
    base = dict(session_id="s", agent_id="a", tool_call_id="t", tool_name="bash")
    with pytest.raises(TypeError) as err:
        client.emit("tool_call_start", **{**base, **fields})
    assert says in str(err.value)
    assert client.stats().emitted == 0  # nothing queued
    client.close(timeout_s=0.1)


def test_the_first_drop_of_each_reason_is_logged(caplog) -> None:
    client = HintClient("127.0.0.1:1", max_queue_events=1, start=False)
    with caplog.at_level("WARNING", logger="kvtier.sdk"):
        for i in range(3):
            client.emit("session_start", session_id=f"s{i}")
    warnings = [r for r in caplog.records if "queue_full" in r.getMessage()]
    assert len(warnings) == 1 and client.stats().dropped["queue_full"] == 2
    assert "127.0.0.1:1" in warnings[0].getMessage()  # which server: a wrong port is otherwise silent
    client.close(timeout_s=0.1)


def test_emit_is_cheap_on_the_caller_thread(srv):
    with HintClient(srv.address) as client:
        samples = []
        for i in range(2000):
            t0 = time.perf_counter_ns()
            client.emit("session_start", session_id=f"cheap-{i}")
            samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    assert samples[len(samples) // 2] < 50_000  # generous: the benchmark reports the real p99


def test_async_client_round_trip(srv):
    async def main():
        async with AsyncHintClient(srv.address, flush_interval_s=0.001) as client:
            async with client.session("async-1"):
                async with client.agent("planner", agent_id="p") as planner:
                    async with client.tool_call("bash", expected_s=1.0, tool_call_id="t"):
                        await asyncio.sleep(0)
                    async with planner.request("r", prompt_block_keys=b"\x00" * 32) as req:
                        req.stop = "end_turn"
                    client.tool_call("wait", tool_call_id="open").start()
                    assert await client.flush(10)
                    info = await asyncio.to_thread(_session_info, srv.address, "async-1")
            assert await client.flush(10)
            return info, client.stats()

    info, stats = asyncio.run(main())
    [agent] = info.agents
    assert (agent.agent_id, agent.num_requests, agent.num_prompt_blocks) == ("p", 1, 2)
    assert [c.tool_call_id for c in info.tool_calls] == ["open"]
    assert stats.accepted == stats.emitted and stats.num_dropped == 0


def test_async_client_survives_no_server():
    port = free_port()

    async def main():
        client = AsyncHintClient(f"127.0.0.1:{port}", max_batch_attempts=2, backoff_initial_s=0.01,
                                 backoff_max_s=0.02, rpc_timeout_s=0.5)
        await client.start()
        for i in range(10):
            assert client.emit("session_start", session_id=f"x{i}")
        await client.flush(5)
        await client.close(1)
        return client.stats()

    stats = asyncio.run(main())
    assert stats.dropped["unavailable"] + stats.dropped["closed"] == 10 and not stats.connected


def _start_cli_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--listen", f"127.0.0.1:{port}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()  # "kvtier hints server on ..." once it serves
    assert f"127.0.0.1:{port}" in line, line
    return proc


def test_sdk_survives_server_kill_and_restart_mid_stream():
    # `kvtier serve` in a subprocess; an agent thread emits all the time. The
    # server is SIGKILLed and restarted on the same port while it emits.
    port = free_port()
    server = _start_cli_server(port)
    client = HintClient(f"127.0.0.1:{port}", flush_interval_s=0.002, backoff_initial_s=0.02, backoff_max_s=0.1,
                        max_batch_attempts=2, rpc_timeout_s=1.0, max_queue_events=2_000)
    stop = threading.Event()
    slowest = [0.0]

    def agent_loop() -> None:
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            client.emit("session_start", session_id=f"before-restart-{i}")  # never raises, never blocks
            slowest[0] = max(slowest[0], time.perf_counter() - t0)
            i += 1
            time.sleep(0.0005)

    agent = threading.Thread(target=agent_loop)
    agent.start()
    try:
        time.sleep(0.5)
        before = client.stats()
        assert before.accepted > 0 and before.connected
        server.send_signal(os_signal.SIGKILL)
        server.wait(10)
        time.sleep(1.0)  # outage: batches fail, the queue fills, drops are counted
        during = client.stats()
        assert during.num_dropped > 0 and not during.connected
        server = _start_cli_server(port)
        deadline = time.monotonic() + 20
        while client.stats().accepted <= during.accepted and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        agent.join()
        assert client.flush(10)
        after = client.stats()
    finally:
        stop.set()
        client.close(2)
        server.send_signal(os_signal.SIGTERM)
        server.wait(10)
    assert after.accepted > during.accepted and after.connected and after.reconnects >= 1
    assert after.dropped["unavailable"] + after.dropped["queue_full"] > 0
    assert slowest[0] < 0.05  # emit() stayed a bounded enqueue during the outage


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "test"


def _drive(client: HintClient, outcomes: list) -> list:
    """Run one batch through the I/O-free send protocol both clients share: each publish
    gets the next outcome; returns what the protocol asked for, in order."""
    steps = client._send_steps("batch", 7)
    asked, out = [], None
    while True:
        try:
            step = steps.send(out)
        except StopIteration:
            return asked
        asked.append(step if not isinstance(step, float) else ("sleep", step))
        out = None if isinstance(step, float) else outcomes.pop(0)


def test_one_send_protocol_retries_backs_off_and_drops_as_both_clients_do() -> None:
    client = HintClient("127.0.0.1:1", start=False, max_batch_attempts=3, backoff_initial_s=0.1, backoff_max_s=0.3)
    unavailable = _Failed(grpc.StatusCode.UNAVAILABLE)
    asked = _drive(client, [unavailable, unavailable, unavailable])
    assert [a if isinstance(a, str) else a[0] for a in asked] == ["batch", "sleep"] * 3
    sleeps = [a[1] for a in asked if not isinstance(a, str)]
    assert 0.05 <= sleeps[0] <= 0.15 and 0.1 <= sleeps[1] <= 0.3 and 0.15 <= sleeps[2] <= 0.45  # doubling, capped
    assert client.stats().dropped["unavailable"] == 7
    # a final error drops at once, no retry, no backoff
    assert _drive(client, [_Failed(grpc.StatusCode.UNAUTHENTICATED)]) == ["batch"]
    assert client.stats().dropped["unauthenticated"] == 7
    # a failure then a success: sent, and the backoff starts over
    ok = pb.PublishResponse(num_accepted=7)
    assert [a if isinstance(a, str) else "sleep" for a in _drive(client, [unavailable, ok])] == ["batch", "sleep", "batch"]
    assert client.stats().accepted == 7 and client._next_backoff_s == 0.1
