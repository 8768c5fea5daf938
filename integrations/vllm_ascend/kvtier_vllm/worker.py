"""Worker side of the kvtier connector: the bytes.

Owns: the registered engine KV caches (through :class:`~.blockio.BlockIO`),
this rank's DRAM slab pool, SSD (LMDB) tier and remote-tier client (a
Mooncake Store shared by engines, :mod:`~.remoteshare`), and the jobs that
move host bytes for the scheduler's plans. The bytes move through kvtier's
data plane, as :class:`~kvtier.store.TieredStore`'s do: the copies are
:mod:`kvtier.transfer.media`'s movers, run on a
:class:`~kvtier.transfer.mover.TransferEngine` (``self.mover``: its failure
handling, ``fault_hook`` and link statistics) in ordered lanes (``LANES``):
``copy`` (a store's hand-off from staging), ``ssd`` and ``remote`` (the slow
tiers' writes and deletes), and, so that a load never queues behind a
write, ``load`` (a load from DRAM alone), ``ssd-read`` (a load with SSD
blocks, SSD -> DRAM promotions: a hung SSD read holds up these only) and
``remote-read``; and a slow tier's write waits (at most
``LoadReads.write_yield_s``) for the loads reading when it starts, and an SSD
write between its groups (:mod:`~.reads`). What stays here is vLLM's: the
gather and scatter between the engine's blocks and host rows. Reports per-block results, store jobs
whose engine blocks it finished reading, finished loads and the engine block
ids whose load failed.

One copy each way on the host. On a CPU cache with kvtier's C module
(:attr:`~.blockio.BlockIO.straight`) a store with a DRAM write is gathered
on the engine's thread straight into the slots the scheduler reserved, and
a load wholly from DRAM is scattered straight from its slots (which stay
reserved until the scheduler completes the load): one pass, no staging, no
thread hand-off. The store's SSD and remote writes take their own copies
from those slots on the copy thread, and its DRAM write is reported after
them, so the slots are not reused first. A load with SSD blocks is read
into a staging run a chunk at a time on the ``ssd-read`` lane, and each verified
chunk is scattered into the engine's blocks (the request's own, which no
forward reads until the load is reported) by the copy helper while the
next chunk is read.

Threads and torch. Torch operations on engine blocks run on the engine's
own thread (gathers in ``wait_for_save`` / ``handle_preemptions``,
scatters in ``get_finished``); background threads touch host buffers only
through numpy, LMDB and kvtier's C copy (whose chunked scatter into a CPU
cache is not torch). So the connector never starts an OpenMP team beside
the forward on vLLM's CPU backend (whose worker is pinned to its cores). On
an accelerator the copies are ordered on the engine's stream: layer by
layer from the device into a run of the staging ring (pinned, so not
blocking), then an event the copy thread waits for; a load's run is copied
to the device without blocking and reused once its event has passed.

Host memory is fixed: every block in flight between the engine's blocks
and the tiers sits in a DRAM slot or the staging ring (``staging_mib``,
:mod:`~.staging`); a store or load that finds it full moves the blocks
that fit and reports the rest failed (counted), never waiting on the
engine's thread. The host copies waiting for the SSD writer are bounded
(``ssd_write_queue_mib``): when the SSD falls behind what the engine
computes, further SSD stores are skipped (reported failed, so the scheduler
never offers those blocks from SSD) and counted, never queued without limit;
the remote writer has a bound of its own (``remote_write_queue_mib``).

Must not decide what to store, load or evict (the scheduler side plans it),
and must never leave unverified bytes in an engine block it reports as
loaded: a block that fails (absent, corrupt, foreign, I/O error) and every
block after it in that request's load is reported as failed, so vLLM
recomputes it. Engine blocks are read only after the step's forward and
never after their request was released, except write-backs (exclusive DRAM),
read in ``handle_preemptions``, the first hook of a step, before the forward
that reuses their slots.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.keys import BlockKey, Namespace
from kvtier.layout import KVLayout
from kvtier.tiers.pool import TensorPool, accelerator_device
from kvtier.transfer import media
from kvtier.transfer.mover import TransferEngine

from . import remoteshare, ssdshare
from .blockio import BlockIO, KVCache
from .reads import LoadReads
from .metadata import KVTierConnectorMetadata, KVTierWorkerMetadata, LoadJob, PromoteJob, StoreJob, TierWrite
from .rerotate import KeyRegion, Rope, key_regions, rerotate_rows
from .settings import ConnectorSettings
from .staging import Run, StagingRing

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Read:
    """A load whose bytes are in a staging run (``None``: the ring was full), waiting
    to be scattered by the engine thread; ``landed``: already scattered straight from
    the DRAM pool's slots (nothing left to copy)."""

    job: LoadJob
    run: Run | None
    oks: list[bool]
    landed: bool = False


@dataclass(slots=True)
class _Results:
    """Completions posted by the background threads, drained once per step."""

    plans: dict[int, list[bool]] = field(default_factory=dict)
    gathered: list[tuple[int, str]] = field(default_factory=list)
    reads: list[_Read] = field(default_factory=list)
    busy_us: int = 0  # CPU time of the background threads
    skipped_blocks: int = 0  # SSD stores skipped for backpressure
    remote_skipped_blocks: int = 0  # remote stores skipped for backpressure
    staging_skipped_stores: int = 0  # blocks not gathered: the staging ring was full
    write_backs_missed: int = 0  # write-back blocks failed: the engine did not call handle_preemptions first
    staging_skipped_loads: int = 0  # blocks not loaded: the staging ring was full


# the worker's ordered lanes on its TransferEngine, in the order they hand on: store copies ("copy") hand
# on to the slow tiers' writers ("ssd", "remote"); loads from DRAM alone read on "load", loads with SSD
# blocks and promotions on "ssd-read" (so an SSD read that hangs never holds a DRAM load up), and both
# hand a load's remote blocks on to "remote-read". Reads have lanes of their own, so a load never queues
# behind writes.
LANES = ("copy", "load", "ssd-read", "ssd", "remote-read", "remote")


class _Writer:
    """A slow tier's writes (SSD or remote): one lane of the mover, and a bound on the
    host copies queued for it (``queued_bytes``; changed under the worker's lock)."""

    def __init__(self, tier: Any, lane: str, bound_bytes: int) -> None:
        self.tier = tier
        self.lane = lane
        self.bound_bytes = bound_bytes
        self.queued_bytes = 0
        self.peak_bytes = 0
        # the remote writer's queued copies live in rows of one buffer registered with the
        # store (bound_bytes of them), so the store sends them with no further copy
        self.arena: np.ndarray | None = None
        self.free_rows: list[int] = []  # a heap: the lowest free rows are taken first

    def take_rows(self, n: int) -> list[int]:
        """``n`` free arena rows, the lowest first (``[]`` when fewer are free). Lowest first keeps
        the rows in use, and so the pages the process touches, near the most ever queued: taken
        oldest first they walked the whole arena under steady traffic (the soak's RSS growth)."""
        if len(self.free_rows) < n:
            return []
        return [heapq.heappop(self.free_rows) for _ in range(n)]

    def give_rows(self, rows: Sequence[int]) -> None:
        for r in rows:
            heapq.heappush(self.free_rows, r)


class KVTierWorker:
    """The worker-side half; one per rank."""

    def __init__(self, settings: ConnectorSettings, namespace: Namespace, layout: KVLayout, num_blocks: int,
                 writes_shared: bool = True, hybrid: bool = False) -> None:
        self.settings = settings
        # False on TP ranks other than 0 for replicated KV (MLA): rank 0 alone writes the SSD directory
        # and the remote store all ranks read; every rank still fills its own DRAM pool
        self.writes_shared = writes_shared
        # hybrid models: vLLM takes a failed load as a failed request, not as failed block ids; and a
        # sliding group's block may be freed and rewritten by the next step's forward while its request
        # runs, so copies stay on the engine's stream (ordered before that forward), not a side stream
        self.fail_requests = hybrid
        self._failed_loads: set[str] = set()
        self.namespace = namespace
        self.layout = layout
        self.num_blocks = num_blocks
        self.io: BlockIO | None = None
        self._pool: TensorPool | None = None
        self._pool_np: np.ndarray | None = None
        self._ssd: Any = None
        self._remote: Any = None
        self._remote_reported: dict[str, int] = {}  # the store client's failure counters as last reported
        # the data plane's mover: the lanes run in order; its own pool is not used here
        self.mover = TransferEngine(1, lanes=LANES)
        self._cpu_reported = 0.0  # the mover's task CPU time as last reported
        self._writers: dict[str, _Writer] = {}  # "ssd" / "remote": their lanes and queue bounds
        # takes half of each large DRAM copy (copy_threads - 1 threads; none at 1)
        self._copy_helper = (ThreadPoolExecutor(settings.copy_threads - 1, thread_name_prefix="kvtier-copy-helper")
                             if settings.copy_threads > 1 else None)
        self._lock = threading.Lock()
        self.reads = LoadReads(self.mover, self._copy_helper, settings.copy_threads, self._post_read)
        self.reads.deadline_s = settings.load_deadline_s
        self._results = _Results()
        self._gathers: dict[str, dict[int, Future[None]]] = {}  # req id -> store job id -> future
        self._written_back: KVTierConnectorMetadata | None = None  # the step whose write-backs were copied out
        self._loads: set[str] = set()  # req ids with a load in flight
        self._release: set[str] = set()
        self._load_errors: set[int] = set()
        self._meta: KVTierWorkerMetadata | None = None
        self.ring: StagingRing | None = None
        self._scattered: list[tuple[Any, Run]] = []  # (event, run): loads copied to the device, run still read
        self._approx: tuple[Rope, list[KeyRegion], torch.dtype] | None = None  # approximate_shifted_segments

    # ------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: Mapping[str, KVCache]) -> None:
        """Wrap the engine's caches and open the host tiers. Raises ``ValueError``
        when the caches' block size in bytes differs from the layout's."""
        io = BlockIO(kv_caches, self.num_blocks, side_stream=self.settings.side_stream and not self.fail_requests,
                     device_staging_bytes=self.settings.device_staging_bytes)
        # an MLA latent is one tensor per layer, as vLLM's fused caches are
        expected = "fused" if self.layout.arrangement == "mla" else self.layout.arrangement
        if io.bytes_per_block != self.layout.bytes_per_block or io.arrangement != expected:
            raise ValueError(
                f"kvtier: registered KV caches hold {io.bytes_per_block} bytes per block ({io.arrangement}), "
                f"but the engine's KV spec gives layout {self.layout.describe()} = {self.layout.bytes_per_block} "
                "bytes; this model's KV cache is not supported by the kvtier connector"
            )
        self.io = io
        if io.device.type == "cpu":
            log.info("kvtier: DRAM stores and loads %s", "move straight between the KV cache and the pool in one pass"
                     if io.straight else "go through torch's gather and the staging ring (the cache's tensors are not "
                     "contiguous, or kvtier's C module kvtier.tiers._rawread was not built)")
        if self.settings.approximate_rope is not None:
            self._approx = _approximate(io, self.layout, self.settings.approximate_rope)
        cfg = self.settings.config
        on_device = io.device.type != "cpu"
        self.ring = StagingRing(self.settings.staging_bytes, io.bytes_per_block,
                                pin=on_device and accelerator_device() is not None)
        if cfg.dram.enabled:
            pin = cfg.dram.pin_memory if isinstance(cfg.dram.pin_memory, bool) else True
            self._pool = TensorPool(cfg.dram.capacity_blocks, io.bytes_per_block, torch.device("cpu"), pin_memory=pin)
            self._pool_np = self._pool.data.numpy()
        if cfg.ssd.enabled:
            path = self.settings.rank_ssd_path(self.namespace.tp_rank, self.namespace.tp_size)
            assert path is not None
            self._ssd = ssdshare.acquire(path, self.namespace, self.layout, cfg)
            # SSD reads, deletes and promotions share the one LMDB thread with the writes
            self._writers["ssd"] = _Writer(self._ssd, "ssd", self.settings.ssd_write_queue_bytes)
        if self.settings.remote is not None:
            self._remote = remoteshare.acquire(self.settings.remote, self.namespace, self.layout)
            writer = _Writer(self._remote, "remote", self.settings.remote.write_queue_bytes)
            self._writers["remote"] = writer
            # raw values: remote reads land in the ring, and queued writes are sent from the arena,
            # with no copy through the store client's staging (a store that refuses either uses it)
            rows = writer.bound_bytes // io.bytes_per_block if self.settings.remote.codec == "raw" else 0
            if rows and self._remote.register_region(self.ring.buf.numpy()):
                arena = np.empty((rows, io.bytes_per_block), dtype=np.uint8)
                if self._remote.register_region(arena):
                    writer.arena, writer.free_rows = arena, list(range(rows))
        self.reads.bind(io, self._pool_np, self._ssd, self._remote)

    @property
    def ssd_queued_peak_bytes(self) -> int:
        """Most host bytes ever queued for the SSD writer (bounded by ``ssd_write_queue_mib``)."""
        writer = self._writers.get("ssd")
        return writer.peak_bytes if writer is not None else 0

    def shutdown(self) -> None:
        """Finish queued jobs, then close the SSD tier and leave the remote store."""
        self.mover.close()  # in LANES order: a lane's jobs hand on only to later lanes
        remote = self._writers.get("remote")
        if self._copy_helper is not None:
            self._copy_helper.shutdown(wait=True)
        if self._ssd is not None:
            ssdshare.release(self._ssd)
            self._ssd = None
        if self._remote is not None:
            if self.ring is not None:
                self._remote.unregister_region(self.ring.buf.numpy())
            if remote is not None and remote.arena is not None:
                self._remote.unregister_region(remote.arena)
            remoteshare.release(self._remote)
            self._remote = None

    # ------------------------------------------------------------ per step

    def start_load_kv(self, meta: KVTierConnectorMetadata) -> None:
        """Take releases and SSD deletions, then start this step's loads (async).
        vLLM 0.32 calls this *after* the forward when every load is asynchronous."""
        self._release.update(meta.release)
        if meta.write_backs and self._written_back is not meta:  # the engine never called handle_preemptions:
            for job in meta.write_backs:  # the slots are overwritten by now, so the write-backs fail (misses)
                self._fail_store(job, None)
            with self._lock:
                self._results.write_backs_missed += sum(len(j.block_ids) for j in meta.write_backs)
        if meta.ssd_deletes and self._ssd is not None and self.writes_shared:  # the writing rank deletes
            keys = [BlockKey(k) for k in meta.ssd_deletes]
            self.mover.submit_task("ssd", "ssd-delete", len(keys), 0, lambda: self._ssd.delete_many(keys), _nothing)
        nbytes = self.layout.bytes_per_block
        for pj in meta.promotions:
            self.mover.submit_task("ssd-read", "ssd->dram", len(pj.keys), len(pj.keys) * nbytes,
                                   lambda pj=pj: self._promote(pj),
                                   lambda pj=pj: self._post_plan(pj.plan_id, [False] * len(pj.keys)))
        for job in meta.loads:
            self._loads.add(job.req_id)
            if self._load_straight(job):
                continue
            if job.sync:  # (the scheduler plans one only for a DRAM hit on a CPU engine, which goes straight)
                log.warning("kvtier: a synchronous load of request %s cannot take the one-pass host copy here; "
                            "its %d blocks are recomputed", job.req_id, len(job.block_ids))
                with self._lock:
                    self._results.reads.append(_Read(job, None, [False] * len(job.keys), landed=True))
                continue
            self.reads.begin(job)  # until self.reads.post reports it; its deadline starts now
            run = self.ring.take(len(job.keys)) if self.ring is not None else None
            got = len(run) if run is not None else 0
            if got < len(job.keys):  # the ring is full: load what fits, the rest is recomputed
                with self._lock:
                    self._results.staging_skipped_loads += len(job.keys) - got
            if run is None:
                self.reads.post(job, None, [False] * len(job.keys))
                continue
            ssd = "ssd" in job.tiers[:got]  # remote reads: reads.read hands them on
            self.mover.submit_task("ssd-read" if ssd else "load", "ssd->hbm" if ssd else "dram->hbm", got, got * nbytes,
                                   lambda job=job, run=run: self.reads.read(job, run),
                                   lambda job=job, run=run: self.reads.post(job, run, [False] * len(job.keys)))

    def _straight(self) -> bool:
        """Whether DRAM blocks move straight between the engine's blocks and the pool's
        slots on the engine's thread: a CPU cache with the one-pass host copy."""
        return self.io is not None and self.io.straight and self._pool_np is not None

    def _split(self, num_blocks: int) -> bool:
        """Whether a copy of ``num_blocks`` is shared with a second thread (``copy_threads``)."""
        return self.settings.copy_threads > 1 and num_blocks * self.layout.bytes_per_block >= media.SPLIT_COPY_MIN_BYTES

    def _load_straight(self, job: LoadJob) -> bool:
        """A load wholly from DRAM on a CPU cache: scattered now, straight from the pool's slots
        (protected until the scheduler completes the load), one pass, no staging and no
        thread hand-off; its result is reported by the next ``get_finished``. ``False``:
        the load takes the staging path (another tier, approximate reuse, an accelerator)."""
        if not job.keys or not self._straight() or job.shifts or any(t != "dram" for t in job.tiers):
            return False
        n = len(job.keys)

        def scatter() -> list[bool]:
            self.io.scatter_rows(job.block_ids, self._pool_np, job.slots, self._split(n))  # type: ignore[union-attr]
            return [True] * n

        # the mover's failure handling, fault hook and link stats, on this thread: a failed copy is a miss
        oks = self.mover.run_inline("dram->hbm", n, n * self.layout.bytes_per_block, scatter)
        with self._lock:
            self._results.reads.append(_Read(job, None, oks, landed=True))
        return True

    def handle_preemptions(self, meta: KVTierConnectorMetadata) -> None:
        """First thing of every step, before vLLM zeroes, copies into or computes any
        block: finish reading preempted requests' blocks, and copy out this step's
        write-backs (exclusive DRAM: blocks whose slots the step reuses)."""
        for req_id in meta.preempted:
            for fut in list(self._gathers.get(req_id, {}).values()):
                fut.result()
        if meta.write_backs and self.io is not None:
            self._gather(meta.write_backs, before_forward=True)
            self._written_back = meta

    def wait_for_save(self, meta: KVTierConnectorMetadata) -> None:
        """Copy this step's stores out of the engine blocks (on the engine's
        stream) and queue their writes to DRAM and SSD (not waited for)."""
        if not meta.stores or self.io is None:
            return
        self._gather(meta.stores)

    def _gather(self, jobs: Sequence[StoreJob], before_forward: bool = False) -> None:
        """Copy the jobs' engine blocks into staging runs and queue their tier writes.
        ``before_forward``: the step's forward overwrites them, so it waits for the copy."""
        assert self.io is not None and self.ring is not None
        for job in jobs:
            if self._gather_straight(job):
                continue
            run = self.ring.take(len(job.block_ids))
            got = len(run) if run is not None else 0
            if got < len(job.block_ids):  # the ring is full: store what fits, never wait for room
                with self._lock:
                    self._results.staging_skipped_stores += len(job.block_ids) - got
            if run is None:
                self._fail_store(job, None)
                continue
            ready = self.io.copy_out(job.block_ids[:got], run.rows, engine_waits=before_forward)
            link = "hbm->dram" if any(w.tier == "dram" for w in job.writes) else "hbm->staging"
            fut = self.mover.submit_task("copy", link, got, got * run.rows.shape[1],
                                         lambda job=job, run=run, ready=ready: self._write(job, run, ready),
                                         lambda job=job, run=run: self._fail_store(job, run))
            self._gathers.setdefault(job.req_id, {})[job.job_id] = fut

    def _gather_straight(self, job: StoreJob) -> bool:
        """A store with a DRAM write on a CPU cache: the blocks gathered now, on the engine's
        thread, straight into the DRAM write's slots (reserved by the scheduler), one pass.
        Its SSD and remote writes then take their copies from those slots on the copy thread,
        and the DRAM write is reported after them, so the slots are not reused before.
        ``False``: the store takes the staging path (no DRAM write, a write of rows the DRAM
        write lacks, an accelerator)."""
        dram = next((w for w in job.writes if w.tier == "dram"), None)
        if dram is None or not self._straight():
            return False
        slot_of = dict(zip(dram.rows, dram.slots))
        others = [w for w in job.writes if w is not dram]
        if any(r not in slot_of for w in others for r in w.rows):
            return False
        ids = [job.block_ids[r] for r in dram.rows]

        def gather() -> list[bool]:
            self.io.gather_rows(ids, self._pool_np, dram.slots, self._split(len(ids)))  # type: ignore[union-attr]
            return [True] * len(ids)

        if not all(self.mover.run_inline("hbm->dram", len(ids), len(ids) * self.layout.bytes_per_block, gather)):
            self._fail_store(job, None)  # a failed copy is a miss, never a crash
            return True
        self._post_gathered(job)  # the engine blocks are no longer read
        if not others:
            self._post_plan(dram.plan_id, [True] * len(dram.rows))
            return True
        rows = [slot_of.get(r, 0) for r in range(len(job.block_ids))]  # a job row -> its pool slot

        def write_others() -> None:
            self._write_tiers(job, self._pool_np, others, rows)
            self._post_plan(dram.plan_id, [True] * len(dram.rows))

        def fail() -> None:
            for w in job.writes:
                self._post_plan(w.plan_id, [False] * len(w.rows))

        self.mover.submit_task("copy", "dram->slow", len(ids), 0, write_others, fail)
        return True

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(released requests whose blocks are no longer read, requests whose load finished).
        Scatters finished loads into the engine blocks first (engine thread)."""
        if self.settings.lockstep_transfers:
            self._drain()
        self._reclaim_scattered()
        with self._lock:
            res, self._results = self._results, _Results()
        meta = KVTierWorkerMetadata()
        meta.plans = {pid: (1, oks) for pid, oks in res.plans.items()}
        for job_id, req_id in res.gathered:
            meta.gathered[job_id] = 1
            jobs = self._gathers.get(req_id)
            if jobs is not None:
                jobs.pop(job_id, None)
                if not jobs:
                    del self._gathers[req_id]
        recving = {self._land_read(read, meta) for read in res.reads if not read.job.sync}
        for read in res.reads:  # synchronous: in place before the forward; vLLM runs the request already
            if read.job.sync:
                self._land_read(read, meta)
        for job in self.reads.expire_due():  # past load_deadline_s: failed now (recomputed), never waited for
            meta.expired_plans.append(job.plan_id)
            recving.add(self._report_load(job, [False] * len(job.keys), 0, meta))
        recving.discard(None)  # (reads of loads that expired earlier)
        sending = {r for r in self._release if r not in self._gathers and r not in self._loads}
        self._release -= sending
        cpu_s = self.mover.cpu_s  # the background jobs' CPU time since the last report
        meta.busy_us = res.busy_us + int((cpu_s - self._cpu_reported) * 1e6)
        self._cpu_reported = cpu_s
        meta.skipped_blocks = res.skipped_blocks
        meta.remote_skipped_blocks = res.remote_skipped_blocks
        meta.remote_outcomes = self._remote_outcomes()
        meta.staging_skipped_stores = res.staging_skipped_stores
        meta.write_backs_missed = res.write_backs_missed
        meta.staging_skipped_loads = res.staging_skipped_loads
        self._meta = meta if meta.reports_anything() else None
        return sending, recving

    def _land_read(self, read: _Read, meta: KVTierWorkerMetadata) -> str | None:
        """A finished read: its verified leading run scattered into the engine blocks (keys
        re-rotated first for approximate reuse), the staging run given back, the per-block
        outcome reported and the rest of the load failed or marked for recomputation.
        Returns the request, whose load is done (``None``: the load expired and was reported before)."""
        job = read.job
        if not self.reads.finish(job):  # expired and reported failed earlier: only its staging run is left
            if read.run is not None:
                self.ring.give_back(read.run)  # type: ignore[union-attr]
            return None
        num_ok = read.oks.index(False) if False in read.oks else len(read.oks)
        done = None
        if num_ok and self.io is not None and read.run is not None and not read.landed:
            try:
                if job.shifts and self._approx is not None:  # approximate reuse: keys turned to this offset
                    rope, regions, dtype = self._approx
                    rerotate_rows(read.run.rows, job.shifts[:num_ok], regions, rope, dtype)
                done = self.io.scatter(job.block_ids[:num_ok], read.run.rows[:num_ok])
            except (RuntimeError, ValueError) as exc:  # a failed copy is a miss, never a crash
                log.warning("kvtier: load into engine blocks failed: %s", exc)
                num_ok, read.oks = 0, [False] * len(read.oks)
        if read.run is not None:
            if done is None:
                self.ring.give_back(read.run)  # type: ignore[union-attr]
            else:  # the device copy may still read the run: give it back once the event passed
                self._scattered.append((done, read.run))
        return self._report_load(job, read.oks, num_ok, meta)

    def _report_load(self, job: LoadJob, oks: list[bool], num_ok: int, meta: KVTierWorkerMetadata) -> str:
        """Report a load: per block, whether the tier returned verified bytes, and the engine
        blocks from ``num_ok`` on failed (recomputed). Returns its request."""
        if job.plan_id:
            meta.plans[job.plan_id] = (1, oks)
        if num_ok < len(job.block_ids) and self.fail_requests and not job.sync:
            self._failed_loads.add(job.req_id)
        elif num_ok < len(job.block_ids):
            self._load_errors.update(job.block_ids[num_ok:])
        self._loads.discard(job.req_id)
        return job.req_id

    def _drain(self) -> None:
        """``lockstep_transfers``: wait until every transfer queued so far has finished. Each
        lane runs in order, so a no-op queued behind its work returns once that work is done;
        twice over, for a job one lane hands on to another (a store's copy, then its SSD or
        remote write; a DRAM or SSD read, then the remote tier's part); then the copy helper,
        which lands SSD loads."""
        for _ in range(2):
            self.mover.drain()
        if self._copy_helper is not None:  # loads the helper is still scattering, and reports
            self._copy_helper.submit(int).result()

    REMOTE_COUNTERS = ("missing", "remote_errors", "checksum_failures", "decode_failures", "mismatches",
                       "key_mismatches", "removed_corrupt", "put_pinned_blocks", "put_direct_blocks",
                       "put_staged_blocks", "get_direct_blocks", "put_no_space_blocks", "client_down",
                       "client_down_skips", "client_up_again")

    def _remote_outcomes(self) -> dict[str, int]:
        """This rank's store client since the last report: failed reads by outcome, errors, soft-pinned puts."""
        if self._remote is None:
            return {}
        now = {k: self._remote.counters[k] for k in self.REMOTE_COUNTERS}  # a snapshot (another thread counts)
        out = {k: v - self._remote_reported.get(k, 0) for k, v in now.items() if v != self._remote_reported.get(k, 0)}
        self._remote_reported = now
        return out

    def _reclaim_scattered(self) -> None:
        """Give back the staging runs of loads whose copy to the device has finished."""
        if not self._scattered:
            return
        still = []
        for event, run in self._scattered:
            if event.query():
                self.ring.give_back(run)  # type: ignore[union-attr]
            else:
                still.append((event, run))
        self._scattered = still

    def add_hook_cpu_us(self, used_us: int) -> None:
        """Engine-thread CPU time spent in the connector's worker hooks (reported with the transfers)."""
        with self._lock:
            self._results.busy_us += used_us

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_loads(self) -> set[str]:
        """Requests whose load failed since the last call (hybrid models only)."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def take_worker_meta(self) -> KVTierWorkerMetadata | None:
        meta, self._meta = self._meta, None
        return meta

    # ------------------------------------------------------------ background jobs (host bytes only)

    def _write(self, job: StoreJob, run: Run, ready: Any) -> None:
        """Copy thread: once the gather into ``run`` is done, write its rows to the tiers, then give it back."""
        try:
            if ready is not None:
                ready.synchronize()
            self._post_gathered(job)  # the engine blocks are no longer read
            host = run.rows.numpy()
            self._write_tiers(job, host, job.writes, range(len(host)))
        finally:
            self.ring.give_back(run)  # type: ignore[union-attr]  # the SSD writes hold their own copies

    def _write_tiers(self, job: StoreJob, host: np.ndarray, writes: Sequence[TierWrite],
                     row_of: Sequence[int]) -> None:
        """Write the job's gathered blocks to each tier of ``writes``: block ``i`` of the job is
        ``host[row_of[i]]`` (a staging run, or the DRAM pool's rows); blocks past
        ``len(row_of)`` were not gathered and are reported failed."""
        got = len(row_of)
        for w in writes:
            pos = [i for i, r in enumerate(w.rows) if r < got]
            if w.tier == "dram":
                assert self._pool_np is not None
                media.staging_to_pool(self._pool_np, [w.slots[i] for i in pos], host,
                                      [row_of[w.rows[i]] for i in pos], self._copy_helper, self.settings.copy_threads)
                self._post_plan(w.plan_id, [r < got for r in w.rows])
                continue
            if not self.writes_shared:  # rank 0 writes this shared tier; this rank's report must not veto it
                self._post_plan(w.plan_id, [True] * len(w.rows))
                continue
            writer = self._writers.get(w.tier)
            if writer is None:  # a tier this rank does not have: nothing stored
                self._post_plan(w.plan_id, [False] * len(w.rows))
                continue
            nbytes = len(pos) * host.shape[1]
            with self._lock:
                room = writer.queued_bytes + nbytes <= writer.bound_bytes
                if room:
                    writer.queued_bytes += nbytes
                    writer.peak_bytes = max(writer.peak_bytes, writer.queued_bytes)
                elif w.tier == "ssd":
                    self._results.skipped_blocks += len(pos)
                else:
                    self._results.remote_skipped_blocks += len(pos)
            if not room:  # the tier is behind: skip (a later miss), never queue without limit
                self._post_plan(w.plan_id, [False] * len(w.rows))
                continue
            src_rows = [row_of[w.rows[i]] for i in pos]
            arena_rows: list[int] = []
            if writer.arena is not None:  # the arena holds bound_bytes of rows: the room above is rows free
                with self._lock:
                    arena_rows = writer.take_rows(len(pos))  # never short, by the bound; a plain copy if ever
            if arena_rows:
                try:
                    media.copy_rows(writer.arena, arena_rows, host, src_rows)
                except BaseException:
                    with self._lock:
                        writer.give_rows(arena_rows)
                        writer.queued_bytes -= nbytes
                    raise
                own = writer.arena
            else:
                own, arena_rows = host[src_rows], list(range(len(pos)))  # its own copy: the staging run can go
            items = [(BlockKey(job.keys[w.rows[i]]), own[r], _key(job.parents[w.rows[i]]))
                     for i, r in zip(pos, arena_rows)]
            held = arena_rows if own is writer.arena else []
            self.mover.submit_task(
                writer.lane, f"hbm->{w.tier}", len(pos), nbytes,
                lambda w=w, wr=writer, items=items, pos=pos, n=nbytes, held=held: self._write_slow(
                    wr, w, items, pos, n, held),
                lambda w=w: self._post_plan(w.plan_id, [False] * len(w.rows)))

    def _write_slow(self, writer: _Writer, w: TierWrite, items: Sequence[tuple[BlockKey, Any, BlockKey | None]],
                    pos: Sequence[int], nbytes: int, arena_rows: Sequence[int] = ()) -> None:
        """SSD or remote thread: write ``items`` (rows ``pos`` of ``w``; in ``arena_rows`` of the
        writer's arena, if any); the plan reports the leading run written."""
        self.reads.yield_to_loads()  # loads first: wait (a little) for the loads reading now
        try:  # the queued bytes (and arena rows) are given back however the write ends (an error fails the plan)
            written = media.staging_to_slow(writer.tier, items, w.codec, w.pin_ttl_s,
                                            self.reads.yield_to_loads if w.tier == "ssd" else None)
        finally:
            with self._lock:
                writer.queued_bytes -= nbytes
                writer.give_rows(arena_rows)
        oks = [False] * len(w.rows)
        for j, ok in zip(pos, written):
            oks[j] = ok
        self._post_plan(w.plan_id, oks)

    def _fail_store(self, job: StoreJob, run: Run | None) -> None:
        self._post_gathered(job)
        for w in job.writes:
            self._post_plan(w.plan_id, [False] * len(w.rows))
        if run is not None:
            self.ring.give_back(run)  # type: ignore[union-attr]

    def _promote(self, job: PromoteJob) -> None:
        """SSD -> DRAM (a prefetch): read verified values straight into the reserved slots."""
        if self._ssd is None or self._pool is None:
            self._post_plan(job.plan_id, [False] * len(job.keys))
            return
        # the scheduler notes copies decoded from lossy values (lossy None here)
        oks = media.ssd_to_pool(self._ssd, [BlockKey(k) for k in job.keys], self._pool, job.slots, None)()
        self._post_plan(job.plan_id, list(map(bool, oks)))

    def _post_read(self, job: LoadJob, run: Run | None, oks: list[bool], landed: bool = False) -> None:
        """A load read (or failed), for the next ``get_finished`` (any thread; through ``self.reads.post``)."""
        with self._lock:
            self._results.reads.append(_Read(job, run, oks, landed))

    def _post_plan(self, plan_id: int, oks: Sequence[bool]) -> None:
        with self._lock:
            self._results.plans[plan_id] = list(oks)

    def _post_gathered(self, job: StoreJob) -> None:
        with self._lock:
            self._results.gathered.append((job.job_id, job.req_id))


def _approximate(io: BlockIO, layout: KVLayout, rope: tuple[float, int]) -> tuple[Rope, list[KeyRegion], torch.dtype]:
    """What re-rotating a loaded block's keys needs; ``ValueError`` (naming the
    setting) for a cache whose keys it cannot place."""
    parts = io.parts
    dtype = parts[0].tensor.dtype
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"kvtier: approximate_shifted_segments turns float keys only; this KV cache holds {dtype} "
                         "(a quantized kv_cache_dtype)")
    if io.device.type == "cpu" and io.arrangement == "fused":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, layout.block_size, layout.head_dim)
        if isa != "vec":
            raise ValueError(f"kvtier: approximate_shifted_segments knows the key layout of vLLM's CPU 'vec' "
                             f"attention kernels only; this CPU, block size and model use '{isa}', which lays keys "
                             "out otherwise")
    regions = key_regions(parts, layout.num_kv_heads, layout.head_dim, layout.block_size)
    return Rope(rope[0], rope[1], layout.head_dim), regions, dtype


def _key(raw: int | None) -> BlockKey | None:
    return None if raw is None else BlockKey(raw)


def _nothing() -> None:
    """``fail`` of a task no plan waits for (an SSD delete; the mover logs and counts its failure)."""
