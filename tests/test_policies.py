"""Eviction policies: scenarios, differential tests against the brute-force
references in ``policy_refs``, a property test of the pop_victim contract,
and LRU / FIFO / ARC / S3-FIFO against libCacheSim on the Mooncake trace.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import UnknownPolicyError
from kvtier.keys import BlockKey
from kvtier.policies import EvictionPolicy, make_policy, policy_names
from policy_harness import DrivenTier, seeded_refusals, simulate, simulate_with_refusals
from policy_refs import REFERENCES

NAMES = ("lru", "fifo", "lfu", "arc", "s3fifo")
MOONCAKE_TRACE = Path("/work/shared/traces/mooncake_fast25/conversation_trace.jsonl")
MOONCAKE_CAPACITIES = (1000, 5000, 20000)
K = BlockKey


def _insert_all(policy: EvictionPolicy, keys: range) -> None:
    for key in keys:
        policy.before_insert(K(key))
        policy.on_insert(K(key))


def _pop(policy: EvictionPolicy, incoming: int | None = None) -> BlockKey | None:
    return policy.pop_victim(lambda key: True, None if incoming is None else K(incoming))


def _drain(policy: EvictionPolicy) -> list[BlockKey]:
    """Every resident key, in eviction order."""
    victims = []
    while (victim := _pop(policy)) is not None:
        victims.append(victim)
    return victims


def _first_mismatch(got: list[bool], expected: list[bool]) -> int | None:
    """Index of the first request on which two hit / miss sequences differ."""
    assert len(got) == len(expected)
    return next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)


# ------------------------------------------------------------------ registry


def test_unknown_policy_lists_every_name() -> None:
    with pytest.raises(UnknownPolicyError) as info:
        make_policy("nope", 10)
    for name in NAMES:
        assert name in str(info.value)
    assert set(NAMES) <= set(policy_names())


@pytest.mark.parametrize("name", NAMES)
def test_registered_policy_follows_protocol(name: str) -> None:
    policy = make_policy(name, 10)
    assert isinstance(policy, EvictionPolicy)
    assert policy.name == name
    assert len(policy) == 0 and _pop(policy) is None


# ----------------------------------------------------------------- scenarios


def test_fifo_hits_do_not_reorder() -> None:
    policy = make_policy("fifo", 3)
    _insert_all(policy, range(1, 4))  # order 1, 2, 3
    policy.on_access(K(1))  # still 1, 2, 3
    assert [_pop(policy), _pop(policy), _pop(policy)] == [1, 2, 3]


def test_lfu_orders_by_hits_then_last_access() -> None:
    policy = make_policy("lfu", 3)
    _insert_all(policy, range(1, 4))
    for key in (2, 1, 3, 3):  # hits 1:1, 2:1, 3:2; 2 was hit before 1
        policy.on_access(K(key))
    assert policy.pop_victim(lambda key: key != 2) == 1  # 2 refused: next in order
    assert [_pop(policy), _pop(policy), _pop(policy)] == [2, 3, None]


def test_arc_ghost_hit_adapts_target_and_lands_in_t2() -> None:
    policy = make_policy("arc", 2)
    _insert_all(policy, range(1, 3))  # T1 = [1, 2]
    policy.on_access(K(1))  # T1 = [2], T2 = [1]
    policy.before_insert(K(3))  # case IV-B: |L1| = 1 < c, nothing to trim
    assert _pop(policy, 3) == 2  # REPLACE: |T1| = 1 > p = 0; B1 = [2]
    policy.on_insert(K(3))  # T1 = [3]
    policy.before_insert(K(2))  # case II: ghost hit in B1, p = 0 + 1
    assert policy.target_t1_blocks == 1.0
    assert _pop(policy, 2) == 1  # |T1| = 1 = p and 2 not in B2: demote LRU of T2; B2 = [1]
    policy.on_insert(K(2))  # T1 = [3], T2 = [2]
    policy.before_insert(K(4))  # case IV-B again
    assert _pop(policy, 4) == 2  # |T1| = 1 = p: T2 again
    policy.check_invariants()


def test_arc_keeps_ghost_bound_when_stores_overlap() -> None:
    # The manager prepares a whole chain before completing it: both
    # before_insert / pop_victim rounds run before either on_insert.
    policy = make_policy("arc", 3)
    tier = DrivenTier(policy, 3)
    for key in (1, 2, 3):
        tier.request(K(key))  # T1 = [1, 2, 3], p = 0
    assert tier.store_batch([K(4), K(5)], lambda key: True) == [4, 5]
    # 4 dropped 1 unghosted (case IV-A, |T1| = c); 5 demoted 2 into B1. Now
    # T1 = [3, 4, 5], so |T1| + |B1| = 4 > c: B1 forgets 2.
    policy.check_invariants()
    policy.before_insert(K(2))
    assert policy.target_t1_blocks == 0.0  # no ghost hit: p unchanged


def test_s3fifo_filters_one_hit_wonders_and_readmits_ghosts_to_main() -> None:
    policy = make_policy("s3fifo", 10)  # S share 1 block, ghost 9 keys
    _insert_all(policy, range(10))  # S = [0..9], M = []
    policy.on_access(K(0))
    policy.on_access(K(0))  # freq(0) = 2
    assert _pop(policy, 10) == 1  # 0 moves to M, 1 (never hit) goes to G
    policy.on_insert(K(10))
    assert _pop(policy, 1) == 2  # S still over its share
    policy.on_insert(K(1))  # G remembered 1: M = [0, 1]
    assert policy.pop_victim(lambda key: key in (0, 1)) == 0  # all of S refused: M's tail
    assert policy.pop_victim(lambda key: False) is None
    policy.check_invariants()


# ------------------------------------------------------- differential tests


def _zipf_trace(seed: int, num_requests: int = 2000) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) % 300 for x in rng.zipf(1.2, num_requests)]


def _loop_trace(seed: int, capacity: int, num_requests: int = 2000) -> list[int]:
    """A loop a bit longer than the cache (LRU's worst case) with zipf noise."""
    rng = np.random.default_rng(seed)
    loop_len = capacity + capacity // 2 + 2
    return [i % loop_len if rng.random() < 0.8 else 1000 + int(rng.zipf(1.3)) % 50 for i in range(num_requests)]


def _scan_trace(seed: int, num_requests: int = 2000) -> list[int]:
    """A hot zipf set interrupted by bursts of never-repeated keys (one-hit wonders)."""
    rng = np.random.default_rng(seed)
    keys: list[int] = []
    fresh = 10_000
    while len(keys) < num_requests:
        keys.extend(int(x) % 40 for x in rng.zipf(1.4, int(rng.integers(5, 60))))
        burst = int(rng.integers(0, 30))
        keys.extend(range(fresh, fresh + burst))
        fresh += burst
    return keys[:num_requests]


def _trace(kind: str, seed: int, capacity: int) -> list[int]:
    if kind == "zipf":
        return _zipf_trace(seed)
    if kind == "loop":
        return _loop_trace(seed, capacity)
    return _scan_trace(seed)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ["zipf", "loop", "scan"])
@pytest.mark.parametrize("capacity", [1, 2, 7, 64])
@pytest.mark.parametrize("name", NAMES)
def test_policy_matches_reference(name: str, capacity: int, kind: str, seed: int) -> None:
    keys = _trace(kind, seed, capacity)
    reference = REFERENCES[name](capacity)
    expected = [reference.access(key) for key in keys]
    got = simulate(make_policy(name, capacity), capacity, keys, check_invariants=True)
    assert _first_mismatch(got, expected) is None, f"{sum(got)} vs {sum(expected)} hits"


@pytest.mark.parametrize("fraction", [0.3, 1.0])
@pytest.mark.parametrize("capacity", [1, 2, 7, 64])
@pytest.mark.parametrize("name", NAMES)
def test_refused_keys_are_never_victims(name: str, capacity: int, fraction: float) -> None:
    # The harness asserts every victim is resident and accepted, and None
    # only when every resident block is refused.
    outcomes = simulate_with_refusals(
        make_policy(name, capacity), capacity, _zipf_trace(7, 1000), seeded_refusals(7, fraction)
    )
    if fraction == 1.0:  # once full, nothing can ever be evicted
        assert outcomes.count(False) == capacity


@pytest.mark.parametrize("name", NAMES)
def test_on_access_many_equals_on_access_in_order(name: str) -> None:
    one, many = DrivenTier(make_policy(name, 16), 16), DrivenTier(make_policy(name, 16), 16)
    for raw in _zipf_trace(3, 300):
        one.request(K(raw))
        many.request(K(raw))
    touched = sorted(one.resident, reverse=True) * 2  # every resident block hit twice
    for key in touched:
        one.policy.on_access(key)
    many.policy.on_access_many(iter(touched))
    assert _drain(one.policy) == _drain(many.policy)


_OP_NAMES = ["request", "request", "pin", "unpin", "remove", "evict", "touch", "batch"]
_OPS = st.lists(st.tuples(st.sampled_from(_OP_NAMES), st.integers(0, 11)), max_size=120)


@settings(max_examples=600, deadline=None)
@given(name=st.sampled_from(NAMES), capacity=st.integers(1, 6), ops=_OPS)
def test_random_interleavings_keep_the_contract(name: str, capacity: int, ops: list[tuple[str, int]]) -> None:
    pinned: set[BlockKey] = set()
    tier = DrivenTier(make_policy(name, capacity), capacity, lambda key: key not in pinned)
    for op, raw in ops:
        key = K(raw)
        if op == "request":
            tier.request(key)
        elif op == "pin":
            pinned.add(key)
        elif op == "unpin":
            pinned.discard(key)
        elif op == "remove":
            tier.remove(key)
        elif op == "touch":  # a chain hit tail first
            tier.touch_many(K(k) for k in range(raw, -1, -1))
        elif op == "batch":  # several stores prepared before any completes; odd keys fail
            tier.store_batch([K(k) for k in range(raw, raw + 4)], lambda k: k % 2 == 0)
        else:
            tier.evict_one()
        tier.check()


# --------------------------------------------------- libCacheSim, Mooncake


@pytest.fixture(scope="module")
def lcs() -> ModuleType:
    return pytest.importorskip("libcachesim", reason="libcachesim is not installed: no cross-check")


@pytest.fixture(scope="module")
def mooncake_blocks() -> list[int]:
    """Every request's ``hash_ids`` of the Mooncake conversation trace, in order."""
    if not MOONCAKE_TRACE.exists():
        pytest.skip(f"Mooncake trace not found at {MOONCAKE_TRACE}")
    blocks: list[int] = []
    with MOONCAKE_TRACE.open() as f:
        for line in f:
            blocks.extend(json.loads(line)["hash_ids"])
    return blocks


def _lcs_hits(lcs: ModuleType, cache: Any, blocks: list[int]) -> list[bool]:
    """Per-request hit / miss of a libCacheSim cache (``get`` inserts on a miss)."""
    req = lcs.Request(obj_size=1)
    hits = []
    for block in blocks:
        req.obj_id = block
        hits.append(cache.get(req))
    return hits


def _kvtier_hits(name: str, capacity: int, blocks: list[int]) -> list[bool]:
    return simulate(make_policy(name, capacity), capacity, blocks)


@pytest.mark.slow
@pytest.mark.parametrize("capacity", MOONCAKE_CAPACITIES)
@pytest.mark.parametrize(("name", "lcs_class"), [("lru", "LRU"), ("fifo", "FIFO")])
def test_matches_libcachesim_hit_for_hit(
    lcs: ModuleType, mooncake_blocks: list[int], name: str, lcs_class: str, capacity: int
) -> None:
    ours = _kvtier_hits(name, capacity, mooncake_blocks)
    theirs = _lcs_hits(lcs, getattr(lcs, lcs_class)(capacity), mooncake_blocks)
    print(f"{name} c={capacity}: kvtier {sum(ours)} hits, libCacheSim {sum(theirs)} of {len(ours)}")
    assert _first_mismatch(ours, theirs) is None


@pytest.mark.slow
@pytest.mark.parametrize("capacity", MOONCAKE_CAPACITIES)
def test_arc_matches_libcachesim(lcs: ModuleType, mooncake_blocks: list[int], capacity: int) -> None:
    # Variant difference: libCacheSim's ARC.c (as published on GitHub) keeps
    # p and its step as integers (max(|B2| // |B1|, 1)); the paper and kvtier
    # use reals. On this trace with libcachesim 0.3.5 no decision changes and
    # the runs agree hit for hit; should another libcachesim version differ,
    # the 2% bound is the tolerance for that variant.
    ours = _kvtier_hits("arc", capacity, mooncake_blocks)
    theirs = _lcs_hits(lcs, lcs.ARC(capacity), mooncake_blocks)
    mismatches = sum(a != b for a, b in zip(ours, theirs))
    print(f"arc c={capacity}: kvtier {sum(ours)}, libCacheSim {sum(theirs)}, {mismatches} requests differ")
    assert abs(sum(ours) - sum(theirs)) <= 0.02 * sum(theirs)
    assert mismatches == 0


def _lcs_s3fifo_without_warmup(lcs: ModuleType, capacity: int, first_unused_id: int) -> Any:
    """A libCacheSim S3FIFO past its first eviction, then emptied.

    Before its first eviction libCacheSim's S3FIFO.c admits new keys into M
    once S is full (S3FIFOv0, the paper's version, keeps admitting into S);
    filling it with ``capacity + 1`` unused ids and removing them ends that
    phase and leaves an empty cache whose ghost holds only the unused id.
    """
    cache = lcs.S3FIFO(capacity)
    dummies = range(first_unused_id, first_unused_id + capacity + 1)
    _lcs_hits(lcs, cache, list(dummies))
    for obj_id in dummies:
        cache.remove(obj_id)
    assert cache.get_n_obj() == 0
    return cache


@pytest.mark.slow
@pytest.mark.parametrize("capacity", MOONCAKE_CAPACITIES)
def test_s3fifo_close_to_libcachesim(lcs: ModuleType, mooncake_blocks: list[int], capacity: int) -> None:
    # Variant differences from libCacheSim's S3FIFO.c:
    # 1. warm-up: before its first eviction it admits new keys into M once S
    #    is full (kvtier and the paper: always S). On this trace that alone
    #    moves hits by up to ~11% at c=20000, so the compared cache skips it;
    #    the fresh cache's count is printed for information.
    # 2. it checks the ghost when the request arrives, kvtier (as the paper's
    #    Algorithm 1) after evicting for it: a key at the ghost's tail can be
    #    forgotten in between (1 request at c=20000).
    # Otherwise the same: S share int(0.1 c) (kvtier c // 10), ghost int(0.9 c)
    # (kvtier c - c // 10; equal for these c), promotion at freq >= 2 with the
    # count reset, M reinsertion at min(freq, 3) - 1.
    ours = _kvtier_hits("s3fifo", capacity, mooncake_blocks)
    cache = _lcs_s3fifo_without_warmup(lcs, capacity, max(mooncake_blocks) + 1)
    theirs = _lcs_hits(lcs, cache, mooncake_blocks)
    fresh = sum(_lcs_hits(lcs, lcs.S3FIFO(capacity), mooncake_blocks))
    mismatches = sum(a != b for a, b in zip(ours, theirs))
    print(
        f"s3fifo c={capacity}: kvtier {sum(ours)}, libCacheSim {sum(theirs)} ({mismatches} requests differ),"
        f" libCacheSim with its warm-up rule {fresh}"
    )
    assert abs(sum(ours) - sum(theirs)) <= 0.02 * sum(theirs)


@pytest.mark.parametrize("name", ["lru", "fifo", "lfu", "arc", "s3fifo"])
def test_held_keys_are_parked_and_keep_counting(name: str) -> None:
    """A held key is never offered, stays counted, survives accesses, and comes back."""
    from kvtier.keys import BlockKey
    from kvtier.policies import make_policy

    pol = make_policy(name, 8)
    keys = [BlockKey(k) for k in range(1, 6)]
    for k in keys:
        pol.before_insert(k)
        pol.on_insert(k)
    pol.on_hold(keys[0])
    pol.on_hold(keys[1])
    pol.on_access(keys[0])  # counted for the parked key, no error
    pol.on_access_many([keys[1], keys[2]])
    assert len(pol) == 5
    pol.check_invariants()
    evicted = []
    while (victim := pol.pop_victim(lambda k: True)) is not None:
        evicted.append(victim)
        pol.check_invariants()
    assert sorted(evicted) == keys[2:]  # only the idle keys were offered
    assert len(pol) == 2
    pol.on_unhold(keys[1], front=True)
    pol.on_unhold(keys[0])
    first = pol.pop_victim(lambda k: True)
    assert first in (keys[0], keys[1])
    assert len(pol) == 1
    remaining = keys[1] if first == keys[0] else keys[0]
    pol.on_hold(remaining)
    pol.on_remove(remaining)  # removing a parked key is allowed
    assert len(pol) == 0
    pol.check_invariants()
