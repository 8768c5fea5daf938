"""BlockIO on the three cache arrangements it meets: vLLM's CPU layout
(block dimension first), the older GPU layout ``[2, num_blocks, ...]`` and
vLLM-Ascend's tuple of separate K and V tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvtier_vllm.blockio import BlockIO

from kvtier.layout import KVLayout

NUM_BLOCKS, BS, HEADS, DIM = 6, 4, 2, 8


def _seeded(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _caches(kind: str) -> dict:
    if kind == "cpu":  # [num_blocks, heads, block_size, 2 * head_dim]
        return {f"l{i}": _seeded((NUM_BLOCKS, HEADS, BS, 2 * DIM), i) for i in range(2)}
    if kind == "kv-first":  # [2, num_blocks, block_size, heads, head_dim]
        return {f"l{i}": _seeded((2, NUM_BLOCKS, BS, HEADS, DIM), i) for i in range(2)}
    # vLLM-Ascend: (K, V), each [num_blocks, block_size, heads, head_dim]
    return {f"l{i}": (_seeded((NUM_BLOCKS, BS, HEADS, DIM), 2 * i), _seeded((NUM_BLOCKS, BS, HEADS, DIM), 2 * i + 1))
            for i in range(2)}


@pytest.mark.parametrize("kind", ["cpu", "kv-first", "ascend-split"])
def test_bytes_per_block_match_the_layout(kind: str) -> None:
    io = BlockIO(_caches(kind), NUM_BLOCKS)
    arrangement = "split" if kind == "ascend-split" else "fused"
    assert io.arrangement == arrangement
    assert io.bytes_per_block == KVLayout(2, HEADS, DIM, "bfloat16", BS, arrangement=arrangement).bytes_per_block


@pytest.mark.parametrize("kind", ["cpu", "kv-first", "ascend-split"])
def test_gather_then_scatter_copies_exactly_the_chosen_blocks(kind: str) -> None:
    caches = _caches(kind)
    before = {name: [t.clone() for t in (c if isinstance(c, tuple) else (c,))] for name, c in caches.items()}
    io = BlockIO(caches, NUM_BLOCKS)
    rows = io.gather([4, 1])
    io.scatter([0, 5], rows)  # block 4 -> 0, block 1 -> 5

    for name, cache in caches.items():
        for t, old in zip(cache if isinstance(cache, tuple) else (cache,), before[name]):
            dim = 1 if kind == "kv-first" else 0
            assert torch.equal(t.select(dim, 0), old.select(dim, 4))
            assert torch.equal(t.select(dim, 5), old.select(dim, 1))
            for b in (1, 2, 3, 4):  # untouched
                assert torch.equal(t.select(dim, b), old.select(dim, b))


def test_split_row_is_layer_by_layer_k_then_v() -> None:
    caches = _caches("ascend-split")
    row = BlockIO(caches, NUM_BLOCKS).gather([3])[0]
    want = torch.cat([t[3].reshape(-1).view(torch.uint8) for k, v in caches.values() for t in (k, v)])
    assert torch.equal(row, want)


def test_unknown_block_dimension_is_an_error() -> None:
    with pytest.raises(ValueError, match="block dimension"):
        BlockIO({"l0": torch.zeros(3, 5)}, num_blocks=7)


def test_mixed_arrangements_are_an_error() -> None:
    caches = {"l0": torch.zeros(NUM_BLOCKS, 4), "l1": (torch.zeros(NUM_BLOCKS, 2), torch.zeros(NUM_BLOCKS, 2))}
    with pytest.raises(ValueError, match="mix"):
        BlockIO(caches, NUM_BLOCKS)


@pytest.mark.parametrize("kind", ["cpu", "kv-first", "ascend-split"])
@pytest.mark.parametrize("chunk_blocks", [1, 2, 8])
def test_chunked_staging_moves_the_same_bytes_as_the_straight_path(kind: str, chunk_blocks: int) -> None:
    """The accelerator path (through a device staging buffer of ``chunk_blocks``
    blocks, one contiguous copy per chunk), run on the CPU: the same rows out,
    and the same blocks written back, as the straight path."""
    straight = BlockIO(_caches(kind), NUM_BLOCKS)
    caches = _caches(kind)
    bpb = straight.bytes_per_block
    io = BlockIO(caches, NUM_BLOCKS, device_staging_bytes=chunk_blocks * bpb + bpb // 2, chunked=True)
    assert io.chunk_blocks == chunk_blocks and io.device_staging_bytes == chunk_blocks * bpb
    assert straight.device_staging_bytes == 0
    ids = [5, 0, 3, 1, 4]
    want = straight.gather(ids)
    out = torch.zeros_like(want)
    assert io.copy_out(ids, out) is None  # the CPU: ready at once
    assert torch.equal(out, want) and torch.equal(io.gather(ids), want)
    rows = torch.stack([want[4], want[0], want[2]])  # blocks 4, 5, 3 into 0, 1, 2
    assert io.scatter([0, 1, 2], rows) is None
    assert torch.equal(io.gather([0, 1, 2]), rows)
    assert torch.equal(io.gather([3, 4, 5]), straight.gather([3, 4, 5]))  # untouched


class _FakeStream:
    """Records what BlockIO asks of a stream (the CPU has none)."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: "_FakeStream") -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def wait_event(self, event: str) -> None:
        self.log.append(f"{self.name} waits for {event}")

    def record_event(self) -> str:
        self.log.append(f"{self.name} records")
        return f"event of {self.name}"

    def __enter__(self) -> None:
        self.log.append(f"{self.name} copies:")

    def __exit__(self, *exc: object) -> None:
        self.log.append("end")


def test_side_stream_copies_are_ordered_by_events_without_host_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a side stream, a store's copies start after the engine's queued work and
    hand back the side stream's event; a load's copies start after the engine's
    queued work, and the engine's stream waits for them. Nothing synchronizes
    the host. (The order on a real accelerator is the GPU benchmark's to show.)"""
    log: list[str] = []
    engine = _FakeStream("engine", log)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: engine)
    caches = _caches("ascend-split")
    io = BlockIO(caches, NUM_BLOCKS)
    want = io.gather([2, 3])
    io.stream = _FakeStream("side", log)
    out = torch.zeros_like(want)
    assert io.copy_out([2, 3], out) == "event of side" and torch.equal(out, want)
    assert log == ["side waits for engine", "side copies:", "side records", "end"]
    log.clear()
    assert io.scatter([0, 1], want) == "event of side"
    assert log == ["side waits for engine", "side copies:", "side records", "end", "engine waits for event of side"]
    assert torch.equal(io.gather([0, 1]), want)


def _reference_row(caches: dict, block: int) -> torch.Tensor:
    """A block's row as the module doc defines it, built with torch alone (the slow path)."""
    parts = []
    for cache in caches.values():
        for t in (cache if isinstance(cache, tuple) else (cache,)):
            dim = 1 if t.shape[0] == 2 and t.shape[1] == NUM_BLOCKS else 0
            parts.append(t.select(dim, block).contiguous().view(-1).view(torch.uint8))
    return torch.cat(parts)


@pytest.mark.parametrize("kind", ["cpu", "kv-first", "ascend-split"])
def test_one_pass_gather_and_scatter_rows_move_exactly_the_chosen_blocks_and_slots(kind: str) -> None:
    """gather_rows / scatter_rows (the worker's DRAM path: engine blocks straight into pool
    slots and back) on blocks and slots that are neither adjacent nor in order."""
    caches = _caches(kind)
    io = BlockIO(caches, NUM_BLOCKS)
    if not io.straight:
        pytest.skip("kvtier's C module (kvtier.tiers._rawread) is not built: the one-pass path is off")
    pool = torch.zeros((5, io.bytes_per_block), dtype=torch.uint8).numpy()
    want = {b: _reference_row(caches, b) for b in range(NUM_BLOCKS)}
    io.gather_rows([4, 0, 2], pool, [3, 1, 4], split=True)
    assert all(torch.equal(torch.from_numpy(pool[s]), want[b]) for b, s in ((4, 3), (0, 1), (2, 4)))
    assert not pool[0].any() and not pool[2].any()  # slots not named are untouched
    io.scatter_rows([5, 1], pool, [4, 3])  # slot 4 holds block 2, slot 3 block 4
    assert torch.equal(_reference_row(caches, 5), want[2]) and torch.equal(_reference_row(caches, 1), want[4])
    assert all(torch.equal(_reference_row(caches, b), want[b]) for b in (0, 2, 3, 4))  # others untouched


def test_a_span_outside_its_buffers_copies_nothing() -> None:
    caches = _caches("cpu")
    io = BlockIO(caches, NUM_BLOCKS)
    if not io.straight:
        pytest.skip("kvtier's C module (kvtier.tiers._rawread) is not built: the one-pass path is off")
    before = {k: v.clone() for k, v in caches.items()}
    pool = torch.ones((2, io.bytes_per_block), dtype=torch.uint8).numpy()
    with pytest.raises(ValueError, match="outside its buffers"):
        io.scatter_rows([0, NUM_BLOCKS], pool, [0, 1])  # block NUM_BLOCKS is past the cache
    assert all(torch.equal(before[k], caches[k]) for k in caches)  # not even block 0 was written
    with pytest.raises(ValueError, match="C-contiguous"):
        io.gather_rows([0], pool[:, :-1], [0])


@pytest.mark.parametrize("kind", ["cpu", "kv-first", "ascend-split", "two-shapes"])
def test_landing_puts_each_rows_bytes_in_row_order_where_scatter_rows_puts_them(kind: str) -> None:
    """The SSD load's one copy (``SSDTier.scatter_many``) walks a value's payload in order
    through ``landing``'s spans: they must tile each row from offset 0 and land every byte
    where ``scatter_rows`` (the staging path) would."""
    def make() -> dict:
        if kind == "two-shapes":  # layers of two shapes: two span groups
            return {"l0": _seeded((NUM_BLOCKS, HEADS, BS, 2 * DIM), 0), "l1": _seeded((NUM_BLOCKS, 1, BS, 2 * DIM), 1)}
        return _caches(kind)

    caches, twin = make(), make()
    io = BlockIO(caches, NUM_BLOCKS)
    if not io.straight:
        pytest.skip("kvtier's C module (kvtier.tiers._rawread) is not built: the one-pass path is off")
    rows = np.random.default_rng(3).integers(0, 256, (2, io.bytes_per_block), dtype=np.uint8)
    BlockIO(twin, NUM_BLOCKS).scatter_rows([5, 1], rows, [0, 1])
    bufs, table = io.landing([5, 1])
    assert table[:, 0].tolist() == sorted(table[:, 0].tolist())  # grouped by row
    at = [0, 0]  # how far into each row the spans have walked
    for r, p, off, ln in table.tolist():
        bufs[p][off:off + ln] = rows[r][at[r]:at[r] + ln]
        at[r] += ln
    assert at == [io.bytes_per_block] * 2
    flat = [t for c in (caches, twin) for v in c.values() for t in (v if isinstance(v, tuple) else (v,))]
    half = len(flat) // 2
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(flat[:half], flat[half:]))
