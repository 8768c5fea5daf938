"""Child process of ``test_fault_storage``: a TieredStore (DRAM + synced SSD) that
puts chains into DRAM, demotes each to SSD (a dram->ssd move through the
mover) and prefetches an older chain back (an ssd->dram move), until killed.

Usage: ``python store_crash_child.py DIR FIRST_CHAIN CODEC``. Prints ``R``
once the store is open (after re-indexing DIR), then ``D chain moved`` after
each demote returned (acknowledged: synced to disk), and ``DONE`` after
:data:`MAX_CHAINS` chains, then waits to be killed.
"""

from __future__ import annotations

import sys
import time

from fault_support import blocks_for, chain_tokens, make_store

BLOCKS_PER_CHAIN = 8
MAX_CHAINS = 150
SSD_CAPACITY_BLOCKS = 16384


def main(path: str, first: int, codec: str) -> None:
    store = make_store(path, dram=128, ssd=SSD_CAPACITY_BLOCKS, codec=codec)
    print("R", store.counters["ssd_reindexed_blocks"], flush=True)
    for chain in range(first, first + MAX_CHAINS):
        keys = store.keys_for(chain_tokens(chain, BLOCKS_PER_CHAIN))
        if store.put(keys, blocks_for(keys)) != len(keys):
            raise SystemExit(f"put of chain {chain} failed: {store.stats()}")
        moved = store.demote(keys, "dram", "ssd", reason="test")
        print("D", chain, moved, flush=True)
        if chain - first >= 2:
            store.prefetch(store.keys_for(chain_tokens(chain - 2, BLOCKS_PER_CHAIN)), "dram")
    print("DONE", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
