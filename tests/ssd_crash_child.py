"""Child process of ``test_ssd_crash``: writes and deletes SSD tier batches until killed.

Usage: ``python ssd_crash_child.py DIR FIRST_BATCH``. Batch ``b`` is
``BLOCKS_PER_BATCH`` chained blocks whose bytes derive from their key alone
(:func:`expected_block`), so the parent can check any value it finds. After
each committed operation the child prints ``P b`` (put) or ``D b`` (delete)
and flushes; after putting batch ``b`` it deletes batch :func:`deletes_after`
``(b)`` (if any) in a separate transaction, so freed pages get reused while the
store still grows slowly. It prints ``R`` once the tier is open.
"""

from __future__ import annotations

import sys

import numpy as np

from kvtier.keys import BlockKey, Namespace
from kvtier.layout import KVLayout
from kvtier.tiers.ssd import SSDTier

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_size=32)  # 64 KiB
NAMESPACE = Namespace("crash-test", "bfloat16", "fused", 32)
BLOCKS_PER_BATCH = 12
MAP_SIZE_BYTES = 1 << 30


def batch_keys(batch: int) -> list[BlockKey]:
    return [BlockKey(batch * 1000 + i + 1) for i in range(BLOCKS_PER_BATCH)]


def key_batch_index(key: BlockKey) -> tuple[int, int]:
    return (key - 1) // 1000, (key - 1) % 1000


def expected_parent(key: BlockKey) -> BlockKey | None:
    return None if key_batch_index(key)[1] == 0 else BlockKey(key - 1)


def deletes_after(batch: int) -> int | None:
    """The batch deleted right after ``batch`` is put: ``batch - 2``, except every 8th."""
    victim = batch - 2
    return victim if victim >= 0 and victim % 8 else None


def expected_block(key: BlockKey) -> np.ndarray:
    """Bytes of block ``key``: bf16-like normals for even keys, random bytes for odd ones."""
    rng = np.random.default_rng(key)
    if key % 2:
        return rng.integers(0, 256, LAYOUT.bytes_per_block, dtype=np.uint8)
    u32 = rng.standard_normal(LAYOUT.bytes_per_block // 2, dtype=np.float32).view(np.uint32)
    return (u32 >> 16).astype(np.uint16).view(np.uint8)


def main(path: str, first_batch: int) -> None:
    tier = SSDTier(path, NAMESPACE, LAYOUT, map_size_bytes=MAP_SIZE_BYTES, sync=True)
    print("R", flush=True)
    batch = first_batch
    while True:
        keys = batch_keys(batch)
        items = [(k, expected_block(k), expected_parent(k)) for k in keys]
        if tier.put_many(items) != len(items):
            raise SystemExit(f"put_many failed: {tier.last_error}")
        print("P", batch, flush=True)
        victim = deletes_after(batch)
        if victim is not None:
            tier.delete_many(batch_keys(victim))
            print("D", victim, flush=True)
        batch += 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
