"""SGLang's v2 pool interface on the kvtier backend, inside a real SGLang.

Run by tests/test_sglang_v2.py with an interpreter that has sglang 0.5.23
(see setup_sglang_venv.sh). Builds the backend as SGLang's hybrid controller
does — ``StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(...))``,
``register_mem_pool_host``, ``register_mem_host_pool_v2`` per pool entry,
``on_host_pools_registered`` — and drives it with SGLang's own
``PoolTransfer`` / ``PoolName`` / ``PoolHitPolicy`` / ``HiCacheStorageExtraInfo``
and the test files' host pools. Prints one JSON line; exits non-zero on an error.

    python integrations/sglang/real_sglang_v2_check.py TMPDIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from test_sglang_backend import PAGE, MHAHostPool, MLAHostPool, fill_random, kvtier_settings, slots
from test_sglang_v2 import IndexerHostPool, MambaHostPool

TRAIL, ALL = PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES


def config(anchor, settings: dict, **kw) -> HiCacheStorageConfig:
    extra = {"backend_name": "kvtier", "module_path": "kvtier_sglang", "class_name": "KVTierHiCacheStorage",
             "interface_v1": 1, "kvtier": settings}
    args = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                enable_storage_metrics=False, is_page_first_layout=anchor.layout == "page_first",
                model_name="tiny", extra_config=extra)
    return HiCacheStorageConfig(**{**args, **kw})


def build(anchor, side: dict, settings: dict, **kw) -> HiCacheStorage:
    backend = StorageBackendFactory.create_backend("dynamic", config(anchor, settings, **kw), anchor)
    backend.register_mem_pool_host(anchor)
    backend.register_mem_host_pool_v2(anchor, PoolName.KV)
    for name, pool in side.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def hybrid_swa(tmp: Path) -> dict:
    kv, swa = MHAHostPool("page_first"), MHAHostPool("page_first", layer_num=1, head_num=1)
    fill_random(kv, seed=1)
    fill_random(swa, seed=2)
    b = build(kv, {PoolName.SWA: swa}, kvtier_settings(tmp / "swa"))
    keys = ["h0", "h1", "h2", "h3"]
    ok = b.batch_set_v1(keys, slots([0, 1, 2, 3]), HiCacheStorageExtraInfo()) == [True] * 4
    info = HiCacheStorageExtraInfo(prefix_keys=keys[:2])  # prefix_keys + keys: one chain
    put = PoolTransfer(name=PoolName.SWA, host_indices=slots([2, 3]), keys=keys[2:], hit_policy=TRAIL)
    ok &= b.batch_set_v2([put], info) == {PoolName.SWA: [True, True]}
    hit = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA, keys=["_", "_"], hit_policy=TRAIL)])
    ok &= b.batch_get_v1(keys, slots([4, 5, 6, 7])) == [True] * 4
    get = PoolTransfer(name=PoolName.SWA, host_indices=slots([6, 7]), keys=keys[2:])
    ok &= b.batch_get_v2([get], info) == {PoolName.SWA: [True, True]}
    ok &= all(torch.equal(kv.get_data_page((s + 4) * PAGE), kv.get_data_page(s * PAGE)) for s in range(4))
    ok &= all(torch.equal(swa.get_data_page(d * PAGE), swa.get_data_page(s * PAGE)) for s, d in ((2, 6), (3, 7)))
    b.close()
    return {"hybrid_swa_round_trip": bool(ok), "hybrid_swa_hit": [hit.kv_hit_pages, hit.restorable_prefix_pages]}


def hybrid_mamba(tmp: Path) -> dict:
    kv, mamba = MHAHostPool("layer_first"), MambaHostPool()
    fill_random(kv, seed=3)
    mamba.fill(seed=4)
    b = build(kv, {PoolName.MAMBA: mamba}, kvtier_settings(tmp / "mamba"))
    keys = ["m0", "m1", "m2", "m3"]
    ok = b.batch_set_v1(keys, slots([0, 1, 2, 3])) == [True] * 4
    for key, slot in (("m1", 1), ("m3", 3)):
        put = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([slot]), keys=[key], hit_policy=TRAIL)
        ok &= b.batch_set_v2([put]) == {PoolName.MAMBA: [True]}
    hit = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=["_"], hit_policy=TRAIL)])
    get = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([5, 6]), keys=["m1", "m3"])
    ok &= b.batch_get_v2([get]) == {PoolName.MAMBA: [True, True]}
    ok &= torch.equal(mamba.get_data_page(5), mamba.get_data_page(1))
    ok &= torch.equal(mamba.get_data_page(6), mamba.get_data_page(3))
    b.close()
    return {"hybrid_mamba_round_trip": bool(ok), "hybrid_mamba_hit": [hit.kv_hit_pages, hit.restorable_prefix_pages]}


def mla(tmp: Path) -> dict:
    kv, ix = MLAHostPool(), IndexerHostPool()
    fill_random(kv, seed=5)
    ix.fill(seed=6)
    b = build(kv, {PoolName.INDEXER: ix}, kvtier_settings(tmp / "mla"), is_mla_model=True)
    keys = ["d0", "d1", "d2"]
    sets = b.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=slots([0, 1, 2]), keys=keys),
                           PoolTransfer(name=PoolName.INDEXER, host_indices=slots([0, 1]), keys=keys[:2])])
    ok = sets == {PoolName.KV: [True] * 3, PoolName.INDEXER: [True, True]}
    hit = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER, keys=keys, hit_policy=ALL)])
    gets = b.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=slots([4, 5]), keys=keys[:2]),
                           PoolTransfer(name=PoolName.INDEXER, host_indices=slots([4, 5]), keys=keys[:2])])
    ok &= gets == {PoolName.KV: [True, True], PoolName.INDEXER: [True, True]}
    ok &= torch.equal(kv.kv_buffer[4 * PAGE:6 * PAGE], kv.kv_buffer[0:2 * PAGE])
    ok &= torch.equal(ix.buffer[4:6], ix.buffer[0:2])
    try:
        b.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=slots([0]), keys=["d0"])])
        bad = False
    except ValueError as e:
        bad = "'swa' was never registered" in str(e)
    b.close()
    hits = {str(k): v for k, v in hit.extra_pool_hit_pages.items()}
    return {"mla_round_trip": bool(ok), "mla_hit": [hit.kv_hit_pages, hits], "bad_pool_error": bad}


def writer_rule(tmp: Path) -> dict:
    from kvtier_sglang.pools import is_storage_writer

    grid = [dict(is_mla_model=m, tp_rank=r, tp_size=4, dcp_size=d, dcp_rank=r % d,
                 logical_page_size=PAGE if d > 1 else None)
            for m in (False, True) for r in range(4) for d in (1, 2)
            if not (d > 1 and not m)]
    matches = all(is_storage_writer(config(MLAHostPool(), {}, **g)) == config(MLAHostPool(), {}, **g).is_storage_writer
                  for g in grid)
    kv, ix, mamba = MLAHostPool(), IndexerHostPool(), MambaHostPool()
    fill_random(kv, seed=7)
    rank1 = build(kv, {PoolName.INDEXER: ix, PoolName.MAMBA: mamba}, kvtier_settings(tmp / "w"),
                  is_mla_model=True, tp_rank=1, tp_size=2)
    sets = rank1.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=slots([0, 1]), keys=["w0", "w1"]),
                               PoolTransfer(name=PoolName.INDEXER, host_indices=slots([0, 1]), keys=["w0", "w1"]),
                               PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1]), keys=["w1"])])
    rank1.close()
    return {"writer_rule_matches_sglang": matches, "non_writer_sets": {str(k): v for k, v in sets.items()},
            "writer_rule_remote": writer_rule_remote(tmp)}


def writer_rule_remote(tmp: Path):
    """Rank 1 (not the writer) stores nothing; rank 0 stores; both ranks find
    the pages, and rank 1 reads rank 0's bytes, through a shared Mooncake Store."""
    from kvtier.benchmarks.remote import LocalMaster, mooncake_problem

    if mooncake_problem() is not None:
        return "skipped"
    master = LocalMaster(tmp / "master.log").start()
    remote = {"enabled": True, "master": master.master, "metadata_server": master.metadata_server,
              "segment_bytes": 32 << 20, "buffer_bytes": 16 << 20}
    settings = kvtier_settings(tmp / "remote")
    settings["tiers"]["remote"] = remote
    kv0, ix0, kv1, ix1 = MLAHostPool(), IndexerHostPool(), MLAHostPool(), IndexerHostPool()
    fill_random(kv0, seed=10)
    ix0.fill(seed=11)
    rank0 = build(kv0, {PoolName.INDEXER: ix0}, settings, is_mla_model=True, tp_rank=0, tp_size=2)
    rank1 = build(kv1, {PoolName.INDEXER: ix1}, settings, is_mla_model=True, tp_rank=1, tp_size=2)
    keys = ["r0", "r1"]

    def both(pages):
        return [PoolTransfer(name=PoolName.KV, host_indices=slots(pages), keys=keys),
                PoolTransfer(name=PoolName.INDEXER, host_indices=slots(pages), keys=keys)]

    try:
        stored1 = any(any(v) for v in rank1.batch_set_v2(both([0, 1])).values())
        rank0.batch_set_v2(both([0, 1]))
        probe = [PoolTransfer(name=PoolName.INDEXER, keys=keys, hit_policy=ALL)]
        hits = [r.batch_exists_v2(keys, probe).kv_hit_pages for r in (rank0, rank1)]
        got = rank1.batch_get_v2(both([4, 5]))
        same = all(all(v) for v in got.values()) and torch.equal(kv1.kv_buffer[4 * PAGE:6 * PAGE],
                                                                 kv0.kv_buffer[0:2 * PAGE]) \
            and torch.equal(ix1.buffer[4:6], ix0.buffer[0:2])
    finally:
        rank0.close()
        rank1.close()
        master.stop()
    return {"rank1_stored": stored1, "both_ranks_hit": hits, "rank1_read_bytes": bool(same)}


def main(tmp: Path) -> dict:
    from kvtier_sglang import KVTierHiCacheStorage

    found = {"base_is_sglang": issubclass(KVTierHiCacheStorage, HiCacheStorage)}
    for part in (hybrid_swa, hybrid_mamba, mla, writer_rule):
        found.update(part(tmp))
    return found


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
