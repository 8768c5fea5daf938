"""One byte path (issue 22): the connector's worker reads and writes the SSD through the
same tier code as ``TieredStore`` and re-indexes it with the same function, and
``bench/connector_path.py`` measures the connector's own path (smoke run here)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from kvtier_vllm import scheduler as connector_scheduler
from kvtier_vllm.metadata import KVTierConnectorMetadata, LoadJob, StoreJob, TierWrite
from kvtier_vllm.settings import ConnectorSettings, EngineFacts
from kvtier_vllm.worker import KVTierWorker

import kvtier.store
from kvtier.config import load_config
from kvtier.keys import BlockKey
from kvtier.tiers.ssd import SSDTier

ROOT = Path(__file__).resolve().parents[2]


def test_worker_and_tiered_store_share_the_ssd_tier_code_and_the_reindex(tmp_path, monkeypatch) -> None:
    calls: list[tuple[str, str]] = []  # (caller, method)
    caller = ["?"]
    for name in ("put_many", "get_many_into", "scatter_many", "scan", "purge_unreadable"):
        real = getattr(SSDTier, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            calls.append((caller[0], _name))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(SSDTier, name, spy)
    assert connector_scheduler.reindex_ssd is kvtier.store.reindex_ssd  # one re-index

    facts = EngineFacts("m", "bfloat16", 16, 2, 2, 32, "split", "sha256")
    settings = ConnectorSettings.build({"dram_capacity_blocks": 0, "ssd_path": str(tmp_path / "c")}, facts, env={})
    layout = settings.config.layout.to_layout()
    w = KVTierWorker(settings, settings.config.namespace.to_namespace(layout), layout, 8)
    caches = {f"l{i}": tuple(torch.randn(8, 16, 2, 32).to(torch.bfloat16) for _ in range(2)) for i in range(2)}
    w.register_kv_caches(caches)
    caller[0] = "connector"
    try:
        store = StoreJob(1, "r", (1,), (77,), (None,), (TierWrite(5, "ssd", (0,), ()),))
        w.wait_for_save(KVTierConnectorMetadata(stores=[store]))
        _until(w, lambda plans, _: 5 in plans)
        w.start_load_kv(KVTierConnectorMetadata(loads=[LoadJob("r2", 6, (77,), ("ssd",), (0,), (3,))]))
        _until(w, lambda plans, received: plans.get(6) == [True] and "r2" in received)
        assert all(torch.equal(t[1], t[3]) for kv in caches.values() for t in kv)
    finally:
        w.shutdown()
    # the load reads raw values straight into the engine's blocks (staging and get_many_into: the others)
    assert {("connector", "put_many"), ("connector", "scatter_many")} <= set(calls)

    caller[0] = "store"
    cfg = load_config(env={}, overrides={
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "dtype": "bfloat16", "block_size": 16,
                   "arrangement": "split"},
        "tiers": {"hbm": {"enabled": False}, "dram": {"enabled": False},
                  "ssd": {"enabled": True, "path": str(tmp_path / "s")}},
        "put_tier": "ssd"})
    with kvtier.store.TieredStore(cfg) as store:
        keys = [BlockKey(9)]
        block = torch.randint(0, 255, (layout.bytes_per_block,), dtype=torch.uint8)
        assert store.put(keys, [block]) == 1
        out = torch.empty_like(block)
        assert store.get(keys, [out]) == 1 and torch.equal(out, block)
    with kvtier.store.TieredStore(cfg):  # a restart re-indexes through the same function
        pass
    assert {("store", "put_many"), ("store", "get_many_into"), ("store", "scan"), ("store", "purge_unreadable")} \
        <= set(calls)


def _until(w: KVTierWorker, done, timeout_s: float = 10.0) -> None:
    """Step the worker as vLLM does until ``done(plans, received)``."""
    plans: dict[int, list[bool]] = {}
    received: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while not done(plans, received):
        assert time.monotonic() < deadline, (plans, received)
        received |= w.get_finished(set())[1]
        meta = w.take_worker_meta()
        if meta is not None:
            plans.update({pid: oks for pid, (_, oks) in meta.plans.items()})
        time.sleep(0.01)


def test_connector_path_bench_smoke(tmp_path) -> None:
    out = tmp_path / "c.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "connector_path.py"), "--sizes-kib", "128",
                           "--total-mib", "4", "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # and through the command: every block size of kvtier bench tiers
    cli = tmp_path / "cli.json"
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "connector", "--total-mib", "4",
                           "--repeats", "1", "--json", str(cli)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(cli.read_text())
    assert [r["block_kib"] for r in report["results"]] == [256, 1024, 4096] and report["repeats"] == 1
    assert all(r["verified"] for r in report["results"]) and "targets met" in proc.stdout
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert row["verified"] is True and row["block_kib"] == 128
    # both callers of the data plane through one function, every byte read back verified
    assert [r["caller"] for r in report["callers"]] == ["TieredStore", "connector worker"]
    assert all(r["verified"] and r["block_kib"] == 128 and r["dram_get_vs_memcpy"] > 0 for r in report["callers"])
    assert "both callers of the data plane" in proc.stdout
    for key in ("dram_put_vs_memcpy", "dram_get_vs_memcpy", "ssd_put_vs_raw_write", "ssd_get_vs_raw_read",
                "end_to_end_store_vs_memcpy", "end_to_end_load_vs_memcpy"):
        assert row[key] > 0, key
    assert "targets met" in proc.stdout
    # loads behind queued SSD writes: the queue really was full while they ran, and every loaded byte checked
    (q,) = report["queued"]
    assert q["verified"] is True and q["queued_mib_peak"] >= 16 - 2  # 4x --total-mib, less one job's room
    assert all(q[f"{t}_{s}_p99_ms"] > 0 for t in ("dram", "ssd") for s in ("idle", "queued"))
    assert "loads behind writes" in proc.stdout
