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

from kvtier.benchmarks.remote import LocalMaster, free_port, master_binary
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey, Namespace
from kvtier.layout import KVLayout
from kvtier.tiers.codec import HEADER_BYTES

LAYOUT = KVLayout(2, 2, 64, "bfloat16", 16)  # 16 KiB per block
NS = Namespace("remote-test", "bfloat16", "fused", 16)


def _require() -> None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        problem = f"mooncake client not importable ({e})"
    else:
        if master_binary() is not None:
            return
        problem = "mooncake_master not found"
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
                                                                    "missing")) == 1
        assert b.counters["missing"] >= 2
    finally:
        a.close()
        b.close()


def test_a_dead_master_makes_misses_and_a_restarted_one_is_used_again(master) -> None:
    """The master is killed: reads miss and writes fail at once, counted, nothing raises
    (the blocks' bytes lived in the master's object map: they are gone). It comes back
    on the same ports: the client reconnects by itself and new blocks hit again."""
    t = master.tier()
    try:
        keys = [BlockKey(21), BlockKey(22)]
        assert t.put_many([(k, b, None) for k, b in zip(keys, _blocks(2, seed=3))]) == 2
        master.kill()
        out = [np.empty(LAYOUT.bytes_per_block, dtype=np.uint8) for _ in range(2)]
        start = time.monotonic()
        assert t.get_many_into(keys, out) == [False, False]
        assert t.put_many([(BlockKey(23), out[0], None)]) == 0
        assert time.monotonic() - start < 10 and t.counters["remote_errors"] >= 1
        master.start()
        block = _blocks(1, seed=4)[0]
        deadline = time.monotonic() + 30
        while t.put_many([(BlockKey(24), block, None)]) != 1:
            assert time.monotonic() < deadline, dict(t.counters)
            time.sleep(0.5)
        assert t.get_many_into([BlockKey(24)], out[:1]) == [True] and np.array_equal(out[0], block)
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
    assert "targets met" in capsys.readouterr().out
