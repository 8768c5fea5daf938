"""Shared pieces of the fault suite: the figures counter, a small store layout,
block bytes derived from the key alone (so any reader can check any block it
finds), store construction over real tiers, and an RSS probe."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

FIGURES: Counter[str] = Counter()
"""faults_injected / faults_survived / bad_inputs_tried / blocks_verified / blocks_lost / blocks_served_wrong."""
NOTES: list[str] = []
"""Extra lines for the end-of-suite summary (RSS measurements)."""

LAYOUT = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64, "dtype": "bfloat16", "block_size": 16}
BLOCK_BYTES = 2 * 16 * 2 * 1 * 64 * 2  # layers * tokens * (K,V) * heads * dim * bytes = 8 KiB
CODECS = ("raw", "zstd", "bplane-zstd", "auto")


def expected_block(key: int) -> np.ndarray:
    """Bytes of block ``key``: bf16-like normals for even keys (compressible
    exponents), uniform random bytes for odd keys."""
    rng = np.random.default_rng(key)
    if key % 2:
        return rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8)
    u32 = rng.standard_normal(BLOCK_BYTES // 2, dtype=np.float32).view(np.uint32)
    return (u32 >> 16).astype(np.uint16).view(np.uint8)


def store_config(ssd_path: Path | str | None = None, *, dram: int = 64, ssd: int = 1024, codec: str = "raw",
                 put_tier: str = "dram", write_through: bool = False, tenant: str = "", **extra: Any):
    from kvtier.config import load_config

    tiers: dict[str, Any] = {
        "hbm": {"enabled": False},
        "dram": {"enabled": dram > 0, "capacity_blocks": max(dram, 1)},
        "ssd": {"enabled": ssd_path is not None, "capacity_blocks": ssd, "codec": codec, "sync": True,
                **({"path": str(ssd_path)} if ssd_path is not None else {})},
    }
    ssd_extra = extra.pop("ssd_extra", {})
    tiers["ssd"].update(ssd_extra)
    return load_config(env={}, overrides={"layout": LAYOUT, "namespace": {"model": "fault", "tenant": tenant},
                                          "tiers": tiers, "put_tier": put_tier, "write_through": write_through,
                                          **extra})


def make_store(ssd_path: Path | str | None = None, **kwargs: Any):
    from kvtier.store import TieredStore

    return TieredStore(store_config(ssd_path, **kwargs))


def chain_tokens(chain: int, num_blocks: int) -> list[int]:
    """Token ids of chain ``chain`` (distinct chains share no block)."""
    return [chain * 1_000_003 + i for i in range(num_blocks * LAYOUT["block_size"])]


def blocks_for(keys: list[int]) -> list[np.ndarray]:
    return [expected_block(k) for k in keys]


def read_and_check(store: Any, keys: list[int], *, timeout_s: float | None = None) -> tuple[int, int]:
    """``get`` ``keys`` into fresh buffers; returns ``(blocks served, blocks served wrong)``."""
    outs = [np.zeros(BLOCK_BYTES, dtype=np.uint8) for _ in keys]
    n = store.get(keys, outs, timeout_s=timeout_s)
    wrong = sum(not np.array_equal(outs[i], expected_block(keys[i])) for i in range(n))
    FIGURES["blocks_verified"] += n
    FIGURES["blocks_served_wrong"] += wrong
    return n, wrong


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
