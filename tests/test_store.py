"""TieredStore over real bytes: DRAM pool, CPU 'hbm' pool, LMDB SSD tier."""

from __future__ import annotations

import threading
from pathlib import Path

import lmdb
import pytest
import torch

from kvtier.config import load_config
from kvtier.keys import key_to_bytes
from kvtier.store import TieredStore

LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "bfloat16", "block_size": 4}
BPB = 2 * 4 * 2 * 2 * 16 * 2  # layers * tokens * (K,V) * heads * dim * bytes = 1024


def make_store(tmp_path: Path | None = None, *, hbm=0, dram=8, ssd=0, put_tier="dram", write_through=False,
               **extra) -> TieredStore:
    tiers = {
        "hbm": {"enabled": hbm > 0, "capacity_blocks": max(hbm, 1), "device": "cpu"},
        "dram": {"enabled": dram > 0, "capacity_blocks": max(dram, 1)},
        "ssd": {"enabled": ssd > 0, "capacity_blocks": max(ssd, 1),
                **({"path": str(tmp_path / "ssd"), "sync": True} if tmp_path else {})},
    }
    cfg = load_config(env={}, overrides={"layout": LAYOUT, "tiers": tiers, "put_tier": put_tier,
                                         "write_through": write_through, **extra})
    return TieredStore(cfg)


def kv_blocks(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BPB // 2, generator=g).to(torch.bfloat16) for _ in range(n)]


def empty(n: int) -> list[torch.Tensor]:
    return [torch.zeros(BPB // 2, dtype=torch.bfloat16) for _ in range(n)]


def test_put_get_round_trip_and_prefix() -> None:
    with make_store() as s:
        keys = s.keys_for(list(range(16)))  # 4 blocks
        data = kv_blocks(4)
        assert s.put(keys[:3], data[:3]) == 3
        outs = empty(4)
        assert s.get(keys, outs) == 3  # longest present prefix
        assert all(torch.equal(a, b) for a, b in zip(data[:3], outs[:3]))
        assert s.stats()["counters"]["hit_blocks_dram"] == 3
        s.check_invariants()


def test_write_through_serves_from_ssd_after_dram_eviction_and_promotes(tmp_path: Path) -> None:
    with make_store(tmp_path, dram=2, ssd=16, write_through=True) as s:
        keys = s.keys_for(list(range(24)))  # 6 blocks
        data = kv_blocks(6)
        for i in range(0, 6, 2):  # DRAM holds 2 blocks: earlier ones are evicted from DRAM
            s.put(keys[i : i + 2], data[i : i + 2], parent=keys[i - 1] if i else None)
        assert s.contains_prefix(keys).tiers[:2] == ("ssd", "ssd")
        outs = empty(6)
        assert s.get(keys, outs) == 6
        assert all(torch.equal(a, b) for a, b in zip(data, outs))
        # the SSD hits were promoted into DRAM (as many as fit)
        assert s.stats()["tiers"]["dram"]["ready_blocks"] == 2
        s.check_invariants()


def test_prefetch_and_demote(tmp_path: Path) -> None:
    with make_store(tmp_path, hbm=4, dram=4, ssd=8, put_tier="ssd") as s:
        keys = s.keys_for(list(range(12)))
        data = kv_blocks(3)
        s.put(keys, data)
        assert s.contains_prefix(keys).tiers == ("ssd",) * 3
        assert s.prefetch(keys, "hbm").result(timeout=30) == 3
        assert s.contains_prefix(keys).tiers == ("hbm",) * 3
        assert s.demote(keys, "hbm", "dram") == 3
        assert s.contains_prefix(keys).tiers == ("dram",) * 3
        outs = empty(3)
        assert s.get(keys, outs) == 3 and all(torch.equal(a, b) for a, b in zip(data, outs))
        s.check_invariants()


def test_warm_restart_reindexes_the_ssd_directory(tmp_path: Path) -> None:
    data = kv_blocks(3, seed=5)
    with make_store(tmp_path, dram=4, ssd=8, put_tier="ssd") as s:
        keys = s.keys_for(list(range(12)))
        s.put(keys, data)
    with make_store(tmp_path, dram=4, ssd=8, put_tier="ssd") as s2:
        assert s2.stats()["counters"]["ssd_reindexed_blocks"] == 3
        assert s2.contains_prefix(keys).num_blocks == 3
        assert s2.manager.parent_of(keys[2]) == keys[1]  # chains survive the restart
        outs = empty(3)
        assert s2.get(keys, outs) == 3 and all(torch.equal(a, b) for a, b in zip(data, outs))


def test_corrupted_ssd_value_is_a_miss_and_is_dropped(tmp_path: Path) -> None:
    with make_store(tmp_path, dram=0, ssd=8, put_tier="ssd") as s:
        keys = s.keys_for(list(range(12)))
        data = kv_blocks(3)
        s.put(keys, data)
    env = lmdb.open(str(tmp_path / "ssd"), subdir=True, max_dbs=8)
    with env.begin(write=True) as txn:
        db = None
        raw = txn.get(key_to_bytes(keys[1]))
        if raw is None:  # values may live in a named sub-database
            names = [k for k, _ in txn.cursor()]
            db = env.open_db(names[0], txn=txn)
            raw = txn.get(key_to_bytes(keys[1]), db=db)
        bad = bytearray(raw)
        bad[len(bad) // 2] ^= 0xFF
        txn.put(key_to_bytes(keys[1]), bytes(bad), db=db)
    env.close()
    with make_store(tmp_path, dram=0, ssd=8, put_tier="ssd") as s:
        outs = empty(3)
        assert s.get(keys, outs) == 1  # block 1 fails its checksum: prefix stops there
        assert torch.equal(outs[0], data[0])
        assert s.contains_prefix(keys).num_blocks == 1  # the bad copy left the index
        st = s.stats()
        assert st["ssd"]["checksum_failures"] + st["ssd"]["decode_failures"] >= 1
        s.check_invariants()


def test_failed_copy_leaves_no_readable_block(monkeypatch) -> None:
    with make_store() as s:
        keys = s.keys_for(list(range(8)))

        def broken(slots, srcs):
            raise RuntimeError("injected copy failure")

        monkeypatch.setattr(s._pools["dram"], "write", broken)
        assert s.put(keys, kv_blocks(2)) == 0
        assert s.contains_prefix(keys).num_blocks == 0
        assert s.stats()["failed_jobs"] == 1
        s.check_invariants()


def test_every_buffer_kind_round_trips_in_one_batch() -> None:
    """Flat uint8 tensors take the C-speed check; a batch mixing them with bf16
    tensors, numpy arrays and bytearrays takes the per-buffer path; both store
    and load the same bytes."""
    import numpy as np

    with make_store() as s:
        keys = s.keys_for(list(range(16)))
        data = kv_blocks(4, seed=3)
        flat = [d.view(torch.uint8) for d in data]
        assert s.put(keys[:2], flat[:2]) == 2  # all flat uint8: the fast check
        assert s.put(keys, [flat[0], data[1], data[2].view(torch.uint8).numpy(),
                            bytearray(data[3].view(torch.uint8).numpy().tobytes())]) == 4
        outs_u8 = [torch.empty(BPB, dtype=torch.uint8) for _ in range(2)]
        outs_mixed = [torch.zeros(BPB // 2, dtype=torch.bfloat16), np.zeros(BPB, dtype=np.uint8)]
        assert s.get(keys[:2], outs_u8) == 2
        assert s.get(keys[2:], outs_mixed, promote=False) == 2
        assert torch.equal(outs_u8[0], flat[0]) and torch.equal(outs_u8[1], flat[1])
        assert torch.equal(outs_mixed[0], data[2])
        assert bytes(outs_mixed[1]) == bytes(flat[3].numpy())
        with pytest.raises(ValueError, match="block 1 has 1023 bytes"):
            s.put(s.keys_for(list(range(100, 108))), [flat[0], torch.zeros(1023, dtype=torch.uint8)])
        s.check_invariants()


def test_per_block_events_only_with_kv_events() -> None:
    """Stored/loaded events are a KV-event feed, recorded only when asked for;
    removals are recorded either way (the store frees bytes and counts them)."""
    from kvtier.events import BlockLoaded, BlockRemoved, BlockStored

    for kv_events in (False, True):
        with make_store(dram=2, kv_events=kv_events) as s:
            first, second = s.keys_for(list(range(8))), s.keys_for(list(range(100, 108)))
            assert s.put(first, kv_blocks(2)) == 2
            assert s.get(first, empty(2)) == 2
            assert s.put(second, kv_blocks(2)) == 2  # evicts the first chain
            kinds = [type(e) for e in s.take_events()]
            assert kinds.count(BlockRemoved) == 2
            assert kinds.count(BlockStored) == (4 if kv_events else 0)
            assert kinds.count(BlockLoaded) == (2 if kv_events else 0)
            assert s.explain_miss(first, 0).reason == "evicted"
            s.check_invariants()


def test_wrong_block_size_names_the_layout() -> None:
    with make_store() as s:
        with pytest.raises(ValueError, match="needs 1024"):
            s.put(s.keys_for(list(range(4))), [torch.zeros(10, dtype=torch.uint8)])


def test_concurrent_puts_and_gets_keep_invariants() -> None:
    with make_store(dram=16, mover_threads=2) as s:
        errors: list[BaseException] = []

        def worker(w: int) -> None:
            try:
                for r in range(20):
                    keys = s.keys_for([w * 1000 + r * 10 + i for i in range(8)])
                    data = kv_blocks(2, seed=w * 100 + r)
                    s.put_async(keys, data).result(timeout=30)
                    outs = empty(2)
                    n = s.get(keys, outs)
                    assert all(torch.equal(data[i], outs[i]) for i in range(n))
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        s.check_invariants()


def test_ssd_get_into_a_strided_buffer_is_refused_and_writes_nothing_outside_it(tmp_path: Path) -> None:
    """Blocks read from SSD reach the caller's tensors through views of their
    memory; a 1-D buffer that is not contiguous must not get a view that
    spans its gaps: the get raises and the bytes between its elements stay."""
    with make_store(tmp_path, dram=0, ssd=4, put_tier="ssd") as s:
        keys = s.keys_for(list(range(8)))
        data = kv_blocks(2)
        assert s.put(keys, data) == 2
        backing = torch.full((2 * BPB,), 7, dtype=torch.uint8)
        with pytest.raises(TypeError, match="contiguous"):
            s.get(keys[:1], [backing[::2]])
        assert bool((backing[1::2] == 7).all())
        outs = empty(2)  # the blocks are still there, readable into proper buffers
        assert s.get(keys, outs) == 2 and all(torch.equal(a, b) for a, b in zip(data, outs))
