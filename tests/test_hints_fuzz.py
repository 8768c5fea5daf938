"""Hypothesis fuzz of the hints server over real gRPC: random well-typed batches
and byte-mutated ones never crash it, every answer is OK / INVALID_ARGUMENT /
RESOURCE_EXHAUSTED (or a parse failure), it keeps serving, and its state stays
under tight limits with every invariant holding."""

from __future__ import annotations

import grpc
import pytest
from hints_support import ServerThread, now_us, stub
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.agents.graph import GraphLimits
from kvtier.hints._gen import hints_pb2 as pb
from kvtier.hints.apply import HintLimits

LIMITS = GraphLimits(max_sessions=6, max_sessions_per_tenant=6, max_sessions_per_client=6, max_agents=12,
                     max_agents_per_session=4, max_tool_calls=6, max_tool_calls_per_session=3,
                     max_requests_in_flight_per_agent=2, max_edges_per_session=5, max_shared_rounds_per_session=2,
                     max_stored_block_key_bytes=16 * 64, max_history_keys=8)
HINT_LIMITS = HintLimits(max_batch_events=24, max_block_keys_per_event=16, max_id_bytes=12,
                         dedupe_window_events=64, max_tenants=3)
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}

ids = st.sampled_from(["", "s1", "s2", "s3", "a", "b", "c", "x" * 13])
enum_values = st.sampled_from([0, 1, 2, 3, 4, 5, 99, -1])
block_keys = st.one_of(st.just(b""), st.binary(max_size=300), st.integers(0, 20).map(lambda n: bytes(16 * n)))
timestamps = st.one_of(st.just(None), st.just(0), st.just(-5), st.integers(0, 2**62))

SIGNAL_FIELDS = {
    "session_start": lambda: st.fixed_dictionaries({"session_id": ids, "model": ids}),
    "session_end": lambda: st.fixed_dictionaries({"session_id": ids}),
    "agent_spawn": lambda: st.fixed_dictionaries({"session_id": ids, "agent_id": ids, "parent_agent_id": ids,
                                                   "agent_type": ids, "importance": enum_values,
                                                   "join_group": ids, "expected_num_requests": st.integers(0, 9)}),
    "agent_end": lambda: st.fixed_dictionaries({"session_id": ids, "agent_id": ids, "status": enum_values}),
    "dependency": lambda: st.fixed_dictionaries({"session_id": ids, "from_agent_id": ids, "to_agent_id": ids}),
    "request_start": lambda: st.fixed_dictionaries({"session_id": ids, "agent_id": ids, "request_id": ids,
                                                     "prompt_block_keys": block_keys,
                                                     "num_prompt_tokens": st.integers(0, 10_000)}),
    "request_end": lambda: st.fixed_dictionaries({"session_id": ids, "agent_id": ids, "request_id": ids,
                                                   "num_output_tokens": st.integers(0, 99), "stop": enum_values}),
    "tool_call_start": lambda: st.fixed_dictionaries({"session_id": ids, "agent_id": ids, "tool_call_id": ids,
                                                       "tool_name": ids},
                                                      optional={"expected_duration_s": st.floats()}),
    "tool_call_end": lambda: st.fixed_dictionaries({"session_id": ids, "agent_id": ids, "tool_call_id": ids,
                                                     "status": enum_values}),
    "shared_round_start": lambda: st.fixed_dictionaries({"session_id": ids, "round_id": ids,
                                                          "agent_ids": st.lists(ids, max_size=4),
                                                          "shared_block_keys": block_keys}),
    "shared_round_end": lambda: st.fixed_dictionaries({"session_id": ids, "round_id": ids}),
}
COMMAND_FIELDS = {
    "pin": lambda: st.fixed_dictionaries({"session_id": ids, "block_keys": block_keys,
                                          "ttl_s": st.floats(allow_nan=True, allow_infinity=True)}),
    "unpin": lambda: st.fixed_dictionaries({"session_id": ids, "block_keys": block_keys}),
    "prefetch": lambda: st.fixed_dictionaries({"session_id": ids, "block_keys": block_keys, "tier": enum_values}),
    "priority": lambda: st.fixed_dictionaries({"session_id": ids, "agent_id": ids, "priority": enum_values}),
}


@st.composite
def events(draw, table, cls):
    kind = draw(st.sampled_from(sorted(table)))
    fields = draw(table[kind]())
    for name in ("importance", "status", "stop", "tier", "priority"):
        if name in fields and fields[name] < 0:
            fields[name] = 2**31 - 1 + fields[name] + 1  # a large unknown enum value (int32 range)
    ts = draw(timestamps)
    return cls(event_id=draw(st.integers(0, 40)), client_time_unix_us=now_us() if ts is None else ts, **{kind: fields})


@st.composite
def requests(draw):
    req = pb.PublishRequest(client_id=draw(ids), skip_invalid=draw(st.booleans()))
    req.signals.extend(draw(st.lists(events(SIGNAL_FIELDS, pb.Signal), max_size=20)))
    req.commands.extend(draw(st.lists(events(COMMAND_FIELDS, pb.Command), max_size=8)))
    return req


@pytest.fixture(scope="module")
def fuzz_server():
    with ServerThread(graph_limits=LIMITS, limits=HINT_LIMITS, expire_interval_s=3600) as s:
        channel, stub_ = stub(s.address)
        raw = channel.unary_unary("/kvtier.v1.HintService/Publish")
        yield s, stub_, raw
        channel.close()
        _assert_bounded(s)


def _assert_bounded(s: ServerThread) -> None:
    def check():
        app = s.server.applier
        app.check_invariants()  # includes every GraphLimits bound
        g = app.graph
        assert g.num_sessions <= LIMITS.max_sessions and g.num_agents <= LIMITS.max_agents
        assert g.num_tool_calls <= LIMITS.max_tool_calls and g.stored_key_bytes <= LIMITS.max_stored_block_key_bytes
        assert app.dedupe_size <= HINT_LIMITS.dedupe_window_events and len(app.tenants) <= HINT_LIMITS.max_tenants
        assert len(g.history) <= LIMITS.max_history_keys

    s.call(check)


TENANTS = st.sampled_from([None, "t1", "t2", "t3", "t4", "t" * 300])
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])


@FUZZ
@given(req=requests(), tenant=TENANTS)
def test_random_batches_never_crash_and_state_stays_bounded(fuzz_server, req, tenant):
    s, client, _ = fuzz_server
    md = () if tenant is None else (("x-kvtier-tenant", tenant),)
    try:
        client.Publish(req, metadata=md, timeout=10)
    except grpc.RpcError as err:
        assert err.code() in ALLOWED, (err.code(), err.details())
        assert err.details()  # always says which field or setting
    _assert_bounded(s)


@FUZZ
@given(req=requests(), flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8),
       cut=st.integers(0, 10_000))
def test_mutated_bytes_never_crash_the_server(fuzz_server, req, flips, cut):
    s, client, raw = fuzz_server
    data = bytearray(req.SerializeToString())
    for pos, value in flips:
        if data:
            data[pos % len(data)] = value
    data = bytes(data[: cut % (len(data) + 1)] if cut % 3 == 0 else data)
    try:
        raw(data, timeout=10)
    except grpc.RpcError as err:
        assert err.code() in ALLOWED, (err.code(), err.details())  # undecodable bytes too
        if err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("request:"):
            assert "cannot decode a kvtier.v1.PublishRequest" in err.details()
    assert client.GetStats(pb.GetStatsRequest(), timeout=10).tenant == "default"  # still serving
    _assert_bounded(s)


def test_flood_of_sessions_is_refused_past_the_limit(fuzz_server):
    s, client, _ = fuzz_server
    for i in range(40):
        req = pb.PublishRequest(client_id=f"flood-{i}", skip_invalid=True)
        for j in range(HINT_LIMITS.max_batch_events):
            req.signals.add(event_id=10_000 + i * 100 + j, client_time_unix_us=now_us(),
                            session_start={"session_id": f"f{i}-{j}"[:12]})
        try:
            client.Publish(req, metadata=(("x-kvtier-tenant", "t1"),), timeout=10)
        except grpc.RpcError as err:  # earlier examples may have used up the tenant table (max_tenants=3)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    _assert_bounded(s)
    assert s.call(lambda: s.server.graph.num_sessions) <= LIMITS.max_sessions
