"""The peers' models (``kvtier.placement.peers``): each one's defining behaviour, through the
manager that runs it, and a replay of each."""

from __future__ import annotations

import math

import pytest

from kvtier.keys import BlockKey
from kvtier.manager import TierManager, TierSpec
from kvtier.placement import ToolWait, make_placement
from kvtier.policies.sae import SAEOrder


def K(*ids: int) -> tuple[BlockKey, ...]:
    return tuple(BlockKey(i) for i in ids)


def _store(m: TierManager, keys: tuple[BlockKey, ...], parent: BlockKey | None = None):
    plan = m.prepare_store("dram", keys, parent)
    if plan is not None:
        m.complete_store(plan, True)
    m.check_invariants()
    return plan


def _sae(capacity: int = 6) -> tuple[SAEOrder, TierManager, list[str]]:
    counted: list[str] = []
    order = SAEOrder(count=counted.append)
    return order, TierManager([TierSpec("dram", capacity, order)]), counted


class _Usage:
    """The two context readings vllm-tiering's store rule takes (HBM referenced, capacity) and its counters."""

    def __init__(self) -> None:
        self.hbm_capacity_blocks, self.used, self.counts = 100, 0, []

    def running_blocks(self) -> int:
        return self.used

    def count(self, name: str, n: int = 1) -> None:
        self.counts.append(name)


def test_the_worst_scored_group_goes_first_tail_first() -> None:
    """Two groups at start_pos 0; a touch of B's blocks gives B a hit and a later touch time
    (score A 30,000, B 1 + 1,500 + 30,000), so a new group's room comes from A, newest first."""
    order, m, _ = _sae()
    a, b = K(1, 2, 3), K(11, 12, 13)
    order.open_store("A", a)
    _store(m, a)
    order.open_store("B", b)
    _store(m, b)
    order.touch(b)
    ga, gb = order.group_of(a[0]), order.group_of(b[0])
    assert (order.score(ga), order.score(gb)) == (30000.0, 31501.0)
    order.open_store("C", K(21, 22))
    plan = _store(m, K(21, 22))
    assert plan.evicted == K(3, 2)  # A's tail first; B untouched
    assert m.lookup(b).num_blocks == 3
    order.check_invariants()


def test_the_gate_declines_a_deep_store_unless_it_continues_its_group() -> None:
    """Groups A (8 blocks), B (3, touched once) and C (1). A request with A's 8 blocks ahead of a
    new one stores at start_pos 8: its baseline 1 + 30,000 / 2 = 15,001 is under the worst score
    (30,000): declined, nothing evicted. The same store by a request whose lookup hit A continues
    A: no gate, and the worst group (C, untouched) gives its block."""
    order, m, counted = _sae(12)
    a, b, c = K(*range(1, 9)), K(11, 12, 13), K(21)
    for name, keys in (("A", a), ("B", b), ("C", c)):
        order.open_store(name, keys)
        _store(m, keys)
    order.touch(b)
    order.open_store("D", (*a, BlockKey(9)))
    assert m.prepare_store("dram", K(9), BlockKey(8)) is None  # no room made: the store is dropped
    assert counted == ["sae_stores_declined"]
    assert m.used_blocks("dram") == 12
    order.lookup("E", (*a, BlockKey(9)))  # hits A's 8 blocks: E continues A (and A is touched)
    order.open_store("E", (*a, BlockKey(9)))
    assert counted[-1] == "sae_stores_merged"
    plan = _store(m, K(9), BlockKey(8))
    assert plan.keys == K(9) and plan.evicted == c
    assert order.group_of(BlockKey(9)) == order.group_of(a[0])


def test_ghost_scores_outlive_eviction_and_seed_a_new_group() -> None:
    """Keys looked up while absent gain ghost scores (``1 / log2(i + 2)`` each); a group that
    stores them starts with hits = their sum / 12, truncated; ghosts decay every 500 touches."""
    order, m, _ = _sae(4)
    keys = K(1, 2)
    for _ in range(12):
        order.touch(keys)  # absent: misses, weight 1 at positions 0 and 1
    assert order.ghost(keys[0]) == pytest.approx(12.0)
    assert order.ghost(keys[1]) == pytest.approx(12 / math.log2(3))
    order.open_store("A", keys)
    _store(m, keys)
    order.open_store("B", K(9))  # closes A: its seeded hits truncated
    assert order.score(order.group_of(keys[0])) == 12 + 1500 * int((12 + 12 / math.log2(3)) / 12) + 30000
    decaying = SAEOrder(decay_interval=2)
    decaying.touch(keys)
    decaying.touch(keys)
    assert decaying.ghost(keys[0]) == pytest.approx(2 * 0.9)


def test_a_batch_that_stored_touches_its_requests_keys_when_it_closes() -> None:
    """vLLM touches a request's keys after each store batch that stored: the timer advances by the
    batches, and every group of the request's context gains a hit each time."""
    order, m, _ = _sae()
    a = K(1, 2)
    order.open_store("A", a, touch=a)
    _store(m, a)
    order.close()
    group = order.group_of(a[0])
    assert order.timer == 1 and order.score(group) == 1 + 1500 + 30000
    order.open_store("A", (), touch=a, times=3)  # three answer blocks, one batch each
    _store(m, K(3), BlockKey(2))
    order.close()
    assert order.timer == 4 and order.score(group) == 4 + 4 * 1500 + 30000
    order.open_store("B", (), touch=K(9), times=5)  # stored nothing: no touch
    order.close()
    assert order.timer == 4


def test_sae_placement_stores_nothing_more_of_a_request_whose_batch_was_declined() -> None:
    """The answer's blocks of a request whose prompt batch the gate declined are not offered
    (vLLM retries the declined batch with them; their parents are not stored); the next request
    of the agent is offered again."""
    policy = make_placement("sae")
    order = policy.eviction_for("dram")
    m = TierManager([TierSpec("dram", 4, order)])
    ctx = _Usage()
    in_hbm = {}
    ctx.blocks_in = lambda keys, tier: in_hbm.get(len(keys), 0)
    for agent, keys in (("a", K(1, 2)), ("b", K(11, 12))):
        policy.on_wait_end(ctx, (0, agent), keys)
        assert policy.admit_lower(ctx, "dram", (0, agent), 2) == 2
        _store(m, keys)
    deep = (*K(1, 2), BlockKey(3))  # a's next request, all of it an HBM hit: vLLM looks up nothing here
    in_hbm[3] = 3
    policy.on_wait_end(ctx, (0, "a"), deep)
    assert policy.admit_lower(ctx, "dram", (0, "a"), 1) == 1  # no merge: start_pos 2, 30,000 / 1.25 + timer
    assert m.prepare_store("dram", K(3), BlockKey(2)) is None
    assert ctx.counts == ["sae_stores_declined"]
    assert policy.admit_lower(ctx, "dram", (0, "a"), 2) == 0  # the answer's blocks: not offered
    assert ctx.counts == ["sae_stores_declined", "sae_batches_after_a_decline"]
    policy.on_wait_start(ctx, ToolWait((0, "a"), deep, "tool", 1.0))
    policy.on_wait_end(ctx, (0, "a"), deep)
    assert policy.admit_lower(ctx, "dram", (0, "a"), 1) == 1


def test_a_block_joins_its_batchs_group_when_its_store_is_prepared_not_when_it_lands() -> None:
    """Two batches prepared before either copy lands (the replay's stores land later): each
    block is in its own batch's group, a hit only once landed, and a batch that prepared
    blocks touches its request's keys when it closes."""
    order, m, _ = _sae()
    a, b = K(1, 2), K(11, 12)
    order.open_store("A", a, touch=a)
    plan_a = m.prepare_store("dram", a)
    order.open_store("B", b, touch=b)
    plan_b = m.prepare_store("dram", b)
    order.close()
    assert order.timer == 2  # both batches stored: one touch each
    assert order.group_of(a[0]) == order.group_of(a[1]) != order.group_of(b[0]) == order.group_of(b[1])
    order.touch(a)  # not landed: misses (weight 1 at position 0), as at A's close
    assert order.ghost(a[0]) == pytest.approx(2)
    m.complete_store(plan_b, True)
    m.complete_store(plan_a, True)
    m.check_invariants()
    order.check_invariants()
    order.touch(a)  # landed: a hit (weight 12)
    assert order.ghost(a[0]) == pytest.approx(2 + 12)


def test_the_lookup_starts_past_the_engines_own_hit() -> None:
    """vLLM looks up past what its HBM prefix cache holds: a hit only there sets no merge pointer,
    so the next store opens a group of its own."""
    order, m, counted = _sae()
    shared = K(1, 2)
    order.open_store("A", shared)
    _store(m, shared)
    order.lookup("B", (*shared, BlockKey(5)), start=2)  # the shared prefix was an HBM hit
    order.open_store("B", (*shared, BlockKey(5)))
    assert "sae_stores_merged" not in counted
    _store(m, K(5), BlockKey(2))
    assert order.group_of(BlockKey(5)) != order.group_of(shared[0])


def test_vllm_tiering_stores_only_under_pressure_for_returning_sessions_within_its_budgets() -> None:
    """PR #48837 at its defaults: nothing stored without HBM pressure (on at 70% referenced, off at 50%,
    kept in between) or for a session's first request; at most 64 blocks a request and a session,
    128 in all, per pressure episode."""
    policy, ctx = make_placement("vllm-tiering"), _Usage()
    a, b, c = (0, "main"), (1, "main"), (2, "main")
    for agent in (a, b, c):
        policy.on_wait_end(ctx, agent, ())
    ctx.used = 72
    assert policy.admit_lower(ctx, "dram", a, 50) == 0  # a session seen once: cold
    assert ctx.counts[-1] == "tiering_stores_cold_session"
    for agent in (a, b, c):
        policy.on_wait_end(ctx, agent, ())
    assert policy.admit_lower(ctx, "dram", a, 50) == 50
    assert policy.admit_lower(ctx, "dram", a, 50) == 14  # 64 a request (and a session)
    ctx.used = 60  # between the watermarks: still under pressure
    assert policy.admit_lower(ctx, "dram", b, 80) == 64
    assert policy.admit_lower(ctx, "dram", c, 10) == 0  # 128 in this episode
    assert ctx.counts[-1] == "tiering_stores_over_budget"
    ctx.used = 50  # pressure off: the episode's budgets reset, nothing stored
    assert policy.admit_lower(ctx, "dram", c, 10) == 0
    assert ctx.counts[-1] == "tiering_stores_no_pressure"
    ctx.used = 69
    assert policy.admit_lower(ctx, "dram", c, 10) == 0  # not yet on again
    ctx.used = 70
    assert policy.admit_lower(ctx, "dram", c, 10) == 10


def test_the_peers_are_registered_as_their_systems_ship_them() -> None:
    """SAE: vLLM's CPU offloading, written through, replay only (the connector refuses it:
    tests/engine/test_connector_settings.py); LMCache's lazy offload: stores at eviction."""
    sae, lazy = make_placement("sae"), make_placement("lmcache-lazy")
    assert sae.write_through and sae.write_back_dram is None and sae.lower_tiers == ("dram",) and sae.replay_only
    assert lazy.write_back_dram == "evict" and lazy.lower_tiers == ("dram",) and not lazy.replay_only


@pytest.mark.parametrize("name", ["sae", "lmcache-lazy", "vllm-tiering"])
def test_each_peer_replays_on_the_live_surface(name: str) -> None:
    """The embedded workload on the vLLM surface and scheduler: each runs, computes no more than
    HBM alone and hits DRAM; SAE counts its gate's decisions."""
    from kvtier.replay.generator import default_workload
    from kvtier.replay.profiles import DEFAULT_PROFILE, parse_profile
    from kvtier.replay.report import summarize
    from kvtier.replay.run import ReplaySpec, sim_config
    from kvtier.replay.sim import Simulator

    wl = default_workload(seed=0, num_sessions=6)
    spec = ReplaySpec(workload=wl, profile=parse_profile(DEFAULT_PROFILE), surface="vllm", scheduler="vllm")
    cfg = sim_config(spec, 4, 1500)
    rows = {}
    for policy in ("lru", name):
        result = Simulator(wl, cfg, make_placement(policy), spec.profile).run()
        rows[policy] = summarize(result, policy=policy, conc=4, hbm_blocks=1500, num_chips=1)
    assert rows[name]["prefill_tokens_computed"] <= rows["lru"]["prefill_tokens_computed"]
    assert rows[name]["prefill_tokens_hit_dram"] > 0
    if name == "sae":
        assert rows[name]["counters"].get("sae_stores_declined", 0) + rows[name]["counters"].get(
            "sae_stores_merged", 0) > 0
