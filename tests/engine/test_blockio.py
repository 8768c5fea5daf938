"""BlockIO on the three cache arrangements it meets: vLLM's CPU layout
(block dimension first), the older GPU layout ``[2, num_blocks, ...]`` and
vLLM-Ascend's tuple of separate K and V tensors."""

from __future__ import annotations

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
