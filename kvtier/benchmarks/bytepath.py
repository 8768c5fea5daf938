"""The data plane's byte path, one measurement for both of its callers (issue 43).

:func:`measure` times a caller's DRAM put and get and its SSD put and get of the
same blocks, each interleaved with its baseline in the same run (``memcpy`` for
DRAM; ``write`` + ``fsync`` and a warm ``readinto`` for SSD, as ``kvtier bench
tiers``), verifies every byte read back, and reports GB/s and the ratio to each
baseline. A caller is an adapter over one public path:

* :class:`StoreCaller` -- :class:`~kvtier.store.TieredStore` ``put`` / ``get``
  between the caller's buffers and a DRAM-only or SSD-only store (one copy);
* ``WorkerCaller`` in ``bench/connector_path.py`` (needs vLLM) -- the connector's
  worker as vLLM drives it: store jobs gathered from the engine's blocks (straight
  into DRAM slots, or into staging for SSD) and written to the tier, loads
  scattered into other engine blocks (straight from DRAM slots, or read into
  staging from SSD), stepped until reported.

Both move their tier bytes through :mod:`kvtier.transfer.media` on a
:class:`~kvtier.transfer.mover.TransferEngine`; what differs is the caller's end.
Must not assert times (the figures are printed and written, never checked).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Protocol

import torch

from .common import bf16_blocks, gbps, interleaved_best_seconds
from .tiers import BATCH_BLOCKS, in_batches, RoundPutter, make_store, memcpy_baseline, raw_file_baselines


class ByteCaller(Protocol):
    """One caller of the data plane over ``blocks`` (byte tensors of ``block_bytes`` each)."""

    name: str
    blocks: list[torch.Tensor]

    def put(self, tier: str) -> None:
        """Store every block in ``tier`` (``dram`` or ``ssd``), through the caller's public path."""

    def get(self, tier: str) -> None:
        """Read what the last :meth:`put` to ``tier`` stored, verified, into the caller's destination."""

    def read_back(self) -> list[torch.Tensor]:
        """The bytes the last :meth:`get` delivered, block by block (outside the timing)."""

    def close(self) -> None: ...


def measure(caller: ByteCaller, repeats: int, workdir: Path) -> dict:
    """DRAM and SSD put / get of ``caller.blocks`` against their baselines; one row."""
    blocks = caller.blocks
    n, block_bytes = len(blocks), blocks[0].numel()
    outs = [torch.empty(block_bytes, dtype=torch.uint8) for _ in range(n)]
    memcpy = memcpy_baseline(blocks, outs)
    raw_write, raw_read = raw_file_baselines(blocks, outs, workdir / f"raw_{caller.name}_{block_bytes}.bin")
    memcpy()  # fault the baseline's buffers in before anything is timed
    caller.put("dram")
    memcpy_s, dram_put_s, dram_get_s = interleaved_best_seconds(
        [memcpy, lambda: caller.put("dram"), lambda: caller.get("dram")], repeats, shuffle=True)
    verified = all(torch.equal(a, b) for a, b in zip(blocks, caller.read_back()))
    raw_write_s, ssd_put_s, raw_read_s, ssd_get_s = interleaved_best_seconds(
        [raw_write, lambda: caller.put("ssd"), raw_read, lambda: caller.get("ssd")], repeats)
    verified = verified and all(torch.equal(a, b) for a, b in zip(blocks, caller.read_back()))
    nbytes = n * block_bytes
    row = {"caller": caller.name, "block_kib": block_bytes // 1024, "blocks": n, "verified": verified,
           "memcpy_gbps": gbps(nbytes, memcpy_s), "dram_put_gbps": gbps(nbytes, dram_put_s),
           "dram_get_gbps": gbps(nbytes, dram_get_s), "raw_file_write_gbps": gbps(nbytes, raw_write_s),
           "ssd_put_gbps": gbps(nbytes, ssd_put_s), "raw_file_read_gbps": gbps(nbytes, raw_read_s),
           "ssd_get_gbps": gbps(nbytes, ssd_get_s)}
    row["dram_put_vs_memcpy"] = row["dram_put_gbps"] / row["memcpy_gbps"]
    row["dram_get_vs_memcpy"] = row["dram_get_gbps"] / row["memcpy_gbps"]
    row["ssd_put_vs_raw_write"] = row["ssd_put_gbps"] / row["raw_file_write_gbps"]
    row["ssd_get_vs_raw_read"] = row["ssd_get_gbps"] / row["raw_file_read_gbps"]
    return row


COLUMNS = ("caller", "block_kib", "memcpy_gbps", "dram_put_gbps", "dram_put_vs_memcpy", "dram_get_gbps",
           "dram_get_vs_memcpy", "raw_file_write_gbps", "ssd_put_gbps", "ssd_put_vs_raw_write",
           "raw_file_read_gbps", "ssd_get_gbps", "ssd_get_vs_raw_read", "verified")


class StoreCaller:
    """:class:`~kvtier.store.TieredStore` as a :class:`ByteCaller`: a DRAM-only and an SSD-only
    store (``sync``: one fsync'ed transaction per batch), fresh keys each DRAM round."""

    name = "TieredStore"

    def __init__(self, blocks: list[torch.Tensor], repeats: int, workdir: Path) -> None:
        self.blocks = blocks
        n, block_bytes = len(blocks), blocks[0].numel()
        self.outs = [torch.empty(block_bytes, dtype=torch.uint8) for _ in range(n)]
        self.stores = {"dram": make_store(block_bytes, (repeats + 2) * n, "dram"),
                       "ssd": make_store(block_bytes, n, "ssd", tempfile.mkdtemp(prefix="bytepath_ssd_", dir=workdir))}
        self.putters = {tier: RoundPutter(store, blocks, repeats + 2) for tier, store in self.stores.items()}

    def put(self, tier: str) -> None:
        self.putters[tier]()

    def get(self, tier: str) -> None:
        store = self.stores[tier]
        for kb, ob in zip(in_batches(self.putters[tier].keys), in_batches(self.outs)):
            if store.get(kb, ob, promote=False) != len(kb):
                raise RuntimeError(f"TieredStore {tier} get served fewer blocks than were put")

    def read_back(self) -> list[torch.Tensor]:
        return self.outs

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


def blocks_of(n: int, block_bytes: int, seed: int = 0) -> list[torch.Tensor]:
    """About ``n`` bf16-like blocks (a whole number of batches) as rows of one tensor, as an engine's pages are."""
    return bf16_blocks(max(BATCH_BLOCKS, n // BATCH_BLOCKS * BATCH_BLOCKS), block_bytes, seed)
