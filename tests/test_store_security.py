"""Security of the data plane: tenants cannot read or evict each other's
blocks, and no configuration or client input makes kvtier write outside its
configured directories. (Hint-server auth, TLS and per-tenant sessions:
``test_hints_security.py``; message size and batch limits:
``test_hints_server.py``; the per-tenant events-per-second limit:
``test_hints_ratelimit.py``.)"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hints_support import ServerThread

from kvtier.config import load_config
from kvtier.errors import ConfigError, StorageError
from kvtier.recording.hints import HintRecorder
from kvtier.keys import Namespace
from kvtier.layout import KVLayout
from kvtier.sdk import HintClient
from kvtier.store import TieredStore
from kvtier.tiers.ssd import SSDTier

LAYOUT = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 32, "dtype": "bfloat16", "block_size": 4}
BPB = 1 * 4 * 2 * 1 * 32 * 2  # 512


def tenant_store(path: Path, tenant: str, *, ssd: int = 64, dram: int = 4) -> TieredStore:
    return TieredStore(load_config(env={}, overrides={
        "layout": LAYOUT, "namespace": {"model": "m", "tenant": tenant},
        "tiers": {"hbm": {"enabled": False}, "dram": {"capacity_blocks": dram},
                  "ssd": {"enabled": True, "capacity_blocks": ssd, "path": str(path), "sync": True}},
        "put_tier": "ssd"}))


def block(i: int) -> np.ndarray:
    return np.full(BPB, i % 251, dtype=np.uint8)


def test_same_tokens_give_each_tenant_its_own_keys(tmp_path: Path) -> None:
    with tenant_store(tmp_path / "a", "alpha") as a, tenant_store(tmp_path / "b", "beta") as b:
        tokens = list(range(16))
        assert not set(a.keys_for(tokens)) & set(b.keys_for(tokens))  # the tenant is in the key's namespace


def test_a_tenant_can_neither_read_nor_evict_another_tenants_blocks(tmp_path: Path) -> None:
    path = tmp_path / "shared-ssd"  # both tenants pointed at one directory (sequentially)
    tokens = list(range(40))  # 10 blocks
    with tenant_store(path, "alpha") as a:
        alpha_keys = a.keys_for(tokens)
        assert a.put(alpha_keys, [block(i) for i in range(10)]) == 10
    with tenant_store(path, "beta", ssd=12) as b:
        assert b.counters["ssd_reindexed_blocks"] == 0  # alpha's blocks are not in beta's index
        outs = [np.zeros(BPB, dtype=np.uint8) for _ in alpha_keys]
        # Beta presenting alpha's exact keys (leaked, guessed) still reads nothing:
        assert b.get(alpha_keys, outs) == 0
        assert b._ssd.get_into(alpha_keys[0], outs[0]) is False  # the value's namespace digest is alpha's
        assert b._ssd.stats["mismatches"] == 1
        assert b.manager.remove(alpha_keys) == 0
        # Beta fills its own SSD quota many times over: evictions only ever hit beta's blocks.
        for c in range(8):
            keys = b.keys_for([1000 * c + t for t in range(40)])
            b.put(keys, [block(i) for i in range(10)])
        assert b.stats()["removals"]["ssd:evicted"] > 0
        b.check_invariants()
    with tenant_store(path, "alpha") as a:
        outs = [np.zeros(BPB, dtype=np.uint8) for _ in alpha_keys]
        assert a.get(alpha_keys, outs) == 10
        assert all(np.array_equal(o, block(i)) for i, o in enumerate(outs))


def test_symlinked_ssd_directory_is_followed(tmp_path: Path) -> None:
    # A data directory symlinked to an NVMe mount: the link is resolved and the
    # real directory holds the LMDB files; nothing is written next to the link.
    nvme = tmp_path / "nvme" / "kv"
    nvme.mkdir(parents=True)
    link = tmp_path / "data" / "ssd"
    link.parent.mkdir()
    link.symlink_to(nvme)
    cfg = load_config(env={}, overrides={"tiers": {"ssd": {"enabled": True, "path": str(link)}}})
    assert cfg.ssd.path == str(link) and cfg.ssd.resolved_path() == nvme
    with tenant_store(link, "alpha") as a:
        keys = a.keys_for(list(range(8)))
        assert a.put(keys, [block(i) for i in range(2)]) == 2
    assert sorted(p.name for p in nvme.iterdir()) == ["data.mdb", "lock.mdb"]
    assert link.is_symlink() and sorted(p.name for p in link.parent.iterdir()) == ["ssd"]
    ns, layout = Namespace("m", "bfloat16", "fused", 4), KVLayout(1, 1, 32, "bfloat16", 4)
    with SSDTier(link, ns, layout) as tier:  # constructed directly: resolved the same way
        assert len(tier) == 2


def test_dangling_ssd_directory_symlink_creates_its_target(tmp_path: Path) -> None:
    link = tmp_path / "ssd"
    link.symlink_to(tmp_path / "mnt" / "kv")  # the mount point's directory does not exist yet
    load_config(env={}, overrides={"tiers": {"ssd": {"enabled": True, "path": str(link)}}})
    assert not (tmp_path / "mnt").exists()  # the config check leaves nothing behind
    with SSDTier(link, Namespace("m", "bfloat16", "fused", 4), KVLayout(1, 1, 32, "bfloat16", 4)):
        pass
    assert (tmp_path / "mnt" / "kv" / "data.mdb").is_file()


@pytest.mark.parametrize("via_link", [False, True], ids=["real-dir", "symlinked-dir"])
@pytest.mark.parametrize("name", ["data.mdb", "lock.mdb"])
def test_symlinked_lmdb_file_is_refused(tmp_path: Path, name: str, via_link: bool) -> None:
    # Even inside a symlinked (allowed) directory, a symlinked LMDB file would
    # redirect writes outside it: refused at config load and at open.
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    real = tmp_path / "real"
    real.mkdir()
    (real / name).symlink_to(target)
    ssd = real
    if via_link:
        ssd = tmp_path / "ssd"
        ssd.symlink_to(real)
    with pytest.raises(ConfigError, match="tiers.ssd.path") as info:
        load_config(env={}, overrides={"tiers": {"ssd": {"enabled": True, "path": str(ssd)}}})
    assert "symlink" in str(info.value)
    with pytest.raises(StorageError, match="tiers.ssd.path.*not a regular file"):
        SSDTier(ssd, Namespace("m", "bfloat16", "fused", 4), KVLayout(1, 1, 32, "bfloat16", 4))
    assert target.read_bytes() == b"precious"


def test_client_chosen_ids_cannot_steer_the_recorder_outside_its_directory(tmp_path: Path) -> None:
    record = tmp_path / "rec"
    recorder = HintRecorder(record, block_size=4, model="m")
    hostile = ["../../escape", "/etc/passwd", "..", "a/../../b", "nul\x00byte", "~root"]
    with ServerThread(recorder=recorder) as s:
        with HintClient(s.address, flush_interval_s=0.001, tenant="../../tenant") as client:
            for sid in hostile:
                client.emit("session_start", session_id=sid)
                client.emit("agent_spawn", session_id=sid, agent_id="../a")
                client.emit("request_start", session_id=sid, agent_id="../a", request_id="../r",
                            prompt_block_keys=[1, 2])
                client.emit("request_end", session_id=sid, agent_id="../a", request_id="../r")
                client.emit("session_end", session_id=sid)
            assert client.flush(10)
        s.stop()
    recorder.close()
    written = [Path(root) / f for root, _, files in os.walk(tmp_path) for f in files]
    assert written and all(record.resolve() in p.resolve().parents for p in written), written
