"""``kvtier_vllm.rerotate``: RoPE by kvtier equals vLLM's own, and re-rotating a block row
turns exactly its keys, in each cache layout the connector meets."""

from __future__ import annotations

import doctest
from types import SimpleNamespace

import pytest
import torch
from kvtier_vllm import rerotate
from kvtier_vllm.blockio import BlockIO
from kvtier_vllm.rerotate import Rope, key_regions, rerotate_rows, rope_of

pytestmark = pytest.mark.vllm_interface  # no engine: also run against newer vLLMs (scripts/vllm_next.sh)

NUM_BLOCKS, BS, HEADS, DIM = 4, 4, 2, 8


def test_doctests() -> None:
    assert doctest.testmod(rerotate).failed == 0


def test_rotation_matches_vllms_rope_and_composes() -> None:
    pytest.importorskip("vllm", reason="vLLM's RoPE is the reference (the engine suite has it)")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    rope = Rope(10000.0, 64, 64)
    with set_current_vllm_config(VllmConfig()):
        vllm_rope = get_rope(64, 2048, is_neox_style=True, rope_parameters={"rope_theta": 10000.0},
                             dtype=torch.float32)
    k = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 1, 17, 300, 1999])
    _, theirs = vllm_rope.forward_native(positions, torch.zeros(5, 64), k.clone())
    ours = torch.stack([rope.rotate(k[i:i + 1], int(p))[0] for i, p in enumerate(positions)])
    assert torch.allclose(ours, theirs, atol=1e-4)
    # turning by a then by b is turning by a + b; by 0 changes nothing
    assert torch.allclose(rope.rotate(rope.rotate(k, 40), -15), rope.rotate(k, 25), atol=1e-5)
    assert torch.equal(rope.rotate(k, 0), k)


def test_rope_of_reads_plain_rope_and_refuses_the_rest() -> None:
    plain = SimpleNamespace(model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert rope_of(plain, 128) == Rope(5e5, 128, 128)
    partial = SimpleNamespace(model_type="qwen3", rope_theta=1e4, partial_rotary_factor=0.5)
    assert rope_of(partial, 64) == Rope(1e4, 32, 64)
    scaled = SimpleNamespace(model_type="llama", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5})
    assert "rope_type 'llama3'" in rope_of(scaled, 128)
    assert "model_type 'gpt2'" in rope_of(SimpleNamespace(model_type="gpt2"), 64)


def _seeded(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _keys_of(kind: str, caches: dict, block: int) -> list[torch.Tensor]:
    """Every layer's keys of ``block`` as ``[vectors, DIM]``, read as the kernels read them."""
    out = []
    for cache in caches.values():
        if kind == "cpu":  # per head: keys transposed [DIM, BS], then values
            out += [cache[block, h].reshape(-1)[: BS * DIM].view(DIM, BS).T for h in range(HEADS)]
        elif kind == "kv-first":
            out.append(cache[0, block].reshape(-1, DIM))
        else:
            out.append(cache[0][block].reshape(-1, DIM))
    return out


@pytest.mark.parametrize("kind", ["cpu", "kv-first", "ascend-split"])
def test_rerotate_turns_the_keys_and_nothing_else(kind: str) -> None:
    if kind == "cpu":
        caches = {f"l{i}": _seeded((NUM_BLOCKS, HEADS, BS, 2 * DIM), i) for i in range(2)}
    elif kind == "kv-first":
        caches = {f"l{i}": _seeded((2, NUM_BLOCKS, BS, HEADS, DIM), i) for i in range(2)}
    else:
        caches = {f"l{i}": (_seeded((NUM_BLOCKS, BS, HEADS, DIM), 2 * i),
                            _seeded((NUM_BLOCKS, BS, HEADS, DIM), 2 * i + 1)) for i in range(2)}
    io = BlockIO(caches, NUM_BLOCKS)
    regions = key_regions(io.parts, HEADS, DIM, BS)
    rope = Rope(10000.0, DIM, DIM)
    rows = io.gather([1, 2])
    before = rows.clone()
    assert rerotate_rows(rows, [0, 37], regions, rope, torch.bfloat16) == 1
    assert torch.equal(rows[0], before[0])  # shift 0: untouched
    io.scatter([3], rows[1:2])  # block 3 now holds block 2's bytes, keys turned
    for turned, original in zip(_keys_of(kind, caches, 3), _keys_of(kind, caches, 2)):
        assert torch.equal(turned, rope.rotate(original.float(), 37).to(torch.bfloat16))
    changed = (rows[1] != before[1]).sum().item()
    keys = 2 * HEADS * BS * DIM * 2  # bytes of every layer's keys in a block
    assert 0 < changed <= keys  # values are never touched


def test_a_layout_without_known_keys_is_refused() -> None:
    io = BlockIO({"l0": torch.zeros((NUM_BLOCKS, 3, 7), dtype=torch.bfloat16)}, NUM_BLOCKS)
    with pytest.raises(ValueError, match=r"approximate_shifted_segments cannot find the keys.*\(4, 3, 7\)"):
        key_regions(io.parts, HEADS, DIM, BS)
