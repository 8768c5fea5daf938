"""The real mover: an asynchronous transfer engine over worker threads.

Owns: running transfer jobs (copies between caller buffers, tensor pools,
staging rows and the SSD and remote tiers) off the caller's thread, each on
its own device stream where an accelerator exists, and reporting completion
with a per-block ``ok`` list. Besides its pool of threads it runs named
*lanes*, one thread each, whose jobs run in submission order (a tier written
in order; the vLLM connector's ``copy``, ``ssd`` and ``remote``), and *tasks*
(:meth:`TransferEngine.submit_task`): jobs that post their own results and
name what to do when they fail. Both callers of the data plane,
:class:`~kvtier.store.TieredStore` and the connector's worker, run every
background copy here, so both get the same failure handling, fault hook
and link statistics.
A job that raises completes with every block ``ok=False`` and is counted; its
blocks never become readable. A job with a ``deadline`` that finishes after
it also completes with every block ``ok=False`` (counted as timed out): late
bytes are discarded, never published. Per link it keeps job, block and byte
counts and a fixed-bucket latency histogram (submission to completion) for
Prometheus. ``fault_hook`` lets fault tests inject slow or failing I/O into
every job (it runs on the worker thread before the copy). Must not decide
anything: it runs what it is given, in submission order per worker.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

log = logging.getLogger(__name__)

JobFn = Callable[[], Sequence[bool]]
"""The work of a job: copy bytes, return one ``ok`` per block."""

LATENCY_BUCKETS_S: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                        2.5, 5.0, 10.0)
"""Upper bounds of the per-link latency histogram (plus an implicit +Inf bucket)."""


@dataclass(slots=True)
class TransferJob:
    """One unit of transfer work. ``link`` names the path (e.g. ``dram->ssd``) for stats;
    ``on_done(oks)`` is called from the worker thread when the copy finished.
    ``deadline`` (a ``time.perf_counter()`` value): finishing later makes every
    block ``ok=False`` (the job timed out)."""

    link: str
    num_blocks: int
    num_bytes: int
    run: JobFn
    on_done: Callable[[Sequence[bool]], None]
    submitted_at: float = field(default_factory=time.perf_counter)
    deadline: float | None = None


@dataclass(slots=True)
class LinkStats:
    """Counters of one link. ``latency_buckets[i]``: jobs that took at most
    ``LATENCY_BUCKETS_S[i]`` (not cumulative; the last entry is +Inf)."""

    jobs: int = 0
    blocks: int = 0
    bytes: int = 0
    failed_blocks: int = 0
    timed_out_blocks: int = 0
    busy_s: float = 0.0
    latency_sum_s: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))


class TransferEngine:
    """Worker threads executing :class:`TransferJob` s. ``submit`` returns a
    future resolving to the job's ``ok`` list after ``on_done`` ran."""

    def __init__(self, num_threads: int = 2, device: torch.device | None = None, lanes: Sequence[str] = ()) -> None:
        if num_threads < 1:
            raise ValueError(f"mover_threads={num_threads!r}: must be >= 1")
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="kvtier-mover")
        self._lanes = {name: ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{name}") for name in lanes}
        self.cpu_s = 0.0  # thread CPU time of every task run (the connector reports it per step)
        self._device = device
        self._streams = device is not None and device.type == "cuda"
        self._local = threading.local()
        self._lock = threading.Lock()
        self.links: dict[str, LinkStats] = {}
        self.failed_jobs = 0
        self.timed_out_jobs = 0
        self.fault_hook: Callable[[TransferJob], None] | None = None
        """Called with each job on its worker thread before the copy (fault tests:
        sleep to slow the I/O down, raise ``OSError`` to fail it)."""

    def submit(self, job: TransferJob) -> Future[Sequence[bool]]:
        return self._pool.submit(self._execute, job)

    def submit_task(self, lane: str, link: str, num_blocks: int, num_bytes: int, run: Callable[[], None],
                    fail: Callable[[], None]) -> Future[None]:
        """Run ``run`` on ``lane``, after the lane's earlier jobs: a job that posts its own
        results. The fault hook sees it first (as a :class:`TransferJob` on ``link``). An I/O or
        copy error, or a bug, calls ``fail`` instead of losing the job (its caller would wait
        for it forever), is logged and counted, and fails its blocks in the link's stats."""
        job = TransferJob(link, num_blocks, num_bytes, _no_oks, _ignore_oks)
        return self._lanes[lane].submit(self._task, job, run, fail)

    def drain(self, lanes: Sequence[str] | None = None) -> None:
        """Wait until every job queued so far on ``lanes`` (default all) has run."""
        for name in (self._lanes if lanes is None else lanes):
            self._lanes[name].submit(int).result()

    def run_sync(self, job: TransferJob) -> Sequence[bool]:
        """Execute ``job`` on the caller's thread (small transfers, tests)."""
        return self._execute(job)

    def run_inline(self, link: str, num_blocks: int, num_bytes: int, run: JobFn) -> list[bool]:
        """Run ``run`` on the caller's thread as a job on ``link`` and return its
        ``ok`` list: the same failure handling and link stats as :meth:`run_sync`,
        without building a :class:`TransferJob` (a synchronous put does this once
        per call); the caller completes its plan itself. With a ``fault_hook``
        set, a job is built to hand to it."""
        if self.fault_hook is not None:
            return list(self._execute(TransferJob(link, num_blocks, num_bytes, run, _ignore_oks)))
        start = time.perf_counter()
        return self._account(link, num_blocks, num_bytes, self._run(link, num_blocks, run, None), start, start, None)

    def close(self) -> None:
        """Finish every queued job (lanes in their order), then stop the threads."""
        self._pool.shutdown(wait=True)
        for lane in self._lanes.values():
            lane.shutdown(wait=True)

    def _task(self, job: TransferJob, run: Callable[[], None], fail: Callable[[], None]) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        ok = False
        try:
            hook = self.fault_hook
            if hook is not None:
                hook(job)
            run()
            ok = True
        except (OSError, RuntimeError, ValueError) as exc:  # a failed transfer is a miss, never a crash
            log.warning("kvtier transfer on %s failed: %s", job.link, exc)
        except Exception:  # a bug: still fail the blocks, or their plan would wait forever
            log.exception("kvtier transfer on %s failed unexpectedly", job.link)
        finally:
            with self._lock:
                self.cpu_s += time.thread_time() - cpu
                if not ok:
                    self.failed_jobs += 1
        if not ok:
            fail()
        self._account(job.link, job.num_blocks, job.num_bytes, [ok] * job.num_blocks, start, job.submitted_at, None)

    def _execute(self, job: TransferJob) -> list[bool]:
        start = time.perf_counter()
        oks = self._run(job.link, job.num_blocks, job.run, job)
        oks = self._account(job.link, job.num_blocks, job.num_bytes, oks, start, job.submitted_at, job.deadline)
        job.on_done(oks)
        return oks

    def _run(self, link: str, num_blocks: int, run: JobFn, job: TransferJob | None) -> list[bool]:
        """Call the fault hook (with ``job``) and ``run``; a failure fails every block."""
        try:
            hook = self.fault_hook
            if hook is not None:
                hook(job)
            if self._streams:
                with self._stream_context():
                    return list(run())
            return list(run())  # host copies: no stream to enter (once per job of every put and get)
        except (OSError, RuntimeError, ValueError) as exc:  # a failed copy is a miss, never a crash
            log.warning("kvtier transfer on %s failed: %s", link, exc)
        except Exception:  # a bug: still fail the blocks (on_done runs), or their plan would wait forever
            log.exception("kvtier transfer on %s failed unexpectedly", link)
        with self._lock:
            self.failed_jobs += 1
        return [False] * num_blocks

    def _account(
        self, link: str, num_blocks: int, num_bytes: int, oks: list[bool], start: float, submitted_at: float,
        deadline: float | None,
    ) -> list[bool]:
        """Count a finished job in its link's stats; past ``deadline`` every block fails."""
        end = time.perf_counter()
        timed_out = deadline is not None and end > deadline
        if timed_out:
            log.debug("kvtier transfer on %s finished %.3f s past its deadline; discarded", link, end - deadline)
            oks = [False] * num_blocks
        latency = end - submitted_at
        with self._lock:
            st = self.links.get(link)
            if st is None:
                st = self.links[link] = LinkStats()
            st.jobs += 1
            st.blocks += num_blocks
            st.bytes += num_bytes
            st.failed_blocks += oks.count(False)
            st.busy_s += end - start
            st.latency_sum_s += latency
            st.latency_buckets[bisect.bisect_left(LATENCY_BUCKETS_S, latency)] += 1
            if timed_out:
                self.timed_out_jobs += 1
                st.timed_out_blocks += num_blocks
        return oks

    def _stream_context(self):
        dev = self._device
        if dev is not None and dev.type == "cuda":
            stream = getattr(self._local, "stream", None)
            if stream is None:
                stream = self._local.stream = torch.cuda.Stream(dev)
            return torch.cuda.stream(stream)
        return _NULL_CONTEXT


def _no_oks() -> Sequence[bool]:
    """``run`` of a task's job: a task posts its own results."""
    return ()


def _ignore_oks(oks: Sequence[bool]) -> None:
    """``on_done`` of a job whose caller completes its plan itself."""


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_CONTEXT = _NullContext()
