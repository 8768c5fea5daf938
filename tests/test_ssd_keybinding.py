"""SSD value format v2: a value is bound to the key it was written for, and
carries its store time.

The rule under test: a valid value found under another LMDB key than it was
written for (a copy or rename bug, a restore from another store) is a counted
miss, never served as that key's bytes; old-format (v1) values, which cannot
prove their key, are unreadable and purged at a warm restart.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from kvtier.cli import main
from kvtier.config import load_config
from kvtier.keys import BlockKey, Namespace, key_to_bytes
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers import codec
from kvtier.tiers.codec import DecodeOutcome, ValueContext, checksum, decode_into, decode_outcome, encode, read_header
from kvtier.tiers.ssd import SSDTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_size=16)  # 16 KiB
NS = Namespace("tiny", "bfloat16", "fused", 16)
CTX = ValueContext.of(NS, LAYOUT)
BPB = LAYOUT.bytes_per_block
CODECS = ("raw", "zstd", "bplane-zstd", "auto")


def bf16_block(seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BPB // 2, generator=g).to(torch.bfloat16).view(torch.uint8).numpy()


def lmdb_put(path: Path, items: dict[bytes, bytes]) -> None:
    """Write raw LMDB entries behind the tier's back (tier closed)."""
    env = lmdb.open(str(path), map_size=1 << 30)
    with env.begin(write=True) as txn:
        for k, v in items.items():
            txn.put(k, v)
    env.close()


def lmdb_get(path: Path, key: BlockKey) -> bytes:
    env = lmdb.open(str(path), map_size=1 << 30)
    with env.begin() as txn:
        value = txn.get(key_to_bytes(key))
    env.close()
    return value


def v1_value(raw: bytes, ctx: ValueContext, version: int = 1) -> bytes:
    """A well-formed value of the version-1 format (76-byte header, no key, raw codec)."""
    fields = struct.pack("<4sBBH16s8s16sIIIQ", b"KVTB", version, 0, 0, ctx.namespace_digest, ctx.layout_hash,
                         bytes(16), len(raw), len(raw), 0, checksum(raw))
    return fields + struct.pack("<Q", checksum(fields)) + raw


# ------------------------------------------------------------------ codec level


@pytest.mark.parametrize("name", CODECS)
def test_value_decodes_only_for_the_key_it_was_encoded_for(name: str) -> None:
    raw = bf16_block(1)
    value = encode(raw, CTX, name, key=BlockKey(7))
    assert read_header(value).key == BlockKey(7)
    out = np.empty(BPB, dtype=np.uint8)
    assert decode_into(value, out, CTX, key=BlockKey(7)) and np.array_equal(out, raw)
    counters: dict[str, int] = {}
    out[:] = raw  # even a buffer already holding the right bytes is not "valid"
    assert not decode_into(value, out, CTX, counters, key=BlockKey(8))
    assert counters == {"key_mismatches": 1}
    assert decode_outcome(value, out, CTX, key=BlockKey(7 << 64)) is DecodeOutcome.KEY_MISMATCH  # high bytes too


def test_header_records_the_store_time() -> None:
    before_s = int(time.time())
    header = read_header(encode(bf16_block(1), CTX, "raw", key=BlockKey(1)))
    assert before_s <= header.stored_at_s <= int(time.time())


def test_version_1_values_are_decode_failures() -> None:
    raw = bytes(bf16_block(2))
    counters: dict[str, int] = {}
    assert read_header(v1_value(raw, CTX)) is None
    assert not decode_into(v1_value(raw, CTX), bytearray(BPB), CTX, counters, key=BlockKey(1))
    assert counters == {"decode_failures": 1}


# ------------------------------------------------------------------- tier level


@pytest.mark.parametrize("name", CODECS)
def test_value_copied_under_another_key_is_a_counted_miss(tmp_path: Path, name: str) -> None:
    path = tmp_path / "ssd"
    blocks = {BlockKey(1): bf16_block(1), BlockKey(2): bf16_block(2)}
    with SSDTier(path, NS, LAYOUT, codec=name) as tier:
        assert tier.put_many([(k, b, None) for k, b in blocks.items()]) == 2
    value_of_1 = lmdb_get(path, BlockKey(1))
    # Key 1's valid value copied over key 2 (a rename bug) and under a fresh key 3 (a bad restore).
    lmdb_put(path, {key_to_bytes(BlockKey(2)): value_of_1, key_to_bytes(BlockKey(3)): value_of_1})
    with SSDTier(path, NS, LAYOUT) as tier:
        outs = [np.empty(BPB, dtype=np.uint8) for _ in range(3)]
        outs[1][:] = blocks[BlockKey(1)]  # what a wrong serve would return
        assert tier.get_many_into([BlockKey(1), BlockKey(2), BlockKey(3)], outs) == [True, False, False]
        assert np.array_equal(outs[0], blocks[BlockKey(1)])
        s = tier.stats
        assert (s["hits"], s["misses"], s["key_mismatches"]) == (1, 2, 2)
        assert (s["checksum_failures"], s["decode_failures"], s["mismatches"]) == (0, 0, 0)
        # Not offered for a warm restart, not even as a foreign value; verify_all flags both.
        assert [e.key for e in tier.scan(include_foreign=True)] == [1]
        assert tier.verify_all() == (1, 2)
        assert tier.purge_unreadable() == 2 and len(tier) == 1 and tier.stats["purged"] == 2


def test_warm_restart_purges_misplaced_and_v1_values_but_keeps_newer_versions(tmp_path: Path) -> None:
    cfg = load_config(env={}, overrides={
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "bfloat16", "block_size": 16},
        "namespace": {"model": "tiny"},
        "tiers": {"hbm": {"enabled": False}, "dram": {"enabled": False},
                  "ssd": {"enabled": True, "capacity_blocks": 16, "path": str(tmp_path / "ssd")}},
        "put_tier": "ssd"})
    with TieredStore(cfg) as store:
        keys = store.keys_for(list(range(48)))  # 3 blocks
        assert store.put(keys, [torch.from_numpy(bf16_block(i)).view(torch.bfloat16) for i in range(3)]) == 3
        ctx = store._ssd._ctx
    raw = bytes(bf16_block(9))
    lmdb_put(tmp_path / "ssd", {
        key_to_bytes(keys[2]): lmdb_get(tmp_path / "ssd", keys[0]),  # misplaced copy of block 0
        key_to_bytes(BlockKey(101)): v1_value(raw, ctx),  # stale v1 value
        key_to_bytes(BlockKey(102)): v1_value(raw, ctx, version=3),  # a newer kvtier's: not ours to judge
    })
    with TieredStore(cfg) as store:
        c = store.counters
        assert (c["ssd_purged_unreadable_values"], c["ssd_reindexed_blocks"]) == (2, 2)
        assert len(store._ssd) == 3  # blocks 0, 1 and the version-3 value
        outs = [torch.zeros(BPB // 2, dtype=torch.bfloat16) for _ in keys]
        assert store.get(keys, outs) == 2  # block 2 was purged: a miss, not block 0's bytes
        assert store._ssd.stats["key_mismatches"] == 0  # it never reached a read


# ---------------------------------------------------------------------- inspect


def test_inspect_shows_per_block_age_and_flags_misplaced_values(tmp_path: Path, monkeypatch, capsys) -> None:
    path = tmp_path / "ssd"
    now_s = int(time.time())
    with SSDTier(path, NS, LAYOUT, codec="raw") as tier:
        monkeypatch.setattr(codec, "_now_s", lambda: now_s - 2 * 3600)  # stored two hours ago
        tier.put_many([(BlockKey(1), bf16_block(1), None), (BlockKey(2), bf16_block(2), BlockKey(1))])
        monkeypatch.setattr(codec, "_now_s", lambda: now_s - 3 * 86400)  # three days ago
        tier.put_many([(BlockKey(3), bf16_block(3), BlockKey(2))])
    monkeypatch.undo()
    assert main(["inspect", str(path), "--blocks"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(": 3 blocks, 0 values with a bad header")
    group = next(ln for ln in out if " raw " in ln and "blocks" not in ln).split()
    assert group[3] == "3" and group[-3:-1] == ["2h00m", "3d00h"] and group[-1] == "0"  # newest, oldest, bad
    lines = {int(ln.split()[0], 16): ln.split() for ln in out if ln.startswith("0x")}
    assert lines[1][1] == "-" and int(lines[2][1], 16) == 1
    assert [lines[k][4] for k in (1, 2, 3)] == ["2h00m", "2h00m", "3d00h"]
    assert {lines[k][5] for k in lines} == {"ok"}

    lmdb_put(path, {key_to_bytes(BlockKey(4)): lmdb_get(path, BlockKey(1))})
    assert main(["inspect", str(path), "--blocks", "--no-verify"]) == 1
    out = capsys.readouterr().out
    assert "1 values stored under another key than they were written for" in out
    assert [ln.split()[-1] for ln in out.splitlines() if ln.startswith("0x")] == ["-", "-", "-", "key_mismatches"]


def test_inspect_counts_old_format_values(tmp_path: Path, capsys) -> None:
    path = tmp_path / "ssd"
    with SSDTier(path, NS, LAYOUT, codec="raw") as tier:
        tier.put_many([(BlockKey(1), bf16_block(1), None)])
    lmdb_put(path, {key_to_bytes(BlockKey(2)): v1_value(bytes(bf16_block(2)), CTX)})
    assert main(["inspect", str(path)]) == 1
    out = capsys.readouterr().out
    assert ": 1 blocks, 1 values with a bad header" in out
    assert "1 values of an older format version (unreadable; purged at the next warm restart)" in out
