"""Deterministic 128-bit block keys chained over a namespace.

Owns: how a block of token ids (or a foreign id such as a trace ``hash_id``
or an engine's block-hash bytes) becomes a :data:`BlockKey`. Keys depend only
on their inputs: never on Python's ``hash()``, the process or
``PYTHONHASHSEED``. Must not import torch or touch I/O.

A key is ``blake2b-128(domain || namespace digest || parent key || payload)``,
so two blocks match only when their namespace, their whole prefix and their
own tokens match. Keys are plain ``int`` values (fast dict keys); use
:func:`key_to_bytes` / :func:`key_from_bytes` for storage.

>>> ns = Namespace(model="m", dtype="bfloat16", layout="fused", block_size=4)
>>> a = chain_keys(ns, [1, 2, 3, 4, 5, 6, 7, 8])
>>> len(a), a[0] != a[1]
(2, True)
>>> chain_keys(ns, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == a  # partial block ignored
True
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Iterable, NewType, Sequence

BlockKey = NewType("BlockKey", int)
"""A 128-bit block key (unsigned int below ``2**128``)."""

KEY_BYTES = 16
_DOMAIN_TOKENS = b"kvtier.tok.v1"
_DOMAIN_FOREIGN = b"kvtier.ext.v1"
_DOMAIN_NAMESPACE = b"kvtier.ns.v1"
_ROOT_PARENT = bytes(KEY_BYTES)


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that makes two identical token blocks hold different KV.

    Blocks of different namespaces never match. ``tenant`` is the cache salt:
    tenants never share blocks.
    """

    model: str
    dtype: str
    layout: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    tenant: str = ""
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"Namespace.block_size={self.block_size!r}: must be > 0")
        text = "\x1f".join(
            str(v)
            for v in (
                self.model,
                self.dtype,
                self.layout,
                self.block_size,
                self.tp_rank,
                self.tp_size,
                self.pp_rank,
                self.tenant,
            )
        )
        h = blake2b(_DOMAIN_NAMESPACE + text.encode(), digest_size=KEY_BYTES)
        object.__setattr__(self, "digest", h.digest())


_U64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints that spreads nearby
    inputs over the whole range (for ints used as dict keys, whose Python hash
    is the value modulo ``2**61 - 1``)."""
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def key_to_bytes(key: BlockKey) -> bytes:
    """16 big-endian bytes of ``key`` (the storage form)."""
    return key.to_bytes(KEY_BYTES, "big")


def key_from_bytes(raw: bytes) -> BlockKey:
    """Inverse of :func:`key_to_bytes`; raises ``ValueError`` on bad length."""
    if len(raw) != KEY_BYTES:
        raise ValueError(f"block key must be {KEY_BYTES} bytes, got {len(raw)}")
    return BlockKey(int.from_bytes(raw, "big"))


def _digest(domain: bytes, ns: Namespace, parent: BlockKey | None, payload: bytes) -> BlockKey:
    h = blake2b(domain, digest_size=KEY_BYTES)
    h.update(ns.digest)
    h.update(_ROOT_PARENT if parent is None else key_to_bytes(parent))
    h.update(payload)
    return BlockKey(int.from_bytes(h.digest(), "big"))


def block_key(ns: Namespace, parent: BlockKey | None, token_ids: Sequence[int]) -> BlockKey:
    """Key of one full block of ``token_ids`` following ``parent``.

    Raises ``ValueError`` when the block is not exactly ``ns.block_size`` long.
    """
    if len(token_ids) != ns.block_size:
        raise ValueError(f"block has {len(token_ids)} tokens, namespace block_size={ns.block_size}")
    return _digest(_DOMAIN_TOKENS, ns, parent, struct.pack(f"<{len(token_ids)}q", *token_ids))


def chain_keys(ns: Namespace, token_ids: Sequence[int], parent: BlockKey | None = None) -> list[BlockKey]:
    """Keys of every *full* block of ``token_ids``; a trailing partial block is ignored."""
    bs = ns.block_size
    keys: list[BlockKey] = []
    for start in range(0, len(token_ids) - bs + 1, bs):
        parent = block_key(ns, parent, token_ids[start : start + bs])
        keys.append(parent)
    return keys


def foreign_key(ns: Namespace, parent: BlockKey | None, foreign_id: int | bytes | str) -> BlockKey:
    """Key of a block known only by a foreign id (trace ``hash_id``, engine hash bytes).

    Foreign ids live in their own domain, so they never collide with token keys.
    """
    if isinstance(foreign_id, int):
        payload = b"i" + foreign_id.to_bytes((foreign_id.bit_length() + 8) // 8 or 1, "big", signed=True)
    elif isinstance(foreign_id, str):
        payload = b"s" + foreign_id.encode()
    elif isinstance(foreign_id, (bytes, bytearray, memoryview)):
        payload = b"b" + bytes(foreign_id)
    else:
        raise TypeError(f"foreign id must be int, str or bytes, got {type(foreign_id).__name__}")
    return _digest(_DOMAIN_FOREIGN, ns, parent, payload)


def chain_foreign_keys(
    ns: Namespace, foreign_ids: Iterable[int | bytes | str], parent: BlockKey | None = None
) -> list[BlockKey]:
    """Chained keys of a sequence of foreign block ids."""
    keys: list[BlockKey] = []
    for fid in foreign_ids:
        parent = foreign_key(ns, parent, fid)
        keys.append(parent)
    return keys
