"""KV events in vLLM's wire format over real ZMQ on loopback (kvtier.kvevents)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvtier.errors import ProtocolError
from kvtier.events import BlockLoaded, BlockRemoved, BlockStored
from kvtier.keys import BlockKey, Namespace, chain_foreign_keys, key_to_bytes
from kvtier.kvevents import (
    EngineKeyMap,
    HBMView,
    KVAllBlocksCleared,
    KVBlockRemoved,
    KVBlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventSubscriber,
    KVUnknownEvent,
    decode_batch,
    encode_batch,
    to_wire,
)
from kvtier.manager import TierManager, TierSpec

LOOPBACK = "tcp://127.0.0.1:0"
NS = Namespace(model="tiny", dtype="float16", layout="fused", block_size=16)


def k(i: int) -> BlockKey:
    return BlockKey(i)


def drain(sub: KVEventSubscriber, want: int, timeout_s: float = 30.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += sub.poll(0.05)
    return got


def test_import_kvtier_does_not_import_zmq():
    code = "import sys, kvtier, kvtier.kvevents; print(any(m in sys.modules for m in ('zmq', 'msgpack')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False).stdout.strip() == "False"


def test_payload_bytes_match_vllm_msgspec_encoding():
    # What vLLM 0.32's msgspec encoder writes for KVEventBatch(ts=1.5, events=[
    #   BlockStored([b"\x01"*16], None, [], 16, None, "CPU", None), BlockRemoved([5], "GPU"),
    #   AllBlocksCleared()], data_parallel_rank=0): an array [ts, events, rank];
    # events as maps, "type" first, defaulted fields left out.
    expected = (
        b"\x93\xcb?\xf8\x00\x00\x00\x00\x00\x00\x93"
        b"\x88\xa4type\xabBlockStored\xacblock_hashes\x91\xc4\x10" + b"\x01" * 16
        + b"\xb1parent_block_hash\xc0\xa9token_ids\x90\xaablock_size\x10\xa7lora_id\xc0"
        b"\xa6medium\xa3CPU\xa9lora_name\xc0"
        b"\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91\x05\xa6medium\xa3GPU"
        b"\x81\xa4type\xb0AllBlocksCleared"
        b"\x00"
    )
    batch = KVEventBatch(1.5, (KVBlockStored((b"\x01" * 16,), None, (), 16, None, "CPU", None),
                               KVBlockRemoved((5,), "GPU"), KVAllBlocksCleared()), 0)
    assert encode_batch(batch) == expected
    assert decode_batch(expected) == batch


def test_vllm_own_types_decode_our_payload():
    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vllm not importable here")
    import msgspec

    batch = KVEventBatch(2.0, (KVBlockStored((b"a" * 16, b"b" * 16), b"p" * 16, (1, 2), 16, None, "STORAGE", None),
                               KVBlockRemoved((b"a" * 16,), "CPU")), 0)
    decoded = msgspec.msgpack.decode(encode_batch(batch), type=kv_events.KVEventBatch)
    stored, removed = decoded.events
    assert (stored.block_hashes, stored.parent_block_hash, stored.medium) == ([b"a" * 16, b"b" * 16], b"p" * 16,
                                                                              "STORAGE")
    assert (removed.block_hashes, removed.medium) == ([b"a" * 16], "CPU")
    assert encode_batch(decode_batch(msgspec.msgpack.encode(decoded))) == encode_batch(batch)


def test_decode_accepts_array_events_and_keeps_unknown_types():
    import msgpack

    raw = msgpack.packb([3.0, [["BlockRemoved", [7], None], {"type": "BlockMoved", "x": 1}]], use_bin_type=True)
    assert decode_batch(raw) == KVEventBatch(3.0, (KVBlockRemoved((7,), None), KVUnknownEvent("BlockMoved")))
    with pytest.raises(ProtocolError, match="lacks field"):
        decode_batch(msgpack.packb([1.0, [{"type": "BlockRemoved"}]]))
    with pytest.raises(ProtocolError):
        decode_batch(b"\xc1")


def test_tier_events_become_vllm_events_per_chain_and_tier():
    events = [
        BlockStored(k(1), "dram", None), BlockStored(k(2), "dram", k(1)),  # one chain: one event
        BlockStored(k(9), "dram", k(5)),  # another chain
        BlockLoaded(k(1), "dram", True),  # not an engine event
        BlockStored(k(1), "ssd", None),
        BlockRemoved(k(2), "dram", "evicted"), BlockRemoved(k(9), "dram", "evicted"),
    ]
    wire = to_wire(events, block_size=16, token_ids_of=lambda key: [int(key)] * 2)
    b = key_to_bytes
    assert wire == [
        KVBlockStored((b(k(1)), b(k(2))), None, (1, 1, 2, 2), 16, None, "CPU", None),
        KVBlockStored((b(k(9)),), b(k(5)), (9, 9), 16, None, "CPU", None),
        KVBlockStored((b(k(1)),), None, (1, 1), 16, None, "STORAGE", None),
        KVBlockRemoved((b(k(2)), b(k(9))), "CPU"),
    ]
    assert to_wire(events, block_size=16, tiers=("ssd",)) == [KVBlockStored((b(k(1)),), None, (), 16, None,
                                                                             "STORAGE", None)]


def test_publish_subscribe_round_trip(tmp_path):
    # a real TieredStore's events, published and received over TCP loopback
    from kvtier.config import load_config
    from kvtier.store import TieredStore

    store = TieredStore(load_config(env={}, overrides={
        "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_size": 4},
        "tiers": {"hbm": {"enabled": False}, "dram": {"capacity_blocks": 2},
                  "ssd": {"enabled": True, "capacity_blocks": 8, "path": str(tmp_path / "ssd")}},
        "put_tier": "dram", "write_through": True, "kv_events": True}))
    with KVEventPublisher(LOOPBACK, LOOPBACK, block_size=4, topic="kv") as pub, \
            KVEventSubscriber(pub.endpoint, pub.replay_endpoint, topic="kv", start_seq=0) as sub:
        sent: list[KVEventBatch] = []
        for start in (0, 8, 16):  # the third put evicts the first chain from dram (capacity 2)
            keys = store.keys_for(list(range(start, start + 8)))
            store.put(keys, [bytes(store.layout.bytes_per_block)] * 2)
            events = store.take_events()
            assert pub.publish_events(events)
            sent.append(KVEventBatch(0.0, tuple(to_wire(events, block_size=4)), 0))
        assert pub.flush()
        got = drain(sub, 3, timeout_s=60.0)  # a slow joiner is filled from the replay socket
    store.close()
    assert [seq for seq, _ in got] == [0, 1, 2]
    assert [b.events for _, b in got] == [b.events for b in sent]
    mediums = {e.medium for _, b in got for e in b.events}
    assert mediums == {"CPU", "STORAGE"}
    assert any(isinstance(e, KVBlockRemoved) and e.medium == "CPU" for e in got[2][1].events)


def test_gap_is_filled_from_the_replay_socket():
    with KVEventPublisher(LOOPBACK, LOOPBACK, block_size=16) as pub, \
            KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        batches = [KVEventBatch(float(i), (KVBlockRemoved((i,), "GPU"),), 0) for i in range(8)]
        _wait_connected(pub, sub)
        first = sub.expected_seq
        live_send = pub._send_live
        pub._send_live = lambda seq, payload: None if 2 <= seq - first <= 4 else live_send(seq, payload)
        for b in batches:
            pub.publish(b)
        assert pub.flush()
        got = drain(sub, 8)
        # batches 2..4 never reached the SUB socket; they came from the replay buffer
        assert [seq - first for seq, _ in got] == list(range(8))
        assert [b for _, b in got] == batches
        assert (sub.stats["gaps"], sub.stats["replayed"], sub.stats["lost_batches"]) == (1, 3, 0)


def test_gap_beyond_the_replay_buffer_is_counted_as_lost():
    with KVEventPublisher(LOOPBACK, LOOPBACK, block_size=16, buffer_steps=2) as pub, \
            KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        _wait_connected(pub, sub)
        first = sub.expected_seq
        live_send = pub._send_live
        pub._send_live = lambda seq, payload: None if 1 <= seq - first <= 4 else live_send(seq, payload)
        for i in range(6):
            pub.publish(KVEventBatch(float(i), (KVBlockRemoved((i,), "GPU"),), 0))
        assert pub.flush()
        got = drain(sub, 3, timeout_s=3.0)
        # the buffer keeps only seq 4 and 5: 1..3 are gone for good
        assert [seq - first for seq, _ in got] == [0, 4, 5]
        assert sub.stats["lost_batches"] == 3


def _wait_connected(pub: KVEventPublisher, sub: KVEventSubscriber) -> None:
    """PUB drops messages until the subscription arrives: send probes until one is seen."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        pub.publish(KVEventBatch(0.0, (), 0))
        assert pub.flush()
        if sub.poll(0.05):
            sub.poll(0.2)  # swallow probes still in flight
            return
    raise AssertionError("subscriber never connected")


def test_manager_hbm_view_follows_an_engine_stream():
    # An engine (here: this test's publisher) stores two chains in HBM, evicts
    # one block, and later clears everything; the manager's hbm tier matches.
    manager = TierManager([TierSpec("hbm", 64), TierSpec("dram", 64)])
    view = HBMView(manager, EngineKeyMap(NS))
    h = [bytes([i]) * 32 for i in range(6)]  # engine block hashes (sha256 bytes)
    stream = [
        KVEventBatch(1.0, (KVBlockStored((h[0], h[1], h[2]), None, (), 16, None, "GPU", None),)),
        KVEventBatch(2.0, (KVBlockStored((h[3],), h[1], (), 16, None, "GPU", None),   # branch after h1
                           KVBlockStored((h[4],), b"?" * 32, (), 16, None, "GPU", None),  # unknown parent
                           KVBlockStored((h[5],), None, (), 16, None, "CPU", None))),  # not device memory
        KVEventBatch(3.0, (KVBlockRemoved((h[2],), "GPU"),)),
    ]
    with KVEventPublisher(LOOPBACK, LOOPBACK, block_size=16) as pub, \
            KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        _wait_connected(pub, sub)
        for b in stream:
            pub.publish(b)
        assert pub.flush()
        for _, batch in drain(sub, len(stream)):
            view.apply(batch)
    # the same keys the vLLM connector computes from request.block_hashes
    chain = chain_foreign_keys(NS, [h[0], h[1], h[2]])
    branch = chain_foreign_keys(NS, [h[3]], chain[1])
    assert manager.present([*chain, *branch], "hbm") == [chain[0], chain[1], branch[0]]
    assert manager.parent_of(branch[0]) == chain[1]
    assert manager.ready_blocks("hbm") == 3 and manager.ready_blocks("dram") == 0
    assert (view.stats["orphan_blocks"], view.stats["ignored_events"]) == (1, 1)
    manager.check_invariants()
    view.apply(KVEventBatch(4.0, (KVAllBlocksCleared(),)))
    assert manager.ready_blocks("hbm") == 0 and len(view.key_map) == 0
    manager.check_invariants()


def test_publisher_rejects_use_after_close():
    pub = KVEventPublisher(LOOPBACK, block_size=16)
    pub.close()
    pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(KVEventBatch(0.0, ()))
