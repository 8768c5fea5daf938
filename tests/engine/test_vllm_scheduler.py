"""The connector's scheduler half with stand-in requests (no engine): a block
is offered only after every worker stored it, a finished request's blocks
are kept only while a store still reads them, a failed load drops the block
and counts only the verified prefix, and reset empties the tiers."""

from __future__ import annotations

import doctest
import time
from types import SimpleNamespace

import pytest
from kvtier_vllm import load_plans
from kvtier_vllm.metadata import KVTierWorkerMetadata
from kvtier_vllm.scheduler import KVTierScheduler
from kvtier_vllm.settings import ConnectorSettings, EngineFacts

pytestmark = pytest.mark.vllm_interface  # no engine: also run against newer vLLMs (scripts/vllm_next.sh)

BS = 32


class FakeRequest:
    def __init__(self, req_id: str, num_blocks: int, extra_tokens: int = 2, params: dict | None = None) -> None:
        self.request_id = req_id
        self.block_hashes = [bytes([i]) * 32 for i in range(num_blocks)]  # same content, same hashes
        self.num_tokens = num_blocks * BS + extra_tokens
        self.num_computed_tokens = 0
        self.kv_transfer_params = params


class FakeKVCacheManager:
    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.blocks[req_id],)


def _sched(world_size: int = 1, **extra) -> tuple[KVTierScheduler, FakeKVCacheManager]:
    facts = EngineFacts("tiny", "bfloat16", BS, 2, 2, 32, "fused", "sha256")
    settings = ConnectorSettings.build({"dram_capacity_blocks": 8, "exclusive_dram": False, **extra}, facts, env={})
    ns = settings.config.namespace.to_namespace(settings.config.layout.to_layout())
    sched = KVTierScheduler(settings, ns, BS, world_size)
    kvm = FakeKVCacheManager()
    sched.bind_kv_cache_manager(kvm)
    return sched, kvm


def _step(sched: KVTierScheduler, scheduled: dict[str, int]):
    return sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens=scheduled, preempted_req_ids=set()))


def _store_r1(sched, kvm, world_size_reports: int = 1, params: dict | None = None):
    r1 = FakeRequest("r1", 4, params=params)
    kvm.blocks["r1"] = [10, 11, 12, 13, 14]
    sched.on_new_request(r1)
    assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
    meta = _step(sched, {"r1": r1.num_tokens})
    (job,) = meta.stores
    assert job.block_ids == (10, 11, 12, 13)  # the partial 5th block is not stored
    (write,) = job.writes
    return r1, job, write


def test_blocks_are_offered_only_after_every_worker_stored_them() -> None:
    sched, kvm = _sched(world_size=2)
    _, job, write = _store_r1(sched, kvm)
    r2 = FakeRequest("r2", 4)
    assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)  # pending
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (1, [True] * 4)}, {job.job_id: 1}))
    assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)  # one rank of two
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (1, [True, True, True, False])},
                                                       {job.job_id: 1}))
    assert sched.get_num_new_matched_tokens(r2, 0) == (3 * BS, True)  # rank 2 failed block 4
    assert sched.get_num_new_matched_tokens(r2, 2 * BS) == (BS, True)  # past the local hit


def test_exclusive_dram_without_a_bound_block_pool_writes_through_and_never_defers() -> None:
    """Exclusive DRAM needs vLLM's block pool (told of a slot's reuse); an engine that never binds one gets
    write-through in full: a lookup behind a pending store is a miss now, never deferred (``None``)."""
    sched, kvm = _sched(exclusive_dram=True)
    assert sched.exclusive and sched.write_backs.pool is None
    _, job, write = _store_r1(sched, kvm)
    assert write.tier == "dram"  # written through, not watched
    assert sched.get_num_new_matched_tokens(FakeRequest("r2", 4), 0) == (0, False)


def test_finished_request_keeps_blocks_only_while_a_store_reads_them() -> None:
    sched, kvm = _sched()
    r1, job, write = _store_r1(sched, kvm)
    assert sched.request_finished(r1) is True
    assert _step(sched, {}).release == ["r1"]
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (1, [True] * 4)}, {job.job_id: 1}))
    r3 = FakeRequest("r3", 2)
    sched.on_new_request(r3)
    assert sched.request_finished(r3) is False  # nothing in flight


def test_failed_load_counts_the_verified_prefix_and_drops_the_bad_block() -> None:
    sched, kvm = _sched()
    _, job, write = _store_r1(sched, kvm)
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (1, [True] * 4)}, {job.job_id: 1}))
    r2 = FakeRequest("r2", 4, params={"kvtier_session_id": "s1", "kvtier_agent_id": "a1"})
    sched.on_new_request(r2)
    assert sched.get_num_new_matched_tokens(r2, 0) == (4 * BS, True)
    sched.update_state_after_alloc(r2, [20, 21, 22, 23, 24], 4 * BS)
    assert sched.hit_sources(r2) == {"dram": 4 * BS}
    assert sched.stats()["live_sessions"] == 1
    meta = _step(sched, {})
    (load,) = meta.loads
    assert load.block_ids == (20, 21, 22, 23) and load.tiers == ("dram",) * 4
    assert sched.request_finished(r2) is True and meta.release == []  # freed by vLLM on finished_recving
    sched.update_connector_output(KVTierWorkerMetadata({load.plan_id: (1, [True, True, False, True])}, {}))
    c = sched.counters
    assert (c["hit_tokens"], c["load_failed_blocks"]) == (2 * BS, 2)
    assert sched.manager.ready_blocks("dram") == 3  # the block that failed is gone
    assert sched.get_num_new_matched_tokens(FakeRequest("r4", 4), 0) == (2 * BS, True)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_load_past_its_deadline_is_counted_once_and_not_offered_again(world_size: int) -> None:
    """A worker reports the load failed because it missed ``load_deadline_s`` (``expired_plans``;
    with two ranks, one rank's expiry is enough): vLLM recomputes it, counted once as expired
    and as failed, and its blocks are dropped, so vLLM's retry of the request (or the next
    request) does not plan the same load and wait on the same tier again."""
    sched, kvm = _sched(world_size=world_size)
    _, job, write = _store_r1(sched, kvm)
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (world_size, [True] * 4)},
                                                       {job.job_id: world_size}))
    r2 = FakeRequest("r2", 4)
    sched.on_new_request(r2)
    assert sched.get_num_new_matched_tokens(r2, 0) == (4 * BS, True)
    sched.update_state_after_alloc(r2, [20, 21, 22, 23, 24], 4 * BS)
    (load,) = _step(sched, {}).loads
    reports = [KVTierWorkerMetadata({load.plan_id: (1, [False] * 4)}, {}, expired_plans=[load.plan_id])]
    if world_size == 2:  # the other rank loaded in time
        reports.append(KVTierWorkerMetadata({load.plan_id: (1, [True] * 4)}, {}))
    for meta in reports:
        sched.update_connector_output(meta)
    c = sched.counters
    assert (c["hit_tokens"], c["load_failed_blocks"], c["load_expired_blocks"]) == (0, 4, 4)
    assert sched.manager.ready_blocks("dram") == 0
    assert sched.get_num_new_matched_tokens(FakeRequest("r3", 4), 0) == (0, False)


@pytest.mark.parametrize("expired", [False, True])
def test_a_request_whose_load_landed_nothing_is_computed_when_asked_again(expired: bool, tmp_path) -> None:
    """vLLM frees the blocks of a request whose asynchronous load landed nothing (failed, or past
    ``load_deadline_s``) and asks again: the request is computed, not offered a second
    asynchronous load (vLLM 0.32 would count the request's whole size twice against it, and a
    long one never fits: the engine waited on it with nothing scheduled). Another request is
    still offered what is left."""
    sched, kvm = _sched(dram_capacity_blocks=16, ssd_path=str(tmp_path), ssd_capacity_blocks=64)
    r1 = FakeRequest("r1", 4)  # stored in DRAM and on the SSD: a second copy to offer after the first fails
    kvm.blocks["r1"] = [10, 11, 12, 13, 14]
    sched.on_new_request(r1)
    assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
    (job,) = _step(sched, {"r1": r1.num_tokens}).stores
    assert sorted(w.tier for w in job.writes) == ["dram", "ssd"]
    sched.update_connector_output(KVTierWorkerMetadata({w.plan_id: (1, [True] * 4) for w in job.writes},
                                                       {job.job_id: 1}))
    r2 = FakeRequest("r2", 4)
    sched.on_new_request(r2)
    assert sched.get_num_new_matched_tokens(r2, 0) == (4 * BS, True)
    sched.update_state_after_alloc(r2, [20, 21, 22, 23, 24], 4 * BS)
    (load,) = _step(sched, {}).loads
    assert load.tiers == ("dram",) * 4
    sched.update_connector_output(KVTierWorkerMetadata({load.plan_id: (1, [False] * 4)}, {},
                                                       expired_plans=[load.plan_id] if expired else []))
    assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)  # computed: not a second load, from the SSD
    assert sched.counters["load_failed_then_computed"] == 1
    r3 = FakeRequest("r3", 4)
    sched.on_new_request(r3)
    assert sched.get_num_new_matched_tokens(r3, 0) == (4 * BS, True)  # another request: the SSD's copies


def test_load_plans_doctest() -> None:
    assert doctest.testmod(load_plans).failed == 0


@pytest.mark.parametrize("ok", [True, False])
def test_a_prefix_another_request_is_loading_is_loaded_once(ok: bool) -> None:
    """vLLM caches an asynchronously loaded block only when its load lands: until then a second
    request behind the same prefix is deferred (``None``: vLLM asks again next step, and finds the
    blocks in its own prefix cache), not planned a second load into blocks of its own. Its own
    retry is not deferred, nor is a synchronous load (vLLM caches its blocks at once). After a
    failed load the prefix is on offer again, from what is left."""
    sched, kvm = _sched()
    _, job, write = _store_r1(sched, kvm)
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (1, [True] * 4)}, {job.job_id: 1}))
    r2, r3, r4 = FakeRequest("r2", 4), FakeRequest("r3", 4), FakeRequest("r4", 2)
    for r in (r2, r3, r4):
        sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r2, 0) == (4 * BS, True)
    sched.update_state_after_alloc(r2, [20, 21, 22, 23, 24], 4 * BS)
    assert sched.get_num_new_matched_tokens(r3, 0) == (None, False)
    assert sched.get_num_new_matched_tokens(r4, 0) == (None, False)  # a shorter request behind the same prefix
    assert sched.get_num_new_matched_tokens(r2, 0) == (4 * BS, True)  # the loader itself, asked again: not deferred
    sched.update_state_after_alloc(r2, [], 0)  # (its allocation failed: the second match is dropped)
    assert sched.get_num_new_matched_tokens(r3, 3 * BS) == (None, False)  # its first block to load is on its way
    assert sched.counters["load_deferred_shared"] == 3
    (load,) = _step(sched, {}).loads
    sched.update_connector_output(KVTierWorkerMetadata({load.plan_id: (1, [True, True, ok, True])}, {}))
    want = 4 * BS if ok else 2 * BS  # (the block that failed is dropped, and what follows it is unreachable)
    assert sched.get_num_new_matched_tokens(r3, 0) == (want, True)
    assert sched.counters["load_deferred_shared"] == 3


@pytest.mark.parametrize("keep", [False, True])
def test_reset_drops_every_block_unless_the_tiers_are_kept(keep: bool) -> None:
    """vLLM resets the connector after a weight update and on sleep: every block goes, and a store in
    flight lands as failed; with ``keep_tiers_on_reset`` (an engine that wakes with the same weights)
    the blocks and the store in flight stay."""
    from kvtier.errors import ConfigError

    sched, kvm = _sched(keep_tiers_on_reset=keep)
    facts = EngineFacts("tiny", "bfloat16", BS, 2, 2, 32, "fused", "sha256")
    kept = ConnectorSettings.build({"dram_capacity_blocks": 8, "keep_tiers_on_reset": True}, facts, env={})
    assert not kept.exclusive_dram  # a sleep loses what exclusive DRAM keeps only in HBM: written through
    with pytest.raises(ConfigError, match="exclusive_dram"):
        ConnectorSettings.build({"dram_capacity_blocks": 8, "keep_tiers_on_reset": True, "exclusive_dram": True},
                                facts, env={})
    _, job, write = _store_r1(sched, kvm)
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (1, [True] * 4)}, {job.job_id: 1}))
    r3 = FakeRequest("r3", 3)
    r3.block_hashes = [bytes([100 + i]) * 32 for i in range(3)]
    kvm.blocks["r3"] = list(range(30, 34))
    sched.on_new_request(r3)
    (store,) = _step(sched, {"r3": r3.num_tokens}).stores
    assert sched.reset() is True
    sched.update_connector_output(KVTierWorkerMetadata({store.writes[0].plan_id: (1, [True] * 3)}, {store.job_id: 1}))
    c = sched.counters
    assert (c["resets"], c["resets_kept_tiers"]) == (1, 1 if keep else 0)
    assert sched.manager.ready_blocks("dram") == (7 if keep else 0)
    assert sched.get_num_new_matched_tokens(FakeRequest("r2", 4), 0) == ((4 * BS, True) if keep else (0, False))


@pytest.mark.parametrize("num_blocks", [1, 3])
def test_the_last_prompt_token_is_never_offered(num_blocks: int) -> None:
    sched, kvm = _sched()
    r1 = FakeRequest("r1", num_blocks, extra_tokens=0)  # prompt ends exactly on a block boundary
    kvm.blocks["r1"] = list(range(num_blocks))
    sched.on_new_request(r1)
    (job,) = _step(sched, {"r1": r1.num_tokens}).stores
    (write,) = job.writes
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (1, [True] * num_blocks)}, {job.job_id: 1}))
    r2 = FakeRequest("r2", num_blocks, extra_tokens=0)
    assert sched.get_num_new_matched_tokens(r2, 0) == ((num_blocks - 1) * BS, num_blocks > 1)


def test_ssd_stores_skipped_by_a_worker_are_counted() -> None:
    sched, _ = _sched()
    sched.update_connector_output(KVTierWorkerMetadata(skipped_blocks=3))
    sched.update_connector_output(KVTierWorkerMetadata(skipped_blocks=2))
    assert sched.counters["store_skipped_backpressure"] == 5


def test_kv_events_follow_the_dram_tier_and_forget_what_left_it() -> None:
    """With vLLM's KV events on, a completed DRAM store becomes one "stored" event per
    block (vLLM hash, parent hash, token ids), a failed one none; an eviction a
    "removed" event; and the metadata kept for events is dropped once no tier
    holds or is storing the block (bounded by the tiers' capacity)."""
    facts = EngineFacts("tiny", "bfloat16", BS, 2, 2, 32, "fused", "sha256")
    settings = ConnectorSettings.build({"dram_capacity_blocks": 4}, facts, env={})
    ns = settings.config.namespace.to_namespace(settings.config.layout.to_layout())
    sched = KVTierScheduler(settings, ns, BS, 1, kv_events=True)
    kvm = FakeKVCacheManager()
    sched.bind_kv_cache_manager(kvm)
    r1 = FakeRequest("r1", 4)
    r1.all_token_ids = list(range(r1.num_tokens))
    kvm.blocks["r1"] = [10, 11, 12, 13, 14]
    sched.on_new_request(r1)
    (job,) = _step(sched, {"r1": r1.num_tokens}).stores
    (write,) = job.writes
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (1, [True, True, True, False])},
                                                       {job.job_id: 1}))
    events = sched.take_kv_events()
    assert [e[:3] for e in events] == [("stored", "dram", r1.block_hashes[i]) for i in range(3)]
    assert [e[3] for e in events] == [None, r1.block_hashes[0], r1.block_hashes[1]]
    assert events[1][4] == list(range(BS, 2 * BS))
    assert len(sched.events.meta) == 3  # the failed 4th block is forgotten
    r2 = FakeRequest("r2", 4)
    r2.block_hashes = [bytes([100 + i]) * 32 for i in range(4)]  # other content: evicts r1's blocks
    r2.all_token_ids = list(range(1000, 1000 + r2.num_tokens))
    kvm.blocks["r2"] = [20, 21, 22, 23, 24]
    sched.on_new_request(r2)
    (job2,) = _step(sched, {"r2": r2.num_tokens}).stores
    (write2,) = job2.writes
    sched.update_connector_output(KVTierWorkerMetadata({write2.plan_id: (1, [True] * len(write2.rows))},
                                                       {job2.job_id: 1}))
    events = sched.take_kv_events()
    removed = {e[2] for e in events if e[0] == "removed"}
    stored = [e[2] for e in events if e[0] == "stored"]
    assert removed and removed <= set(r1.block_hashes[:3]) and stored == r2.block_hashes[:len(stored)]
    assert len(sched.events.meta) <= 4 and not removed & {k[0] for k in sched.events.meta.values()}
    assert _sched()[0].take_kv_events() == []  # off by default: nothing is kept


# ---------------------------------------------------------------- exclusive DRAM (issue 41), vLLM's own BlockPool


def _exclusive(dram_blocks: int = 8, **extra):
    from vllm.v1.core.block_pool import BlockPool

    sched, kvm = _sched(dram_capacity_blocks=dram_blocks, exclusive_dram=True, **extra)
    pool = BlockPool(num_gpu_blocks=12, enable_caching=True, hash_block_size=BS)
    sched.bind_gpu_block_pool(pool)
    return sched, kvm, pool


def _run_and_free(sched, kvm, pool, req_id: str, num_blocks: int):
    """A request computes ``num_blocks`` full blocks (and a partial one), finishes, and frees them."""
    r = FakeRequest(req_id, num_blocks)
    blocks = pool.get_new_blocks(num_blocks + 1)
    kvm.blocks[req_id] = [b.block_id for b in blocks]
    sched.on_new_request(r)
    meta = _step(sched, {req_id: r.num_tokens})
    assert sched.request_finished(r) is False
    pool.free_blocks(reversed(blocks))
    return r, blocks, meta


def _report(sched, job, oks=None):
    sched.update_connector_output(KVTierWorkerMetadata(
        {w.plan_id: (1, list(oks[i] for i in w.rows) if oks else [True] * len(w.rows)) for w in job.writes},
        {job.job_id: 1}))


def test_a_block_that_does_not_land_defers_lookups_for_the_load_deadline_only() -> None:
    """A lookup waits a step for a block on its way into DRAM, but not for longer than
    ``load_deadline_s``: a write-back or promotion behind a hung SSD read lands when the read ends
    (``bench/chaos_serve.py``'s stalled loads: requests waited 104-114 s, one past the client's
    timeout). Past the bound the request is not deferred; it computes what did not land."""
    sched, kvm, pool = _exclusive(load_deadline_s=0.3)
    _, blocks, _ = _run_and_free(sched, kvm, pool, "r1", 4)
    other = pool.get_new_blocks(pool.get_num_free_blocks())
    (wb,) = _step(sched, {}).write_backs  # on its way down, never reported
    assert sched.get_num_new_matched_tokens(FakeRequest("r2", 4), 0) == (None, False)
    assert sched.get_num_new_matched_tokens(FakeRequest("r3", 4), 0) == (None, False)
    time.sleep(0.35)
    assert sched.get_num_new_matched_tokens(FakeRequest("r2", 4), 0) == (0, False)  # computed, not deferred
    assert sched.counters["load_deferred"] == 2
    _report(sched, wb)
    pool.free_blocks(other)


def test_exclusive_dram_writes_a_block_down_only_when_vllm_reuses_its_slot() -> None:
    sched, kvm, pool = _exclusive()
    r1, blocks, meta = _run_and_free(sched, kvm, pool, "r1", 4)
    assert meta.stores == [] and meta.write_backs == []  # nothing written through
    assert sched.manager.ready_blocks("dram") == 0
    ids = [b.block_id for b in blocks[:4]]
    assert [pool.blocks[i].ref_cnt for i in ids] == [0] * 4  # the watch took no reference
    # other requests take every free slot: vLLM hands r1's blocks out again
    other = pool.get_new_blocks(pool.get_num_free_blocks())
    (wb,) = _step(sched, {}).write_backs
    assert sorted(wb.block_ids) == sorted(ids) and wb.req_id == ""
    assert sched.get_num_new_matched_tokens(FakeRequest("r2", 4), 0) == (None, False)  # deferred: on its way
    _report(sched, wb)
    assert sched.manager.ready_blocks("dram") == 4
    c = sched.counters
    assert (c["write_back_blocks"], c["stored_blocks_dram"], c["load_deferred"]) == (4, 4, 1)
    pool.free_blocks(other)
    # r2 loads them: they move up (the DRAM copies go once the loaded HBM blocks are watched)
    r2 = FakeRequest("r2", 4)
    sched.on_new_request(r2)
    assert sched.get_num_new_matched_tokens(r2, 0) == (4 * BS, True)
    new = pool.get_new_blocks(5)
    kvm.blocks["r2"] = [b.block_id for b in new]
    sched.update_state_after_alloc(r2, kvm.blocks["r2"], 4 * BS)
    (load,) = _step(sched, {}).loads
    sched.update_connector_output(KVTierWorkerMetadata({load.plan_id: (1, [True] * 4)}, {}))
    assert (c["hit_tokens_dram"], c["dram_moved_blocks"]) == (4 * BS, 4)
    assert sched.manager.ready_blocks("dram") == 0
    sched.request_finished(r2)
    pool.free_blocks(reversed(new))
    pool.get_new_blocks(pool.get_num_free_blocks())  # and down again when HBM loses them
    (wb2,) = _step(sched, {}).write_backs
    assert sorted(wb2.block_ids) == sorted(kvm.blocks["r2"][:4])


def test_exclusive_dram_write_back_of_a_zeroed_or_overwritten_slot_fails() -> None:
    sched, kvm, pool = _exclusive()
    _, blocks, _ = _run_and_free(sched, kvm, pool, "r1", 4)
    pool.get_new_blocks(pool.get_num_free_blocks())
    ids = [b.block_id for b in blocks[:4]]
    out = SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids=set(), new_block_ids_to_zero=[ids[0]],
                          kv_cache_block_copies=[SimpleNamespace(src_block_id=0, dst_block_id=ids[1])])
    (wb,) = sched.build_connector_meta(out).write_backs
    assert sorted(wb.block_ids) == sorted(ids[2:])  # their old bytes are gone before the copy could run
    assert sched.counters["write_back_lost"] == 2


def test_exclusive_dram_reset_drops_write_backs_in_flight() -> None:
    sched, kvm, pool = _exclusive()
    _, blocks, _ = _run_and_free(sched, kvm, pool, "r1", 4)
    pool.get_new_blocks(pool.get_num_free_blocks())
    (wb,) = _step(sched, {}).write_backs
    assert sched.reset() is True
    _report(sched, wb)  # the workers copied them: stale bytes, never offered
    assert sched.manager.ready_blocks("dram") == 0
    assert sched.get_num_new_matched_tokens(FakeRequest("r2", 4), 0) == (0, False)


def test_exclusive_dram_is_refused_where_it_cannot_run() -> None:
    from kvtier.errors import ConfigError

    facts = EngineFacts("tiny", "bfloat16", BS, 2, 2, 32, "fused", "sha256")
    with pytest.raises(ConfigError, match="exclusive_dram.*lru-dram.*writes DRAM through"):
        ConnectorSettings.build({"dram_capacity_blocks": 8, "exclusive_dram": True, "placement": "lru-dram"},
                                facts, env={})
    with pytest.raises(ConfigError, match="exclusive_dram.*needs the DRAM tier"):
        ConnectorSettings.build({"dram_capacity_blocks": 0, "ssd_path": "/nonexistent/kvtier-ssd",
                                 "exclusive_dram": True}, facts, env={})
    with pytest.raises(ConfigError, match="exclusive_dram.*true or false"):
        ConnectorSettings.build({"dram_capacity_blocks": 8, "exclusive_dram": "yes"}, facts, env={})


def test_a_tagged_request_without_a_tool_wait_starts_a_turn_end() -> None:
    """An agent whose request ends with no tool wait waits on its user, or is done:
    nothing will say which (no hint server), so it is a ``turn_end`` of
    ``TURN_END_GAP_S``: kvtier's next-use order no longer counts it busy and ranks it
    that far ahead (x ``next_use_trust``), behind agents on shorter tool waits; the
    wait is no tool's history."""
    from kvtier.placement.base import TURN_END_GAP_S

    sched, kvm = _sched()
    r1 = FakeRequest("r1", 4, params={"kvtier_session_id": "s", "kvtier_agent_id": "a"})
    kvm.blocks["r1"] = [10, 11, 12, 13, 14]
    sched.on_new_request(r1)
    _step(sched, {"r1": r1.num_tokens})
    sched.request_finished(r1)
    assert (sched.counters["user_waits"], sched.counters["tool_waits"]) == (1, 0)
    assert sched.placement.is_waiting(("s", "a"))
    est = sched.policy._est
    ahead = est._rank[("s", "a")] + est._clock()
    assert ahead == pytest.approx(sched.policy.next_use_trust * TURN_END_GAP_S, abs=1.0)
    r2 = FakeRequest("r2", 5, params={"kvtier_session_id": "s", "kvtier_agent_id": "a"})
    sched.on_new_request(r2)  # the user came back
    assert not sched.placement.is_waiting(("s", "a")) and list(sched.placement.tool_history_s()) == []
    untagged = FakeRequest("r3", 2)
    kvm.blocks["r3"] = [20, 21, 22]
    sched.on_new_request(untagged)
    sched.request_finished(untagged)
    assert sched.counters["user_waits"] == 1  # no agent, no wait


def test_vllms_session_id_names_an_untagged_request_and_kvtier_tags_win() -> None:
    """Precedence (docs/agents.md): kvtier's tags, when a request has them; else vLLM's own
    ``Request.session_id``, whose agent the connector derives (``native_sessions``)."""
    sched, kvm = _sched()
    native = FakeRequest("r1", 4)
    native.session_id = "vs"
    tagged = FakeRequest("r2", 4, params={"kvtier_session_id": "s", "kvtier_agent_id": "a"})
    tagged.session_id = "vs"  # also has vLLM's: the tags win
    for r, blocks in ((native, [10, 11, 12, 13, 14]), (tagged, [20, 21, 22, 23, 24])):
        kvm.blocks[r.request_id] = blocks
        sched.on_new_request(r)
    _step(sched, {"r1": native.num_tokens, "r2": tagged.num_tokens})
    for r in (native, tagged):
        sched.request_finished(r)
    assert sched.placement.is_waiting(("vs", "vllm-0")) and sched.placement.is_waiting(("s", "a"))
    assert not sched.placement.is_waiting(("vs", "vllm-1"))
    assert sched.counters["native_session_requests"] == 1 and sched.counters["native_session_agents"] == 1


def test_vllms_kv_hints_envelopes_pin_prefetch_retain_and_release_with_every_outcome_counted() -> None:
    """vLLM's ``Request.kv_hints`` (its own ``KvHintsEnvelope`` struct) read as kvtier's
    vocabulary (``kvtier.sdk.kv_hints``): ``identity`` names the agent, ``pin`` sets its
    criticality, ``prefetch`` starts a tool wait (brought back), ``retain`` a wait that is
    not, ``release`` ends the agent; each action's outcome is a counter."""
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    def envelope(agent: str, *actions: tuple[str, dict]) -> KvHintsEnvelope:
        acts = [KvHintAction("id", "identity", "1", {"session_id": "s", "agent_id": agent})]
        acts += [KvHintAction(str(i), kind, "1", payload) for i, (kind, payload) in enumerate(actions)]
        return KvHintsEnvelope("0.1", f"m-{agent}", acts)

    sched, kvm = _sched()
    reqs = {"pin": envelope("a1", ("pin", {"priority": 0.9}), ("prefetch", {"after_s": 3.0})),
            "retain": envelope("a2", ("retain", {"duration_s": 60.0})),
            "release": envelope("a3", ("release", {}), ("vllm.set_priority", {"ttl_seconds": 1})),
            "odd": envelope("a4", ("pin", {"priority": float("nan")}), ("retain", {"duration_s": 1e12}))}
    for i, (name, env) in enumerate(reqs.items()):
        r = FakeRequest(name, 4)
        r.block_hashes = [bytes([i, b]) * 16 for b in range(4)]
        r.kv_hints = env
        kvm.blocks[name] = list(range(10 * i + 10, 10 * i + 15))
        sched.on_new_request(r)
        reqs[name] = r
    _step(sched, {r.request_id: r.num_tokens for r in reqs.values()})
    assert sched.placement.criticality(("s", "a1")) == 0.9
    for r in reqs.values():
        sched.request_finished(r)
    c = sched.counters
    assert sched.placement.is_waiting(("s", "a1"), tool=True) and c["tool_waits"] == 1  # prefetch: a tool wait
    assert sched.placement.is_waiting(("s", "a2")) and not sched.placement.is_waiting(("s", "a2"), tool=True)
    assert sched.placement.is_waiting(("s", "a4"))  # the clipped retain
    assert c["kv_hints_waits_retained"] == 2 and c["user_waits"] == 2
    assert not sched.placement.is_waiting(("s", "a3")) and c["kv_hints_agents_released"] == 1
    assert c["kv_hints_envelopes"] == 4 and c["kv_hints_identity_accepted"] == 4
    assert (c["kv_hints_pin_accepted"], c["kv_hints_prefetch_accepted"], c["kv_hints_retain_accepted"]) == (1, 1, 1)
    assert (c["kv_hints_release_accepted"], c["kv_hints_other_unknown"]) == (1, 1)
    assert (c["kv_hints_pin_rejected"], c["kv_hints_retain_clipped"]) == (1, 1)
    assert sched.stats()["counters"]["kv_hints_envelopes"] == 4  # the stats file and /metrics carry them


def test_a_kv_hints_release_waits_for_the_agents_other_requests() -> None:
    """vLLM copies a request's ``kv_hints`` to each of its ``n > 1`` children, and an agent may
    have requests in flight together: a ``release`` while another request of the agent runs
    does not end the agent (counted ``kv_hints_release_busy``); the last one's does."""
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    env = KvHintsEnvelope("0.1", "m", [KvHintAction("0", "identity", "1", {"session_id": "s", "agent_id": "a"}),
                                       KvHintAction("1", "release", "1", {})])
    sched, kvm = _sched()
    reqs = []
    for name in ("n0", "n1"):
        r = FakeRequest(name, 4)
        r.kv_hints = env
        kvm.blocks[name] = [10, 11, 12, 13, 14] if name == "n0" else [20, 21, 22, 23, 24]
        sched.on_new_request(r)
        reqs.append(r)
    _step(sched, {r.request_id: r.num_tokens for r in reqs})
    sched.request_finished(reqs[0])
    assert (sched.counters["kv_hints_release_busy"], sched.counters["kv_hints_agents_released"]) == (1, 0)
    sched.request_finished(reqs[1])
    assert sched.counters["kv_hints_agents_released"] == 1


def _run_steps(sched: KVTierScheduler, clock: list[float], fixed_s: float, per_token_s: float) -> None:
    """Twelve engine steps of one running request, prefill chunks and decodes, each taking
    ``fixed_s + tokens * per_token_s`` on ``clock``; an idle gap of 100 s before the last."""
    for i in range(12):
        tokens = (64, 256, 1, 1, 512, 1, 128, 1, 1, 320, 1, 1)[i]
        if i == 11:
            _step(sched, {})  # the engine idles: a step of nothing, then 100 s with no steps
            clock[0] += 100.0
        _step(sched, {"running": tokens})
        clock[0] += fixed_s + tokens * per_token_s


@pytest.mark.parametrize(("params", "num_computed", "offered", "capped"), [
    ({"max_load_tokens": 0}, 0, 0, 1),  # a router says recompute: nothing offered
    ({"max_load_tokens": 2 * BS + 5}, 0, 2 * BS, 1),  # whole blocks only, as vLLM's offloading connector
    ({"max_load_tokens": 2 * BS}, BS, 2 * BS, 1),  # counted past what the engine has cached itself
    ({"max_load_tokens": 10 * BS}, 0, 4 * BS, 0),  # more than the hit: no cap
    ({"max_load_tokens": -1}, 0, 4 * BS, 0),  # not an integer >= 0: ignored, as vLLM does
    ({"max_load_tokens": True}, 0, 4 * BS, 0),
    ({"max_load_tokens": "0"}, 0, 4 * BS, 0),
])
def test_max_load_tokens_caps_what_a_request_loads(params, num_computed, offered, capped) -> None:
    """vLLM's ``max_load_tokens`` in ``kv_transfer_params`` (what llm-d's router sets to 0 to make a
    request recompute) caps the tokens kvtier offers past the engine's own hit."""
    sched, kvm = _sched()
    _, job, write = _store_r1(sched, kvm)
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (1, [True] * 4)}, {job.job_id: 1}))
    r2 = FakeRequest("r2", 4, params=params)
    sched.on_new_request(r2)
    assert sched.get_num_new_matched_tokens(r2, num_computed) == ((offered, True) if offered else (0, False))
    assert sched.counters["load_capped_by_request"] == capped


@pytest.mark.parametrize(("fixed_s", "per_token_s", "loads"), [
    (0.05, 1e-6, False),  # a step's fixed cost dominates (the tiny test model): recompute 4 blocks
    (0.001, 1e-3, True),  # the forward dominates (a real model): load them
])
def test_recompute_when_cheaper_weighs_the_fitted_step_against_the_load(fixed_s, per_token_s, loads) -> None:
    sched, kvm = _sched(recompute_when_cheaper=True)
    clock = [1000.0]
    sched.placement.clock = lambda: clock[0]
    _, job, write = _store_r1(sched, kvm)
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (1, [True] * 4)}, {job.job_id: 1}))
    _run_steps(sched, clock, fixed_s, per_token_s)
    # a step like the running one (1 decode token), not the idle gap: the gap was not a step
    assert sched.placement.load_wait_s() == pytest.approx(fixed_s + per_token_s, rel=0.05)
    assert sched.placement.recompute_time_s(1000) == pytest.approx(1000 * per_token_s, rel=0.05)
    r2 = FakeRequest("r2", 4)
    sched.on_new_request(r2)
    got = sched.get_num_new_matched_tokens(r2, 0)
    assert got == ((4 * BS, True) if loads else (0, False))
    assert sched.counters["load_skipped_cheaper"] == (0 if loads else 1)
    assert sched.counters["load_skipped_cheaper_tokens"] == (0 if loads else 4 * BS)


def test_recompute_when_cheaper_charges_the_running_step_and_an_idle_engine_its_fixed_cost() -> None:
    """A load waits through a step: its fixed cost (the scheduler-worker round trip) always, and the
    forward of what runs beside it while requests run; once the last step ended long ago (or
    scheduled nothing) the engine idles and only the fixed cost is charged."""
    sched, kvm = _sched(recompute_when_cheaper=True)
    clock = [1000.0]
    sched.placement.clock = lambda: clock[0]
    _, job, write = _store_r1(sched, kvm)
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (1, [True] * 4)}, {job.job_id: 1}))
    _run_steps(sched, clock, 0.001, 1e-3)
    _step(sched, {"running": 300})  # a bigger batch runs: its step is the one a load waits behind
    assert sched.placement.load_wait_s() == pytest.approx(0.001 + 0.3, rel=0.05)
    r2 = FakeRequest("r2", 4)
    sched.on_new_request(r2)
    assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)  # 0.3 s behind the batch: recompute 4 blocks
    clock[0] += 1.0  # no step for 1 s, far over twice a step: nothing runs
    assert sched.placement.load_wait_s() == pytest.approx(0.001, rel=0.05)
    _step(sched, {})  # a step that scheduled nothing: idle too
    assert sched.placement.load_wait_s() == pytest.approx(0.001, rel=0.05)
    r3 = FakeRequest("r3", 4)
    sched.on_new_request(r3)
    assert sched.get_num_new_matched_tokens(r3, 0) == (4 * BS, True)  # idle: the load is faster
    assert sched.counters["load_skipped_cheaper"] == 1


def test_without_recompute_when_cheaper_a_hit_is_always_loaded() -> None:
    sched, kvm = _sched()
    clock = [1000.0]
    sched.placement.clock = lambda: clock[0]
    _, job, write = _store_r1(sched, kvm)
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (1, [True] * 4)}, {job.job_id: 1}))
    _run_steps(sched, clock, 0.05, 1e-6)
    r2 = FakeRequest("r2", 4)
    assert sched.get_num_new_matched_tokens(r2, 0) == (4 * BS, True)
    assert sched.placement.load_wait_s() == 0.0  # nothing fitted: the steps are not timed


def _cpu_sched(**extra) -> tuple[KVTierScheduler, FakeKVCacheManager]:
    facts = EngineFacts("tiny", "bfloat16", BS, 2, 2, 32, "fused", "sha256", device_type="cpu")
    settings = ConnectorSettings.build({"dram_capacity_blocks": 8, "exclusive_dram": False, **extra}, facts, env={})
    ns = settings.config.namespace.to_namespace(settings.config.layout.to_layout())
    sched = KVTierScheduler(settings, ns, BS, 1)
    kvm = FakeKVCacheManager()
    sched.bind_kv_cache_manager(kvm)
    return sched, kvm


def test_sync_dram_loads_plans_a_dram_hit_for_this_steps_forward() -> None:
    sched, kvm = _cpu_sched(sync_dram_loads=True)
    _, job, write = _store_r1(sched, kvm)
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (1, [True] * 4)}, {job.job_id: 1}))
    r2 = FakeRequest("r2", 4)
    sched.on_new_request(r2)
    assert sched.get_num_new_matched_tokens(r2, 0) == (4 * BS, False)  # not asynchronous: vLLM runs it now
    kvm.blocks["r2"] = [20, 21, 22, 23, 24]
    sched.update_state_after_alloc(r2, kvm.blocks["r2"], 4 * BS)
    (load,) = _step(sched, {"r2": 2}).loads
    assert load.sync and load.tiers == ("dram",) * 4 and load.block_ids == (20, 21, 22, 23)
    assert sched.counters["load_sync"] == 1
    # a request behind the same prefix is not deferred: vLLM cached r2's blocks as it allocated them
    assert sched.get_num_new_matched_tokens(FakeRequest("r3", 4), 0) == (4 * BS, False)
    assert sched.counters["load_deferred_shared"] == 0


@pytest.mark.parametrize(("device", "extra", "problem"), [
    ("cuda", {}, "built for CPU engines"),
    ("cpu", {"dram_capacity_blocks": 0, "ssd_capacity_blocks": 8}, "needs the DRAM tier"),
])
def test_sync_dram_loads_is_refused_where_it_is_not_built(tmp_path, device, extra, problem) -> None:
    from kvtier.errors import ConfigError

    facts = EngineFacts("tiny", "bfloat16", BS, 2, 2, 32, "fused", "sha256", device_type=device)
    if "ssd_capacity_blocks" in extra:
        extra = {**extra, "ssd_path": str(tmp_path / "ssd")}
    with pytest.raises(ConfigError, match=problem) as err:
        ConnectorSettings.build({"dram_capacity_blocks": 8, "sync_dram_loads": True, **extra}, facts, env={})
    assert "sync_dram_loads" in str(err.value)


def test_stats_file_rewritten_at_most_every_interval_while_busy_and_at_once_when_idle(tmp_path, monkeypatch) -> None:
    """Each rewrite costs the engine's thread a temporary file and a rename: while a request is
    live the file is rewritten at most every ``STATS_EVERY_S``, and the moment the last live
    request finishes it shows the latest counters (a reader waiting for idle reads them)."""
    import json

    from kvtier_vllm import scheduler as sched_mod

    path = tmp_path / "stats.json"
    sched, kvm = _sched(stats_path=str(path))
    clock = [100.0]
    monkeypatch.setattr(sched_mod, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    r1, job, write = _store_r1(sched, kvm)
    sched.update_connector_output(KVTierWorkerMetadata())
    first = json.loads(path.read_text())["counters"]
    sched.update_connector_output(KVTierWorkerMetadata({write.plan_id: (1, [True] * 4)}, {job.job_id: 1}))
    assert json.loads(path.read_text())["counters"] == first  # 0 s later, r1 live: not yet
    clock[0] += sched_mod.STATS_EVERY_S
    sched.update_connector_output(KVTierWorkerMetadata())
    assert json.loads(path.read_text())["counters"]["stored_blocks_dram"] == 4  # the interval passed
    sched.counters["lookups"] += 7
    sched.update_connector_output(KVTierWorkerMetadata())
    assert json.loads(path.read_text())["counters"]["lookups"] != sched.counters["lookups"]
    sched.request_finished(r1)  # the last live request: written at once
    assert json.loads(path.read_text())["counters"]["lookups"] == sched.counters["lookups"]
