"""``kvtier bench tiers`` measures what it says: real digest keys, right bytes."""

from __future__ import annotations

from pathlib import Path

from kvtier.benchmarks import tiers
from kvtier.benchmarks.common import bf16_blocks
from kvtier.keys import BlockKey


def test_round_keys_are_digests_with_distinct_hashes() -> None:
    # the trap the putter avoids: Python hashes ints modulo 2**61 - 1, where
    # 2**64 is 8, so (round << 64) | i collides with key i - 8 of the next round
    assert hash(BlockKey((1 << 64) | 8)) == hash(BlockKey((2 << 64) | 0))
    store = tiers.make_store(256 * 1024, 64, "dram")
    try:
        put = tiers.RoundPutter(store, bf16_blocks(16, 256 * 1024), rounds=3)
        keys = [k for r in put._rounds for k in r]
        assert len(set(keys)) == len(keys) == 48
        assert len({hash(k) for k in keys}) == len(keys)
        assert all(k.bit_length() > 64 for k in keys)  # 128-bit digests, not small ints
        for _ in range(3):
            put()
        assert store.contains_prefix(put.keys).num_blocks == 16
    finally:
        store.close()


def test_dram_and_ssd_figures_come_from_verified_round_trips(tmp_path: Path) -> None:
    # both functions assert the bytes read back equal the bytes put
    dram = tiers.bench_memcpy_and_dram(256 * 1024, 4 << 20)
    ssd = tiers.bench_ssd(256 * 1024, 4 << 20, str(tmp_path))
    for name in ("memcpy_gbps", "dram_put_gbps", "dram_get_gbps", "dram_put_scattered_gbps", "dram_put_evicting_gbps"):
        assert dram[name] > 0, name
    for name in ("raw_file_write_gbps", "ssd_put_gbps", "raw_file_read_gbps", "ssd_get_gbps", "ssd_put_gbps_auto"):
        assert ssd[name] > 0, name
    assert ssd["zstd_ratio_bf16"] > 1.0  # bf16 KV-like data compresses under the auto codec
