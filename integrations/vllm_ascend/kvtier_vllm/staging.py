"""The connector's host staging: one fixed buffer for every block in flight between
the engine's KV cache and the tiers.

Owns: a ring of ``staging_mib`` of host memory (pinned when an accelerator is
present, so device copies into and out of it can run without blocking), cut
into rows of one block each and handed out as runs of adjacent rows. A store
job's blocks are gathered into a run on the engine's thread and written to
the tiers from it by the copy thread; a load's blocks are read into a run by
the tier threads and scattered from it on the engine's thread. A run is given
back once its last user is done; space is reused oldest first, so a run given
back early waits for the older ones (the copy thread finishes jobs in order,
so this costs little). Runs go back to the front of the ring once a quarter of
the ring is free there, so under steady traffic the pages touched stay near a
quarter of the ring, not all of it (a soak of ``vllm serve`` found the ring
walking its whole 1 GiB, the process's RSS growing with it; going back as soon
as one run fitted the front left no room for the runs that followed while older
ones were still out, and stores were skipped).

When a run does not fit, :meth:`StagingRing.take` hands out the rows that do
(possibly none): the caller stores or loads only those blocks and reports the
rest failed, a later miss and recomputation, never a wait on the engine's
thread and never memory beyond the ring.

Must not decide what to store or load, or touch the tiers or the engine's
tensors.

>>> ring = StagingRing(4 * 8, 8, pin=False)
>>> a, b = ring.take(3), ring.take(3)
>>> (a.start, len(a)), (b.start, len(b))  # only one row was left for b
((0, 3), (3, 1))
>>> ring.give_back(a); ring.take(2).start  # wraps to the front once a is back
0
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass(slots=True, eq=False)
class Run:
    """Rows ``start .. start + len(rows) - 1`` of the ring (``rows``: a ``[n, bytes_per_block]`` view)."""

    start: int
    rows: torch.Tensor
    done: bool = field(default=False)

    def __len__(self) -> int:
        return self.rows.shape[0]


class StagingRing:
    """``capacity_bytes // bytes_per_block`` rows of host memory, handed out in order."""

    def __init__(self, capacity_bytes: int, bytes_per_block: int, *, pin: bool) -> None:
        self.num_rows = capacity_bytes // bytes_per_block
        if self.num_rows < 1:
            raise ValueError(f"staging of {capacity_bytes} bytes holds no block of {bytes_per_block} bytes")
        self.bytes_per_block = bytes_per_block
        self.pinned = pin
        # empty, not zeros: pages are touched as rows are first used, and rows are reused from the front,
        # so a ring larger than the traffic costs only address space on a host without an accelerator
        # (pinned memory is resident)
        self.buf = torch.empty((self.num_rows, bytes_per_block), dtype=torch.uint8, pin_memory=pin)
        self._lock = threading.Lock()
        self._live: deque[Run] = deque()  # runs not yet reclaimed, oldest first (gaps as done runs)
        self._head = 0  # next row to hand out
        self.rows_in_use = 0
        self.peak_rows_in_use = 0

    @property
    def capacity_bytes(self) -> int:
        return self.num_rows * self.bytes_per_block

    def take(self, n: int) -> Run | None:
        """A run of at most ``n`` adjacent rows (as many as fit now), or ``None`` when none is free."""
        if n <= 0:
            return None
        with self._lock:
            if not self._live:
                self._head = 0
            tail = self._live[0].start if self._live else 0
            if self._live and self._head <= tail:  # wrapped: free rows lie between head and tail
                free_start, free = self._head, tail - self._head
            else:
                free_start, free = self._head, self.num_rows - self._head
                # back to the front when the end is too small, or once the front has a quarter of the ring
                # free (and room for twice what is in flight): runs that come while older ones are still
                # out then find room, and the rows touched stay near a quarter of the ring
                want = min(n, self.num_rows)
                if tail >= want and (free < want or tail >= max(want + 2 * self.rows_in_use, self.num_rows // 4)):
                    if free:
                        self._live.append(Run(self._head, self.buf[self._head:], done=True))
                    free_start, free = 0, tail
            k = min(n, free)
            if k <= 0:
                return None
            run = Run(free_start, self.buf[free_start:free_start + k])
            self._live.append(run)
            self._head = free_start + k
            self.rows_in_use += k
            self.peak_rows_in_use = max(self.peak_rows_in_use, self.rows_in_use)
            return run

    def give_back(self, run: Run) -> None:
        """``run`` is no longer read or written; its rows are reused once older runs are back too."""
        with self._lock:
            if run.done:
                return
            run.done = True
            self.rows_in_use -= len(run)
            while self._live and self._live[0].done:
                self._live.popleft()
