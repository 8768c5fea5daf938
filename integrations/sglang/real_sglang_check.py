"""Round trips of the kvtier backend inside a real SGLang installation.

Run by tests/test_sglang_backend.py with an interpreter that has sglang (see
setup_sglang_venv.sh): builds the backend the way SGLang's server does —
``StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(...))``
then ``register_mem_pool_host`` — and exercises it with the test file's host
pool. Prints one JSON line of findings; exits non-zero on an error.

    python integrations/sglang/real_sglang_check.py TMPDIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from test_sglang_backend import PAGE, MHAHostPool, fill_random, slots


def build(tmp: Path, pool: MHAHostPool) -> HiCacheStorage:
    extra = {
        "backend_name": "kvtier", "module_path": "kvtier_sglang", "class_name": "KVTierHiCacheStorage",
        "interface_v1": 1,
        "kvtier": {"tiers": {"dram": {"capacity_blocks": 32},
                             "ssd": {"enabled": True, "capacity_blocks": 64, "path": str(tmp / "ssd")}}},
    }
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=pool.layout == "page_first", model_name="tiny-llama",
        extra_config=extra,
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def main(tmp: Path) -> dict:
    from kvtier_sglang import KVTierHiCacheStorage

    pool = MHAHostPool("page_first")
    fill_random(pool, seed=11)
    backend = build(tmp, pool)
    found = {"base_is_sglang": issubclass(KVTierHiCacheStorage, HiCacheStorage),
             "factory_built": isinstance(backend, KVTierHiCacheStorage)}
    info = HiCacheStorageExtraInfo(prefix_keys=None)
    ok_set = backend.batch_set_v1(["s0", "s1"], slots([0, 1]), info)
    info2 = HiCacheStorageExtraInfo(prefix_keys=["s0", "s1"])
    ok_set += backend.batch_set_v1(["s2"], slots([2]), info2)
    ok_get = backend.batch_get_v1(["s0", "s1", "s2"], slots([4, 5, 6]), info)
    found["v1_round_trip"] = ok_set == ok_get == [True] * 3 and all(
        torch.equal(pool.get_data_page(a * PAGE), pool.get_data_page(b * PAGE)) for a, b in ((0, 4), (1, 5), (2, 6)))
    page = pool.get_data_page(3 * PAGE)
    dummy = pool.get_dummy_flat_data_page()
    found["generic_round_trip"] = bool(backend.batch_set(["g"], [page]) and backend.batch_get(["g"], [dummy])[0]
                                       is not None and torch.equal(dummy, page))
    found["batch_exists"] = backend.batch_exists(["s0", "s1", "missing", "s2"], info)
    backend.close()
    again = build(tmp, pool)
    found["restart_hit"] = again.batch_exists(["s0", "s1", "s2", "g"]) == 4
    again.close()
    return found


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
