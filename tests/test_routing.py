"""kvtier.routing: the routing index, fed by real ZMQ publishers in vLLM's wire
format, and its JSON service. (Fed by two real vLLM engines in
tests/engine/test_vllm_remote.py.)"""

from __future__ import annotations

import doctest
import json
import time
import urllib.error
import urllib.request

import pytest

import kvtier.routing
from kvtier.errors import ConfigError
from kvtier.kvevents.wire import KVAllBlocksCleared, KVBlockRemoved, KVBlockStored, KVEventBatch
from kvtier.routing import RoutingIndex, chain_keys

BS = 4


def _stored(hashes, parent, tokens, medium="GPU", locality=None) -> KVBlockStored:
    return KVBlockStored(tuple(hashes), parent, tuple(tokens), BS, None, medium, None, locality=locality)


def _batch(*events) -> KVEventBatch:
    return KVEventBatch(0.0, tuple(events))


def test_doctests() -> None:
    assert doctest.testmod(kvtier.routing).failed == 0


def test_scores_follow_tiers_parents_removals_and_resets() -> None:
    ix = RoutingIndex(["a", "b"], BS)
    toks = list(range(100, 116))  # 4 blocks
    # a: blocks 0-1 in GPU, then block 2 stored later under its parent's engine hash
    ix.apply("a", _batch(_stored([1, 2], None, toks[:8])))
    ix.apply("a", _batch(_stored([3], 2, toks[8:12], medium="CPU")))
    # b: all 4 blocks on its SSD tier
    ix.apply("b", _batch(_stored([91, 92, 93, 94], None, toks, medium="STORAGE")))
    assert ix.scores(toks) == {"a": 2.8, "b": 2.0}
    assert ix.prefix_blocks(toks) == {"a": {"CPU": 0, "GPU": 2}, "b": {"STORAGE": 4}}
    assert ix.choose(toks) == "a"
    # a's GPU prefix cache is reset: block 2 in CPU no longer continues a prefix a holds
    ix.apply("a", _batch(KVAllBlocksCleared()))
    assert ix.scores(toks) == {"a": 0.0, "b": 2.0} and ix.choose(toks) == "b"
    # a removal of one medium keeps the others
    ix.apply("b", _batch(_stored([91], None, toks[:4], medium="CPU"), KVBlockRemoved((91,), "STORAGE")))
    assert ix.scores(toks) == {"a": 0.0, "b": 2.3}  # block 0 now in CPU only, 1-3 still on SSD
    # a block whose parent was never seen cannot be placed: counted, not guessed
    ix.apply("a", _batch(_stored([7], 12345, toks[4:8])))
    assert ix.counters["orphan_blocks"] == 1
    # another block size is not comparable: skipped, counted
    ix.apply("a", _batch(KVBlockStored((8,), None, tuple(range(8)), 8, None, "GPU", None)))
    assert ix.counters["skipped_block_size"] == 1


def test_a_remote_block_counts_for_every_engine() -> None:
    ix = RoutingIndex(["a", "b"], BS)
    toks = list(range(40))
    ix.apply("a", _batch(_stored([1, 2], None, toks[:8])))
    # a wrote blocks 0-2 to the shared store (locality REMOTE): b can load them too
    ix.apply("a", _batch(_stored([1, 2, 3], None, toks[:12], medium="STORAGE", locality="REMOTE")))
    assert ix.scores(toks) == {"a": 2.3, "b": 0.9}
    ix.apply("b", _batch(KVBlockRemoved((3,), "STORAGE", locality="REMOTE")))  # any engine may report it gone
    assert ix.scores(toks) == {"a": 2.0, "b": 0.6}


def test_chain_keys_depend_on_every_earlier_token() -> None:
    a = chain_keys(list(range(12)), BS)
    b = chain_keys([0, 1, 2, 99] + list(range(4, 12)), BS)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))
    assert chain_keys(list(range(3)), BS) == []


def test_bad_settings_name_the_setting() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        RoutingIndex(["a"], 0)
    with pytest.raises(ConfigError, match="engines"):
        RoutingIndex([], 16)
    with pytest.raises(ConfigError, match="weights.GPU"):
        RoutingIndex(["a"], 16, {"GPU": -1})
    with pytest.raises(KeyError, match="unknown engine"):
        RoutingIndex(["a"], 16).apply("z", _batch())


def test_router_over_real_publishers_and_the_json_service() -> None:
    pytest.importorskip("zmq")
    from kvtier.kvevents.publisher import KVEventPublisher
    from kvtier.routing import Router, serve_http

    pubs = {n: KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", block_size=BS) for n in ("a", "b")}
    toks = list(range(200, 224))
    try:
        # published before the router subscribes: it catches up through the replay socket
        pubs["b"].publish(_batch(_stored([5, 6, 7], None, toks[:12])))
        pubs["a"].publish(_batch(_stored([1], None, toks[:4])))
        for p in pubs.values():
            assert p.flush()
        with Router({n: (p.endpoint, p.replay_endpoint) for n, p in pubs.items()}, BS) as router:
            deadline = time.monotonic() + 10
            while router.index.counters["stored_blocks"] < 4 and time.monotonic() < deadline:
                router.poll(0.1)
            assert router.index.choose(toks) == "b"
            router.start(0.02)
            pubs["a"].publish(_batch(_stored([2, 3, 4, 8], 1, toks[4:20], medium="CPU")))
            while router.index.choose(toks) != "a" and time.monotonic() < deadline + 10:
                time.sleep(0.05)
            assert router.index.scores(toks) == {"a": 4.2, "b": 3.0}
            server = serve_http(router, "127.0.0.1", 0)
            try:
                url = f"http://127.0.0.1:{server.server_address[1]}"
                req = urllib.request.Request(url + "/route", json.dumps({"token_ids": toks}).encode(), method="POST")
                reply = json.loads(urllib.request.urlopen(req, timeout=5).read())
                assert reply["engine"] == "a" and reply["prefix_blocks"]["a"] == {"CPU": 0, "GPU": 1}
                stats = json.loads(urllib.request.urlopen(url + "/stats", timeout=5).read())
                assert stats["blocks"] == {"a": 5, "b": 3, "(remote)": 0}
                bad = urllib.request.Request(url + "/route", b'{"tokens": 1}', method="POST")
                with pytest.raises(urllib.error.HTTPError) as err:
                    urllib.request.urlopen(bad, timeout=5)
                assert err.value.code == 400 and "token_ids" in err.value.read().decode()
            finally:
                server.shutdown()
    finally:
        for p in pubs.values():
            p.close()
