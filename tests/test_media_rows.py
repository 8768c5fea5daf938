"""The data plane's staging-row copier (``kvtier.transfer.media.copy_rows``), which the
vLLM connector's worker runs for every DRAM store and load: exact rows, split parts that
are views of about equal size. No engine needed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.transfer import media


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_split_dram_copies_write_exactly_the_rows_asked(data) -> None:
    """``copy_rows`` cut into 1-4 parts (by rows, or by bytes when rows are
    fewer than parts) over runs and scattered rows: every asked row of ``dst``
    equals its source row, and no other byte of ``dst`` changes."""
    rows, width = 12, 64
    src = np.arange(rows * width, dtype=np.uint32).astype(np.uint8).reshape(rows, width) ^ 0x5A
    n = data.draw(st.integers(1, rows), label="n")
    dst_rows = data.draw(st.permutations(range(rows)), label="dst")[:n]
    src_rows = data.draw(st.lists(st.integers(0, rows - 1), min_size=n, max_size=n), label="src")
    if data.draw(st.booleans(), label="runs"):
        d0, s0 = data.draw(st.integers(0, rows - n)), data.draw(st.integers(0, rows - n))
        dst_rows, src_rows = list(range(d0, d0 + n)), list(range(s0, s0 + n))
    threads = data.draw(st.integers(1, 4), label="threads")
    dst = np.zeros((rows, width), np.uint8)
    with ThreadPoolExecutor(3) as helper, mock.patch.object(media, "SPLIT_COPY_MIN_BYTES", 1):
        media.copy_rows(dst, dst_rows, src, src_rows, helper, threads)
    for r in range(rows):
        want = src[src_rows[dst_rows.index(r)]] if r in dst_rows else np.zeros(width, np.uint8)
        assert np.array_equal(dst[r], want), (r, dst_rows, src_rows, threads)


def test_split_parts_are_views_of_about_equal_size() -> None:
    """The parts are slices of ``dst`` (writing them writes the pool) and differ by
    at most one row, or split one row's bytes when there are fewer rows."""
    dst, src = np.zeros((10, 8), np.uint8), np.ones((10, 8), np.uint8)
    parts = media._split(dst, src, media._runs([0, 1, 2, 5, 6], [3, 4, 5, 0, 1]), 5, 2)
    assert [sum(len(d) for d, _ in p) for p in parts] == [2, 3]
    assert all(np.shares_memory(d, dst) for p in parts for d, _ in p)
    one = media._split(dst, src, [(4, 2, 1)], 1, 3)
    assert [sum(d.size for d, _ in p) for p in one] == [2, 3, 3]
    assert all(np.shares_memory(d, dst) for p in one for d, _ in p)
