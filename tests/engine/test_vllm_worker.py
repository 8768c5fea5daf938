"""The connector's worker half on vLLM-Ascend's cache arrangement (a tuple of
separate K and V tensors per layer), without an engine: stores to DRAM and
SSD, loads back into other blocks, and a corrupt SSD value reported as a load
error. Needs vLLM only for the metadata base classes."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from kvtier_vllm.metadata import (
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    LoadJob,
    PromoteJob,
    StoreJob,
    TierWrite,
)
from kvtier_vllm.settings import ConnectorSettings, EngineFacts
from kvtier_vllm.worker import KVTierWorker

import kvtier.tiers.ssd as ssd_mod
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey, key_to_bytes
from kvtier.tiers.codec import HEADER_BYTES

pytestmark = pytest.mark.vllm_interface  # no engine: also run against newer vLLMs (scripts/vllm_next.sh)

NUM_BLOCKS, BS, HEADS, DIM = 8, 32, 2, 32


BLOCK_BYTES = 2 * 2 * BS * HEADS * DIM * 2  # layers x K/V x tokens x heads x dim x bf16


def _build(extra: dict, seed: int, contiguous: bool = True) -> tuple[KVTierWorker, dict]:
    """A worker over two layers of random (K, V) caches, registered as vLLM-Ascend does.
    ``contiguous=False``: caches strided as no one-pass copy takes, so every load goes through
    staging and the worker's lanes, as on an accelerator."""
    facts = EngineFacts("tiny", "bfloat16", BS, 2, HEADS, DIM, "split", "sha256")
    settings = ConnectorSettings.build(extra, facts, env={})
    layout = settings.config.layout.to_layout()
    assert layout.bytes_per_block == BLOCK_BYTES
    w = KVTierWorker(settings, settings.config.namespace.to_namespace(layout), layout, NUM_BLOCKS)
    gen = torch.Generator().manual_seed(seed)

    def cache() -> torch.Tensor:
        if contiguous:
            return torch.randn(NUM_BLOCKS, BS, HEADS, DIM, generator=gen).to(torch.bfloat16)
        return torch.randn(HEADS, NUM_BLOCKS, BS, DIM, generator=gen).to(torch.bfloat16).permute(1, 2, 0, 3)

    caches = {f"layers.{i}.attn": (cache(), cache()) for i in range(2)}
    w.register_kv_caches(caches)
    return w, caches


@pytest.fixture
def worker(tmp_path):
    w, caches = _build({"dram_capacity_blocks": 4, "ssd_path": str(tmp_path)}, seed=0)
    yield w, caches, tmp_path / "tp0-of-1"
    w.shutdown()


def _drain(w: KVTierWorker, want_plans: set[int], want_recv: set[str] = frozenset()) -> tuple:
    """Step the worker until the plans and loads are reported (as vLLM does each step)."""
    plans: dict[int, list[bool]] = {}
    sending: set[str] = set()
    recving: set[str] = set()
    errors: set[int] = set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s, r = w.get_finished(set())
        sending |= s
        recving |= r
        errors |= w.take_load_errors()
        meta = w.take_worker_meta()
        if meta is not None:
            plans.update({pid: oks for pid, (_, oks) in meta.plans.items()})
        if want_plans <= set(plans) and want_recv <= recving:
            return plans, sending, recving, errors
        time.sleep(0.01)
    raise AssertionError(f"worker did not report {want_plans - set(plans)} / {want_recv - recving}")


def _blocks_equal(caches: dict, a: int, b: int) -> bool:
    return all(torch.equal(t[a], t[b]) for kv in caches.values() for t in kv)


def _store(w: KVTierWorker) -> None:
    job = StoreJob(job_id=1, req_id="r1", block_ids=(1, 2), keys=(10, 11), parents=(None, 10),
                   writes=(TierWrite(1, "dram", (0, 1), (0, 1)), TierWrite(2, "ssd", (0, 1), ())))
    w.wait_for_save(KVTierConnectorMetadata(stores=[job]))
    plans, *_ = _drain(w, {1, 2})
    assert plans == {1: [True, True], 2: [True, True]}


def _count_landed(w: KVTierWorker) -> list[int]:
    """What each call of the SSD tier's one-copy read (``scatter_many``) landed, from now on."""
    landed: list[int] = []
    scatter = w._ssd.scatter_many

    def spy(*args, **kwargs):
        landed.append(scatter(*args, **kwargs))
        return landed[-1]

    w._ssd.scatter_many = spy
    return landed


def test_store_then_load_from_dram_and_ssd_into_other_blocks(worker) -> None:
    w, caches, _ = worker
    _store(w)
    # from DRAM slots into blocks 4, 5; from SSD into blocks 6, 7
    loads = [LoadJob("r2", 3, (10, 11), ("dram", "dram"), (0, 1), (4, 5)),
             LoadJob("r3", 4, (10, 11), ("ssd", "ssd"), (0, 0), (6, 7))]
    w.start_load_kv(KVTierConnectorMetadata(loads=loads))
    plans, _, _, errors = _drain(w, {3, 4}, {"r2", "r3"})
    assert plans == {3: [True, True], 4: [True, True]} and not errors
    assert _blocks_equal(caches, 1, 4) and _blocks_equal(caches, 2, 5)
    assert _blocks_equal(caches, 1, 6) and _blocks_equal(caches, 2, 7)


def test_a_synchronous_load_is_in_place_when_start_load_kv_returns_and_not_reported_received(worker) -> None:
    w, caches, _ = worker
    _store(w)
    w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r2", 3, (10, 11), ("dram", "dram"), (0, 1), (4, 5),
                                                           sync=True)]))
    assert _blocks_equal(caches, 1, 4) and _blocks_equal(caches, 2, 5)  # before any get_finished: the forward's
    _, recving = w.get_finished(set())
    meta = w.take_worker_meta()
    assert recving == set()  # vLLM runs the request already: "received" would be an error there
    assert meta is not None and meta.plans == {3: (1, [True, True])} and not w.take_load_errors()


def test_corrupt_ssd_value_fails_that_block_and_the_rest(worker) -> None:
    w, caches, _ = worker
    _store(w)
    env = w._ssd._env  # LMDB allows one environment per directory and process: reuse the tier's
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(key_to_bytes(10)))
        value[HEADER_BYTES + 7] ^= 0x01
        txn.put(key_to_bytes(10), bytes(value))
    before = [t[6].clone() for kv in caches.values() for t in kv]
    landed = _count_landed(w)
    w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r3", 4, (10, 11), ("ssd", "ssd"), (0, 0), (6, 7))]))
    plans, _, _, errors = _drain(w, {4}, {"r3"})
    assert landed == [0]  # the one-copy path was tried, and stopped at the corrupt value
    assert plans[4] == [False, True]  # block 11 verified, but follows a failed block
    assert errors == {6, 7}  # vLLM recomputes both
    after = [t[6] for kv in caches.values() for t in kv]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing unverified was written


def test_an_ssd_load_lands_raw_values_straight_and_reads_a_compressed_one_through_staging(worker) -> None:
    """One copy: raw SSD values go from the tier's map straight into the engine's blocks; the
    first value that path cannot show (here a compressed one) and those after it are read
    through staging and the general decoder, in the same load."""
    w, caches, _ = worker
    _store(w)  # keys 10, 11 raw on SSD, from blocks 1, 2
    block3 = w.io.gather([3]).numpy()[0].copy()
    assert w._ssd.put_many([(BlockKey(12), block3, BlockKey(10))], codec="zstd") == 1
    landed = _count_landed(w)
    w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r3", 4, (10, 12, 11), ("ssd",) * 3, (0,) * 3,
                                                           (5, 6, 7))]))
    plans, _, _, errors = _drain(w, {4}, {"r3"})
    assert plans[4] == [True, True, True] and not errors
    assert landed == [1]  # key 10 straight; 12 (compressed) and 11 after it through staging
    assert _blocks_equal(caches, 1, 5) and _blocks_equal(caches, 3, 6) and _blocks_equal(caches, 2, 7)


def test_a_released_request_is_reported_only_after_its_blocks_were_read(worker) -> None:
    w, _, _ = worker
    gate = __import__("threading").Event()
    w.mover.submit_task("copy", "test-gate", 0, 0, gate.wait, lambda: None)  # hold the copy lane
    # an SSD-only store goes through a staging run: its blocks count as read once the copy thread took the run
    job = StoreJob(job_id=7, req_id="r1", block_ids=(1,), keys=(10,), parents=(None,),
                   writes=(TierWrite(1, "ssd", (0,), ()),))
    w.wait_for_save(KVTierConnectorMetadata(stores=[job]))
    w.start_load_kv(KVTierConnectorMetadata(release=["r1"]))
    assert w.get_finished({"r1"}) == (set(), set())  # still reading
    # a DRAM store on a CPU cache is gathered straight into its slots on the engine's thread: read at once,
    # though the copy lane is still held
    assert w.io.straight
    job = StoreJob(job_id=8, req_id="r2", block_ids=(2,), keys=(11,), parents=(None,),
                   writes=(TierWrite(2, "dram", (0,), (0,)),))
    w.wait_for_save(KVTierConnectorMetadata(stores=[job]))
    w.start_load_kv(KVTierConnectorMetadata(release=["r2"]))
    assert w.get_finished({"r2"})[0] == {"r2"}
    gate.set()
    _, sending, _, _ = _drain(w, {1})
    assert sending == {"r1"}


@pytest.mark.parametrize("lockstep", [True, False])
def test_lockstep_transfers_report_a_steps_transfers_in_that_steps_get_finished(tmp_path, lockstep: bool) -> None:
    """``lockstep_transfers``: the first ``get_finished`` after a store or a load reports it
    done, however slow the disk, so the engine's schedule does not depend on thread timing.
    Without it a slow SSD write is reported by a later call."""
    w, caches = _build({"dram_capacity_blocks": 4, "ssd_path": str(tmp_path), "lockstep_transfers": lockstep}, seed=3)
    put_many = w._ssd.put_many

    def slow_put(items, **kwargs):
        time.sleep(0.3)
        return put_many(items, **kwargs)

    def slow(read):  # the tier's reads: into staging rows, or straight into the engine's blocks
        def slow_read(*args, **kwargs):
            time.sleep(0.3)
            return read(*args, **kwargs)
        return slow_read

    w._ssd.put_many = slow_put
    w._ssd.get_many_into, w._ssd.scatter_many = slow(w._ssd.get_many_into), slow(w._ssd.scatter_many)
    try:
        job = StoreJob(job_id=1, req_id="r1", block_ids=(1, 2), keys=(10, 11), parents=(None, 10),
                       writes=(TierWrite(1, "dram", (0, 1), (0, 1)), TierWrite(2, "ssd", (0, 1), ())))
        w.wait_for_save(KVTierConnectorMetadata(stores=[job]))
        w.get_finished(set())
        meta = w.take_worker_meta()
        plans = {} if meta is None else {pid: oks for pid, (_, oks) in meta.plans.items()}
        if not lockstep:
            assert 2 not in plans  # the SSD write is still sleeping
            _drain(w, {2})
            return
        assert plans == {1: [True, True], 2: [True, True]}
        w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r2", 3, (10, 11), ("ssd", "ssd"), (0, 0), (6, 7))]))
        assert w.get_finished(set()) == (set(), {"r2"})
        assert _blocks_equal(caches, 1, 6) and _blocks_equal(caches, 2, 7)
    finally:
        w.shutdown()


def test_worker_metadata_aggregates_over_ranks() -> None:
    a = KVTierWorkerMetadata({1: (1, [True, True])}, {5: 1})
    b = KVTierWorkerMetadata({1: (1, [True, False]), 2: (1, [True])}, {5: 1})
    merged = a.aggregate(b)
    assert merged.plans == {1: (2, [True, False]), 2: (1, [True])}
    assert merged.gathered == {5: 2}


def test_a_prefetch_promotes_ssd_values_into_dram_slots(worker) -> None:
    """A PromoteJob (SSD -> DRAM, the connector's predictive prefetch) fills the DRAM
    slots the scheduler reserved with verified SSD bytes: a load from those slots
    gives back the stored blocks. A key not on SSD fails, and only that one."""
    w, caches, _ = worker
    _store(w)
    w.start_load_kv(KVTierConnectorMetadata(promotions=[PromoteJob(5, (10, 11, 99), (2, 3, 0))]))
    plans, *_ = _drain(w, {5})
    assert plans == {5: [True, True, False]}
    w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r4", 6, (10, 11), ("dram", "dram"), (2, 3), (4, 5))]))
    plans, _, _, errors = _drain(w, {6}, {"r4"})
    assert plans == {6: [True, True]} and not errors
    assert _blocks_equal(caches, 1, 4) and _blocks_equal(caches, 2, 5)


def test_a_slow_ssd_skips_stores_instead_of_queueing_without_limit(tmp_path) -> None:
    """The SSD writer is slowed (each write sleeps) while stores keep coming: host
    copies waiting for it never exceed ``ssd_write_queue_mib``; the stores past the
    bound are reported failed (a later miss, never a wrong block) and counted, and
    DRAM stores go on. Every queued write still lands."""
    bound_blocks = 3
    block_bytes = BLOCK_BYTES
    w, _ = _build({"dram_capacity_blocks": 64, "ssd_path": str(tmp_path),
                   "ssd_write_queue_mib": bound_blocks * block_bytes / (1 << 20)}, seed=1)
    slow_put = w._ssd.put_many

    def put_many(items, **kwargs):  # a disk 100x slower than this machine's
        time.sleep(0.05)
        return slow_put(items, **kwargs)

    w._ssd.put_many = put_many
    try:
        jobs = []
        for j in range(20):  # 20 store jobs of 2 blocks, each to DRAM and SSD, in one burst
            keys = (1000 + 2 * j, 1001 + 2 * j)
            jobs.append(StoreJob(job_id=j + 1, req_id=f"r{j}", block_ids=(1, 2), keys=keys, parents=(None, keys[0]),
                                 writes=(TierWrite(100 + j, "dram", (0, 1), (2 * j, 2 * j + 1)),
                                         TierWrite(200 + j, "ssd", (0, 1), ()))))
        w.wait_for_save(KVTierConnectorMetadata(stores=jobs))
        plans, skipped = {}, 0
        deadline = time.monotonic() + 30
        while len(plans) < 40 and time.monotonic() < deadline:
            w.get_finished(set())
            meta = w.take_worker_meta()
            if meta is not None:
                plans.update({pid: oks for pid, (_, oks) in meta.plans.items()})
                skipped += meta.skipped_blocks
            time.sleep(0.01)
        assert len(plans) == 40
        assert all(all(plans[100 + j]) for j in range(20))  # DRAM never waits for the SSD
        ssd_ok = [j for j in range(20) if all(plans[200 + j])]
        ssd_skipped = [j for j in range(20) if not any(plans[200 + j])]
        assert len(ssd_ok) + len(ssd_skipped) == 20 and ssd_skipped and ssd_ok
        assert skipped == 2 * len(ssd_skipped)
        assert w.ssd_queued_peak_bytes <= bound_blocks * block_bytes  # the bound held
        assert w._writers["ssd"].queued_bytes == 0
    finally:
        w.shutdown()


def test_a_full_staging_ring_stores_and_loads_what_fits_and_counts_the_rest(tmp_path) -> None:
    """Host staging is a fixed ring (``staging_mib``): a store job larger than what is
    free gathers and stores its leading blocks only, a load reads its leading blocks
    only (the rest is recomputed), the blocks left out are counted, and the engine's
    thread never waits for room."""
    w, caches = _build({"dram_capacity_blocks": 8, "ssd_path": str(tmp_path),
                        "staging_mib": 3 * BLOCK_BYTES / (1 << 20)}, seed=2)
    try:
        assert w.ring is not None and w.ring.num_rows == 3
        keys = (20, 21, 22, 23)
        job = StoreJob(job_id=1, req_id="r1", block_ids=(0, 1, 2, 3), keys=keys, parents=(None, 20, 21, 22),
                       writes=(TierWrite(1, "ssd", (0, 1, 2, 3), ()),))
        w.wait_for_save(KVTierConnectorMetadata(stores=[job]))
        skipped_stores = skipped_loads = 0
        plans: dict[int, list[bool]] = {}
        received: set[str] = set()
        deadline = time.monotonic() + 10

        def step() -> None:
            nonlocal skipped_stores, skipped_loads
            received.update(w.get_finished(set())[1])
            meta = w.take_worker_meta()
            if meta is not None:
                plans.update({pid: oks for pid, (_, oks) in meta.plans.items()})
                skipped_stores += meta.staging_skipped_stores
                skipped_loads += meta.staging_skipped_loads

        while 1 not in plans and time.monotonic() < deadline:
            step()
            time.sleep(0.01)
        assert plans[1] == [True, True, True, False] and skipped_stores == 1
        load = LoadJob("r2", 2, keys[:3] + (24,), ("ssd",) * 4, (0,) * 4, (4, 5, 6, 7))
        w.start_load_kv(KVTierConnectorMetadata(loads=[load]))
        while "r2" not in received and time.monotonic() < deadline:
            step()
            time.sleep(0.01)
        assert plans[2] == [True, True, True, False] and skipped_loads == 1
        assert all(_blocks_equal(caches, a, b) for a, b in ((0, 4), (1, 5), (2, 6)))
        assert w.take_load_errors() == {7}
        assert w.ring.rows_in_use == 0 and w.ring.peak_rows_in_use == 3
        # DRAM traffic on a CPU cache takes no staging: a 4-block store and load are whole
        job = StoreJob(job_id=3, req_id="r3", block_ids=(0, 1, 2, 3), keys=keys, parents=(None, 20, 21, 22),
                       writes=(TierWrite(3, "dram", (0, 1, 2, 3), (0, 1, 2, 3)),))
        w.wait_for_save(KVTierConnectorMetadata(stores=[job]))
        w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r4", 4, keys, ("dram",) * 4, (0, 1, 2, 3),
                                                                (4, 5, 6, 7))]))
        while "r4" not in received and time.monotonic() < deadline:
            step()
            time.sleep(0.01)
        assert plans[3] == plans[4] == [True] * 4 and skipped_stores == skipped_loads == 1
        assert all(_blocks_equal(caches, a, b) for a, b in ((0, 4), (1, 5), (2, 6), (3, 7)))
        assert w.ring.peak_rows_in_use == 3
    finally:
        w.shutdown()


def _mla_worker(tmp_path, tp_rank: int) -> tuple[KVTierWorker, dict]:
    """A worker of TP rank ``tp_rank`` (of 2) over two layers of an MLA latent cache
    (``[blocks, 16, 576]`` bf16 per layer, as vLLM's CPU MLA backend lays it out)."""
    facts = EngineFacts("tiny-mla", "bfloat16", 16, 2, 1, 576, "mla", "sha256", tp_rank=tp_rank, tp_size=2)
    settings = ConnectorSettings.build({"dram_capacity_blocks": 4, "ssd_path": str(tmp_path)}, facts, env={})
    layout = settings.config.layout.to_layout()
    assert layout.bytes_per_token == 2 * 576 * 2  # the latent, no heads: the engine's page per token
    ns = settings.config.namespace.to_namespace(layout)
    assert (ns.tp_rank, ns.tp_size) == (0, 1)  # every rank holds the same latent: keyed without the rank
    w = KVTierWorker(settings, ns, layout, NUM_BLOCKS, writes_shared=facts.writes_shared_tiers)
    gen = torch.Generator().manual_seed(tp_rank)
    caches = {f"layers.{i}.attn": torch.randn(NUM_BLOCKS, 16, 576, generator=gen).to(torch.bfloat16) for i in range(2)}
    w.register_kv_caches(caches)
    return w, caches


def test_mla_rank_0_alone_writes_the_shared_ssd_and_every_rank_reads_it(tmp_path) -> None:
    """MLA under tensor parallelism: the latent is the same on every rank, so one
    directory serves them all and rank 0 alone writes it (a second rank's copy would be
    the same bytes written twice). Rank 1 still fills its own DRAM pool; its SSD write
    reports ok without writing, so the AND over ranks is rank 0's result."""
    w1, caches1 = _mla_worker(tmp_path, tp_rank=1)
    job = StoreJob(job_id=1, req_id="r1", block_ids=(1, 2), keys=(10, 11), parents=(None, 10),
                   writes=(TierWrite(1, "dram", (0, 1), (0, 1)), TierWrite(2, "ssd", (0, 1), ())))
    w1.wait_for_save(KVTierConnectorMetadata(stores=[job]))
    plans, *_ = _drain(w1, {1, 2})
    assert plans == {1: [True, True], 2: [True, True]}
    assert list(w1._ssd.scan()) == []  # rank 1 wrote nothing to the shared directory
    w0, caches0 = _mla_worker(tmp_path, tp_rank=0)
    assert [p.name for p in tmp_path.iterdir()] == ["tp0-of-1"]
    w0.wait_for_save(KVTierConnectorMetadata(stores=[job]))
    plans, *_ = _drain(w0, {1, 2})
    assert plans == {1: [True, True], 2: [True, True]}
    # rank 1 reads rank 0's values (here the same process: one LMDB environment per directory)
    w1.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r2", 3, (10, 11), ("ssd", "ssd"), (0, 0), (5, 6))]))
    plans, _, _, errors = _drain(w1, {3}, {"r2"})
    assert plans == {3: [True, True]} and not errors
    assert all(torch.equal(caches1[n][5], caches0[n][1]) and torch.equal(caches1[n][6], caches0[n][2]) for n in caches0)
    w0.shutdown()
    w1.shutdown()


def test_a_hybrid_models_failed_load_fails_its_request_not_block_ids(tmp_path) -> None:
    """vLLM cannot map a failed block id back to a request position when a model has
    several KV cache groups (block ids repeat across groups): such a load reports its
    request (``failed_recving``), and vLLM recomputes it in full."""
    facts = EngineFacts("tiny", "bfloat16", BS, 2, HEADS, DIM, "split", "sha256", window_blocks=(2, 0))
    settings = ConnectorSettings.build({"dram_capacity_blocks": 4}, facts, env={})
    layout = settings.config.layout.to_layout()
    w = KVTierWorker(settings, settings.config.namespace.to_namespace(layout), layout, NUM_BLOCKS,
                     hybrid=facts.hybrid)
    caches = {f"layers.{i}.attn": tuple(torch.zeros(NUM_BLOCKS, BS, HEADS, DIM, dtype=torch.bfloat16)
                                        for _ in range(2)) for i in range(2)}
    w.register_kv_caches(caches)
    w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r1", 0, (), (), (), (3, 4))]))  # nothing readable
    _, _, recving, errors = _drain(w, set(), {"r1"})
    assert not errors and w.take_failed_loads() == {"r1"}
    w.shutdown()


def _slow_ssd_reads(w: KVTierWorker, events: list[tuple[str, float]]) -> None:
    """The SSD tier's reads (into staging rows, or straight into the engine's blocks) take 0.4 s more,
    noting ``read-start`` and ``read-end`` in ``events``."""
    def slow(read):
        def slow_read(*args, **kwargs):
            events.append(("read-start", time.monotonic()))
            time.sleep(0.4)
            out = read(*args, **kwargs)
            events.append(("read-end", time.monotonic()))
            return out
        return slow_read

    w._ssd.get_many_into, w._ssd.scatter_many = slow(w._ssd.get_many_into), slow(w._ssd.scatter_many)


def test_an_ssd_write_under_way_pauses_between_groups_while_a_load_reads(tmp_path, monkeypatch) -> None:
    """Loads first, within a write too: an SSD write of several groups that a load's read
    starts beside goes on with its next group only once that read is done; the write and
    the load both complete."""
    monkeypatch.setattr("kvtier.tiers.ssd.WRITE_GROUP_BYTES", BLOCK_BYTES)  # one block per group
    w, caches = _build({"dram_capacity_blocks": 4, "ssd_path": str(tmp_path)}, seed=5)
    w.reads.write_yield_s = 2.0
    try:
        _store(w)  # keys 10, 11 on SSD
        events: list[tuple[str, float]] = []
        encode_into = ssd_mod.encode_into

        def slow_encode(items, *args, **kwargs):  # each group of the write takes a while
            events.append(("group", time.monotonic()))
            time.sleep(0.1)
            return encode_into(items, *args, **kwargs)

        monkeypatch.setattr(ssd_mod, "encode_into", slow_encode)
        _slow_ssd_reads(w, events)
        job = StoreJob(job_id=6, req_id="r3", block_ids=(3, 4, 5, 6), keys=(30, 31, 32, 33),
                       parents=(None, 30, 31, 32), writes=(TierWrite(7, "ssd", (0, 1, 2, 3), ()),))
        w.wait_for_save(KVTierConnectorMetadata(stores=[job]))
        while not events:  # the write is under way
            time.sleep(0.005)
        w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r2", 5, (10, 11), ("ssd", "ssd"), (0, 0), (1, 2))]))
        plans, _, _, _ = _drain(w, {5, 7}, {"r2"})
        assert plans[5] == [True, True] and plans[7] == [True] * 4
        groups = [t for name, t in events if name == "group"]
        read_start, read_end = dict(events)["read-start"], dict(events)["read-end"]
        # groups 0 and 1 began encoding with the write (two buffers); the rest only once the read was done
        assert len(groups) == 4 and groups[0] < read_start and all(t >= read_end for t in groups[2:])
        assert _blocks_equal(caches, 1, 1) and all(w._ssd.contains(BlockKey(k)) for k in (30, 31, 32, 33))
    finally:
        w.shutdown()


@pytest.mark.parametrize("yield_s", [2.0, 0.0])
def test_a_slow_tier_write_waits_for_the_loads_reading_when_it_starts(tmp_path, yield_s: float) -> None:
    """Loads first: an SSD write queued while an SSD load reads starts once the load has read
    (at most ``reads.write_yield_s`` later); with no yield it starts beside the read."""
    w, caches = _build({"dram_capacity_blocks": 4, "ssd_path": str(tmp_path)}, seed=4)
    w.reads.write_yield_s = yield_s
    try:
        _store(w)  # keys 10, 11 on SSD
        events: list[tuple[str, float]] = []
        put_many = w._ssd.put_many

        def noted_put(items, **kwargs):
            events.append(("write-start", time.monotonic()))
            return put_many(items, **kwargs)

        _slow_ssd_reads(w, events)
        w._ssd.put_many = noted_put
        w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r2", 5, (10, 11), ("ssd", "ssd"), (0, 0), (6, 7))]))
        while not events:  # the load is reading
            time.sleep(0.005)
        job = StoreJob(job_id=6, req_id="r3", block_ids=(3,), keys=(30,), parents=(None,),
                       writes=(TierWrite(7, "ssd", (0,), ()),))
        w.wait_for_save(KVTierConnectorMetadata(stores=[job]))
        plans, _, _, _ = _drain(w, {5, 7}, {"r2"})
        assert plans[5] == [True, True] and plans[7] == [True]
        when = dict(events)
        if yield_s:
            assert when["write-start"] >= when["read-end"]
        else:
            assert when["write-start"] < when["read-end"]
        assert _blocks_equal(caches, 1, 6) and _blocks_equal(caches, 2, 7)
    finally:
        w.shutdown()


def _step_load(w: KVTierWorker, req_id: str, timeout_s: float = 10.0) -> tuple[float, dict, set[int], list[int]]:
    """Step the worker until ``req_id``'s load is reported: (seconds it took, plans, errors, expired plans)."""
    start = time.monotonic()
    plans: dict[int, list[bool]] = {}
    errors: set[int] = set()
    expired: list[int] = []
    while time.monotonic() - start < timeout_s:
        _, recving = w.get_finished(set())
        errors |= w.take_load_errors()
        meta = w.take_worker_meta()
        if meta is not None:
            plans.update({pid: oks for pid, (_, oks) in meta.plans.items()})
            expired += meta.expired_plans
        if req_id in recving:
            return time.monotonic() - start, plans, errors, expired
        time.sleep(0.01)
    raise AssertionError(f"load of {req_id} not reported within {timeout_s} s")


def _stalled(read, seconds: float):
    def stalled_read(*args, **kwargs):
        time.sleep(seconds)
        return read(*args, **kwargs)
    return stalled_read


STALL_S = 1.5


def test_a_load_stalled_past_its_deadline_is_recomputed_and_its_late_read_writes_nothing(tmp_path) -> None:
    """``load_deadline_s``: an SSD read that stalls (before any byte reaches the engine's blocks)
    past the deadline is reported failed at the deadline, not when the tier answers: vLLM
    recomputes the blocks. The late read then lands nothing in the engine's blocks and
    gives its staging run back; the load is reported once."""
    w, caches = _build({"dram_capacity_blocks": 4, "ssd_path": str(tmp_path), "load_deadline_s": 0.2}, seed=5)
    try:
        block3 = w.io.gather([3]).numpy()[0].copy()  # compressed on SSD: read through staging, not the map
        assert w._ssd.put_many([(BlockKey(12), block3, None)], codec="zstd") == 1
        w._ssd.get_many_into = _stalled(w._ssd.get_many_into, STALL_S)
        before = [t[5].clone() for kv in caches.values() for t in kv]
        w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r3", 4, (12,), ("ssd",), (0,), (5,))]))
        took, plans, errors, expired = _step_load(w, "r3")
        assert took < STALL_S - 0.3  # at the deadline, not when the stalled read returned
        assert plans == {4: [False]} and errors == {5} and expired == [4]
        deadline = time.monotonic() + STALL_S + 10  # the stalled read returns, verified, into its staging run
        while time.monotonic() < deadline and w.ring.rows_in_use:
            _, recving = w.get_finished(set())
            assert "r3" not in recving and not w.take_load_errors()  # reported once
            time.sleep(0.02)
        assert w.ring.rows_in_use == 0  # its staging run was given back: the late read is done
        assert w.get_finished(set())[1] == set() and not w.take_load_errors()
        after = [t[5] for kv in caches.values() for t in kv]
        assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing landed after the report
    finally:
        w.shutdown()


def test_a_copy_into_the_engines_blocks_under_way_at_the_deadline_finishes_first(tmp_path) -> None:
    """A raw SSD value is copied from the tier's map straight into the engine's blocks; a copy
    under way is not abandoned halfway (the block would be neither the tier's nor recomputed):
    the load waits for it and is reported as loaded, not expired, also when the engine's thread
    steps between the last copy and the load's report (held open here: the report waits 0.3 s)."""
    w, caches = _build({"dram_capacity_blocks": 4, "ssd_path": str(tmp_path), "load_deadline_s": 0.1}, seed=6)
    try:
        _store(w)
        started = threading.Event()
        scatter_many = _stalled(w._ssd.scatter_many, 0.6)

        def copying(*args, **kwargs):
            started.set()
            return scatter_many(*args, **kwargs)

        w._ssd.scatter_many = copying
        w.reads.post = _stalled(w.reads.post, 0.3)
        w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r3", 4, (10, 11), ("ssd", "ssd"), (0, 0), (6, 7))]))
        assert started.wait(10)  # the copy is under way (the engine's thread steps only from here: a busy
        time.sleep(0.15)  # machine may start the load's thread later than the deadline), and the deadline past
        took, plans, errors, expired = _step_load(w, "r3")
        assert took >= 0.3 and plans == {4: [True, True]} and not errors and expired == []  # (0.3: the report's hold)
        assert _blocks_equal(caches, 1, 6) and _blocks_equal(caches, 2, 7)
    finally:
        w.shutdown()


def test_an_ssd_read_that_hangs_holds_up_no_load_from_dram(tmp_path) -> None:
    """Loads from DRAM read on a lane of their own: with an SSD read hung (held until released
    here), a load from DRAM alone that comes after it is reported, verified, while the SSD load
    still waits. Caches strided as on an accelerator, where every load goes through the lanes."""
    w, caches = _build({"dram_capacity_blocks": 4, "ssd_path": str(tmp_path)}, seed=7, contiguous=False)
    assert not w.io.straight
    release = threading.Event()
    get_many_into = w._ssd.get_many_into

    def hung(*args, **kwargs):
        release.wait(30)
        return get_many_into(*args, **kwargs)

    try:
        _store(w)
        w._ssd.get_many_into = hung
        w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r3", 4, (10, 11), ("ssd", "ssd"), (0, 0), (6, 7))]))
        w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r2", 3, (10, 11), ("dram", "dram"), (0, 1), (4, 5))]))
        _, plans, errors, _ = _step_load(w, "r2")
        assert plans == {3: [True, True]} and not errors and not release.is_set()
        assert _blocks_equal(caches, 1, 4) and _blocks_equal(caches, 2, 5)
        release.set()
        _, plans, errors, _ = _step_load(w, "r3")
        assert plans == {4: [True, True]} and not errors
        assert _blocks_equal(caches, 1, 6) and _blocks_equal(caches, 2, 7)
    finally:
        release.set()
        w.shutdown()


def test_a_bad_load_deadline_names_the_setting() -> None:
    facts = EngineFacts("tiny", "bfloat16", BS, 2, HEADS, DIM, "split", "sha256")
    for bad in (-1, "30", True, 7200):
        with pytest.raises(ConfigError, match="load_deadline_s"):
            ConnectorSettings.build({"load_deadline_s": bad}, facts, env={})
    assert ConnectorSettings.build({}, facts, env={}).load_deadline_s == 30.0


def test_the_gil_switch_interval_is_lowered_never_raised_and_a_bad_value_named() -> None:
    """``gil_switch_interval_us``: vLLM's engine thread holds the GIL in its loop while requests wait on
    loads, so a kvtier copy thread that gave the GIL up (an LMDB read, a C copy) waited a whole switch
    interval (5 ms) to get it back. The connector lowers it (default 500 us), never raises it, and 0
    leaves it."""
    import sys

    from kvtier_vllm.connector import _lower_switch_interval

    facts = EngineFacts("tiny", "bfloat16", BS, 2, HEADS, DIM, "split", "sha256")
    assert ConnectorSettings.build({}, facts, env={}).gil_switch_interval_us == 500
    for bad in (-1, 0.5, "500", True, 200_000):
        with pytest.raises(ConfigError, match="gil_switch_interval_us"):
            ConnectorSettings.build({"gil_switch_interval_us": bad}, facts, env={})
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        _lower_switch_interval(0)
        assert sys.getswitchinterval() == pytest.approx(0.005)
        _lower_switch_interval(500)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        _lower_switch_interval(2_000)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)


def test_a_load_scattered_by_several_helper_threads_is_reported_after_every_copy(tmp_path) -> None:
    """``copy_threads`` 3: a CPU load's chunks are scattered by two helper threads; the load is
    reported only once every chunk is in the engine's blocks, not when the last-queued one is
    (here the first chunk's copy is the slow one)."""
    w, caches = _build({"dram_capacity_blocks": 4, "ssd_path": str(tmp_path), "copy_threads": 3}, seed=7)
    try:
        rows = w.io.gather([1, 2]).numpy().copy()
        assert w._ssd.put_many([(BlockKey(12), rows[0], None), (BlockKey(13), rows[1], BlockKey(12))],
                               codec="zstd") == 2  # compressed: read into staging, then scattered
        w.reads.land_chunk_bytes = BLOCK_BYTES  # one block a chunk: two scatters
        scatter_rows = w.io.scatter_rows

        def first_chunk_slow(block_ids, *args, **kwargs):
            if list(block_ids) == [5]:
                time.sleep(0.5)
            return scatter_rows(block_ids, *args, **kwargs)

        w.io.scatter_rows = first_chunk_slow
        w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r3", 4, (12, 13), ("ssd", "ssd"), (0, 0), (5, 6))]))
        _, plans, errors, _ = _step_load(w, "r3")
        assert plans == {4: [True, True]} and not errors
        assert _blocks_equal(caches, 1, 5) and _blocks_equal(caches, 2, 6)  # both in place when reported
    finally:
        w.shutdown()
