"""The replay simulator: Belady bound, determinism, dependency rules, engine accounting."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.replay import default_workload
from kvtier.replay.generator import GeneratorConfig
from kvtier.replay.model import Agent, Request, Session, Workload
from kvtier.placement import PlacementPolicy, make_placement
from kvtier.replay.profiles import get_profile
from kvtier.replay.run import ReplaySpec, run_point
from kvtier.replay.sim import SimConfig, Simulator

PROFILE = get_profile("h100-80gb", "llama-3.1-8b")
TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def test_same_seed_same_results_and_different_seed_differs() -> None:
    def one(seed: int) -> dict:
        w = default_workload(seed=seed, num_sessions=4, max_requests_per_agent=10)
        spec = ReplaySpec(workload=w, profile=PROFILE, hbm_fractions=(0.2,), seed=seed)
        rows = [run_point(spec, p, 3, spec.capacities()[0]) for p in ("lru", "minwaste")]
        for r in rows:
            r.pop("wall_s"), r.pop("block_touches_per_s")
        return json.loads(json.dumps(rows, default=float))

    assert one(7) == one(7)
    assert one(7) != one(8)


def _tiny_session() -> Workload:
    # root: r0 (spawns sub-agent after it), r1 waits for the sub-agent, then 3 s tool gap.
    r0 = Request(0, 640, 10, tuple(range(10)), 0.0, "start", "tool_use", 0.0)
    r1 = Request(1, 768, 10, tuple(range(12)), 2.0, "subagent_join", "tool_use", 0.0, depends_on=("sub",))
    r2 = Request(2, 832, 4, tuple(range(13)), 3.0, "tool", "end_turn", 0.0)
    s0 = Request(0, 128, 5, (100, 101), 0.5, "start", "end_turn", 0.0)
    root = Agent("root", None, "main", (r0, r1, r2))
    sub = Agent("sub", "root", "Explore", (s0,), spawn_after=0, join_before=1)
    return Workload("tiny", 64, (Session("s", (root, sub)),), False)


def test_dependencies_gaps_and_cache_accounting() -> None:
    w = _tiny_session()
    w.check_invariants()
    sim = Simulator(w, SimConfig(hbm_blocks=1000, conc=1), make_placement("lru"), PROFILE)
    res = sim.run()
    recs = {(r.agent_id, r.index): r for r in res.records}
    assert len(recs) == 4
    # the sub-agent starts after r0 and its 0.5 s gap; r1 waits for it plus 2 s
    assert recs[("sub", 0)].ready_s == pytest.approx(recs[("root", 0)].finish_s + 0.5)
    assert recs[("root", 1)].ready_s == pytest.approx(recs[("sub", 0)].finish_s + 2.0)
    assert recs[("root", 2)].ready_s == pytest.approx(recs[("root", 1)].finish_s + 3.0)
    # r1 reuses r0's 10 blocks from HBM and computes the rest; r2 reuses 12
    assert recs[("root", 1)].hit_hbm_tokens == 10 * 64
    assert recs[("root", 1)].computed_tokens == 768 - 640
    assert recs[("root", 2)].hit_hbm_tokens == 12 * 64
    assert recs[("root", 0)].first_turn and not recs[("root", 1)].first_turn
    sim.mgr.check_invariants()
    assert sim.mgr.num_pinned() == 0


@pytest.mark.parametrize("policy", ["lru", "lru-dram", "arc", "s3fifo", "ttl", "minwaste", "belady-hbm"])
def test_every_policy_keeps_manager_invariants_under_pressure(policy: str) -> None:
    w = default_workload(seed=3, num_sessions=5, max_requests_per_agent=10)
    cfg = SimConfig(hbm_blocks=max(200, w.num_distinct_blocks() // 10), dram_blocks=300, ssd_blocks=2000, conc=4)
    from kvtier.replay.belady import NextUseOracle

    oracle = None
    if policy == "belady-hbm":
        order: list = []
        Simulator(w, cfg, make_placement("lru"), PROFILE, order_log=order).run()
        oracle = NextUseOracle(order)
    sim = Simulator(w, cfg, make_placement(policy), PROFILE, oracle=oracle)
    res = sim.run()
    assert len(res.records) == w.num_requests()
    sim.mgr.check_invariants()
    for r in res.records:
        assert r.computed_tokens + r.hit_hbm_tokens + r.hit_dram_tokens + r.hit_ssd_tokens >= r.input_tokens
        assert r.first_token_s >= r.ready_s and r.finish_s >= r.first_token_s


def test_belady_victim_search_ends_when_every_drift_estimate_is_overdue() -> None:
    """A session running behind its recorded self keeps next-use estimates in the
    past however often they are refreshed; pop_victim must still pick one (it
    once refreshed the heap's top forever: the dev-trace replay never ended)."""
    from kvtier.keys import BlockKey
    from kvtier.replay.belady import BeladyPolicy, DriftOracle

    k1, k2 = BlockKey(1), BlockKey(2)
    oracle = DriftOracle([(("s", 0), [k1], 10.0), (("s", 1), [k1, k2], 20.0), (("t", 0), [], 30.0)])
    oracle.advance(("s", 0), 0.0)  # session s runs 10 s ahead of its recording: offset -10
    oracle.advance(("t", 0), 100.0)  # the clock moves on; s does not
    assert oracle.next_use(k1) == 10.0 and oracle.next_use(k1) < oracle.clock  # overdue, and stays so
    pol = BeladyPolicy(oracle)
    pol.on_insert(k1)
    pol.on_insert(k2)
    victims = {pol.pop_victim(lambda k: True), pol.pop_victim(lambda k: True)}
    assert victims == {k1, k2}
    assert pol.pop_victim(lambda k: True) is None


@pytest.mark.skipif(not (TRACES / "weka_claude_code" / "weka_dev_120.tar.xz").exists(), reason="no shared traces")
def test_dev_traces_replay_a_slice_under_pressure() -> None:
    from kvtier.replay import load_trace

    w = load_trace(TRACES / "weka_claude_code" / "weka_dev_120.tar.xz")
    w = replace(w, sessions=w.sessions[:6])
    spec = ReplaySpec(workload=w, profile=PROFILE, hbm_fractions=(0.25,))
    cap = spec.capacities()[0]
    lru = run_point(spec, "lru", 4, cap)
    dram = run_point(spec, "lru-dram", 4, cap)
    assert lru["num_requests"] == dram["num_requests"] == w.num_requests()
    assert dram["prefill_tokens_computed"] <= lru["prefill_tokens_computed"]
    assert dram["prefill_tokens_hit_dram"] > 0


def test_slo_capacity_search_finds_the_largest_passing_conc() -> None:
    from kvtier.replay.run import slo_capacity

    w = default_workload(seed=5, num_sessions=6, max_requests_per_agent=8)
    spec = ReplaySpec(workload=w, profile=PROFILE, hbm_fractions=(0.3,))
    cap = spec.capacities()[0]
    loose = slo_capacity(spec, "lru", cap, ttft_p99_s=1e9, interactivity=None, max_conc=8)
    assert loose["max_conc"] == 6  # an SLO nothing violates admits the ceiling: 6 sessions, conc 8 is conc 6
    impossible = slo_capacity(spec, "lru", cap, ttft_p99_s=1e-9, interactivity=None, max_conc=8)
    assert impossible["max_conc"] == 0
    # a bound between the measured p99 at conc 1 and the worst measured admits conc 1 at least
    mid = slo_capacity(spec, "lru", cap, ttft_p99_s=loose["points"][0]["ttft_p99_later_turns_s"] * 1.0001,
                       interactivity=None, max_conc=8)
    assert mid["max_conc"] >= 1
    bound = loose["points"][0]["ttft_p99_s"] * 1.0001
    by_conc = {pt["conc"]: pt for pt in mid["points"]}
    assert by_conc[mid["max_conc"]]["ttft_p99_s"] <= bound  # the reported capacity was measured passing
    above = mid["max_conc"] + 1
    if above in by_conc:  # and the next conc up, when measured, failed
        assert by_conc[above]["ttft_p99_s"] > bound


class _Recorder(PlacementPolicy):
    """What the simulator tells a placement policy: wait starts, agent and session ends."""

    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_wait_start(self, ctx, wait) -> None:
        self.seen.append(("wait", wait.agent_key[1], wait.cause, wait.predicted_gap_s))

    def on_agent_end(self, ctx, agent_key, keys) -> None:
        self.seen.append(("end", agent_key[1]))

    def on_session_end(self, ctx, session) -> None:
        self.seen.append(("session end",))


def test_with_agent_ends_unknown_a_turn_without_a_tool_call_is_a_turn_end() -> None:
    """``agent_ends=False`` (``--agent-ends unknown``: hints in kv_transfer_params only): the
    policy is never told an agent or a session ended; the sub-agent's and the root's last
    turns, and a user's turn, start ``turn_end`` waits of ``TURN_END_GAP_S``, as the live
    connector starts them. With ends reported, the same turns end the agents."""
    from kvtier.placement.base import TURN_END_GAP_S

    base = _tiny_session()
    root = base.sessions[0].agents[0]
    r3 = Request(3, 900, 4, tuple(range(14)), 40.0, "user", "end_turn", 0.0)  # the user replies to r2
    w = replace(base, sessions=(Session("s", (replace(root, requests=root.requests + (r3,)),
                                              base.sessions[0].agents[1])),))
    w.check_invariants()
    seen = {}
    for ends in (True, False):
        policy = _Recorder()
        Simulator(w, SimConfig(hbm_blocks=1000, conc=1, agent_ends=ends), policy, PROFILE).run()
        seen[ends] = policy.seen
    assert [s for s in seen[True] if s[0] != "wait" or s[2] != "tool"] == [
        ("wait", "root", "subagent_join", pytest.approx(10.0)), ("end", "sub"),
        ("wait", "root", "user", 10.0), ("end", "root"), ("session end",)]
    turn_end = ("wait", "root", "turn_end", TURN_END_GAP_S)
    assert [s for s in seen[False] if s[0] != "wait" or s[2] != "tool"] == [
        ("wait", "root", "subagent_join", pytest.approx(10.0)), ("wait", "sub", "turn_end", TURN_END_GAP_S),
        turn_end, turn_end]


def test_announced_tool_waits_tell_the_policy_each_true_gap() -> None:
    """``tool_waits="announced"`` (``--tool-waits announced``): every tool wait the policy
    sees is the true gap, capped as the sim caps it; predicted (the default), the first is
    the hint plane's no-history guess. A bad value names the setting."""
    from kvtier.errors import ConfigError
    from kvtier.placement.base import UNPREDICTED_GAP_S

    w = _tiny_session()  # root r2 comes 3 s after a tool call
    seen = {}
    for waits, cap in (("predicted", None), ("announced", None), ("announced", 2.5)):
        policy = _Recorder()
        Simulator(w, SimConfig(hbm_blocks=1000, conc=1, tool_waits=waits, gap_cap_s=cap), policy, PROFILE).run()
        seen[(waits, cap)] = [e[3] for e in policy.seen if e[0] == "wait" and e[2] == "tool"]
    assert seen == {("predicted", None): [UNPREDICTED_GAP_S], ("announced", None): [3.0], ("announced", 2.5): [2.5]}
    with pytest.raises(ConfigError, match="--tool-waits.*'exact'.*valid: predicted, predicted-stream, announced"):
        Simulator(w, SimConfig(hbm_blocks=1000, tool_waits="exact"), _Recorder(), PROFILE)


def test_predicted_stream_waits_are_learned_per_session_first() -> None:
    """``tool_waits="predicted-stream"``: the chain the request-stream middleware's hints get (they name
    no agent type): per (session, tool), then per tool. Session ``b``'s agent, of the same type as
    ``a``'s, waits 1 s where ``a``'s waited 20 s: after three of its own waits it is predicted from
    them; with ``predicted`` (per agent type, as the SDK names it) ``a``'s waits still weigh in."""
    def session(name: str, base: int, gap_s: float, n: int) -> Session:
        reqs = tuple(Request(i, 64 * (2 + i), 4, tuple(range(base, base + 2 + i)), 0.0 if i == 0 else gap_s,
                             "start" if i == 0 else "tool", "tool_use" if i < n - 1 else "end_turn", 0.0)
                     for i in range(n))
        return Session(name, (Agent("root", None, "main", reqs),))

    w = Workload("two", 64, (session("a", 0, 20.0, 5), session("b", 1000, 1.0, 6)), False)
    w.check_invariants()
    seen = {}
    for waits in ("predicted", "predicted-stream"):
        policy = _Recorder()
        Simulator(w, SimConfig(hbm_blocks=1000, conc=1, tool_waits=waits), policy, PROFILE).run()
        seen[waits] = [e[3] for e in policy.seen if e[0] == "wait" and e[2] == "tool"]
    assert len(seen["predicted"]) == len(seen["predicted-stream"]) == 4 + 5
    assert seen["predicted"][:4] == seen["predicted-stream"][:4]  # session a: the same history either way
    assert seen["predicted-stream"][-1] == pytest.approx(1.0)  # b's own three waits and more
    assert seen["predicted"][-1] > 5.0  # per agent type: a's 20 s waits still in the average


def _two_forks(prompt_blocks: int = 6, shared: int = 4) -> Workload:
    """Two sessions whose first requests share ``shared`` leading blocks and arrive together."""
    def one(name: str, own: int) -> Session:
        ids = tuple(range(shared)) + tuple(own + j for j in range(prompt_blocks - shared))
        return Session(name, (Agent(name, None, "main", (Request(0, prompt_blocks * 64 + 5, 4, ids, 0.0, "start",
                                                                     "end_turn", 0.0),)),))
    return Workload("forks", 64, (one("a", 100), one("b", 200)), open_loop=True)


def test_vllm_scheduler_shares_blocks_scheduled_earlier_in_the_step() -> None:
    """``scheduler="vllm"``: vLLM caches a block when it allocates it, so a request admitted
    after another in the same step finds the blocks that one's chunk covers as HBM hits, and
    the step computes them once; ``plain`` finds only computed blocks, so both requests
    compute the shared prefix."""
    w = _two_forks()
    out = {}
    for sched in ("plain", "vllm"):
        cfg = SimConfig(hbm_blocks=100, conc=2, max_batch_tokens=4096, scheduler=sched)
        res = Simulator(w, cfg, make_placement("lru"), PROFILE).run()
        out[sched] = sorted((r.hit_hbm_tokens, r.computed_tokens) for r in res.records)
        assert len({r.first_token_s for r in res.records}) == 1  # one step served both
    assert out == {"plain": [(0, 389), (0, 389)], "vllm": [(0, 389), (4 * 64, 389 - 4 * 64)]}


def test_vllm_scheduler_admits_only_while_the_step_has_tokens_left() -> None:
    """Steps of 200 tokens: the first request's chunk takes all of the first, so vLLM admits
    the second only in the next step (the first's last 189 tokens leave 11), by when the
    first's chunks cover the 4 shared blocks: they are hits. ``plain`` admits both at once,
    before any block is computed. A bad value names the setting."""
    from kvtier.errors import ConfigError

    w = _two_forks()
    out = {}
    for sched in ("plain", "vllm"):
        cfg = SimConfig(hbm_blocks=100, conc=2, max_batch_tokens=200, scheduler=sched)
        res = Simulator(w, cfg, make_placement("lru"), PROFILE).run()
        out[sched] = [(r.hit_hbm_tokens, r.computed_tokens) for r in sorted(res.records, key=lambda r: r.session)]
    assert out == {"plain": [(0, 389), (0, 389)], "vllm": [(0, 389), (4 * 64, 389 - 4 * 64)]}
    with pytest.raises(ConfigError, match="--scheduler.*'sglang'.*valid: plain, vllm"):
        Simulator(w, SimConfig(hbm_blocks=100, scheduler="sglang"), make_placement("lru"), PROFILE)


def test_live_write_backs_claim_their_dram_slot_when_they_leave_hbm() -> None:
    """Exclusive DRAM: on ``full`` (modelled only) an HBM victim takes the DRAM slot the
    admission's loads free (a swap through a staging buffer); on ``vllm`` it claims a DRAM
    slot as it leaves HBM, as the connector's write-back does in ``on_reuse``, so with DRAM
    full of blocks the admission is loading, it finds no room and is dropped."""
    from kvtier.placement.surface import SURFACES

    assert SURFACES["full"].victim_swap and not SURFACES["vllm"].victim_swap
    # a: 4 blocks, then b: 4 other blocks evict a's from a 5-block HBM into a 4-block DRAM,
    # then a again: its 4 DRAM blocks load while b's go down (HBM can hold only one context)
    a0 = Request(0, 4 * 64 + 5, 4, (1, 2, 3, 4), 0.0, "start", "tool_use", 0.0)
    a1 = Request(1, 4 * 64 + 5, 4, (1, 2, 3, 4), 5.0, "tool", "end_turn", 0.0)
    b0 = Request(0, 4 * 64 + 5, 4, (11, 12, 13, 14), 1.0, "start", "end_turn", 1.0)
    w = Workload("swap", 64, (Session("a", (Agent("a", None, "main", (a0, a1)),)),
                              Session("b", (Agent("b", None, "main", (b0,)),))), open_loop=True)
    out = {}
    for surface in ("full", "vllm"):
        cfg = SimConfig(hbm_blocks=5, dram_blocks=4, conc=2, surface=surface)
        sim = Simulator(w, cfg, make_placement("kvtier"), PROFILE)
        res = sim.run()
        sim.mgr.check_invariants()
        a_again = next(r for r in res.records if r.agent_id == "a" and r.index == 1)
        out[surface] = (a_again.hit_dram_tokens, res.counters.get("write_back_no_room", 0),
                        len(sim.mgr.present([11, 12, 13, 14], "dram")))
    assert out["full"][0] == out["vllm"][0] == 4 * 64  # a's blocks load from DRAM on both
    assert out["full"][1] == 0 and out["full"][2] > 0  # swapped: b's blocks take the slots a's loads free
    assert out["vllm"][1] > 0 and out["vllm"][2] == 0  # live: no room while a's blocks still fill DRAM


def test_vllm_scheduler_runs_another_request_while_one_loads() -> None:
    """One running slot. ``a`` comes back (its blocks now only in DRAM: ``b`` took HBM)
    while ``b`` decodes, and ``c`` queues behind it. When ``b`` ends, ``a`` is admitted
    with a load: vLLM parks it without a running slot until the load is done
    (WAITING_FOR_REMOTE_KVS), so ``c`` runs first; ``plain`` gives ``a`` the slot."""
    a0 = Request(0, 4 * 64 + 5, 4, (1, 2, 3, 4), 0.0, "start", "tool_use", 0.0)
    a1 = Request(1, 4 * 64 + 5, 4, (1, 2, 3, 4), 5.0, "tool", "end_turn", 0.0)
    b0 = Request(0, 4 * 64 + 5, 200, (11, 12, 13, 14), 0.0, "start", "end_turn", 4.9)
    c0 = Request(0, 2 * 64 + 5, 4, (21, 22), 0.0, "start", "end_turn", 5.04)
    w = Workload("hold", 64, tuple(Session(n, (Agent(n, None, "main", r),))
                                   for n, r in (("a", (a0, a1)), ("b", (b0,)), ("c", (c0,)))), open_loop=True)
    order = {}
    for sched in ("plain", "vllm"):
        cfg = SimConfig(hbm_blocks=8, dram_blocks=16, conc=3, max_running=1, surface="vllm-write-through",
                        scheduler=sched)
        res = Simulator(w, cfg, make_placement("lru-dram"), PROFILE).run()
        recs = sorted(res.records, key=lambda r: r.first_token_s)
        assert next(r for r in recs if r.session == 0 and r.index == 1).hit_dram_tokens == 4 * 64
        order[sched] = [(r.agent_id, r.index) for r in recs]
    assert order == {"plain": [("a", 0), ("b", 0), ("a", 1), ("c", 0)], "vllm": [("a", 0), ("b", 0), ("c", 0), ("a", 1)]}


def test_throughput_per_chip_ends_with_the_last_request_not_the_last_timer() -> None:
    """On a short trace, a policy's timers (kvtier's prefetch and reserve) fire after the last request: the
    span that tok/s/chip divides by ends with the last request, so two policies that serve the same work in
    the same time report the same throughput."""
    reqs = tuple(Request(i, 640 + 64 * i, 8, tuple(range(10 + i)), 0.0 if i == 0 else 2.0,
                         "start" if i == 0 else "tool", "tool_use", 0.0) for i in range(3))
    w = Workload("short", 64, (Session("s0", (Agent("root", None, "main", reqs),)),), open_loop=False)
    spec = ReplaySpec(workload=w, profile=PROFILE, hbm_blocks=(1000,))
    rows = {p: run_point(spec, p, 1, spec.capacities()[0]) for p in ("lru", "kvtier")}
    assert rows["lru"]["prefill_tokens_computed"] == rows["kvtier"]["prefill_tokens_computed"]
    assert rows["kvtier"]["throughput_per_chip_tok_s"] == pytest.approx(rows["lru"]["throughput_per_chip_tok_s"],
                                                                        rel=0.01)
    result = Simulator(w, SimConfig(hbm_blocks=1000, dram_blocks=200, conc=1), make_placement("kvtier"), PROFILE).run()
    assert result.makespan_s == max(r.finish_s for r in result.records)
