"""``kvtier bench tiers``: tier throughput against baselines measured in the same run.

For each block size it measures, through the public :class:`~kvtier.store.TieredStore`
(manager bookkeeping included):

* ``memcpy_gbps``: a torch copy of the same bytes between preallocated buffers (baseline);
* ``dram_put_gbps`` / ``dram_get_gbps``: store.put / store.get on a DRAM-only store.
  The blocks are rows of one tensor, as an engine's pages are, so each batch
  of a fresh chain is one run copied as one (see ``TensorPool.write``); the
  gets read into separate buffers, block by block;
  ``dram_put_scattered_gbps``: the same puts with each batch's blocks in a
  shuffled order, so no run forms and every block is copied on its own (no
  target: it shows what the run copy buys), interleaved with a second memcpy
  baseline (``memcpy_2_gbps``) rather than joining the rounds above;
  ``dram_put_evicting_gbps``: puts into a full store, each block evicting one;
* ``raw_file_write_gbps``: plain ``write`` + ``fsync`` of the same bytes in the same
  batches (baseline); ``ssd_put_gbps``: store.put on an SSD-only store with
  ``sync=True`` (one fsync'ed LMDB transaction per batch: equal durability);
* ``raw_file_read_gbps``: ``readinto`` of that file from a warm page cache (baseline);
  ``ssd_get_gbps``: store.get from a warm LMDB map (checksums verified);
* ``zstd_ratio_bf16``: raw/stored bytes of bf16 KV-like data under the ``auto`` codec;

The startup heap is frozen before measuring, as vLLM does after init (see
:func:`run`). Each figure is the best of ``REPEATS`` rounds, and each baseline runs
interleaved with what it is compared to (memcpy / put / get, file write / SSD
put / file read / SSD get), so load from other jobs on a shared machine hits
both sides of a ratio alike;

and once, ``lookup_ms_15625_keys``: a longest-prefix lookup over a 1M-token prefix at
block size 64 (15,625 chained keys), all present.
"""

from __future__ import annotations

import gc
import os
import random
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import load_config
from ..keys import BlockKey, Namespace, chain_foreign_keys
from ..manager import TierManager, TierSpec
from ..store import TieredStore
from ..tiers.pool import host_run
from .common import best_seconds, bf16_blocks, gbps, interleaved_best_seconds

BLOCK_SIZES_BYTES = (256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
BATCH_BLOCKS = 16
REPEATS = 9  # interleaved rounds; each figure is the best of them
EVICT_REPEATS = 3  # rounds of puts into a full DRAM store
AUTO_CODEC_REPEATS = 3  # rounds of the zstd codec's put / get (no target: fewer)
TARGETS = {
    "dram_put_vs_memcpy": 0.8,
    "dram_get_vs_memcpy": 0.8,
    "ssd_put_vs_raw_write": 0.5,
    "ssd_get_vs_raw_read": 0.6,
}
LOOKUP_TARGET_MS = 3.0


def _layout_for(block_bytes: int) -> dict[str, Any]:
    # 16 tokens x 2 (K,V) x 8 heads x 128 dim x 2 bytes = 64 KiB per layer.
    return {"num_layers": block_bytes // (64 * 1024), "num_kv_heads": 8, "head_dim": 128,
            "dtype": "bfloat16", "block_size": 16, "arrangement": "fused"}


def make_store(block_bytes: int, num_blocks: int, tier: str, ssd_dir: str | None = None,
               codec: str = "raw") -> TieredStore:
    overrides: dict[str, Any] = {
        "layout": _layout_for(block_bytes),
        "tiers": {
            "hbm": {"enabled": False},
            "dram": {"enabled": tier == "dram", "capacity_blocks": num_blocks},
            "ssd": {"enabled": tier == "ssd", "capacity_blocks": num_blocks, "sync": True, "codec": codec,
                    **({"path": ssd_dir} if ssd_dir else {})},
        },
        "put_tier": tier,
        "write_through": False,
    }
    return TieredStore(load_config(overrides=overrides, env={}))


def in_batches(items: list[Any]) -> list[list[Any]]:
    return [items[i : i + BATCH_BLOCKS] for i in range(0, len(items), BATCH_BLOCKS)]


class RoundPutter:
    """Calling it puts ``blocks`` under a fresh set of keys (one round); ``keys``
    are the last round's.

    Keys are real chained digests (what :func:`~kvtier.keys.chain_foreign_keys`
    gives a user), made before anything is timed: synthetic integers such as
    ``(round << 64) | i`` are a trap, since Python hashes an int modulo
    ``2**61 - 1`` and ``2**64`` is 8 there, so key ``i`` of one round collides
    with key ``i - 8`` of the next and every dict probe of the index walks a
    chain as long as the number of rounds stored."""

    def __init__(self, store: TieredStore, blocks: list[torch.Tensor], rounds: int) -> None:
        self.store, self.blocks, self.round = store, blocks, 0
        self.keys: list[BlockKey] = []
        ns = Namespace(model="bench-tiers", dtype="bfloat16", layout="fused", block_size=16)
        n = len(blocks)
        ids = chain_foreign_keys(ns, range(rounds * n))
        self._rounds = [ids[r * n : (r + 1) * n] for r in range(rounds)]

    def __call__(self) -> None:
        if self.round >= len(self._rounds):
            raise RuntimeError(f"RoundPutter made keys for {len(self._rounds)} rounds; round {self.round + 1} asked")
        self.keys = self._rounds[self.round]
        self.round += 1
        for kb, bb in zip(in_batches(self.keys), in_batches(self.blocks)):
            self.store.put(kb, bb)


def memcpy_baseline(blocks: list[torch.Tensor], outs: list[torch.Tensor]) -> Callable[[], None]:
    """The DRAM baseline: a torch copy of each block into its own preallocated buffer."""

    def memcpy() -> None:
        for src, dst in zip(blocks, outs):
            dst.copy_(src)

    return memcpy


def raw_file_baselines(blocks: list[torch.Tensor], outs: list[torch.Tensor],
                       path: Path) -> tuple[Callable[[], None], Callable[[], None]]:
    """The SSD baselines: plain ``write`` + ``fsync`` of ``blocks`` to ``path`` in
    batches of ``BATCH_BLOCKS`` (one fsync a batch, as an SSD put commits one
    transaction a batch), and ``readinto`` of that file into ``outs`` (a warm
    page cache once written)."""

    def raw_write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for batch in in_batches(blocks):
                for b in batch:
                    os.write(fd, b.numpy())
                os.fsync(fd)
        finally:
            os.close(fd)

    def raw_read() -> None:
        with open(path, "rb", buffering=0) as f:
            for o in outs:
                f.readinto(o.numpy())

    return raw_write, raw_read


def bench_memcpy_and_dram(block_bytes: int, total_bytes: int) -> dict[str, float]:
    n = max(BATCH_BLOCKS, total_bytes // block_bytes)
    blocks = bf16_blocks(n, block_bytes)
    outs = [torch.empty(block_bytes, dtype=torch.uint8) for _ in range(n)]
    nbytes = n * block_bytes
    memcpy = memcpy_baseline(blocks, outs)

    # every round of fresh keys fits: this measures the put path itself (no eviction)
    store = make_store(block_bytes, (REPEATS + 1) * n, "dram")
    put = RoundPutter(store, blocks, REPEATS)

    def get() -> None:  # the blocks of the latest put round
        for kb, ob in zip(in_batches(put.keys), in_batches(outs)):
            assert store.get(kb, ob) == len(kb)

    memcpy()  # fault the output buffers in before anything is timed
    memcpy_s, put_s, get_s = interleaved_best_seconds([memcpy, put, get], REPEATS)
    assert all(torch.equal(a, b) for a, b in zip(blocks, outs)), "dram get returned wrong bytes"
    store.close()
    scattered_blocks = [b for batch in in_batches(blocks) for b in random.Random(7).sample(batch, len(batch))]
    # what each variant measures: every batch of `blocks` is a run, no batch of `scattered_blocks` is
    assert all(host_run(b, block_bytes) is not None for b in in_batches(blocks))
    assert all(host_run(b, block_bytes) is None for b in in_batches(scattered_blocks))
    scattered_store = make_store(block_bytes, (REPEATS + 1) * n, "dram")
    put_scattered = RoundPutter(scattered_store, scattered_blocks, REPEATS)
    # its own pair with the baseline: a fourth variant in the rounds above shifts the others' ratios
    memcpy_2_s, put_scattered_s = interleaved_best_seconds([memcpy, put_scattered], REPEATS)
    for kb, ob in zip(in_batches(put_scattered.keys), in_batches(outs)):
        assert scattered_store.get(kb, ob) == len(kb)
    assert all(torch.equal(a, b) for a, b in zip(scattered_blocks, outs)), "scattered dram put stored wrong bytes"
    scattered_store.close()
    # steady state of a full cache: every put also evicts one block
    full = make_store(block_bytes, n, "dram")
    put_evicting = RoundPutter(full, blocks, 1 + EVICT_REPEATS)
    put_evicting()  # fill
    put_evict_s = best_seconds(put_evicting, EVICT_REPEATS)
    full.close()
    return {"memcpy_gbps": gbps(nbytes, memcpy_s), "dram_put_gbps": gbps(nbytes, put_s),
            "dram_get_gbps": gbps(nbytes, get_s), "dram_put_scattered_gbps": gbps(nbytes, put_scattered_s),
            "memcpy_2_gbps": gbps(nbytes, memcpy_2_s),
            "dram_put_evicting_gbps": gbps(nbytes, put_evict_s)}


def bench_ssd(block_bytes: int, total_bytes: int, workdir: str) -> dict[str, float]:
    n = max(BATCH_BLOCKS, total_bytes // block_bytes)
    blocks = bf16_blocks(n, block_bytes, seed=1)
    nbytes = n * block_bytes
    path = Path(workdir) / f"raw_{block_bytes}.bin"
    outs = [torch.empty(block_bytes, dtype=torch.uint8) for _ in range(n)]
    raw_write, raw_read = raw_file_baselines(blocks, outs, path)

    out: dict[str, float] = {}
    for codec, suffix in (("raw", ""), ("auto", "_auto")):
        ssd_dir = tempfile.mkdtemp(prefix=f"ssd_{codec}_{block_bytes}_", dir=workdir)
        store = make_store(block_bytes, n, "ssd", ssd_dir, codec)
        put = RoundPutter(store, blocks, REPEATS)  # each round replaces the last: puts include their evictions

        def get() -> None:  # warm: the latest round's values, just written
            for kb, ob in zip(in_batches(put.keys), in_batches(outs)):
                assert store.get(kb, ob, promote=False) == len(kb)

        if codec == "raw":  # the targets: each baseline interleaved with what it is compared to
            raw_write_s, put_s, raw_read_s, get_s = interleaved_best_seconds([raw_write, put, raw_read, get],
                                                                             REPEATS)
            out["raw_file_write_gbps"] = gbps(nbytes, raw_write_s)
            out["raw_file_read_gbps"] = gbps(nbytes, raw_read_s)
        else:
            put_s, get_s = interleaved_best_seconds([put, get], AUTO_CODEC_REPEATS)
            st = store.stats()["ssd"]
            out["zstd_ratio_bf16"] = st["raw_bytes_written"] / st["bytes_written"]
        assert all(torch.equal(a, b) for a, b in zip(blocks, outs)), f"ssd get ({codec}) returned wrong bytes"
        out[f"ssd_put_gbps{suffix}"] = gbps(nbytes, put_s)
        out[f"ssd_get_gbps{suffix}"] = gbps(nbytes, get_s)
        store.close()
    return out


def bench_lookup_ms(num_keys: int = 15625) -> float:
    ns = Namespace(model="bench", dtype="bfloat16", layout="fused", block_size=64)
    keys = chain_foreign_keys(ns, range(num_keys))
    m = TierManager([TierSpec("dram", num_keys)], record_events=False)
    m.complete_store(m.prepare_store("dram", keys), True)
    assert m.lookup(keys).num_blocks == num_keys
    return best_seconds(lambda: m.lookup(keys), repeats=7) * 1e3


def run(total_mib: int = 128, ssd_total_mib: int = 64, progress=print) -> dict[str, Any]:
    """Run every measurement; returns ``{"results": [...], "lookup_ms_15625_keys": ..., "targets": ...}``.

    The process's startup heap (torch and every import: hundreds of thousands
    of objects) is frozen first, as vLLM's engine core, workers and API server
    do after init (``vllm.utils.gc_utils.freeze_gc_heap``): the cyclic
    collector then still visits every object made while measuring (kvtier's
    index nodes, plans, events), but not the import-time heap, whose size says
    nothing about kvtier. Unfrozen again on return."""
    gc.collect()
    gc.freeze()
    try:
        return _run(total_mib, ssd_total_mib, progress)
    finally:
        gc.unfreeze()


def _run(total_mib: int, ssd_total_mib: int, progress) -> dict[str, Any]:
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as workdir:
        for size in BLOCK_SIZES_BYTES:
            progress(f"[bench tiers] block {size // 1024} KiB: memcpy / dram ...")
            row: dict[str, Any] = {"block_kib": size // 1024}
            row.update(bench_memcpy_and_dram(size, total_mib << 20))
            progress(f"[bench tiers] block {size // 1024} KiB: raw file / ssd ...")
            row.update(bench_ssd(size, ssd_total_mib << 20, workdir))
            row["dram_put_vs_memcpy"] = row["dram_put_gbps"] / row["memcpy_gbps"]
            row["dram_get_vs_memcpy"] = row["dram_get_gbps"] / row["memcpy_gbps"]
            row["dram_put_scattered_vs_memcpy"] = row["dram_put_scattered_gbps"] / row["memcpy_2_gbps"]
            row["ssd_put_vs_raw_write"] = row["ssd_put_gbps"] / row["raw_file_write_gbps"]
            row["ssd_get_vs_raw_read"] = row["ssd_get_gbps"] / row["raw_file_read_gbps"]
            results.append(row)
    lookup_ms = bench_lookup_ms()
    met = {k: all(r[k] >= v for r in results) for k, v in TARGETS.items()}
    met["lookup_ms_15625_keys"] = lookup_ms <= LOOKUP_TARGET_MS
    return {"results": results, "lookup_ms_15625_keys": lookup_ms,
            "targets": {**TARGETS, "lookup_ms_15625_keys": LOOKUP_TARGET_MS}, "targets_met": met}
