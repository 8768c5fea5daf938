"""Hint-plane faults over real gRPC: the server SIGKILLed and restarted under
load, and one client flooding sessions while another goes about its work.

(``tests/test_hints_sdk.py`` already checks that ``emit`` stays non-blocking
through a restart; here the point is what the *server* ends up knowing: the
new process gets back every session the client still has live (the SDK
announces them again), rebuilds the rest from the events sent after the
restart, and what was lost in between is counted on the client, never
raised.)
"""

from __future__ import annotations

import os
import signal as os_signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from fault_support import FIGURES, NOTES
from hints_support import ServerThread, free_port, stub

from kvtier.agents.graph import GraphLimits
from kvtier.hints._gen import hints_pb2 as pb
from kvtier.sdk import HintClient

ROOT = Path(__file__).resolve().parents[2]


def _start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--listen", f"127.0.0.1:{port}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()
    assert f"127.0.0.1:{port}" in line, line
    return proc


def _session_info(address: str, session_id: str):
    channel, st = stub(address)
    try:
        return st.GetStats(pb.GetStatsRequest(session_id=session_id), timeout=5)
    finally:
        channel.close()


def _lifecycle(client: HintClient, sid: str) -> None:
    client.emit("session_start", session_id=sid)
    client.emit("agent_spawn", session_id=sid, agent_id="root", agent_type="planner")
    client.emit("tool_call_start", session_id=sid, agent_id="root", tool_call_id="t", tool_name="search")
    client.emit("tool_call_end", session_id=sid, agent_id="root", tool_call_id="t", status="ok")
    client.emit("agent_end", session_id=sid, agent_id="root", status="completed")
    client.emit("session_end", session_id=sid)


def test_server_killed_under_load_is_rebuilt_from_later_events_and_drops_are_counted() -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    server = _start_server(port)
    client = HintClient(address, client_id="agentfw", flush_interval_s=0.002, backoff_initial_s=0.02,
                        backoff_max_s=0.1, max_batch_attempts=2, rpc_timeout_s=1.0, max_queue_events=2_000)
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            _lifecycle(client, f"load-{i}")
            i += 1
            time.sleep(0.001)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        client.emit("session_start", session_id="before")
        client.emit("agent_spawn", session_id="before", agent_id="root")
        # The loader keeps the queue busy, so wait for the events, not for an empty queue.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if len(_session_info(address, "before").session.agents) == 1:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        assert len(_session_info(address, "before").session.agents) == 1
        server.send_signal(os_signal.SIGKILL)  # under load
        server.wait(10)
        FIGURES["faults_injected"] += 1
        time.sleep(0.8)
        during = client.stats()
        assert not during.connected and during.num_dropped > 0
        server = _start_server(port)
        deadline = time.monotonic() + 20
        while client.stats().accepted <= during.accepted and time.monotonic() < deadline:
            time.sleep(0.05)
        # The SDK announced "before" (still live) to the new process; later events build new trees.
        client.emit("session_start", session_id="after")
        client.emit("agent_spawn", session_id="after", agent_id="root", agent_type="planner")
        client.emit("agent_spawn", session_id="after", agent_id="child", parent_agent_id="root")
        client.emit("tool_call_start", session_id="after", agent_id="child", tool_call_id="t1", tool_name="python",
                    expected_duration_s=2.0)
        client.emit("agent_spawn", session_id="before", agent_id="late")  # a session from before the restart
        stop.set()
        loader.join()
        assert client.flush(60)
        after = client.stats()
        info = _session_info(address, "after")
        before = _session_info(address, "before")
    finally:
        stop.set()
        client.close(2)
        server.send_signal(os_signal.SIGTERM)
        server.wait(10)
    assert {a.agent_id for a in before.session.agents} == {"root", "late"}  # announced again, then extended
    agents = {a.agent_id: a for a in info.session.agents}
    assert set(agents) == {"root", "child"} and agents["child"].parent_agent_id == "root"
    assert [t.tool_call_id for t in info.session.tool_calls] == ["t1"]
    assert after.connected and after.reconnects >= 1 and after.accepted > during.accepted
    assert after.reannounced_sessions >= 1
    assert after.rejected == 0  # after the restart nothing is refused: lost events are drops, counted above
    assert after.dropped["unavailable"] + after.dropped["queue_full"] > 0
    dropped = {k: v for k, v in after.dropped.items() if v}
    NOTES.append(f"hint restart: accepted {after.accepted}, dropped {dropped}"
                 f", rejected {after.rejected}, reconnects {after.reconnects}")
    FIGURES["faults_survived"] += 1


def test_one_client_flooding_sessions_is_capped_without_starving_another() -> None:
    cap = 50
    limits = GraphLimits(max_sessions=400, max_sessions_per_tenant=400, max_sessions_per_client=cap)
    with ServerThread(graph_limits=limits) as s:
        flood = HintClient(s.address, client_id="flood", max_queue_events=100_000)
        calm = HintClient(s.address, client_id="calm")
        stop = threading.Event()

        def flooding() -> None:
            i = 0
            while not stop.is_set() and i < 20_000:
                flood.emit("session_start", session_id=f"f{i}")  # never ends them
                i += 1

        t = threading.Thread(target=flooding)
        t.start()
        try:
            for i in range(30):  # the well-behaved client keeps working through the flood
                calm.emit("session_start", session_id=f"c{i}")
                calm.emit("agent_spawn", session_id=f"c{i}", agent_id="root")
                if i % 2:
                    calm.emit("session_end", session_id=f"c{i}")
                time.sleep(0.005)
        finally:
            stop.set()
            t.join()
        assert flood.flush(30) and calm.flush(30)
        fs, cs = flood.stats(), calm.stats()
        flood.close(2)
        calm.close(2)
        by_client = s.call(lambda: [x.client_id for x in s.server.graph.sessions()])
        s.call(s.server.applier.check_invariants)
    FIGURES["faults_injected"] += 1
    FIGURES["flood_events_refused"] += fs.rejected
    assert by_client.count("flood") == cap  # capped ...
    assert fs.rejected == fs.emitted - cap > 0  # ... every refusal counted on the flooding client
    assert cs.rejected == 0 and cs.accepted == cs.emitted == 75  # the other client lost nothing
    assert by_client.count("calm") == 15
    FIGURES["faults_survived"] += 1
