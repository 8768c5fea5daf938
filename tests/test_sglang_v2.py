"""SGLang's v2 pool interface on the kvtier backend (hybrid and DeepSeek caches).

Main venv: the backend with host pools written here after SGLang's
(``MambaPoolHost``: state bytes in separate buffers, a page of one slot;
``DSAIndexerPoolHost``: a page per index page; SWA: an MHA pool), the pure
rules of :mod:`kvtier_sglang.pools`, and the MLA one-writer rule (across two
ranks through a real Mooncake Store where one can run). ``test_real_sglang_v2``
repeats the round trips with SGLang 0.5.23's own classes
(``integrations/sglang/real_sglang_v2_check.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvtier_sglang import KVTierHiCacheStorage
from kvtier_sglang._contract import PoolHitPolicy, PoolName, PoolTransfer
from kvtier_sglang.pools import PoolHits, fold_pool_hits, is_storage_writer, rank_replicated
from test_sglang_backend import (
    PAGE,
    MHAHostPool,
    MLAHostPool,
    StorageConfig,
    _sglang_python,
    fill_random,
    kvtier_settings,
    slots,
)

ROOT = Path(__file__).resolve().parents[1]
ALL, TRAIL = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES


class MambaHostPool:
    """SGLang's MambaPoolHost (page_first): page_size 1; a slot's state is a
    temporal state and conv states in separate buffers; its flat page is the
    temporal bytes, then each conv state's."""

    def __init__(self, num_slots: int = 8, layers: int = 2) -> None:
        self.page_size, self.layout = 1, "page_first"
        self.conv_buffer = [torch.zeros((num_slots, layers, 3, 4), dtype=torch.bfloat16)]  # allocated first
        self.temporal_buffer = torch.zeros((num_slots, layers, 2, 5), dtype=torch.float32)

    def _tensors(self, index: int) -> list[torch.Tensor]:
        return [self.temporal_buffer[index:index + 1], *(c[index:index + 1] for c in self.conv_buffer)]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return torch.cat([t.reshape(-1).view(torch.uint8) for t in self._tensors(index)])

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(sum(t.numel() * t.element_size() for t in self._tensors(0)), dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        start = 0
        for t in self._tensors(index):
            n = t.numel() * t.element_size()
            t.copy_(data_page[start:start + n].clone().view(t.dtype).reshape(t.shape))
            start += n

    def fill(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for buf in (self.temporal_buffer, *self.conv_buffer):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))


class IndexerHostPool:
    """SGLang's DSAIndexerPoolHost (page_first): per index page and layer one
    row of fp8 keys and their scales, held as bytes."""

    def __init__(self, num_pages: int = 8, layer_num: int = 2, stride: int = 24) -> None:
        self.page_size, self.layout, self.layer_num, self.stride = PAGE, "page_first", layer_num, stride
        self.buffer = torch.zeros((num_pages, layer_num, 1, stride), dtype=torch.uint8)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.buffer[index // PAGE:index // PAGE + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.layer_num * self.stride, dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.buffer[index // PAGE:index // PAGE + 1] = data_page.reshape(1, self.layer_num, 1, self.stride)

    def fill(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.buffer.copy_(torch.randint(0, 256, self.buffer.shape, generator=gen, dtype=torch.uint8))


def make(tmp_path: Path, anchor, side: dict, settings: dict | None = None, **cfg) -> KVTierHiCacheStorage:
    """A backend as SGLang's hybrid controller builds it: factory call,
    anchor pool, then every pool entry through register_mem_host_pool_v2."""
    extra = {"backend_name": "kvtier", "module_path": "kvtier_sglang", "class_name": "KVTierHiCacheStorage",
             "interface_v1": 1, "kvtier": settings or kvtier_settings(tmp_path)}
    backend = KVTierHiCacheStorage(StorageConfig(extra_config=extra, **cfg), {})
    backend.register_mem_pool_host(anchor)
    backend.register_mem_host_pool_v2(anchor, PoolName.KV)
    for name, pool in side.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


# ------------------------------------------------------------------ pure rules


def test_fold_all_pages_and_trailing_pages():
    # kv hit 4 pages; indexer (all pages) has pages 0..2: prefixes 1..3 only
    f = fold_pool_hits("kv", 4, [PoolHits("indexer", "all_pages", 0, [True, True, True, False])])
    assert (f.kv_hit_pages, f.restorable_prefix_pages, f.pool_hit_pages) == (3, [1, 2, 3], {"kv": 4, "indexer": 3})
    # swa window of 2 pages present at pages 1, 2 only: only prefix 3 ends on a full window
    f = fold_pool_hits("kv", 4, [PoolHits("swa", "trailing_pages", 2, [False, True, True, False])])
    assert (f.kv_hit_pages, f.restorable_prefix_pages, f.pool_hit_pages) == (3, [3], {"kv": 4, "swa": 3})
    # two pools: the prefix must be restorable in both
    f = fold_pool_hits("kv", 4, [PoolHits("mamba", "trailing_pages", 1, [True, False, True, True]),
                                 PoolHits("swa", "trailing_pages", 1, [True, True, False, True])])
    assert (f.kv_hit_pages, f.restorable_prefix_pages) == (4, [1, 4])
    assert fold_pool_hits("kv", 0, [PoolHits("swa", "trailing_pages", 1, [])]).kv_hit_pages == 0
    with pytest.raises(ValueError, match="'c4'.*block_groups"):
        fold_pool_hits("kv", 2, [PoolHits("c4", "block_groups", 0, [True, True])])


def test_writer_rule_matches_sglangs_formula():
    # HiCacheStorageConfig.is_storage_writer: not is_mla_model or tp_rank == dcp_rank
    assert is_storage_writer(StorageConfig(is_mla_model=False, tp_rank=3, tp_size=4))
    assert is_storage_writer(StorageConfig(is_mla_model=True, tp_rank=0, tp_size=4))
    assert not is_storage_writer(StorageConfig(is_mla_model=True, tp_rank=1, tp_size=4))

    class DCP(StorageConfig):  # tp 4, dcp 2: rank r holds DCP shard r % 2; ranks 0 and 1 write
        pass

    for rank, writes in ((0, True), (1, True), (2, False), (3, False)):
        cfg = DCP(is_mla_model=True, tp_rank=rank, tp_size=4)
        cfg.dcp_rank, cfg.dcp_size = rank % 2, 2
        assert is_storage_writer(cfg) is writes


def test_which_pools_are_rank_replicated():
    mla, indexer, mamba, mha = MLAHostPool(), IndexerHostPool(), MambaHostPool(), MHAHostPool("page_first")
    assert rank_replicated("kv", mla, True) and rank_replicated("indexer", indexer, True)
    assert not rank_replicated("mamba", mamba, True)  # TP-sharded state: every rank writes its own
    assert not rank_replicated("draft", mha, True)  # head-sharded MHA pool
    assert not any(rank_replicated(n, p, False) for n, p in (("kv", mla), ("indexer", indexer)))


# ------------------------------------------------------------------ hybrid round trips


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_hybrid_kv_and_swa_round_trip(tmp_path, layout):
    kv, swa = MHAHostPool(layout), MHAHostPool(layout, layer_num=1, head_num=1)
    fill_random(kv, seed=1)
    fill_random(swa, seed=2)
    backend = make(tmp_path, kv, {PoolName.SWA: swa})
    keys = ["h0", "h1", "h2", "h3"]
    # the write-back: the KV pages through v1, the SWA window (last 2 pages) through v2
    assert backend.batch_set_v1(keys, slots([0, 1, 2, 3])) == [True] * 4
    window = PoolTransfer(PoolName.SWA, host_indices=slots([2, 3]), keys=keys[2:], hit_policy=TRAIL)
    assert backend.batch_set_v2([window]) == {PoolName.SWA: [True, True]}
    # the hit query: 4 KV pages, and the 2-page window ends at page 4
    hit = backend.batch_exists_v2(keys + ["h4"], [PoolTransfer(PoolName.SWA, keys=["x", "y"], hit_policy=TRAIL)])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (4, [4])
    assert hit.extra_pool_hit_pages == {PoolName.KV: 4, PoolName.SWA: 4}
    # the prefetch: both pools into other slots, byte for byte
    assert backend.batch_get_v1(keys, slots([4, 5, 6, 7])) == [True] * 4
    got = backend.batch_get_v2([PoolTransfer(PoolName.SWA, host_indices=slots([6, 7]), keys=keys[2:])])
    assert got == {PoolName.SWA: [True, True]}
    for src, dst in ((0, 4), (1, 5), (2, 6), (3, 7)):
        assert torch.equal(kv.get_data_page(dst * PAGE), kv.get_data_page(src * PAGE))
    for src, dst in ((2, 6), (3, 7)):
        assert torch.equal(swa.get_data_page(dst * PAGE), swa.get_data_page(src * PAGE))
    assert backend.store.layout != backend._side_stores["swa"].layout  # a store per page size
    backend.close()


def test_hybrid_kv_and_mamba_round_trip_and_restart(tmp_path):
    kv, mamba = MHAHostPool("page_first"), MambaHostPool()
    fill_random(kv, seed=3)
    mamba.fill(seed=4)
    backend = make(tmp_path, kv, {PoolName.MAMBA: mamba})
    keys = ["m0", "m1", "m2", "m3"]
    backend.batch_set_v1(keys, slots([0, 1, 2, 3]))
    # Mamba checkpoints at pages 2 and 4 only (slots 1 and 3 of the state pool)
    for key, slot in (("m1", 1), ("m3", 3)):
        t = PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([slot]), keys=[key], hit_policy=TRAIL)
        assert backend.batch_set_v2([t]) == {PoolName.MAMBA: [True]}
    expected = [mamba.get_data_page(s).clone() for s in (1, 3)]
    backend.close()
    # a restart over the same directory, empty host pools
    mamba.temporal_buffer.zero_()
    mamba.conv_buffer[0].zero_()
    backend = make(tmp_path, kv, {PoolName.MAMBA: mamba})
    assert backend.kvtier_stats("mamba")["counters"]["ssd_reindexed_blocks"] == 2
    probe = [PoolTransfer(PoolName.MAMBA, keys=["k"], hit_policy=TRAIL)]
    hit = backend.batch_exists_v2(keys, probe)
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (4, [2, 4])
    got = backend.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([5, 6, 7]),
                                             keys=["m1", "m3", "m2"])])
    assert got == {PoolName.MAMBA: [True, True, False]}  # m2 never had a state: a miss
    assert torch.equal(mamba.get_data_page(5), expected[0]) and torch.equal(mamba.get_data_page(6), expected[1])
    assert not mamba.get_data_page(7).any()  # the miss left its slot untouched
    backend.close()


def test_mla_kv_and_indexer_round_trip(tmp_path):
    kv, indexer = MLAHostPool(), IndexerHostPool()
    fill_random(kv, seed=5)
    indexer.fill(seed=6)
    backend = make(tmp_path, kv, {PoolName.INDEXER: indexer}, is_mla_model=True)
    keys = ["d0", "d1", "d2"]
    # DeepSeek (DSA): KV and its indexer pages, both through v2, the indexer on the KV's indices
    sets = backend.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=slots([0, 1, 2]), keys=keys),
                                 PoolTransfer(PoolName.INDEXER, host_indices=slots([0, 1]), keys=keys[:2])])
    assert sets == {PoolName.KV: [True] * 3, PoolName.INDEXER: [True, True]}
    hit = backend.batch_exists_v2(keys, [PoolTransfer(PoolName.INDEXER, keys=keys, hit_policy=ALL)])
    assert (hit.kv_hit_pages, hit.extra_pool_hit_pages) == (2, {PoolName.KV: 3, PoolName.INDEXER: 2})
    got = backend.batch_get_v2([PoolTransfer(PoolName.KV, host_indices=slots([4, 5]), keys=keys[:2]),
                                PoolTransfer(PoolName.INDEXER, host_indices=slots([4, 5]), keys=keys[:2])])
    assert got == {PoolName.KV: [True, True], PoolName.INDEXER: [True, True]}
    assert torch.equal(kv.kv_buffer[4 * PAGE:6 * PAGE], kv.kv_buffer[0:2 * PAGE])
    assert torch.equal(indexer.buffer[4:6], indexer.buffer[0:2])
    # KV via v2 and via v1 are the same pages
    assert backend.batch_get_v1(["d2"], slots([6])) == [True]
    assert torch.equal(kv.kv_buffer[6 * PAGE:7 * PAGE], kv.kv_buffer[2 * PAGE:3 * PAGE])
    backend.close()


# ------------------------------------------------------------------ the MLA one-writer rule


def test_non_writer_rank_stores_nothing(tmp_path):
    kv, indexer, mamba = MLAHostPool(), IndexerHostPool(), MambaHostPool()
    fill_random(kv, seed=7)
    indexer.fill(seed=8)
    mamba.fill(seed=9)
    rank1 = make(tmp_path, kv, {PoolName.INDEXER: indexer, PoolName.MAMBA: mamba},
                 is_mla_model=True, tp_rank=1, tp_size=2)
    assert not rank1.is_storage_writer
    assert rank1.batch_set_v1(["w0", "w1"], slots([0, 1])) == [False, False]
    assert not rank1.batch_set(["w0"], [kv.kv_buffer[0:PAGE].flatten()])
    sets = rank1.batch_set_v2([PoolTransfer(PoolName.INDEXER, host_indices=slots([0, 1]), keys=["w0", "w1"]),
                               PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([1]), keys=["w1"])])
    # replicated pools: nothing; the TP-sharded Mamba state: this rank's own
    assert sets == {PoolName.INDEXER: [False, False], PoolName.MAMBA: [True]}
    assert rank1.batch_exists(["w0"]) == 0
    assert rank1.kvtier_stats()["tiers"].keys() == {"dram"}  # no SSD directory for what it never writes
    assert not (tmp_path / "ssd").exists() or not any("replicated" in p.name for p in (tmp_path / "ssd").iterdir())
    rank1.close()


def test_replicated_keys_are_rank_free_and_sharded_keys_are_not(tmp_path):
    pools = lambda: {PoolName.INDEXER: IndexerHostPool(), PoolName.MAMBA: MambaHostPool()}  # noqa: E731
    r0 = make(tmp_path / "r0", MLAHostPool(), pools(), is_mla_model=True, tp_rank=0, tp_size=2)
    r1 = make(tmp_path / "r1", MLAHostPool(), pools(), is_mla_model=True, tp_rank=1, tp_size=2)
    assert r0.kvtier_key("p") == r1.kvtier_key("p")
    assert r0._side_stores["indexer"].namespace == r1._side_stores["indexer"].namespace
    assert r0._side_stores["mamba"].namespace != r1._side_stores["mamba"].namespace
    m0 = make(tmp_path / "m0", MHAHostPool("page_first"), {}, tp_rank=0, tp_size=2)
    m1 = make(tmp_path / "m1", MHAHostPool("page_first"), {}, tp_rank=1, tp_size=2)
    assert m0.kvtier_key("p") != m1.kvtier_key("p")  # MHA: each rank its own heads
    for b in (r0, r1, m0, m1):
        b.close()


def test_every_rank_reads_what_the_writer_stored(tmp_path):
    # Two TP ranks of one MLA model over a real Mooncake Store (tiers.remote):
    # rank 1 stores nothing, rank 0 stores; rank 1 finds and reads rank 0's pages.
    from test_remote_mooncake import Master, _require

    _require()
    master = Master(tmp_path / "master.log").start()
    remote = {"enabled": True, "master": master.master, "metadata_server": master.metadata_server,
              "segment_bytes": 32 << 20, "buffer_bytes": 16 << 20}
    settings = {**kvtier_settings(tmp_path), "tiers": {**kvtier_settings(tmp_path)["tiers"], "remote": remote}}
    kv0, ix0, kv1, ix1 = MLAHostPool(), IndexerHostPool(), MLAHostPool(), IndexerHostPool()
    fill_random(kv0, seed=10)
    ix0.fill(seed=11)
    fill_random(kv1, seed=12)  # rank 1's own pool holds other bytes
    ix1.fill(seed=13)
    rank0 = make(tmp_path, kv0, {PoolName.INDEXER: ix0}, settings, is_mla_model=True, tp_rank=0, tp_size=2)
    rank1 = make(tmp_path, kv1, {PoolName.INDEXER: ix1}, settings, is_mla_model=True, tp_rank=1, tp_size=2)
    try:
        keys = ["r0", "r1"]
        both = lambda hi: [PoolTransfer(PoolName.KV, host_indices=hi, keys=keys),  # noqa: E731
                           PoolTransfer(PoolName.INDEXER, host_indices=hi, keys=keys)]
        assert rank1.batch_set_v2(both(slots([0, 1]))) == {PoolName.KV: [False] * 2, PoolName.INDEXER: [False] * 2}
        assert rank1.batch_exists_v2(keys, [PoolTransfer(PoolName.INDEXER, keys=keys)]).kv_hit_pages == 0
        assert rank0.batch_set_v2(both(slots([0, 1]))) == {PoolName.KV: [True] * 2, PoolName.INDEXER: [True] * 2}
        for rank in (rank0, rank1):
            assert rank.batch_exists_v2(keys, [PoolTransfer(PoolName.INDEXER, keys=keys)]).kv_hit_pages == 2
        assert rank1.batch_get_v2(both(slots([4, 5]))) == {PoolName.KV: [True] * 2, PoolName.INDEXER: [True] * 2}
        assert torch.equal(kv1.kv_buffer[4 * PAGE:6 * PAGE], kv0.kv_buffer[0:2 * PAGE])
        assert torch.equal(ix1.buffer[4:6], ix0.buffer[0:2])
    finally:
        rank0.close()
        rank1.close()
        master.kill()


# ------------------------------------------------------------------ bad input, failed loads


def test_bad_input_names_the_pool_and_field(tmp_path):
    backend = make(tmp_path, MHAHostPool("page_first"), {PoolName.SWA: MHAHostPool("page_first", layer_num=1)})
    with pytest.raises(ValueError, match="pool 'mamba' was never registered"):
        backend.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([0]), keys=["a"])])
    with pytest.raises(ValueError, match="pool 'swa': host_indices has 2 slots for 1 keys of page_size 4"):
        backend.batch_set_v2([PoolTransfer(PoolName.SWA, host_indices=slots([0])[:2], keys=["a"])])
    with pytest.raises(ValueError, match="pool 'swa': host_indices has None"):
        backend.batch_get_v2([PoolTransfer(PoolName.SWA, keys=["a"])])
    with pytest.raises(ValueError, match="pool 'swa' has hit_policy 'block_groups'"):
        backend.batch_exists_v2(["a"], [PoolTransfer(PoolName.SWA, keys=["a"], hit_policy="block_groups")])
    with pytest.raises(ValueError, match="host pool 'indexer' .* has no attribute 'get_data_page'"):
        backend.register_mem_host_pool_v2(type("Pool", (), {"page_size": 1})(), PoolName.INDEXER)
    with pytest.raises(ValueError, match="host pool 'swa' registered again"):
        backend.register_mem_host_pool_v2(MHAHostPool("page_first", layer_num=2), PoolName.SWA)
    backend.close()


def test_corrupt_side_pool_value_is_a_miss(tmp_path):
    import lmdb

    from kvtier.keys import key_to_bytes

    kv, mamba = MHAHostPool("page_first"), MambaHostPool()
    mamba.fill(seed=14)
    backend = make(tmp_path, kv, {PoolName.MAMBA: mamba})
    put = PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([0, 1]), keys=["c0", "c1"])
    assert backend.batch_set_v2([put]) == {PoolName.MAMBA: [True, True]}
    key = backend._pool_keys(backend._side_stores["mamba"], ["c1"])[0]
    backend.close()
    (env_dir,) = [p for p in (tmp_path / "ssd").iterdir() if p.name.endswith(".mamba")]
    env = lmdb.open(str(env_dir), subdir=True)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(key_to_bytes(key)))
        value[-1] ^= 0xFF
        txn.put(key_to_bytes(key), bytes(value))
    env.close()
    for buf in (mamba.temporal_buffer, *mamba.conv_buffer):  # restart: empty slots 4, 5
        buf[4:6].zero_()
    backend = make(tmp_path, kv, {PoolName.MAMBA: mamba})
    got = backend.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([4, 5]), keys=["c0", "c1"])])
    assert got == {PoolName.MAMBA: [True, False]}  # never wrong bytes
    assert torch.equal(mamba.get_data_page(4), mamba.get_data_page(0))
    assert not mamba.get_data_page(5).any()
    backend.close()


# ------------------------------------------------------------------ the real SGLang classes


def test_real_sglang_v2(tmp_path):
    # The same round trips with SGLang 0.5.23's own PoolTransfer, PoolName,
    # PoolHitPolicy, HiCacheStorageConfig (its is_storage_writer) and backend
    # factory, in the interpreter test_real_sglang_backend uses.
    if _sglang_python() is None:
        if os.environ.get("KVTIERTEST_REQUIRE_SGLANG") == "1":
            pytest.fail("no sglang interpreter: integrations/sglang/setup_sglang_venv.sh did not build .venv-sglang")
        pytest.skip("no sglang interpreter (integrations/sglang/setup_sglang_venv.sh)")
    script = ROOT / "integrations" / "sglang" / "real_sglang_v2_check.py"
    # mooncake_master sits beside this (main venv) interpreter; the side venv finds it on the PATH
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run([_sglang_python(), str(script), str(tmp_path)], capture_output=True, text=True, check=False,
                          timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    remote = report.pop("writer_rule_remote")
    assert report == {"base_is_sglang": True, "writer_rule_matches_sglang": True, "hybrid_swa_round_trip": True,
                      "hybrid_swa_hit": [4, [4]], "hybrid_mamba_round_trip": True, "hybrid_mamba_hit": [4, [2, 4]],
                      "mla_round_trip": True, "mla_hit": [2, {"kv": 3, "indexer": 2}],
                      "non_writer_sets": {"kv": [False, False], "indexer": [False, False], "mamba": [True]},
                      "bad_pool_error": True}
    from kvtier.benchmarks.remote import mooncake_problem

    if remote == "skipped" and (mooncake_problem() is None or os.environ.get("KVTIERTEST_REQUIRE_MOONCAKE") == "1"):
        pytest.fail("the writer-rule read across ranks did not run on a Mooncake Store")
    assert remote in ("skipped", {"rank1_stored": False, "both_ranks_hit": [2, 2], "rank1_read_bytes": True})
