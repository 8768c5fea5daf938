"""SGLang HiCache storage backend (integrations/sglang/kvtier_sglang).

Runs in the main venv against the backend with a host pool that implements the
contract of SGLang's MHA/MLA host pools (kv_buffer, get_page_buffer_meta,
get_data_page, set_from_flat_data_page), written here. Where sglang itself is
installed (SGLANG_PYTHON, or .venv-sglang from
integrations/sglang/setup_sglang_venv.sh), ``test_real_sglang_*`` repeats the
round trips in that interpreter through SGLang's own StorageBackendFactory and
HiCacheStorage base class.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from kvtier_sglang import KVTierHiCacheStorage
from kvtier_sglang.backend import _HiCacheStorageBase

from kvtier.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PAGE = 4  # tokens per page


@dataclass
class StorageConfig:
    """The fields of SGLang's HiCacheStorageConfig the backend reads."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla_model: bool = False
    model_name: str | None = "tiny-llama"
    extra_config: dict | None = field(default_factory=dict)


class MHAHostPool:
    """A host KV pool with the memory layouts and page metadata of SGLang's
    MHATokenToKVPoolHost (layer_first / page_first), on CPU."""

    def __init__(self, layout: str, num_pages: int = 8, layer_num: int = 2, head_num: int = 2, head_dim: int = 8,
                 dtype: torch.dtype = torch.float16) -> None:
        self.layout, self.page_size, self.layer_num = layout, PAGE, layer_num
        self.head_num, self.head_dim, self.dtype = head_num, head_dim, dtype
        self.size = num_pages * PAGE
        dims = (2, layer_num, self.size, head_num, head_dim) if layout == "layer_first" else \
            (2, self.size, layer_num, head_num, head_dim)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def _token_bytes(self) -> int:
        return self.head_num * self.head_dim * self.dtype.itemsize

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        base, tb, idx = self.kv_buffer.data_ptr(), self._token_bytes(), indices.tolist()
        v_offset = self.layer_num * self.size * tb
        ptrs: list[int] = []
        if self.layout == "layer_first":  # per page: k, v of layer 0, then layer 1, ...
            for first in idx[::PAGE]:
                for layer in range(self.layer_num):
                    k = base + (layer * self.size + first) * tb
                    ptrs += [k, k + v_offset]
            return ptrs, [PAGE * tb] * len(ptrs)
        for first in idx[::PAGE]:  # page_first: per page one k run and one v run
            k = base + first * self.layer_num * tb
            ptrs += [k, k + v_offset]
        return ptrs, [PAGE * self.layer_num * tb] * len(ptrs)

    def _page(self, index: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index:index + PAGE]
        return self.kv_buffer[:, index:index + PAGE]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * self.layer_num * PAGE * self.head_num * self.head_dim, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page(index)
        page.copy_(data_page.reshape(page.shape))


class MLAHostPool:
    """SGLang's MLATokenToKVPoolHost, page_first: one latent run per page."""

    def __init__(self, num_pages: int = 8, layer_num: int = 2, kv_lora_rank: int = 12, qk_rope_head_dim: int = 4):
        self.layout, self.page_size, self.layer_num, self.dtype = "page_first", PAGE, layer_num, torch.bfloat16
        self.kv_lora_rank, self.qk_rope_head_dim, self.head_num = kv_lora_rank, qk_rope_head_dim, 1
        self.size = num_pages * PAGE
        self.kv_buffer = torch.zeros((self.size, layer_num, 1, kv_lora_rank + qk_rope_head_dim), dtype=self.dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        tb = self.layer_num * (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype.itemsize
        ptrs = [self.kv_buffer.data_ptr() + first * tb for first in indices.tolist()[::PAGE]]
        return ptrs, [PAGE * tb] * len(ptrs)


def fill_random(pool, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(pool.kv_buffer.dtype))


def slots(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def kvtier_settings(tmp_path: Path, ssd: bool = True, dram_blocks: int = 64) -> dict:
    tiers: dict = {"dram": {"capacity_blocks": dram_blocks}}
    if ssd:
        tiers["ssd"] = {"enabled": True, "capacity_blocks": 256, "path": str(tmp_path / "ssd"), "codec": "raw"}
    return {"tiers": tiers}


def make_backend(tmp_path: Path, pool, ssd: bool = True, dram_blocks: int = 64, **cfg) -> KVTierHiCacheStorage:
    extra = {"backend_name": "kvtier", "module_path": "kvtier_sglang", "class_name": "KVTierHiCacheStorage",
             "interface_v1": 1, "kvtier": kvtier_settings(tmp_path, ssd, dram_blocks)}
    backend = KVTierHiCacheStorage(StorageConfig(extra_config=extra, **cfg), {})  # the dynamic factory's call
    backend.register_mem_pool_host(pool)
    return backend


@pytest.fixture(params=["layer_first", "page_first"])
def mha_pool(request) -> MHAHostPool:
    return MHAHostPool(request.param)


def test_class_is_a_hicache_storage():
    # Main venv: the contract stand-in (sglang is not installed here); the
    # real base class is exercised by test_real_sglang_backend.
    assert issubclass(KVTierHiCacheStorage, _HiCacheStorageBase)


def test_v1_round_trip_through_host_pool(tmp_path, mha_pool):
    fill_random(mha_pool)
    backend = make_backend(tmp_path, mha_pool)
    # pages 0..2 written under three chained keys
    assert backend.batch_set_v1(["h0", "h1", "h2"], slots([0, 1, 2])) == [True, True, True]
    expected = [mha_pool.get_data_page(p * PAGE).clone() for p in range(3)]
    # read them back into pages 5..7 of the same pool
    assert backend.batch_get_v1(["h0", "h1", "h2"], slots([5, 6, 7])) == [True, True, True]
    for src, dst in zip(expected, (5, 6, 7)):
        assert torch.equal(mha_pool.get_data_page(dst * PAGE), src)
    backend.store.check_invariants()
    backend.close()


def test_v1_pages_equal_generic_flat_pages(tmp_path, mha_pool):
    # A page stored by the zero-copy path reads back through the generic path
    # as get_data_page(flat=True), and the other way round.
    fill_random(mha_pool, seed=1)
    backend = make_backend(tmp_path, mha_pool)
    backend.batch_set_v1(["a"], slots([1]))
    dummy = mha_pool.get_dummy_flat_data_page()
    assert backend.get("a", dummy) is dummy
    assert torch.equal(dummy, mha_pool.get_data_page(PAGE))
    assert backend.set("b", mha_pool.get_data_page(2 * PAGE))
    assert backend.batch_get_v1(["b"], slots([6])) == [True]
    assert torch.equal(mha_pool.get_data_page(6 * PAGE), mha_pool.get_data_page(2 * PAGE))
    backend.close()


def test_generic_round_trip_and_exists(tmp_path):
    pool = MHAHostPool("page_first")
    fill_random(pool, seed=2)
    backend = make_backend(tmp_path, pool, ssd=False)
    pages = [pool.get_data_page(p * PAGE).clone() for p in range(3)]
    assert backend.batch_set(["k0", "k1", "k2"], pages)
    assert backend.exists("k1") and not backend.exists("nope")
    out = backend.batch_get(["k0", "nope", "k2"], [pool.get_dummy_flat_data_page() for _ in range(3)])
    # a miss in the middle does not hide the page after it
    assert out[1] is None and torch.equal(out[0], pages[0]) and torch.equal(out[2], pages[2])
    fresh = backend.get("k2")  # no target: a new uint8 page
    assert torch.equal(fresh, pages[2].view(torch.uint8))
    backend.close()


def test_batch_exists_counts_the_leading_run(tmp_path):
    pool = MHAHostPool("page_first")
    fill_random(pool, seed=3)
    backend = make_backend(tmp_path, pool, ssd=False)
    backend.batch_set_v1(["p0", "p1", "p3"], slots([0, 1, 3]))
    assert backend.batch_exists(["p0", "p1", "p2", "p3"]) == 2  # p2 missing: p3 does not count
    assert backend.batch_exists(["p3", "p0"]) == 2
    assert backend.batch_exists(["p2"]) == 0
    assert backend.batch_exists([]) == 0
    backend.close()


def test_mla_page_is_used_in_place(tmp_path):
    pool = MLAHostPool()
    fill_random(pool, seed=4)
    backend = make_backend(tmp_path, pool, is_mla_model=True)
    layout = backend.store.layout
    assert (layout.arrangement, layout.head_dim, layout.num_kv_heads) == ("mla", 16, 1)
    regions = backend._pointers.pages(slots([2]), 1)
    assert len(regions[0]) == 1  # one contiguous run: no staging copy
    assert regions[0][0].data_ptr() == pool.kv_buffer[2 * PAGE].data_ptr()
    assert backend.batch_set_v1(["m"], slots([2])) == [True]
    assert backend.batch_get_v1(["m"], slots([7])) == [True]
    assert torch.equal(pool.kv_buffer[7 * PAGE:8 * PAGE], pool.kv_buffer[2 * PAGE:3 * PAGE])
    backend.close()


def test_corrupted_ssd_value_is_a_miss(tmp_path):
    pool = MHAHostPool("page_first")
    fill_random(pool, seed=5)
    backend = make_backend(tmp_path, pool)
    backend.batch_set_v1(["c0", "c1"], slots([0, 1]))
    key = backend.kvtier_key("c1")
    backend.close()
    _corrupt_lmdb_value(tmp_path / "ssd", key)
    # restart: DRAM is empty, the SSD holds c0 intact and c1 corrupted
    pool.kv_buffer[:, 4 * PAGE:6 * PAGE].fill_(7)
    backend = make_backend(tmp_path, pool)
    assert backend.batch_exists(["c0", "c1"]) == 2  # indexed; not yet read
    assert backend.batch_get_v1(["c0", "c1"], slots([4, 5])) == [True, False]
    assert torch.equal(pool.get_data_page(4 * PAGE), pool.get_data_page(0))
    assert backend.get("c1") is None  # never wrong bytes
    assert not backend.exists("c1")  # the bad value was dropped
    assert backend.kvtier_stats()["ssd"]["checksum_failures"] >= 1
    backend.close()


def _corrupt_lmdb_value(ssd_root: Path, key: int) -> None:
    """Flip the last byte of ``key``'s stored value (inside the zstd/raw payload)."""
    import lmdb

    from kvtier.keys import key_to_bytes

    (env_dir,) = {p.parent for p in ssd_root.rglob("data.mdb")}
    env = lmdb.open(str(env_dir), subdir=True)
    with env.begin(write=True) as txn:
        value = txn.get(key_to_bytes(key))
        assert value is not None, "stored value not found in the SSD tier"
        flipped = bytearray(value)
        flipped[-1] ^= 0xFF
        txn.put(key_to_bytes(key), bytes(flipped))
    env.close()


def test_restart_over_the_same_directory_finds_the_pages(tmp_path, mha_pool):
    fill_random(mha_pool, seed=6)
    backend = make_backend(tmp_path, mha_pool)
    assert backend.batch_set_v1(["r0", "r1", "r2"], slots([0, 1, 2])) == [True] * 3
    expected = [mha_pool.get_data_page(p * PAGE).clone() for p in range(3)]
    backend.close()
    # a new process: a new backend and an emptied host pool
    mha_pool.kv_buffer.zero_()
    backend = make_backend(tmp_path, mha_pool)
    assert backend.kvtier_stats()["counters"]["ssd_reindexed_blocks"] == 3
    assert backend.batch_exists(["r0", "r1", "r2"]) == 3
    assert backend.batch_get_v1(["r0", "r1", "r2"], slots([3, 4, 5])) == [True] * 3
    for src, dst in zip(expected, (3, 4, 5)):
        assert torch.equal(mha_pool.get_data_page(dst * PAGE), src)
    backend.close()


def test_namespace_separates_models_ranks_and_pool_layouts(tmp_path):
    pool = MHAHostPool("page_first")
    fill_random(pool, seed=7)
    a = make_backend(tmp_path / "a", pool)
    other = [make_backend(tmp_path / "b", pool, model_name="other"),
             make_backend(tmp_path / "c", pool, tp_rank=1, tp_size=2),
             make_backend(tmp_path / "d", MHAHostPool("layer_first"))]
    assert len({a.kvtier_key("x"), *(b.kvtier_key("x") for b in other)}) == 4
    for b in (a, *other):
        b.close()


def test_dram_only_evicts_and_stays_consistent(tmp_path):
    pool = MHAHostPool("page_first", num_pages=8)
    fill_random(pool, seed=8)
    backend = make_backend(tmp_path, pool, ssd=False, dram_blocks=4)
    for start in range(0, 8, 2):
        backend.batch_set_v1([f"e{start}", f"e{start + 1}"], slots([start, start + 1]))
        backend.store.check_invariants()
    assert backend.batch_exists([f"e{i}" for i in range(6, 8)]) == 2  # the newest pages stay
    assert backend.batch_exists(["e0"]) == 0
    backend.close()


def test_config_errors_name_the_extra_config_key(tmp_path):
    with pytest.raises(ConfigError, match="extra_config.kvtier"):
        KVTierHiCacheStorage(StorageConfig(extra_config={"kvtier": "dram"}), {})
    with pytest.raises(ConfigError, match="extra_config.kvtier_config"):
        KVTierHiCacheStorage(StorageConfig(extra_config={"kvtier_config": 3}), {})
    bad = {"kvtier": {**kvtier_settings(tmp_path), "layout": {"block_size": 16}}}
    backend = KVTierHiCacheStorage(StorageConfig(extra_config=bad), {})
    with pytest.raises(ConfigError, match="extra_config.kvtier.layout.block_size"):
        backend.register_mem_pool_host(MHAHostPool("page_first"))
    with pytest.raises(ValueError, match="host_indices"):
        make_backend(tmp_path / "x", MHAHostPool("page_first")).batch_get_v1(["a"], slots([0])[:2])


def _sglang_python() -> str | None:
    explicit = os.environ.get("SGLANG_PYTHON")
    if explicit:
        return explicit
    side = ROOT / ".venv-sglang" / "bin" / "python"
    return str(side) if side.exists() else None


def test_real_sglang_backend(tmp_path):
    # The same round trips, in an interpreter with sglang installed: built by
    # SGLang's StorageBackendFactory("dynamic") from the extra config, as the
    # server does, and checked to subclass the real HiCacheStorage. CI builds
    # the interpreter (scripts/test.sh) and sets KVTIERTEST_REQUIRE_SGLANG=1,
    # so there a missing SGLang fails instead of skipping.
    if _sglang_python() is None:
        if os.environ.get("KVTIERTEST_REQUIRE_SGLANG") == "1":
            pytest.fail("no sglang interpreter: integrations/sglang/setup_sglang_venv.sh did not build .venv-sglang")
        pytest.skip("no sglang interpreter (integrations/sglang/setup_sglang_venv.sh)")
    script = ROOT / "integrations" / "sglang" / "real_sglang_check.py"
    proc = subprocess.run([_sglang_python(), str(script), str(tmp_path)], capture_output=True, text=True, check=False,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"base_is_sglang": True, "factory_built": True, "v1_round_trip": True,
                      "generic_round_trip": True, "batch_exists": 2, "restart_hit": True}
