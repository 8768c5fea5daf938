"""Content keys of shared segments: position-independent, next to chained prefix keys.

Owns: how a block-aligned run of shared tokens (one agent's output that an
all-gather round sends to every agent) becomes a :data:`SegmentKey`, and the
per-block keys inside a segment. Must not import torch or do I/O.

A prefix key (:func:`kvtier.keys.chain_keys`) depends on everything before a
block, so the same text at another offset never matches. A segment key
depends only on the namespace and the segment's own tokens, so every agent
that receives the segment, at whatever offset and after whatever private
history, finds the same key. Segment keys live in their own blake2b domain
and never collide with prefix or foreign keys. A segment must be whole blocks
(the engine pads or splits shared content at block boundaries).

>>> from kvtier.keys import Namespace, chain_keys
>>> ns = Namespace(model="m", dtype="bfloat16", layout="fused", block_size=4)
>>> seg = list(range(100, 108))
>>> segment_key(ns, seg) == segment_key(ns, seg)
True
>>> a = chain_keys(ns, [1, 2, 3, 4] + seg)[1:]   # the segment after one history ...
>>> b = chain_keys(ns, [9, 9, 9, 9] + seg)[1:]   # ... and after another: prefix keys differ
>>> a == b, len(segment_block_keys(ns, segment_key(ns, seg), 2))
(False, 2)
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from hashlib import blake2b
from itertools import pairwise
from typing import NewType

from ..errors import ConfigError
from ..keys import KEY_BYTES, BlockKey, Namespace, key_to_bytes

SegmentKey = NewType("SegmentKey", int)
"""A 128-bit content key of a whole shared segment (position independent)."""

_DOMAIN_SEGMENT = b"kvtier.seg.v1"
_DOMAIN_SEGMENT_BLOCK = b"kvtier.segblk.v1"


def segment_key(ns: Namespace, token_ids: Sequence[int]) -> SegmentKey:
    """Content key of a block-aligned segment of ``token_ids``.

    Raises ``ConfigError`` naming ``shared.segment_tokens`` when the segment
    is empty or not a whole number of ``ns.block_size`` blocks.
    """
    check_block_aligned(ns, len(token_ids))
    h = blake2b(_DOMAIN_SEGMENT, digest_size=KEY_BYTES)
    h.update(ns.digest)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return SegmentKey(int.from_bytes(h.digest(), "big"))


def segment_block_keys(ns: Namespace, seg: SegmentKey, num_blocks: int) -> list[BlockKey]:
    """Keys of the ``num_blocks`` blocks of segment ``seg`` (storage keys of its master).

    Each depends on the segment key and the block's index inside the segment,
    never on the offset where an agent placed the segment.
    """
    if num_blocks <= 0:
        raise ConfigError("shared.num_blocks", num_blocks, "a segment has at least one block")
    prefix = _DOMAIN_SEGMENT_BLOCK + ns.digest + key_to_bytes(BlockKey(seg))
    return [
        BlockKey(int.from_bytes(blake2b(prefix + struct.pack("<I", i), digest_size=KEY_BYTES).digest(), "big"))
        for i in range(num_blocks)
    ]


def check_block_aligned(ns: Namespace, num_tokens: int) -> int:
    """Number of blocks of a ``num_tokens`` segment; raises unless it is whole blocks."""
    if num_tokens <= 0 or num_tokens % ns.block_size:
        raise ConfigError(
            "shared.segment_tokens", num_tokens,
            f"a shared segment must be a positive multiple of block_size={ns.block_size} tokens; "
            "pad or split shared content at block boundaries",
        )
    return num_tokens // ns.block_size


def split_segments(ns: Namespace, token_ids: Sequence[int], boundaries: Sequence[int]) -> list[SegmentKey]:
    """Segment keys of ``token_ids`` cut at ``boundaries`` (token offsets, increasing,
    each a multiple of the block size; the end is implied)."""
    cuts = [0, *boundaries, len(token_ids)]
    if any(b <= a for a, b in pairwise(cuts)):
        raise ConfigError("shared.boundaries", list(boundaries), "must be increasing offsets inside the tokens")
    return [segment_key(ns, token_ids[a:b]) for a, b in pairwise(cuts)]
