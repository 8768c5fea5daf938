"""Exclusive DRAM and the order by predicted next use: holds that protect one tier
only (the manager), the eviction order (policy and estimate), and the two
mechanisms through the real simulator on the ``full`` and ``vllm-write-through`` surfaces."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.manager import TierManager, TierSpec
from kvtier.placement import make_placement
from kvtier.placement.nextuse import AgentNextUse
from kvtier.policies.nextuse import NEVER
from kvtier.replay.model import Agent, Request, Session, Workload
from kvtier.replay.profiles import get_profile
from kvtier.replay.sim import SimConfig, Simulator

PROFILE = get_profile("h100-80gb", "llama-3.1-8b")
BS = 64


# ------------------------------------------------------------ holds per tier


def _stored(mgr: TierManager, tier: str, keys: tuple[int, ...]) -> None:
    plan = mgr.prepare_store(tier, keys, None)
    mgr.complete_store(plan, True)


def test_a_hold_limited_to_hbm_lets_the_dram_copy_go():
    for hold_tiers, dram_victims in ((None, (6, 5, 4)), (("hbm",), (3, 2, 1))):
        mgr = TierManager([TierSpec("hbm", 3), TierSpec("dram", 6)], record_events=False, hold_tiers=hold_tiers)
        _stored(mgr, "hbm", (1, 2, 3))
        _stored(mgr, "dram", (1, 2, 3))
        _stored(mgr, "dram", (4, 5, 6))
        mgr.acquire((3,))  # a running request holds the chain (1, 2, 3)
        mgr.check_invariants()
        # every tier held: the DRAM copy of the running chain stays, the idle chain goes;
        # HBM only: the DRAM copy of what HBM holds is evictable (and the oldest)
        assert mgr.evict("dram", 3) == dram_victims, hold_tiers
        assert mgr.evict("hbm", 3) == ()  # the HBM copy is protected either way
        mgr.check_invariants()
        mgr.release((3,))
        mgr.check_invariants()


def test_a_load_in_flight_still_protects_its_source_where_holds_do_not():
    mgr = TierManager([TierSpec("hbm", 3), TierSpec("dram", 3)], record_events=False, hold_tiers=("hbm",))
    _stored(mgr, "dram", (1, 2, 3))
    plan = mgr.prepare_move((1, 2, 3), "dram", "hbm", keep_source=True)
    assert mgr.evict("dram", 3) == ()
    mgr.complete_move(plan, True)
    assert mgr.evict("dram", 3) == (3, 2, 1)
    mgr.check_invariants()


def test_hold_tiers_must_name_enabled_tiers():
    with pytest.raises(ConfigError, match="hold_tiers.*'ssd'.*enabled: hbm, dram"):
        TierManager([TierSpec("hbm", 3), TierSpec("dram", 3)], hold_tiers=("ssd",))


# ------------------------------------------------------------ the order


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _tier(est: AgentNextUse, *chains: tuple[int, ...]) -> TierManager:
    mgr = TierManager([TierSpec("dram", sum(map(len, chains)), est.policy())], record_events=False)
    for chain in chains:
        _stored(mgr, "dram", chain)
    return mgr


def test_finished_agents_go_first_then_waits_by_their_start_and_busy_agents_last():
    clock = _Clock()
    est = AgentNextUse(clock)
    mgr = _tier(est, (1, 2), (3, 4), (5, 6), (7, 8))
    a, b, c, d = (0, "a"), (0, "b"), (0, "c"), (0, "d")
    est.used(a, (1, 2))  # a is running
    clock.t = 1.0
    est.waiting(b, (3, 4), 2.0)  # b waits since t=1
    clock.t = 2.0
    est.waiting(c, (5, 6), 2.0)  # c since t=2
    est.ended(d, (7, 8))  # d is done (no other chain branches from its blocks)
    clock.t = 3.0
    assert mgr.evict("dram", 8) == (8, 7, 4, 3, 6, 5, 2, 1)  # deeper blocks first within an agent
    mgr.check_invariants()


def test_trust_moves_a_long_predicted_wait_ahead_of_an_older_short_one():
    for trust, first in ((0.0, 2), (1.0, 4)):
        clock = _Clock()
        est = AgentNextUse(clock, trust=trust)
        mgr = _tier(est, (1, 2), (3, 4))
        est.waiting((0, "short"), (1, 2), 1.0)  # since 0, back in about 1 s
        clock.t = 5.0
        est.waiting((0, "long"), (3, 4), 300.0)  # since 5, back in about 5 min
        assert mgr.evict("dram", 1) == (first,), trust


def test_a_block_that_left_its_agents_context_ages_like_lru():
    clock = _Clock()
    est = AgentNextUse(clock)
    mgr = _tier(est, (1, 2, 3), (9,))
    agent = (0, "a")
    est.waiting(agent, (1, 2, 3), 1.0)
    clock.t = 10.0
    est.waiting((0, "b"), (9,), 1.0)
    clock.t = 20.0
    est.used(agent, (1, 2))  # a came back; its new context dropped block 3
    assert est.next_use(3) == 0.0 and est.next_use(1) < -20.0  # 3 ranks by its old claim, 1-2 are busy
    assert mgr.evict("dram", 2) == (3, 9)


def test_a_copy_made_next_victim_stays_first_until_it_is_used():
    clock = _Clock()
    est = AgentNextUse(clock)
    mgr = _tier(est, (1,), (2,))
    est.waiting((0, "a"), (1,), 1.0)
    est.waiting((0, "b"), (2,), 1.0)
    mgr.deprioritize((2,), "dram")  # e.g. HBM holds it now
    est.waiting((0, "b"), (2,), 1.0)  # a refresh from the hint plane does not undo that
    assert mgr.evict("dram", 1) == (2,)


def test_a_finished_sub_agent_hands_its_parents_prefix_back():
    clock = _Clock()
    est = AgentNextUse(clock)
    parent, child = (0, "root"), (0, "sub")
    est.waiting(parent, (1, 2), 5.0)
    est.used(child, (1, 2, 3, 4))  # the sub-agent extends the parent's context
    est.ended(child, (1, 2, 3, 4), 2, heir=parent, inherited=2)
    assert est.next_use(3) == est.next_use(4) == NEVER
    assert est.next_use(1) == est.next_use(2) == 5.0 * est.trust - 0.0


def test_a_finished_agents_shared_prefix_is_not_dead():
    clock = _Clock()
    est = AgentNextUse(clock)
    est.ended((0, "a"), (1, 2, 3, 4), dead_from=2)  # other chains branch from (1, 2)
    assert est.next_use(3) == est.next_use(4) == NEVER
    assert est.next_use(1) == est.next_use(2) == 0.0  # unclaimed: by when it is pushed (trust 0: no user turn)


def test_an_untagged_chains_head_keeps_its_rank_when_its_tail_is_evicted():
    """A chain's parent is held out of the order while its children are stored (they
    must go first). When the tail goes, the parent comes back with the rank it had,
    as LRU keeps its place: it used to come back as most recent (an unclaimed block
    ranks by now), so an old one-shot request's head outlived a waiting agent that
    came after it, and the hint did harm (issue 41; measured on MLA live)."""
    clock = _Clock()
    est = AgentNextUse(clock)
    mgr = TierManager([TierSpec("dram", 6, est.policy())], record_events=False)
    _stored(mgr, "dram", (1, 2, 3))  # an untagged one-shot request, stored at t=0
    clock.t = 1.0
    _stored(mgr, "dram", (7, 8))
    est.waiting((0, "agent"), (7, 8), 1.0)  # an agent stops at t=1, back in 1 s
    clock.t = 2.0
    _stored(mgr, "dram", (20,))  # more untagged traffic fills the tier
    assert mgr.evict("dram", 1) == (3,)  # the oldest chain's tail
    _stored(mgr, "dram", (21,))
    # its head ranks by t=0 still, before the agent (t=1): blocks 2 and 1 go first
    assert mgr.evict("dram", 2) == (2, 1)
    assert mgr.evict("dram", 1) == (8,)
    mgr.check_invariants()


def test_a_tool_wait_never_ranks_an_agent_behind_untagged_traffic_of_the_same_age():
    """Untagged requests are taken as a user's turn (``user_wait_s`` ahead), as an
    agent waiting on its user is: an agent announcing a shorter tool wait outlives
    untagged traffic stored when its wait started (before, that traffic ranked as
    just used, and the hint put the agent first in line)."""
    for trust, first in ((0.5, 5), (1.0, 5)):
        clock = _Clock()
        est = AgentNextUse(clock, trust=trust, user_wait_s=60.0)
        mgr = TierManager([TierSpec("dram", 2, est.policy())], record_events=False)
        _stored(mgr, "dram", (5,))  # untagged, stored at t=0
        _stored(mgr, "dram", (7,))
        est.waiting((0, "agent"), (7,), 30.0)  # at t=0 too, back in 30 s
        assert mgr.evict("dram", 1) == (first,), trust


def test_an_agent_that_may_be_done_goes_before_long_tool_waits_where_a_users_turn_would_not():
    """A turn that calls no tool: in the replay a user's turn (``user_wait_s``, a knob, 60 s)
    or the agent's end; live, until a hint server reports which, either (``turn_end``,
    ``TURN_END_GAP_S``). As a user's turn, an agent stopped 5 s after another went on a
    60 s tool outlives it; as a turn end, it goes first, as a finished agent would."""
    from kvtier.placement.base import TURN_END_GAP_S

    for user_wait_s, done_wait_s, first in ((60.0, None, 1), (300.0, None, 2), (60.0, TURN_END_GAP_S, 2)):
        clock = _Clock()
        policy = make_placement("kvtier", params={"user_wait_s": user_wait_s, "next_use_trust": 0.5})
        policy.eviction_for("dram", clock)
        est = policy._est
        assert (est.user_wait_s, est.trust) == (user_wait_s, 0.5)
        mgr = _tier(est, (1,), (2,))
        est.waiting((0, "tool"), (1,), 60.0)  # t=0: a 60 s tool wait
        clock.t = 5.0
        est.waiting((0, "done"), (2,), done_wait_s)  # t=5: a turn without a tool call
        assert mgr.evict("dram", 1) == (first,), (user_wait_s, done_wait_s)


def test_the_estimate_forgets_blocks_no_tier_holds():
    clock = _Clock()
    est = AgentNextUse(clock, max_agents=2)
    est._sweep_at = 8
    mgr = _tier(est, (1, 2))
    est.waiting((0, "a"), tuple(range(1, 20)), 1.0)  # blocks 3..19 are in no tier
    assert set(est._owner) == {1, 2}
    for i in range(5):
        est.waiting((1, str(i)), (100 + i,), 1.0)
    assert len(est._serial) == 2 and len(est._rank) <= 2
    mgr.check_invariants()


# ------------------------------------------------------------ through the simulator


def _req(i: int, blocks, gap_s: float = 0.0, cause: str = "start", out: int = 8) -> Request:
    return Request(i, len(blocks) * BS + 10, out, tuple(blocks), gap_s, cause, "tool_use", 0.0)


def _three_agents() -> Workload:
    """Three sessions whose contexts (5 blocks each, 15 in all) fit HBM + DRAM (8 + 8)
    but not DRAM alone, each coming back after a tool call."""
    sessions = []
    for s in range(3):
        base = 100 * (s + 1)
        first = list(range(base, base + 4))
        reqs = [_req(0, first, out=40)]
        for turn in range(1, 4):
            reqs.append(_req(turn, list(range(base, base + 4 + turn)), 20.0 + s, "tool", out=40))
        sessions.append(Session(f"s{s}", (Agent("root", None, "main", tuple(reqs)),)))
    return Workload("three", BS, tuple(sessions), False)


def _computed(policy: str, surface: str = "full") -> int:
    cfg = SimConfig(hbm_blocks=8, dram_blocks=8, conc=3, surface=surface)
    sim = Simulator(_three_agents(), cfg, make_placement(policy), PROFILE)
    res = sim.run()
    assert len(res.records) == 12
    sim.mgr.check_invariants()
    return sum(r.computed_tokens for r in res.records)


def test_exclusive_dram_holds_what_inclusive_dram_cannot():
    exclusive, inclusive = _computed("kvtier"), _computed("kvtier-inclusive")
    assert exclusive < inclusive
    assert exclusive < _computed("lru-dram")


def test_the_vllm_write_through_surface_has_no_victim_write():
    """vLLM reuses an evicted block before a connector without ``exclusive_dram`` hears of it:
    on that surface kvtier writes through, exactly as its inclusive ablation does."""
    assert _computed("kvtier", "vllm-write-through") == _computed("kvtier-inclusive", "vllm-write-through")


def test_exclusive_dram_comes_close_to_one_tier_of_the_same_size():
    """HBM 8 + DRAM 8 as exclusive tiers against 16 blocks as one tier: loads move
    (no DRAM copy of what HBM holds is left parked under a suffix), and the
    victims of an admission land in the DRAM slots its loads free instead of
    evicting from a DRAM that is about to empty (before both, 1.47x)."""
    tiered = _computed("kvtier")
    cfg = SimConfig(hbm_blocks=16, dram_blocks=0, conc=3)
    one_tier = sum(r.computed_tokens for r in Simulator(_three_agents(), cfg, make_placement("kvtier"),
                                                        PROFILE).run().records)
    assert tiered <= 1.1 * one_tier, (tiered, one_tier)


def test_a_request_that_cannot_fit_waits_without_evicting():
    """An engine checks its free plus evictable blocks before it allocates: an
    admission that fails must not have pushed anything out of HBM first."""
    cfg = SimConfig(hbm_blocks=8, dram_blocks=8, conc=3)
    sim = Simulator(_three_agents(), cfg, make_placement("kvtier"), PROFILE)
    admit, failed = sim.admission.admit, []

    def checked(run):
        before, victims = set(sim.mgr._ready[0]), len(sim.victims.pending)
        ok = admit(run)
        if not ok:
            failed.append(len(before))
            assert set(sim.mgr._ready[0]) == before and len(sim.victims.pending) == victims
        return ok

    sim.admission.admit = checked
    sim.run()
    assert failed and max(failed) > 0  # it was tried with blocks in HBM that could have gone
    sim.mgr.check_invariants()


def test_a_victim_on_its_way_down_is_found():
    """HBM victims are readable nowhere while their copy is under way; a request
    that wants them lands them in DRAM at once (and loads them once the copy is
    done) instead of recomputing them."""
    cfg = SimConfig(hbm_blocks=4, dram_blocks=4, conc=1)
    sim = Simulator(_three_agents(), cfg, make_placement("kvtier"), PROFILE)
    mgr = sim.mgr
    _stored(mgr, "hbm", (1, 2, 3, 4))
    assert set(mgr.evict("hbm", 2)) == {3, 4}
    done = sim.victims.write()
    assert done is not None and not mgr.contains(3) and not mgr.contains(4)
    assert sim.victims.land((1, 2, 3, 4), 2) == done
    assert mgr.lookup((1, 2, 3, 4)).tiers == ("hbm", "hbm", "dram", "dram")
    assert sim.counters["victims_landed_early"] == 2
    while sim.event_queue:  # the copy's own landing finds them there already
        _, _, fn, args = sim.event_queue.pop()
        fn(*args)
    assert mgr.ready_blocks("dram") == 2
    mgr.check_invariants()


def test_a_queued_request_has_its_ssd_blocks_staged_into_dram():
    """kvtier stages a queued request's SSD-only blocks into DRAM while others
    compute; a request the admission pass took at once loads from SSD itself."""
    from types import SimpleNamespace

    cfg = SimConfig(hbm_blocks=8, dram_blocks=8, ssd_blocks=16, conc=1)
    sim = Simulator(_three_agents(), cfg, make_placement("kvtier"), PROFILE)
    mgr = sim.mgr
    _stored(mgr, "ssd", (1, 2, 3, 4))
    _stored(mgr, "dram", (1,))
    _stored(mgr, "ssd", (9, 10))
    queued, admitted = (1, 2, 3, 4), (9, 10)
    sim.policy.on_wait_end(sim.ctx, (0, "root"), queued)  # the policy's hook asks for it
    sim.ctx.stage(admitted)
    sim.waiting.append(SimpleNamespace(keys=queued))  # left queued by the pass
    sim.prefetches.stage_queued()
    assert sim.counters["staged_blocks"] == 3  # 2, 3, 4: block 1 is in DRAM already
    while sim.event_queue:
        _, _, fn, args = sim.event_queue.pop()
        fn(*args)
    assert mgr.lookup(queued).tiers == ("dram",) * 4
    assert mgr.lookup(admitted).tiers == ("ssd", "ssd")
    mgr.check_invariants()
    # the ablation without time-based decisions does not stage
    sim = Simulator(_three_agents(), cfg, make_placement("kvtier-space-only"), PROFILE)
    sim.policy.on_wait_end(sim.ctx, (0, "root"), queued)
    assert sim.prefetches.to_stage == []
