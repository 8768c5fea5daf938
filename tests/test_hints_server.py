"""The hints server over real gRPC (loopback TCP and a unix socket): every event
type round-trips into the AgentGraph, each bad-input class is INVALID_ARGUMENT
naming the field, duplicates apply once, streams count rejections, commands
reach a store, health and metrics answer."""

from __future__ import annotations

import math
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hints_support import ServerThread, batch, command, keys, now_us, signal, stub

from kvtier.agents.graph import GraphLimits
from kvtier.hints._gen import hints_pb2 as pb
from kvtier.hints.apply import HintLimits


@pytest.fixture(scope="module")
def srv():
    with ServerThread(metrics_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    channel, st = stub(srv.address)
    yield st
    channel.close()


def _session(client, sid: str, *agents: str) -> None:
    events = [signal("session_start", session_id=sid, model="m")]
    events += [signal("agent_spawn", session_id=sid, agent_id=a, agent_type="coder") for a in agents]
    client.Publish(batch(*events, skip_invalid=True))  # idempotent set-up: repeats are rejected, not fatal


def _invalid(client, req) -> str:
    with pytest.raises(grpc.RpcError) as info:
        client.Publish(req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details()


def test_every_event_type_round_trips_into_the_graph(srv, client):
    # One batch with every signal kind, then every command kind; GetStats shows the result.
    sid = "rt"
    resp = client.Publish(batch(
        signal("session_start", session_id=sid, model="m"),
        signal("agent_spawn", session_id=sid, agent_id="root", agent_type="planner",
               importance=pb.IMPORTANCE_HIGH, expected_num_requests=4),
        signal("agent_spawn", session_id=sid, agent_id="kid", parent_agent_id="root", agent_type="coder",
               join_group="g1"),
        signal("agent_spawn", session_id=sid, agent_id="gone", parent_agent_id="root"),
        signal("dependency", session_id=sid, from_agent_id="kid", to_agent_id="root"),
        signal("request_start", session_id=sid, agent_id="root", request_id="r1", prompt_block_keys=keys(1, 2, 3),
               num_prompt_tokens=48, model="m"),
        signal("request_end", session_id=sid, agent_id="root", request_id="r1", num_output_tokens=7,
               stop=pb.STOP_REASON_TOOL_USE),
        signal("request_start", session_id=sid, agent_id="kid", request_id="r2"),
        signal("tool_call_start", session_id=sid, agent_id="root", tool_call_id="t1", tool_name="bash",
               expected_duration_s=30.0),
        signal("tool_call_start", session_id=sid, agent_id="kid", tool_call_id="t2", tool_name="grep"),
        signal("tool_call_end", session_id=sid, agent_id="kid", tool_call_id="t2", status=pb.TOOL_STATUS_OK),
        signal("shared_round_start", session_id=sid, round_id="fan", agent_ids=["root", "kid"],
               shared_block_keys=keys(1, 2)),
        signal("shared_round_start", session_id=sid, round_id="done", agent_ids=["kid"]),
        signal("shared_round_end", session_id=sid, round_id="done"),
        signal("agent_end", session_id=sid, agent_id="gone", status=pb.AGENT_STATUS_COMPLETED),
        command("priority", session_id=sid, agent_id="kid", priority=pb.PRIORITY_HIGH),
    ))
    assert (resp.num_accepted, resp.num_rejected, resp.num_duplicates) == (16, 0, 0)
    # no store: block-key commands are refused, each saying why (never accepted and dropped)
    resp = client.Publish(batch(
        command("pin", session_id=sid, block_keys=keys(1, 2), ttl_s=5.0),
        command("unpin", session_id=sid, block_keys=keys(2)),
        command("prefetch", session_id=sid, block_keys=keys(3), tier=pb.TIER_DRAM), skip_invalid=True))
    assert (resp.num_accepted, resp.num_rejected) == (0, 3)
    assert [(r.field, r.reason) for r in resp.rejections] == [
        (f"commands[{i}].{k}.block_keys", "no_store") for i, k in enumerate(("pin", "unpin", "prefetch"))]
    assert all("no store" in r.message and "--store" in r.message for r in resp.rejections)
    stats = client.GetStats(pb.GetStatsRequest(session_id=sid))
    info = stats.session
    agents = {a.agent_id: a for a in info.agents}
    assert sorted(agents) == ["gone", "kid", "root"]
    assert agents["root"].importance == pb.IMPORTANCE_HIGH and agents["root"].num_requests == 1
    assert agents["root"].num_prompt_blocks == 3 and list(agents["root"].depends_on) == ["kid"]
    assert agents["kid"].parent_agent_id == "root" and agents["kid"].join_group == "g1"
    assert agents["kid"].num_requests_in_flight == 1 and agents["kid"].priority == pb.PRIORITY_HIGH
    assert agents["gone"].ended
    # t1 is in flight with the client's 30 s estimate (no history for planner/bash yet); t2 returned.
    [call] = info.tool_calls
    assert (call.tool_call_id, call.tool_name) == ("t1", "bash")
    assert 29.0 < call.predicted_remaining_s <= 30.0
    rounds = [(r.round_id, list(r.agent_ids), r.num_block_keys) for r in info.shared_rounds]
    assert rounds == [("fan", ["root", "kid"], 2)]
    assert list(info.critical_path) == ["kid", "root"]  # root waits for kid
    assert stats.events_by_type["session_start"] >= 1 and stats.events_by_type["priority"] >= 1
    assert stats.rejections_by_reason["no_store"] == 3
    # session_end removes everything of the session.
    client.Publish(batch(signal("session_end", session_id=sid)))
    with pytest.raises(grpc.RpcError) as info_err:
        client.GetStats(pb.GetStatsRequest(session_id=sid))
    assert info_err.value.code() == grpc.StatusCode.NOT_FOUND
    srv.call(srv.server.applier.check_invariants)


@pytest.mark.parametrize("event, field", [
    (lambda: signal("agent_spawn", session_id="v", agent_id="x", importance=99), "signals[0].agent_spawn.importance"),
    (lambda: signal("tool_call_end", session_id="v", agent_id="a", tool_call_id="t", status=42),
     "signals[0].tool_call_end.status"),
    (lambda: command("prefetch", session_id="v", block_keys=keys(1), tier=17), "commands[0].prefetch.tier"),
    (lambda: signal("agent_spawn", session_id="v", agent_id=""), "signals[0].agent_spawn.agent_id"),
    (lambda: signal("session_start", session_id=""), "signals[0].session_start.session_id"),
    (lambda: signal("session_start", event_id=0, session_id="z"), "signals[0].event_id"),
    (lambda: signal("session_start", ts=0, session_id="z"), "signals[0].client_time_unix_us"),
    (lambda: pb.Signal(event_id=77, client_time_unix_us=now_us()), "signals[0].kind"),
    (lambda: signal("session_start", ts=now_us() + 3_600_000_000, session_id="z"), "signals[0].client_time_unix_us"),
    (lambda: signal("request_start", session_id="v", agent_id="a", request_id="r", prompt_block_keys=b"x" * 17),
     "signals[0].request_start.prompt_block_keys"),
    (lambda: signal("tool_call_start", session_id="v", agent_id="a", tool_call_id="t", tool_name="b",
                    expected_duration_s=math.nan), "signals[0].tool_call_start.expected_duration_s"),
    (lambda: command("pin", session_id="v", block_keys=keys(1), ttl_s=-1.0), "commands[0].pin.ttl_s"),
    (lambda: signal("agent_spawn", session_id="nope", agent_id="x"), "signals[0].agent_spawn.session_id"),
    (lambda: signal("agent_spawn", session_id="v", agent_id="x", parent_agent_id="ghost"),
     "signals[0].agent_spawn.parent_agent_id"),
    (lambda: signal("session_start", session_id="s" * 300), "signals[0].session_start.session_id"),
])
def test_each_bad_input_class_is_invalid_argument_naming_the_field(client, event, field):
    _session(client, "v", "a")
    details = _invalid(client, batch(event()))
    assert details.startswith(f"{field}: "), details


def test_dependency_cycle_is_rejected_and_the_dag_stays_acyclic(srv, client):
    _session(client, "cyc", "a", "b", "c")
    client.Publish(batch(signal("dependency", session_id="cyc", from_agent_id="a", to_agent_id="b"),
                         signal("dependency", session_id="cyc", from_agent_id="b", to_agent_id="c")))
    details = _invalid(client, batch(signal("dependency", session_id="cyc", from_agent_id="c", to_agent_id="a")))
    assert details.startswith("signals[0].dependency.to_agent_id: ") and "[cycle]" in details
    srv.call(srv.server.applier.check_invariants)


def test_oversize_batch_is_invalid_even_with_skip_invalid():
    with ServerThread(limits=HintLimits(max_batch_events=4)) as s:
        channel, st = stub(s.address)
        events = [signal("session_start", session_id=f"o{i}") for i in range(5)]
        for skip in (False, True):
            details = _invalid(st, batch(*events, skip_invalid=skip))
            assert details.startswith("signals: 5 events; HintLimits.max_batch_events=4")
        assert s.call(lambda: s.server.graph.num_sessions) == 0  # nothing applied
        channel.close()


def test_limit_is_resource_exhausted_naming_the_setting():
    with ServerThread(graph_limits=GraphLimits(max_sessions=2)) as s:
        channel, st = stub(s.address)
        st.Publish(batch(*[signal("session_start", session_id=f"l{i}") for i in range(2)]))
        with pytest.raises(grpc.RpcError) as info:
            st.Publish(batch(signal("session_start", session_id="l2")))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "GraphLimits.max_sessions=2" in info.value.details()
        channel.close()


def test_strict_batch_stops_at_the_first_bad_event_and_keeps_serving(srv, client):
    # Events before the bad one stay applied; the server answers the next call normally.
    bad = batch(signal("session_start", session_id="p1"), signal("agent_spawn", session_id="p1", agent_id=""),
                signal("session_start", session_id="p2"))
    details = _invalid(client, bad)
    assert "1 earlier events were applied" in details
    assert client.GetStats(pb.GetStatsRequest(session_id="p1")).session.session_id == "p1"
    with pytest.raises(grpc.RpcError):
        client.GetStats(pb.GetStatsRequest(session_id="p2"))
    # skip_invalid: the bad event is listed, the rest applied.
    resp = client.Publish(batch(signal("session_start", session_id="p3"), signal("agent_spawn", session_id="p3"),
                                signal("session_start", session_id="p4"), skip_invalid=True))
    assert (resp.num_accepted, resp.num_rejected) == (2, 1)
    assert resp.rejections[0].field == "signals[1].agent_spawn.agent_id" and resp.rejections[0].reason == "missing"


def test_duplicate_event_ids_are_applied_once(srv, client):
    start = signal("session_start", session_id="dup")
    spawn = signal("agent_spawn", session_id="dup", agent_id="a")
    call = signal("tool_call_start", session_id="dup", agent_id="a", tool_call_id="t", tool_name="bash")
    first = client.Publish(batch(start, spawn, call))
    again = client.Publish(batch(start, spawn, call, call))  # a retried batch, plus a repeat inside it
    assert (first.num_accepted, first.num_duplicates) == (3, 0)
    assert (again.num_accepted, again.num_duplicates) == (0, 4)
    assert len(client.GetStats(pb.GetStatsRequest(session_id="dup")).session.tool_calls) == 1


def test_dedupe_window_is_bounded():
    with ServerThread(limits=HintLimits(dedupe_window_events=8)) as s:
        channel, st = stub(s.address)
        st.Publish(batch(*[signal("session_start", session_id=f"w{i}") for i in range(20)]))
        assert s.call(lambda: s.server.applier.dedupe_size) == 8
        s.call(s.server.applier.check_invariants)
        channel.close()


def test_stream_counts_rejections_and_goes_on(srv, client):
    def messages():
        yield batch(signal("session_start", session_id="st"), signal("agent_spawn", session_id="st", agent_id="a"))
        yield batch(signal("agent_spawn", session_id="st", agent_id="a"),            # duplicate agent id
                    signal("agent_spawn", session_id="nope", agent_id="b"),          # unknown session
                    signal("agent_spawn", session_id="st", agent_id="c", importance=9))  # unknown enum
        yield batch(signal("session_end", session_id="st"))

    summary = client.PublishStream(messages())
    assert (summary.num_messages, summary.num_accepted, summary.num_rejected) == (3, 3, 3)
    assert dict(summary.rejected_by_reason) == {"duplicate": 1, "unknown_session": 1, "unknown_enum": 1}
    assert [r.field for r in summary.first_rejections] == [
        "signals[0].agent_spawn.agent_id", "signals[1].agent_spawn.session_id", "signals[2].agent_spawn.importance"]


def test_unix_socket_health_and_metrics(tmp_path):
    address = f"unix:{tmp_path / 'hints.sock'}"
    with ServerThread(address, metrics_port=0) as s:
        assert s.address == address
        channel, st = stub(address)
        resp = st.Publish(batch(signal("session_start", session_id="u"),
                                signal("agent_spawn", session_id="u", agent_id="a"),
                                signal("agent_spawn", session_id="u", agent_id=""), skip_invalid=True))
        assert (resp.num_accepted, resp.num_rejected) == (2, 1)
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvtier.v1.HintService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
        text = urllib.request.urlopen(f"http://127.0.0.1:{s.server.metrics_port}/metrics", timeout=10).read().decode()
        assert 'kvtier_hint_events_total{type="agent_spawn"} 1.0' in text
        assert 'kvtier_hint_rejections_total{reason="missing"} 1.0' in text
        assert "kvtier_hint_sessions 1.0" in text and "kvtier_hint_agents 1.0" in text
        assert "kvtier_hint_tool_calls_in_flight 0.0" in text
        assert "kvtier_tool_predictions_total 0.0" in text and "kvtier_tool_prediction_under_fraction 0.0" in text
        channel.close()


class _FakeStore:
    """Records the commands it receives (the TieredStore interface)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def pin(self, keys, ttl_s=None):
        self.calls.append(("pin", tuple(keys), ttl_s))
        return len(keys) if len(keys) < 3 else None  # a budget of 2 blocks

    def unpin(self, keys):
        self.calls.append(("unpin", tuple(keys)))

    def prefetch(self, keys, tier="dram"):
        self.calls.append(("prefetch", tuple(keys), tier))


def test_commands_are_applied_to_the_store():
    store = _FakeStore()
    with ServerThread(store=store) as s:
        channel, st = stub(s.address)
        st.Publish(batch(signal("session_start", session_id="c"),
                         command("pin", session_id="c", block_keys=keys(1, 2), ttl_s=9.0),
                         command("pin", session_id="c", block_keys=keys(1, 2, 3), ttl_s=9.0),
                         command("unpin", session_id="c", block_keys=keys(2)),
                         command("prefetch", session_id="c", block_keys=keys(5), tier=pb.TIER_UNSPECIFIED)))
        assert store.calls == [("pin", (1, 2), 9.0), ("pin", (1, 2, 3), 9.0), ("unpin", (2,)),
                               ("prefetch", (5,), "dram")]
        outcomes = st.GetStats(pb.GetStatsRequest()).commands_by_outcome
        assert dict(outcomes) == {"pin_applied": 1, "pin_refused_budget": 1, "unpin_applied": 1,
                                  "prefetch_submitted": 1}
        channel.close()


def test_pin_reaches_a_real_tiered_store():
    torch = pytest.importorskip("torch")
    from kvtier.config import load_config
    from kvtier.store import TieredStore

    cfg = load_config(env={}, overrides={"layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_size": 4},
                                         "tiers": {"hbm": {"enabled": False}, "dram": {"capacity_blocks": 4}},
                                         "put_tier": "dram", "pin_budget_blocks": 4})
    with TieredStore(cfg) as store:
        ks = store.keys_for(list(range(8)))
        store.put(ks, [torch.zeros(store.layout.bytes_per_block, dtype=torch.uint8) for _ in ks])
        with ServerThread(store=store) as s:
            channel, st = stub(s.address)
            st.Publish(batch(signal("session_start", session_id="real"),
                             command("pin", session_id="real", block_keys=keys(*ks), ttl_s=60.0)))
            assert store.stats()["pinned_blocks"] == 2
            st.Publish(batch(command("unpin", session_id="real", block_keys=keys(*ks))))
            assert store.stats()["pinned_blocks"] == 0
            channel.close()


def test_abandoned_sessions_expire_after_the_ttl():
    with ServerThread(graph_limits=GraphLimits(session_ttl_s=0.2), expire_interval_s=0.05) as s:
        channel, st = stub(s.address)
        st.Publish(batch(signal("session_start", session_id="old")))
        import time

        deadline = time.monotonic() + 5
        while s.call(lambda: s.server.graph.num_sessions) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.call(lambda: s.server.graph.num_sessions) == 0
        assert st.GetStats(pb.GetStatsRequest()).num_expired_sessions == 1
        channel.close()


def test_non_local_address_needs_a_token():
    from kvtier.hints.server import is_local_address

    assert is_local_address("127.0.0.1:1") and is_local_address("[::1]:1") and is_local_address("unix:/x")
    assert not is_local_address("0.0.0.0:1") and not is_local_address("10.1.2.3:1")
    with pytest.raises(ValueError, match="--allow-unauthenticated-remote"):
        ServerThread("0.0.0.0:0")


def test_undecodable_bytes_are_invalid_argument(srv):
    import grpc as _grpc

    with _grpc.insecure_channel(srv.address) as channel:
        raw_unary = channel.unary_unary("/kvtier.v1.HintService/Publish")
        with pytest.raises(_grpc.RpcError) as info:
            raw_unary(b"\x12\x05\x08", timeout=10)  # truncated
        assert info.value.code() == _grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("request: cannot decode a kvtier.v1.PublishRequest")
        raw_stream = channel.stream_unary("/kvtier.v1.HintService/PublishStream")
        good = batch(signal("session_start", session_id="undec")).SerializeToString()
        summary = pb.PublishSummary.FromString(raw_stream(iter([b"\xff\xff", good]), timeout=10))
        assert (summary.num_messages, summary.num_accepted) == (2, 1)
        assert dict(summary.rejected_by_reason) == {"undecodable": 1}


def test_serve_help_names_every_flag():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--listen", "--unix", "--token-file", "--tls-cert", "--tls-key", "--metrics-port", "--config",
                 "--record", "--store", "--max-events-per-s-per-tenant"):
        assert flag in out.stdout


def test_dedupe_keys_of_tenants_do_not_collide_in_the_hash_table() -> None:
    """Sequential event ids of many tenants hash to distinct values (with the
    plain ``index << 64`` they shared one hash per 8 ids: every probe of the
    dedupe set walked one entry per tenant), and no two tenants share a key."""
    from kvtier.hints.apply import _dedupe_tenant_key

    keys = [_dedupe_tenant_key(t) | e for t in range(1, 65) for e in range(1, 1001)]
    assert len(set(keys)) == len(keys)
    assert len({hash(k) for k in keys}) == len(keys)
    assert len({hash((t << 64) | e) for t in range(1, 65) for e in range(1, 1001)}) < len(keys) // 20
