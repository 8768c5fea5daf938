"""Agent-aware placement: critical path, duration predictor, transfer model, reserve
accounting, and scripted offload / prefetch timelines through the real simulator."""

from __future__ import annotations

import math
import random

import pytest

from kvtier.agents import AgentGraph, DurationHistory
from kvtier.agents.critical import criticality, path_through_s
from kvtier.keys import BlockKey
from kvtier.manager import TierManager, TierSpec
from kvtier.placement.agent import AGENT_POLICIES, KVTier
from kvtier.replay.model import Agent, Request, Session, Workload
from kvtier.placement import make_placement, placement_names
from kvtier.placement.base import ToolWait
from kvtier.replay.profiles import get_profile
from kvtier.replay.sim import SimConfig, Simulator
from kvtier.transfer.linkmodel import LinkModel

PROFILE = get_profile("h100-80gb", "llama-3.1-8b")
BS = 64


# ----------------------------------------------------------- critical path

def test_critical_path_on_a_fan_out_and_join():
    # plan(2) -> {a(5), b(1), c(3)} -> merge(1) -> review(4)
    rem = {"plan": 2.0, "a": 5.0, "b": 1.0, "c": 3.0, "merge": 1.0, "review": 4.0}
    deps = {"a": ["plan"], "b": ["plan"], "c": ["plan"], "merge": ["a", "b", "c"], "review": ["merge"]}
    through = path_through_s(rem, deps)
    # longest path plan-a-merge-review = 12; b's best path 2+1+1+4 = 8; c's 10
    assert through == {"plan": 12.0, "a": 12.0, "b": 8.0, "c": 10.0, "merge": 12.0, "review": 12.0}
    crit = criticality(rem, deps)
    assert crit["b"] == pytest.approx(8 / 12) and crit["c"] == pytest.approx(10 / 12) and crit["a"] == 1.0
    # b and c join with a: until the join they inherit the group's highest value
    joined = criticality(rem, deps, join_group={"a": "g", "b": "g", "c": "g"})
    assert joined["b"] == joined["c"] == 1.0 and joined["plan"] == 1.0


def test_critical_path_ignores_finished_agents_and_rejects_cycles():
    rem = {"x": 1.0, "y": 2.0}
    assert path_through_s(rem, {"y": ["x", "gone"]}) == {"x": 3.0, "y": 3.0}
    with pytest.raises(ValueError, match="cycle"):
        path_through_s(rem, {"x": ["y"], "y": ["x"]})
    assert criticality({}, {}) == {}


def test_graph_criticalities_follow_tool_predictions():
    g = AgentGraph()
    g.start_session("t", "s", now_s=0.0)
    g.spawn_agent("t", "s", "root", now_s=0.0)
    g.spawn_agent("t", "s", "fast", now_s=0.0, parent_id="root", join_group="j")
    g.spawn_agent("t", "s", "slow", now_s=0.0, parent_id="root")
    g.add_dependency("t", "s", "fast", "root", now_s=0.0)
    g.add_dependency("t", "s", "slow", "root", now_s=0.0)
    g.start_tool_call("t", "s", "slow", "c1", "web", expected_s=9.0, now_s=0.0)
    crit = g.criticalities("t", "s", now_s=0.0)
    # remaining: root 1, fast 1, slow 9 + 1: slow -> root is critical (11), fast -> root is 2
    assert crit == {"root": 1.0, "slow": 1.0, "fast": pytest.approx(2 / 11)}
    assert g.criticalities("t", "nope", now_s=0.0) == {}


# ---------------------------------------------------------------- predictor

def test_predictor_converges_to_the_tools_duration_and_tracks_error():
    rng = random.Random(0)
    h = DurationHistory(max_keys=16, max_samples=64)
    errors = []
    for _ in range(200):
        actual = rng.gauss(4.0, 0.2)
        pred = h.predict_s("coder", "pytest", 30.0)  # the client's estimate is far off
        h.observe_error(pred, actual)
        errors.append(abs(pred - actual))
        h.observe("coder", "pytest", actual)
    assert h.predict_s("coder", "pytest", 30.0) == pytest.approx(4.0, abs=0.6)  # history dominates
    assert sum(errors[-20:]) / 20 < sum(errors[:3]) / 3 / 5
    err = h.error()
    assert err.num_predictions == 200 and 0 < err.under_fraction < 1
    assert len(h.samples("pytest")) == 64  # bounded empirical distribution
    assert 3.5 < h.quantile_s("pytest", 0.5) < 4.5 and h.quantile_s("nope", 0.5) is None


def test_link_model_fits_observed_transfers():
    m = LinkModel(prior={"dram->hbm": (0.0, 100e9)}, min_samples=3)
    assert m.predict_s("dram->hbm", 1_000_000_000) == pytest.approx(0.01)
    for nbytes in (1e8, 2e8, 5e8, 1e9):  # the real link: 50 us + 20 GB/s
        m.observe("dram->hbm", int(nbytes), 50e-6 + nbytes / 20e9)
    latency, bw = m.params("dram->hbm")
    assert latency == pytest.approx(50e-6, rel=1e-3) and bw == pytest.approx(20e9, rel=1e-3)
    with pytest.raises(KeyError, match="ssd->dram"):
        m.predict_s("ssd->dram", 1)


def test_deprioritize_makes_a_chain_the_next_victims_tail_first():
    mgr = TierManager([TierSpec("hbm", 6, "lru")], record_events=False)
    for chain in ((1, 2, 3), (4, 5, 6)):
        plan = mgr.prepare_store("hbm", chain, None)
        mgr.complete_store(plan, True)
    # (1,2,3) is older; deprioritizing (4,5,6) makes 6, then 5, then 4 go first
    assert mgr.deprioritize((4, 5, 6), "hbm") == 3
    assert mgr.evict("hbm", 3) == (6, 5, 4)
    mgr.check_invariants()


class _IdleContext:
    """A live context with nothing of the agents' contexts in HBM: a wait decides nothing."""

    def hbm_pressure(self) -> float:
        return 0.0

    def blocks_in(self, keys, tier: str) -> int:
        return 0

    def count(self, name: str, n: int = 1) -> None:
        pass


@pytest.mark.parametrize("name", ["kvtier", "tokencake", "kvflow"])
def test_agents_whose_sessions_never_end_are_remembered_up_to_a_bound(name):
    """Live, a session may never say it ended (abandoned, or named only by vLLM's session_id): the
    policy keeps the turn count and last context of the ``max_agents`` agents seen last, not of
    every agent ever seen (the soak's RSS creep: ``bench/scheduler_memory.py`` measured the
    scheduler half growing about 1.8 KiB per 40-block session past the connector's own bound,
    without end)."""
    pol = make_placement(name)
    pol.eviction_for("dram", lambda: 0.0)  # the next-use order, where the policy has one (as the connector does)
    pol.max_agents = 16
    ctx = _IdleContext()
    for i in range(200):
        pol.on_wait_start(ctx, ToolWait((i, "a"), tuple(BlockKey(i * 100 + j) for j in range(4)), "tool", 1.0))
    assert len(pol._turns) == 16 and len(pol._last_ctx) <= 16 and len(pol._seen) == 16
    assert pol._turns.get((199, "a")) == 1 and (0, "a") not in pol._turns  # the least recently seen went first
    pol.on_wait_start(ctx, ToolWait((199, "a"), (BlockKey(1),), "tool", 1.0))  # a remembered agent goes on counting
    assert pol._turns[(199, "a")] == 2


# ------------------------------------------------------- scripted timelines

def _req(i, blocks, gap_s=0.0, cause="start", out=8):
    return Request(i, len(blocks) * BS + 10, out, tuple(blocks), gap_s, cause, "tool_use", 0.0)


def _tool_then_pressure(gap_s: float) -> Workload:
    """Agent A computes 20 blocks, waits ``gap_s`` on a tool, then extends them;
    meanwhile session B needs all 40 HBM blocks."""
    a = Agent("a", None, "coder", (_req(0, range(1, 21)), _req(1, range(1, 22), gap_s, "tool")))
    b = Agent("b", None, "coder", (_req(0, range(101, 140)),))
    return Workload("scripted", BS, (Session("A", (a,)), Session("B", (b,))), False)


def _run(w: Workload, policy: str = "kvtier"):
    sim = Simulator(w, SimConfig(hbm_blocks=40, dram_blocks=200, conc=2), make_placement(policy), PROFILE)
    return sim, sim.run()


def test_offload_decided_and_prefetched_back_on_time():
    sim, res = _run(_tool_then_pressure(gap_s=30.0))
    c = res.counters
    assert c["decision_offload"] == 1  # A's wait (predicted 10 s: no history yet) pays for the round trip
    assert c["prefetches"] == 1 and c["prefetch_on_time"] == 1 and c["prefetch_late"] == 0
    assert c["prefetched_blocks"] == 20  # B had pushed all of A's blocks out of HBM
    a1 = next(r for r in res.records if r.session == 0 and r.index == 1)
    assert a1.hit_hbm_tokens == 20 * BS and a1.hit_dram_tokens == 0  # all back before the tool returned
    # lru-dram has the same blocks in DRAM but loads them on demand
    _, base = _run(_tool_then_pressure(gap_s=30.0), "lru-dram")
    b1 = next(r for r in base.records if r.session == 0 and r.index == 1)
    assert b1.hit_dram_tokens == 20 * BS and a1.ttft_s < b1.ttft_s


def test_late_prefetch_is_counted_late_and_the_request_waits_for_it():
    t_back = PROFILE.transfer_time_s(20 * PROFILE.kv_bytes_per_block(BS), "dram->hbm")
    lead = KVTier().lead_s(t_back)
    # The tool returns halfway through the prefetch (predicted 10 s).
    sim, res = _run(_tool_then_pressure(gap_s=10.0 - lead + t_back / 2))
    c = res.counters
    assert c["prefetches"] == 1 and c["prefetch_late"] == 1 and c["prefetch_on_time"] == 0
    a1 = next(r for r in res.records if r.session == 0 and r.index == 1)
    assert a1.hit_hbm_tokens == 20 * BS
    assert a1.ttft_s >= t_back / 2 * 0.99  # it waited for the rest of the transfer


def test_early_return_cancels_the_prefetch():
    _, res = _run(_tool_then_pressure(gap_s=2.0))
    c = res.counters
    assert c["prefetches"] == 0 and c["prefetch_cancelled"] == 1
    a1 = next(r for r in res.records if r.session == 0 and r.index == 1)
    assert a1.hit_dram_tokens == 20 * BS  # loaded on demand instead


# ------------------------------------------------------ reserve accounting

def _fan_out_workload(num_sessions: int = 6) -> Workload:
    sessions = []
    nid = 1
    for s in range(num_sessions):
        reqs = []
        blocks: list[int] = []
        for i in range(6):
            blocks = blocks + list(range(nid, nid + 12))
            nid += 12
            reqs.append(_req(i, blocks, gap_s=3.0 + s if i else 0.0, cause="tool" if i else "start"))
        sessions.append(Session(f"s{s}", (Agent("root", None, "coder", tuple(reqs)),)))
    return Workload("fan", BS, tuple(sessions), False)


@pytest.mark.parametrize("name", [cls.name for cls in AGENT_POLICIES])
def test_reserve_stays_within_its_share_and_is_returned(name):
    policy = make_placement(name)
    sim = Simulator(_fan_out_workload(), SimConfig(hbm_blocks=150, dram_blocks=600, ssd_blocks=600, conc=6),
                    policy, PROFILE)
    seen = []
    orig = policy.on_wait_start

    def checked(ctx, wait):
        orig(ctx, wait)
        used = sum(n for n, _ in policy._reserved.values())
        lo, hi = policy.rho_bounds
        assert lo <= policy.rho <= hi
        assert used <= math.floor(policy.rho * ctx.hbm_capacity_blocks) or not policy.space
        seen.append(used)
        sim.mgr.check_invariants()

    policy.on_wait_start = checked
    res = sim.run()
    assert len(res.records) == 36
    assert policy._reserved == {} and policy._timers == {}  # every wait ended: reserve returned
    sim.mgr.check_invariants()


def test_agent_policies_are_registered():
    assert {"tokencake", "kvflow", "kvtier", "kvtier-space-only", "kvtier-time-only"} <= set(placement_names())


def test_a_prefetch_of_a_context_the_next_prompt_left_never_stalls_admission():
    # A's next prompt is rewritten (compaction): the 20 prefetched blocks are
    # useless, and with them held the 37 blocks it needs would not fit in 40.
    a = Agent("a", None, "coder", (_req(0, range(1, 21)), _req(1, range(201, 237), 30.0, "tool")))
    b = Agent("b", None, "coder", (_req(0, range(101, 140)),))
    w = Workload("rewrite", BS, (Session("A", (a,)), Session("B", (b,))), False)
    _, res = _run(w)
    assert len(res.records) == 3  # every request served (a stall raises)
    c = res.counters
    assert c["prefetches"] == 1 and c["prefetch_wasted"] == 1
    assert c["prefetch_holds_released"] >= 1


def test_a_long_predicted_wait_demotes_to_the_ssd_copy():
    """kvtier: a wait predicted at demote_after_s or longer gives up the HBM and the
    DRAM copies first (the write-through SSD copy stays); shorter waits only the
    HBM copy. TokenCake (no SSD, no write-through) never demotes, nor does kvtier
    when no SSD tier is enabled."""

    class Ctx:
        def __init__(self):
            self.calls = []

        def private_start(self, keys):
            return 1  # keys[0] is a shared prefix: never demoted

        def deprioritize(self, keys, tiers=("hbm",)):
            self.calls.append((tuple(keys), tuple(tiers)))
            return len(keys)

    class Tiers:
        def __init__(self, *names):
            self.names = ("hbm", *names)

        def tiers_enabled(self):
            return self.names

    pol = KVTier()
    pol.demote_after_s = 30.0  # whatever the tuned value, the rule is the same
    with_ssd = Tiers("dram", "ssd")
    assert pol._demotes(with_ssd, 30.0) and not pol._demotes(with_ssd, 29.9)
    assert not pol._demotes(Tiers("dram"), 1e9)  # no SSD copy to keep: no demotion
    ctx = Ctx()
    assert pol._offload(ctx, (1, 2, 3), demote=True) == 2
    assert pol._offload(ctx, (1, 2, 3)) == 2
    assert ctx.calls == [((2, 3), ("hbm", "dram")), ((2, 3), ("hbm",))]
    assert not make_placement("tokencake")._demotes(with_ssd, 1e9)
