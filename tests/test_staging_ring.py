"""The vLLM connector's staging ring (integrations/vllm_ascend/kvtier_vllm/staging.py): fixed
host memory for blocks in flight, handed out as runs that never overlap while in use."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier_vllm.staging import StagingRing


def test_runs_fit_what_is_free_and_wrap_once_the_front_is_back() -> None:
    ring = StagingRing(10 * 16, 16, pin=False)
    a, b = ring.take(6), ring.take(6)
    assert (a.start, len(a), b.start, len(b)) == (0, 6, 6, 4)  # b got what was left
    assert ring.take(1) is None and ring.rows_in_use == 10
    ring.give_back(b)
    assert ring.take(1) is None  # b's rows are reused only after a's, the older run
    ring.give_back(a)
    c = ring.take(3)
    assert (c.start, len(c)) == (0, 3) and ring.rows_in_use == 3 and ring.peak_rows_in_use == 10
    c.rows.fill_(7)
    assert int(ring.buf[:3].sum()) == 7 * 3 * 16  # runs are views of the ring's buffer
    ring.give_back(c)
    ring.give_back(c)  # twice is harmless
    assert ring.rows_in_use == 0


def test_the_front_is_used_when_the_end_is_too_small() -> None:
    ring = StagingRing(8 * 4, 4, pin=False)
    a, b = ring.take(5), ring.take(1)
    ring.give_back(a)
    c = ring.take(4)  # 2 rows at the end, 5 at the front: wrap
    assert (c.start, len(c)) == (0, 4)
    ring.give_back(b)
    ring.give_back(c)
    assert ring.take(8).start == 0  # all back: the whole ring


def test_a_ring_smaller_than_a_block_is_refused() -> None:
    with pytest.raises(ValueError, match="holds no block"):
        StagingRing(100, 256, pin=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 50)), max_size=60))
def test_live_runs_never_overlap_and_stay_inside_the_ring(ops) -> None:
    ring = StagingRing(16 * 2, 2, pin=False)
    live = []
    for take, n, pick in ops:
        if take or not live:
            run = ring.take(n)
            if run is not None:
                assert 1 <= len(run) <= n and run.start + len(run) <= ring.num_rows
                live.append(run)
        else:
            ring.give_back(live.pop(pick % len(live)))
        rows = [r for run in live for r in range(run.start, run.start + len(run))]
        assert len(rows) == len(set(rows)) == ring.rows_in_use <= ring.num_rows
    for run in live:
        ring.give_back(run)
    assert ring.rows_in_use == 0 and len(ring.take(16)) == 16


def test_under_steady_traffic_the_rows_in_use_stay_near_the_front() -> None:
    """The ring is never empty (a run is always in flight), as under a server's steady
    traffic: runs go back to the front once a quarter of the ring is free there, so the
    highest row ever handed out stays near a quarter of the ring, not all of it (the pages
    a process touches, its RSS, follow the highest row; they walked the whole 1 GiB ring
    before)."""
    from collections import deque

    ring = StagingRing(1000 * 8, 8, pin=False)
    live: deque = deque()
    highest = 0
    for i in range(10_000):
        run = ring.take(1 + i % 4)
        assert run is not None
        highest = max(highest, run.start + len(run))
        live.append(run)
        while len(live) > 3:  # three runs stay in flight: the ring never empties
            ring.give_back(live.popleft())
    assert highest <= 1000 // 4 + 4 * 4, highest  # a quarter of the ring, and what is in flight


def test_runs_taken_while_an_older_one_is_out_are_never_refused() -> None:
    """Going back to the front must leave room for the runs that follow while an older run
    is still out. Runs of 6 in a ring of 1,000 rows: the first is given back, the second
    stays out, and twelve more are taken; all get their rows (going back as soon as one run
    fitted the front left the next one none: the full-disk engine test's skipped stores)."""
    ring = StagingRing(1000 * 8, 8, pin=False)
    first, _second = ring.take(6), ring.take(6)
    ring.give_back(first)
    got = [ring.take(6) for _ in range(12)]
    assert all(r is not None and len(r) == 6 for r in got)
