"""The per-tenant events-per-second limit of the hints server
(``HintLimits.max_events_per_s_per_tenant``): the token bucket on a given
clock, then over real gRPC — unary batches over the limit are
RESOURCE_EXHAUSTED naming the setting, streams count ``rate_limited``
rejections, and one tenant over its limit never starves another."""

from __future__ import annotations

import argparse
import threading
import time
import urllib.request

import grpc
import pytest
from hints_support import ServerThread, batch, signal, stub

from kvtier.hints._gen import hints_pb2 as pb
from kvtier.hints.apply import HintApplier, HintLimits, TokenBucket

SETTING = "HintLimits.max_events_per_s_per_tenant"


def _as(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("x-kvtier-tenant", tenant),)


def _starts(prefix: str, n: int, **kw) -> pb.PublishRequest:
    return batch(*[signal("session_start", session_id=f"{prefix}{i}") for i in range(n)], **kw)


# ---------------------------------------------------------------- on a given clock


def test_token_bucket_refills_at_the_rate_up_to_one_second_of_events() -> None:
    bucket = TokenBucket(rate_per_s=100.0, now_s=10.0)
    assert bucket.take(150, now_s=10.0) == 100  # starts full: one second's worth
    assert bucket.take(1, now_s=10.0) == 0
    assert bucket.wait_s(50) == pytest.approx(0.5)
    assert bucket.take(80, now_s=10.25) == 25  # refilled 25 in 0.25 s
    assert bucket.take(500, now_s=99.0) == 100  # never more than the capacity
    assert bucket.take(5, now_s=98.0) == 0  # a clock going back grants nothing extra
    slow = TokenBucket(rate_per_s=0.5, now_s=0.0)
    assert (slow.take(3, 0.0), slow.take(1, 1.0), slow.take(1, 2.0)) == (1, 0, 1)  # capacity at least 1


def test_applier_refuses_the_tail_per_tenant_and_lists_it_once() -> None:
    applier = HintApplier(limits=HintLimits(max_events_per_s_per_tenant=10))
    now_us = time.time_ns() // 1000

    def publish(tenant: str, req, now_s: float, skip: bool = True):
        return applier.apply(tenant, req, skip_invalid=skip, now_s=now_s, now_unix_us=now_us)

    r = publish("a", _starts("a", 25, client_id="a"), 0.0)
    assert (r.num_accepted, r.num_rejected) == (10, 15)
    assert r.stopped is r.rejections[-1] and r.stopped.reason == "rate_limited" and r.stopped.num_events == 15
    assert r.stopped.field == "signals[10]" and f"{SETTING}=10 " in r.stopped.message
    assert "15 of 25 events refused; retry them in 1.00 s" in r.stopped.message
    # Tenant b, same instant: its own full budget.
    r = publish("b", _starts("b", 10, client_id="b"), 0.0)
    assert (r.num_accepted, r.num_rejected, r.stopped) == (10, 0, None)
    # Half a second later a has 5 events again; a strict batch whose 2nd event is
    # bad stops there (INVALID_ARGUMENT), before the rate limit is reached.
    bad = batch(signal("session_start", session_id="a-late"), signal("agent_spawn", session_id="a-late"),
                *[signal("session_start", session_id=f"a-x{i}") for i in range(8)], client_id="a")
    r = publish("a", bad, 0.5, skip=False)
    assert (r.num_accepted, r.stopped.reason) == (1, "missing")
    assert applier.tenants["a"].rejections_by_reason == {"rate_limited": 15, "missing": 1}
    assert "rate_limited" not in applier.tenants["b"].rejections_by_reason
    applier.check_invariants()


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "10"])
def test_bad_rate_setting_names_itself(value) -> None:
    with pytest.raises(ValueError, match=f"{SETTING}="):
        HintLimits(max_events_per_s_per_tenant=value)


def test_serve_flag_sets_the_limit_and_rejects_bad_values() -> None:
    from kvtier.hints import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    server, _, _ = serve.build_server(parser.parse_args(["--max-events-per-s-per-tenant", "250"]))
    assert server.applier.limits.max_events_per_s_per_tenant == 250
    with pytest.raises(SystemExit) as info:  # refused while parsing: argparse's exit status 2
        parser.parse_args(["--max-events-per-s-per-tenant", "0"])
    assert info.value.code == 2
    assert serve.build_server(parser.parse_args([]))[0].applier.limits.max_events_per_s_per_tenant is None


# ------------------------------------------------------------------- real gRPC


def test_unary_over_the_limit_is_resource_exhausted_and_other_tenants_keep_their_budget() -> None:
    with ServerThread(limits=HintLimits(max_events_per_s_per_tenant=200), metrics_port=0) as s:
        channel, st = stub(s.address)
        # noisy: 300 events from a full bucket of 200 -> the first 200 applied, 100 refused,
        # RESOURCE_EXHAUSTED even though skip_invalid is set.
        with pytest.raises(grpc.RpcError) as info:
            st.Publish(_starts("n", 300, skip_invalid=True, client_id="n"), metadata=_as("noisy"))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = info.value.details()
        assert details.startswith(f"signals[200]: tenant 'noisy' is over {SETTING}=200 ")
        assert "100 of 300 events refused" in details and "[rate_limited]" in details
        assert details.endswith("; 200 earlier events were applied")
        # quiet, right after: its whole budget is there.
        resp = st.Publish(_starts("q", 200, client_id="q"), metadata=_as("quiet"))
        assert (resp.num_accepted, resp.num_rejected) == (200, 0)
        noisy = st.GetStats(pb.GetStatsRequest(), metadata=_as("noisy"))
        quiet = st.GetStats(pb.GetStatsRequest(), metadata=_as("quiet"))
        assert (noisy.num_sessions, dict(noisy.rejections_by_reason)) == (200, {"rate_limited": 100})
        assert (quiet.num_sessions, dict(quiet.rejections_by_reason)) == (200, {})
        text = urllib.request.urlopen(f"http://127.0.0.1:{s.server.metrics_port}/metrics", timeout=10).read().decode()
        assert 'kvtier_hint_rejections_total{reason="rate_limited"} 100.0' in text
        assert 'kvtier_hint_rpcs_total{code="RESOURCE_EXHAUSTED",method="Publish"} 1.0' in text
        s.call(s.server.applier.check_invariants)
        channel.close()


def test_stream_counts_rate_limited_events_and_goes_on() -> None:
    with ServerThread(limits=HintLimits(max_events_per_s_per_tenant=200)) as s:
        channel, st = stub(s.address)
        # 5 x 200 events back to back: 200 from the full bucket, then only what refills meanwhile.
        started_s = time.monotonic()
        summary = st.PublishStream(iter([_starts(f"s{m}-", 200, skip_invalid=True, client_id=f"s{m}")
                                         for m in range(5)]), metadata=_as("streamer"))
        elapsed_s = time.monotonic() - started_s
        limited = summary.rejected_by_reason["rate_limited"]
        assert summary.num_messages == 5 and summary.num_accepted + limited == 1000
        assert dict(summary.rejected_by_reason) == {"rate_limited": limited}
        assert 200 <= summary.num_accepted <= 200 + 200 * elapsed_s + 1
        first = summary.first_rejections[0]
        assert first.reason == "rate_limited" and f"{SETTING}=200 " in first.message
        assert s.call(lambda: s.server.graph.tenant_counts("streamer")[0]) == summary.num_accepted
        channel.close()


def test_a_tenant_hammering_the_server_does_not_starve_another() -> None:
    # noisy publishes as fast as it can from its own thread; quiet publishes
    # 5 events every 0.1 s (half its limit) meanwhile: every quiet event is applied.
    with ServerThread(limits=HintLimits(max_events_per_s_per_tenant=100)) as s:
        channel, st = stub(s.address)
        stop = threading.Event()
        noisy_refusals = []

        def hammer() -> None:
            i = 0
            while not stop.is_set():
                try:
                    st.Publish(_starts(f"n{i}-", 100, skip_invalid=True, client_id=f"n{i % 50}"),
                               metadata=_as("noisy"))
                except grpc.RpcError as err:
                    noisy_refusals.append(err.code())
                i += 1

        thread = threading.Thread(target=hammer)
        thread.start()
        try:
            quiet_accepted = 0
            for i in range(10):
                resp = st.Publish(_starts(f"q{i}-", 5, client_id="q"), metadata=_as("quiet"))
                quiet_accepted += resp.num_accepted
                time.sleep(0.1)
        finally:
            stop.set()
            thread.join(10)
        assert quiet_accepted == 50
        assert noisy_refusals and set(noisy_refusals) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        stats = st.GetStats(pb.GetStatsRequest(), metadata=_as("quiet"))
        assert dict(stats.rejections_by_reason) == {}
        channel.close()
