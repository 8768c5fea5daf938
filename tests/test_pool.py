"""TensorPool copies: a run of adjacent blocks into adjacent slots is one copy,
and every other arrangement copies block by block; both give the same bytes.
Buffer views of tensors and slots (for the SSD codec) alias their bytes, and
are refused where they would not."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.pool import TensorPool, host_buffers, host_run

NB = 64  # bytes per block


def rows(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, NB), generator=g, dtype=torch.uint8)


def test_host_run_accepts_only_adjacent_contiguous_blocks_of_one_storage() -> None:
    base = rows(6)
    blocks = list(base.unbind(0))
    run = host_run(blocks[1:5], NB)
    assert run is not None and run.shape == (4, NB) and run.data_ptr() == blocks[1].data_ptr()
    assert torch.equal(run, base[1:5])
    assert host_run(blocks[:1], NB) is None  # one block: nothing to merge
    assert host_run([blocks[2], blocks[1]], NB) is None  # out of order
    assert host_run([blocks[0], blocks[2]], NB) is None  # a gap
    assert host_run([blocks[0], blocks[0]], NB) is None  # the same block twice
    strided = torch.zeros(4 * NB, dtype=torch.uint8)
    assert host_run([strided[0 : 2 * NB : 2], strided[2 * NB :: 2]], NB) is None  # not contiguous
    # adjacent memory, two storages: the first one's storage does not reach the second block
    buf = bytearray(rows(2).numpy().tobytes())
    mv = memoryview(buf)
    apart = [torch.frombuffer(mv[:NB], dtype=torch.uint8), torch.frombuffer(mv[NB:], dtype=torch.uint8)]
    assert apart[1].data_ptr() == apart[0].data_ptr() + NB
    assert host_run(apart, NB) is None


def test_a_run_is_one_copy_and_anything_else_copies_per_block(monkeypatch) -> None:
    pool = TensorPool(8, NB, torch.device("cpu"))
    src = rows(4, seed=1)
    calls: list[int] = []
    real = torch._foreach_copy_

    def counting(dsts, srcs, **kw):
        calls.append(len(dsts))
        return real(dsts, srcs, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    assert pool.write([2, 3, 4, 5], list(src.unbind(0))) == [True] * 4
    assert calls == []  # the run took one plain copy
    assert torch.equal(pool.data[2:6], src)
    out = torch.zeros_like(src)
    assert pool.read([2, 3, 4, 5], list(out.unbind(0))) == [True] * 4
    assert calls == [] and torch.equal(out, src)
    pool.write([7, 0], list(src[:2].unbind(0)))  # slots not adjacent
    pool.read([0, 1], [torch.empty(NB, dtype=torch.uint8) for _ in range(2)])  # buffers not adjacent
    assert calls == [2, 2]
    assert torch.equal(pool.data[7], src[0]) and torch.equal(pool.data[0], src[1])


@settings(max_examples=60, deadline=None)
@given(
    slots=st.lists(st.integers(0, 11), min_size=1, max_size=8, unique=True),
    order=st.permutations(range(8)),
    adjacent=st.booleans(),
)
def test_writes_and_reads_match_per_block_copies(slots: list[int], order: list[int], adjacent: bool) -> None:
    """Whatever the slots (adjacent or not) and the buffers (rows of one tensor in
    order, or scattered rows), the pool ends up as block-by-block copies would
    leave it, and reads give back each slot's bytes."""
    n = len(slots)
    pool = TensorPool(12, NB, torch.device("cpu"))
    base = rows(8, seed=n)
    srcs = list(base[:n].unbind(0)) if adjacent else [base[i] for i in order[:n]]
    expected = pool.data.clone()
    for s, b in zip(slots, srcs):
        expected[s] = b
    assert pool.write(slots, srcs) == [True] * n
    assert torch.equal(pool.data, expected)
    out = torch.zeros((8, NB), dtype=torch.uint8)
    dsts = list(out[:n].unbind(0)) if adjacent else [out[i] for i in order[:n]]
    assert pool.read(slots, dsts) == [True] * n
    for s, d in zip(slots, dsts):
        assert torch.equal(d, expected[s])


def test_overlapping_run_is_a_failed_copy_not_a_wrong_block() -> None:
    """Writing a pool's own adjacent slots into an overlapping run raises (the
    mover turns that into a failed job), rather than copying half-moved bytes."""
    pool = TensorPool(6, NB, torch.device("cpu"))
    pool.data.copy_(rows(6, seed=2))
    with pytest.raises(RuntimeError):
        pool.write([1, 2, 3], [pool.view(0), pool.view(1), pool.view(2)])


def test_host_buffers_alias_the_tensors_and_refuse_what_they_cannot_view() -> None:
    base = rows(3, seed=3)
    ts = list(base.unbind(0))
    bufs = host_buffers(ts, NB)
    assert bufs is not None and [memoryview(b).nbytes for b in bufs] == [NB] * 3
    assert all(bytes(b) == t.numpy().tobytes() for b, t in zip(bufs, ts))
    before = base.clone()
    memoryview(bufs[1]).cast("B")[5] = (int(before[1, 5]) + 1) % 256  # lands in that tensor's bytes only
    before[1, 5] = (int(before[1, 5]) + 1) % 256
    assert torch.equal(base, before)
    assert host_buffers([], NB) == []
    strided = torch.zeros(2 * NB, dtype=torch.uint8)[::2]  # NB bytes, but not contiguous
    assert host_buffers([ts[0], strided], NB) is None
    assert host_buffers([ts[0], torch.zeros(NB + 1, dtype=torch.uint8)], NB) is None  # another size
    # the byte count, not the element count, is what must match
    assert host_buffers([torch.zeros(NB // 2, dtype=torch.bfloat16)], NB) is not None


def test_pool_host_buffers_view_the_slots_and_check_the_range() -> None:
    pool = TensorPool(4, NB, torch.device("cpu"))
    pool.data.copy_(rows(4, seed=4))
    bufs = pool.host_buffers([3, 1])
    assert [bytes(b) for b in bufs] == [pool.view(3).numpy().tobytes(), pool.view(1).numpy().tobytes()]
    memoryview(bufs[0]).cast("B")[:] = bytes(range(NB))
    assert pool.view(3).tolist() == list(range(NB))
    assert pool.host_buffers([]) == []
    for bad in ([4], [0, -1]):
        with pytest.raises(IndexError, match="outside 0..3"):
            pool.host_buffers(bad)
