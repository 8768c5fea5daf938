"""Store observability: Prometheus metrics of every tier (registered on a
registry and on ``kvtier serve``'s endpoint) and the per-request "why was
this a miss" debug log."""

from __future__ import annotations

import logging
import time
import urllib.request
from pathlib import Path

import lmdb
import numpy as np
import pytest
from hints_support import ServerThread
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.config import load_config
from kvtier.keys import key_to_bytes
from kvtier.metrics import register_store_metrics
from kvtier.store import TieredStore

LAYOUT = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 32, "dtype": "bfloat16", "block_size": 4}
BPB = 512


def make_store(tmp_path: Path, dram: int = 4) -> TieredStore:
    return TieredStore(load_config(env={}, overrides={
        "layout": LAYOUT, "tiers": {"hbm": {"enabled": False}, "dram": {"capacity_blocks": dram},
                                    "ssd": {"enabled": True, "capacity_blocks": 64, "path": str(tmp_path / "ssd")}},
        "put_tier": "dram", "write_through": True}))


def blocks(n: int, seed: int = 0) -> list[np.ndarray]:
    return [np.full(BPB, (seed * 7 + i) % 251, dtype=np.uint8) for i in range(n)]


def samples(registry) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_every_tier_figure_is_exported(tmp_path: Path) -> None:
    with make_store(tmp_path) as store:
        registry = CollectorRegistry()
        register_store_metrics(store, registry)
        a, b = store.keys_for(list(range(8))), store.keys_for(list(range(100, 116)))
        store.put(a, blocks(2))
        store.put(b, blocks(4, seed=1))  # DRAM holds 4: chain a is evicted from DRAM, still on SSD
        outs = [np.zeros(BPB, dtype=np.uint8) for _ in range(4)]
        assert store.get(a, outs[:2], promote=False) == 2  # SSD hits
        assert store.get(store.keys_for(list(range(500, 504))), outs[:1]) == 0  # a miss
        assert store.demote(b[:2], "dram", "ssd", reason="tool_call") == 0  # already on SSD: nothing to move
        store.mover.fault_hook = lambda job: time.sleep(0.2) if job.link == "ssd->dram" else None
        assert store.prefetch(a, "dram", timeout_s=0.01).result(10) == 0  # late: discarded
        store.mover.fault_hook = None
        assert store.prefetch(a, "dram").result(10) == 2
        m = samples(registry)
    def v(name, **labels):
        return m[(name, tuple(sorted(labels.items())))]

    assert v("kvtier_tier_capacity_blocks", tier="dram") == 4 and v("kvtier_tier_capacity_blocks", tier="ssd") == 64
    assert v("kvtier_tier_capacity_bytes", tier="dram") == 4 * BPB
    assert v("kvtier_tier_used_blocks", tier="ssd") == 6 and v("kvtier_tier_used_bytes", tier="ssd") == 6 * BPB
    assert v("kvtier_hit_blocks_total", tier="ssd") == 2 and v("kvtier_hit_blocks_total", tier="dram") == 0
    assert v("kvtier_get_blocks_total") == 3 and v("kvtier_miss_blocks_total") == 1
    # DRAM evicted chain a (2) for chain b, then 2 of b for the prefetched chain a
    assert v("kvtier_evicted_blocks_total", tier="dram") == 4 and v("kvtier_evicted_blocks_total", tier="ssd") == 0
    assert v("kvtier_transfer_bytes_total", src="put", dst="ssd") == 6 * BPB
    assert v("kvtier_transfer_blocks_total", src="ssd", dst="dram") == 4
    assert v("kvtier_transfer_timed_out_blocks_total", src="ssd", dst="dram") == 2
    assert v("kvtier_transfer_latency_seconds_count", src="ssd", dst="dram") == 2
    assert v("kvtier_transfer_latency_seconds_bucket", src="ssd", dst="dram", le="+Inf") == 2
    assert v("kvtier_transfer_latency_seconds_bucket", src="ssd", dst="dram", le="0.1") <= 1  # the slowed one is above
    assert v("kvtier_prefetch_blocks_total", outcome="late") == 2
    assert v("kvtier_prefetch_blocks_total", outcome="on_time") == 2
    assert v("kvtier_ssd_checksum_failures_total") == 0 and v("kvtier_ssd_map_full_total") == 0


def test_checksum_failures_and_offload_reasons_are_counted(tmp_path: Path) -> None:
    with make_store(tmp_path, dram=8) as store:
        keys = store.keys_for(list(range(8)))
        store.put(keys, blocks(2))
        assert store.manager.remove(keys, "ssd") == 2
        store.take_events()
        assert store.demote(keys, "dram", "ssd", reason="tool_call") == 2
    env = lmdb.open(str(tmp_path / "ssd"), subdir=True)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(key_to_bytes(keys[0])))
        value[-1] ^= 0xFF
        txn.put(key_to_bytes(keys[0]), bytes(value))
    env.close()
    with make_store(tmp_path) as store:
        registry = CollectorRegistry()
        register_store_metrics(store, registry)
        assert store.get(keys, [np.zeros(BPB, dtype=np.uint8) for _ in keys]) == 0
        m = samples(registry)
    assert m[("kvtier_ssd_checksum_failures_total", ())] == 1
    assert m[("kvtier_removed_blocks_total", (("reason", "failed_verify"), ("tier", "ssd")))] == 1


def test_kvtier_serve_exposes_store_metrics_next_to_hint_metrics(tmp_path: Path) -> None:
    with make_store(tmp_path) as store, ServerThread(store=store, metrics_port=0) as s:
        store.put(store.keys_for(list(range(4))), blocks(1))
        text = urllib.request.urlopen(f"http://127.0.0.1:{s.server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'kvtier_tier_ready_blocks{tier="dram"} 1.0' in text
    assert 'kvtier_tier_capacity_blocks{tier="ssd"} 64.0' in text
    assert "kvtier_hint_sessions 0.0" in text  # the hint plane's metrics are on the same endpoint


def test_debug_log_explains_each_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with make_store(tmp_path, dram=2) as store:
        a = store.keys_for(list(range(8)))
        store.put(a, blocks(2))
        store.manager.remove(a, "ssd")
        store.put(store.keys_for(list(range(100, 108))), blocks(2, seed=3))  # evicts chain a from DRAM
        caplog.set_level(logging.DEBUG, logger="kvtier.store")
        outs = [np.zeros(BPB, dtype=np.uint8) for _ in range(2)]
        assert store.get(a, outs) == 0
        assert store.get(store.keys_for(list(range(900, 904))), outs[:1]) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.store"]
    assert any("block 0" in ln and "evicted from dram by its lru policy" in ln for ln in lines), lines
    assert any("absent" in ln and "never stored" in ln for ln in lines), lines


def test_inspect_lists_namespaces_codecs_bytes_age_and_verifies(tmp_path: Path, capsys) -> None:
    from kvtier.cli import main

    with make_store(tmp_path) as store:
        store.put(store.keys_for(list(range(12))), blocks(3))
    assert main(["inspect", str(tmp_path / "ssd")]) == 0
    out = capsys.readouterr().out
    assert ": 3 blocks, 0 values with a bad header" in out and "last written" in out and " ago" in out
    row = out.strip().splitlines()[-1].split()
    assert row[2] == "raw" and row[3] == "3" and row[-1] == "0"  # codec, blocks, bad
