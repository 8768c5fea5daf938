"""The vLLM connector's own byte path against memcpy and raw file I/O (issue 22).

``kvtier bench tiers`` measures ``TieredStore``. The connector's worker moves
bytes its own way between the engine's blocks, host rows, its DRAM slab pool
and the SSD tier (the same ``SSDTier`` and the same re-index as
``TieredStore``; the DRAM copies are numpy, so its background threads never
start an OpenMP team beside a CPU engine's forward). This measures that path:
a ``KVTierWorker`` built as vLLM builds it (no engine), over caches shaped like
an engine's, timing the exact functions its threads run, each interleaved
with its baseline in the same run:

* ``dram_store``: ``_gather_straight`` of a store job to DRAM slots (the engine's
  blocks straight into the pool's slots, one pass; staged rows into the pool
  where the straight path does not apply) vs ``memcpy`` (a torch copy of each
  block into its own buffer, as in ``kvtier bench tiers``);
* ``dram_load``: ``_load_straight`` of a load job from DRAM slots into other
  engine blocks vs ``memcpy``;
* ``ssd_store``: ``_write_ssd`` (LMDB, ``sync``: one fsync'ed transaction per
  16-block job) vs ``write`` + ``fsync`` of the same bytes per 16 blocks;
* ``ssd_load``: ``reads.read_tiers`` of a load job from SSD (warm page cache, checksums
  verified) vs ``readinto`` of the raw file;
* ``end_to_end_store`` / ``end_to_end_load`` (no target): the whole worker
  path a step sees for DRAM, through its public calls, stepped until reported.

Targets (as for ``TieredStore``): DRAM >= 0.8x memcpy, SSD put >= 0.5x write +
fsync, SSD get >= 0.6x warm read. Every loaded byte is compared with what was
stored.

Then loads behind writes (``queued`` in the JSON): the latency of one 16-block
DRAM load and one SSD load (200 of each by default), as vLLM steps them (``start_load_kv``, then
``get_finished`` until the load is reported), with nothing queued and with
256 MiB of SSD writes queued (``ssd_write_queue_mib``; the queue topped up
before every load), alternating, p50 / p99 of each. Targets: with the queue,
p99 <= 1.5x (DRAM) and <= 2x (SSD) of the same load with nothing queued.

Then both callers of the data plane through one function
(:func:`kvtier.benchmarks.bytepath.measure`, ``callers`` in the JSON): ``TieredStore``
put / get from the caller's buffers, and the worker through its public calls as
vLLM steps it (gather from the engine's blocks into staging, the tier write;
the tier read into staging, the scatter into other engine blocks), each against
the same baselines in the same run. Needs vLLM (the connector's metadata classes):

    .venv-vllm/bin/python bench/connector_path.py [--json bench/out/connector-path.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from kvtier_vllm.metadata import KVTierConnectorMetadata, LoadJob, StoreJob, TierWrite
from kvtier_vllm.settings import ConnectorSettings, EngineFacts
from kvtier_vllm.worker import KVTierWorker

from kvtier.benchmarks import bytepath
from kvtier.benchmarks.common import gbps, interleaved_best_seconds, print_table
from kvtier.benchmarks.tiers import BATCH_BLOCKS, TARGETS, memcpy_baseline, raw_file_baselines
from kvtier.keys import BlockKey
from kvtier.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
LAYER_BYTES = 2 * 16 * 8 * 128 * 2  # K/V x 16 tokens x 8 heads x 128 dim x bf16 = 64 KiB per layer per block


def _wait(worker: KVTierWorker, plan_ids: set[int], recv: set[str] = frozenset(), timeout_s: float = 120) -> None:
    """Step the worker as vLLM does until ``plan_ids`` and the loads of ``recv`` are reported ok."""
    got: dict[int, list[bool]] = {}
    received: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while not (plan_ids <= set(got) and recv <= received):
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker did not report plans {sorted(plan_ids - set(got))[:5]}")
        _, r = worker.get_finished(set())
        received |= r
        meta = worker.take_worker_meta()
        if meta is not None:
            got.update({pid: oks for pid, (_, oks) in meta.plans.items()})
        time.sleep(0.0002)
    bad = [pid for pid in plan_ids if not all(got[pid])]
    if bad:
        raise RuntimeError(f"plans failed: {bad[:5]}")


def _worker(block_bytes: int, n: int, workdir: Path) -> tuple[KVTierWorker, dict]:
    """A worker as vLLM builds it over 2 ``n`` engine blocks of random bf16 KV, DRAM and SSD of ``n``."""
    layers = block_bytes // LAYER_BYTES
    facts = EngineFacts("bench", "bfloat16", 16, layers, 8, 128, "fused", "sha256")
    ssd_dir = Path(tempfile.mkdtemp(prefix=f"connector_{block_bytes}_", dir=workdir))
    settings = ConnectorSettings.build({"dram_capacity_blocks": n, "ssd_path": str(ssd_dir), "ssd_capacity_blocks": n,
                                        "kvtier": {"tiers": {"ssd": {"sync": True}}}}, facts, env={})
    layout = settings.config.layout.to_layout()
    assert layout.bytes_per_block == block_bytes, (layout.bytes_per_block, block_bytes)
    engine_blocks = 2 * n  # stores read the first half, loads write the second
    worker = KVTierWorker(settings, settings.config.namespace.to_namespace(layout), layout, engine_blocks)
    gen = torch.Generator().manual_seed(3)
    caches = {f"model.layers.{i}.self_attn": torch.randn((2, engine_blocks, 16, 8, 128), generator=gen)
              .to(torch.bfloat16) for i in range(layers)}
    worker.register_kv_caches(caches)
    return worker, caches


def bench_size(block_bytes: int, total_bytes: int, repeats: int, workdir: Path) -> dict:
    n = max(BATCH_BLOCKS, total_bytes // block_bytes) // BATCH_BLOCKS * BATCH_BLOCKS
    worker, caches = _worker(block_bytes, n, workdir)
    try:
        return _measure(worker, caches, n, block_bytes, repeats, workdir)
    finally:
        worker.shutdown()


class WorkerCaller:
    """The connector's worker as a :class:`~kvtier.benchmarks.bytepath.ByteCaller`: engine blocks
    ``0 .. n-1`` stored, loads into blocks ``n .. 2n-1``, through the calls vLLM makes, stepped until reported."""

    name = "connector worker"

    def __init__(self, block_bytes: int, n: int, workdir: Path) -> None:
        self.worker, self.caches = _worker(block_bytes, n, workdir)
        self.io = self.worker.io
        self.n = n
        self.blocks = list(self.io.gather(list(range(n))))  # the source bytes, for the baselines and the check
        self.keys = list(range(2_000_000, 2_000_000 + n))
        self._ids = iter(range(1, 1 << 30))
        self._batches = [list(range(i, i + BATCH_BLOCKS)) for i in range(0, n, BATCH_BLOCKS)]

    def put(self, tier: str) -> None:
        keys = self.keys
        jobs = [StoreJob(job_id=next(self._ids), req_id="bytepath", block_ids=tuple(b),
                         keys=tuple(keys[i] for i in b), parents=tuple(keys[i - 1] if i else None for i in b),
                         writes=(TierWrite(next(self._ids), tier, tuple(range(len(b))),
                                           tuple(b) if tier == "dram" else ()),)) for b in self._batches]
        self.worker.wait_for_save(KVTierConnectorMetadata(stores=jobs))
        _wait(self.worker, {w.plan_id for j in jobs for w in j.writes})

    def get(self, tier: str) -> None:
        n, keys = self.n, self.keys
        jobs = [LoadJob("bytepath-load", next(self._ids), tuple(keys[i] for i in b), (tier,) * len(b),
                        tuple(b) if tier == "dram" else (0,) * len(b), tuple(n + i for i in b)) for b in self._batches]
        self.worker.start_load_kv(KVTierConnectorMetadata(loads=jobs))
        _wait(self.worker, {j.plan_id for j in jobs}, {"bytepath-load"})

    def read_back(self) -> list[torch.Tensor]:
        return list(self.io.gather(list(range(self.n, 2 * self.n))))

    def close(self) -> None:
        self.worker.shutdown()


QUEUED_TARGETS = {"dram": 1.5, "ssd": 2.0}
# the worker's whole path, as vLLM steps it (issue 57): against memcpy, write + fsync and a warm read
WORKER_TARGETS = {"dram_put_vs_memcpy": 0.8, "dram_get_vs_memcpy": 0.8, "ssd_put_vs_raw_write": 0.6,
                  "ssd_get_vs_raw_read": 0.5}  # p99 with 256 MiB of SSD writes queued / p99 with nothing queued


def bench_queued(block_bytes: int, loads: int, workdir: Path, queue_mib: int = 256) -> dict:
    """Load latency with nothing queued and with ``queue_mib`` of SSD writes queued (see the module doc)."""
    n = BATCH_BLOCKS
    queue_mib = max(queue_mib, 2 * (n * block_bytes >> 20))  # room for the seed store and a job of writes
    store_blocks = max(BATCH_BLOCKS, (queue_mib << 20) // block_bytes // 4)  # engine blocks the writes read
    layers = block_bytes // LAYER_BYTES
    facts = EngineFacts("bench", "bfloat16", 16, layers, 8, 128, "fused", "sha256")
    ssd_dir = Path(tempfile.mkdtemp(prefix=f"queued_{block_bytes}_", dir=workdir))
    cap = 4 * (queue_mib << 20) // block_bytes + 4 * n
    settings = ConnectorSettings.build({"dram_capacity_blocks": n, "ssd_path": str(ssd_dir), "ssd_capacity_blocks": cap,
                                        "ssd_write_queue_mib": queue_mib,
                                        "staging_mib": 2 * queue_mib + 2 * (n * block_bytes >> 20) + 16,
                                        "kvtier": {"tiers": {"ssd": {"sync": True}}}}, facts, env={})
    layout = settings.config.layout.to_layout()
    engine_blocks = store_blocks + 2 * n
    worker = KVTierWorker(settings, settings.config.namespace.to_namespace(layout), layout, engine_blocks)
    gen = torch.Generator().manual_seed(5)
    caches = {f"model.layers.{i}.self_attn": torch.randn((2, engine_blocks, 16, 8, 128), generator=gen)
              .to(torch.bfloat16) for i in range(layers)}
    worker.register_kv_caches(caches)
    ids = iter(range(1, 1 << 30))
    src, dst = list(range(n)), list(range(store_blocks + n, store_blocks + 2 * n))
    keys = list(range(3_000_000, 3_000_000 + n))
    writer = worker._writers["ssd"]
    gates: list[threading.Event] = []  # the SSD writer's gates (see top_up), opened however the run ends
    try:
        for tier in ("dram", "ssd"):  # the blocks the loads read
            job = StoreJob(next(ids), "seed", tuple(src), tuple(keys), tuple([None] + keys[:-1]),
                           (TierWrite(next(ids), tier, tuple(range(n)), tuple(range(n)) if tier == "dram" else ()),))
            worker.wait_for_save(KVTierConnectorMetadata(stores=[job]))
            _wait(worker, {job.writes[0].plan_id})
        fresh = iter(range(10_000_000, 1 << 40))

        def top_up() -> None:
            """SSD-only stores of fresh keys until ``queue_mib`` is queued for the writer, which waits
            behind a gate meanwhile (else a fast disk drains the queue as it fills); the gate opens
            as the load is issued, so the writer works through the whole queue beside it."""
            gate = threading.Event()
            worker.mover.submit_task("ssd", "bench-gate", 0, 0, gate.wait, lambda: None)
            gates.append(gate)
            while writer.queued_bytes + BATCH_BLOCKS * block_bytes <= writer.bound_bytes:
                b = list(range(store_blocks))[:BATCH_BLOCKS]
                ks = [next(fresh) for _ in b]
                job = StoreJob(next(ids), "writes", tuple(b), tuple(ks), tuple([None] + ks[:-1]),
                               (TierWrite(next(ids), "ssd", tuple(range(len(b))), ()),))
                worker.wait_for_save(KVTierConnectorMetadata(stores=[job]))
                worker.mover.drain(["copy"])  # the copy thread has queued it for the writer
                worker.get_finished(set())

        def load(tier: str) -> float:
            job = LoadJob("queued-load", next(ids), tuple(keys), (tier,) * n,
                          tuple(range(n)) if tier == "dram" else (0,) * n, tuple(dst))
            t0 = time.perf_counter()
            worker.start_load_kv(KVTierConnectorMetadata(loads=[job]))
            while "queued-load" not in worker.get_finished(set())[1]:
                time.sleep(0.0002)
            took = time.perf_counter() - t0
            meta = worker.take_worker_meta()
            if meta is None or not all(meta.plans.get(job.plan_id, (0, [False]))[1]):
                raise RuntimeError(f"{tier} load failed")
            return took

        lat: dict[str, list[float]] = {f"{t}_{q}": [] for t in ("dram", "ssd") for q in ("idle", "queued")}
        peak = 0
        for _ in range(loads):
            for tier in ("dram", "ssd"):
                worker.mover.drain()  # nothing queued
                worker.get_finished(set())
                lat[f"{tier}_idle"].append(load(tier))
                top_up()
                peak = max(peak, writer.queued_bytes)
                gates.pop().set()
                lat[f"{tier}_queued"].append(load(tier))
        worker.mover.drain()
        verified = all(torch.equal(t[:, src], t[:, dst]) for t in caches.values())
    finally:
        for gate in gates:
            gate.set()
        worker.shutdown()
    row: dict = {"block_kib": block_bytes // 1024, "load_blocks": n, "loads": loads, "queued_mib_peak": peak >> 20,
                 "verified": verified}
    for k, v in lat.items():
        v.sort()
        row[f"{k}_p50_ms"] = 1e3 * v[len(v) // 2]
        row[f"{k}_p99_ms"] = 1e3 * v[min(len(v) - 1, int(0.99 * len(v)))]
    for tier in ("dram", "ssd"):
        row[f"{tier}_p99_queued_vs_idle"] = row[f"{tier}_queued_p99_ms"] / row[f"{tier}_idle_p99_ms"]
    return row


QUEUED_COLUMNS = ("block_kib", "queued_mib_peak", "dram_idle_p50_ms", "dram_idle_p99_ms", "dram_queued_p50_ms",
                  "dram_queued_p99_ms", "dram_p99_queued_vs_idle", "ssd_idle_p50_ms", "ssd_idle_p99_ms",
                  "ssd_queued_p50_ms", "ssd_queued_p99_ms", "ssd_p99_queued_vs_idle", "verified")


def bench_callers(block_bytes: int, total_bytes: int, repeats: int, workdir: Path) -> list[dict]:
    """Both callers of the data plane through :func:`kvtier.benchmarks.bytepath.measure`."""
    n = max(BATCH_BLOCKS, total_bytes // block_bytes) // BATCH_BLOCKS * BATCH_BLOCKS
    rows = []
    for make in (lambda: bytepath.StoreCaller(bytepath.blocks_of(n, block_bytes), repeats, workdir),
                 lambda: WorkerCaller(block_bytes, n, workdir)):
        caller = make()
        try:
            rows.append(bytepath.measure(caller, repeats, workdir))
        finally:
            caller.close()
    return rows


def _measure(worker: KVTierWorker, caches: dict, n: int, block_bytes: int, repeats: int, workdir: Path) -> dict:
    io = worker.io
    assert io is not None
    src_blocks = list(range(n))
    dst_blocks = list(range(n, 2 * n))
    keys = list(range(1_000_000, 1_000_000 + n))
    batches = [list(range(i, i + BATCH_BLOCKS)) for i in range(0, n, BATCH_BLOCKS)]
    rows = io.gather(src_blocks)  # host rows (CPU engine): what wait_for_save gathers into the staging ring
    plan_ids = iter(range(1, 1 << 30))

    def store_job(b: list[int], tier: str) -> StoreJob:
        return StoreJob(job_id=next(plan_ids), req_id="bench", block_ids=tuple(src_blocks[i] for i in b),
                        keys=tuple(keys[i] for i in b), parents=tuple(keys[i - 1] if i else None for i in b),
                        writes=(TierWrite(next(plan_ids), tier, tuple(range(len(b))),
                                          tuple(b) if tier == "dram" else ()),))

    def load_job(b: list[int], tier: str) -> LoadJob:
        return LoadJob("bench-load", next(plan_ids), tuple(keys[i] for i in b), (tier,) * len(b),
                       tuple(b) if tier == "dram" else (0,) * len(b), tuple(dst_blocks[i] for i in b))

    # tier parts: the functions the worker's threads run, called here on one thread
    dram_jobs = [store_job(b, "dram") for b in batches]
    job_rows = [rows[b[0]:b[-1] + 1] for b in batches]
    out_rows = [torch.empty((len(b), block_bytes), dtype=torch.uint8) for b in batches]

    def dram_store() -> None:  # straight from the engine's blocks into the slots (staged rows on an accelerator)
        for job, r in zip(dram_jobs, job_rows):
            if not worker._gather_straight(job):
                worker._write_tiers(job, r.numpy(), job.writes, range(len(r)))

    def dram_load() -> None:  # straight from the slots into other engine blocks (staged rows on an accelerator)
        for b, r in zip(batches, out_rows):
            if not worker._load_straight(load_job(b, "dram")):
                assert all(worker.reads.read_tiers(load_job(b, "dram"), r.numpy()))

    def ssd_store() -> None:
        for b, r in zip(batches, job_rows):
            own = r.numpy()[list(range(len(b)))]  # as _write_tiers does: the SSD write owns a copy of its rows
            items = [(BlockKey(keys[i]), own[j], BlockKey(keys[i - 1]) if i else None) for j, i in enumerate(b)]
            writer = worker._writers["ssd"]
            writer.queued_bytes += own.nbytes  # what _write_tiers reserves before queueing it
            worker._write_slow(writer, TierWrite(0, "ssd", tuple(range(len(b))), ()), items, list(range(len(b))),
                               own.nbytes)

    def ssd_load() -> None:
        for b, r in zip(batches, out_rows):
            assert all(worker.reads.read_tiers(load_job(b, "ssd"), r.numpy()))

    blocks = list(rows)
    outs = [torch.empty(block_bytes, dtype=torch.uint8) for _ in range(n)]
    memcpy = memcpy_baseline(blocks, outs)
    raw_write, raw_read = raw_file_baselines(blocks, outs, workdir / f"raw_{block_bytes}.bin")
    memcpy()  # fault the baseline's buffers in
    dram_store()  # the pool holds the blocks before any load (the rounds run in shuffled order)
    memcpy_s, dram_store_s, dram_load_s = interleaved_best_seconds([memcpy, dram_store, dram_load], repeats,
                                                                   shuffle=True)
    verified = worker.io.straight or torch.equal(torch.cat(out_rows), rows)
    verified = verified and all(torch.equal(t[:, :n], t[:, n:]) for t in caches.values())
    raw_write_s, ssd_store_s, raw_read_s, ssd_load_s = interleaved_best_seconds(
        [raw_write, ssd_store, raw_read, ssd_load], repeats)
    verified = verified and torch.equal(torch.cat(out_rows), rows)
    worker._results = type(worker._results)()  # drop what the direct calls posted

    # end to end, through the worker's public calls and threads: DRAM store, then load into other blocks
    def e2e_store() -> None:
        jobs = [store_job(b, "dram") for b in batches]
        worker.wait_for_save(KVTierConnectorMetadata(stores=jobs))
        _wait(worker, {w.plan_id for j in jobs for w in j.writes})

    def e2e_load() -> None:
        jobs = [load_job(b, "dram") for b in batches]
        worker.start_load_kv(KVTierConnectorMetadata(loads=jobs))
        _wait(worker, {j.plan_id for j in jobs}, {"bench-load"})

    e2e_store_s, e2e_load_s = interleaved_best_seconds([e2e_store, e2e_load], repeats)
    verified = verified and all(torch.equal(t[:, :n], t[:, n:]) for t in caches.values())
    nbytes = n * block_bytes
    row = {
        "block_kib": block_bytes // 1024, "blocks": n, "verified": verified,
        "memcpy_gbps": gbps(nbytes, memcpy_s),
        "dram_store_gbps": gbps(nbytes, dram_store_s), "dram_load_gbps": gbps(nbytes, dram_load_s),
        "raw_file_write_gbps": gbps(nbytes, raw_write_s), "ssd_store_gbps": gbps(nbytes, ssd_store_s),
        "raw_file_read_gbps": gbps(nbytes, raw_read_s), "ssd_load_gbps": gbps(nbytes, ssd_load_s),
        "end_to_end_store_gbps": gbps(nbytes, e2e_store_s), "end_to_end_load_gbps": gbps(nbytes, e2e_load_s),
    }
    row["dram_put_vs_memcpy"] = row["dram_store_gbps"] / row["memcpy_gbps"]
    row["dram_get_vs_memcpy"] = row["dram_load_gbps"] / row["memcpy_gbps"]
    row["ssd_put_vs_raw_write"] = row["ssd_store_gbps"] / row["raw_file_write_gbps"]
    row["ssd_get_vs_raw_read"] = row["ssd_load_gbps"] / row["raw_file_read_gbps"]
    row["end_to_end_store_vs_memcpy"] = row["end_to_end_store_gbps"] / row["memcpy_gbps"]
    row["end_to_end_load_vs_memcpy"] = row["end_to_end_load_gbps"] / row["memcpy_gbps"]
    return row


COLUMNS = ("block_kib", "memcpy_gbps", "dram_store_gbps", "dram_put_vs_memcpy", "dram_load_gbps",
           "dram_get_vs_memcpy", "raw_file_write_gbps", "ssd_store_gbps", "ssd_put_vs_raw_write",
           "raw_file_read_gbps", "ssd_load_gbps", "ssd_get_vs_raw_read", "end_to_end_store_vs_memcpy",
           "end_to_end_load_vs_memcpy", "verified")


def run(sizes_kib: list[int], total_mib: int, repeats: int, progress=print, callers_only: bool = False,
        queued_loads: int = 200, queued_mib: int = 256) -> dict:
    results, callers, queued = [], [], []
    with tempfile.TemporaryDirectory(prefix="kvtier-connector-bench-") as tmp:
        for kib in sizes_kib:
            if not callers_only:
                progress(f"[connector_path] block {kib} KiB ...")
                results.append(bench_size(kib * 1024, total_mib << 20, repeats, Path(tmp)))
            progress(f"[connector_path] block {kib} KiB, both callers ...")
            callers.extend(bench_callers(kib * 1024, total_mib << 20, repeats, Path(tmp)))
            if queued_loads:
                progress(f"[connector_path] block {kib} KiB, loads behind {queued_mib} MiB of queued SSD writes ...")
                queued.append(bench_queued(kib * 1024, queued_loads, Path(tmp), queued_mib))
    met = {k: all(r[k] >= v for r in results) for k, v in TARGETS.items()}
    met_queued = {t: all(r[f"{t}_p99_queued_vs_idle"] <= v for r in queued) for t, v in QUEUED_TARGETS.items()}
    workers = [r for r in callers if r["caller"] == WorkerCaller.name]
    met_worker = {k: all(r[k] >= v for r in workers) for k, v in WORKER_TARGETS.items()}
    return {"results": results, "callers": callers, "worker_targets": WORKER_TARGETS, "worker_targets_met": met_worker,
            "queued": queued, "queued_targets": QUEUED_TARGETS, "queued_targets_met": met_queued, "targets": TARGETS, "targets_met": met, "total_mib": total_mib,
            "repeats": repeats,
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            **provenance(("kvtier", "integrations/vllm_ascend"), dirty_key="code_dirty")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-kib", default="256,1024,4096", help="block sizes in KiB, multiples of 64 "
                                                                   "(default 256,1024,4096, as kvtier bench tiers)")
    ap.add_argument("--total-mib", type=int, default=64, help="bytes moved per measurement (MiB, default 64)")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds; the best is kept (default 7)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--queued-loads", type=int, default=200, metavar="N",
                    help="loads of each tier timed with and without 256 MiB of SSD writes queued (default 200, so "
                         "that a p99 is not simply the slowest load; 0 skips)")
    ap.add_argument("--queued-mib", type=int, metavar="MIB",
                    help="SSD writes queued ahead of those loads (MiB; default 4x --total-mib, at most 256; at least "
                         "two 16-block jobs)")
    ap.add_argument("--callers-only", action="store_true",
                    help="only the two callers through one function and the loads behind writes")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes_kib.split(",")]
    except ValueError:
        ap.error(f"--sizes-kib {args.sizes_kib!r}: expected comma-separated integers")
    if any(s <= 0 or s * 1024 % LAYER_BYTES for s in sizes) or args.total_mib <= 0 or args.repeats <= 0:
        ap.error("--sizes-kib must be positive multiples of 64; --total-mib and --repeats positive")
    if args.queued_loads < 0 or (args.queued_mib is not None and args.queued_mib <= 0):
        ap.error("--queued-loads must be >= 0 and --queued-mib positive")
    report = run(sizes, args.total_mib, args.repeats, progress=lambda m: print(m, file=sys.stderr, flush=True),
                 callers_only=args.callers_only, queued_loads=args.queued_loads,
                 queued_mib=args.queued_mib or min(256, 4 * args.total_mib))
    if args.callers_only:
        report = {k: v for k, v in report.items() if k not in ("results", "targets", "targets_met")}
    else:
        _print_functions(report)
    print("\nboth callers of the data plane, one function (kvtier.benchmarks.bytepath.measure), GB/s and x baseline:")
    print_table(report["callers"], bytepath.COLUMNS)
    print("worker's whole path, targets: " + ", ".join(
        f"{k} >= {v} {'yes' if report['worker_targets_met'][k] else 'NO'}" for k, v in WORKER_TARGETS.items()))
    if report["queued"]:
        print("\nloads behind writes: one 16-block load, ms, with nothing queued and with SSD writes queued "
              "(queued_mib_peak):")
        print_table(report["queued"], QUEUED_COLUMNS)
        print("targets (p99 queued / idle): " + ", ".join(
            f"{t} <= {v}x {'yes' if report['queued_targets_met'][t] else 'NO'}" for t, v in QUEUED_TARGETS.items()))
    ok = all(r["verified"] for r in report.get("results", []) + report["callers"] + report["queued"])
    print(f"loaded bytes verified: {ok}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


def _print_functions(report: dict) -> None:
    print("  ".join(f"{c:>12}" for c in ("block_kib", "memcpy", "dram_put", "x", "dram_get", "x", "raw_write",
                                           "ssd_put", "x", "raw_read", "ssd_get", "x", "e2e_st x", "e2e_ld x")))
    for r in report["results"]:
        print("  ".join(f"{r[c]:>12.2f}" if isinstance(r[c], float) else f"{str(r[c]):>12}" for c in COLUMNS[:-1]))
    print("(GB/s; x = ratio to the baseline on its left; e2e = gather/scatter + DRAM, vs memcpy; no target)")
    print("targets met: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in report["targets_met"].items()))


if __name__ == "__main__":
    sys.exit(main())
