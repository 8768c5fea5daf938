"""SSD tier and its value codec: round trips, corruption, mismatches, capacity, errors.

The rule under test everywhere: ``get_into`` / ``decode_into`` return ``True``
only for bytes that verified and belong to the tier's namespace and layout;
anything else is a counted miss, never an exception.
"""

from __future__ import annotations

import random
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError, ProtocolError, StorageError
from kvtier.keys import BlockKey, Namespace, key_to_bytes
from kvtier.layout import DTYPE_TO_BYTES, KVLayout
from kvtier.tiers.codec import (
    HEADER_BYTES, ValueContext, decode_into, encode, native_raw_read, read_header, value_bound,
)
from kvtier.tiers.ssd import SSDTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_size=16)  # 16 KiB
SAME_SIZE_LAYOUT = KVLayout(num_layers=4, num_kv_heads=1, head_dim=64, dtype="bfloat16", block_size=16)
NS = Namespace("tiny", "bfloat16", "fused", 16)
OTHER_NS = Namespace("tiny", "bfloat16", "fused", 16, tenant="other")
CTX = ValueContext.of(NS, LAYOUT)
CODECS = ("raw", "zstd", "bplane-zstd")
BPB = LAYOUT.bytes_per_block
FAILURE_COUNTERS = ("checksum_failures", "decode_failures", "mismatches", "key_mismatches")
K = BlockKey(42)  # the key of values encoded directly


def bf16_block(seed: int, nbytes: int = BPB) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nbytes // 2, generator=g).to(torch.bfloat16).view(torch.uint8).numpy()


def random_block(seed: int, nbytes: int = BPB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def make_block(kind: str, seed: int) -> np.ndarray:
    if kind == "bf16":
        return bf16_block(seed)
    if kind == "random":
        return random_block(seed)
    return np.zeros(BPB, dtype=np.uint8)


def failures(tier: SSDTier) -> int:
    return failures_from(tier.stats)


def failures_from(stats: dict[str, int]) -> int:
    return sum(stats[c] for c in FAILURE_COUNTERS)


def rewrite_values(path: Path, edit) -> None:
    """Open the LMDB directory directly (tier closed) and replace each value by ``edit(key, value)``."""
    env = lmdb.open(str(path), map_size=1 << 30)
    with env.begin(write=True) as txn:
        for key, value in list(txn.cursor()):
            txn.put(key, edit(key, value))
    env.close()


@pytest.fixture
def tier_path(tmp_path: Path) -> Path:
    return tmp_path / "ssd"


@pytest.fixture(params=["native", "python"])
def read_path(request, monkeypatch) -> str:
    """Run a test on the C read path for raw values and on the pure-Python one
    (what a machine without a C compiler at install runs)."""
    import kvtier.tiers.codec as codec_mod

    if request.param == "native" and not codec_mod.native_raw_read():
        pytest.skip("kvtier.tiers._rawread is not built here")
    if request.param == "python":
        monkeypatch.setattr(codec_mod, "_rawread", None)
    return request.param


# ----------------------------------------------------------------- round trips


@pytest.mark.parametrize("codec", [*CODECS, "auto"])
@pytest.mark.parametrize("kind", ["bf16", "random", "zeros"])
def test_round_trip_every_codec(
    tier_path: Path, codec: str, kind: str, read_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvtier.tiers.ssd as ssd_mod

    blocks = {BlockKey(i + 1): make_block(kind, i) for i in range(6)}
    with SSDTier(tier_path, NS, LAYOUT, codec=codec) as tier:
        items = [(k, b, BlockKey(k - 1) if k > 1 else None) for k, b in blocks.items()]
        assert tier.put_many(items) == 6
        outs = [np.empty(BPB, dtype=np.uint8) for _ in blocks]
        with monkeypatch.context() as m:
            if read_path == "native" and codec == "raw":  # intact raw values never reach the Python decoder
                m.setattr(ssd_mod, "decode_into", lambda *a, **k: pytest.fail("raw value left the C read path"))
            assert tier.get_many_into(list(blocks), outs) == [True] * 6
        for out, block in zip(outs, blocks.values()):
            assert np.array_equal(out, block)
        assert tier.stats["hits"] == 6 and tier.stats["misses"] == 0 and failures(tier) == 0
    # Reopened: the same bytes, and the scan rebuilds the chain.
    with SSDTier(tier_path, NS, LAYOUT, readonly=True) as tier:
        out = bytearray(BPB)
        assert tier.get_into(BlockKey(3), out) and bytes(out) == blocks[BlockKey(3)].tobytes()
        entries = list(tier.scan())
        assert [(e.key, e.parent) for e in entries] == [(k, BlockKey(k - 1) if k > 1 else None) for k in blocks]
        assert all(e.raw_len == BPB for e in entries)
        if codec != "auto":
            assert {e.codec for e in entries} == {codec}


@pytest.mark.parametrize(
    ("kind", "dtype", "expected_codec"),
    [
        ("bf16", "bfloat16", "bplane-zstd"),  # exponent plane compresses ~3x
        ("random", "bfloat16", "raw"),  # nothing compresses: keep raw
        ("zeros", "bfloat16", "bplane-zstd"),
        ("zeros", "float8_e4m3fn", "zstd"),  # 1-byte dtype: plain zstd candidate
        ("random", "float8_e4m3fn", "raw"),
    ],
)
def test_auto_codec_choice(kind: str, dtype: str, expected_codec: str) -> None:
    layout = KVLayout(2, 2, 64, dtype, 32 // DTYPE_TO_BYTES[dtype])
    assert layout.bytes_per_block == BPB
    ctx = ValueContext.of(NS, layout)
    raw = make_block(kind, 7)
    value = encode(raw, ctx, "auto", key=K)
    assert read_header(value).codec == expected_codec
    out = np.empty(BPB, dtype=np.uint8)
    assert decode_into(value, out, ctx, key=K) and np.array_equal(out, raw)


def test_bplane_compresses_bf16_better_than_zstd() -> None:
    raw = bf16_block(1, 1 << 20)
    ctx = ValueContext.of(NS, KVLayout(32, 2, 128, "bfloat16", 32))
    sizes = {c: len(encode(raw, ctx, c, key=K)) for c in CODECS}
    assert sizes["bplane-zstd"] < sizes["zstd"] < sizes["raw"]
    assert raw.nbytes / sizes["bplane-zstd"] > 1.35  # measured ~1.5 on bf16 normals


def test_get_many_into_mixes_hits_and_misses(tier_path: Path) -> None:
    with SSDTier(tier_path, NS, LAYOUT) as tier:
        tier.put_many([(BlockKey(1), bf16_block(1), None), (BlockKey(3), bf16_block(3), None)])
        outs = [bytearray(BPB) for _ in range(3)]
        assert tier.get_many_into([BlockKey(1), BlockKey(2), BlockKey(3)], outs) == [True, False, True]
        assert tier.contains(BlockKey(3)) and not tier.contains(BlockKey(2))
        s = tier.stats
        assert (s["gets"], s["hits"], s["misses"], failures(tier)) == (3, 2, 1, 0)
        assert s["raw_bytes_read"] == 2 * BPB and 0 < s["bytes_read"] and s["puts"] == 2


def test_delete_many_and_overwrite(tier_path: Path) -> None:
    with SSDTier(tier_path, NS, LAYOUT) as tier:
        tier.put_many([(BlockKey(i), bf16_block(i), None) for i in (1, 2, 3)])
        assert tier.delete_many([BlockKey(2), BlockKey(9)]) == 1  # 9 never existed
        assert [e.key for e in tier.scan()] == [1, 3]
        tier.put_many([(BlockKey(1), random_block(5), BlockKey(3))])  # overwrite
        out = np.empty(BPB, dtype=np.uint8)
        assert tier.get_into(BlockKey(1), out) and np.array_equal(out, random_block(5))
        assert next(iter(tier.scan())).parent == BlockKey(3)
        assert len(tier) == 2 and tier.stats["deletes"] == 1


def test_scan_crosses_chunk_boundaries(tier_path: Path) -> None:
    # 2,500 tiny entries: more than two scan chunks of 1,024.
    layout = KVLayout(1, 1, 8, "bfloat16", 2, arrangement="mla")
    with SSDTier(tier_path, NS, layout) as tier:
        items = [(BlockKey(i), bytes(layout.bytes_per_block), None) for i in range(1, 2501)]
        assert tier.put_many(items) == 2500
        assert [e.key for e in tier.scan()] == list(range(1, 2501))
        assert tier.verify_all() == (2500, 0)


def test_misuse_raises(tier_path: Path) -> None:
    with SSDTier(tier_path, NS, LAYOUT) as tier:
        with pytest.raises(ValueError, match="needs 16384"):
            tier.put_many([(BlockKey(1), bytes(BPB - 2), None)])
        with pytest.raises(ValueError, match="needs 16384"):
            tier.get_into(BlockKey(1), bytearray(BPB + 1))
        with pytest.raises(TypeError, match="writable"):
            tier.get_into(BlockKey(1), bytes(BPB))  # even for a key that is absent
    with pytest.raises(ProtocolError, match="closed"):
        tier.contains(BlockKey(1))
    with SSDTier(tier_path, NS, LAYOUT, readonly=True) as ro:
        with pytest.raises(ProtocolError, match="read-only"):
            ro.put_many([(BlockKey(2), bytes(BPB), None)])
    with pytest.raises(ConfigError, match="tiers.ssd.codec"):
        SSDTier(tier_path, NS, LAYOUT, codec="lz4")
    with pytest.raises(ConfigError, match="tiers.ssd.map_size_bytes"):
        SSDTier(tier_path, NS, LAYOUT, map_size_bytes=0)
    with pytest.raises(ConfigError, match="tiers.ssd.write_threads"):
        SSDTier(tier_path, NS, LAYOUT, write_threads=0)


# ------------------------------------------------------------------ corruption


def _flip(value: bytes, offset: int, mask: int) -> bytes:
    b = bytearray(value)
    b[offset] ^= mask
    return bytes(b)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("region", ["header", "payload"])
def test_flipped_bytes_are_counted_misses(tier_path: Path, codec: str, region: str, read_path: str) -> None:
    rng = random.Random(f"{codec}-{region}")
    keys = [BlockKey(i) for i in range(1, 41)]
    originals = {k: (bf16_block(k) if k % 2 else random_block(k)) for k in keys}
    with SSDTier(tier_path, NS, LAYOUT, codec=codec) as tier:
        tier.put_many([(k, originals[k], None) for k in keys])
    flipped_at: dict[bytes, int] = {}

    def corrupt(key: bytes, value: memoryview) -> bytes:
        value = bytes(value)
        lo, hi = (0, HEADER_BYTES) if region == "header" else (HEADER_BYTES, len(value))
        offset = rng.randrange(lo, hi)
        flipped_at[key] = offset
        return _flip(value, offset, rng.randrange(1, 256))

    rewrite_values(tier_path, corrupt)
    with SSDTier(tier_path, NS, LAYOUT) as tier:
        out = np.empty(BPB, dtype=np.uint8)
        for n, key in enumerate(keys, start=1):
            out[:] = originals[key]  # even a buffer already holding the right bytes is not "valid"
            assert not tier.get_into(key, out), f"{codec} flip at {flipped_at[key.to_bytes(16, 'big')]}"
            assert failures(tier) == n
        s = tier.stats
        assert (s["hits"], s["misses"], s["mismatches"]) == (0, len(keys), 0)
        if region == "payload" and codec == "raw":
            assert s["checksum_failures"] == len(keys)  # only the raw checksum can catch these
        assert tier.verify_all() == (0, len(keys))
        assert tier.verify_all(delete_bad=True) == (0, len(keys)) and len(tier) == 0


@pytest.mark.parametrize("codec", CODECS)
def test_reads_split_over_threads_match_the_callers_thread(
    tier_path: Path, codec: str, monkeypatch, read_path: str
) -> None:
    """A read split over pool threads returns, per block, what one thread returns:
    the same verified bytes, the same misses for absent and corrupted values,
    and the same counters; the tier's read pool is gone after close()."""
    import kvtier.tiers.ssd as ssd_mod

    keys = [BlockKey(i) for i in range(1, 26)]
    originals = {k: bf16_block(k) for k in keys}
    with SSDTier(tier_path, NS, LAYOUT, codec=codec) as tier:
        tier.put_many([(k, originals[k], None) for k in keys[:-3]])  # the last three are absent
    rng = random.Random(codec)
    bad = set(rng.sample(range(len(keys) - 3), 6))

    def corrupt(key: bytes, value: memoryview) -> bytes:
        if int.from_bytes(key, "big") - 1 not in bad:
            return bytes(value)
        return _flip(bytes(value), rng.randrange(HEADER_BYTES, len(value)), rng.randrange(1, 256))

    rewrite_values(tier_path, corrupt)
    monkeypatch.setattr(ssd_mod, "PARALLEL_READ_MIN_BYTES", 0)  # split even these small blocks
    monkeypatch.setattr(ssd_mod, "READ_CHUNK_BYTES", 2 * BPB)  # 13 chunks of 25 blocks, the last one short
    seen = {}
    for threads in (1, 3):
        with SSDTier(tier_path, NS, LAYOUT, read_threads=threads) as tier:
            outs = [np.zeros(BPB, dtype=np.uint8) for _ in keys]
            oks = tier.get_many_into(keys, outs)
            assert (tier._read_pool is not None) == (threads > 1)
            seen[threads] = (oks, tier.stats)
            for i, (k, ok) in enumerate(zip(keys, oks)):
                assert ok == (i not in bad and i < len(keys) - 3)
                if ok:
                    assert np.array_equal(outs[i], originals[k])
        assert tier._read_pool is None
    assert seen[1] == seen[3]
    assert seen[3][1]["misses"] == len(bad) + 3 and failures_from(seen[3][1]) == len(bad)
    with pytest.raises(ConfigError, match="tiers.ssd.read_threads"):
        SSDTier(tier_path, NS, LAYOUT, read_threads=0)


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_and_extended_values_are_decode_failures(tier_path: Path, codec: str) -> None:
    block = bf16_block(11)
    with SSDTier(tier_path, NS, LAYOUT, codec=codec) as tier:
        tier.put_many([(BlockKey(1), block, None)])
    for cut in (0, 1, 4, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 1, -1, "half", "extend"):

        def edit(key: bytes, value: memoryview, cut=cut) -> bytes:
            value = bytes(value)
            if cut == "half":
                return value[: len(value) // 2]
            if cut == "extend":
                return value + b"\0"
            return value[:cut]

        with SSDTier(tier_path, NS, LAYOUT, codec=codec) as tier:
            tier.put_many([(BlockKey(1), block, None)])  # restore the good value
        rewrite_values(tier_path, edit)
        with SSDTier(tier_path, NS, LAYOUT) as tier:
            assert not tier.get_into(BlockKey(1), np.empty(BPB, dtype=np.uint8)), cut
            assert tier.stats["decode_failures"] == 1 and tier.stats["misses"] == 1
            assert list(tier.scan()) == []  # no valid header: not offered for warm restart


def test_foreign_namespace_and_layout_are_misses(tier_path: Path) -> None:
    block = bf16_block(3)
    with SSDTier(tier_path, NS, LAYOUT) as tier:
        tier.put_many([(BlockKey(1), block, None)])
    out = np.empty(BPB, dtype=np.uint8)
    with SSDTier(tier_path, OTHER_NS, LAYOUT) as tier:
        assert not tier.get_into(BlockKey(1), out)
        assert tier.stats["mismatches"] == 1 and tier.stats["misses"] == 1
        assert list(tier.scan()) == [] and [e.key for e in tier.scan(include_foreign=True)] == [1]
        assert tier.verify_all() == (0, 1)
    with SSDTier(tier_path, NS, SAME_SIZE_LAYOUT) as tier:  # same bytes per block, other shape
        assert not tier.get_into(BlockKey(1), out)
        assert tier.stats["mismatches"] == 1
    with SSDTier(tier_path, NS, LAYOUT) as tier:
        assert tier.get_into(BlockKey(1), out) and np.array_equal(out, block)


# ------------------------------------------------------------ capacity, errors


def test_map_full_keeps_earlier_data_and_names_the_setting(tier_path: Path) -> None:
    map_size = 1 << 20  # 1 MiB: room for a few dozen 16 KiB raw blocks
    blocks = {BlockKey(i): random_block(i) for i in range(1, 201)}
    keys = list(blocks)
    with SSDTier(tier_path, NS, LAYOUT, map_size_bytes=map_size, codec="raw") as tier:
        assert tier.put_many([(k, blocks[k], None) for k in keys[:10]]) == 10
        written = tier.put_many([(k, blocks[k], None) for k in keys[10:]])  # does not fit
        assert 0 <= written < 190
        assert tier.stats["map_full"] == 1
        assert f"tiers.ssd.map_size_bytes={map_size}" in tier.last_error
        # Exactly the longest prefix that fit was written; the rest is absent.
        stored = [e.key for e in tier.scan()]
        assert stored == keys[: 10 + written] and tier.stats["puts"] == 10 + written
        rest = keys[10 + written :]
        assert tier.put_many([(k, blocks[k], None) for k in rest]) < len(rest)  # still full: a value, not a crash
        assert tier.stats["map_full"] == 2
        out = np.empty(BPB, dtype=np.uint8)
        stored = [e.key for e in tier.scan()]
        for k in stored:
            assert tier.get_into(k, out) and np.array_equal(out, blocks[k])
        # Deleting makes room again.
        assert tier.delete_many(stored[:8]) == 8
        assert tier.put_many([(keys[-1], blocks[keys[-1]], None)]) == 1


def test_a_put_right_after_evicting_deletes_reuses_their_room(tier_path: Path) -> None:
    """LMDB reuses pages freed by transaction N only from N+2: the put that follows
    an eviction's delete must still fit when the map holds the data once plus
    headroom (a full tier replaced batch by batch, as a store under churn does)."""
    k = 24
    map_size = (k * (BPB + 4096)) * 3 // 2 + (256 << 10)  # the data once, plus half again
    with SSDTier(tier_path, NS, LAYOUT, map_size_bytes=map_size, codec="raw") as tier:
        for round_ in range(5):
            keys = [BlockKey(1000 * round_ + i) for i in range(k)]
            if round_:
                assert tier.delete_many([BlockKey(1000 * (round_ - 1) + i) for i in range(k)]) == k
            assert tier.put_many([(key, random_block(i), None) for i, key in enumerate(keys)]) == k, tier.last_error
        assert tier.stats["map_full"] == 0


def _small_groups(monkeypatch: pytest.MonkeyPatch, blocks: int) -> list[str]:
    """Puts encode ``blocks`` blocks per group from now on; returns the names of the
    threads that encode each group, in the order the groups are encoded."""
    import kvtier.tiers.ssd as ssd_mod
    import threading

    monkeypatch.setattr(ssd_mod, "WRITE_GROUP_BYTES", blocks * BPB)
    names: list[str] = []
    real = ssd_mod.encode_into

    def encode_into(items, *args, **kwargs):
        names.append(threading.current_thread().name)
        return real(items, *args, **kwargs)

    monkeypatch.setattr(ssd_mod, "encode_into", encode_into)
    return names


@pytest.mark.parametrize("codec", ["raw", "bplane-zstd"])
@pytest.mark.parametrize("write_threads", [1, 2, 3])
def test_a_put_of_many_groups_writes_every_block_once(
    tier_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str, write_threads: int
) -> None:
    """A put longer than one group is encoded group by group (on the encoder threads
    when there are any) into at most ``write_threads`` reused buffers, and commits
    the same values as a put of one group."""
    names = _small_groups(monkeypatch, 2)
    blocks = {BlockKey(i): bf16_block(i) for i in range(1, 12)}  # 6 groups, the last of one block
    with SSDTier(tier_path, NS, LAYOUT, codec=codec, write_threads=write_threads) as tier:
        assert tier.put_many([(k, b, None) for k, b in blocks.items()]) == 11
        assert len(names) == 6
        assert names[0] == names[-1] if write_threads == 1 else all("kvtier-ssd-encode" in n for n in names)
        assert len(tier._write_bufs) == min(write_threads, 6)
        assert all(len(b) <= 2 * value_bound(BPB) for b in tier._write_bufs)
        outs = [np.empty(BPB, dtype=np.uint8) for _ in blocks]
        assert tier.get_many_into(list(blocks), outs) == [True] * 11
        assert all(np.array_equal(o, b) for o, b in zip(outs, blocks.values()))
        stored = tier.stats["bytes_written"]
    one_group = tier_path.parent / "one-group"
    monkeypatch.setattr("kvtier.tiers.ssd.WRITE_GROUP_BYTES", 16 * BPB)
    with SSDTier(one_group, NS, LAYOUT, codec=codec, write_threads=write_threads) as tier:
        assert tier.put_many([(k, b, None) for k, b in blocks.items()]) == 11
        assert tier.stats["bytes_written"] == stored


def test_a_put_calls_between_between_groups_and_reads_go_on_meanwhile(
    tier_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``between`` (a writer yielding to loads) runs once between each two groups, inside
    the transaction: a read on another thread meanwhile is served at once, from what was
    committed before, and the put then commits every block."""
    import threading

    _small_groups(monkeypatch, 2)
    old = {BlockKey(i): bf16_block(i) for i in range(100, 103)}
    new = {BlockKey(i): bf16_block(i) for i in range(1, 8)}  # 4 groups
    seen: list[tuple[bool, bool]] = []
    with SSDTier(tier_path, NS, LAYOUT) as tier:
        assert tier.put_many([(k, b, None) for k, b in old.items()]) == 3

        def between() -> None:
            out = np.empty(BPB, dtype=np.uint8)
            got: list[tuple[bool, bool]] = []
            reader = threading.Thread(target=lambda: got.append(
                (tier.get_into(BlockKey(100), out), tier.contains(BlockKey(1)))))
            reader.start()
            reader.join(timeout=10)
            assert got and np.array_equal(out, old[BlockKey(100)])
            seen.append(got[0])

        assert tier.put_many([(k, b, None) for k, b in new.items()], between=between) == 7
        assert seen == [(True, False)] * 3  # old blocks served, the open transaction's not yet visible
        outs = [np.empty(BPB, dtype=np.uint8) for _ in new]
        assert tier.get_many_into(list(new), outs) == [True] * 7
        assert all(np.array_equal(o, b) for o, b in zip(outs, new.values()))


def test_a_between_that_raises_commits_nothing_and_the_next_put_works(
    tier_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _small_groups(monkeypatch, 2)
    blocks = {BlockKey(i): bf16_block(i) for i in range(1, 8)}

    def between() -> None:
        raise RuntimeError("a load's wait failed")

    with SSDTier(tier_path, NS, LAYOUT) as tier:
        with pytest.raises(RuntimeError, match="wait failed"):
            tier.put_many([(k, b, None) for k, b in blocks.items()], between=between)
        assert len(tier) == 0
        assert tier.put_many([(k, b, None) for k, b in blocks.items()]) == 7
        out = np.empty(BPB, dtype=np.uint8)
        assert tier.get_into(BlockKey(7), out) and np.array_equal(out, blocks[BlockKey(7)])


def test_a_put_that_fails_mid_way_commits_nothing(tier_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder error in a later group (after earlier groups were copied into the
    transaction) aborts the whole put: it raises, nothing of it is stored, and
    the blocks stored before are intact."""
    import kvtier.tiers.ssd as ssd_mod

    monkeypatch.setattr(ssd_mod, "WRITE_GROUP_BYTES", 2 * BPB)
    real = ssd_mod.encode_into

    def encode_into(items, *args, **kwargs):
        if any(k == BlockKey(107) for k, _, _ in items):
            raise RuntimeError("injected encoder fault")
        return real(items, *args, **kwargs)

    with SSDTier(tier_path, NS, LAYOUT, write_threads=2) as tier:
        assert tier.put_many([(BlockKey(1), bf16_block(1), None)]) == 1
        monkeypatch.setattr(ssd_mod, "encode_into", encode_into)
        with pytest.raises(RuntimeError, match="injected"):
            tier.put_many([(BlockKey(100 + i), bf16_block(i), None) for i in range(10)])
        assert [e.key for e in tier.scan()] == [BlockKey(1)]
        assert tier.stats["puts"] == 1
        monkeypatch.setattr(ssd_mod, "encode_into", real)
        assert tier.put_many([(BlockKey(100 + i), bf16_block(i), None) for i in range(10)]) == 10


def test_map_full_in_a_put_of_many_groups_keeps_the_prefix_that_fits(
    tier_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The map fills in a later group of a pipelined put: the longest prefix that
    fits is committed, exactly, and its stored bytes are counted."""
    _small_groups(monkeypatch, 3)
    blocks = {BlockKey(i): random_block(i) for i in range(1, 121)}
    with SSDTier(tier_path, NS, LAYOUT, map_size_bytes=1 << 20, codec="raw", write_threads=2) as tier:
        written = tier.put_many([(k, b, None) for k, b in blocks.items()])
        assert 3 < written < 120 and tier.stats["map_full"] == 1
        assert [e.key for e in tier.scan()] == list(blocks)[:written]
        assert tier.stats["bytes_written"] == written * (HEADER_BYTES + BPB)


def test_a_put_whose_encoder_was_shut_down_encodes_on_the_callers_thread(
    tier_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    names = _small_groups(monkeypatch, 2)
    blocks = {BlockKey(i): bf16_block(i) for i in range(1, 8)}
    with SSDTier(tier_path, NS, LAYOUT, write_threads=2) as tier:
        dead = ThreadPoolExecutor(1)
        dead.shutdown()
        monkeypatch.setattr(tier, "_encoder", lambda: dead)
        assert tier.put_many([(k, b, None) for k, b in blocks.items()]) == 7
        assert len(names) == 4 and not any("kvtier-ssd-encode" in n for n in names)
        outs = [np.empty(BPB, dtype=np.uint8) for _ in blocks]
        assert tier.get_many_into(list(blocks), outs) == [True] * 7
        assert all(np.array_equal(o, b) for o, b in zip(outs, blocks.values()))


def test_unwritable_directory_raises_storage_error(tmp_path: Path) -> None:
    regular_file = tmp_path / "not-a-dir"
    regular_file.write_bytes(b"x")
    for bad in (regular_file / "ssd", regular_file):
        with pytest.raises(StorageError, match="tiers.ssd.path") as info:
            SSDTier(bad, NS, LAYOUT)
        assert str(bad) in str(info.value)
    with pytest.raises(StorageError, match="tiers.ssd.path"):
        SSDTier(tmp_path / "missing", NS, LAYOUT, readonly=True)


def test_sync_false_is_flushed_on_close(tier_path: Path) -> None:
    with SSDTier(tier_path, NS, LAYOUT, sync=False) as tier:
        tier.put_many([(BlockKey(1), bf16_block(1), None)])
    with SSDTier(tier_path, NS, LAYOUT) as tier:
        assert tier.get_into(BlockKey(1), bytearray(BPB))


# ------------------------------------------------------- decode property tests

SMALL = KVLayout(1, 1, 512, "bfloat16", 2, arrangement="mla")  # 2 KiB
SMALL_CTX = ValueContext.of(NS, SMALL)
SMALL_RAWS = {
    "bf16": bf16_block(5, SMALL.bytes_per_block).tobytes(),
    "random": random_block(5, SMALL.bytes_per_block).tobytes(),
    "zeros": bytes(SMALL.bytes_per_block),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=3 * SMALL.bytes_per_block))
def test_decode_of_random_bytes_never_raises_or_succeeds(data: bytes) -> None:
    counters: dict[str, int] = {}
    assert not decode_into(data, bytearray(SMALL.bytes_per_block), SMALL_CTX, counters, key=K)
    assert sum(counters.values()) == 1


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    codec=st.sampled_from(CODECS),
    kind=st.sampled_from(sorted(SMALL_RAWS)),
    edits=st.lists(
        st.tuples(st.sampled_from(["flip", "cut", "insert", "delete"]), st.integers(0, 10**6), st.integers(1, 255)),
        min_size=1,
        max_size=4,
    ),
)
def test_decode_of_mutated_values_never_returns_wrong_bytes(codec: str, kind: str, edits: list) -> None:
    raw = SMALL_RAWS[kind]
    original = encode(raw, SMALL_CTX, codec, key=K)
    value = bytearray(original)
    for op, pos, byte in edits:
        pos %= len(value) + 1
        if op == "flip" and pos < len(value):
            value[pos] ^= byte
        elif op == "cut":
            del value[pos:]
        elif op == "insert":
            value[pos:pos] = bytes([byte])
        elif op == "delete" and pos < len(value):
            del value[pos]
    out = bytearray(b"\xaa" * SMALL.bytes_per_block)
    counters: dict[str, int] = {}
    ok = decode_into(bytes(value), out, SMALL_CTX, counters, key=K)
    if ok:
        assert bytes(out) == raw, "a mutated value decoded to wrong bytes and was called valid"
        assert not counters
    else:
        assert sum(counters.values()) == 1
    if bytes(value) == original:
        assert ok


def test_map_resize_for_deletes_is_safe_with_concurrent_readers(tier_path: Path) -> None:
    # Deletes on a full map grow it briefly (set_mapsize); zero-copy reads in other
    # threads must never run across that (they would read unmapped memory).
    import threading

    blocks = {BlockKey(i): bf16_block(i) for i in range(1, 9)}
    errors: list[str] = []
    stop = threading.Event()
    with SSDTier(tier_path, NS, LAYOUT, map_size_bytes=1 << 20) as tier:
        tier.put_many([(k, b, None) for k, b in blocks.items()])

        def reader() -> None:
            outs = [np.empty(BPB, dtype=np.uint8) for _ in blocks]
            while not stop.is_set():
                if tier.get_many_into(list(blocks), outs) != [True] * len(blocks):
                    errors.append(f"miss: {tier.stats}")
                if not all(np.array_equal(o, b) for o, b in zip(outs, blocks.values())):
                    errors.append("wrong bytes")

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            for i in range(30):
                with tier._headroom(1 << 20):  # what a delete on a full map does
                    tier.put_many([(BlockKey(100 + i), random_block(i), None)])
                tier.delete_many([BlockKey(100 + i)])
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert errors == []
        assert tier._env.info()["map_size"] == 1 << 20  # set back afterwards


def test_close_waits_for_reads_in_flight(tier_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() unmaps the file only once no read holds views into it: reads on
    other threads (split over the pool too) either return verified bytes or
    raise ProtocolError for a closed tier, and never read unmapped memory."""
    import threading

    import kvtier.tiers.ssd as ssd_mod

    monkeypatch.setattr(ssd_mod, "PARALLEL_READ_MIN_BYTES", 0)
    monkeypatch.setattr(ssd_mod, "READ_CHUNK_BYTES", 4 * BPB)  # 8 chunks: the pool takes part
    blocks = {BlockKey(i): bf16_block(i) for i in range(1, 33)}
    for attempt in range(10):
        path = tier_path / str(attempt)
        with SSDTier(path, NS, LAYOUT) as tier:
            tier.put_many([(k, b, None) for k, b in blocks.items()])
        tier = SSDTier(path, NS, LAYOUT, read_threads=2)
        outcomes: list[str] = []
        started = threading.Barrier(4)

        def reader(tier: SSDTier, outcomes: list[str], started: threading.Barrier) -> None:
            outs = [np.empty(BPB, dtype=np.uint8) for _ in blocks]
            started.wait()
            while True:
                try:
                    oks = tier.get_many_into(list(blocks), outs)
                except ProtocolError:
                    outcomes.append("closed")
                    return
                if oks != [True] * len(blocks) or not all(np.array_equal(o, b) for o, b in zip(outs, blocks.values())):
                    outcomes.append("wrong")
                    return

        threads = [threading.Thread(target=reader, args=(tier, outcomes, started)) for _ in range(3)]
        for t in threads:
            t.start()
        started.wait()
        tier.close()
        for t in threads:
            t.join(timeout=30)
        assert outcomes == ["closed"] * 3


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(sorted(SMALL_RAWS)),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=3),
    other_key=st.booleans(),
)
def test_raw_fast_path_accepts_only_what_the_general_path_accepts(kind: str, edits: list, other_key: bool) -> None:
    """The raw codec's one-unpack read path (``_decode_raw_fast``) never accepts a
    value that the general path rejects, and accepts every intact raw value."""
    from kvtier.tiers.codec import DecodeOutcome, _decode_raw_fast, decode_outcome

    raw = SMALL_RAWS[kind]
    value = bytearray(encode(raw, SMALL_CTX, "raw", key=K))
    for pos, byte in edits:
        value[pos % len(value)] ^= byte
    key = BlockKey(K + 1) if other_key else K
    out = bytearray(SMALL.bytes_per_block)
    fast = _decode_raw_fast(bytes(value), out, SMALL_CTX, key)
    general = decode_outcome(bytes(value), bytearray(SMALL.bytes_per_block), SMALL_CTX, key=key)
    if fast:
        assert general is DecodeOutcome.OK and bytes(out) == raw
    if not edits and not other_key:
        assert fast  # the common case takes the fast path


def test_a_read_whose_pool_was_shut_down_reads_on_the_callers_thread(
    tier_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() on another thread may shut the read pool down between a read
    taking it and handing it work; the read then finishes alone."""
    from concurrent.futures import ThreadPoolExecutor

    import kvtier.tiers.ssd as ssd_mod

    monkeypatch.setattr(ssd_mod, "PARALLEL_READ_MIN_BYTES", 0)
    monkeypatch.setattr(ssd_mod, "READ_CHUNK_BYTES", BPB)
    blocks = {BlockKey(i): bf16_block(i) for i in range(1, 9)}
    with SSDTier(tier_path, NS, LAYOUT, read_threads=2) as tier:
        tier.put_many([(k, b, None) for k, b in blocks.items()])
        dead = ThreadPoolExecutor(1)
        dead.shutdown()
        monkeypatch.setattr(tier, "_pool", lambda: dead)
        outs = [np.empty(BPB, dtype=np.uint8) for _ in blocks]
        assert tier.get_many_into(list(blocks), outs) == [True] * len(blocks)
        assert all(np.array_equal(o, b) for o, b in zip(outs, blocks.values()))


def test_the_c_read_path_is_built_where_a_compiler_is() -> None:
    """setup.py builds ``kvtier.tiers._rawread`` as optional: a failed build would
    leave every SSD read on the slower Python path without a word, so where a C
    compiler, the Python headers and the xxHash library are present (CI,
    developer machines) it must have been built."""
    import ctypes.util
    import shutil
    import sys
    import sysconfig

    from kvtier.tiers.codec import native_raw_read

    compiler = shutil.which("cc") or shutil.which("gcc")
    headers = Path(sysconfig.get_paths()["include"], "Python.h").is_file()
    if not sys.platform.startswith("linux") or not compiler or not headers:
        pytest.skip("no C compiler or Python headers here: the pure-Python read path is expected")
    if ctypes.util.find_library("xxhash") is None:
        pytest.skip("no xxHash library (libxxhash0) here: the pure-Python read path is expected")
    assert native_raw_read(), "kvtier.tiers._rawread was not built; reinstall with `pip install -e .`"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(sorted(SMALL_RAWS)),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=3),
    other_key=st.booleans(),
    codec=st.sampled_from(CODECS),
    ctx_kind=st.sampled_from(["same", "other_namespace", "other_layout"]),
)
def test_c_read_path_accepts_only_what_the_general_path_accepts(
    kind: str, edits: list, other_key: bool, codec: str, ctx_kind: str
) -> None:
    """The C batch read (``decode_raw_batch``) never accepts a value the general
    decoder rejects (bit flips anywhere, another key, namespace, layout or
    codec), and accepts every intact raw value of the tier's own."""
    from kvtier.tiers.codec import DecodeOutcome, decode_outcome, decode_raw_batch, native_raw_read

    if not native_raw_read():
        pytest.skip("kvtier.tiers._rawread is not built here")
    raw = SMALL_RAWS[kind]
    value = bytearray(encode(raw, SMALL_CTX, codec, key=K))
    for pos, byte in edits:
        value[pos % len(value)] ^= byte
    key = BlockKey(K + 1) if other_key else K
    ctx = {"same": SMALL_CTX, "other_namespace": ValueContext.of(OTHER_NS, SMALL),
           "other_layout": ValueContext.of(NS, KVLayout(1, 1, 512, "bfloat16", 2, arrangement="fused"))}[ctx_kind]
    out = bytearray(SMALL.bytes_per_block)
    [fast] = decode_raw_batch([bytes(value)], [key.to_bytes(16, "big")], [out], ctx)
    general = decode_outcome(bytes(value), bytearray(SMALL.bytes_per_block), ctx, key=key)
    if fast:
        assert general is DecodeOutcome.OK and bytes(out) == raw
    if codec == "raw" and not edits and not other_key and ctx_kind == "same":
        assert fast


def test_c_read_path_refuses_what_it_cannot_check() -> None:
    """Absent values, output buffers of the wrong size, read-only or strided ones,
    and values that are not contiguous are "not shown OK" (the general decoder
    then says why or raises for the caller's bug); bad arguments raise."""
    from kvtier.tiers.codec import decode_raw_batch, native_raw_read

    if not native_raw_read():
        pytest.skip("kvtier.tiers._rawread is not built here")
    raw = SMALL_RAWS["bf16"]
    value = encode(raw, SMALL_CTX, "raw", key=K)
    kb = K.to_bytes(16, "big")
    n = SMALL.bytes_per_block
    strided = np.zeros(2 * n, dtype=np.uint8)[::2]
    wide = np.frombuffer(value + value, dtype=np.uint8)[::2]  # not contiguous
    outs = [bytearray(n), bytearray(n + 1), bytes(n), strided, bytearray(n), bytearray(n)]
    got = decode_raw_batch([value, value, value, value, None, wide], [kb] * 6, outs, SMALL_CTX)
    assert got == [True, False, False, False, False, False]
    assert bytes(outs[0]) == raw and not any(outs[1]) and not strided.any()
    with pytest.raises(TypeError, match="16 bytes"):
        decode_raw_batch([value], [kb[:8]], [bytearray(n)], SMALL_CTX)
    with pytest.raises(ValueError, match="same length"):
        decode_raw_batch([value, value], [kb], [bytearray(n)], SMALL_CTX)


def test_batched_raw_encoding_gives_the_same_bytes_as_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``encode_raw_many_into`` (payloads copied and summed in C) writes exactly the
    values ``encode`` gives, each at its slot; without the C module it declines."""
    import kvtier.tiers.codec as codec_mod
    from kvtier.tiers.codec import encode_raw_many_into, native_raw_read, value_bound

    if not native_raw_read():
        pytest.skip("kvtier.tiers._rawread not built")
    monkeypatch.setattr(codec_mod, "_now_s", lambda: 1_700_000_000)
    raws = [SMALL_RAWS[k] for k in sorted(SMALL_RAWS)]
    items = [(BlockKey(K + i), np.frombuffer(r, dtype=np.uint8), BlockKey(K + i - 1) if i else None)
             for i, r in enumerate(raws)]
    slot = value_bound(SMALL.bytes_per_block)
    staging = np.full(len(items) * slot, 0xAB, dtype=np.uint8)
    sizes = encode_raw_many_into(items, SMALL_CTX, staging, slot)
    for i, ((key, raw, parent), n) in enumerate(zip(items, sizes)):
        assert bytes(staging[i * slot:i * slot + n]) == encode(raw, SMALL_CTX, "raw", parent, key=key)
    with pytest.raises(ValueError, match="holds"):  # a slot too small: refused, not overrun
        encode_raw_many_into(items[:1], SMALL_CTX, staging[: slot // 2], slot // 2)
    monkeypatch.setattr(codec_mod, "_rawread", None)
    assert encode_raw_many_into(items, SMALL_CTX, staging, slot) is None


BIG = KVLayout(8, 8, 128, "bfloat16", 16)  # 512 KiB: 8 chunks of 64 KiB, the least copied + summed chunk by chunk
BIG_CTX = ValueContext.of(NS, BIG)


def test_large_values_are_copied_and_summed_chunk_by_chunk_and_still_checked() -> None:
    """Values of 8 or more 64 KiB chunks are copied and summed a chunk at a time (xxHash's
    streaming calls, bound only where they agree with the one-shot sum): intact values
    read right, and a flipped bit in any chunk (first, middle, last byte) is a miss."""
    from kvtier.tiers import codec as codec_mod
    from kvtier.tiers.codec import decode_raw_batch, native_raw_read

    if not native_raw_read():
        pytest.skip("kvtier.tiers._rawread is not built here")
    assert codec_mod._rawread.streaming()
    raw = np.random.default_rng(5).integers(0, 256, BIG.bytes_per_block, dtype=np.uint8).tobytes()
    value = encode(raw, BIG_CTX, "raw", key=K)
    kb = K.to_bytes(16, "big")
    flipped = []
    for pos in (HEADER_BYTES, HEADER_BYTES + len(raw) // 2 + 3, len(value) - 1):
        v = bytearray(value)
        v[pos] ^= 0x04
        flipped.append(bytes(v))
    outs = [bytearray(len(raw)) for _ in range(4)]
    assert decode_raw_batch([value] + flipped, [kb] * 4, outs, BIG_CTX) == [True, False, False, False]
    assert bytes(outs[0]) == raw
    dsts = [np.zeros(len(raw), dtype=np.uint8)]
    assert codec_mod._rawread.copy_sum_many(dsts, [raw]) == [codec_mod.checksum(raw)] and dsts[0].tobytes() == raw


@pytest.mark.parametrize("layout", [SMALL, BIG], ids=["small", "chunked"])
def test_a_payload_read_in_place_is_checked_where_it_landed(layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    """``raw_headers_into`` + the block is the value ``encode`` gives (what the remote tier
    sends from a registered buffer); ``decode_raw_batch(in_place=True)`` checks a header
    alone against a payload already in the output buffer: a flip in either, another key,
    a payload of another length or a whole value in place of the header is not OK."""
    import kvtier.tiers.codec as codec_mod
    from kvtier.tiers.codec import decode_raw_batch, native_raw_read, raw_headers_into

    if not native_raw_read():
        pytest.skip("kvtier.tiers._rawread is not built here")
    monkeypatch.setattr(codec_mod, "_now_s", lambda: 1_700_000_000)  # the headers' stored_at
    ctx = ValueContext.of(NS, layout)
    raw = np.random.default_rng(6).integers(0, 256, layout.bytes_per_block, dtype=np.uint8)
    headers = np.zeros(2 * HEADER_BYTES, dtype=np.uint8)
    assert raw_headers_into([(K, raw, None), (BlockKey(K + 1), raw, K)], ctx, headers)
    value = encode(raw.tobytes(), ctx, "raw", None, key=K)
    assert bytes(headers[:HEADER_BYTES]) == value[:HEADER_BYTES]
    header = bytes(headers[:HEADER_BYTES])
    bad_header = bytearray(header)
    bad_header[30] ^= 1
    outs = [bytearray(raw.tobytes()) for _ in range(6)]
    outs[1][len(raw) - 1] ^= 0x80  # the payload flipped where it landed
    outs[5] = bytearray(len(raw) - 2)  # another length
    kb = K.to_bytes(16, "big")
    values = [header, header, bytes(bad_header), header, value, header]
    keys = [kb, kb, kb, BlockKey(K + 5).to_bytes(16, "big"), kb, kb]
    assert decode_raw_batch(values, keys, outs, ctx, in_place=True) == [True, False, False, False, False, False]
    assert decode_raw_batch([header], [kb], [bytearray(raw.tobytes())], ctx) == [False]  # a header is no value
    monkeypatch.setattr(codec_mod, "_rawread", None)
    assert not raw_headers_into([(K, raw, None)], ctx, headers)


def test_copy_many_splits_a_copy_with_a_second_thread_and_copies_every_byte() -> None:
    """``codec.copy_many`` (the connector's split DRAM copy): spans of any length, cut at
    half the bytes between this thread and the C module's worker, land whole and touch
    nothing past them; a destination too short is refused before anything is copied;
    a forked child starts a worker of its own."""
    import os

    from kvtier.tiers.codec import copy_many, native_raw_read

    if not native_raw_read():
        pytest.skip("kvtier.tiers._rawread is not built here")
    rng = np.random.default_rng(9)
    for sizes in ([1], [0, 0], [5, 7, 9], [1 << 20] * 5, [3, 3 << 20, 17], []):
        srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
        dsts = [np.zeros(n + 3, np.uint8) for n in sizes]
        assert copy_many(dsts, srcs)
        assert all(np.array_equal(d[:len(s)], s) and not d[len(s):].any() for d, s in zip(dsts, srcs)), sizes
    keep = np.zeros(8, np.uint8)
    with pytest.raises(ValueError, match="holds 3 bytes"):
        copy_many([keep, np.zeros(3, np.uint8)], [np.ones(8, np.uint8), np.ones(4, np.uint8)])
    assert not keep.any()
    pid = os.fork()
    if pid == 0:  # the child: no worker yet (the parent's did not come along); it must not hang
        src = [rng.integers(0, 256, 2 << 20, dtype=np.uint8) for _ in range(3)]
        dst = [np.zeros(2 << 20, np.uint8) for _ in range(3)]
        copy_many(dst, src)
        os._exit(0 if all(np.array_equal(a, b) for a, b in zip(dst, src)) else 1)
    assert os.waitpid(pid, 0)[1] == 0


# ------------------------------------------------------- scatter_many (one copy)

def _landing(n: int, part: int = BPB // 4) -> tuple[list[np.ndarray], np.ndarray]:
    """Two destination buffers, each value's four quarters landing at scattered places in them
    (block i's quarter q into buffer q % 2, at slot (n - 1 - i) * 2 + q // 2): a table in row order."""
    dsts = [np.zeros(2 * n * part, dtype=np.uint8) for _ in range(2)]
    rows = [(i, q % 2, ((n - 1 - i) * 2 + q // 2) * part, part) for i in range(n) for q in range(4)]
    return dsts, np.array(rows, dtype=np.int64)


def _landed(dsts: list[np.ndarray], table: np.ndarray, i: int) -> np.ndarray:
    return np.concatenate([dsts[d][off:off + ln] for b, d, off, ln in table.tolist() if b == i])


@pytest.mark.skipif(not native_raw_read(), reason="the C read path (kvtier.tiers._rawread) is not built here")
def test_scatter_many_lands_verified_values_in_their_spans_and_stops_at_the_first_it_cannot_show(
        tier_path: Path) -> None:
    blocks = [random_block(s) for s in range(6)]
    with SSDTier(tier_path, NS, LAYOUT) as tier:
        assert tier.put_many([(BlockKey(i), b, None) for i, b in enumerate(blocks[:4])]) == 4
        assert tier.put_many([(BlockKey(4), blocks[4], None)], codec="zstd") == 1  # compressed: not this path
        dsts, table = _landing(4)
        assert tier.scatter_many([BlockKey(i) for i in range(4)], dsts, table) == 4
        assert all(np.array_equal(_landed(dsts, table, i), blocks[i]) for i in range(4))
        assert tier.stats["hits"] == 4

        # block 1 corrupt (one payload bit), then a compressed and an absent one: each stops the run
        # there, and nothing of that block (or after it) is written
        with tier._env.begin(write=True) as txn:
            key = key_to_bytes(BlockKey(1))
            value = bytearray(txn.get(key))
            value[HEADER_BYTES + 5] ^= 0x04
            txn.put(key, bytes(value))
        for keys, stop in (([0, 1, 2], 1), ([0, 4, 2], 1), ([0, 9, 2], 1), ([0, 2, 3], 3)):
            dsts, table = _landing(3)
            assert tier.scatter_many([BlockKey(k) for k in keys], dsts, table) == stop, keys
            for i in range(3):
                want = blocks[keys[i]] if i < stop else np.zeros(BPB, dtype=np.uint8)
                assert np.array_equal(_landed(dsts, table, i), want), (keys, i)
        out = np.zeros(BPB, dtype=np.uint8)  # the general decoder reads the compressed one, and says why of the other
        assert tier.get_many_into([BlockKey(4), BlockKey(1)], [out, np.zeros(BPB, dtype=np.uint8)]) == [True, False]
        assert np.array_equal(out, blocks[4]) and tier.stats["checksum_failures"] >= 1


@pytest.mark.skipif(not native_raw_read(), reason="the C read path (kvtier.tiers._rawread) is not built here")
def test_scatter_many_refuses_a_table_outside_its_buffers_or_out_of_order_and_writes_nothing(tier_path: Path) -> None:
    blocks = [random_block(s) for s in range(2)]
    with SSDTier(tier_path, NS, LAYOUT) as tier:
        tier.put_many([(BlockKey(i), b, None) for i, b in enumerate(blocks)])
        keys = [BlockKey(0), BlockKey(1)]
        dsts, table = _landing(2)
        beyond = table.copy()
        beyond[-1, 2] = dsts[beyond[-1, 1]].size - 8  # the last span runs past its buffer
        shuffled = table[::-1].copy()  # block 1's spans before block 0's
        for bad in (beyond, shuffled):
            with pytest.raises(ValueError, match="out of order or outside its buffers"):
                tier.scatter_many(keys, dsts, bad)
            assert not any(d.any() for d in dsts)
        short = table[table[:, 0] == 0][:3]  # block 0's spans cover 3/4 of it: not its raw length
        assert tier.scatter_many(keys[:1], dsts, short) == 0 and not any(d.any() for d in dsts)
