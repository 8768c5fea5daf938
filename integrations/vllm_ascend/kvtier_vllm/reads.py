"""The worker's reads for loads: host tiers into staging, and landing into a CPU cache.

Owns: reading a load's blocks from the DRAM pool's slots, the SSD tier and the
remote tier into a run of the staging ring (verified; a block that fails fails
every block after it), landing them in the engine's blocks chunk by chunk on a
CPU cache with the one-pass host copy, raw SSD values straight from the tier's
map with no staging row between (:meth:`LoadReads.read`), and the count
of loads reading, which the slow tiers' writers yield to (loads first: a
user's TTFT waits on a load, only a later request on a write). Runs on the
worker's ``load``, ``ssd-read`` and ``remote-read`` lanes and its copy helper; reports each
load exactly once through ``post``. Must not decide what loads, take or give
back staging rows, touch torch (the scatter is kvtier's C copy), or write the
tiers.

Deadlines (``load_deadline_s``). Each load read here has a :class:`LoadGate`:
the threads hold it around every write into the engine's blocks, and the
engine's thread expires it, without waiting, once the load is past its
deadline (:meth:`LoadReads.expire_due`); from then on nothing of that load
writes the engine's blocks, so the worker reports it failed at once and vLLM
recomputes it, while the late read runs out into its staging run. A copy
already under way when the deadline passes finishes first (it cannot be
abandoned halfway through a block): a raw SSD value copied straight from the
tier's map, or a chunk being scattered; and a load whose last copy has finished
is reported loaded, not expired in the moment before its report. Reads into staging (the remote tier,
compressed values, every load on an accelerator) never hold the gate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvtier.keys import BlockKey
from kvtier.transfer import media
from kvtier.transfer.mover import TransferEngine

from .blockio import BlockIO
from .metadata import LoadJob
from .staging import Run

log = logging.getLogger(__name__)

Post = Callable[[LoadJob, "Run | None", list[bool], bool], None]
"""Where a finished read goes: (job, its staging run or ``None``, ok per key, landed)."""


class LoadGate:
    """Whether a load may still write the engine's blocks: entered by the load's threads around
    each write (several at once: the load thread's straight copies and the helper's scatters
    overlap), expired by the engine's thread, which never waits for a write."""

    __slots__ = ("_lock", "_writing", "_landed", "expired")

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held for a counter's change only, never across a copy
        self._writing = 0
        self._landed = False  # the load's last write finished: it is reported loaded, never expired
        self.expired = False

    @contextmanager
    def writing(self) -> Iterator[bool]:
        """Around a write into the engine's blocks; yields False once expired (write nothing)."""
        with self._lock:
            live = not self.expired
            self._writing += live
        try:
            yield live
        finally:
            if live:
                with self._lock:
                    self._writing -= 1

    def landed(self) -> None:
        """Inside :meth:`writing`, once the write of the load's last block has finished: the load is
        not expired from then on (earlier chunks still being scattered on the copy helper hold the
        gate anyway, and :meth:`LoadReads.read` reports the load once every write is done)."""
        with self._lock:
            self._landed = True

    def try_expire(self) -> bool:
        """Expire unless a write is under way (then ``False``: try again on a later step) or
        the last one has finished (the load is about to be reported loaded)."""
        with self._lock:
            if self._writing or self._landed:
                return False
            self.expired = True
            return True


NO_DEADLINE = LoadGate()
"""The gate of every load without a deadline (``load_deadline_s`` 0, or not read here): never expired."""


class LoadReads:
    """A worker's load reads; :meth:`bind` gives it the tiers once the caches are registered."""

    def __init__(self, mover: TransferEngine, helper: ThreadPoolExecutor | None, copy_threads: int,
                 post: Post) -> None:
        self.mover = mover
        self.helper = helper
        self.copy_threads = copy_threads
        self._post = post
        self.io: BlockIO | None = None
        self.pool_np: np.ndarray | None = None
        self.ssd: Any = None
        self.remote: Any = None
        # a slow tier's write waits at most this long for the loads reading when it starts, and an SSD write
        # as long again between its groups (the writer's queue stays bounded: stores that find it full are
        # skipped and counted)
        self.write_yield_s = 0.05
        self.land_chunk_bytes = 4 << 20  # a straight load's read and scatter overlap in chunks of this size
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)
        self.reading = 0  # loads begun and not yet posted
        self.deadline_s = 0.0  # load_deadline_s (0: none)
        # id(job) -> (deadline, gate, job): loads read here and not yet finished (engine thread only)
        self._gates: dict[int, tuple[float, LoadGate, LoadJob]] = {}

    def bind(self, io: BlockIO, pool_np: np.ndarray | None, ssd: Any, remote: Any) -> None:
        self.io, self.pool_np, self.ssd, self.remote = io, pool_np, ssd, remote

    def begin(self, job: LoadJob | None = None) -> None:
        """A load is about to be read (or failed): counted until :meth:`post` reports it, and
        (engine thread) given its gate and deadline when it has one."""
        with self._lock:
            self.reading += 1
        if job is not None and self.deadline_s > 0:
            self._gates[id(job)] = (time.monotonic() + self.deadline_s, LoadGate(), job)

    def expire_due(self) -> list[LoadJob]:
        """Engine thread, each step: expire the loads past their deadline whose threads are not
        writing the engine's blocks; returns them (the caller reports them failed now)."""
        if not self._gates:
            return []
        now = time.monotonic()
        out = []
        for deadline, gate, job in list(self._gates.values()):
            if now >= deadline and not gate.expired and gate.try_expire():
                out.append(job)
        return out

    def finish(self, job: LoadJob) -> bool:
        """Engine thread, for a read posted: ``False`` when the load expired earlier (it was
        reported then: only its staging run is left to give back)."""
        entry = self._gates.pop(id(job), None)
        return entry is None or not entry[1].expired

    def _gate(self, job: LoadJob) -> LoadGate:
        """The load's gate; one that never expires for a load without a deadline."""
        entry = self._gates.get(id(job))
        return NO_DEADLINE if entry is None else entry[1]

    def post(self, job: LoadJob, run: Run | None, oks: list[bool], landed: bool = False) -> None:
        """Report a begun load (once), and wake the writers waiting for loads to finish."""
        self._post(job, run, oks, landed)
        with self._lock:
            self.reading -= 1
            if self.reading <= 0:
                self._quiet.notify_all()

    def yield_to_loads(self) -> None:
        """A slow tier's writer, before a write (and the SSD tier's between the groups of one): wait
        (at most ``write_yield_s``) for the loads reading now."""
        with self._lock:
            self._quiet.wait_for(lambda: self.reading <= 0, timeout=self.write_yield_s)

    def read(self, job: LoadJob, run: Run) -> None:
        """Copy or SSD thread: read the first ``len(run)`` blocks of the load into ``run``;
        blocks from the remote tier (the tail of the load) are read next on the remote thread."""
        host = run.rows.numpy()
        remote = [i for i, t in enumerate(job.tiers[:len(host)]) if t == "remote"]
        if not remote and not job.shifts and self.io is not None and self.io.straight:
            self._read_and_land(job, run)
            return
        oks = self.read_tiers(job, host)
        if not remote or self.remote is None or not all(oks[:remote[0]]):  # a failed block fails all after it
            self.post(job, run, oks)
            return
        self.mover.submit_task("remote-read", "remote->hbm", len(remote), len(remote) * host.shape[1],
                               lambda: self._read_remote(job, run, oks, remote),
                               lambda: self.post(job, run, [False] * len(job.keys)))

    def _read_and_land(self, job: LoadJob, run: Run) -> None:
        """Load thread, a CPU cache with the one-pass host copy: read the load's DRAM and SSD
        blocks into ``run`` a chunk at a time and scatter each verified chunk into the engine's
        blocks (the request's, untouched by any forward until its load is reported) while the
        next chunk is read (a run of raw SSD values lands straight from the tier's map instead,
        :meth:`_land_ssd`): on the copy helper's thread where there is one, so reading and
        scattering overlap instead of adding up, also across loads (the helper reports the load
        after its last scatter, and this thread goes on to the next load). The scatter is
        kvtier's C copy, not torch, so no OpenMP team starts beside the forward. A block that
        fails stops the load there (the blocks after it are reported failed and recomputed)."""
        assert self.io is not None
        host = run.rows.numpy()
        got = len(host)
        oks = [False] * len(job.keys)
        chunk = max(1, self.land_chunk_bytes // host.shape[1])
        helper = self.helper
        scattered: list[int] = [got]  # the first block whose scatter failed (got: none)
        futures: list[Future[None]] = []

        gate = self._gate(job)

        def scatter(lo: int, k: int) -> None:
            with gate.writing() as live:
                if not live:  # past its deadline: reported failed already
                    return
                try:
                    self.io.scatter_rows(job.block_ids[lo:k], host, range(lo, k), False)  # type: ignore[union-attr]
                except (RuntimeError, ValueError) as exc:  # a failed copy is a miss, never a crash
                    log.warning("kvtier: load into engine blocks failed: %s", exc)
                    scattered[0] = min(scattered[0], lo)
                    return
                if k == got:
                    gate.landed()

        def land() -> None:
            wait(futures)  # a helper of several threads may still scatter: the load is reported after every write
            for i in range(scattered[0], got):
                oks[i] = False
            self.post(job, run, oks, landed=True)

        try:
            for start in range(0, got, chunk):
                if gate.expired:  # reported failed: read no further
                    break
                hi = min(got, start + chunk)
                lo = self._land_ssd(job, start, hi, hi == got)
                oks[start:lo] = [True] * (lo - start)
                if lo == hi:
                    continue
                part = self.read_tiers(job, host, lo, hi)
                oks[lo:hi] = part[lo:hi]
                k = next((i for i in range(lo, hi) if not part[i]), hi)
                if k > lo and helper is not None:
                    futures.append(helper.submit(scatter, lo, k))
                elif k > lo:
                    scatter(lo, k)
                if k < hi:
                    break
        except BaseException:
            for f in futures:  # nothing may still write the engine's blocks once the load is reported failed
                f.result()
            raise
        if helper is None:
            land()
            return
        try:
            helper.submit(land)  # after the scatters (it waits for them: the helper may have several threads)
        except RuntimeError:  # the helper is shutting down: wait here
            for f in futures:
                f.result()
            land()

    def _land_ssd(self, job: LoadJob, lo: int, hi: int, last: bool = False) -> int:
        """Load thread: the load's leading run of SSD blocks from ``lo`` (up to ``hi``), each
        verified in the SSD tier's map and then copied straight into the engine's blocks (one
        copy: no staging row between). Returns where that stopped: the first block not landed
        (a DRAM block, or an SSD one that is compressed, absent or fails a check; nothing of it
        was written), which the caller reads through staging and the general decoder (which
        says why). ``lo``: none. ``last``: ``hi`` is the load's end (landing all of it lands the load)."""
        assert self.io is not None
        end = next((i for i in range(lo, hi) if job.tiers[i] != "ssd"), hi)
        landing = self.io.landing(job.block_ids[lo:end]) if end > lo and self.ssd is not None else None
        if landing is None:
            return lo
        gate = self._gate(job)
        with gate.writing() as live:
            if not live:  # past its deadline: nothing more lands
                return lo
            try:
                landed = self.ssd.scatter_many([BlockKey(k) for k in job.keys[lo:end]], *landing)
            except (RuntimeError, ValueError) as exc:  # a failed copy is a miss, never a crash
                log.warning("kvtier: SSD load into engine blocks failed: %s", exc)
                return lo
            if last and lo + landed == hi:
                gate.landed()
        return lo + max(landed, 0)

    def _read_remote(self, job: LoadJob, run: Run, oks: list[bool], rows: Sequence[int]) -> None:
        """Remote thread: read and verify the load's remote blocks ``rows`` into ``run``."""
        got = media.slow_to_staging(self.remote, [BlockKey(job.keys[i]) for i in rows], run.rows.numpy(), rows)
        for i, ok in zip(rows, got):
            oks[i] = bool(ok)
        self.post(job, run, oks)

    def read_tiers(self, job: LoadJob, host: np.ndarray, lo: int = 0, hi: int | None = None) -> list[bool]:
        """Read the load's blocks ``lo:hi`` (default: its first ``len(host)``) into the same rows
        of ``host``; one ok per key of the job."""
        got = len(host) if hi is None else hi
        oks = [False] * len(job.keys)
        dram = [i for i in range(lo, got) if job.tiers[i] == "dram"]
        ssd = [i for i in range(lo, got) if job.tiers[i] == "ssd"]
        if dram and self.pool_np is not None:
            got_dram = media.pool_to_staging(self.pool_np, [job.slots[i] for i in dram], host, dram,
                                             self.helper, self.copy_threads)
            for i, ok in zip(dram, got_dram):
                oks[i] = ok
        if ssd and self.ssd is not None:
            got_ssd = media.slow_to_staging(self.ssd, [BlockKey(job.keys[i]) for i in ssd], host, ssd)
            for i, ok in zip(ssd, got_ssd):
                oks[i] = ok
        return oks
