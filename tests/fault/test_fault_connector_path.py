"""Transfer faults on the path vLLM runs: the kvtier connector's worker, not TieredStore.

The worker moves its bytes on the data plane's ``TransferEngine``, so faults go in
exactly as in ``test_fault_transfers.py``: through the mover's ``fault_hook``, by
link, on the lane's own thread, where real failing or slow I/O would hit. The
worker is built as vLLM builds it (no engine; two layers of (K, V) caches as
vLLM-Ascend lays them out) over a real DRAM pool and LMDB SSD tier. Checked:

* a failing SSD read (``ssd->hbm``) reports the load's blocks failed, engine
  block ids vLLM recomputes, and leaves the destination blocks untouched: a
  miss, never a wrong token;
* a failing DRAM copy (``hbm->dram``) fails its plans but still reports the
  engine blocks read (vLLM may free them) and gives its staging rows back;
* a slow SSD writer makes later SSD stores skip (counted) instead of queueing
  without limit, while DRAM stores go on; what was stored before is intact.

Needs vLLM only for the connector's metadata classes; CI runs this file with
the engine tests (``scripts/test.sh``).
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm", reason="the connector's metadata classes derive from vLLM's (the engine venv runs this)")

import torch  # noqa: E402
from fault_support import FIGURES  # noqa: E402
from kvtier_vllm.metadata import KVTierConnectorMetadata, LoadJob, StoreJob, TierWrite  # noqa: E402
from kvtier_vllm.settings import ConnectorSettings, EngineFacts  # noqa: E402
from kvtier_vllm.worker import KVTierWorker  # noqa: E402

NUM_BLOCKS, BS, HEADS, DIM = 12, 32, 2, 32


@pytest.fixture
def worker(tmp_path):
    facts = EngineFacts("tiny", "bfloat16", BS, 2, HEADS, DIM, "split", "sha256")
    settings = ConnectorSettings.build({"dram_capacity_blocks": 8, "ssd_path": str(tmp_path),
                                        "ssd_write_queue_mib": 1}, facts, env={})
    layout = settings.config.layout.to_layout()
    w = KVTierWorker(settings, settings.config.namespace.to_namespace(layout), layout, NUM_BLOCKS)
    gen = torch.Generator().manual_seed(7)
    caches = {f"layers.{i}.attn": tuple(torch.randn(NUM_BLOCKS, BS, HEADS, DIM, generator=gen).to(torch.bfloat16)
                                        for _ in range(2)) for i in range(2)}
    w.register_kv_caches(caches)
    yield w, caches
    w.mover.fault_hook = None
    w.shutdown()


def _hook(link: str, *, fail: bool = False, delay_s: float = 0.0, gate: threading.Event | None = None):
    def hook(job) -> None:
        if job.link != link:
            return
        FIGURES["faults_injected"] += 1
        if gate is not None:
            gate.wait(30)
        time.sleep(delay_s)
        if fail:
            raise OSError(5, f"injected I/O error on {job.link}")
    return hook


def _step_until(w: KVTierWorker, plans: set[int], recv: set[str] = frozenset(), timeout_s: float = 30,
                got: dict | None = None) -> dict:
    """Step the worker as vLLM does until ``plans`` and the loads of ``recv`` are reported
    (adding to ``got``, what earlier steps reported)."""
    if got is None:
        got = {"plans": {}, "recv": set(), "errors": set(), "gathered": set(), "skipped": 0}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, r = w.get_finished(set())
        got["recv"] |= r
        got["errors"] |= w.take_load_errors()
        meta = w.take_worker_meta()
        if meta is not None:
            got["plans"].update({pid: oks for pid, (_, oks) in meta.plans.items()})
            got["gathered"] |= set(meta.gathered)
            got["skipped"] += meta.skipped_blocks
        if plans <= set(got["plans"]) and recv <= got["recv"]:
            return got
        time.sleep(0.01)
    raise AssertionError(f"the worker did not report {plans - set(got['plans'])} / {recv - got['recv']}")


def _store(w: KVTierWorker, job_id: int, blocks: tuple[int, ...], keys: tuple[int, ...], slots: tuple[int, ...],
           ssd: bool = True) -> StoreJob:
    rows = tuple(range(len(blocks)))
    writes = [TierWrite(100 * job_id, "dram", rows, slots)]
    if ssd:
        writes.append(TierWrite(100 * job_id + 1, "ssd", rows, ()))
    job = StoreJob(job_id=job_id, req_id=f"r{job_id}", block_ids=blocks, keys=keys,
                   parents=(None, *keys[:-1]), writes=tuple(writes))
    w.wait_for_save(KVTierConnectorMetadata(stores=[job]))
    return job


def _same(caches: dict, a: int, b: int) -> bool:
    return all(torch.equal(t[a], t[b]) for kv in caches.values() for t in kv)


def test_a_failing_ssd_read_is_a_miss_and_leaves_the_engine_blocks_untouched(worker) -> None:
    w, caches = worker
    _store(w, 1, (1, 2, 3), (10, 11, 12), (0, 1, 2))
    assert _step_until(w, {100, 101})["plans"] == {100: [True] * 3, 101: [True] * 3}
    before = [t[6:9].clone() for kv in caches.values() for t in kv]
    w.mover.fault_hook = _hook("ssd->hbm", fail=True)
    w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r9", 9, (10, 11, 12), ("ssd",) * 3, (0,) * 3, (6, 7, 8))]))
    got = _step_until(w, {9}, {"r9"})
    assert got["plans"][9] == [False] * 3 and got["errors"] == {6, 7, 8}  # vLLM recomputes them
    after = [t[6:9] for kv in caches.values() for t in kv]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # no unverified byte reached the engine
    assert w.mover.links["ssd->hbm"].failed_blocks == 3
    # the fault gone, the same load succeeds: nothing stored was lost
    w.mover.fault_hook = None
    w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r9", 10, (10, 11, 12), ("ssd",) * 3, (0,) * 3,
                                                           (6, 7, 8))]))
    got = _step_until(w, {10}, {"r9"})
    assert got["plans"][10] == [True] * 3 and not got["errors"]
    assert all(_same(caches, a, b) for a, b in ((1, 6), (2, 7), (3, 8)))
    FIGURES["faults_survived"] += 1
    FIGURES["blocks_verified"] += 3


def test_a_failing_dram_copy_fails_its_plans_and_frees_the_engine_blocks(worker) -> None:
    w, caches = worker
    w.mover.fault_hook = _hook("hbm->dram", fail=True)
    job = _store(w, 2, (1, 2), (20, 21), (3, 4))
    got = _step_until(w, {200, 201})
    assert got["plans"] == {200: [False, False], 201: [False, False]}  # neither tier offers the blocks
    assert job.job_id in got["gathered"]  # the engine may free and reuse its blocks
    assert w.ring.rows_in_use == 0  # the staging rows came back
    w.mover.fault_hook = None
    _store(w, 3, (1, 2), (20, 21), (3, 4))
    assert _step_until(w, {300, 301})["plans"] == {300: [True, True], 301: [True, True]}
    FIGURES["faults_survived"] += 1


def test_a_slow_ssd_writer_skips_later_ssd_stores_and_dram_goes_on(worker) -> None:
    w, caches = worker
    gate = threading.Event()
    w.mover.fault_hook = _hook("hbm->ssd", gate=gate)  # the SSD lane stalls on its first write
    block_bytes = w.layout.bytes_per_block
    per_job = 3
    jobs = 1 + (1 << 20) // (per_job * block_bytes)  # enough to pass the 1 MiB SSD write queue
    for j in range(jobs):
        _store(w, 10 + j, (1, 2, 3), (1000 + 3 * j, 1001 + 3 * j, 1002 + 3 * j), (5, 6, 7))
    dram = {100 * (10 + j) for j in range(jobs)}
    got = _step_until(w, dram)
    assert all(got["plans"][p] == [True] * per_job for p in dram)  # DRAM stores are not held up
    gate.set()
    ssd = {100 * (10 + j) + 1 for j in range(jobs)}
    got = _step_until(w, ssd, got=got)
    plans = got["plans"]
    skipped = [p for p in ssd if plans[p] == [False] * per_job]
    assert skipped and got["skipped"] == per_job * len(skipped)  # skipped, counted
    assert w.ssd_queued_peak_bytes <= 1 << 20  # never queued past the bound
    written = [p for p in ssd if plans[p] == [True] * per_job]
    assert written  # what was queued was written
    FIGURES["faults_survived"] += 1
