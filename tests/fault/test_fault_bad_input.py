"""Bad input next to stored data: nothing already stored is lost.

The parsers themselves are fuzzed elsewhere — config files and settings in
``tests/test_config.py`` (only ``ConfigError``, naming the setting or file),
trace readers in ``tests/test_replay_readers.py`` (only ``TraceError``,
naming the file and request), the SSD value header in ``tests/test_ssd.py``
(never raises, never verifies a mutated value), protobuf at the server in
``tests/test_hints_fuzz.py``; all four also under coverage-guided atheris
(libFuzzer) in ``tests/test_atheris.py``. Here the same kinds of junk meet a store that
holds real blocks:

* arbitrary bytes under arbitrary keys in the LMDB directory of a store:
  the restart purges or ignores them, reads of them are misses, and every
  good block still reads back byte-exact;
* arbitrary configurations pointed at that directory (other layouts,
  tenants, codecs, junk values): either a ``ConfigError`` naming a setting,
  or a store that opens, works, and leaves the first store's blocks intact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
from fault_support import (
    BLOCK_BYTES,
    FIGURES,
    LAYOUT,
    blocks_for,
    chain_tokens,
    make_store,
    read_and_check,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.keys import key_to_bytes
from kvtier.tiers.codec import HEADER_BYTES

# data_too_large: junk values are block-sized (8 KiB + a header), near hypothesis's buffer size on purpose.
FUZZ = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
NUM_CHAINS = 4


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    path = tmp_path_factory.mktemp("bad-input") / "ssd"
    with make_store(path, dram=0, ssd=512, codec="auto", put_tier="ssd") as store:
        chains = [store.keys_for(chain_tokens(c, 4)) for c in range(NUM_CHAINS)]
        for keys in chains:
            assert store.put(keys, blocks_for(keys)) == 4
    return path, chains


def _all_good_blocks_read_back(path: Path, chains: list[list[int]], *, restore: bool = False) -> None:
    """Every block of ``chains`` reads back exactly (with ``restore``, blocks a
    same-namespace store legitimately evicted are put back first)."""
    with make_store(path, dram=0, ssd=512, put_tier="ssd") as store:
        for keys in chains:
            if restore:
                store.put(keys, blocks_for(keys))
            served, wrong = read_and_check(store, keys)
            if served != len(keys):
                FIGURES["blocks_lost"] += len(keys) - served
            assert (served, wrong) == (len(keys), 0), store.explain_miss(keys)
        store.check_invariants()


junk_values = st.one_of(
    st.binary(max_size=HEADER_BYTES + 64),
    st.binary(min_size=BLOCK_BYTES, max_size=BLOCK_BYTES + HEADER_BYTES),
    st.builds(lambda b: b"KVTB" + b, st.binary(max_size=HEADER_BYTES + 32)),  # right magic, junk after
)
junk_keys = st.one_of(st.binary(min_size=1, max_size=40), st.integers(0, 2**128 - 1).map(key_to_bytes))


@FUZZ
@given(entries=st.lists(st.tuples(junk_keys, junk_values), min_size=1, max_size=6), overwrite=st.booleans(),
       victim=st.integers(0, NUM_CHAINS - 1))
def test_junk_values_in_the_directory_never_cost_a_good_block(stored, entries, overwrite, victim) -> None:
    path, chains = stored
    # Junk is written under junk keys; with ``overwrite`` one good block is also
    # replaced by junk (then only that chain's tail may be lost, and is restored after).
    env = lmdb.open(str(path), subdir=True, map_size=1 << 30)
    target = key_to_bytes(chains[victim][3])
    with env.begin(write=True) as txn:
        good_value = bytes(txn.get(target))
        own = {key_to_bytes(k) for keys in chains for k in keys}
        for key, value in entries:
            if key not in own:
                txn.put(key, value)
        if overwrite:
            txn.put(target, entries[0][1])
    env.close()
    FIGURES["bad_inputs_tried"] += len(entries) + overwrite
    with make_store(path, dram=0, ssd=512, put_tier="ssd") as store:
        for i, keys in enumerate(chains):
            served, wrong = read_and_check(store, keys)
            assert wrong == 0
            assert served == (3 if overwrite and i == victim else 4)
        for key, _ in entries:  # a junk key, if it happens to be 16 bytes, is a miss
            if len(key) == 16:
                out = np.zeros(BLOCK_BYTES, dtype=np.uint8)
                assert store.get([int.from_bytes(key, "big")], [out]) == 0
        store.check_invariants()
    if overwrite:  # put the good value back for the next example
        env = lmdb.open(str(path), subdir=True, map_size=1 << 30)
        with env.begin(write=True) as txn:
            txn.put(target, good_value)
        env.close()
    _all_good_blocks_read_back(path, chains)


_overrides = st.fixed_dictionaries({}, optional={
    "layout": st.fixed_dictionaries({}, optional={
        "num_layers": st.sampled_from([1, 2, 0, -1, "2", 2.5]),
        "head_dim": st.sampled_from([64, 32, 0, None]),
        "dtype": st.sampled_from(["bfloat16", "float16", "int8", "fp4", ""]),
        "block_size": st.sampled_from([16, 8, 0, 3])}),
    "namespace": st.fixed_dictionaries({}, optional={
        "model": st.sampled_from(["fault", "other", "", "../../etc"]),
        "tenant": st.sampled_from(["", "t1", "t2", "x" * 300])}),
    "tiers": st.fixed_dictionaries({}, optional={
        "ssd": st.fixed_dictionaries({}, optional={
            "codec": st.sampled_from(["raw", "zstd", "bplane-zstd", "auto", "lz4", ""]),
            "capacity_blocks": st.sampled_from([1, 2, 512, 0, -5]),
            "map_size_bytes": st.sampled_from([None, 1, 1 << 20, 1 << 30]),
            "policy": st.sampled_from(["lru", "lfu", "s3fifo", "nope"])}),
        "dram": st.fixed_dictionaries({}, optional={"capacity_blocks": st.sampled_from([1, 8, 0])})}),
    "put_tier": st.sampled_from(["ssd", "dram", "hbm", "nvme"]),
})


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@settings(FUZZ, max_examples=80)
@given(extra=_overrides)
def test_any_configuration_on_the_directory_errors_clearly_or_leaves_its_blocks_intact(stored, extra) -> None:
    from kvtier.store import TieredStore

    path, chains = stored
    base = {"layout": dict(LAYOUT), "namespace": {"model": "fault"},
            "tiers": {"hbm": {"enabled": False}, "dram": {"capacity_blocks": 4},
                      "ssd": {"enabled": True, "path": str(path), "capacity_blocks": 512, "sync": True}},
            "put_tier": "ssd"}
    FIGURES["bad_inputs_tried"] += 1
    try:
        cfg = load_config(env={}, overrides=_merge(base, extra))
    except ConfigError as err:
        assert err.setting and err.setting.split(".")[0] in {"layout", "namespace", "tiers", "put_tier"}, err
        _all_good_blocks_read_back(path, chains)
        return
    with TieredStore(cfg) as other:  # a valid config: it opens, works, and evicts only its own blocks
        same_namespace = other.namespace.digest == make_namespace_digest()
        keys = other.keys_for(chain_tokens(1000, 2))
        other.put(keys, [np.zeros(other.layout.bytes_per_block, dtype=np.uint8) for _ in keys])
        other.check_invariants()
    # Another namespace (layout, model, tenant) never touches these blocks. The
    # same namespace is the same cache: a smaller capacity may evict some of them.
    _all_good_blocks_read_back(path, chains, restore=same_namespace)


def make_namespace_digest() -> bytes:
    from fault_support import store_config

    cfg = store_config(None)
    return cfg.namespace.to_namespace(cfg.layout.to_layout()).digest
