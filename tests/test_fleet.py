"""A fleet of modelled engines (kvtier.replay.fleet): one engine replays exactly as the
simulator; routing and the shared remote tier change prefill work as they must."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.placement import make_placement
from kvtier.replay import default_workload
from kvtier.replay.fleet import FleetConfig, FleetSimulator, RemoteTier
from kvtier.replay.profiles import get_profile
from kvtier.replay.report import summarize
from kvtier.replay.sim import SimConfig, Simulator
from cli_support import cli_error

PROFILE = get_profile("h100-80gb", "llama-3.1-8b")


@pytest.mark.parametrize("policy", ["lru", "lru-dram", "ttl", "kvtier"])
def test_one_engine_without_remote_replays_exactly_as_the_simulator(policy: str) -> None:
    w = default_workload(seed=1, num_sessions=6, max_requests_per_agent=20)
    cfg = SimConfig(hbm_blocks=3000, dram_blocks=6000, conc=3)
    one = Simulator(w, cfg, make_placement(policy), PROFILE).run()
    fleet = FleetSimulator(w, cfg, lambda: make_placement(policy), PROFILE, FleetConfig(engines=1)).run()
    assert fleet.records == one.records  # every request: same times, hits, computed tokens
    assert fleet.session_latency_s == one.session_latency_s
    assert fleet.makespan_s == one.makespan_s
    assert fleet.bytes_moved == one.bytes_moved
    assert fleet.counters == one.counters
    assert fleet.block_touches == one.block_touches


def _replay_json(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    argv = ["replay", "--quiet", "--sessions", "3", "--policies", "lru,kvtier", "--hbm-blocks", "3500", "--conc", "2",
            "--no-references", "--jobs", "1", "--json", str(out), *extra]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    for row in report["results"]:
        row.pop("wall_s"), row.pop("block_touches_per_s")
    report.pop("wall_s")
    return report


def test_engines_1_is_the_plain_replay(tmp_path: Path, capsys) -> None:
    assert _replay_json(tmp_path, "a") == _replay_json(tmp_path, "b", "--engines", "1")


def _fleet(routing: str, remote_blocks: int, policy: str = "lru") -> dict:
    # 16 sessions over 4 engines; each engine's HBM holds a few sessions' contexts, DRAM twice that
    w = default_workload(seed=0, num_sessions=16)
    cfg = SimConfig(hbm_blocks=3500, dram_blocks=7000, conc=16)
    sim = FleetSimulator(w, cfg, lambda: make_placement(policy), PROFILE,
                         FleetConfig(engines=4, routing=routing, remote_blocks=remote_blocks))
    res = sim.run()
    row = summarize(res, policy=policy, conc=16, hbm_blocks=3500, num_chips=1)
    row["remote_bytes"] = {k: v for k, v in res.bytes_moved.items() if "remote" in k}
    row["served"] = len(res.records) + res.counters.get("skipped_requests", 0)
    row["total"] = w.num_requests()
    row["per_engine"] = [len(e.records) for e in sim.engines]
    return row


def test_routing_and_the_remote_tier_change_prefill_work_as_they_must() -> None:
    rr, rr_remote = _fleet("round-robin", 0), _fleet("round-robin", 400_000)
    sticky, kv_remote = _fleet("session", 0), _fleet("kv-aware", 400_000)
    for row in (rr, rr_remote, sticky, kv_remote):
        assert row["served"] == row["total"]  # every request served once, no stall
        assert all(n > 0 for n in row["per_engine"])  # every engine served some
    computed = {name: r["prefill_tokens_computed"] for name, r in
                (("rr", rr), ("rr_remote", rr_remote), ("sticky", sticky), ("kv_remote", kv_remote))}
    # a session's next turn on another engine recomputes its context: sticky sessions compute less
    assert computed["sticky"] < computed["rr"], computed
    # the remote tier serves what another engine computed
    assert computed["rr_remote"] < computed["rr"], computed
    assert computed["kv_remote"] <= computed["rr_remote"], computed
    # bytes on the remote links only with a remote tier; both ways
    assert rr["remote_bytes"] == {} and sticky["remote_bytes"] == {}
    for row in (rr_remote, kv_remote):
        assert row["remote_bytes"]["hbm->remote"] > 0 and row["remote_bytes"]["remote->hbm"] > 0


def test_kv_aware_routing_scores_as_the_live_router_then_the_least_load() -> None:
    w = default_workload(seed=0, num_sessions=2)
    sim = FleetSimulator(w, SimConfig(hbm_blocks=100, conc=2), lambda: make_placement("lru"), PROFILE,
                         FleetConfig(engines=3, routing="kv-aware", remote_blocks=10))
    sr = None  # kv-aware routing reads only the request's blocks
    req = w.sessions[0].root.requests[0]
    keys = req.block_ids
    # nothing cached anywhere, no load: the lowest index
    assert sim.route(sr, req) is sim.engines[0]
    # engine 0 has a request waiting: the next least loaded, engine 1
    sim.engines[0].waiting.append(object())
    assert sim.route(sr, req) is sim.engines[1]
    # engine 2 holds the first two blocks in HBM: the longest prefix wins over load
    mgr = sim.engines[2].mgr
    plan = mgr.prepare_store("hbm", keys[:2], None)
    mgr.complete_store(plan, True)
    assert sim.cached_prefix_blocks(sim.engines[2], keys) == 2
    assert sim.route(sr, req) is sim.engines[2]
    # the remote tier extends every engine's prefix from where its own tiers stop
    sim.remote.store(keys[:3])
    assert [sim.cached_prefix_blocks(e, keys) for e in sim.engines] == [3, 3, 3]
    # scored as the live router scores: engine 2's two HBM blocks outweigh reading them from the store
    assert [sim.route_score(e, keys) for e in sim.engines] == [0.9, 0.9, 2.3]
    assert sim.route(sr, req) is sim.engines[2]
    mgr.evict("hbm", 2)  # engine 2 drops them: a tie at 3 remote blocks, least load, then lowest index
    assert sim.route(sr, req) is sim.engines[1]


def test_remote_tier_is_lru_over_its_capacity() -> None:
    r = RemoteTier(3)
    assert r.store(["a", "b", "c"]) == 3
    r.touch(["a"])  # b is now the least recent
    assert r.store(["d"]) == 1
    assert "b" not in r and all(k in r for k in "acd")
    assert r.prefix_from(["a", "c", "b", "d"], 0) == 2
    assert r.prefix_from(["x", "c", "d"], 1) == 2
    assert r.store(["c"]) == 0 and len(r) == 3


@pytest.mark.parametrize("extra,says", [
    (["--engines", "0"], "--engines"),
    (["--routing", "bogus"], "--routing"),
    (["--remote-blocks", "-1"], "--remote-blocks"),
    (["--remote-gbps", "0"], "--remote-gbps"),
    (["--engines", "2", "--workload", "apps"], "--engines"),
    (["--engines", "2", "--workload", "rounds"], "--engines"),
    (["--engines", "2", "--policies", "lru,belady-hbm"], "--policies"),
    (["--remote-blocks", "100", "--slo-ttft-p99", "5"], "--remote-blocks"),
    (["--routing", "session"], "--routing"),  # one engine: nothing to route
    (["--remote-gbps", "25"], "--remote-gbps"),  # no remote tier: no link to it
])
def test_bad_fleet_flags_exit_2_naming_the_flag(extra: list[str], says: str, tmp_path: Path, capsys) -> None:
    argv = ["replay", "--quiet", "--sessions", "1", "--policies", "lru", "--no-references",
            "--json", str(tmp_path / "out.json")] + _pairs(extra)
    rc, lines, err = cli_error(argv, capsys)
    assert rc == 2, (argv, err)
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "out.json").exists()


def _pairs(extra: list[str]) -> list[str]:
    """``--flag value`` pairs as ``--flag=value`` (a value may start with '-')."""
    return [f"{a}={b}" for a, b in zip(extra[::2], extra[1::2])]


def test_fleet_cli_reports_each_point_modelled(tmp_path: Path, capsys) -> None:
    report = _replay_json(tmp_path, "f", "--engines", "2", "--routing", "session", "--remote-blocks", "50000")
    assert report["fleet"]["engines"] == 2 and report["fleet"]["modelled"] is True
    for row in report["results"]:
        assert row["engines"] == 2 and row["routing"] == "session" and row["remote"] is True
        assert row["remote_bytes_written"] > 0 and "remote" in row["tiers_used"]
        for key in ("prefill_tokens_computed", "ttft_p50_s", "ttft_p99_s", "ttft_p99_later_turns_s",
                    "remote_bytes_read"):
            assert key in row
    out = capsys.readouterr().out
    assert "MODELLED fleet: 2 engines" in out and "remote written GB" in out


@pytest.mark.parametrize("policy", ["ttl", "tokencake", "kvtier"])
def test_an_agent_moved_to_another_engine_leaves_no_wait_prefetch_or_hold_behind(policy: str) -> None:
    # round-robin moves almost every next turn to another engine: the engine of the last
    # turn ends the agent's wait (its policy unpins, its prefetch is dropped)
    w = default_workload(seed=2, num_sessions=6, max_requests_per_agent=15)
    cfg = SimConfig(hbm_blocks=3500, dram_blocks=7000, ssd_blocks=14000, conc=6)
    sim = FleetSimulator(w, cfg, lambda: make_placement(policy), PROFILE,
                         FleetConfig(engines=3, routing="round-robin", remote_blocks=5000))
    res = sim.run()
    assert len(res.records) + res.counters.get("skipped_requests", 0) == w.num_requests()
    assert res.counters["handed_over"] > 0
    for engine in sim.engines:
        assert not engine.ctx.waiting_agents and not engine.prefetches.by_agent
        assert not engine.waiting and not engine.prefilling and not engine.decoding
        assert engine.mgr.num_pinned() == 0
        engine.mgr.check_invariants()
    assert len(sim.remote) <= 5000
