"""Block keys: deterministic across processes and PYTHONHASHSEED, chained, namespaced."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.keys import (
    BlockKey,
    Namespace,
    block_key,
    chain_foreign_keys,
    chain_keys,
    foreign_key,
    key_from_bytes,
    key_to_bytes,
)

NS = Namespace(model="llama", dtype="bfloat16", layout="fused:L2", block_size=4)
_SCRIPT = (
    "from kvtier.keys import Namespace, chain_keys, chain_foreign_keys;"
    "ns = Namespace(model='llama', dtype='bfloat16', layout='fused:L2', block_size=4, tenant='t1');"
    "print([hex(k) for k in chain_keys(ns, list(range(12)))] + "
    "[hex(k) for k in chain_foreign_keys(ns, [7, b'ab', 'x'])])"
)


def test_same_keys_in_fresh_interpreters_with_different_hash_seeds() -> None:
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True)
        outs.add(res.stdout.strip())
    assert len(outs) == 1
    ns = Namespace(model="llama", dtype="bfloat16", layout="fused:L2", block_size=4, tenant="t1")
    here = [hex(k) for k in chain_keys(ns, list(range(12)))] + [hex(k) for k in chain_foreign_keys(ns, [7, b"ab", "x"])]
    assert outs == {str(here)}


def test_chain_depends_on_whole_prefix() -> None:
    a = chain_keys(NS, [1, 2, 3, 4, 5, 6, 7, 8])
    b = chain_keys(NS, [9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]  # same second block, different first block
    assert a[1] == block_key(NS, a[0], [5, 6, 7, 8])
    assert all(0 <= k < 2**128 for k in a)


@pytest.mark.parametrize("field", ["model", "dtype", "layout", "block_size", "tp_rank", "tenant"])
def test_every_namespace_field_separates_keys(field: str) -> None:
    other = {"model": "m2", "dtype": "float16", "layout": "split", "block_size": 4, "tp_rank": 1, "tenant": "x"}
    kwargs = dict(model="llama", dtype="bfloat16", layout="fused:L2", block_size=4)
    kwargs[field] = other[field] if field != "block_size" else 4
    ns2 = Namespace(**kwargs)
    if field == "block_size":
        ns2 = Namespace(model="llama", dtype="bfloat16", layout="fused:L2", block_size=2)
        assert chain_keys(ns2, [1, 2, 3, 4])[1] != chain_keys(NS, [1, 2, 3, 4])[0]
    else:
        assert chain_keys(ns2, [1, 2, 3, 4]) != chain_keys(NS, [1, 2, 3, 4])


def test_foreign_ids_have_their_own_domain() -> None:
    assert foreign_key(NS, None, 5) != foreign_key(NS, None, "5") != foreign_key(NS, None, b"5")
    assert chain_foreign_keys(NS, [1, 2])[1] == foreign_key(NS, foreign_key(NS, None, 1), 2)
    with pytest.raises(TypeError):
        foreign_key(NS, None, 1.5)  # type: ignore[arg-type]


def test_bad_block_length_and_key_bytes() -> None:
    with pytest.raises(ValueError, match="block_size=4"):
        block_key(NS, None, [1, 2, 3])
    with pytest.raises(ValueError, match="16 bytes"):
        key_from_bytes(b"short")


@given(st.integers(min_value=0, max_value=2**128 - 1))
def test_key_bytes_round_trip(k: int) -> None:
    assert key_from_bytes(key_to_bytes(BlockKey(k))) == k
