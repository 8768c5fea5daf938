"""TierManager scenarios (exact blocks and eviction order) and a seeded stress test."""

from __future__ import annotations

import random

import pytest

from kvtier.errors import ConfigError, ProtocolError, UnknownPolicyError
from kvtier.events import BlockRemoved, BlockStored, PinRefused, StoreFailed
from kvtier.keys import BlockKey
from kvtier.manager import TierManager, TierSpec


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def K(*ids: int) -> list[BlockKey]:
    return [BlockKey(i) for i in ids]


def store(m: TierManager, tier: str, keys, parent=None, ok=True, chain=True):
    plan = m.prepare_store(tier, keys, parent, chain=chain)
    assert plan is not None
    m.complete_store(plan, ok)
    m.check_invariants()
    return plan


def test_store_lookup_and_events() -> None:
    m = TierManager([TierSpec("hbm", 4), TierSpec("dram", 8)])
    store(m, "dram", K(1, 2, 3))
    store(m, "hbm", K(1, 2))
    # fastest copy wins; the prefix stops at the first unknown key
    assert m.lookup(K(1, 2, 3, 4)).tiers == ("hbm", "hbm", "dram")
    assert m.lookup(K(9, 1)).num_blocks == 0
    events = m.take_events()
    assert [type(e) for e in events] == [BlockStored] * 5
    assert events[1] == BlockStored(BlockKey(2), "dram", BlockKey(1))
    assert m.take_events() == []


def test_pending_store_is_not_readable_and_failure_drops_it() -> None:
    m = TierManager([TierSpec("dram", 4)])
    plan = m.prepare_store("dram", K(1, 2))
    assert m.lookup(K(1, 2)).num_blocks == 0  # pending: not readable yet
    m.complete_store(plan, [True, False])
    m.check_invariants()
    assert m.lookup(K(1, 2)).num_blocks == 1
    assert m.used_blocks("dram") == 1
    assert StoreFailed(BlockKey(2), "dram") in m.take_events()
    with pytest.raises(ProtocolError):
        m.complete_store(plan, True)  # completed twice


def test_lru_eviction_is_tail_first_within_a_chain() -> None:
    m = TierManager([TierSpec("dram", 4)])
    store(m, "dram", K(1, 2, 3))  # chain 1 <- 2 <- 3
    store(m, "dram", K(10))  # an unrelated, more recent root
    # A new block needs room: LRU order would pick 1 (oldest), but 1 and 2 have
    # children present, so the chain's tail (3) goes first.
    plan = store(m, "dram", K(20))
    assert plan.evicted == (BlockKey(3),)
    plan = store(m, "dram", K(21))
    assert plan.evicted == (BlockKey(2),)
    assert m.lookup(K(1, 2)).num_blocks == 1


def test_touch_keeps_shared_prefix_alive() -> None:
    m = TierManager([TierSpec("dram", 3)])
    store(m, "dram", K(1, 2))
    store(m, "dram", K(3), parent=BlockKey(1))  # 1 is shared by 2 and 3
    m.touch(K(1, 2), "dram")
    # 3 is the least recent leaf; 1 cannot go while it has children.
    assert store(m, "dram", K(4)).evicted == (BlockKey(3),)
    assert store(m, "dram", K(5)).evicted == (BlockKey(2),)
    assert m.contains(BlockKey(1), "dram")


def test_store_of_a_chain_stores_the_prefix_that_fits() -> None:
    m = TierManager([TierSpec("hbm", 2)])
    m.acquire([])  # no-op
    plan = m.prepare_store("hbm", K(1, 2, 3))
    assert plan.keys == (BlockKey(1), BlockKey(2))
    m.complete_store(plan, True)
    m.acquire(K(1, 2))  # e.g. a running request holds them
    assert m.prepare_store("hbm", K(7)) is None  # nothing evictable
    m.release(K(1, 2))
    assert store(m, "hbm", K(7)).evicted == (BlockKey(2),)
    m.check_invariants()


def test_parent_of_a_chain_is_not_evicted_to_store_its_child() -> None:
    m = TierManager([TierSpec("dram", 2)])
    store(m, "dram", K(1))
    store(m, "dram", K(5))
    m.touch(K(5), "dram")
    m.touch(K(1), "dram")  # 5 is LRU, then 1
    plan = store(m, "dram", K(2), parent=BlockKey(1))
    assert plan.evicted == (BlockKey(5),)
    m.touch(K(5), "dram")
    # full: 1 <- 2. Storing 3 under 2: 2 is protected as the parent, 1 has a child.
    assert m.prepare_store("dram", K(3), parent=BlockKey(2)) is None


def test_load_refs_and_failed_verify_drops_copy() -> None:
    m = TierManager([TierSpec("dram", 2), TierSpec("ssd", 4)])
    store(m, "ssd", K(1, 2))
    store(m, "dram", K(1))
    plan = m.prepare_load(K(1, 2, 3))
    assert plan.keys == (BlockKey(1), BlockKey(2)) and plan.tiers == ("dram", "ssd")
    # loading blocks are referenced: a store that needs room cannot evict 1
    assert m.prepare_store("dram", K(8, 9), chain=False).evicted == ()
    m.complete_load(plan, [True, False])  # block 2 on ssd failed its checksum
    m.check_invariants()
    assert m.lookup(K(1, 2)).tiers == ("dram",)
    assert BlockRemoved(BlockKey(2), "ssd", "failed_verify") in m.take_events()


def test_move_promote_keeps_source_and_demote_drops_it() -> None:
    m = TierManager([TierSpec("hbm", 2), TierSpec("dram", 4), TierSpec("ssd", 8)])
    store(m, "ssd", K(1, 2))
    up = m.prepare_move(K(1, 2), "ssd", "dram")
    assert up.keep_source and m.lookup(K(1)).tiers == ("ssd",)
    m.complete_move(up, True)
    m.check_invariants()
    assert m.tiers_of(BlockKey(1)) == ("dram", "ssd")
    down = m.prepare_move(K(1, 2), "dram", "ssd")
    assert down is None  # already on ssd
    store(m, "hbm", K(1, 2))
    down = m.prepare_move(K(1, 2), "hbm", "dram")
    assert down is None
    m.remove(K(1, 2), "dram")
    down = m.prepare_move(K(1, 2), "hbm", "dram")
    m.complete_move(down, [True, False])
    m.check_invariants()
    # block 1 moved (left hbm); block 2's copy failed: still only in hbm and ssd
    assert m.tiers_of(BlockKey(1)) == ("dram", "ssd")
    assert m.tiers_of(BlockKey(2)) == ("hbm", "ssd")


def test_pins_budget_ttl_and_protection() -> None:
    clock = FakeClock()
    m = TierManager([TierSpec("dram", 2)], pin_budget_blocks=1, clock=clock)
    store(m, "dram", K(1))
    store(m, "dram", K(2))
    assert m.pin(K(1), ttl_s=5.0) == 1
    assert m.pin(K(2), ttl_s=5.0) is None  # over budget: all or nothing
    assert isinstance(m.take_events()[-1], PinRefused)
    assert store(m, "dram", K(3)).evicted == (BlockKey(2),)  # 1 is pinned
    clock.now = 6.0  # the pin lapsed: 1 re-enters the LRU order as its most recent block
    assert m.num_pinned() == 0
    assert store(m, "dram", K(4)).evicted == (BlockKey(3),)
    assert store(m, "dram", K(5)).evicted == (BlockKey(1),)


def test_held_blocks_are_parked_and_come_back_most_recent() -> None:
    m = TierManager([TierSpec("dram", 3)])
    store(m, "dram", K(1))
    store(m, "dram", K(2))
    store(m, "dram", K(3))
    m.acquire(K(1))  # held: out of the LRU order, whatever its age
    assert store(m, "dram", K(4)).evicted == (BlockKey(2),)
    m.release(K(1))  # idle again, as the most recent block
    assert store(m, "dram", K(5)).evicted == (BlockKey(3),)
    assert store(m, "dram", K(6)).evicted == (BlockKey(4),)
    assert store(m, "dram", K(7)).evicted == (BlockKey(1),)


def test_evict_and_remove() -> None:
    m = TierManager([TierSpec("hbm", 4)])
    store(m, "hbm", K(1, 2, 3))
    assert m.evict("hbm", 2) == (BlockKey(3), BlockKey(2))
    assert m.remove(K(1)) == 1
    m.check_invariants()
    assert m.used_blocks("hbm") == 0


@pytest.mark.parametrize(
    ("tiers", "setting"),
    [
        ([TierSpec("dram", -1)], "tiers.dram.capacity_blocks"),
        ([TierSpec("tape", 1)], "tiers"),
        ([], "tiers"),
    ],
)
def test_bad_tier_specs_name_the_setting(tiers, setting) -> None:
    with pytest.raises(ConfigError, match=setting):
        TierManager(tiers)


def test_unknown_policy_lists_valid_names() -> None:
    with pytest.raises(UnknownPolicyError, match=r"tiers\.ssd\.policy.*lru"):
        TierManager([TierSpec("ssd", 4, policy="random-ish")])


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "arc", "s3fifo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stress_invariants_after_every_step(policy: str, seed: int) -> None:
    """Random interleavings of every operation; invariants checked after each."""
    rng = random.Random(seed)
    clock = FakeClock()
    m = TierManager(
        [TierSpec("hbm", 6, policy), TierSpec("dram", 12, policy), TierSpec("ssd", 24, policy)],
        pin_budget_blocks=5,
        clock=clock,
    )
    tiers = m.tier_names
    # a small forest of chains sharing prefixes
    chains = [[BlockKey(1000 * c + i) for i in range(rng.randint(1, 8))] for c in range(12)]
    for c in range(3, 12):
        chains[c] = chains[rng.randrange(3)][: rng.randint(0, 3)] + chains[c]
    open_plans: list = []
    refs: list[BlockKey] = []
    for _ in range(1500):
        clock.now += rng.random()
        chain = rng.choice(chains)
        op = rng.random()
        if op < 0.3:
            plan = m.prepare_store(rng.choice(tiers), chain)
            if plan is not None:
                open_plans.append(plan)
        elif op < 0.45 and open_plans:
            plan = open_plans.pop(rng.randrange(len(open_plans)))
            ok = [rng.random() < 0.9 for _ in plan.keys]
            if hasattr(plan, "dst"):
                m.complete_move(plan, ok)
            elif hasattr(plan, "skipped"):
                m.complete_store(plan, ok)
            else:
                m.complete_load(plan, ok)
        elif op < 0.55:
            plan = m.prepare_load(chain)
            if plan is not None:
                open_plans.append(plan)
        elif op < 0.65:
            src, dst = rng.sample(tiers, 2)
            plan = m.prepare_move(chain, src, dst)
            if plan is not None:
                open_plans.append(plan)
        elif op < 0.75:
            m.touch(chain[: m.lookup(chain).num_blocks], rng.choice(tiers))
        elif op < 0.8:
            m.pin(chain[:2], ttl_s=rng.uniform(0.5, 5))
        elif op < 0.83:
            m.unpin(chain)
        elif op < 0.88:
            known = [k for k in chain if m.contains(k)]
            if known:
                m.acquire(known[:1])
                refs.append(known[0])
        elif op < 0.93 and refs:
            m.release([refs.pop(rng.randrange(len(refs)))])
        elif op < 0.97:
            m.remove(chain[-2:], rng.choice([None, *tiers]))
        else:
            m.evict(rng.choice(tiers), rng.randint(1, 4))
        m.check_invariants()
        # readable blocks always form a chain-consistent view: a hit's tier holds it
        hit = m.lookup(chain)
        for key, tier in zip(chain, hit.tiers):
            assert m.contains(key, tier)
    m.take_events()


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "arc", "s3fifo"])
@pytest.mark.parametrize("seed", [0, 1])
def test_fresh_chain_reservation_matches_the_per_key_path(policy: str, seed: int, monkeypatch) -> None:
    """prepare_store reserves a fresh chain with one C-speed update per structure
    (and completes it without looking its keys up while no later plan was
    prepared); a second manager forced onto the per-key loop gets the same
    inputs. Some plans stay open while later ones (e.g. a chain continuing
    theirs) are prepared and completed, some keys are referenced while pending.
    Every plan, event, lookup and the final eviction order of each tier must agree."""
    rng = random.Random(seed)
    managers = []
    for fast in (True, False):
        m = TierManager([TierSpec("dram", 150, policy), TierSpec("ssd", 400, policy)], pin_budget_blocks=4,
                        clock=FakeClock())
        if not fast:
            monkeypatch.setattr(m, "_is_fresh_chain", lambda *a: False)
        managers.append(m)
    fresh_plans = fresh_completions = 0
    open_plans: list[tuple[list, list[bool] | bool]] = []  # (plan per manager, ok)
    refs: list[BlockKey] = []  # keys referenced while their store was in flight, not released yet

    def complete(entry) -> None:
        plans, ok = entry
        for m, plan in zip(managers, plans):
            m.complete_store(plan, ok)

    roots = [BlockKey(r) for r in range(1, 6)]
    chains: list[list[BlockKey]] = []
    next_key = 100
    for _ in range(600):
        op = rng.random()
        if op < 0.45 or not chains:  # a new chain, after a known or unknown parent, or a root
            n = rng.randint(1, 9)
            chain = [BlockKey(next_key + i) for i in range(n)]
            next_key += n
            parent = rng.choice([None, rng.choice(roots), *(c[-1] for c in chains[-3:])])
            if rng.random() < 0.1:
                chain.append(chain[0])  # a repeated key: the per-key path's business
            chains.append(chain)
        else:  # an existing chain again (skips), or extended (often a recent one, maybe still in flight)
            chain = rng.choice(chains[-3:] if rng.random() < 0.5 else chains)
            parent = None
            if rng.random() < 0.5:
                chain = chain + [BlockKey(next_key)]
                next_key += 1
        tier = rng.choice(["dram", "ssd"])
        ok = [rng.random() < 0.9 for _ in range(len(chain))]
        all_ok, load = rng.random() < 0.5, rng.random() < 0.2
        defer, reference = rng.random() < 0.3, rng.random() < 0.2
        results = []
        plans = [m.prepare_store(tier, chain, parent) for m in managers]
        fresh = managers[0]._fresh_plan_id == managers[0]._last_plan_id and plans[0] is not None
        fresh_plans += fresh
        if plans[0] is not None:
            entry = (plans, True if all_ok else ok[: len(plans[0].keys)])
            if reference and plans[0].keys:  # a key (the tail) referenced while its store is in flight
                refs.append(plans[0].keys[-1])
                for m in managers:
                    m.acquire(refs[-1:])
            if defer:
                open_plans.append(entry)
            else:
                fresh_completions += fresh
                complete(entry)
        if open_plans and rng.random() < 0.4:  # an older plan completes after later ones
            complete(open_plans.pop(rng.randrange(len(open_plans))))
        if refs and rng.random() < 0.2:
            ref = refs.pop(rng.randrange(len(refs)))
            for m in managers:
                m.release([ref])
        for m, plan in zip(managers, plans):
            outcome = None if plan is None else (plan.keys, plan.slots, plan.skipped, plan.evicted)
            if load:
                hit = m.prepare_load(chain)
                if hit is not None:
                    m.complete_load(hit, True)
            results.append((outcome, m.take_events(), m.lookup(chain), m.parent_of(chain[0])))
            m.check_invariants()
        assert results[0] == results[1]
    while open_plans:
        complete(open_plans.pop())
    for m in managers:
        m.release(refs)
    for m in managers:
        m.check_invariants()
    for tier in ("dram", "ssd"):
        assert managers[0].evict(tier, 500) == managers[1].evict(tier, 500)
    # the fast paths ran (on the fast manager only)
    assert fresh_plans > 50 and fresh_completions > 30, (fresh_plans, fresh_completions)
