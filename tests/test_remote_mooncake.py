"""The remote tier on a real Mooncake Store: ``mooncake_master`` on loopback and
kvtier's :class:`~kvtier.tiers.remote.MooncakeTier` clients over TCP.

Needs ``mooncake-transfer-engine-non-cuda`` (which ships ``mooncake_master``)
and, even over TCP, the Debian libraries libibverbs1, libnl-3-200 and
libnl-route-3-200 (``scripts/test.sh`` installs all three for the full
suite). Without them these tests skip, except with
``KVTIERTEST_REQUIRE_MOONCAKE=1`` (CI), where they fail.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvtier.benchmarks.remote import LocalMaster, free_port, mooncake_problem
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey, Namespace
from kvtier.layout import KVLayout
from kvtier.tiers.codec import HEADER_BYTES

LAYOUT = KVLayout(2, 2, 64, "bfloat16", 16)  # 16 KiB per block
NS = Namespace("remote-test", "bfloat16", "fused", 16)


def _require() -> None:
    problem = mooncake_problem()
    if problem is None:
        return
    if os.environ.get("KVTIERTEST_REQUIRE_MOONCAKE") == "1":
        pytest.fail(problem + " (scripts/test.sh installs mooncake-transfer-engine-non-cuda)")
    pytest.skip(problem)


class Master(LocalMaster):
    """The bench's local master, handing out tiers of this test's layout."""

    def kill(self) -> None:
        self.stop()

    def tier(self, namespace: Namespace = NS, **kw):
        from kvtier.tiers.remote import MooncakeTier

        return MooncakeTier(namespace, LAYOUT, master=self.master, metadata_server=self.metadata_server,
                            segment_bytes=64 << 20, buffer_bytes=32 << 20, **kw)


@pytest.fixture
def master(tmp_path):
    _require()
    m = Master(tmp_path / "master.log").start()
    yield m
    m.kill()


def _blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, LAYOUT.bytes_per_block, dtype=np.uint8) for _ in range(n)]


def test_blocks_round_trip_between_two_clients_and_misses_are_misses(master) -> None:
    writer, reader = master.tier(), master.tier(codec="auto")
    try:
        keys = [BlockKey(1000 + i) for i in range(8)]
        blocks = _blocks(8, seed=1)
        assert writer.put_many([(k, b, keys[i - 1] if i else None) for i, (k, b) in enumerate(zip(keys, blocks))]) == 8
        outs = [np.empty(LAYOUT.bytes_per_block, dtype=np.uint8) for _ in range(9)]
        oks = reader.get_many_into(keys + [BlockKey(5)], outs)
        assert oks == [True] * 8 + [False]  # the other client reads them; an absent key misses
        assert all(np.array_equal(a, b) for a, b in zip(blocks, outs))
        assert reader.contains_many([keys[0], BlockKey(5)]) == [True, False]
        assert writer.delete_many(keys[:2]) == 2
        assert reader.get_many_into(keys[:3], outs[:3]) == [False, False, True]
    finally:
        writer.close()
        reader.close()


def test_a_corrupt_or_misplaced_value_is_a_miss_and_tenants_never_meet(master) -> None:
    a = master.tier()
    b = master.tier(Namespace("remote-test", "bfloat16", "fused", 16, tenant="other"))
    try:
        keys = [BlockKey(7), BlockKey(8)]
        blocks = _blocks(2, seed=2)
        assert a.put_many([(keys[0], blocks[0], None), (keys[1], blocks[1], keys[0])]) == 2
        out = [np.empty(LAYOUT.bytes_per_block, dtype=np.uint8) for _ in range(2)]
        # tenant "other": the same keys are other objects there; nothing is found
        assert b.get_many_into(keys, out) == [False, False]
        raw = a._store.get(a.object_name(keys[0]))
        flipped = bytearray(raw)
        flipped[HEADER_BYTES + 100] ^= 0x10
        assert a._store.upsert(a.object_name(keys[0]), bytes(flipped)) == 0
        # a's valid value of key 8 copied under key 7's name, and into tenant "other"'s name of key 8
        assert a._store.upsert(b.object_name(keys[1]), a._store.get(a.object_name(keys[1]))) == 0
        assert a.get_many_into(keys, out) == [False, True]
        assert b.get_many_into(keys, out) == [False, False]  # foreign namespace in the header: a miss
        assert sum(a.counters[k] for k in a.counters if k not in ("put_blocks", "put_bytes", "get_hit_blocks",
                                                                    "missing", "removed_corrupt", "put_staged_blocks",
                                                                    "put_direct_blocks", "get_direct_blocks")) == 1
        assert b.counters["missing"] >= 2
        # the corrupt value was removed, so a put writes key 7 afresh and it hits again
        assert a.counters["removed_corrupt"] == 1 and a.contains_many(keys[:1]) == [False]
        assert a.put_many([(keys[0], blocks[0], None)]) == 1
        assert a.get_many_into(keys[:1], out[:1]) == [True] and np.array_equal(out[0], blocks[0])
    finally:
        a.close()
        b.close()


def test_a_dead_master_makes_misses_and_a_restarted_one_is_used_again(master) -> None:
    """The master is killed: reads miss and writes fail, counted, nothing raises (the blocks'
    bytes lived in the master's object map: they are gone); after the first call that fails,
    the tier counts the store as down and its calls fail at once. It comes back on the same
    ports: the client reconnects by itself, a probe finds it and new blocks hit again."""
    t = master.tier()
    try:
        keys = [BlockKey(21), BlockKey(22)]
        assert t.put_many([(k, b, None) for k, b in zip(keys, _blocks(2, seed=3))]) == 2
        master.kill()
        out = [np.empty(LAYOUT.bytes_per_block, dtype=np.uint8) for _ in range(2)]
        start = time.monotonic()
        assert t.get_many_into(keys, out) == [False, False]
        assert t.put_many([(BlockKey(23), out[0], None)]) == 0
        assert time.monotonic() - start < 20 and t.counters["client_down"] == 1, dict(t.counters)
        # down: every call fails at once (Mooncake's client waits 4-9 s a call for a master that is gone:
        # without this, a queue of writes blocked its lane for minutes), save one probe every 0.5 s
        start = time.monotonic()
        for i in range(20):
            assert t.put_many([(BlockKey(30 + i), out[0], None)]) == 0
            assert t.get_many_into(keys, out) == [False, False] and t.contains_many(keys) == [False, False]
        assert time.monotonic() - start < 5, dict(t.counters)
        assert t.counters["client_down_skips"] >= 50 and t.down, dict(t.counters)
        master.start()
        block = _blocks(1, seed=4)[0]
        deadline = time.monotonic() + 30
        while t.put_many([(BlockKey(24), block, None)]) != 1:
            assert time.monotonic() < deadline, dict(t.counters)
            time.sleep(0.5)
        assert t.get_many_into([BlockKey(24)], out[:1]) == [True] and np.array_equal(out[0], block)
        assert not t.down and t.counters["client_up_again"] == 1, dict(t.counters)
    finally:
        t.close()


def test_puts_and_gets_from_several_threads_keep_their_bytes(master) -> None:
    """TieredStore's mover runs puts on two threads: each put (and get) has the staging
    buffer to itself (without the tier's locks this test fails: values cross)."""
    from concurrent.futures import ThreadPoolExecutor

    t = master.tier()
    try:
        chains = [[BlockKey(1000 * c + i) for i in range(20)] for c in range(4)]
        data = [_blocks(20, seed=10 + c) for c in range(4)]

        def put(c: int) -> int:
            return t.put_many([(k, b, None) for k, b in zip(chains[c], data[c])])

        def get(c: int) -> bool:
            outs = [np.empty(LAYOUT.bytes_per_block, dtype=np.uint8) for _ in range(20)]
            return all(t.get_many_into(chains[c], outs)) and all(np.array_equal(a, b) for a, b in zip(outs, data[c]))

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(put, range(4))) == [20] * 4
            assert all(pool.map(get, range(4)))
    finally:
        t.close()


def test_puts_into_a_full_store_fail_for_space_counted_apart_and_nothing_read_is_wrong(master) -> None:
    """The cause of the remote puts the soak saw fail: Mooncake frees a full store's space
    ``eviction_ratio`` (5%) of a segment at a time, and a put that finds less free space than it
    needs fails its values (``NO_AVAILABLE_HANDLE``). Written quickly, 48 MiB into a 16 MiB
    segment: some puts fail (here more than half), every one of them counted as
    ``put_no_space_blocks``; the store keeps taking puts, and every value read back is the block
    written."""
    from kvtier.tiers.remote import MooncakeTier

    t = MooncakeTier(NS, LAYOUT, master=master.master, metadata_server=master.metadata_server,
                     segment_bytes=16 << 20, buffer_bytes=16 << 20)
    try:
        keys = [BlockKey(70_000 + i) for i in range(3072)]
        blocks = _blocks(16, seed=5)  # 16 distinct payloads, reused: the bytes do not matter here
        written = [t.put_many([(k, blocks[j], None) for j, k in enumerate(keys[i:i + 16])])
                   for i in range(0, len(keys), 16)]
        c = t.counters
        assert c["put_failed_blocks"] > 0, dict(c)  # the store was full at some point
        assert c["put_no_space_blocks"] == c["put_failed_blocks"], dict(c)  # and for no other reason
        assert c["put_blocks"] == sum(written) and sum(written[-32:]) > 0, (written, dict(c))  # still taking puts
        outs = [np.empty(LAYOUT.bytes_per_block, dtype=np.uint8) for _ in range(16)]
        hits = 0
        for b in range(len(written) - 64, len(written)):  # the latest puts that wrote: what the store still holds
            if not written[b]:
                continue
            oks = t.get_many_into(keys[16 * b:16 * b + 16], outs)
            assert all(np.array_equal(outs[j], blocks[j]) for j in range(16) if oks[j])
            hits += sum(oks)
        assert hits > 0
    finally:
        t.close()


def test_a_pinned_put_is_soft_pinned_in_the_master(master) -> None:
    t = master.tier()
    try:
        blocks = _blocks(3, seed=5)
        assert t.put_many([(BlockKey(31 + i), b, None) for i, b in enumerate(blocks)], pin_ttl_s=30) == 3
        assert t.put_many([(BlockKey(40), blocks[0], None)]) == 1
        assert master.soft_pinned_keys() == 3 and t.counters["put_pinned_blocks"] == 3
    finally:
        t.close()


def test_blocks_in_a_registered_region_move_with_no_copy_and_stay_checked(master) -> None:
    """Raw blocks in a region given to ``register_region`` (an engine's staging ring) are put
    from and read into it directly: the tier's staging buffers are never made. A flipped
    bit is still a miss (checked where it landed) and is removed; a value of another codec,
    or a buffer outside the region, goes through the staging buffer and reads right."""
    t = master.tier()
    try:
        n = 20  # more than one batch of GET_SLOTS
        src = np.stack(_blocks(n, seed=41))
        dst = np.zeros_like(src)
        assert t.register_region(src) and t.register_region(dst)
        keys = [BlockKey(500 + i) for i in range(n)]
        assert t.put_many([(k, src[i], keys[i - 1] if i else None) for i, k in enumerate(keys)], pin_ttl_s=30) == n
        assert t.get_many_into(keys, list(dst)) == [True] * n and np.array_equal(dst, src)
        assert t._put_staging is None and t._get_staging is None  # nothing went through the staging copies
        assert master.soft_pinned_keys() == n and t.counters["put_direct_blocks"] == n
        more = [BlockKey(600 + i) for i in range(3)]  # one there already, unpinned: the batch upserts, pinning it
        assert t.put_many([(more[0], src[0], None)]) == 1 and master.soft_pinned_keys() == n
        assert t.put_many([(k, src[i], None) for i, k in enumerate(more)], pin_ttl_s=30) == 3
        assert master.soft_pinned_keys() == n + 3 and t.counters["put_staged_blocks"] == 3

        value = bytearray(t._store.get(t.object_name(keys[2])))
        value[HEADER_BYTES + 7] ^= 1
        assert t._store.upsert(t.object_name(keys[2]), bytes(value)) == 0
        dst[:] = 0
        assert t.get_many_into(keys[:4], list(dst[:4])) == [True, True, False, True]
        assert t.counters["checksum_failures"] == 1 and t.counters["removed_corrupt"] == 1
        assert t.contains_many(keys[2:3]) == [False]

        assert t.put_many([(keys[2], src[2], keys[1])], codec="zstd") == 1  # another codec: a value of other length
        assert t.get_many_into(keys[2:3], [dst[2]]) == [True] and np.array_equal(dst[2], src[2])
        plain = np.zeros(LAYOUT.bytes_per_block, dtype=np.uint8)  # outside every region
        assert t.get_many_into(keys[5:6], [plain]) == [True] and np.array_equal(plain, src[5])
        assert t.get_many_into([BlockKey(999)], [dst[0]]) == [False] and t.counters["missing"] == 1
        t.unregister_region(dst)
        assert not t._all_in_regions([dst[0]], writable=True)
        assert not t.register_region(src[:, ::2])  # not one contiguous run: refused
    finally:
        t.close()


def test_setup_failure_names_the_setting(tmp_path) -> None:
    _require()
    from kvtier.tiers.remote import MooncakeTier, RemoteTierError

    start = time.monotonic()
    with pytest.raises(RemoteTierError, match="tiers.remote.master"):
        MooncakeTier(NS, LAYOUT, master=f"127.0.0.1:{free_port()}",
                     metadata_server=f"http://127.0.0.1:{free_port()}/metadata", segment_bytes=16 << 20,
                     buffer_bytes=16 << 20)
    assert time.monotonic() - start < 30  # not Mooncake's own minute-and-a-half of retries
    with pytest.raises(ConfigError, match="tiers.remote.master"):
        MooncakeTier(NS, LAYOUT, master="no-port", metadata_server="http://127.0.0.1:1/metadata")


def test_bench_remote_compares_with_mooncakes_own_calls(tmp_path, capsys) -> None:
    _require()
    import json

    from kvtier.cli import main

    out = tmp_path / "remote.json"
    assert main(["bench", "remote", "--total-mib", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["block_kib"] for r in report["results"]] == [256, 1024, 4096]
    for r in report["results"]:
        assert r["verified"] is True and r["put_vs_mooncake"] > 0 and r["get_vs_mooncake"] > 0
        assert r["staged_put_vs_mooncake"] > 0 and r["staged_get_vs_mooncake"] > 0
    assert "targets met" in capsys.readouterr().out


def _store(master, tenant: str = "", dram_blocks: int = 16):
    from kvtier.config import load_config
    from kvtier.store import TieredStore

    return TieredStore(load_config(env={}, overrides={
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "block_size": 16},
        "namespace": {"model": "remote-store-test", "tenant": tenant},
        "tiers": {"hbm": {"enabled": False}, "dram": {"capacity_blocks": dram_blocks},
                  "remote": {"enabled": True, "master": master.master, "metadata_server": master.metadata_server,
                             "segment_bytes": 32 << 20, "buffer_bytes": 16 << 20}},
        "put_tier": "dram"}))


def test_tiered_stores_share_blocks_through_the_remote_tier(master) -> None:
    """Two TieredStores (two engines' SGLang backends) on one store: what one puts, the
    other reads past its own (empty) tiers and promotes into DRAM; another tenant finds
    nothing; an altered value is a miss."""
    import torch

    a, b, other = _store(master), _store(master), _store(master, tenant="other")
    try:
        bpb = a.layout.bytes_per_block
        keys = a.keys_for(list(range(8 * 16)))
        blocks = [torch.randint(0, 256, (bpb,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
                  for i in range(8)]
        assert a.put(keys, blocks) == 8 and a.stats()["counters"]["remote_put_blocks"] == 8
        assert b.contains_prefix(keys).num_blocks == 0 and b.readable_prefix(keys) == 8
        outs = [torch.empty(bpb, dtype=torch.uint8) for _ in keys]
        assert b.get(keys, outs) == 8 and all(torch.equal(x, y) for x, y in zip(outs, blocks))
        assert b.stats()["counters"]["hit_blocks_remote"] == 8
        assert b.contains_prefix(keys).num_blocks == 8  # promoted into B's DRAM
        assert b.get(keys, outs) == 8 and b.stats()["counters"]["hit_blocks_dram"] == 8
        # another tenant: same tokens, other keys and namespace; nothing is found
        okeys = other.keys_for(list(range(8 * 16)))
        assert other.readable_prefix(okeys) == 0 and other.get(okeys, outs) == 0
        # an altered value in the store: a miss (counted by cause), never bytes
        more = a.keys_for(list(range(1000, 1000 + 4 * 16)))
        assert a.put(more, blocks[:4]) == 4
        name = a._remote.object_name(more[0])
        raw = bytearray(a._remote._store.get(name))
        raw[HEADER_BYTES + 7] ^= 0x01
        assert a._remote._store.upsert(name, bytes(raw)) == 0
        assert b.readable_prefix(more) == 4  # present, not yet verified
        assert b.get(more, outs[:4]) == 0
        assert b.stats()["remote"]["checksum_failures"] == 1
    finally:
        for s in (a, b, other):
            s.close()


def test_sglang_backends_of_two_engines_share_pages(master, tmp_path) -> None:
    """SGLang's HiCache storage calls through kvtier's backend on two engines: pages one
    engine wrote are found (batch_exists) and read (batch_get_v1) by the other."""
    import torch
    from test_sglang_backend import PAGE, MHAHostPool, StorageConfig, fill_random, slots  # tests/ is on sys.path

    from kvtier_sglang import KVTierHiCacheStorage

    def backend(pool):
        extra = {"backend_name": "kvtier", "module_path": "kvtier_sglang", "class_name": "KVTierHiCacheStorage",
                 "interface_v1": 1, "kvtier": {"tiers": {"dram": {"capacity_blocks": 16}, "remote": {
                     "enabled": True, "master": master.master, "metadata_server": master.metadata_server,
                     "segment_bytes": 32 << 20, "buffer_bytes": 16 << 20}}}}
        b = KVTierHiCacheStorage(StorageConfig(extra_config=extra), {})
        b.register_mem_pool_host(pool)
        return b

    pool_a, pool_b = MHAHostPool("layer_first"), MHAHostPool("layer_first")
    fill_random(pool_a, seed=3)
    a, b = backend(pool_a), backend(pool_b)
    try:
        assert a.batch_set_v1(["p0", "p1", "p2"], slots([0, 1, 2])) == [True, True, True]
        assert b.batch_exists(["p0", "p1", "p2", "p3"]) == 3
        assert b.batch_get_v1(["p0", "p1", "p2"], slots([4, 5, 6])) == [True, True, True]
        for src, dst in zip((0, 1, 2), (4, 5, 6)):
            assert torch.equal(pool_b.get_data_page(dst * PAGE), pool_a.get_data_page(src * PAGE))
        assert b.kvtier_stats()["counters"]["hit_blocks_remote"] == 3
    finally:
        a.close()
        b.close()
